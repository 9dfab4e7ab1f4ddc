"""Conversion between Hugging Face `Qwen3MoeForCausalLM` checkpoints and titan's MoE family (one of the moe family's
two formats; titan/checkpoint/hf/ reads and writes the files).

Qwen3-MoE is titan's MoE with q/k norms, softmax scores, route scale 1, no shared experts and no routing bias:
each token's top `num_experts_per_tok` experts by softmax score, their weights renormalised when norm_topk_prob.
Its layers are dense where `mlp_only_layers` or `decoder_sparse_step` say; titan keeps only its first
`dense_layers` dense, so only that pattern converts.

Attention converts as every decoder's (titan/models/decoder/hf.py), the q/k rows moved within each head between HF's
half-split RoPE layout and titan's interleaved one; the q/k norms act on each head's coordinates before RoPE, so
their weights move alike. The experts are read and written as both formats do (experts.py).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from titan.models.decoder import hf as decoder
from titan.models.moe import hf_format_blockers
from titan.models.moe.args import LIMITS, MoEArgs
from titan.models.moe.hf.experts import check_experts, expert_names
from titan.schema import Flag, Integer, ListOf, Table, optional

MODEL_TYPE = "qwen3_moe"  # config.json's
# transformers' Qwen3MoeConfig defaults for fields a config.json may leave out.
_HF_DEFAULTS = {"intermediate_size": 6144, "max_position_embeddings": 32768, "rms_norm_eps": 1e-6}


def _size(arg: str) -> Integer:
    return decoder.hf_size(arg, LIMITS)


# The decoder's fields with this family's bounds, and the experts': checked before any is used.
HF_CONFIG = Table(
    {
        **decoder.HF_CONFIG.fields,
        "head_dim": optional(_size("head_dim")),
        "intermediate_size": _size("dense_hidden_dim"),
        "moe_intermediate_size": _size("expert_hidden_dim"),
        "num_experts": _size("n_experts"),  # Qwen's name; transformers 5 writes num_local_experts
        "num_local_experts": _size("n_experts"),
        "num_experts_per_tok": _size("top_k"),
        "norm_topk_prob": Flag(),
        "decoder_sparse_step": _size("n_layers"),
        "mlp_only_layers": optional(ListOf(Integer(0, LIMITS["n_layers"]), most=LIMITS["n_layers"])),
        "tie_word_embeddings": Flag(),
        "attention_bias": Flag(),
        "use_sliding_window": Flag(),
    },
    required=frozenset(
        {"hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size", "moe_intermediate_size"}
        | {"num_experts_per_tok"}
    ),
)


# --------------------------------------------------------------------------------------------------------------
# Config
# --------------------------------------------------------------------------------------------------------------


def _n_experts(hf: dict[str, Any]) -> int:
    counts = {hf[key] for key in ("num_experts", "num_local_experts") if key in hf}
    if not counts:
        raise ValueError("has no 'num_experts' (nor 'num_local_experts'): how many experts each MoE layer holds")
    if len(counts) > 1:
        raise ValueError(f"num_experts ({hf['num_experts']}) and num_local_experts ({hf['num_local_experts']}) differ")
    return counts.pop()


def _dense_layers(hf: dict[str, Any], n_layers: int) -> int:
    """How many layers are dense, when they are the first ones (HF: a layer in mlp_only_layers, or whose number
    plus one decoder_sparse_step does not divide); ValueError naming the field that makes another pattern."""
    step, only = hf.get("decoder_sparse_step", 1), set(hf.get("mlp_only_layers") or ())
    by_step = [i for i in range(n_layers) if (i + 1) % step]
    dense = sorted(set(by_step) | (only & set(range(n_layers))))
    if dense == list(range(len(dense))):
        return len(dense)
    field, value = (
        ("decoder_sparse_step", step) if by_step != list(range(len(by_step))) else ("mlp_only_layers", sorted(only))
    )
    raise ValueError(
        f"{field} = {value} makes layers {dense} dense, not the first k layers: titan's moe has no other pattern "
        "(its first dense_layers layers are dense, the others MoE)"
    )


def args_from_hf_config(hf: dict[str, Any]) -> MoEArgs:
    """`MoEArgs` for an HF Qwen3-MoE `config.json` dict; unsupported features and values of the wrong type or out of
    bounds raise ValueError naming the field."""
    decoder.check_config(hf, HF_CONFIG, MODEL_TYPE, ("attention_bias", "use_sliding_window"))
    dim, n_heads, n_layers = hf["hidden_size"], hf["num_attention_heads"], hf["num_hidden_layers"]
    n_experts, top_k = _n_experts(hf), hf["num_experts_per_tok"]
    if top_k > n_experts:
        raise ValueError(f"num_experts_per_tok ({top_k}) cannot exceed num_experts ({n_experts})")
    defaults = {**_HF_DEFAULTS, **hf}
    args = MoEArgs(
        dim=dim,
        n_layers=n_layers,
        n_heads=n_heads,
        n_kv_heads=hf.get("num_key_value_heads") or n_heads,
        head_dim=hf.get("head_dim") or dim // n_heads,
        qk_norm=True,
        vocab_size=hf["vocab_size"],
        norm_eps=float(defaults["rms_norm_eps"]),
        max_seq_len=defaults["max_position_embeddings"],
        tie_embeddings=hf.get("tie_word_embeddings", False),
        attn_dropout=float(hf.get("attention_dropout") or 0.0),
        dense_layers=_dense_layers(hf, n_layers),
        dense_hidden_dim=defaults["intermediate_size"],
        n_experts=n_experts,
        top_k=top_k,
        expert_hidden_dim=hf["moe_intermediate_size"],
        n_shared_experts=0,
        score_func="softmax",
        norm_topk=hf.get("norm_topk_prob", False),
        route_scale=1.0,
        **decoder.rope_settings(hf),
    )
    args.validate()
    return args


def hf_config_from_args(args: MoEArgs, dtype: torch.dtype | str = "float32") -> dict[str, Any]:
    """A `config.json` dict for `args` that `transformers.Qwen3MoeConfig(**d)` accepts; ValueError for args
    Qwen3-MoE cannot express. The dense layers' width is written only when there are dense layers: otherwise it
    describes nothing (transformers then takes its default)."""
    args.validate()
    if blockers := hf_format_blockers(args):
        raise ValueError("; ".join(blockers))
    dtype = str(dtype).removeprefix("torch.")
    config = {
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        "hidden_size": args.dim,
        "num_hidden_layers": args.n_layers,
        "num_attention_heads": args.n_heads,
        "num_key_value_heads": args.n_kv_heads,
        "head_dim": args.head_dim,
        "vocab_size": args.vocab_size,
        "hidden_act": "silu",
        "rms_norm_eps": args.norm_eps,
        "max_position_embeddings": args.max_seq_len,
        **decoder.rope_config(args),
        "tie_word_embeddings": args.tie_embeddings,
        "attention_bias": False,
        "use_sliding_window": False,
        "attention_dropout": args.attn_dropout,
        "num_experts": args.n_experts,
        "num_experts_per_tok": args.top_k,
        "moe_intermediate_size": args.expert_hidden_dim,
        "norm_topk_prob": args.norm_topk,
        "decoder_sparse_step": 1,
        "mlp_only_layers": list(range(args.dense_layers)),
        "initializer_range": 0.02,
        "use_cache": True,
        "dtype": dtype,
        "torch_dtype": dtype,
    }
    if args.dense_layers:
        config["intermediate_size"] = args.dense_hidden_dim
    return config


# --------------------------------------------------------------------------------------------------------------
# Weights
# --------------------------------------------------------------------------------------------------------------

# titan name -> HF name of each layer's tensors (prefixed with `layers.{i}.` and `model.layers.{i}.`): the decoder's
# attention and norms with Qwen3's q/k norms; a dense MLP in the dense layers.
_ATTENTION = {**decoder.ATTENTION_NAMES, **decoder.QK_NORM_NAMES}


def _moe_names(n_experts: int) -> dict[str, str | tuple[str, ...]]:
    """titan name -> HF name(s) of a MoE layer's feed-forward: its router, and each stacked expert tensor."""
    return {"feed_forward.router.gate.weight": "mlp.gate.weight", **expert_names(n_experts)}


