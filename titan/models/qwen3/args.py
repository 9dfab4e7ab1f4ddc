"""Qwen3's dense hyper-parameters (Qwen3Args): the decoder's, with heads of their own width, q/k norms and a SwiGLU of
`hidden_dim` (not rounded)."""

from __future__ import annotations

from dataclasses import dataclass

from titan.models.decoder.args import LIMITS as DECODER_LIMITS
from titan.models.decoder.args import DecoderArgs

LIMITS = {**DECODER_LIMITS, "head_dim": 2**12, "hidden_dim": 2**19}


@dataclass
class Qwen3Args(DecoderArgs):
    # Qwen3-8B's (transformers' Qwen3Config for Qwen/Qwen3-8B).
    dim: int = 4096
    n_layers: int = 36
    n_heads: int = 32
    n_kv_heads: int = 8
    vocab_size: int = 151936
    norm_eps: float = 1e-6
    rope_theta: float = 1000000.0
    max_seq_len: int = 40960
    head_dim: int = 128  # each head's width: Qwen3's heads are wider than dim / n_heads in the smaller models
    hidden_dim: int = 12288  # the SwiGLU's hidden units (HF's intermediate_size)

    def check_parallelism(self, tp: int, pp_stages: int, ep: int = 1, cp: int = 1) -> None:
        if ep > 1:
            raise ValueError(
                f"parallel.ep = {ep} splits the experts of a mixture of experts, and the qwen3 family's feed-forwards "
                "are dense; use parallel.ep = 1, or model.name = 'moe'"
            )
        self.check_layer_split(tp, pp_stages, ("hidden_dim", self.hidden_dim))

    def block_params(self, layer: int) -> int:
        return self.attention_params(qk_norm=True) + 3 * self.dim * self.hidden_dim

    def validate(self) -> None:
        self.check_bounds(LIMITS)
        self.check_heads()
