"""Conversion between Hugging Face `Qwen3ForCausalLM` checkpoints and titan's qwen3 family (its HFAdapter;
titan/checkpoint/hf/ reads and writes the files).

Qwen3 dense is the decoder with q/k norms and a SwiGLU MLP: its attention converts as every decoder's
(titan/models/decoder/hf.py), the q/k rows moved within each head between HF's half-split RoPE layout and titan's
interleaved one, and the q/k norms' elements alike.
"""

from __future__ import annotations

from typing import Any

import torch

from titan.models.decoder import hf as decoder
from titan.models.qwen3.args import LIMITS, Qwen3Args
from titan.schema import Flag, Table, optional

MODEL_TYPE = "qwen3"  # config.json's, which picks this family
MODEL_TYPES = (MODEL_TYPE,)
TRAINING_CHOICES = decoder.TRAINING_CHOICES
# The decoder's fields with this family's bounds: checked before any is used.
HF_CONFIG = Table(
    {
        **decoder.HF_CONFIG.fields,
        "head_dim": optional(decoder.hf_size("head_dim", LIMITS)),
        "intermediate_size": decoder.hf_size("hidden_dim", LIMITS),
        "tie_word_embeddings": Flag(),
        "attention_bias": Flag(),
        "use_sliding_window": Flag(),
    },
    required=decoder.HF_CONFIG.required,
)


def args_from_hf_config(hf: dict[str, Any]) -> Qwen3Args:
    """`Qwen3Args` for an HF Qwen3 `config.json` dict; unsupported features and values of the wrong type or out of
    bounds raise ValueError naming the field."""
    decoder.check_config(hf, HF_CONFIG, MODEL_TYPE, ("attention_bias", "use_sliding_window"))
    dim, n_heads = hf["hidden_size"], hf["num_attention_heads"]
    args = Qwen3Args(
        dim=dim,
        n_layers=hf["num_hidden_layers"],
        n_heads=n_heads,
        n_kv_heads=hf.get("num_key_value_heads") or n_heads,
        head_dim=hf.get("head_dim") or dim // n_heads,
        hidden_dim=hf["intermediate_size"],
        vocab_size=hf["vocab_size"],
        norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        max_seq_len=hf.get("max_position_embeddings", 32768),  # transformers' Qwen3Config default
        tie_embeddings=hf.get("tie_word_embeddings", False),
        attn_dropout=float(hf.get("attention_dropout") or 0.0),
        **decoder.rope_settings(hf),
    )
    args.validate()
    return args


def hf_config_from_args(args: Qwen3Args, dtype: torch.dtype | str = "float32") -> dict[str, Any]:
    """A `config.json` dict for `args` that `transformers.Qwen3Config(**d)` accepts."""
    args.validate()
    dtype = str(dtype).removeprefix("torch.")
    return {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "hidden_size": args.dim,
        "num_hidden_layers": args.n_layers,
        "num_attention_heads": args.n_heads,
        "num_key_value_heads": args.n_kv_heads,
        "head_dim": args.head_dim,
        "intermediate_size": args.hidden_dim,
        "vocab_size": args.vocab_size,
        "hidden_act": "silu",
        "rms_norm_eps": args.norm_eps,
        "max_position_embeddings": args.max_seq_len,
        **decoder.rope_config(args),
        "tie_word_embeddings": args.tie_embeddings,
        "attention_bias": False,
        "use_sliding_window": False,
        "attention_dropout": args.attn_dropout,
        "initializer_range": 0.02,
        "use_cache": True,
        "dtype": dtype,
        "torch_dtype": dtype,
    }


_LAYER = {**decoder.ATTENTION_NAMES, **decoder.QK_NORM_NAMES, **decoder.DENSE_NAMES}


def hf_sources(args: Qwen3Args) -> dict[str, decoder.Source]:
    """Where each titan parameter comes from: its name -> (HF tensor name, rows; see decoder.decoder_sources)."""
    return decoder.decoder_sources(args, lambda _: _LAYER, decoder.attention_rope_rows(args, qk_norm=True))


def check_hf_names(names, args: Qwen3Args) -> dict[str, str]:
    """ValueError listing the missing and unexpected tensors; returns the tied copies the files hold."""
    return decoder.check_names(set(names), args, hf_sources(args))


to_hf_tensor = decoder.to_hf_tensor  # a titan tensor as HF stores it, given its rows
