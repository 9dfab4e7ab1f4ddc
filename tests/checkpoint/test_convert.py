"""HF interoperability end to end: `titan convert hf-to-dcp | dcp-to-hf` and `checkpoint.init_from_hf`.

A tiny random `transformers.LlamaForCausalLM` (GQA, Llama 3.1 RoPE scaling, untied and tied; see test_hf.py)
is saved with `save_pretrained` and brought into titan's Trainer through each route; a model trained in titan
is exported and read back by `from_pretrained`. Logits are compared in fp32 with test_hf's tolerance.
"""

from __future__ import annotations

import itertools
import json
import logging
import re
import tomllib

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

transformers = pytest.importorskip("transformers")

from conftest import DEBUG_RECIPE, run_titan, tiny_overrides  # noqa: E402
from distributed import run_distributed  # noqa: E402
from helpers import (  # noqa: E402
    SMALL,
    TOL,
    assert_one_line_error,
    full_weights,
    hf_logits,
    max_diff,
    randomize_,
    read_checkpoint,
    tiny_hf_config,
)
from titan import models  # noqa: E402
from titan.checkpoint import hf as hf_io  # noqa: E402
from titan.checkpoint.format import CheckpointWriter, seal  # noqa: E402
from titan.checkpoint.hf import match as hf_match  # noqa: E402
from titan.checkpoint.hf.memory import release_freed_memory  # noqa: E402
from titan.checkpoint.train_state import model_shapes, write_train_state  # noqa: E402
from titan.config import Config, Model, load_config, to_toml  # noqa: E402
from titan.data.tokenizer import Tokenizer  # noqa: E402
from titan.errors import ConfigError  # noqa: E402
from titan.models.llama.hf import from_hf_state_dict  # noqa: E402
from titan.rng.shards import ShardIndex, full_tensor, global_indices  # noqa: E402
from titan.train.trainer import Trainer  # noqa: E402

VOCAB = 1280  # covers the project tokenizer's 1170 tokens (the Trainer checks), and splits in two for TP
BATCH, SEQ = 2, 24


@pytest.fixture(scope="module", params=[False, True], ids=["untied", "tied"])
def hf_dir(request, tmp_path_factory):
    tied = request.param
    config = tiny_hf_config(tied)
    config.vocab_size = VOCAB
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).float().eval()
    randomize_(model, seed=1)
    path = tmp_path_factory.mktemp("hf_tied" if tied else "hf_untied")
    # Both layouts HF writes: one model.safetensors (untied), and shards with an index (tied).
    model.save_pretrained(path, max_shard_size="200KB" if tied else "50GB")
    assert (path / "model.safetensors.index.json").exists() == tied
    return path


@pytest.fixture(scope="module")
def tokens():
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(2))


@pytest.fixture(scope="module")
def hf_reference(hf_dir, tokens):
    logits = hf_logits(hf_dir, tokens)
    assert logits.abs().max() > 1  # the comparisons are not between near-zero numbers
    return logits


def recipe_from_output(stdout: str) -> dict[str, str]:
    """The [model] table that hf-to-dcp prints, as command-line overrides."""
    block = stdout[stdout.index("[model]") :].split("\n\n")[0]
    model = tomllib.loads(block)["model"]
    overrides = {"model.name": model["name"], "model.flavor": model["flavor"]}
    for key, value in model.get("overrides", {}).items():
        overrides[f"model.overrides.{key}"] = str(value).lower() if isinstance(value, bool) else repr(value)
    return overrides


@pytest.fixture(scope="module")
def converted(hf_dir, tmp_path_factory):
    """hf-to-dcp through the CLI: (checkpoint folder, the model overrides it printed)."""
    out = tmp_path_factory.mktemp("converted") / "dcp"
    result = run_titan("convert", "hf-to-dcp", str(hf_dir), str(out))
    assert result.returncode == 0, result.stderr
    assert "closest is 'debug'" in result.stdout and 'load_only = ["model"]' in result.stdout
    return out, recipe_from_output(result.stdout)


def make_trainer(root, model_overrides: dict, **extra) -> Trainer:
    return Trainer(load_config(DEBUG_RECIPE, tiny_overrides(root, **model_overrides, **extra)))


