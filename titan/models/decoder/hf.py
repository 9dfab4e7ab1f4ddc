"""What every decoder family's Hugging Face conversion shares (a family's hf.py maps its own config fields and
feed-forwards): the config fields of attention, RoPE and the sizes, RoPE's two config shapes, the attention's and a
dense MLP's tensor names, and the q/k row order.

The one non-trivial step is the q/k layout. titan (like Meta's reference code) rotates *interleaved* pairs
(x[2i], x[2i+1]) of each head with RoPE, while HF rotates *half-split* pairs (x[i], x[i + head_dim/2]). Both
rotate pair i by the same angle, so reordering the rows of wq and wk within every head turns one model into
the other exactly; see `permute_rope_rows`.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from titan.models.decoder.args import LIMITS, DecoderArgs
from titan.schema import Flag, Integer, Number, Table, Text, optional

# HF's default when a config names no rope_theta (transformers' LlamaConfig).
HF_DEFAULT_ROPE_THETA = 10000.0
_LLAMA3_ROPE_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
# Args that are training choices rather than properties of the weights: the RoPE table's length (titan sizes it by
# training.seq_len) and dropout.
TRAINING_CHOICES = ("max_seq_len", "attn_dropout", "resid_dropout")


def hf_size(arg: str, limits: dict[str, int] = LIMITS) -> Integer:
    """A config field that holds args field `arg`: an integer within its limit."""
    return Integer(1, limits[arg])


# The fields of a config.json every decoder reads (a family adds its own; others are left alone), checked before any
# is used: sizes within titan's LIMITS, every float finite. The RoPE fields come in either of transformers' shapes
# (see `rope_settings`).
_POSITIVE = Number(0, above=True)
_ROPE = Table(
    {
        "rope_type": Text(),
        "type": Text(),
        "rope_theta": _POSITIVE,
        "factor": Number(0),
        "low_freq_factor": _POSITIVE,
        "high_freq_factor": _POSITIVE,
        "original_max_position_embeddings": hf_size("rope_original_max_seq_len"),
        "partial_rotary_factor": Number(),
        "beta_fast": _POSITIVE,
        "beta_slow": _POSITIVE,
        "attention_factor": _POSITIVE,
        "mscale": Number(0),
        "mscale_all_dim": Number(0),
        "truncate": Flag(),
    },
)
HF_CONFIG = Table(
    {
        "model_type": Text(),
        "hidden_act": Text(),
        "hidden_size": hf_size("dim"),
        "num_hidden_layers": hf_size("n_layers"),
        "num_attention_heads": hf_size("n_heads"),
        "num_key_value_heads": optional(hf_size("n_kv_heads")),
        "head_dim": optional(hf_size("dim")),
        "intermediate_size": Integer(1, 8 * LIMITS["dim"]),
        "vocab_size": hf_size("vocab_size"),
        "max_position_embeddings": hf_size("max_seq_len"),
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


def check_config(hf: dict[str, Any], schema: Table, model_type: str, refused: tuple[str, ...]) -> None:
    """What every family's config import checks first: its fields' types and bounds (`schema`), its model_type,
    the `refused` features (flags titan does not build: biases, sliding windows) off, and SwiGLU's activation;
    ValueError naming the field."""
    schema.check(hf, "")
    if hf.get("model_type", model_type) != model_type:
        raise ValueError(f"model_type: expected {model_type!r}, got {hf['model_type']!r}")
    for field in refused:
        if hf.get(field, False):
            raise ValueError(f"{field}: not supported by titan's {model_type} conversion")
    if hf.get("hidden_act", "silu") != "silu":
        raise ValueError(f"hidden_act: only 'silu' is supported, got {hf['hidden_act']!r}")


def rope_settings(hf: dict[str, Any]) -> dict[str, Any]:
    """The RoPE fields of a family's args from either config shape.

    transformers 5 writes `rope_parameters: {rope_type, rope_theta, ...}`; transformers 4 wrote a top-level
    `rope_theta` and `rope_scaling: {rope_type (or "type"), factor, ...}` or `rope_scaling: null`.
    """
    params = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    if not isinstance(params, dict):
        raise ValueError(f"rope_parameters/rope_scaling must be a dict, got {params!r}")
    if params and all(isinstance(v, dict) for v in params.values()):
        raise ValueError("rope_parameters: per-layer-type RoPE parameters are not supported")
    rope_type = params.get("rope_type", params.get("type", "default"))
    theta = params.get("rope_theta", hf.get("rope_theta", HF_DEFAULT_ROPE_THETA))
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
    if rope_type == "yarn":
        return {"rope_theta": float(theta), **_yarn_settings(hf, params)}
    raise ValueError(f"rope_type: {rope_type!r} is not supported (only 'default', 'llama3' and 'yarn')")


def _yarn_settings(hf: dict[str, Any], params: dict[str, Any]) -> dict[str, Any]:
    """YaRN's args, as transformers reads its parameters: the factor (else max_position_embeddings over the original
    context), the betas (default 32 and 1), and the attention factor stated, or from DeepSeek's mscale and
    mscale_all_dim, else the paper's (0 here)."""
    if "original_max_position_embeddings" not in params:
        raise ValueError("rope_parameters: yarn RoPE scaling lacks original_max_position_embeddings")
    if params.get("truncate", True) is not True:
        raise ValueError("rope_parameters.truncate: only YaRN's rounded ramp (truncate = true) is supported")
    original = int(params["original_max_position_embeddings"])
    factor = params.get("factor") or hf.get("max_position_embeddings", original) / original
    attention = params.get("attention_factor") or 0.0
    if not attention and params.get("mscale") and params.get("mscale_all_dim"):
        mscale = lambda m: 0.1 * m * math.log(factor) + 1 if factor > 1 else 1.0  # noqa: E731
        attention = mscale(params["mscale"]) / mscale(params["mscale_all_dim"])
    return {
        "rope_scaling": "yarn",
        "rope_scaling_factor": float(factor),
        "rope_original_max_seq_len": original,
        "rope_yarn_beta_fast": float(params.get("beta_fast") or 32),
        "rope_yarn_beta_slow": float(params.get("beta_slow") or 1),
        "rope_attention_factor": float(attention),
    }


