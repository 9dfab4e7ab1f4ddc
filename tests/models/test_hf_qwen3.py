"""HF Qwen3 (dense) <-> titan's qwen3: a tiny random `Qwen3ForCausalLM` built by transformers and titan's model on the
weights read from its files give the same logits and the same greedy tokens; titan's weights written back under HF's
names are transformers' own, bit for bit, and the config maps both ways.

The model: 3 layers, 4 heads of 24 (wider than hidden_size / heads = 16) with q/k norms, 2 KV heads, random norm
weights, tied and untied.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from helpers import TOL, max_diff, randomize_  # noqa: E402
from titan import models  # noqa: E402
from titan.checkpoint.hf import open_hf, read_into  # noqa: E402
from titan.models.qwen3 import FLAVORS, Qwen3  # noqa: E402
from titan.models.qwen3.hf import args_from_hf_config, hf_config_from_args, hf_sources, to_hf_tensor  # noqa: E402
from titan.tools.generate import generate  # noqa: E402

SPEC = models.get_model_spec("qwen3")


@pytest.fixture(scope="module", params=[False, True], ids=["untied", "tied"])
def hf_model(request, tmp_path_factory) -> tuple[Path, torch.nn.Module]:
    config = transformers.Qwen3Config(
        vocab_size=320, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, head_dim=24, tie_word_embeddings=request.param, max_position_embeddings=64,
        rms_norm_eps=1e-6, rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.Qwen3ForCausalLM(config).float().eval()
    randomize_(model, seed=1)
    path = tmp_path_factory.mktemp("qwen3")
    model.save_pretrained(path)
    return path, model


def titan_model(path: Path) -> Qwen3:
    hf = open_hf(path, SPEC)
    with torch.device("meta"):
        model = Qwen3(hf.args)
    model.to_empty(device="cpu")
    model.init_weights(0)
    read_into(hf, model.named_parameters(), "reading")
    return model.eval()


def test_titan_on_the_imported_weights_gives_transformers_logits_and_greedy_tokens(hf_model):
    path, theirs = hf_model
    ours = titan_model(path)
    tokens = torch.randint(0, 320, (2, 24), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        expected = theirs(tokens).logits
        assert expected.abs().max() > 1  # not a comparison of near-zero numbers
        assert max_diff(ours(tokens), expected) < TOL
        prompt = tokens[0, :5]
        their_tokens = theirs.generate(prompt[None], max_new_tokens=12, do_sample=False, min_new_tokens=12)
    assert generate(ours, [prompt.tolist()], 12).tokens[0] == their_tokens[0, 5:].tolist()


def test_the_export_is_transformers_own_weights_bit_for_bit_and_its_config_builds_the_same_model(hf_model):
    path, theirs = hf_model
    ours = titan_model(path)
    args = SPEC.hf.args_from_config(theirs.config.to_dict())
    params = dict(ours.named_parameters())
    exported = {hf: to_hf_tensor(params[name].detach(), rows) for name, (hf, rows) in hf_sources(args).items()}
    their_state = theirs.state_dict()
    assert set(exported) == set(their_state) - ({"lm_head.weight"} if args.tie_embeddings else set())
    for name, tensor in exported.items():
        assert torch.equal(tensor, their_state[name]), name
    config = transformers.Qwen3Config(**hf_config_from_args(args))
    for field in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                  "num_key_value_heads", "head_dim", "vocab_size", "tie_word_embeddings", "rms_norm_eps"):  # fmt: skip
        assert getattr(config, field) == getattr(theirs.config, field), field
    assert args_from_hf_config(hf_config_from_args(args)) == args


def test_qwen3_8b_has_the_parameters_of_transformers_qwen3_8b():
    args = FLAVORS["qwen3_8b"]
    config = transformers.Qwen3Config(**hf_config_from_args(args))
    with torch.device("meta"):
        theirs = sum(p.numel() for p in transformers.Qwen3ForCausalLM(config).parameters())
        ours = sum(p.numel() for p in Qwen3(args).parameters())
    assert ours == theirs == 8_190_735_360  # Qwen3-8B's published 8.2B


@pytest.mark.parametrize(
    "change, field",
    [({"attention_bias": True}, "attention_bias"), ({"use_sliding_window": True}, "use_sliding_window"),
     ({"hidden_act": "gelu"}, "hidden_act"), ({"model_type": "qwen3_moe"}, "model_type"),
     ({"intermediate_size": 2**20}, "intermediate_size")],
)  # fmt: skip
def test_configs_titan_cannot_build_are_refused_naming_the_field(change, field):
    config = {**hf_config_from_args(FLAVORS["debug"]), **change}
    with pytest.raises(ValueError, match=field):
        args_from_hf_config(config)


@pytest.mark.parametrize(
    "rope",
    [{"factor": 4.0, "original_max_position_embeddings": 16},
     {"factor": 4.0, "original_max_position_embeddings": 16, "beta_fast": 8.0, "beta_slow": 2.0,
      "attention_factor": 1.3},
     {"factor": 4.0, "original_max_position_embeddings": 16, "mscale": 0.7, "mscale_all_dim": 1.0}],
    ids=["paper", "stated", "deepseek_mscale"],
)  # fmt: skip
def test_yarn_rope_scaling_gives_transformers_logits_past_the_original_context(tmp_path, rope):
    """Qwen3 extends its context with YaRN (rope_scaling), as DeepSeek-V3 does: 48 positions of a model whose
    original context is 16, factor 4. titan's table and attention factor give transformers' logits; without the
    scaling they are far off; the config maps back to the same parameters."""
    config = transformers.Qwen3Config(
        vocab_size=320, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=24, max_position_embeddings=64, rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, **rope},
    )  # fmt: skip
    torch.manual_seed(0)
    theirs = transformers.Qwen3ForCausalLM(config).float().eval()
    randomize_(theirs, seed=1)
    theirs.save_pretrained(tmp_path)
    ours = titan_model(tmp_path)
    assert ours.args.rope_scaling == "yarn"
    tokens = torch.randint(0, 320, (2, 48), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        expected = theirs(tokens).logits
        assert max_diff(ours(tokens), expected) < TOL
        plain = Qwen3(dataclasses.replace(ours.args, rope_scaling_factor=0.0))
        plain.load_state_dict(ours.state_dict())
        plain.init_buffers()
        assert max_diff(plain.eval()(tokens), expected) > 100 * TOL  # the scaling matters at these positions
    again = args_from_hf_config(hf_config_from_args(ours.args))
    assert again == ours.args
