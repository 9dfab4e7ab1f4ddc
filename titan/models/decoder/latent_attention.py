"""DeepSeek-V2/V3's multi-head latent attention (MLA): keys and values come from one compressed latent per token
(kv_lora_rank wide, RMS-normalised) expanded per head, queries from the hidden state or a compressed one of their
own (q_lora_rank; 0: none). Each head's query and key are a part without position (qk_nope_head_dim) and a part
RoPE rotates (qk_rope_head_dim), the key's rotated part one for all heads; values are v_head_dim wide.

RoPE rotates interleaved pairs, as titan's other attention does and as DeepSeek's weights (and transformers'
`rope_interleave`) hold them, so the weights need no reordering. Decoding caches each token's latent and rotated
key: at DeepSeek-V3's sizes 576 numbers a token and layer, where its 128 heads' keys and values are 40,960.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.nn.attention.flex_attention import BlockMask

from titan import rng
from titan.models.decoder.attention import attend
from titan.models.decoder.kv_cache import KVCache
from titan.models.decoder.rope import apply_rope


class LatentAttention(nn.Module):
    def __init__(self, args):
        """args: a family's with dim, n_heads, norm_eps, attn_dropout, q_lora_rank, kv_lora_rank, qk_nope_head_dim,
        qk_rope_head_dim, v_head_dim and softmax_scale."""
        super().__init__()
        self.nope, self.rope, self.v_width = args.qk_nope_head_dim, args.qk_rope_head_dim, args.v_head_dim
        self.rank, self.scale, self.n_heads = args.kv_lora_rank, args.softmax_scale, args.n_heads
        heads, qk_width = args.n_heads, args.qk_nope_head_dim + args.qk_rope_head_dim
        self.dropout = rng.Dropout(args.attn_dropout)  # on the attention probabilities
        if args.q_lora_rank:  # the query's own latent
            self.wq, self.wq_a = None, nn.Linear(args.dim, args.q_lora_rank, bias=False)
            self.q_a_norm = nn.RMSNorm(args.q_lora_rank, eps=args.norm_eps)
            self.wq_b = nn.Linear(args.q_lora_rank, heads * qk_width, bias=False)
        else:
            self.wq = nn.Linear(args.dim, heads * qk_width, bias=False)
        self.wkv_a = nn.Linear(args.dim, args.kv_lora_rank + args.qk_rope_head_dim, bias=False)
        self.kv_norm = nn.RMSNorm(args.kv_lora_rank, eps=args.norm_eps)
        self.wkv_b = nn.Linear(args.kv_lora_rank, heads * (args.qk_nope_head_dim + args.v_head_dim), bias=False)
        self.wo = nn.Linear(heads * args.v_head_dim, args.dim, bias=False)
        self.context_parallel = None  # the slot every attention module has (titan/parallel/cp/ring.py)
        self.logit_max = None  # QK-clip's record of each head's largest logit (titan/optim/qk_clip.py), when on

    def qk_clip_scales(self, gamma: torch.Tensor) -> dict[str, torch.Tensor]:
        """QK-clip's row scales for each head's factor gamma (n_heads,), as Kimi K2 clips MLA: the head's query and
        key parts without position by sqrt(gamma) each, its rotated query part by gamma; the rotated key, one for
        all heads, stays."""
        root, ones = gamma.sqrt()[:, None], torch.ones_like(gamma)[:, None]
        query = torch.cat([root.expand(-1, self.nope), gamma[:, None].expand(-1, self.rope)], dim=1).flatten()
        key_value = torch.cat([root.expand(-1, self.nope), ones.expand(-1, self.v_width)], dim=1).flatten()
        return {("wq" if self.wq is not None else "wq_b") + ".weight": query, "wkv_b.weight": key_value}

    def forward(
        self,
        x: torch.Tensor,
        rope: torch.Tensor,
        rows: torch.Tensor,
        mask: torch.Tensor | BlockMask | list | None,
        cache: KVCache | None = None,
    ) -> torch.Tensor:
        batch, seq, _ = x.shape
        q = self.wq(x) if self.wq is not None else self.wq_b(self.q_a_norm(self.wq_a(x)))
        q_nope, q_rope = q.view(batch, seq, -1, self.nope + self.rope).split([self.nope, self.rope], dim=-1)
        q_rope = apply_rope(q_rope, rope)
        latent, k_rope = self.wkv_a(x).split([self.rank, self.rope], dim=-1)
        latent, k_rope = self.kv_norm(latent), apply_rope(k_rope.view(batch, seq, 1, self.rope), rope)
        if cache is not None:
            return self.wo(self._decode(q_nope, q_rope, latent, k_rope, mask, rows, cache).flatten(2))
        k_nope, v = (
            self.wkv_b(latent).view(batch, seq, -1, self.nope + self.v_width).split([self.nope, self.v_width], -1)
        )
        q = torch.cat([q_nope, q_rope], dim=-1)
        k = torch.cat([k_nope, k_rope.expand(-1, -1, k_nope.shape[2], -1)], dim=-1)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        return self.wo(attend(self, q, k, v, mask, rows, self.scale).transpose(1, 2).reshape(batch, seq, -1))

    def _decode(self, q_nope, q_rope, latent, k_rope, mask, rows, cache: KVCache) -> torch.Tensor:
        """Attention over the cache of each token's latent and rotated key (kv_lora_rank + qk_rope_head_dim wide,
        one for all heads), not of every head's keys and values: wkv_b's key half is absorbed into the queries
        (q_nope . (W_k latent) = (q_nope W_k) . latent) and its value half applied to the heads' attended latents,
        so decoding is multi-query attention over the latent. Returns (batch, seq, heads, v_head_dim)."""
        # Under tensor parallelism wkv_b holds this rank's heads, and kv_norm hands it the latent as a DTensor.
        w, latent = (t.to_local() if isinstance(t, DTensor) else t for t in (self.wkv_b.weight, latent))
        w = w.view(-1, self.nope + self.v_width, self.rank)
        w_key, w_value = w.split([self.nope, self.v_width], dim=1)
        q = torch.cat([torch.einsum("bshn,hnr->bshr", q_nope, w_key), q_rope], dim=-1).transpose(1, 2)
        keys, _ = cache.extend(torch.cat([latent.unsqueeze(2), k_rope], dim=-1).transpose(1, 2))
        attended = attend(self, q, keys, keys[..., : self.rank], mask, rows, self.scale)  # (batch, heads, seq, rank)
        return torch.einsum("bhsr,hvr->bshv", attended, w_value)
