"""The decoder every family builds on, in plain PyTorch: RMSNorm, RoPE with Llama 3.1 frequency scaling (rope.py),
grouped-query attention (attention.py), blocks of attention and a feed-forward the family picks (a SwiGLU, or a
mixture of experts), and the stack of blocks between the embedding and the output head.

The model knows nothing of parallelism: titan applies FSDP/TP/PP from outside. Parameter names follow Meta's
checkpoints (tok_embeddings, layers.N.attention.wq, ...), and q/k use Meta's interleaved RoPE layout. Build it on the
meta device, move it with `to_empty`, then call `init_weights` (or `init_buffers` and load weights).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention.flex_attention import BlockMask

from titan import rng
from titan.models.contract import Routing
from titan.models.decoder.args import DecoderArgs
from titan.models.decoder.attention import Attention, MaskForm, document_mask
from titan.models.decoder.kv_cache import KVCache, cached_positions_and_mask
from titan.models.decoder.rope import document_positions, rope_table


class FeedForward(nn.Module):
    """SwiGLU of `hidden` units."""

    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self, layer_id: int, args: DecoderArgs, feed_forward: nn.Module, attention: nn.Module | None = None):
        """feed_forward: x (rows, seq, dim) -> (rows, seq, dim), e.g. a FeedForward, or a mixture of experts.
        attention: grouped-query Attention by default, or latent attention."""
        super().__init__()
        self.layer_id = layer_id
        self.attention_norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.attention = attention if attention is not None else Attention(args)
        self.ffn_norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.feed_forward = feed_forward
        self.attention_dropout = rng.Dropout(args.resid_dropout)  # on each residual branch's output
        self.ffn_dropout = rng.Dropout(args.resid_dropout)

    def forward(
        self,
        x: torch.Tensor,
        rope: torch.Tensor,
        rows: torch.Tensor,
        mask: torch.Tensor | BlockMask | list | None = None,
        cache: KVCache | None = None,
    ) -> torch.Tensor:
        # cache by keyword: tensor parallelism's input plan for the attention lists its positional inputs.
        x = x + self.attention_dropout(self.attention(self.attention_norm(x), rope, rows, mask, cache=cache), rows)
        return x + self.ffn_dropout(self.feed_forward(self.ffn_norm(x)), rows)


class Decoder(nn.Module):
    """The embedding, the blocks a family builds (`block`) and the output head."""

    routing: Routing | None = None  # a dense model has no experts to route to
    # The parameters that end a residual branch, whose initial values shrink with depth (by name's end).
    residual_outputs: tuple[str, ...] = ("attention.wo.weight", "w2.weight")

    def __init__(self, args: DecoderArgs, traceable: bool = False):
        """traceable: for compiled blocks and fake tensors. Documents then take a boolean mask rather than attention
        one document at a time on the CPU (see document_mask), whose spans are Python lists read from the data:
        compiled blocks would recompile for every batch."""
        super().__init__()
        args.validate()
        self.args, self.traceable = args, traceable
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        # A ModuleDict keyed by layer number keeps parameter names stable when pipeline stages drop layers.
        self.layers = nn.ModuleDict({str(i): self.block(i) for i in range(args.n_layers)})
        self.norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)
        if args.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        self.register_buffer("rope", rope_table(args), persistent=False)
        # Context parallelism's view of the sequence (titan/parallel/cp/ring.py): `positions`, the positions of each row
        # that this rank's tokens hold, and mask(document_ids), what its attention's ring needs of the documents.
        self.context_parallel = None
        # Sequence parallelism's slot (titan/parallel/parallelize.py): into how many shards of the sequence a later
        # pipeline stage's hidden states are cut.
        self.sequence_shards = 1
        self.name_dropout_streams()

    def name_dropout_streams(self) -> None:
        """Each dropout's mask stream: its module's name, the same on every layout."""
        for name, module in self.named_modules():
            if isinstance(module, rng.Dropout):
                module.stream = name

    def block(self, layer_id: int) -> TransformerBlock:
        """Layer `layer_id`, as the family builds it."""
        raise NotImplementedError

    def _apply(self, fn, recurse=True):
        # `to_empty`, `to` and friends give each module its own new tensor, which would untie the head.
        super()._apply(fn, recurse)
        if self.args.tie_embeddings and self.output is not None and self.tok_embeddings is not None:
            self.output.weight = self.tok_embeddings.weight
        return self

    def forward(
        self,
        tokens: torch.Tensor,
        rows: torch.Tensor | None = None,
        document_ids: torch.Tensor | None = None,
        cache: list[KVCache] | None = None,
        local: bool = False,
        labels: torch.Tensor | None = None,
    ):
        """tokens: (batch, seq) ids -> logits (batch, seq, vocab).

        rows: each sample's row in the step's global batch, which dropout masks are keyed by (default:
        0..batch-1). document_ids (batch, seq): packed documents (consecutive tokens with one id), each
        attending only to itself, with positions from 0 (default: one causal sequence). Pipeline stages
        other than the first take hidden states for `tokens`, and stages other than the last return their
        hidden states and the other arguments given, for the next stage. cache: a KVCache per layer, for
        decoding (one causal sequence, no document_ids; see kv_cache): `tokens` follow the cached ones, which they
        attend to, and are added to the cache. local: under context parallelism, `tokens` are whole rows of this
        rank's own, attended without the ring (default: this rank's positions of rows its cp group shares).
        labels: a training forward's (the model contract's); the decoder trains on the next token alone, whose loss
        the step computes from the logits, so it does not read them.
        """
        rows, rope, mask = self.attention_inputs(tokens, rows, document_ids, cache, local)
        h = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens
        h = self.through_blocks(h, rows, rope, mask, cache)
        if self.output is None:
            return (h, rows) if document_ids is None else (h, rows, document_ids)
        return self.output(self.norm(h))

    def attention_inputs(
        self,
        tokens: torch.Tensor,
        rows: torch.Tensor | None,
        document_ids: torch.Tensor | None,
        cache: list[KVCache] | None,
        local: bool,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | BlockMask | list | None]:
        """What every block takes besides the hidden states, from forward's arguments: (rows, RoPE, mask)."""
        if rows is None:
            rows = torch.arange(tokens.shape[0], device=tokens.device)
        if cache:  # a pipeline stage without layers has an empty cache, and nothing to attend with
            # The new tokens follow the cached ones; an explicit mask, as SDPA's is_causal would align this
            # non-square one top-left. A later pipeline stage's hidden states may be a sequence shard.
            seq = tokens.shape[1] * (1 if self.tok_embeddings is not None else self.sequence_shards)
            positions, mask = cached_positions_and_mask(cache[0].pad, cache[0].length, seq)
            # Padding after the last token (a sequence-parallel forward's) may count past the table; none attends to it.
            rope = self.rope[positions.clamp(max=len(self.rope) - 1)]
        elif self.context_parallel is not None and not local:
            # `tokens` are this rank's positions of each row: RoPE and documents follow from the whole row's.
            here = self.context_parallel.positions
            rope = (
                self.rope[here].unsqueeze(0)
                if document_ids is None
                else self.rope[document_positions(document_ids)[:, here]]
            )
            mask = self.context_parallel.mask(document_ids)
        elif document_ids is None:
            # The whole table: a later pipeline stage's hidden states may be a sequence shard (sequence
            # parallel), while attention sees the whole sequence and takes its length from the table.
            rope, mask = self.rope.unsqueeze(0), None
        else:
            rope = self.rope[document_positions(document_ids)]
            explicit = self.training and self.args.attn_dropout > 0  # dropout on the probabilities needs them all
            if tokens.is_cuda and not explicit:
                form = MaskForm.FLEX
            else:
                form = MaskForm.DENSE if explicit or self.traceable else MaskForm.SPANS
            mask = document_mask(document_ids, form)
        return rows, rope, mask

    def through_blocks(self, h: torch.Tensor, rows, rope, mask, cache: list[KVCache] | None = None) -> torch.Tensor:
        """The hidden states through the blocks."""
        for i, layer in enumerate(self.layers.values()):
            h = layer(h, rope, rows, mask, None if cache is None else cache[i])
        return h

    def step_losses(self) -> dict[str, torch.Tensor]:
        """None (the model contract's): the decoder's objective is the step's next-token loss alone."""
        return {}

    def kv_cache(self, batch: int, max_len: int, pad: torch.Tensor | None = None) -> list[KVCache]:
        """A KVCache per layer for decoding up to max_len tokens of `batch` rows; pad: each row's slots of left
        padding (default none), on the model's device."""
        if pad is None:
            pad = torch.zeros(batch, dtype=torch.long, device=self.rope.device)
        return [KVCache(max_len, pad) for _ in self.layers]

    def init_buffers(self, positions: int | None = None) -> None:
        """Compute the buffers, which depend on the args alone (the RoPE table, in fp32 whatever the parameters'
        dtype, for the first `positions`: default all of max_seq_len), leaving the parameters as they are: with
        weights loaded from a checkpoint, the model is complete."""
        self.rope = rope_table(self.args, device=self.rope.device, positions=positions)

    @torch.no_grad()
    def init_weights(self, seed: int) -> None:
        """Initialise every parameter from (seed, parameter name) alone, so any sharding gets the same values."""
        self.init_buffers()
        for module in self.modules():
            if isinstance(module, rng.Dropout):
                module.seed = seed
        for name, param in self.named_parameters():
            if name.endswith("norm.weight"):
                param.fill_(1.0)
            elif name == "tok_embeddings.weight" and not self.args.tie_embeddings:
                rng.normal_(param, std=1.0, seed=seed, stream=name)
            elif name in ("output.weight", "tok_embeddings.weight"):  # a tied embedding serves as the head
                std = self.args.dim**-0.5
                rng.trunc_normal_(param, std=std, a=-3 * std, b=3 * std, seed=seed, stream=name)
            else:
                # Output projections of each residual branch shrink with depth: their block's layer number, the
                # second part of the name (layers.N..., and a family's blocks after the stack alike).
                std = 0.02
                if name.endswith(self.residual_outputs):
                    std = 0.02 / math.sqrt(2 * (int(name.split(".")[1]) + 1))
                rng.trunc_normal_(param, std=std, a=-3 * std, b=3 * std, seed=seed, stream=name)
