"""DeepSeek-V3 checkpoints through titan's command line: `titan convert hf-to-dcp` on a transformers
DeepseekV3ForCausalLM folder, `titan convert dcp-to-hf` back, and transformers on the export; and a DeepSeek-V3-style
MoE trained in titan, routing biases moved, that exports with them (the format holds them, as Qwen3-MoE's does not).

The HF model is helpers.tiny_deepseek_v3 (latent attention with the query's latent, a dense first layer, 8 experts
in 2 groups, a shared expert, random routing biases), saved in several files. Logits are compared in fp32 with
helpers.TOL.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch

transformers = pytest.importorskip("transformers")

from conftest import ROOT, run_titan, tiny_overrides  # noqa: E402
from helpers import SAVED, TOL, max_diff, read_checkpoint, tiny_deepseek_v3, transformers_model  # noqa: E402
from titan.config import load_config  # noqa: E402
from titan.tools.generate import load_model  # noqa: E402
from titan.train.trainer import Trainer  # noqa: E402

VOCAB = 1280  # covers the project tokenizer's 1170 tokens, which the HF folder brings
TOKENS = torch.randint(0, VOCAB, (2, 24), generator=torch.Generator().manual_seed(2))


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("deepseek_v3") / "hf"
    tiny_deepseek_v3(path, vocab_size=VOCAB, max_shard_size="100KB")
    shutil.copy(ROOT / "data" / "tokenizer.json", path / "tokenizer.json")
    special = {"bos_token": "<|begin_of_text|>", "eos_token": "<|end_of_text|>"}
    (path / "tokenizer_config.json").write_text(json.dumps(special))
    return path


@pytest.fixture(scope="module")
def exported(hf_dir):
    """hf-to-dcp (the family picked by config.json's model_type), then dcp-to-hf: (the checkpoint, the export)."""
    converted, out = hf_dir.parent / "dcp", hf_dir.parent / "exported"
    for command in (("hf-to-dcp", str(hf_dir), str(converted)), ("dcp-to-hf", str(converted), str(out))):
        result = run_titan("convert", *command)
        assert result.returncode == 0, result.stderr
    return converted, out


def test_hf_to_titan_to_hf_holds_the_same_tensors_and_config(hf_dir, exported):
    _, original = read_checkpoint(hf_dir)
    _, again = read_checkpoint(exported[1])
    assert again.keys() == original.keys()
    assert all(torch.equal(again[name], tensor) for name, tensor in original.items())
    config, exported_config = (transformers.AutoConfig.from_pretrained(f) for f in (hf_dir, exported[1]))
    for key in (
        "kv_lora_rank",
        "q_lora_rank",
        "qk_nope_head_dim",
        "qk_rope_head_dim",
        "v_head_dim",
        "n_group",
        "topk_group",
        "routed_scaling_factor",
        "first_k_dense_replace",
        "n_shared_experts",
        "n_routed_experts",
        "num_experts_per_tok",
        "norm_topk_prob",
        "rope_parameters",
        "intermediate_size",
    ):
        assert getattr(exported_config, key) == getattr(config, key), key  # fmt: skip


def test_transformers_on_the_export_gives_the_logits_of_the_converted_checkpoint(hf_dir, exported):
    with torch.no_grad():
        ours = load_model(exported[0], torch.device("cpu")).model(TOKENS)
        theirs, original = transformers_model(exported[1])(TOKENS).logits, transformers_model(hf_dir)(TOKENS).logits
    assert theirs.abs().max() > 1
    assert max_diff(ours, theirs) < TOL and max_diff(ours, original) < TOL


# The debug MoE as DeepSeek-V3 holds it: latent attention, sigmoid routing in 2 groups; 2 layers, 2 steps, saved.
DEEPSEEK_LIKE = {**SAVED, "model.overrides.kv_lora_rank": "32", "model.overrides.q_lora_rank": "24",
                 "model.overrides.qk_nope_head_dim": "16", "model.overrides.qk_rope_head_dim": "8",
                 "model.overrides.v_head_dim": "12", "model.overrides.score_func": "'sigmoid'",
                 "model.overrides.n_group": "2", "model.overrides.n_layers": "2",
                 "checkpoint.enable": "true"}  # fmt: skip


def test_a_deepseek_v3_moe_trained_in_titan_exports_with_its_moved_routing_biases(tmp_path):
    recipe = ROOT / "recipes" / "debug_moe.toml"
    trainer = Trainer(load_config(recipe, tiny_overrides(tmp_path, **DEEPSEEK_LIKE)))
    trainer.train()
    model = trainer.model_parts.parts[0].eval()
    biases = {name: router.expert_bias for name, router in model.routing.routers().items()}
    assert all(bias.any() for bias in biases.values())  # the default rate moved them
    with torch.no_grad():
        ours = model(TOKENS[:, :16] % 2048)
    for dtype in ("float32", "bfloat16"):
        result = run_titan("convert", "dcp-to-hf", str(tmp_path / "debug_moe"), str(tmp_path / dtype), "--dtype",
                           dtype)  # fmt: skip
        assert result.returncode == 0, result.stderr
    with torch.no_grad():
        theirs = transformers_model(tmp_path / "float32")(TOKENS[:, :16] % 2048).logits
    assert max_diff(ours, theirs) < TOL
    # In bfloat16 the weights round, the routing biases do not: transformers keeps them in float32.
    _, rounded = read_checkpoint(tmp_path / "bfloat16")
    for layer, bias in biases.items():
        saved = rounded[f"model.layers.{layer}.mlp.gate.e_score_correction_bias"]
        assert saved.dtype == torch.float32 and torch.equal(saved, bias)
