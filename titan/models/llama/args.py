"""Llama's hyper-parameters (ModelArgs): its sizes, RoPE's frequencies and dropout, checked once."""

from __future__ import annotations

import math
from dataclasses import dataclass

from titan.models.contract import PerRow

# The largest of each size: far above any Llama (405B: dim 16,384, 126 layers, 128k positions), low enough that a
# crafted config or checkpoint is refused before it allocates (a RoPE table of 10^12 positions is 64 TB).
LIMITS = {
    "dim": 2**17,
    "n_layers": 2**12,
    "n_heads": 2**12,
    "n_kv_heads": 2**12,
    "vocab_size": 2**22,
    "multiple_of": 2**17,
    "max_seq_len": 2**24,
    "rope_original_max_seq_len": 2**24,
}


@dataclass
class ModelArgs:
    dim: int = 4096
    n_layers: int = 32
    n_heads: int = 32
    n_kv_heads: int = 8
    vocab_size: int = 128256
    multiple_of: int = 1024  # the FFN hidden size is rounded up to a multiple of this
    ffn_dim_multiplier: float | None = 1.3
    norm_eps: float = 1e-5
    rope_theta: float = 500000.0
    # Llama 3.1 long-context frequency scaling; factor 0 disables it.
    rope_scaling_factor: float = 8.0
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_original_max_seq_len: int = 8192
    max_seq_len: int = 8192  # RoPE table length
    tie_embeddings: bool = False
    attn_dropout: float = 0.0
    resid_dropout: float = 0.0

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def ffn_hidden_dim(self) -> int:
        hidden = int(2 * 4 * self.dim / 3)
        if self.ffn_dim_multiplier is not None:
            hidden = int(self.ffn_dim_multiplier * hidden)
        return self.multiple_of * math.ceil(hidden / self.multiple_of)

    @property
    def per_row(self) -> PerRow | None:
        return dropout_per_row(self)

    def check_parallelism(self, tp: int, pp_stages: int, ep: int = 1, cp: int = 1) -> None:
        if ep > 1:
            raise ValueError(
                f"parallel.ep = {ep} splits the experts of a mixture of experts, and the llama3 family's feed-forwards "
                "are dense; use parallel.ep = 1, or model.name = 'moe'"
            )
        check_layer_split(self, tp, pp_stages)

    def block_params(self, layer: int) -> int:
        return attention_params(self) + 3 * self.dim * self.ffn_hidden_dim

    def validate(self) -> None:
        for name, most in LIMITS.items():
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
            if getattr(self, name) > most:
                raise ValueError(f"{name} must be at most {most:,}, got {getattr(self, name):,}")
        for name in ("norm_eps", "rope_theta", "rope_low_freq_factor", "rope_high_freq_factor", "ffn_dim_multiplier"):
            value = getattr(self, name)
            if value is not None and not 0 < value < math.inf:  # NaN too
                raise ValueError(f"{name} must be a finite number > 0, got {value}")
        if not 0 <= self.rope_scaling_factor < math.inf:
            raise ValueError(
                f"rope_scaling_factor must be a finite number >= 0 (0: none), got {self.rope_scaling_factor}"
            )
        if self.dim % self.n_heads or self.n_heads % self.n_kv_heads:
            raise ValueError(
                f"dim ({self.dim}) must divide by n_heads ({self.n_heads}), and n_heads by n_kv_heads "
                f"({self.n_kv_heads})"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim ({self.head_dim}) must be even for RoPE")
        for name in ("attn_dropout", "resid_dropout"):
            if not 0 <= getattr(self, name) < 1:
                raise ValueError(f"{name} must be in [0, 1), got {getattr(self, name)}")


def dropout_per_row(args) -> PerRow | None:
    """Dropout, when on: its masks are keyed by row and position."""
    if args.attn_dropout > 0 or args.resid_dropout > 0:
        return PerRow("dropout", "titan keys its masks by row and position", "set attn_dropout and resid_dropout to 0")
    return None


def check_layer_split(args, tp: int, pp_stages: int) -> None:
    """ValueError when tensor parallelism or the pipeline stages cannot split Llama's layers (the MoE family's too)."""
    for name, size in (
        ("n_heads", args.n_heads),
        ("n_kv_heads", args.n_kv_heads),
        ("ffn_hidden_dim", args.ffn_hidden_dim),
        ("vocab_size", args.vocab_size),
    ):
        if size % tp:
            raise ValueError(f"parallel.tp = {tp} must divide the model's {name} ({size})")
    if args.tie_embeddings and pp_stages > 1:
        raise ValueError(
            "tied embeddings (model tie_embeddings) cannot be split across pipeline stages; use parallel.pp = 1"
        )
    if pp_stages > args.n_layers:
        raise ValueError(
            f"{pp_stages} pipeline stages (parallel.pp x stages per rank) exceed the model's {args.n_layers} layers"
        )


def attention_params(args, qk_norm: bool = False) -> int:
    """A block's parameters but its feed-forward's: q, k, v and o, each head's q and k norms if it has them, and the
    block's two RMSNorms."""
    qkvo = args.dim * args.head_dim * (2 * args.n_heads + 2 * args.n_kv_heads)
    return qkvo + (2 * args.head_dim if qk_norm else 0) + 2 * args.dim