def hf_sources(args: MoEArgs) -> dict[str, tuple[str | tuple[str, ...], Tensor | None]]:
    """Where each titan parameter comes from: its name -> (HF tensor name, or the names of the experts' tensors it
    stacks; rows). Titan row r of wq and wk is HF row rows[r] (Llama's RoPE layout change); of the q/k norms,
    which act on one head's coordinates, element rows[r]; rows is None for every other tensor. A tied model has no
    output.weight of its own."""
    rope_rows = decoder.attention_rope_rows(args, qk_norm=True)
    dense, moe = {**_ATTENTION, **decoder.DENSE_NAMES}, {**_ATTENTION, **_moe_names(args.n_experts)}
    return decoder.decoder_sources(args, lambda i: dense if i < args.dense_layers else moe, rope_rows)


def check_hf_names(names, args: MoEArgs) -> dict[str, str]:
    """Check the tensor names of an HF checkpoint against `args`: ValueError naming experts of another number or
    form, or listing the missing and unexpected tensors. Returns the tied copies the files hold (see the decoder's)."""
    names = {name for name in names if not decoder.IGNORED_HF.search(name)}
    check_experts(names, args.n_experts, "num_experts")
    return decoder.check_names(names, args, hf_sources(args))


def check_hf_buffers(args: MoEArgs, buffers: dict[str, Tensor]) -> None:
    """Qwen3-MoE routes without a bias: ValueError naming the first routing bias that is not zero."""
    for name, bias in buffers.items():
        if bias.any():
            raise ValueError(
                f"{name} is not zero (up to {bias.abs().max().item():.3g}): Qwen3-MoE has no routing bias, so this "
                "model routes tokens as no Qwen3-MoE does; to train an exportable model, keep the biases at zero "
                "with model.overrides.bias_update_rate = 0"
            )
