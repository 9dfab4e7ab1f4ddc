"""Qwen3-MoE checkpoints through titan's command line: `titan convert hf-to-dcp`, `titan generate` on the result,
`titan convert dcp-to-hf` back, and transformers' AutoModelForCausalLM on the export; a MoE trained in titan
exports only with its routing biases at zero; and what is refused, one line each.

The HF model is helpers.tiny_qwen3_moe (a dense first layer, 8 experts of which 2 per token, heads wider than
hidden_size / heads), saved in several files so that the experts of a layer are read across them. Logits are
compared in fp32 with helpers.TOL (measured 1.2e-6, see tiny_qwen3_moe).
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import tomllib

import pytest
import torch

transformers = pytest.importorskip("transformers")

from conftest import ROOT, run_titan, tiny_overrides  # noqa: E402
from helpers import (  # noqa: E402
    SAVED,
    TOL,
    assert_one_line_error,
    max_diff,
    read_checkpoint,
    tiny_qwen3_moe,
    transformers_model,
)
from titan import models  # noqa: E402
from titan.config import load_config  # noqa: E402
from titan.tools.generate import load_model  # noqa: E402
from titan.train.trainer import Trainer  # noqa: E402

VOCAB = 1280  # covers the project tokenizer's 1170 tokens, which the HF folder brings
BATCH, SEQ = 2, 24
PROMPT = "The dog ran"
MOE_RECIPE = ROOT / "recipes" / "debug_moe.toml"


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen3_moe") / "hf"
    tiny_qwen3_moe(path, vocab_size=VOCAB, max_shard_size="100KB")
    # Its tokenizer, as an HF model folder has one: the import takes it along, and the export writes it back.
    shutil.copy(ROOT / "data" / "tokenizer.json", path / "tokenizer.json")
    special = {"bos_token": "<|begin_of_text|>", "eos_token": "<|end_of_text|>"}
    (path / "tokenizer_config.json").write_text(json.dumps(special))
    assert len(set(json.loads((path / "model.safetensors.index.json").read_text())["weight_map"].values())) >= 3
    return path


@pytest.fixture(scope="module")
def converted(hf_dir):
    """hf-to-dcp through the CLI, the family picked by config.json's model_type: (the checkpoint, the [model] table
    it printed)."""
    out = hf_dir.parent / "dcp"
    result = run_titan("convert", "hf-to-dcp", str(hf_dir), str(out))
    assert result.returncode == 0, result.stderr
    return out, tomllib.loads(result.stdout[result.stdout.index("[model]") :].split("\n\n")[0])["model"]


@pytest.fixture(scope="module")
def exported(converted):
    out = converted[0].parent / "exported"
    result = run_titan("convert", "dcp-to-hf", str(converted[0]), str(out), "--max-shard-size", "100KB")
    assert result.returncode == 0, result.stderr
    assert "the tokenizer files" in result.stdout
    return out


@pytest.fixture(scope="module")
def tokens():
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(2))


def titan_logits(checkpoint, tokens) -> torch.Tensor:
    """The model of a titan checkpoint as `titan generate` loads it, on `tokens`."""
    with torch.no_grad():
        return load_model(checkpoint, torch.device("cpu")).model(tokens)


def test_hf_to_dcp_prints_the_recipe_model_that_builds_it(hf_dir, converted):
    _, printed = converted
    spec = models.get_model_spec("moe")
    args = models.model_args(spec.name, printed["flavor"], printed["overrides"])
    hf_args = spec.hf.args_from_config(read_checkpoint(hf_dir)[0])
    # The same network; the training choices (load balancing among them) are the flavor's.
    choices = {name: getattr(args, name) for name in spec.hf.training_choices}
    assert printed["name"] == "moe" and args == dataclasses.replace(hf_args, **choices)
    assert (args.n_experts, args.top_k, args.dense_layers, args.head_dim, args.qk_norm) == (8, 2, 1, 24, True)


def test_hf_to_titan_to_hf_holds_the_same_tensors_and_config(hf_dir, exported):
    _, original = read_checkpoint(hf_dir)
    _, again = read_checkpoint(exported)
    assert again.keys() == original.keys()
    assert all(torch.equal(again[name], tensor) for name, tensor in original.items())
    config, exported_config = (transformers.AutoConfig.from_pretrained(folder) for folder in (hf_dir, exported))
    for key in ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob", "mlp_only_layers",
                "decoder_sparse_step", "head_dim", "intermediate_size", "tie_word_embeddings", "rope_parameters",
                "num_key_value_heads", "rms_norm_eps"):  # fmt: skip
        assert getattr(exported_config, key) == getattr(config, key), key


def test_transformers_on_the_export_gives_the_logits_of_the_converted_checkpoint(converted, exported, tokens):
    ours = titan_logits(converted[0], tokens)
    with torch.no_grad():
        theirs = transformers_model(exported)(tokens).logits
    assert theirs.abs().max() > 1
    assert max_diff(ours, theirs) < TOL  # measured 1.2e-6


def test_titan_generate_continues_as_transformers_generate_on_the_export(converted, exported):
    """Greedy decoding of a prompt as titan frames it (BOS + text): `titan generate` on the converted checkpoint
    prints the text transformers' generate makes with the exported model and tokenizer."""
    generated = run_titan("generate", "--checkpoint", str(converted[0]), "--prompt", PROMPT, "--max-new-tokens", "16")
    assert generated.returncode == 0, generated.stderr
    tokenizer = transformers.AutoTokenizer.from_pretrained(exported)
    inputs = tokenizer(PROMPT, return_tensors="pt")
    with torch.no_grad():
        new = transformers_model(exported).generate(**inputs, max_new_tokens=16, do_sample=False)[
            0, inputs["input_ids"].shape[1] :
        ]
    assert len(set(new.tolist())) > 3  # a continuation, not one token repeated
    assert generated.stdout == tokenizer.decode(new, skip_special_tokens=True) + "\n"