def logits_of(trainer: Trainer, tokens: torch.Tensor) -> torch.Tensor:
    model = trainer.model_parts.parts[0]
    model.eval()
    with torch.no_grad():
        out = model(tokens)
    return full_tensor(out)


def full_load(hf_dir) -> dict[str, torch.Tensor]:
    """The reference for every import: the whole HF files read by safetensors, mapped by from_hf_state_dict."""
    config, weights = read_checkpoint(hf_dir)
    return from_hf_state_dict(weights, models.get_model_spec("llama3").hf.args_from_config(config))


def assert_equal_weights(weights: dict[str, torch.Tensor], reference: dict[str, torch.Tensor]) -> None:
    assert weights and all(torch.equal(w, reference[name]) for name, w in weights.items())


# -- HF -> titan -------------------------------------------------------------------------------------------------


def test_hf_to_dcp_resumes_with_the_hf_logits(converted, hf_reference, tokens, tmp_path):
    out, overrides = converted
    state = json.loads((out / "train_state.json").read_text())
    assert (out / "COMPLETE").is_file() and state["step"] == 0 and state["model"]["name"] == "llama3"
    trainer = make_trainer(tmp_path, overrides, **{"checkpoint.resume": str(out), "checkpoint.load_only": '["model"]'})
    assert trainer.step == 0
    assert max_diff(logits_of(trainer, tokens), hf_reference) < TOL


def test_init_from_hf_gives_the_hf_logits_and_the_converted_weights(converted, hf_dir, hf_reference, tokens, tmp_path):
    out, overrides = converted
    from_hf = make_trainer(tmp_path / "a", overrides, **{"checkpoint.init_from_hf": str(hf_dir)})
    assert from_hf.step == 0
    assert max_diff(logits_of(from_hf, tokens), hf_reference) < TOL
    resumed = make_trainer(
        tmp_path / "b", overrides, **{"checkpoint.resume": str(out), "checkpoint.load_only": '["model"]'}
    )
    mine, theirs = full_weights(from_hf), full_weights(resumed)
    assert mine.keys() == theirs.keys() and all(torch.equal(mine[k], theirs[k]) for k in mine)


def test_init_from_hf_is_sensitive_to_the_qk_permutation(
    converted, hf_dir, hf_reference, tokens, tmp_path, monkeypatch
):
    """The logit comparison can fail: an import without the RoPE layout change is far off."""
    from titan.models.llama import hf

    original = hf.hf_sources
    monkeypatch.setattr(hf, "hf_sources", lambda args: original(args, permute_qk=False))
    assert models.get_model_spec("llama3").hf.sources is not original
    trainer = make_trainer(tmp_path, converted[1], **{"checkpoint.init_from_hf": str(hf_dir)})
    assert max_diff(logits_of(trainer, tokens), hf_reference) > 1000 * TOL


def test_init_from_hf_is_skipped_when_the_run_resumes(converted, hf_dir, tmp_path):
    _, overrides = converted
    extra = {"checkpoint.init_from_hf": str(hf_dir), "training.steps": "1", "training.seq_len": "32"}
    first = make_trainer(tmp_path, overrides, **extra)
    first.train()
    again = make_trainer(tmp_path, overrides, **extra)
    assert again.step == 1
    mine, theirs = full_weights(first), full_weights(again)
    assert all(torch.equal(mine[k], theirs[k]) for k in mine)  # the trained weights, not the HF ones


def _distributed_logits(root, overrides, layout, tokens):
    trainer = make_trainer(root, overrides, **layout)
    placements = {str(p.placements) for _, p in trainer.model_parts.named_parameters() if isinstance(p, DTensor)}
    return logits_of(trainer, tokens), placements, full_weights(trainer)


