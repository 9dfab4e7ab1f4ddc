"""Llama's hyper-parameters (ModelArgs): the decoder's (titan/models/decoder/args.py) with Llama 3's defaults and
its SwiGLU's width, rounded up to a multiple."""

from __future__ import annotations

import math
from dataclasses import dataclass

from titan.models.decoder.args import LIMITS as DECODER_LIMITS
from titan.models.decoder.args import DecoderArgs

LIMITS = {**DECODER_LIMITS, "multiple_of": 2**17}


@dataclass
class ModelArgs(DecoderArgs):
    rope_scaling_factor: float = 8.0
    multiple_of: int = 1024  # the FFN hidden size is rounded up to a multiple of this
    ffn_dim_multiplier: float | None = 1.3

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def ffn_hidden_dim(self) -> int:
        hidden = int(2 * 4 * self.dim / 3)
        if self.ffn_dim_multiplier is not None:
            hidden = int(self.ffn_dim_multiplier * hidden)
        return self.multiple_of * math.ceil(hidden / self.multiple_of)

    def check_parallelism(self, tp: int, pp_stages: int, ep: int = 1, cp: int = 1) -> None:
        if ep > 1:
            raise ValueError(
                f"parallel.ep = {ep} splits the experts of a mixture of experts, and the llama3 family's feed-forwards "
                "are dense; use parallel.ep = 1, or model.name = 'moe'"
            )
        self.check_layer_split(tp, pp_stages, ("ffn_hidden_dim", self.ffn_hidden_dim))

    def block_params(self, layer: int) -> int:
        return self.attention_params() + 3 * self.dim * self.ffn_hidden_dim

    def validate(self) -> None:
        self.check_bounds(LIMITS, ("ffn_dim_multiplier",))
        if self.dim % self.n_heads or self.n_heads % self.n_kv_heads:
            raise ValueError(
                f"dim ({self.dim}) must divide by n_heads ({self.n_heads}), and n_heads by n_kv_heads "
                f"({self.n_kv_heads})"
            )
        self.check_heads()
