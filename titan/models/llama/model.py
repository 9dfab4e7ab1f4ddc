"""Llama 3 in plain PyTorch: RMSNorm, RoPE with Llama 3.1 frequency scaling, grouped-query attention, SwiGLU.

The model knows nothing of parallelism: titan applies FSDP/TP/PP from outside. Parameter names follow
Meta's checkpoints (tok_embeddings, layers.N.attention.wq, ...), and q/k use Meta's interleaved RoPE layout.
Build it on the meta device, move it with `to_empty`, then call `init_weights` (or `init_buffers` and load weights).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention

from titan import rng

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
    def has_dropout(self) -> bool:
        return self.attn_dropout > 0 or self.resid_dropout > 0

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


def rope_frequencies(args: ModelArgs) -> torch.Tensor:
    """Inverse frequencies per rotated pair, with Llama 3.1's smooth long-wavelength scaling."""
    freqs = 1.0 / (args.rope_theta ** (torch.arange(0, args.head_dim, 2, dtype=torch.float64) / args.head_dim))
    if args.rope_scaling_factor:
        low_wavelen = args.rope_original_max_seq_len / args.rope_low_freq_factor
        high_wavelen = args.rope_original_max_seq_len / args.rope_high_freq_factor
        wavelen = 2 * math.pi / freqs
        smooth = (args.rope_original_max_seq_len / wavelen - args.rope_low_freq_factor) / (
            args.rope_high_freq_factor - args.rope_low_freq_factor
        )
        blended = (1 - smooth) * freqs / args.rope_scaling_factor + smooth * freqs
        freqs = torch.where(wavelen > low_wavelen, freqs / args.rope_scaling_factor, freqs)
        in_between = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        freqs = torch.where(in_between, blended, freqs)
    return freqs


def rope_table(args: ModelArgs, device=None) -> torch.Tensor:
    """(max_seq_len, head_dim/2, 2) table of cos and sin."""
    positions = torch.arange(args.max_seq_len, dtype=torch.float64)
    angles = torch.outer(positions, rope_frequencies(args))
    return torch.stack([angles.cos(), angles.sin()], dim=-1).float().to(device)


