"""Conversion between Hugging Face `LlamaForCausalLM` checkpoints and titan's Llama 3.

Pure functions on config dicts and tensors; reading and writing files is left to the caller:

* `args_from_hf_config` / `hf_config_from_args`: a `config.json` dict <-> `ModelArgs`.
* `hf_sources`: each titan parameter's HF tensor and, for q/k, which HF row each titan row is. It is the
  mapping in both directions: per tensor (`to_hf_tensor`; titan/checkpoint/hf/ reads just a shard's rows with it)
  and for whole state dicts (`from_hf_state_dict` / `to_hf_state_dict`, full tensors).

What every decoder shares (RoPE's config shapes, the attention's tensor names, the q/k row order) is in
titan/models/decoder/hf.py.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from titan.models.decoder.hf import (
    ATTENTION_NAMES,
    DENSE_NAMES,
    HF_CONFIG,
    TRAINING_CHOICES,
    attention_rope_rows,
    check_config,
    check_keys,
    check_names,
    decoder_sources,
    rope_config,
    rope_settings,
    to_hf_tensor,
)
from titan.models.llama.args import ModelArgs

__all__ = [
    "MODEL_TYPE", "MODEL_TYPES", "TRAINING_CHOICES", "args_from_hf_config", "check_hf_names", "from_hf_state_dict",
    "hf_config_from_args", "hf_sources", "to_hf_state_dict", "to_hf_tensor",
]  # fmt: skip
MODEL_TYPE = "llama"  # config.json's, which picks this family
MODEL_TYPES = (MODEL_TYPE,)


# --------------------------------------------------------------------------------------------------------------
# Config
# --------------------------------------------------------------------------------------------------------------


def _ffn_multiplier_for(dim: int, intermediate_size: int) -> float:
    """An `ffn_dim_multiplier` that, with `multiple_of=1`, makes `ModelArgs.ffn_hidden_dim == intermediate_size`.

    titan computes `int(multiplier * int(8 * dim / 3))` rounded up to `multiple_of`. With `multiple_of=1` there is
    no rounding up, so any multiplier in [I/h, (I+1)/h) works; I/h itself can land one ulp low and floor to I-1,
    so the middle of the interval, (I + 0.5)/h, is the fallback. 1.0 rather than None when no multiplier is
    needed, so the value can be written in a TOML recipe's model.overrides (TOML has no null).
    """
    base = int(2 * 4 * dim / 3)
    if base <= 0 or intermediate_size <= 0:
        raise ValueError(f"cannot express intermediate_size={intermediate_size} for hidden_size={dim}")
    if base == intermediate_size:
        return 1.0
    for multiplier in (intermediate_size / base, (intermediate_size + 0.5) / base):
        if int(multiplier * base) == intermediate_size:
            return multiplier
    raise ValueError(f"cannot express intermediate_size={intermediate_size} as a titan FFN size for hidden_size={dim}")


def args_from_hf_config(hf: dict[str, Any]) -> ModelArgs:
    """`ModelArgs` for an HF Llama `config.json` dict; unsupported features and values of the wrong type or out of
    bounds raise ValueError naming the field."""
    check_config(hf, HF_CONFIG, MODEL_TYPE, ("attention_bias", "mlp_bias"))
    dim, n_heads = int(hf["hidden_size"]), int(hf["num_attention_heads"])
    if dim % n_heads:
        raise ValueError(f"hidden_size ({dim}) must divide by num_attention_heads ({n_heads})")
    head_dim = hf.get("head_dim")
    if head_dim is not None and head_dim != dim // n_heads:
        raise ValueError(
            f"head_dim: {head_dim} != hidden_size / num_attention_heads = {dim // n_heads} is not supported"
        )
    intermediate = int(hf["intermediate_size"])
    args = ModelArgs(
        dim=dim,
        n_layers=int(hf["num_hidden_layers"]),
        n_heads=n_heads,
        n_kv_heads=int(hf.get("num_key_value_heads") or n_heads),
        vocab_size=int(hf["vocab_size"]),
        multiple_of=1,
        ffn_dim_multiplier=_ffn_multiplier_for(dim, intermediate),
        norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        max_seq_len=int(hf.get("max_position_embeddings", 2048)),
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        attn_dropout=float(hf.get("attention_dropout") or 0.0),
        **rope_settings(hf),
    )
    if args.ffn_hidden_dim != intermediate:  # guards the arithmetic above
        raise ValueError(f"intermediate_size: titan's FFN size came out {args.ffn_hidden_dim}, expected {intermediate}")
    args.validate()
    return args


def hf_config_from_args(args: ModelArgs, dtype: torch.dtype | str = "float32") -> dict[str, Any]:
    """A `config.json` dict for `args` that `transformers.LlamaConfig(**d)` accepts.

    `dtype` names the dtype the weights are saved in. RoPE is written in both shapes: `rope_parameters`
    (transformers 5) and `rope_theta` + `rope_scaling` (transformers 4). `resid_dropout` has no HF counterpart.
    """
    args.validate()
    dtype = str(dtype).removeprefix("torch.")
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": args.dim,
        "num_hidden_layers": args.n_layers,
        "num_attention_heads": args.n_heads,
        "num_key_value_heads": args.n_kv_heads,
        "head_dim": args.head_dim,
        "intermediate_size": args.ffn_hidden_dim,
        "vocab_size": args.vocab_size,
        "hidden_act": "silu",
        "rms_norm_eps": args.norm_eps,
        "max_position_embeddings": args.max_seq_len,
        **rope_config(args),
        "tie_word_embeddings": args.tie_embeddings,
        "attention_bias": False,
        "mlp_bias": False,
        "attention_dropout": args.attn_dropout,
        "initializer_range": 0.02,
        "use_cache": True,
        "dtype": dtype,
        "torch_dtype": dtype,
    }


# --------------------------------------------------------------------------------------------------------------
# Weights
# --------------------------------------------------------------------------------------------------------------


def hf_sources(args: ModelArgs, *, permute_qk: bool = True) -> dict[str, tuple[str, Tensor | None]]:
    """Where each titan parameter comes from: its name -> (HF tensor name, rows), the one definition of the mapping.

    Titan row r is HF row rows[r]: for wq and wk the RoPE layout change, which moves rows within each head (see
    `permute_rope_rows`); rows is None for every other tensor, which is the HF tensor as it is. Holding the row
    numbers rather than permuted tensors lets a reader fetch only the rows one shard needs. A tied model has no
    output.weight of its own: HF stores the tied head once, as the embedding. `permute_qk=False` keeps q/k as HF
    stores them (only to show that the layout change matters).
    """
    layer = {**ATTENTION_NAMES, **DENSE_NAMES}
    return decoder_sources(args, lambda _: layer, attention_rope_rows(args) if permute_qk else {})


def check_hf_names(names, args: ModelArgs) -> dict[str, str]:
    """Check the tensor names of an HF checkpoint against `args`: ValueError listing the missing and unexpected
    ones. Returns the copies it holds, {name: the tensor it must equal}: a tied model may keep lm_head.weight
    (some exports do), which is then unused but must really be the embedding. RoPE inverse frequencies are ignored.
    """
    return check_names(set(names), args, hf_sources(args))


def from_hf_state_dict(sd: dict[str, Tensor], args: ModelArgs, *, permute_qk: bool = True) -> dict[str, Tensor]:
    """HF `LlamaForCausalLM` weights -> a titan `Transformer` state dict, by `hf_sources`.

    With tied embeddings `lm_head.weight` may be absent (HF omits it); `output.weight` is then the embedding
    tensor itself. `permute_qk=False` skips the RoPE layout change (only to show it matters).
    """
    for copy, original in check_hf_names(sd, args).items():
        if not torch.equal(sd[copy], sd[original]):
            raise ValueError(f"tie_word_embeddings is set but {copy} differs from {original}")
    out = {
        titan: sd[hf] if rows is None else sd[hf][rows]
        for titan, (hf, rows) in hf_sources(args, permute_qk=permute_qk).items()
    }
    if args.tie_embeddings:
        out["output.weight"] = out["tok_embeddings.weight"]
    return out


def to_hf_state_dict(sd: dict[str, Tensor], args: ModelArgs) -> dict[str, Tensor]:
    """A titan `Transformer` state dict -> HF `LlamaForCausalLM` weights (no `lm_head.weight` when tied).

    The result may still share storage with `sd` (every tensor but q/k); clone before saving if that matters.
    """
    sources = hf_sources(args)
    if args.tie_embeddings and "output.weight" in sd:  # `state_dict()` lists the tied parameter under both names
        if sd["output.weight"] is not sd.get("tok_embeddings.weight") and not torch.equal(
            sd["output.weight"], sd.get("tok_embeddings.weight", torch.empty(0))
        ):
            raise ValueError(
                "tie_embeddings is set but output.weight differs from tok_embeddings.weight "
                "(was the tie lost, e.g. by Module.to_empty?)"
            )
        sd = {k: v for k, v in sd.items() if k != "output.weight"}
    check_keys(set(sd), set(sources), "titan")
    return {sources[name][0]: to_hf_tensor(w, sources[name][1]) for name, w in sd.items()}
