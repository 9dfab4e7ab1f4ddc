"""Conversion between Hugging Face `LlamaForCausalLM` checkpoints and titan's Llama 3.

Pure functions on config dicts and tensors; reading and writing files is left to the caller:

* `args_from_hf_config` / `hf_config_from_args`: a `config.json` dict <-> `ModelArgs`.
* `hf_sources`: each titan parameter's HF tensor and, for q/k, which HF row each titan row is. It is the
  mapping in both directions: per tensor (`to_hf_tensor`; titan/checkpoint/hf/ reads just a shard's rows with it)
  and for whole state dicts (`from_hf_state_dict` / `to_hf_state_dict`, full tensors).

The one non-trivial step is the q/k layout. titan (like Meta's reference code) rotates *interleaved* pairs
(x[2i], x[2i+1]) of each head with RoPE, while HF rotates *half-split* pairs (x[i], x[i + head_dim/2]). Both
rotate pair i by the same angle, so reordering the rows of wq and wk within every head turns one model into
the other exactly; see `permute_rope_rows`.
"""

from __future__ import annotations

import re
from typing import Any

import torch
from torch import Tensor

from titan.models.llama.args import LIMITS, ModelArgs
from titan.schema import Integer, Number, Table, Text, optional

# HF's default when a config names no rope_theta (transformers' LlamaConfig).
_HF_DEFAULT_ROPE_THETA = 10000.0
_LLAMA3_ROPE_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
# Args that are training choices rather than properties of the weights: the RoPE table's length (titan sizes it by
# training.seq_len) and dropout.
TRAINING_CHOICES = ("max_seq_len", "attn_dropout", "resid_dropout")


def _size(arg: str) -> Integer:
    return Integer(1, LIMITS[arg])


# The fields of a config.json titan reads (others are left alone), checked before any is used: sizes within titan's
# LIMITS, every float finite. The RoPE fields come in either of transformers' shapes (see `_rope_settings`).
_POSITIVE = Number(0, above=True)
_ROPE = Table(
    {
        "rope_type": Text(),
        "type": Text(),
        "rope_theta": _POSITIVE,
        "factor": Number(0),
        "low_freq_factor": _POSITIVE,
        "high_freq_factor": _POSITIVE,
        "original_max_position_embeddings": _size("rope_original_max_seq_len"),
        "partial_rotary_factor": Number(),
    },
)
HF_CONFIG = Table(
    {
        "model_type": Text(),
        "hidden_act": Text(),
        "hidden_size": _size("dim"),
        "num_hidden_layers": _size("n_layers"),
        "num_attention_heads": _size("n_heads"),
        "num_key_value_heads": optional(_size("n_kv_heads")),
        "head_dim": optional(_size("dim")),
        "intermediate_size": Integer(1, 8 * LIMITS["dim"]),
        "vocab_size": _size("vocab_size"),
        "max_position_embeddings": _size("max_seq_len"),
        "rms_norm_eps": _POSITIVE,
        "rope_theta": _POSITIVE,
        "partial_rotary_factor": Number(),
        "rope_parameters": optional(_ROPE),
        "rope_scaling": optional(_ROPE),
        "attention_dropout": optional(Number(0, 1)),
    },
    required=frozenset({"hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "vocab_size"}),
)


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


def _rope_settings(hf: dict[str, Any]) -> dict[str, Any]:
    """RoPE fields of ModelArgs from either config shape.

    transformers 5 writes `rope_parameters: {rope_type, rope_theta, ...}`; transformers 4 wrote a top-level
    `rope_theta` and `rope_scaling: {rope_type (or "type"), factor, ...}` or `rope_scaling: null`.
    """
    params = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    if not isinstance(params, dict):
        raise ValueError(f"rope_parameters/rope_scaling must be a dict, got {params!r}")
    if params and all(isinstance(v, dict) for v in params.values()):
        raise ValueError("rope_parameters: per-layer-type RoPE parameters are not supported")
    rope_type = params.get("rope_type", params.get("type", "default"))
    theta = params.get("rope_theta", hf.get("rope_theta", _HF_DEFAULT_ROPE_THETA))
    if params.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0)) != 1.0:
        raise ValueError("partial_rotary_factor: only full-head RoPE is supported")
    if rope_type == "default":
        return {"rope_theta": float(theta), "rope_scaling_factor": 0.0}
    if rope_type == "llama3":
        missing = [k for k in _LLAMA3_ROPE_KEYS if k not in params]
        if missing:
            raise ValueError(f"rope_parameters: llama3 RoPE scaling lacks {', '.join(missing)}")
        if not params["factor"]:
            raise ValueError("rope_parameters.factor: a llama3 scaling factor of 0 is not meaningful")
        return {
            "rope_theta": float(theta),
            "rope_scaling_factor": float(params["factor"]),
            "rope_low_freq_factor": float(params["low_freq_factor"]),
            "rope_high_freq_factor": float(params["high_freq_factor"]),
            "rope_original_max_seq_len": int(params["original_max_position_embeddings"]),
        }
    raise ValueError(f"rope_type: {rope_type!r} is not supported (only 'default' and 'llama3')")


