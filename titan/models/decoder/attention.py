"""Grouped-query attention under a document mask: the mask in each of its forms, the kernels that run it (flex
attention, one document at a time, SDPA, or explicit probabilities for titan's dropout), and the Attention
module."""

from __future__ import annotations

import enum
import functools

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, create_mask, flex_attention

from titan import rng
from titan.models.decoder.args import DecoderArgs
from titan.models.decoder.kv_cache import KVCache
from titan.models.decoder.rope import apply_rope


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


def attend_flex(q, k, v, mask: BlockMask, attention=None, scale: float | None = None) -> torch.Tensor:
    """Flex attention of (batch, heads, seq, head_dim) q, k, v under a document mask built for flex_length(seq)
    tokens: padded to that length, attended, cut back. `attention`: the kernel (default the compiled one)."""
    seq = q.shape[2]
    pad = flex_length(seq) - seq
    q, k, v = (F.pad(t, (0, 0, 0, pad)) for t in (q, k, v))
    if attention is None:
        attention = compiled_flex_attention()
    limit = max(FLEX_RECOMPILE_LIMIT, torch._dynamo.config.recompile_limit)
    with torch._dynamo.config.patch(recompile_limit=limit):
        out = attention(q, k, v, block_mask=mask, enable_gqa=True, scale=scale)
    return out[:, :, :seq]


class MaskForm(enum.Enum):
    """The form of a document mask (see document_mask)."""

    FLEX = "flex"  # a flex attention block mask (GPUs)
    DENSE = "dense"  # a boolean (batch, 1, seq, seq) mask
    SPANS = "spans"  # each row's document spans, attended one document at a time


def document_mask(document_ids: torch.Tensor, form: MaskForm) -> torch.Tensor | BlockMask | list:
    """Where a query may attend to a key: earlier or same position, same document.

    FLEX (on GPUs): a flex attention block mask, whose kernel skips the blocks that are all masked, for
    flex_length(seq) tokens: each padding token is a document of its own, so it attends to itself alone and no real
    token sees it, and the padding's blocks off the diagonal are skipped. DENSE (attention dropout materialises the
    probabilities; compiled blocks): a boolean (batch, 1, seq, seq) mask. SPANS (the CPU, where flex attention has
    no backward in torch 2.13): each row's document spans [(start, stop, id)], attended one document at a time: a
    document of s tokens then costs s² rather than the row's seq², which is what cost-balanced packing
    (titan/data/packing/) assumes."""
    batch, seq = document_ids.shape
    if form is MaskForm.FLEX:
        length = flex_length(seq)
        padding = -1 - torch.arange(length - seq, device=document_ids.device)  # ids no real document has
        ids = torch.cat([document_ids, padding.expand(batch, -1)], dim=1)

        def same_document_causal(b, h, q, kv):
            return (q >= kv) & (ids[b, q] == ids[b, kv])

        return create_block_mask(same_document_causal, batch, None, length, length, device=document_ids.device)
    if form is MaskForm.DENSE:
        causal = torch.ones(seq, seq, dtype=torch.bool, device=document_ids.device).tril()
        return ((document_ids[:, :, None] == document_ids[:, None, :]) & causal).unsqueeze(1)
    spans = []
    for row in document_ids.cpu():
        ids, counts = torch.unique_consecutive(row, return_counts=True)
        stops = counts.cumsum(0).tolist()
        spans.append([(stop - n, stop, doc) for stop, n, doc in zip(stops, counts.tolist(), ids.tolist())])
    return spans


def attend_per_document(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spans: list, scale=None) -> torch.Tensor:
    """Causal attention within each document span of each row (see document_mask). Rows and documents are cut
    with unbind and split, whose backward is one stack or cat: a slice's would fill a zero tensor of the whole
    input for every document."""
    rows = []
    for q_row, k_row, v_row, row_spans in zip(q.unbind(0), k.unbind(0), v.unbind(0), spans):
        sizes = [stop - start for start, stop, _ in row_spans]
        pieces = [
            sdpa(qs[None], ks[None], vs[None], is_causal=True, enable_gqa=True, scale=scale)
            for qs, ks, vs in zip(q_row.split(sizes, dim=1), k_row.split(sizes, dim=1), v_row.split(sizes, dim=1))
        ]
        rows.append(torch.cat(pieces, dim=2))
    return torch.cat(rows)


