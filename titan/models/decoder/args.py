"""What every decoder family's hyper-parameters share (DecoderArgs): sizes, RoPE's frequencies and dropout, their
bounds, and the checks of the layer split that tensor and pipeline parallelism make."""

from __future__ import annotations

import math
from dataclasses import dataclass

from titan.models.contract import PerRow

# The largest of each size: far above any released model (Llama 3 405B: dim 16,384, 126 layers, 128k positions),
# low enough that a crafted config or checkpoint is refused before it allocates (a RoPE table of 10^12 positions is
# 64 TB).
LIMITS = {
    "dim": 2**17,
    "n_layers": 2**12,
    "n_heads": 2**12,
    "n_kv_heads": 2**12,
    "vocab_size": 2**22,
    "max_seq_len": 2**24,
    "rope_original_max_seq_len": 2**24,
}


ROPE_SCALINGS = ("llama3", "yarn")


@dataclass
class DecoderArgs:
    """A family adds its own fields (its feed-forward's) and defaults, and a `head_dim`."""

    dim: int = 4096
    n_layers: int = 32
    n_heads: int = 32
    n_kv_heads: int = 8
    vocab_size: int = 128256
    norm_eps: float = 1e-5
    rope_theta: float = 500000.0
    # Long-context frequency scaling by rope_scaling_factor (0: none) over rope_original_max_seq_len positions:
    # "llama3", Llama 3.1's smooth long-wavelength scaling, or "yarn", YaRN's (Qwen3's and DeepSeek-V3's).
    rope_scaling: str = "llama3"
    rope_scaling_factor: float = 0.0
    rope_low_freq_factor: float = 1.0  # llama3's
    rope_high_freq_factor: float = 4.0
    rope_original_max_seq_len: int = 8192
    # YaRN's ramp from extrapolated to interpolated frequencies, in rotations (its beta_fast and beta_slow), and its
    # scale of cos and sin (HF's attention_factor; 0: 0.1 ln(factor) + 1, as the paper has it).
    rope_yarn_beta_fast: float = 32.0
    rope_yarn_beta_slow: float = 1.0
    rope_attention_factor: float = 0.0
    max_seq_len: int = 8192  # the most positions a sequence holds
    tie_embeddings: bool = False
    attn_dropout: float = 0.0
    resid_dropout: float = 0.0

    # A family adds `head_dim`, each head's width (a field, or a property of dim and n_heads).

    @property
    def per_row(self) -> PerRow | None:
        """Dropout, when on: its masks are keyed by row and position."""
        if self.attn_dropout > 0 or self.resid_dropout > 0:
            return PerRow(
                "dropout", "titan keys its masks by row and position", "set attn_dropout and resid_dropout to 0"
            )
        return None

    @property
    def stage_width(self) -> int:
        """The width of the hidden states pipeline stages pass on: dim (a family may pass more along with them)."""
        return self.dim

    @property
    def rope_dim(self) -> int:
        """Each head's width that RoPE rotates: all of it (latent attention rotates a part of its own)."""
        return self.head_dim

    def validate(self) -> None:
        self.check_bounds()
        self.check_heads()

    def check_bounds(self, limits: dict[str, int] = LIMITS, positive: tuple[str, ...] = ()) -> None:
        """ValueError naming the first field out of its bounds: the sizes' `limits` (a family's own among them),
        and the numbers that must be finite and > 0 (`positive`: a family's own besides RoPE's and the norm's)."""
        for name, most in limits.items():
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
            if getattr(self, name) > most:
                raise ValueError(f"{name} must be at most {most:,}, got {getattr(self, name):,}")
        rope = ("rope_low_freq_factor", "rope_high_freq_factor", "rope_yarn_beta_fast", "rope_yarn_beta_slow")
        for name in ("norm_eps", "rope_theta", *rope, *positive):
            value = getattr(self, name)
            if value is not None and not 0 < value < math.inf:  # NaN too
                raise ValueError(f"{name} must be a finite number > 0, got {value}")
        for name in ("rope_scaling_factor", "rope_attention_factor"):
            if not 0 <= getattr(self, name) < math.inf:
                raise ValueError(f"{name} must be a finite number >= 0 (0: none), got {getattr(self, name)}")
        if self.rope_scaling not in ROPE_SCALINGS:
            raise ValueError(f"rope_scaling must be one of {', '.join(ROPE_SCALINGS)}, got {self.rope_scaling!r}")

    def check_heads(self) -> None:
        """ValueError when the heads cannot be grouped or rotated, or a dropout is not a probability."""
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_heads ({self.n_heads}) must divide by n_kv_heads ({self.n_kv_heads})")
        if self.head_dim % 2:
            raise ValueError(f"head_dim ({self.head_dim}) must be even for RoPE")
        for name in ("attn_dropout", "resid_dropout"):
            if not 0 <= getattr(self, name) < 1:
                raise ValueError(f"{name} must be in [0, 1), got {getattr(self, name)}")

    def check_layer_split(self, tp: int, pp_stages: int, dense: tuple[str, int] | None, kv_heads: bool = True) -> None:
        """ValueError when tensor parallelism or the pipeline stages cannot split the layers: tp splits the heads
        (and the kv heads, where the attention has them: `kv_heads`), the vocabulary and the dense feed-forwards'
        hidden units (`dense`: their field's name and width; None: the model has none)."""
        heads = [("n_heads", self.n_heads)] + ([("n_kv_heads", self.n_kv_heads)] if kv_heads else [])
        sizes = [*heads, *([dense] if dense else [])]
        for name, size in (*sizes, ("vocab_size", self.vocab_size)):
            if size % tp:
                raise ValueError(f"parallel.tp = {tp} must divide the model's {name} ({size})")
        if self.tie_embeddings and pp_stages > 1:
            raise ValueError(
                "tied embeddings (model tie_embeddings) cannot be split across pipeline stages; use parallel.pp = 1"
            )
        if pp_stages > self.n_layers:
            raise ValueError(
                f"{pp_stages} pipeline stages (parallel.pp x stages per rank) exceed the model's {self.n_layers} layers"
            )

    def attention_params(self, qk_norm: bool = False) -> int:
        """A block's parameters but its feed-forward's: q, k, v and o, each head's q and k norms if it has them, and
        the block's two RMSNorms."""
        qkvo = self.dim * self.head_dim * (2 * self.n_heads + 2 * self.n_kv_heads)
        return qkvo + (2 * self.head_dim if qk_norm else 0) + 2 * self.dim


def kv_width(args: DecoderArgs) -> int:
    """One token's keys (or values) in one layer: its kv heads' dimensions."""
    return args.n_kv_heads * args.head_dim