def args_from_hf_config(hf: dict[str, Any]) -> ModelArgs:
    """`ModelArgs` for an HF Llama `config.json` dict; unsupported features and values of the wrong type or out of
    bounds raise ValueError naming the field."""
    HF_CONFIG.check(hf, "")
    if hf.get("model_type", "llama") != "llama":
        raise ValueError(f"model_type: expected 'llama', got {hf['model_type']!r}")
    for field in ("attention_bias", "mlp_bias"):
        if hf.get(field, False):
            raise ValueError(f"{field}: biases are not supported by titan's Llama")
    if hf.get("hidden_act", "silu") != "silu":
        raise ValueError(f"hidden_act: only 'silu' is supported, got {hf['hidden_act']!r}")
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
        **_rope_settings(hf),
    )
    if args.ffn_hidden_dim != intermediate:  # guards the arithmetic above
        raise ValueError(f"intermediate_size: titan's FFN size came out {args.ffn_hidden_dim}, expected {intermediate}")
    args.validate()
    return args


def _rope_config(args: ModelArgs) -> dict[str, Any]:
    """The RoPE fields of a config.json, in both shapes (see hf_config_from_args)."""
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": float(args.rope_theta)}
    if args.rope_scaling_factor:
        rope = {
            "rope_type": "llama3",
            "rope_theta": float(args.rope_theta),
            "factor": float(args.rope_scaling_factor),
            "low_freq_factor": float(args.rope_low_freq_factor),
            "high_freq_factor": float(args.rope_high_freq_factor),
            "original_max_position_embeddings": int(args.rope_original_max_seq_len),
        }
    legacy_scaling = {k: v for k, v in rope.items() if k != "rope_theta"} if args.rope_scaling_factor else None
    return {"rope_parameters": rope, "rope_theta": float(args.rope_theta), "rope_scaling": legacy_scaling}


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
        **_rope_config(args),
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


