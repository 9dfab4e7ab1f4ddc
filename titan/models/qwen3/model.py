"""Qwen3 dense: the decoder (titan/models/decoder/) with q/k norms and a SwiGLU feed-forward in every block."""

from __future__ import annotations

from titan.models.decoder.attention import Attention
from titan.models.decoder.model import Decoder, FeedForward, TransformerBlock
from titan.models.qwen3.args import Qwen3Args


class Qwen3(Decoder):
    args: Qwen3Args

    def block(self, layer_id: int) -> TransformerBlock:
        feed_forward = FeedForward(self.args.dim, self.args.hidden_dim)
        return TransformerBlock(layer_id, self.args, feed_forward, Attention(self.args, qk_norm=True))