@pytest.mark.distributed
def test_init_from_hf_on_two_ranks_matches_one_process(converted, hf_dir, hf_reference, tokens, tmp_path):
    """Untied under TP2 (q/k rows split by head across ranks), tied under FSDP2: each rank reads its shards'
    slices, and the parameters are bitwise those of the full load."""
    tied = json.loads((hf_dir / "config.json").read_text())["tie_word_embeddings"]
    layout = (
        {"parallel.dp_shard": "2", "training.local_batch_size": "2"}
        if tied
        else {"parallel.tp": "2", "parallel.dp_shard": "1"}
    )
    _, overrides = converted
    reference = full_load(hf_dir)
    one = make_trainer(tmp_path / "one", overrides, **{"checkpoint.init_from_hf": str(hf_dir)})
    assert_equal_weights(full_weights(one), reference)
    single = logits_of(one, tokens)
    results = run_distributed(
        _distributed_logits, 2, tmp_path / "two", overrides, {"checkpoint.init_from_hf": str(hf_dir), **layout}, tokens
    )
    for logits, placements, weights in results:
        assert any("Shard(dim=0)" in p for p in placements)  # really sharded
        assert_equal_weights(weights, reference)
        torch.testing.assert_close(logits, single, rtol=TOL, atol=TOL)  # only the order of fp32 sums differs
        assert max_diff(logits, hf_reference) < TOL


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("hf_dir", [False], ids=["untied"], indirect=True)
def test_init_from_hf_under_fsdp2_x_tp2_is_the_full_load(converted, hf_dir, tokens, tmp_path):
    """Four ranks: FSDP over TP shards q/k rows in strided pieces (_StridedShard), the general case."""
    layout = {"parallel.dp_shard": "2", "parallel.tp": "2", "training.local_batch_size": "2"}
    results = run_distributed(
        _distributed_logits, 4, tmp_path, converted[1], {"checkpoint.init_from_hf": str(hf_dir), **layout}, tokens
    )
    reference = full_load(hf_dir)
    for _, placements, weights in results:
        assert any("_StridedShard" in p for p in placements)
        assert_equal_weights(weights, reference)