def permute_rope_rows(w: Tensor, n_heads: int, *, to_half_split: bool) -> Tensor:
    """Reorder the output rows of a q or k projection, head by head, between the two RoPE layouts.

    Within one head of size d, RoPE rotates pair i by angle pos * freq[i]:
      interleaved (titan/Meta): pair i is rows (2i, 2i+1)       -> rows read as (d/2 pairs, 2)
      half-split  (HF):         pair i is rows (i, i + d/2)     -> rows read as (2, d/2 pairs)
    Swapping those two axes moves every pair to where the other layout expects it, so the rotated q and k
    are the same vectors with their coordinates reordered; q.k (and hence attention) is unchanged because q
    and k are reordered alike. `to_half_split=False` swaps the axes back: the inverse permutation.
    """
    rows, cols = w.shape
    if rows % n_heads or (rows // n_heads) % 2:
        raise ValueError(f"cannot split {rows} rows into {n_heads} heads of even size")
    half = rows // n_heads // 2
    shape = (n_heads, half, 2, cols) if to_half_split else (n_heads, 2, half, cols)
    return w.reshape(shape).transpose(1, 2).reshape(rows, cols)


# titan name -> HF name of each layer's tensors (prefixed with `layers.{i}.` and `model.layers.{i}.`).
_LAYER_NAMES = {
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
}
# HF checkpoints from older transformers may carry RoPE inverse frequencies; they are derived, not weights.
_IGNORED_HF = re.compile(r"(^|\.)rotary_emb\.inv_freq$")


def _rope_rows(n_heads: int, head_dim: int) -> Tensor:
    """The HF row behind each titan row of a q or k projection: `permute_rope_rows` applied to row numbers."""
    rows = torch.arange(n_heads * head_dim).unsqueeze(1)
    return permute_rope_rows(rows, n_heads, to_half_split=False).squeeze(1)


def hf_sources(args: ModelArgs, *, permute_qk: bool = True) -> dict[str, tuple[str, Tensor | None]]:
    """Where each titan parameter comes from: its name -> (HF tensor name, rows), the one definition of the mapping.

    Titan row r is HF row rows[r]: for wq and wk the RoPE layout change, which moves rows within each head (see
    `permute_rope_rows`); rows is None for every other tensor, which is the HF tensor as it is. Holding the row
    numbers rather than permuted tensors lets a reader fetch only the rows one shard needs. A tied model has no
    output.weight of its own: HF stores the tied head once, as the embedding. `permute_qk=False` keeps q/k as HF
    stores them (only to show that the layout change matters).
    """
    qk = {
        "attention.wq.weight": _rope_rows(args.n_heads, args.head_dim) if permute_qk else None,
        "attention.wk.weight": _rope_rows(args.n_kv_heads, args.head_dim) if permute_qk else None,
    }
    sources = {"tok_embeddings.weight": ("model.embed_tokens.weight", None)}
    for i in range(args.n_layers):
        for titan, hf in _LAYER_NAMES.items():
            sources[f"layers.{i}.{titan}"] = (f"model.layers.{i}.{hf}", qk.get(titan))
    sources["norm.weight"] = ("model.norm.weight", None)
    if not args.tie_embeddings:
        sources["output.weight"] = ("lm_head.weight", None)
    return sources


def check_hf_names(names, args: ModelArgs) -> dict[str, str]:
    """Check the tensor names of an HF checkpoint against `args`: ValueError listing the missing and unexpected
    ones. Returns the copies it holds, {name: the tensor it must equal}: a tied model may keep lm_head.weight
    (some exports do), which is then unused but must really be the embedding. RoPE inverse frequencies are ignored.
    """
    names = {name for name in names if not _IGNORED_HF.search(name)}
    copies = {}
    if args.tie_embeddings and "lm_head.weight" in names:
        copies["lm_head.weight"] = "model.embed_tokens.weight"
    _check_keys(names - set(copies), {hf for hf, _ in hf_sources(args).values()}, "HF")
    return copies


def to_hf_tensor(w: Tensor, rows: Tensor | None) -> Tensor:
    """A titan tensor as HF stores it, given its rows from `hf_sources` (HF row rows[r] is titan row r)."""
    return w if rows is None else w[rows.argsort()]


def _check_keys(given: set[str], expected: set[str], side: str) -> None:
    missing, unexpected = sorted(expected - given), sorted(given - expected)
    if missing or unexpected:
        raise ValueError(f"{side} state dict does not match the model args: missing {missing}, unexpected {unexpected}")


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
    _check_keys(set(sd), set(sources), "titan")
    return {sources[name][0]: to_hf_tensor(w, sources[name][1]) for name, w in sd.items()}
