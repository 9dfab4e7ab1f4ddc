"""HF Llama <-> titan conversion: a tiny random `LlamaForCausalLM` and titan's Transformer give the same logits.

The model is small but exercises everything the conversion touches: grouped-query attention (4 heads, 2 KV
heads), Llama 3.1 RoPE scaling with a short original context (so scaling changes the frequencies that the
24 positions actually see), random norm weights, and both tied and untied embeddings.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")
from safetensors.torch import save_file  # noqa: E402

from helpers import TOL, hf_logits, max_diff, randomize_, read_checkpoint, tiny_hf_config  # noqa: E402
from titan.models.decoder.hf import permute_rope_rows  # noqa: E402
from titan.models.decoder.rope import rope_frequencies  # noqa: E402
from titan.models.llama.flavors import FLAVORS  # noqa: E402
from titan.models.llama.hf import (  # noqa: E402
    args_from_hf_config,
    check_hf_names,
    from_hf_state_dict,
    hf_config_from_args,
    hf_sources,
    to_hf_state_dict,
    to_hf_tensor,
)
from titan.models.llama.model import Transformer  # noqa: E402

BATCH, SEQ = 2, 24


@pytest.fixture(scope="module", params=[False, True], ids=["untied", "tied"])
def hf_checkpoint(request, tmp_path_factory) -> Path:
    """A saved random tiny HF Llama (config.json + safetensors), built once per tie setting."""
    tied = request.param
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(tiny_hf_config(tied)).float().eval()
    randomize_(model, seed=1)
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == tied
    path = tmp_path_factory.mktemp("hf_tied" if tied else "hf_untied")
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def tokens() -> torch.Tensor:
    return torch.randint(0, 320, (BATCH, SEQ), generator=torch.Generator().manual_seed(2))


def titan_from_hf(path: Path, *, permute_qk: bool = True) -> Transformer:
    config, weights = read_checkpoint(path)
    args = args_from_hf_config(config)
    # Every parameter is overwritten, and the non-persistent RoPE table comes from args in __init__.
    model = Transformer(args)
    model.load_state_dict(from_hf_state_dict(weights, args, permute_qk=permute_qk), strict=True)
    return model.eval()


def test_to_empty_keeps_the_tie():
    """Building on meta and moving with to_empty, as the trainer does, must keep output.weight tied."""
    args = args_from_hf_config(tiny_hf_config(tied=True).to_dict())
    with torch.device("meta"):
        model = Transformer(args)
    assert model.output.weight is model.tok_embeddings.weight
    model.to_empty(device="cpu")
    assert model.output.weight is model.tok_embeddings.weight


def test_hf_checkpoint_imports_with_the_same_logits(hf_checkpoint, tokens):
    config, weights = read_checkpoint(hf_checkpoint)
    if config["tie_word_embeddings"]:
        assert "lm_head.weight" not in weights  # HF stores a tied head once, under the embedding's name
    model = titan_from_hf(hf_checkpoint)
    assert model.args.ffn_hidden_dim == 176
    assert (model.output.weight is model.tok_embeddings.weight) == config["tie_word_embeddings"]
    with torch.no_grad():
        ours = model(tokens)
    theirs = hf_logits(hf_checkpoint, tokens)
    assert ours.shape == theirs.shape == (BATCH, SEQ, 320)
    assert theirs.abs().max() > 1  # the comparison below is not between near-zero numbers
    assert max_diff(ours, theirs) < TOL


def test_import_without_the_qk_permutation_gives_other_logits(hf_checkpoint, tokens):
    """The logit test can fail: skipping the RoPE layout change moves the logits by far more than TOL."""
    with torch.no_grad():
        wrong = titan_from_hf(hf_checkpoint, permute_qk=False)(tokens)
    assert max_diff(wrong, hf_logits(hf_checkpoint, tokens)) > 1000 * TOL  # measured: 0.49


def test_rope_scaling_matters_for_these_positions(hf_checkpoint):
    """The tiny config's llama3 scaling changes frequencies, so a scaling bug could not hide.

    (Measured: titan's model with rope_scaling_factor=0 differs from HF's logits by 0.56.)
    """
    args = args_from_hf_config(read_checkpoint(hf_checkpoint)[0])
    unscaled = rope_frequencies(dataclasses.replace(args, rope_scaling_factor=0.0))
    changed = (rope_frequencies(args) - unscaled).abs() * SEQ
    assert changed.max() > 0.1  # radians of rotation difference reached within the sequence


def test_titan_model_exports_to_hf_with_the_same_logits(hf_checkpoint, tokens, tmp_path):
    model = titan_from_hf(hf_checkpoint)
    randomize_(model, seed=3)  # export weights that did not come straight from the import
    args = model.args
    hf_weights = to_hf_state_dict(model.state_dict(), args)
    assert ("lm_head.weight" in hf_weights) != args.tie_embeddings
    # save_file rejects tensors sharing storage: a tied head must appear only once, as embed_tokens.
    save_file(hf_weights, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    (tmp_path / "config.json").write_text(json.dumps(hf_config_from_args(args), indent=2))

    hf_model, info = transformers.LlamaForCausalLM.from_pretrained(
        tmp_path, local_files_only=True, dtype=torch.float32, attn_implementation="eager", output_loading_info=True
    )
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    assert (hf_model.lm_head.weight is hf_model.model.embed_tokens.weight) == args.tie_embeddings
    with torch.no_grad():
        ours, theirs = model(tokens), hf_model.eval()(tokens).logits
    assert theirs.abs().max() > 1
    assert max_diff(ours, theirs) < TOL


def test_state_dict_round_trip_is_exact(hf_checkpoint):
    config, weights = read_checkpoint(hf_checkpoint)
    args = args_from_hf_config(config)
    back = to_hf_state_dict(from_hf_state_dict(weights, args), args)
    assert back.keys() == weights.keys()
    assert all(torch.equal(back[k], weights[k]) for k in weights)
    # The config survives a trip through titan too.
    assert args_from_hf_config(hf_config_from_args(args)) == args


def test_permutation_is_inverted_and_pairs_move_as_documented():
    heads, head_dim, cols = 3, 8, 5
    w = torch.randn(heads * head_dim, cols)
    half_split = permute_rope_rows(w, heads, to_half_split=True)
    assert torch.equal(permute_rope_rows(half_split, heads, to_half_split=False), w)
    for h in range(heads):
        for i in range(head_dim // 2):  # interleaved pair (2i, 2i+1) becomes half-split pair (i, i + d/2)
            base = h * head_dim
            assert torch.equal(half_split[base + i], w[base + 2 * i])
            assert torch.equal(half_split[base + i + head_dim // 2], w[base + 2 * i + 1])


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_sources_name_every_parameter_once_and_move_only_qk_rows_within_heads(tied):
    args = args_from_hf_config(tiny_hf_config(tied).to_dict())
    with torch.device("meta"):
        names = [name for name, _ in Transformer(args).named_parameters()]  # a tied head is listed once
    sources = hf_sources(args)
    assert sorted(sources) == sorted(names)
    hf_names = {hf for hf, _ in sources.values()}
    assert len(hf_names) == len(sources) and ("lm_head.weight" in hf_names) != tied
    for name, (_, rows) in sources.items():
        if name.endswith(("attention.wq.weight", "attention.wk.weight")):
            heads = args.n_heads if name.endswith("wq.weight") else args.n_kv_heads
            w = torch.randn(heads * args.head_dim, args.dim)
            assert torch.equal(w[rows], permute_rope_rows(w, heads, to_half_split=False))  # titan row r = HF rows[r]
            assert torch.equal(to_hf_tensor(w[rows], rows), w)
            assert torch.equal(rows // args.head_dim, torch.arange(len(rows)) // args.head_dim)  # within heads
        else:
            assert rows is None, name


@pytest.mark.parametrize("hf_checkpoint", [True], ids=["tied"], indirect=True)
def test_a_tied_model_may_keep_its_head_only_as_a_copy_of_the_embedding(hf_checkpoint):
    config, weights = read_checkpoint(hf_checkpoint)
    args = args_from_hf_config(config)
    embed = weights["model.embed_tokens.weight"]
    assert check_hf_names(weights, args) == {}
    assert check_hf_names([*weights, "lm_head.weight"], args) == {"lm_head.weight": "model.embed_tokens.weight"}
    titan = from_hf_state_dict({**weights, "lm_head.weight": embed.clone()}, args)
    assert titan["output.weight"] is titan["tok_embeddings.weight"]
    with pytest.raises(ValueError, match="lm_head.weight differs from model.embed_tokens.weight"):
        from_hf_state_dict({**weights, "lm_head.weight": embed + 1}, args)


# Published config.json of meta-llama/Llama-3.1-8B (transformers 4 shape: rope_theta and rope_scaling).
LLAMA_31_8B = {
    "architectures": ["LlamaForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 128000,
    "eos_token_id": 128001,
    "hidden_act": "silu",
    "hidden_size": 4096,
    "initializer_range": 0.02,
    "intermediate_size": 14336,
    "max_position_embeddings": 131072,
    "mlp_bias": False,
    "model_type": "llama",
    "num_attention_heads": 32,
    "num_hidden_layers": 32,
    "num_key_value_heads": 8,
    "pretraining_tp": 1,
    "rms_norm_eps": 1e-05,
    "rope_scaling": {
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
        "rope_type": "llama3",
    },
    "rope_theta": 500000.0,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "transformers_version": "4.43.0.dev0",
    "use_cache": True,
    "vocab_size": 128256,
}

ARCH_FIELDS = (
    "dim",
    "n_layers",
    "n_heads",
    "n_kv_heads",
    "vocab_size",
    "ffn_hidden_dim",
    "head_dim",
    "norm_eps",
    "rope_theta",
    "rope_scaling_factor",
    "rope_low_freq_factor",
    "rope_high_freq_factor",
    "rope_original_max_seq_len",
    "max_seq_len",
    "tie_embeddings",
)


@pytest.mark.parametrize("shape", ["transformers4", "transformers5"])
def test_llama_31_8b_config_matches_the_8b_flavor(shape):
    config = LLAMA_31_8B
    if shape == "transformers5":  # the same config as transformers 5 writes it: rope_parameters
        config = transformers.LlamaConfig(**LLAMA_31_8B).to_dict()
        assert "rope_parameters" in config and config["rope_parameters"]["rope_theta"] == 500000.0
    args, flavor = args_from_hf_config(config), FLAVORS["8B"]
    assert {f: getattr(args, f) for f in ARCH_FIELDS} == {f: getattr(flavor, f) for f in ARCH_FIELDS}
    assert args.ffn_hidden_dim == 14336


def test_exported_config_is_accepted_by_transformers():
    for flavor in ("debug", "1B", "8B"):
        args = FLAVORS[flavor]
        config = transformers.LlamaConfig(**hf_config_from_args(args))
        assert config.intermediate_size == args.ffn_hidden_dim and config.tie_word_embeddings == args.tie_embeddings
        expected_type = "llama3" if args.rope_scaling_factor else "default"
        assert config.rope_parameters["rope_type"] == expected_type
        assert config.rope_parameters["rope_theta"] == args.rope_theta


@pytest.mark.parametrize(
    "change, field",
    [
        ({"attention_bias": True}, "attention_bias"),
        ({"mlp_bias": True}, "mlp_bias"),
        ({"head_dim": 256}, "head_dim"),
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"rope_scaling": {"rope_type": "longrope", "factor": 4.0}}, "rope_type"),
        ({"rope_scaling": {"rope_type": "linear", "factor": 4.0}}, "rope_type"),
    ],
)
def test_unsupported_config_names_the_field(change, field):
    with pytest.raises(ValueError, match=field):
        args_from_hf_config({**LLAMA_31_8B, **change})


def test_unknown_and_missing_weights_are_listed(hf_checkpoint):
    config, weights = read_checkpoint(hf_checkpoint)
    args = args_from_hf_config(config)
    weights_plus = {**weights, "model.layers.0.self_attn.rotary_emb.inv_freq": torch.ones(8)}
    from_hf_state_dict(weights_plus, args)  # derived RoPE buffers are ignored
    with pytest.raises(ValueError, match="model.layers.9.mlp.up_proj.weight"):
        from_hf_state_dict({**weights, "model.layers.9.mlp.up_proj.weight": torch.ones(1)}, args)
    missing = {k: v for k, v in weights.items() if k != "model.norm.weight"}
    with pytest.raises(ValueError, match="missing.*model.norm.weight"):
        from_hf_state_dict(missing, args)
    titan = from_hf_state_dict(weights, args)
    with pytest.raises(ValueError, match="layers.1.ffn_norm.weight"):
        to_hf_state_dict({k: v for k, v in titan.items() if k != "layers.1.ffn_norm.weight"}, args)
