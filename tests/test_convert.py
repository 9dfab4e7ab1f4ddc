"""HF interoperability end to end: `titan convert hf-to-dcp | dcp-to-hf` and `checkpoint.init_from_hf`.

A tiny random `transformers.LlamaForCausalLM` (GQA, Llama 3.1 RoPE scaling, untied and tied; see test_hf.py)
is saved with `save_pretrained` and brought into titan's Trainer through each route; a model trained in titan
is exported and read back by `from_pretrained`. Logits are compared in fp32 with test_hf's tolerance.
"""

from __future__ import annotations

import json
import tomllib

import pytest
import torch
from torch.distributed.tensor import DTensor

transformers = pytest.importorskip("transformers")

from conftest import DEBUG_RECIPE, run_titan, tiny_overrides  # noqa: E402
from distributed import run_distributed  # noqa: E402
from helpers import (  # noqa: E402
    SMALL,
    TOL,
    assert_one_line_error,
    hf_logits,
    max_diff,
    randomize_,
    read_checkpoint,
    tiny_hf_config,
)
from titan import (  # noqa: E402
    hf_io,
    hf_match,
    models,  # noqa: E402
)
from titan.config import ConfigError, load_config  # noqa: E402
from titan.trainer import Trainer  # noqa: E402

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
    return out.full_tensor() if isinstance(out, DTensor) else out


def full_weights(trainer: Trainer) -> dict[str, torch.Tensor]:
    return {
        n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
        for n, p in trainer.model_parts.named_parameters()
    }


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

    original = hf.from_hf_state_dict
    monkeypatch.setattr(hf, "from_hf_state_dict", lambda sd, args: original(sd, args, permute_qk=False))
    assert models.get_model_spec("llama3").hf.from_state_dict is not original
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
    return logits_of(trainer, tokens), placements


@pytest.mark.distributed
def test_init_from_hf_on_two_ranks_matches_one_process(converted, hf_dir, hf_reference, tokens, tmp_path):
    """Untied under TP2 (q/k rows split by head across ranks), tied under FSDP2."""
    tied = json.loads((hf_dir / "config.json").read_text())["tie_word_embeddings"]
    layout = (
        {"parallel.dp_shard": "2", "training.local_batch_size": "2"}
        if tied
        else {"parallel.tp": "2", "parallel.dp_shard": "1"}
    )
    _, overrides = converted
    single = logits_of(make_trainer(tmp_path / "one", overrides, **{"checkpoint.init_from_hf": str(hf_dir)}), tokens)
    results = run_distributed(
        _distributed_logits, 2, tmp_path / "two", overrides, {"checkpoint.init_from_hf": str(hf_dir), **layout}, tokens
    )
    for logits, placements in results:
        assert any("Shard(dim=0)" in p for p in placements)  # really sharded
        torch.testing.assert_close(logits, single, rtol=TOL, atol=TOL)  # only the order of fp32 sums differs
        assert max_diff(logits, hf_reference) < TOL


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


def test_init_from_hf_fills_a_plain_model_without_a_trainer(hf_dir, tokens, hf_reference):
    """init_from_hf needs only the parameters, the model's args and the folder."""
    from titan.models.llama import Transformer

    spec = models.get_model_spec("llama3")
    args = spec.hf.args_from_config(json.loads((hf_dir / "config.json").read_text()))
    torch.manual_seed(0)
    model = Transformer(args).eval()  # random weights, every one of which the import must replace
    hf_io.init_from_hf(model.named_parameters(), spec, args, hf_dir, "llama3 (from the HF config)")
    with torch.no_grad():
        assert max_diff(model(tokens), hf_reference) < TOL
