"""Llama 3: the decoder (titan/models/decoder/) with a SwiGLU feed-forward in every block."""

from __future__ import annotations

from titan.models.decoder.model import Decoder, FeedForward, TransformerBlock
from titan.models.llama.args import ModelArgs


def llama_block(layer_id: int, args: ModelArgs) -> TransformerBlock:
    return TransformerBlock(layer_id, args, FeedForward(args.dim, args.ffn_hidden_dim))


class Transformer(Decoder):
    args: ModelArgs

    def block(self, layer_id: int) -> TransformerBlock:
        return llama_block(layer_id, self.args)