def apply_rope(x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
    """Rotate interleaved pairs (x[2i], x[2i+1]) of x: (batch, seq, heads, head_dim) by the angles of each
    token's position, rope: (batch or 1, seq or more, head_dim/2, 2), of which x takes the first seq."""
    rope = rope[:, : x.shape[1]]
    pairs = x.float().unflatten(-1, (-1, 2))
    cos, sin = rope[:, :, None, :, 0], rope[:, :, None, :, 1]
    real, imag = pairs[..., 0], pairs[..., 1]
    rotated = torch.stack([real * cos - imag * sin, real * sin + imag * cos], dim=-1)
    return rotated.flatten(-2).type_as(x)


@functools.cache
def compiled_flex_attention():
    """Flex attention is fast only compiled (eager, it materialises the scores); built on first use, as
    torch.compile imports dynamo, which CPU runs never need. Compiled for fixed shapes: packed micro-batches come in
    the few lengths of flex_length, so it compiles once per length bucket (see attend_flex)."""
    return torch.compile(flex_attention, dynamic=False)


# Flex attention's block size: lengths are padded to a power of two from here.
FLEX_MIN_LENGTH = 128
# Compiles of flex attention allowed in one process: one per power-of-two length from 128 to 2**20 tokens, where
# dynamo's default (8) would stop at 16,384 and fall back to the unfused, materialising eager kernel.
FLEX_RECOMPILE_LIMIT = 16


def flex_length(seq: int) -> int:
    """The length flex attention runs a micro-batch of `seq` tokens at: the next power of two from 128. Packed
    micro-batches have a new length every step; bucketed, the compiled kernel sees at most log2(seq / 128) + 1
    shapes and recompiles only for those (the padding costs little but its memory: see document_mask)."""
    return max(FLEX_MIN_LENGTH, 1 << (seq - 1).bit_length())


def attend_flex(q, k, v, mask: BlockMask, attention=None) -> torch.Tensor:
    """Flex attention of (batch, heads, seq, head_dim) q, k, v under a document mask built for flex_length(seq)
    tokens: padded to that length, attended, cut back. `attention`: the kernel (default the compiled one)."""
    seq = q.shape[2]
    pad = flex_length(seq) - seq
    q, k, v = (F.pad(t, (0, 0, 0, pad)) for t in (q, k, v))
    if attention is None:
        attention = compiled_flex_attention()
    limit = max(FLEX_RECOMPILE_LIMIT, torch._dynamo.config.recompile_limit)
    with torch._dynamo.config.patch(recompile_limit=limit):
        out = attention(q, k, v, block_mask=mask, enable_gqa=True)
    return out[:, :, :seq]


def document_mask(document_ids: torch.Tensor, flex: bool, dense: bool) -> torch.Tensor | BlockMask | list:
    """Where a query may attend to a key: earlier or same position, same document.

    On GPUs a flex attention block mask, whose kernel skips the blocks that are all masked, for flex_length(seq)
    tokens: each padding token is a document of its own, so it attends to itself alone and no real token sees it,
    and the padding's blocks off the diagonal are skipped. When `dense` (attention dropout materialises the
    probabilities; compiled blocks) a boolean (batch, 1, seq, seq) mask. Otherwise (the CPU, where flex attention
    has no backward in torch 2.13) each row's document spans [(start, stop, id)], attended one document at a time:
    a document of s tokens then costs s² rather than the row's seq², which is what cost-balanced packing
    (titan/data/packing.py) assumes."""
    batch, seq = document_ids.shape
    if flex:
        length = flex_length(seq)
        padding = -1 - torch.arange(length - seq, device=document_ids.device)  # ids no real document has
        ids = torch.cat([document_ids, padding.expand(batch, -1)], dim=1)

        def same_document_causal(b, h, q, kv):
            return (q >= kv) & (ids[b, q] == ids[b, kv])

        return create_block_mask(same_document_causal, batch, None, length, length, device=document_ids.device)
    if dense:
        causal = torch.ones(seq, seq, dtype=torch.bool, device=document_ids.device).tril()
        return ((document_ids[:, :, None] == document_ids[:, None, :]) & causal).unsqueeze(1)
    spans = []
    for row in document_ids.cpu():
        ids, counts = torch.unique_consecutive(row, return_counts=True)
        stops = counts.cumsum(0).tolist()
        spans.append([(stop - n, stop, doc) for stop, n, doc in zip(stops, counts.tolist(), ids.tolist())])
    return spans


def attend_per_document(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spans: list) -> torch.Tensor:
    """Causal attention within each document span of each row (see document_mask). Rows and documents are cut
    with unbind and split, whose backward is one stack or cat: a slice's would fill a zero tensor of the whole
    input for every document."""
    rows = []
    for q_row, k_row, v_row, row_spans in zip(q.unbind(0), k.unbind(0), v.unbind(0), spans):
        sizes = [stop - start for start, stop, _ in row_spans]
        pieces = [
            F.scaled_dot_product_attention(qs[None], ks[None], vs[None], is_causal=True, enable_gqa=True)
            for qs, ks, vs in zip(q_row.split(sizes, dim=1), k_row.split(sizes, dim=1), v_row.split(sizes, dim=1))
        ]
        rows.append(torch.cat(pieces, dim=2))
    return torch.cat(rows)


def document_positions(document_ids: torch.Tensor) -> torch.Tensor:
    """Each token's position within its document: 0 where the id changes (and at the start), counting up.
    Derived from the ids, not passed along, so pipeline stages never index the RoPE table with anything but
    positions in [0, seq)."""
    index = torch.arange(document_ids.shape[1], device=document_ids.device).expand_as(document_ids)
    starts = torch.ones_like(document_ids, dtype=torch.bool)
    starts[:, 1:] = document_ids[:, 1:] != document_ids[:, :-1]
    return index - torch.where(starts, index, 0).cummax(dim=1).values


class KVCache:
    """One layer's keys and values of the tokens so far, for max_len tokens, so that decoding computes only the new
    token's and attends to every earlier one without recomputing it.

    Rows of a batch may hold prompts of different lengths, left-padded to one: row b's first pad[b] slots are padding,
    which no real token attends to, and its positions count from its first real token. The buffers are allocated on
    the first tokens, in their dtype, device and number of heads (a tensor-parallel rank holds a slice of them)."""

    def __init__(self, max_len: int, pad: torch.Tensor):
        self.max_len, self.pad = max_len, pad
        self.keys: torch.Tensor | None = None
        self.values: torch.Tensor | None = None
        self.length = 0  # slots filled: the slot of the next token

    def extend(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store the new tokens' keys and values (batch, n_kv_heads, seq, head_dim) after the cached ones;
        returns those of every token so far."""
        if self.keys is None:
            batch, heads, _, head_dim = k.shape
            self.keys = k.new_zeros(batch, heads, self.max_len, head_dim)
            self.values = torch.zeros_like(self.keys)
        stop = self.length + k.shape[2]
        self.keys[:, :, self.length : stop] = k
        self.values[:, :, self.length : stop] = v
        self.length = stop
        return self.keys[:, :, :stop], self.values[:, :, :stop]


def cached_positions_and_mask(pad: torch.Tensor, start: int, seq: int) -> tuple[torch.Tensor, torch.Tensor]:
    """For `seq` new tokens in cache slots start.. of left-padded rows (pad: (batch,) slots of padding): their
    positions (batch, seq), counted from each row's first real token, and where they may attend (batch, 1, seq,
    start + seq): the earlier and same slots that are not padding. A padding slot attends to itself alone, so that
    its output (never read) stays finite: a row of nothing to attend to would give NaN, and NaN values times a zero
    probability are still NaN in the real tokens' attention."""
    slots = torch.arange(start, start + seq, device=pad.device)
    keys = torch.arange(start + seq, device=pad.device)
    mask = (keys <= slots[:, None]) & (keys >= pad[:, None, None])
    mask |= keys == slots[:, None]
    return (slots - pad[:, None]).clamp(min=0), mask.unsqueeze(1)


class Attention(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = args.n_heads, args.n_kv_heads, args.head_dim
        self.dropout = rng.Dropout(args.attn_dropout)  # on the attention probabilities
        self.wq = nn.Linear(args.dim, args.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(args.dim, args.n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(args.dim, args.n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(args.n_heads * self.head_dim, args.dim, bias=False)
        # Context parallelism installs its ring here (titan/parallel/cp.py): attend(q, k, v, mask, rows, dropout).
        self.context_parallel = None

    def forward(
        self,
        x: torch.Tensor,
        rope: torch.Tensor,
        rows: torch.Tensor,
        mask: torch.Tensor | BlockMask | list | None,
        cache: KVCache | None = None,
    ) -> torch.Tensor:
        """mask: from document_mask; None: causal. cache: this layer's, when decoding (see Transformer.forward)."""
        batch, seq, _ = x.shape
        # -1 heads: under tensor parallelism each rank holds a slice of the heads.
        q = self.wq(x).view(batch, seq, -1, self.head_dim)
        k = self.wk(x).view(batch, seq, -1, self.head_dim)
        v = self.wv(x).view(batch, seq, -1, self.head_dim)
        q, k = apply_rope(q, rope), apply_rope(k, rope)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        if cache is not None:
            k, v = cache.extend(k, v)
        if self.context_parallel is not None and self.context_parallel.is_ring(mask):
            # This rank's chunks of the sequence; the others' come round a ring.
            out = self.context_parallel.attend(q, k, v, mask, rows, self.dropout if self.training else None)
        elif isinstance(mask, BlockMask):
            out = attend_flex(q, k, v, mask)
        elif isinstance(mask, list):
            out = attend_per_document(q, k, v, mask)
        elif self.training and self.dropout.p:
            # SDPA draws its own dropout mask; titan's mask must come from its counter-based RNG.
            k, v = (t.repeat_interleave(q.shape[1] // t.shape[1], dim=1) for t in (k, v))
            if mask is None:
                mask = torch.ones(seq, seq, dtype=torch.bool, device=x.device).tril()
            # The mask as the bias and the scale as the alpha of the scores' matmul: two fewer passes over the
            # (batch, heads, seq, seq) scores each way, which on a CPU cost more than the matmul itself.
            heads = q.shape[1]
            bias = torch.zeros(mask.shape, dtype=q.dtype, device=x.device).masked_fill_(~mask, float("-inf"))
            if bias.ndim == 4:  # a mask per row (documents): one per row and head
                bias = bias.expand(batch, heads, seq, seq).flatten(0, 1)
            scores = torch.baddbmm(bias, q.flatten(0, 1), k.flatten(0, 1).transpose(1, 2), alpha=self.head_dim**-0.5)
            probs = scores.view(batch, heads, seq, seq).softmax(dim=-1, dtype=torch.float32).type_as(q)
            out = self.dropout(probs, rows) @ v
        else:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None, enable_gqa=True)
        return self.wo(out.transpose(1, 2).reshape(batch, seq, -1))


class FeedForward(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.w1 = nn.Linear(args.dim, args.ffn_hidden_dim, bias=False)
        self.w2 = nn.Linear(args.ffn_hidden_dim, args.dim, bias=False)
        self.w3 = nn.Linear(args.dim, args.ffn_hidden_dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self, layer_id: int, args: ModelArgs):
        super().__init__()
        self.layer_id = layer_id
        self.attention_norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.attention = Attention(args)
        self.ffn_norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.feed_forward = FeedForward(args)
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


class Transformer(nn.Module):
    def __init__(self, args: ModelArgs, traceable: bool = False):
        """traceable: for compiled blocks and fake tensors. Documents then take a boolean mask rather than attention
        one document at a time on the CPU (see document_mask), whose spans are Python lists read from the data:
        compiled blocks would recompile for every batch."""
        super().__init__()
        args.validate()
        self.args, self.traceable = args, traceable
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        # A ModuleDict keyed by layer number keeps parameter names stable when pipeline stages drop layers.
        self.layers = nn.ModuleDict({str(i): TransformerBlock(i, args) for i in range(args.n_layers)})
        self.norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)
        if args.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        self.register_buffer("rope", rope_table(args), persistent=False)
        # Context parallelism's view of the sequence (titan/parallel/cp.py): `positions`, the positions of each row
        # that this rank's tokens hold, and mask(document_ids), what its attention's ring needs of the documents.
        self.context_parallel = None
        for name, module in self.named_modules():
            if isinstance(module, rng.Dropout):
                module.stream = name  # the mask's stream: the same name on every layout

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
        """
        if rows is None:
            rows = torch.arange(tokens.shape[0], device=tokens.device)
        seq = tokens.shape[1]
        if cache is not None:
            # The new tokens follow the cached ones; an explicit mask, as SDPA's is_causal would align this
            # non-square one top-left.
            positions, mask = cached_positions_and_mask(cache[0].pad, cache[0].length, seq)
            rope = self.rope[positions]
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
            flex = tokens.is_cuda and not explicit
            mask = document_mask(document_ids, flex, dense=explicit or self.traceable)
        h = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens
        for i, layer in enumerate(self.layers.values()):
            h = layer(h, rope, rows, mask, None if cache is None else cache[i])
        if self.output is None:
            return (h, rows) if document_ids is None else (h, rows, document_ids)
        return self.output(self.norm(h))

    def kv_cache(self, batch: int, max_len: int, pad: torch.Tensor | None = None) -> list[KVCache]:
        """A KVCache per layer for decoding up to max_len tokens of `batch` rows; pad: each row's slots of left
        padding (default none), on the model's device."""
        if pad is None:
            pad = torch.zeros(batch, dtype=torch.long, device=self.rope.device)
        return [KVCache(max_len, pad) for _ in self.layers]

    def init_buffers(self) -> None:
        """Compute the buffers, which depend on the args alone (the RoPE table, in fp32 whatever the parameters'
        dtype), leaving the parameters as they are: with weights loaded from a checkpoint, the model is complete."""
        self.rope = rope_table(self.args, device=self.rope.device)

    @torch.no_grad()
    def init_weights(self, seed: int) -> None:
        """Initialise every parameter from (seed, parameter name) alone, so any sharding gets the same values."""
        self.init_buffers()
        for module in self.modules():
            if isinstance(module, rng.Dropout):
                module.seed = seed
        depth_std = {f"layers.{i}.": 0.02 / math.sqrt(2 * (i + 1)) for i in range(self.args.n_layers)}
        for name, param in self.named_parameters():
            if name.endswith("norm.weight"):
                param.fill_(1.0)
            elif name == "tok_embeddings.weight" and not self.args.tie_embeddings:
                rng.normal_(param, std=1.0, seed=seed, stream=name)
            elif name in ("output.weight", "tok_embeddings.weight"):  # a tied embedding serves as the head
                std = self.args.dim**-0.5
                rng.trunc_normal_(param, std=std, a=-3 * std, b=3 * std, seed=seed, stream=name)
            else:
                # Output projections of each residual branch shrink with depth.
                std = 0.02
                if name.endswith(("attention.wo.weight", "feed_forward.w2.weight")):
                    std = depth_std[name[: name.index(".", len("layers.")) + 1]]
                rng.trunc_normal_(param, std=std, a=-3 * std, b=3 * std, seed=seed, stream=name)