# Queries scored at once: the (batch, heads, QUERY_BLOCK, seq) fp32 scores bound head_max's memory.
QUERY_BLOCK = 512


@torch.no_grad()
def head_max(q: torch.Tensor, k: torch.Tensor, mask, scale: float | None) -> torch.Tensor:
    """The largest logit of each query head (heads,) of (batch, heads, seq, width) q against (batch, kv heads, seq,
    width) k, over the pairs `mask` (document_mask's forms; None: causal) lets attend. Costs the scores'
    matmul again, 2 * seq * width FLOPs per token and head (per document token under SPANS), in fp32."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    if isinstance(mask, list):  # document spans per row: each document causal on its own
        maxima = [
            _masked_max(q[row : row + 1, :, start:stop], k[row : row + 1, :, start:stop], None, scale)
            for row, spans in enumerate(mask)
            for start, stop, _ in spans
        ]
        return torch.stack(maxima).amax(0)
    if isinstance(mask, BlockMask):  # flex's, built for a padded length: its pairs, materialised and cut back
        seq, length = q.shape[2], mask.seq_lengths[0]
        mask = create_mask(mask.mask_mod, q.shape[0], None, length, length, q.device)[..., :seq, :seq]
    return _masked_max(q, k, mask, scale)


def _masked_max(q: torch.Tensor, k: torch.Tensor, mask: torch.Tensor | None, scale: float) -> torch.Tensor:
    seq = q.shape[2]
    if mask is None:
        mask = torch.ones(seq, seq, dtype=torch.bool, device=q.device).tril()
    maxima = []
    for start in range(0, seq, QUERY_BLOCK):
        scores = (q[:, :, start : start + QUERY_BLOCK].float() @ k.float().mT) * scale
        allowed = mask[..., start : start + QUERY_BLOCK, :]
        maxima.append(scores.masked_fill_(~allowed, float("-inf")).amax(dim=(0, 2, 3)))
    return torch.stack(maxima).amax(0)


class Attention(nn.Module):
    def __init__(self, args: DecoderArgs, qk_norm: bool = False):
        """qk_norm: RMSNorm of each head's queries and keys before RoPE, as Qwen3 has."""
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = args.n_heads, args.n_kv_heads, args.head_dim
        self.dropout = rng.Dropout(args.attn_dropout)  # on the attention probabilities
        self.wq = nn.Linear(args.dim, args.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(args.dim, args.n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(args.dim, args.n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(args.n_heads * self.head_dim, args.dim, bias=False)
        self.q_norm = nn.RMSNorm(self.head_dim, eps=args.norm_eps) if qk_norm else None
        self.k_norm = nn.RMSNorm(self.head_dim, eps=args.norm_eps) if qk_norm else None
        # Context parallelism installs its ring here (titan/parallel/cp/ring.py): see the model contract's slot.
        self.context_parallel = None
        self.logit_max = None  # QK-clip's record of each head's largest logit (titan/optim/qk_clip.py), when on

    def qk_clip_scales(self, gamma: torch.Tensor) -> dict[str, torch.Tensor] | None:
        """QK-clip's row scales of the weights, for each head's factor gamma (n_heads,): the query rows alone take
        gamma, as a key head of GQA serves several query heads, which scaling it would clip too. None under qk_norm,
        whose RMSNorm of each head's queries and keys undoes any scale of wq and wk."""
        if self.q_norm is not None:
            return None
        return {"wq.weight": gamma.repeat_interleave(self.head_dim)}

    def forward(
        self,
        x: torch.Tensor,
        rope: torch.Tensor,
        rows: torch.Tensor,
        mask: torch.Tensor | BlockMask | list | None,
        cache: KVCache | None = None,
    ) -> torch.Tensor:
        """mask: from document_mask; None: causal. cache: this layer's, when decoding (see Decoder.forward)."""
        batch, seq, _ = x.shape
        # -1 heads: under tensor parallelism each rank holds a slice of the heads.
        q = self.wq(x).view(batch, seq, -1, self.head_dim)
        k = self.wk(x).view(batch, seq, -1, self.head_dim)
        v = self.wv(x).view(batch, seq, -1, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, rope), apply_rope(k, rope)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        if cache is not None:
            k, v = cache.extend(k, v)
        return self.wo(attend(self, q, k, v, mask, rows).transpose(1, 2).reshape(batch, seq, -1))


def attend(module: nn.Module, q, k, v, mask, rows: torch.Tensor, scale: float | None = None) -> torch.Tensor:
    """An attention module's (batch, heads, seq, width) q, k and v (v's width may differ; k and v may hold fewer
    heads, or the cache's earlier tokens) -> (batch, heads, seq, v's width), scores scaled by `scale` (default
    1/sqrt(q's width)): round its context-parallel ring, by flex or per document under a document mask, with titan's
    own dropout of the probabilities, or by SDPA. `module`: its `context_parallel`, `dropout` and `training`, and
    when training its `logit_max` (QK-clip's), which takes each head's largest logit."""
    batch, heads, seq, width = q.shape
    ring = module.context_parallel
    logit_max = module.logit_max if module.training else None
    if ring is not None and ring.is_ring(mask):
        # This rank's chunks of the sequence; the others' come round a ring, which records their logits.
        return ring.attend(q, k, v, mask, rows, module.dropout if module.training else None, scale, logit_max)
    if logit_max is not None:
        logit_max.add(head_max(q, k, mask, scale))
    if isinstance(mask, BlockMask):
        return attend_flex(q, k, v, mask, scale=scale)
    if isinstance(mask, list):
        return attend_per_document(q, k, v, mask, scale=scale)
    if module.training and module.dropout.p:
        # SDPA draws its own dropout mask; titan's mask must come from its counter-based RNG.
        k, v = (t.repeat_interleave(heads // t.shape[1], dim=1) for t in (k, v))
        if mask is None:
            mask = torch.ones(seq, seq, dtype=torch.bool, device=q.device).tril()
        # The mask as the bias and the scale as the alpha of the scores' matmul: two fewer passes over the
        # (batch, heads, seq, seq) scores each way, which on a CPU cost more than the matmul itself.
        bias = torch.zeros(mask.shape, dtype=q.dtype, device=q.device).masked_fill_(~mask, float("-inf"))
        if bias.ndim == 4:  # a mask per row (documents): one per row and head
            bias = bias.expand(batch, heads, seq, seq).flatten(0, 1)
        alpha = width**-0.5 if scale is None else scale
        scores = torch.baddbmm(bias, q.flatten(0, 1), k.flatten(0, 1).transpose(1, 2), alpha=alpha)
        probs = scores.view(batch, heads, seq, seq).softmax(dim=-1, dtype=torch.float32).type_as(q)
        return module.dropout(probs, rows) @ v
    return sdpa(q, k, v, attn_mask=mask, is_causal=mask is None, enable_gqa=True, scale=scale)


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **options) -> torch.Tensor:
    """F.scaled_dot_product_attention, with values narrower than the queries and keys (latent attention's) padded
    with zeros to their width and the output cut back: the flash kernels (the CPU's, and CUDA's) take one width,
    and without them SDPA materialises the (seq, seq) scores. The padding adds nothing to the values' columns."""
    pad = q.shape[-1] - v.shape[-1]
    if pad <= 0:
        return F.scaled_dot_product_attention(q, k, v, **options)
    return F.scaled_dot_product_attention(q, k, F.pad(v, (0, pad)), **options)[..., : v.shape[-1]]