def rope_config(args: DecoderArgs) -> dict[str, Any]:
    """The RoPE fields of a config.json, in both shapes: transformers 5's `rope_parameters`, and 4's `rope_theta` and
    `rope_scaling`."""
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": float(args.rope_theta)}
    if args.rope_scaling_factor and args.rope_scaling == "yarn":
        rope = {
            "rope_type": "yarn",
            "rope_theta": float(args.rope_theta),
            "factor": float(args.rope_scaling_factor),
            "original_max_position_embeddings": int(args.rope_original_max_seq_len),
            "beta_fast": float(args.rope_yarn_beta_fast),
            "beta_slow": float(args.rope_yarn_beta_slow),
            **({"attention_factor": float(args.rope_attention_factor)} if args.rope_attention_factor else {}),
        }
    elif args.rope_scaling_factor:
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


# titan name -> HF name of each layer's tensors (prefixed with `layers.{i}.` and `model.layers.{i}.`): the attention
# and the two norms, and a dense SwiGLU feed-forward (HF's MLP).
ATTENTION_NAMES = {
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
}
# Qwen3's q/k norms: RMSNorm of each head's queries and keys, before RoPE.
QK_NORM_NAMES = {
    "attention.q_norm.weight": "self_attn.q_norm.weight",
    "attention.k_norm.weight": "self_attn.k_norm.weight",
}
DENSE_NAMES = {
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
}
# HF checkpoints from older transformers may carry RoPE inverse frequencies; they are derived, not weights.
IGNORED_HF = re.compile(r"(^|\.)rotary_emb\.inv_freq$")
Source = tuple[str | tuple[str, ...], Tensor | None]  # an HF tensor's name (or the names a stack holds), and rows


def rope_rows(n_heads: int, head_dim: int) -> Tensor:
    """The HF row behind each titan row of a q or k projection: `permute_rope_rows` applied to row numbers."""
    rows = torch.arange(n_heads * head_dim).unsqueeze(1)
    return permute_rope_rows(rows, n_heads, to_half_split=False).squeeze(1)


def attention_rope_rows(args: DecoderArgs, qk_norm: bool = False) -> dict[str, Tensor]:
    """The rows of the attention's tensors that RoPE's layout change moves: wq's and wk's within each head, and a q/k
    norm's elements (they act on one head's coordinates before RoPE), by titan name."""
    rows = {
        "attention.wq.weight": rope_rows(args.n_heads, args.head_dim),
        "attention.wk.weight": rope_rows(args.n_kv_heads, args.head_dim),
    }
    if qk_norm:
        rows |= {name: rope_rows(1, args.head_dim) for name in QK_NORM_NAMES}
    return rows


def decoder_sources(
    args: DecoderArgs, layer_names: Callable[[int], dict[str, str | tuple[str, ...]]], rows: dict[str, Tensor]
) -> dict[str, Source]:
    """Each titan parameter's HF source: the embedding, each layer's tensors (`layer_names(i)`: titan name -> HF
    name, or the names of the tensors it stacks), the final norm and the head. Titan row r of a layer tensor named
    in `rows` is HF row rows[...][r]; rows is None for every other tensor. A tied model has no output.weight of its
    own: HF stores the tied head once, as the embedding."""
    sources: dict[str, Source] = {"tok_embeddings.weight": ("model.embed_tokens.weight", None)}
    for i in range(args.n_layers):
        for titan, hf in layer_names(i).items():
            theirs = f"model.layers.{i}.{hf}" if isinstance(hf, str) else tuple(f"model.layers.{i}.{h}" for h in hf)
            sources[f"layers.{i}.{titan}"] = (theirs, rows.get(titan))
    sources["norm.weight"] = ("model.norm.weight", None)
    if not args.tie_embeddings:
        sources["output.weight"] = ("lm_head.weight", None)
    return sources


def check_names(names: set[str], args: DecoderArgs, sources: dict[str, Source]) -> dict[str, str]:
    """Check an HF checkpoint's tensor names against the model's `sources`: ValueError listing the missing and
    unexpected ones. Returns the copies it holds, {name: the tensor it must equal}: a tied model may keep
    lm_head.weight (some exports do), which is then unused but must really be the embedding. RoPE inverse
    frequencies are ignored."""
    names = {name for name in names if not IGNORED_HF.search(name)}
    copies = {}
    if args.tie_embeddings and "lm_head.weight" in names:
        copies["lm_head.weight"] = "model.embed_tokens.weight"
    expected = set()
    for hf, _ in sources.values():
        expected.update([hf] if isinstance(hf, str) else hf)
    check_keys(names - set(copies), expected, "HF")
    return copies


def to_hf_tensor(w: Tensor, rows: Tensor | None) -> Tensor:
    """A titan tensor as HF stores it, given its rows from `hf_sources` (HF row rows[r] is titan row r)."""
    return w if rows is None else w[rows.argsort()]


def check_keys(given: set[str], expected: set[str], side: str) -> None:
    missing, unexpected = sorted(expected - given), sorted(given - expected)
    if missing or unexpected:
        raise ValueError(f"{side} state dict does not match the model args: missing {missing}, unexpected {unexpected}")