def _layouts(ndim: int) -> dict[str, tuple[tuple[int, ...], list]]:
    """name -> (mesh shape, placements): how titan's parallelisms lay out a parameter of `ndim` dims."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    layouts = {
        "FSDP2": ((2,), [Shard(0)]),
        "3 ranks: uneven, across heads": ((3,), [Shard(0)]),
        "FSDP2 x TP2 colwise": ((2, 2), [_StridedShard(0, split_factor=2), Shard(0)]),
        "HSDP2 x FSDP2": ((2, 2), [Replicate(), Shard(0)]),
    }
    if ndim == 2:
        layouts["TP2 rowwise"] = ((2,), [Shard(1)])
        layouts["FSDP2 x TP2 rowwise"] = ((2, 2), [Shard(0), Shard(1)])
    return layouts


@pytest.mark.parametrize("hf_dir", [False], ids=["untied"], indirect=True)
def test_every_shard_layout_reads_what_the_full_load_holds_there(hf_dir):
    """read_part for every rank of each layout, given the per-dim indices a DTensor shard holds (as init_from_hf
    computes them), against the full load at the flat global indices of titan.rng.shards (which
    test_rng checks against DTensor itself)."""
    hf = hf_io.open_hf(hf_dir, models.get_model_spec("llama3"))
    for name, full in full_load(hf_dir).items():
        for layout, (mesh, placements) in _layouts(full.ndim).items():
            for coord in itertools.product(*map(range, mesh)):
                shard = ShardIndex(full.shape, mesh, coord, placements)
                index = [torch.arange(n) if v is None else v for n, v in zip(full.shape, shard.vecs)]
                values, read = hf_io.read_part(hf, name, index)
                expected = full.reshape(-1)[global_indices(full.shape, mesh, coord, placements)]
                assert torch.equal(values, expected), (name, layout, coord)
                if layout in ("FSDP2", "TP2 rowwise"):  # whole heads: the slice read is the shard, no more
                    assert read == expected.numel() * expected.element_size(), (name, layout, coord)


def test_hf_to_dcp_to_hf_round_trip_is_exact(converted, hf_dir, tmp_path):
    out, _ = converted
    hf_io.dcp_to_hf(out, tmp_path / "back")
    config, weights = read_checkpoint(hf_dir)
    config_back, back = read_checkpoint(tmp_path / "back")
    assert back.keys() == weights.keys() and all(torch.equal(back[k], weights[k]) for k in weights)
    for key in (
        "hidden_size",
        "intermediate_size",
        "num_key_value_heads",
        "vocab_size",
        "max_position_embeddings",
        "tie_word_embeddings",
        "rope_parameters",
        "rms_norm_eps",
    ):
        assert config_back[key] == config[key], key


def test_dcp_to_hf_takes_titans_dtype_names(converted, tmp_path):
    out, _ = converted
    hf_io.dcp_to_hf(out, tmp_path / "bf16", dtype="bf16")
    config, weights = read_checkpoint(tmp_path / "bf16")
    assert config["torch_dtype"] == "bfloat16" and {w.dtype for w in weights.values()} == {torch.bfloat16}


# -- titan -> HF -------------------------------------------------------------------------------------------------

# Few steps at a high learning rate move the weights far from their init; no dropout.
EXPORT_RUN = {
    **SMALL,
    "training.steps": "3",
    "lr_scheduler.warmup_steps": "0",
    "optimizer.lr": "3e-2",
    "model.overrides.resid_dropout": "0.0",
}


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_trained_checkpoint_exports_to_hf_with_the_same_logits(tmp_path, tied):
    trainer = make_trainer(tmp_path, EXPORT_RUN, **{"model.overrides.tie_embeddings": str(tied).lower()})
    trainer.train()
    tokens = torch.randint(0, 2048, (BATCH, SEQ), generator=torch.Generator().manual_seed(3))
    ours = logits_of(trainer, tokens)
    out, limit = tmp_path / "hf", 100_000
    result = run_titan(
        "convert", "dcp-to-hf", str(tmp_path / "debug" / "checkpoints"), str(out), "--max-shard-size", "100KB"
    )
    assert result.returncode == 0, result.stderr
    assert "step-3" in result.stdout

    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(out.glob("model-*.safetensors"))
    assert len(shards) >= 3 and sorted(set(index["weight_map"].values())) == [s.name for s in shards]
    assert ("lm_head.weight" in index["weight_map"]) != tied
    for shard in shards:  # no shard over the limit, unless it holds one tensor that alone exceeds it
        assert shard.stat().st_size <= limit + 4096 or sum(v == shard.name for v in index["weight_map"].values()) == 1

    model, info = transformers.LlamaForCausalLM.from_pretrained(
        out, local_files_only=True, dtype=torch.float32, attn_implementation="eager", output_loading_info=True
    )
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == tied
    with torch.no_grad():
        theirs = model.eval()(tokens).logits
    assert theirs.abs().max() > 1
    assert max_diff(ours, theirs) < TOL  # measured: 1.3e-2 if the export skips the q/k permutation
    sizes = {name: p.numel() * p.element_size() for name, p in model.state_dict().items()}
    assert index["metadata"]["total_size"] == sum(sizes[name] for name in index["weight_map"])
    assert index["metadata"]["total_parameters"] == sum(p.numel() for p in model.parameters())


PROMPT = "The dog ran"


def test_exported_folder_loads_with_auto_classes_and_continues_as_titan_generate(tmp_path):
    """`titan convert dcp-to-hf` writes the tokenizer and generation config: transformers' AutoTokenizer encodes
    a text as titan frames a prompt (BOS + text), and AutoModelForCausalLM's greedy generate continues it with
    the text `titan generate` prints."""
    run = {"training.steps": "5", "lr_scheduler.warmup_steps": "0", "optimizer.lr": "1e-2"}
    make_trainer(tmp_path, {**SMALL, **run, "checkpoint.enable": "true"}).train()
    out = tmp_path / "hf"
    result = run_titan("convert", "dcp-to-hf", str(tmp_path / "debug"), str(out))
    assert result.returncode == 0, result.stderr
    assert {"config.json", "model.safetensors", *hf_io.TOKENIZER_FILES} <= {p.name for p in out.iterdir()}
    assert "the tokenizer files" in result.stdout

    tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    ours = Tokenizer(load_config(DEBUG_RECIPE, tiny_overrides(tmp_path)).tokenizer)
    for text in (PROMPT, "  two spaces, then\nlines", "é ü 🙂"):
        ids = tokenizer(text)["input_ids"]
        assert ids == ours.encode(text)[:-1] and ids[0] == ours.bos_id
        assert tokenizer.decode(ids[1:]) == ours.decode(ids[1:]) == text

    generated = run_titan("generate", "--checkpoint", str(tmp_path / "debug"), "--prompt", PROMPT, "--max-new-tokens",
                          "24")  # fmt: skip
    assert generated.returncode == 0, generated.stderr
    model = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    inputs = tokenizer(PROMPT, return_tensors="pt")
    with torch.no_grad():
        sequence = model.generate(**inputs, max_new_tokens=24, do_sample=False)[0, inputs["input_ids"].shape[1] :]
    assert len(set(sequence.tolist())) > 3  # a continuation, not one token repeated
    assert generated.stdout == tokenizer.decode(sequence, skip_special_tokens=True) + "\n"


# -- errors ------------------------------------------------------------------------------------------------------


def test_hf_to_dcp_of_a_missing_folder_is_a_clear_error(tmp_path):
    assert_one_line_error(
        run_titan("convert", "hf-to-dcp", str(tmp_path / "nope"), str(tmp_path / "out")), "does not exist"
    )
    assert not (tmp_path / "out").exists()


def test_hf_to_dcp_of_a_folder_without_config_is_a_clear_error(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"")
    assert_one_line_error(run_titan("convert", "hf-to-dcp", str(tmp_path), str(tmp_path / "out")), "no config.json")


def test_dcp_to_hf_of_a_folder_that_is_no_checkpoint_is_a_clear_error(tmp_path):
    assert_one_line_error(
        run_titan("convert", "dcp-to-hf", str(tmp_path), str(tmp_path / "out")), "not a complete titan checkpoint"
    )


@pytest.mark.parametrize("hf_dir", [False], ids=["untied"], indirect=True)  # one run of the CLI is enough
def test_init_from_hf_with_other_model_args_is_a_clear_error(hf_dir, tmp_path):
    """The debug flavor as it is: every shape differs; the message names the first and says what to set."""
    result = run_titan(
        "train", "--config", str(DEBUG_RECIPE), *tiny_overrides(tmp_path, **{"checkpoint.init_from_hf": str(hf_dir)})
    )
    assert_one_line_error(
        result,
        "checkpoint.init_from_hf",
        "tok_embeddings.weight",
        "[1280, 64]",
        "[2048, 256]",
        'model.flavor = "debug"',
        "dim = 64",
    )


def test_init_from_hf_with_other_rope_settings_is_a_clear_error(converted, hf_dir, tmp_path):
    """Equal shapes, another network: RoPE theta differs."""
    _, overrides = converted
    with pytest.raises(ConfigError, match=r"rope_theta is 10000.0 there but 500000.0 here"):
        make_trainer(
            tmp_path,
            {**overrides, "model.overrides.rope_theta": "500000.0"},
            **{"checkpoint.init_from_hf": str(hf_dir)},
        )


def test_only_safetensors_are_read_and_outputs_are_not_overwritten(hf_dir, tmp_path):
    pickled = tmp_path / "pickled"
    pickled.mkdir()
    (pickled / "config.json").write_text((hf_dir / "config.json").read_text())
    (pickled / "pytorch_model.bin").write_bytes(b"not unpickled")
    with pytest.raises(ConfigError, match="pytorch_model.bin: pickle files, which titan does not read"):
        hf_io.hf_to_dcp(pickled, tmp_path / "out")
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("")
    with pytest.raises(ConfigError, match="already exists and is not empty"):
        hf_io.hf_to_dcp(hf_dir, tmp_path / "full")


def test_flavor_matching_and_sizes():
    spec = models.get_model_spec("llama3")
    for name in ("debug", "1B", "8B"):  # a published size converts to exactly its flavor
        args = spec.hf.args_from_config(spec.hf.config_from_args(spec.flavors[name]))
        assert hf_match.recipe_model(spec, args) == (name, {})
    assert hf_io.parse_size("2GB") == 2 * 10**9 and hf_io.parse_size("1GiB") == 2**30 and hf_io.parse_size("100") == 100
    with pytest.raises(ConfigError, match="max-shard-size"):
        hf_io.parse_size("2 potatoes")


def test_init_from_hf_fills_a_plain_model_without_a_trainer(hf_dir, tokens, hf_reference, caplog):
    """init_from_hf needs only the parameters, the model's args and the folder; it logs what it read."""
    from titan.models.llama import Transformer

    spec = models.get_model_spec("llama3")
    args = spec.hf.args_from_config(json.loads((hf_dir / "config.json").read_text()))
    torch.manual_seed(0)
    model = Transformer(args).eval()  # random weights, every one of which the import must replace
    with caplog.at_level(logging.INFO, logger="titan"):
        hf_io.init_from_hf(model.named_parameters(), spec, args, hf_dir, "llama3 (from the HF config)")
    with torch.no_grad():
        assert max_diff(model(tokens), hf_reference) < TOL
    model_mib = sum(p.numel() * 4 for p in model.parameters()) / 2**20  # one process reads every tensor once
    assert f"{model_mib:.1f} MiB read from the files, peak host memory added" in caplog.text