# -- a MoE trained in titan -----------------------------------------------------------------------------------------

# The debug MoE as Qwen3-MoE can hold it: q/k norms, no shared experts; 2 steps, saved.
QWEN3_LIKE = {**SAVED, "model.overrides.qk_norm": "true", "model.overrides.n_shared_experts": "0",
              "model.overrides.n_layers": "2", "checkpoint.enable": "true"}  # fmt: skip


def train_moe(root, **overrides) -> Trainer:
    trainer = Trainer(load_config(MOE_RECIPE, tiny_overrides(root, **{**QWEN3_LIKE, **overrides})))
    trainer.train()
    return trainer


def test_a_moe_trained_without_moving_its_biases_exports_with_its_logits(tmp_path, tokens):
    trainer = train_moe(tmp_path, **{"model.overrides.bias_update_rate": "0"})
    model = trainer.model_parts.parts[0].eval()
    with torch.no_grad():
        ours = model(tokens)
    result = run_titan("convert", "dcp-to-hf", str(tmp_path / "debug_moe"), str(tmp_path / "hf"))
    assert result.returncode == 0, result.stderr
    with torch.no_grad():
        theirs = transformers_model(tmp_path / "hf")(tokens).logits
    assert max_diff(ours, theirs) < TOL


def test_a_moe_whose_biases_moved_is_refused_export_naming_the_fix(tmp_path):
    trainer = train_moe(tmp_path)
    biases = [router.expert_bias for router in trainer.model_parts.parts[0].routing.routers().values()]
    assert all(bias.any() for bias in biases)  # the default rate moved them
    result = run_titan("convert", "dcp-to-hf", str(tmp_path / "debug_moe"), str(tmp_path / "hf"))
    assert_one_line_error(result, "cannot export checkpoint", "layers.1.feed_forward.router.expert_bias is not zero",
                          "model.overrides.bias_update_rate = 0")  # fmt: skip
    assert not (tmp_path / "hf").exists()
    # titan generate runs the model as it trained, biases included: they are in the checkpoint.
    loaded = load_model(tmp_path / "debug_moe", torch.device("cpu")).model
    for router, bias in zip(loaded.routing.routers().values(), biases):
        assert torch.equal(router.expert_bias, bias)


# -- refused, one line each -----------------------------------------------------------------------------------------


def edited_copy(hf_dir, tmp_path, **config):
    folder = tmp_path / "hf"
    shutil.copytree(hf_dir, folder)
    path = folder / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **config}))
    return folder


@pytest.mark.parametrize(
    "config, words",
    [({"num_local_experts": 4}, ["model.layers.1.mlp holds 8 experts, but num_experts in config.json is 4"]),
     ({"mlp_only_layers": [1]}, ["config.json: mlp_only_layers = [1] makes layers [1] dense",
                                 "not the first k layers"])],
)  # fmt: skip
def test_an_hf_folder_titan_cannot_read_is_one_line(hf_dir, tmp_path, config, words):
    result = run_titan("convert", "hf-to-dcp", str(edited_copy(hf_dir, tmp_path, **config)), str(tmp_path / "out"),
                       "--model", "moe")  # fmt: skip
    assert_one_line_error(result, *words)


def test_init_from_hf_with_another_expert_count_in_the_recipe_is_one_line(hf_dir, converted, tmp_path):
    overrides = {f"model.overrides.{key}": str(value).lower() for key, value in converted[1]["overrides"].items()}
    overrides.update({"model.flavor": converted[1]["flavor"], "model.overrides.n_experts": "16"})
    args = tiny_overrides(tmp_path, **SAVED, **overrides, **{"checkpoint.init_from_hf": str(hf_dir)})
    result = run_titan("train", "--config", str(MOE_RECIPE), *args)
    assert_one_line_error(result, "does not match this recipe's moe", "has shape [8, 64] there but [16, 64] here",
                          "to use it, set model.flavor")  # fmt: skip


def test_exporting_a_flavor_qwen3_moe_cannot_express_is_one_line(tmp_path):
    """The debug flavor has shared experts (and no q/k norms): refused before any tensor is written."""
    train_moe(tmp_path, **{"model.overrides.n_shared_experts": "2"})
    result = run_titan("convert", "dcp-to-hf", str(tmp_path / "debug_moe"), str(tmp_path / "hf"))
    assert_one_line_error(result, "cannot export checkpoint", "n_shared_experts = 2: Qwen3-MoE has no shared experts")


def test_hf_to_dcp_names_the_model_types_it_reads(hf_dir, tmp_path):
    folder = tmp_path / "gpt2"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    result = run_titan("convert", "hf-to-dcp", str(folder), str(tmp_path / "out"))
    assert_one_line_error(result, "no titan model family reads HF model_type 'gpt2'", "llama (llama3)",
                          "qwen3_moe (moe)")  # fmt: skip