@pytest.mark.parametrize("hf_dir", [True], ids=["tied"], indirect=True)
def test_a_tied_head_in_the_files_must_be_the_embedding(hf_dir, tmp_path):
    from safetensors.torch import save_file

    from titan.models.llama import Transformer

    spec = models.get_model_spec("llama3")
    config, weights = read_checkpoint(hf_dir)
    args = spec.hf.args_from_config(config)
    embed = weights["model.embed_tokens.weight"]
    for head in ("copy", "other"):
        folder = tmp_path / head
        folder.mkdir()
        (folder / "config.json").write_text(json.dumps(config))
        lm_head = embed.clone() if head == "copy" else embed + 1
        save_file({**weights, "lm_head.weight": lm_head}, str(folder / "model.safetensors"))
    model = Transformer(args)
    hf_io.init_from_hf(model.named_parameters(), spec, args, tmp_path / "copy", "llama3")
    assert torch.equal(model.output.weight, embed)
    with pytest.raises(ConfigError, match="lm_head.weight differs from model.embed_tokens.weight"):
        hf_io.init_from_hf(model.named_parameters(), spec, args, tmp_path / "other", "llama3")


def test_weights_of_other_shapes_than_the_config_says_are_a_clear_error(hf_dir, tmp_path):
    from safetensors.torch import save_file

    config, weights = read_checkpoint(hf_dir)
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text(json.dumps(config))
    weights["model.norm.weight"] = weights["model.norm.weight"][:-1]
    save_file(weights, str(tmp_path / "hf" / "model.safetensors"))
    with pytest.raises(ConfigError, match=r"model.norm.weight has shape \[63\], but the config makes it \[64\]"):
        hf_io.hf_to_dcp(tmp_path / "hf", tmp_path / "out")


# -- memory: per-rank import and streaming export ---------------------------------------------------------------

# 57M parameters, 216 MiB in fp32: large enough that the figures are mostly tensors. The export's peak is still
# mostly fixed costs at this size: the 25 MB output layer with DCP's read buffer, freed memory glibc keeps in its
# heap (tensors under 32 MB are not handed back), and code pages first used in the forked process.
BIG_HF_CONFIG = {
    "hidden_size": 768,
    "num_hidden_layers": 7,
    "num_attention_heads": 12,
    "num_key_value_heads": 4,
    "intermediate_size": 2048,
    "vocab_size": 8192,
    "max_position_embeddings": 256,
}


def _write_big_hf_folder(folder) -> int:
    """Random weights written with safetensors, as an HF folder; returns their bytes."""
    from safetensors.torch import save_file

    spec = models.get_model_spec("llama3")
    args = spec.hf.args_from_config(BIG_HF_CONFIG)
    sources, gen = spec.hf.sources(args), torch.Generator().manual_seed(0)
    weights = {sources[n][0]: torch.randn(s, generator=gen) for n, s in model_shapes(spec, args).items()}
    folder.mkdir()
    save_file(weights, str(folder / "model.safetensors"), metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps(spec.hf.config_from_args(args)))
    return sum(w.numel() * w.element_size() for w in weights.values())


def _peak_of_full_read(folder) -> int | None:
    """The reference: every tensor of the files in memory at once, as the import used to hold them on every rank
    (a lower bound of that import's peak, which also held permuted q/k copies and index tensors)."""
    release_freed_memory()
    with hf_io.PeakMemory() as peak:
        _, weights = read_checkpoint(folder)
        for w in weights.values():
            w.sum()  # safetensors maps the file: touch every page, as reading every element does
    return peak.added


def _save_sharded_checkpoint(model, spec, args, folder) -> None:
    """The model as a titan checkpoint holding only the model, one DCP file per rank."""
    import torch.distributed.checkpoint as dcp

    dcp.save({"model": dict(model.named_parameters())}, storage_writer=CheckpointWriter(folder))
    if dist.get_rank() == 0:
        flavor, overrides = hf_match.recipe_model(spec, args)
        recipe = to_toml(Config(model=Model(name=spec.name, flavor=flavor, overrides=overrides)))
        shapes = model_shapes(spec, args)
        model = {"name": spec.name, "flavor": flavor, "shapes": shapes}
        write_train_state(folder, step=0, tokens_seen=0, lr_scheduler={}, recipe=recipe, model=model, parts=["model"])
        seal(folder)
    dist.barrier()


def _peak_of_sharded_import(folder, checkpoint) -> int | None:
    """init_from_hf's peak on this rank of an FSDP2 model (sharded as the trainer shards it); then the model is
    saved as a sharded checkpoint for the export."""
    from torch.distributed.device_mesh import init_device_mesh

    from titan.parallel.fsdp import apply_fsdp

    spec = models.get_model_spec("llama3")
    args = spec.hf.args_from_config(BIG_HF_CONFIG)
    with torch.device("meta"):
        model = spec.build(args)
    apply_fsdp(model, spec.blocks(model), init_device_mesh("cpu", (dist.get_world_size(),)), None, True, False)
    model.to_empty(device="cpu")
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()  # resident before the import, as the trainer's initialised parameters are
    release_freed_memory()
    with hf_io.PeakMemory() as peak:
        hf_io.init_from_hf(model.named_parameters(), spec, args, folder, "llama3 (test)")
    _save_sharded_checkpoint(model, spec, args, checkpoint)
    return peak.added


def _peak_of_export(checkpoint, out) -> tuple[int | None, str]:
    """`titan convert dcp-to-hf` as a user runs it, in a fresh process: a process forked from a test worker would
    inherit the allocator state of whatever that worker ran before, which the peak then measures too."""
    result = run_titan("convert", "dcp-to-hf", str(checkpoint), str(out), "--max-shard-size", "10MB", fresh=True)
    assert result.returncode == 0, result.stderr
    peak = re.search(r"peak host memory added: ([\d.]+) MiB", result.stdout)
    return (float(peak.group(1)) * 2**20 if peak else None), result.stdout


@pytest.mark.distributed
@pytest.mark.slow
def test_import_per_rank_and_streaming_export_hold_a_fraction_of_the_model(tmp_path):
    """Peak host memory each step adds: reading the full weights (the reference) and the per-rank import on 2 FSDP2
    ranks, measured in forked processes, and `titan convert dcp-to-hf` of the checkpoint those ranks save, in a
    fresh one. The export is then
    compared with the HF folder: HF -> sharded import -> sharded checkpoint -> HF is exact."""
    hf_dir, checkpoint, out = tmp_path / "hf", tmp_path / "checkpoint", tmp_path / "out"
    [model_bytes] = run_distributed(_write_big_hf_folder, 1, hf_dir)
    [full] = run_distributed(_peak_of_full_read, 1, hf_dir)
    if full is None:
        pytest.skip("measuring peak memory needs Linux's /proc")
    per_rank = run_distributed(_peak_of_sharded_import, 2, hf_dir, checkpoint)
    export, report = _peak_of_export(checkpoint, out)
    mib = lambda n: f"{n / 2**20:.0f} MiB"  # noqa: E731
    print(
        f"\nmodel {mib(model_bytes)} (fp32); peak host memory added: reading the full weights {mib(full)}, "
        f"per-rank import on 2 FSDP2 ranks {' and '.join(map(mib, per_rank))}, export (10MB files) {mib(export)}"
    )
    assert full > 0.9 * model_bytes  # the reference really holds the model
    assert all(peak <= 0.5 * full for peak in per_rank)
    # Measured: 84 MiB every time, 42 of them before the first file and twice the largest tensor (24 MiB, the
    # embedding: its zeroed target and the chunks read into it). Before the export handed each file's freed pages
    # back, glibc kept them and the peak wandered from 85 to 110 MiB across runs, past this bound.
    assert export < 0.5 * model_bytes and "peak host memory added" in report
    (_, original), (_, back) = read_checkpoint(hf_dir), read_checkpoint(out)
    assert len(list(out.glob("model-*.safetensors"))) > 5
    assert back.keys() == original.keys() and all(torch.equal(back[k], original[k]) for k in original)
