"""The ring's block kernels: one chunk pair's attention, forward and backward.

Each block runs on a kernel that returns the log-sum-exp the merge needs (BlockAttention.kernel), never with a mask:
a pair where documents meet in part runs it once per shared document. On the CPU: the CPU flash-attention kernels
(`_scaled_dot_product_flash_attention_for_cpu` and its backward). On CUDA: the kernels torch's own context
parallelism runs its blocks on, `_scaled_dot_product_flash_attention` (bf16, fp16) or else
`_scaled_dot_product_efficient_attention` (fp32), with their backwards, where torch's SDPA checks accept the
shapes. With attention dropout every block is explicit: its masks are titan's, drawn by global position.
"""

from __future__ import annotations

import enum

import torch
import torch.nn.functional as F
from torch import Tensor

from titan.parallel.cp.masks import NEG_INF, PairKind, PairMask, RingMask

aten = torch.ops.aten
LSE_TILE = 32  # CUDA's memory-efficient kernel pads its log-sum-exp to whole tiles of this many queries


class BlockKernel(enum.Enum):
    """The kernel that computes a block (BlockAttention.kernel picks it)."""

    CPU_FLASH = "cpu_flash"  # the CPU's flash attention
    FLASH = "flash"  # CUDA's flash attention: bf16 and fp16
    EFFICIENT = "efficient"  # CUDA's memory-efficient attention
    EXPLICIT = "explicit"  # the probabilities computed whole, for titan's dropout masks on them


class BlockAttention:
    """One block pair's attention, forward (its output and log-sum-exp) and backward (given the merged output and
    log-sum-exp), by the kernel `kernel` picks; a SPANS pair runs it once per shared document. `ring`: the
    ContextParallel whose blocks these are (titan.parallel.cp.ring, which imports this module)."""

    def __init__(self, ring, mask: RingMask, rows: Tensor, dropout, groups: int, scale: float, logit_max=None):
        self.ring, self.mask, self.rows, self.drop = ring, mask, rows, dropout
        self.groups, self.scale = groups, scale
        self.logit_max = logit_max  # QK-clip's record of each head's largest logit (None: off)
        self.state: dict[tuple, tuple] = {}  # a CUDA kernel's forward outputs that its backward takes, by call

    def _expand(self, x: Tensor) -> Tensor:
        return x.repeat_interleave(self.groups, dim=1) if self.groups > 1 else x

    def _reduce(self, grad: Tensor) -> Tensor:
        """A gradient of expanded key or value heads, summed back onto the kv heads."""
        return grad.unflatten(1, (-1, self.groups)).sum(2) if self.groups > 1 else grad

    def kernel(self, q: Tensor, k: Tensor, causal: bool) -> BlockKernel:
        """Which kernel computes this block: the CPU's flash kernel (CPU_FLASH), CUDA's FLASH or EFFICIENT (where
        torch's checks accept its shapes and dtype: flash takes bf16 and fp16), or EXPLICIT (with attention dropout,
        whose masks are titan's; the module docstring says why)."""
        if self.drop is not None:
            return BlockKernel.EXPLICIT
        if q.device.type == "cpu":
            return BlockKernel.CPU_FLASH
        if q.device.type == "cuda":
            params = torch.backends.cuda.SDPAParams(q, k, k, None, 0.0, causal, False)
            if torch.backends.cuda.can_use_flash_attention(params):
                return BlockKernel.FLASH
            if torch.backends.cuda.can_use_efficient_attention(params):
                return BlockKernel.EFFICIENT
        return BlockKernel.EXPLICIT

    def _keep(self, a: int, b: int, shape) -> Tensor:
        ring, device = self.ring, self.rows.device
        given = {2: (ring.seq_len, ring.span(a, device)), 3: (ring.seq_len, ring.span(b, device))}
        if ring.tp > 1:  # this rank's heads, as DTensor splits them
            heads = shape[1]
            given[1] = (heads * ring.tp, torch.arange(ring.tp_rank * heads, (ring.tp_rank + 1) * heads))
        return self.drop.keep_mask(tuple(shape), self.rows, given)

    def _scores(self, a: int, b: int, pair: PairMask, q: Tensor, k: Tensor) -> Tensor:
        scores = (q.float() @ k.float().transpose(-1, -2)) * self.scale
        if pair.kind is PairKind.CAUSAL:
            above = torch.ones(scores.shape[-2:], dtype=torch.bool, device=scores.device).triu(1)
            return scores.masked_fill_(above, NEG_INF)
        if pair.kind is PairKind.SPANS:
            return scores + pair.bias(q.shape[0], self.ring.chunk, a == b, scores.device)
        return scores

    @torch.no_grad()
    def head_max(self, a: int, b: int, q: Tensor, k: Tensor) -> Tensor:
        """The largest logit of each query head (heads,) over the pair's attended positions, for QK-clip: the
        scores computed whole, as the explicit kernel does."""
        return self._scores(a, b, self.mask.pairs[a, b], q, self._expand(k)).amax(dim=(0, 2, 3))

    def _fused(self, kernel: BlockKernel, call: tuple, q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """One fused kernel call of the pair call[:2] (a span of it: call[2]); a pair on the diagonal is causal."""
        causal = call[0] == call[1]
        if kernel is BlockKernel.CPU_FLASH:
            return aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=self.scale)
        if kernel is BlockKernel.FLASH:
            out, lse, *rest = aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, scale=self.scale)
            self.state[call] = tuple(rest[:6])  # cumulative lengths, max lengths, philox seed and offset
            return out, lse
        out, lse, *philox = aten._scaled_dot_product_efficient_attention(
            q, k, v, None, True, 0.0, causal, scale=self.scale
        )
        self.state[call] = tuple(philox)
        return out, lse[..., : q.shape[2]]  # padded to whole tiles of queries

    def _fused_backward(self, kernel: BlockKernel, call: tuple, grad_out, q, k, v, out, lse):
        causal = call[0] == call[1]
        if kernel is BlockKernel.CPU_FLASH:
            return aten._scaled_dot_product_flash_attention_for_cpu_backward(
                grad_out, q, k, v, out, lse, 0.0, causal, scale=self.scale
            )
        if kernel is BlockKernel.FLASH:
            lengths, philox = self.state[call][:4], self.state[call][4:]
            # This block's log-sum-exp on its own, not a view into the rank's: the kernel takes it contiguous (torch's
            # ring makes it so too).
            return aten._scaled_dot_product_flash_attention_backward(
                grad_out, q, k, v, out, lse.contiguous(), *lengths, 0.0, causal, *philox, scale=self.scale
            )
        padded = F.pad(lse, (0, -lse.shape[-1] % LSE_TILE))  # the kernel reads the log-sum-exp by whole tiles
        grads = [True, True, True, False]  # q, k, v; no bias
        dq, dk, dv, _ = aten._scaled_dot_product_efficient_attention_backward(
            grad_out, q, k, v, None, out, padded, *self.state[call], 0.0, grads, causal, scale=self.scale
        )
        return dq, dk, dv

    @staticmethod
    def _at(row: int, start: int, stop: int) -> tuple:
        """Index of one row's positions [start, stop) of a (batch, heads, seq, ...) tensor, the row kept."""
        return slice(row, row + 1), slice(None), slice(start, stop)

    def forward(self, a: int, b: int, q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        pair = self.mask.pairs[a, b]
        k, v = self._expand(k), self._expand(v)
        kernel = self.kernel(q, k, a == b)
        if kernel is BlockKernel.EXPLICIT:
            scores = self._scores(a, b, pair, q, k)
            lse = scores.logsumexp(-1)
            probs = (scores - lse.masked_fill(lse == NEG_INF, 0)[..., None]).exp_()
            if self.drop is not None:
                probs = probs * self._keep(a, b, probs.shape) / (1 - self.drop.p)
            return probs @ v.float(), lse
        if pair.kind is not PairKind.SPANS:
            out, lse = self._fused(kernel, (a, b), q, k, v)
            return out.float(), lse
        # Queries of no shared document keep a log-sum-exp of -inf: they weigh nothing in the merge.
        out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        lse = torch.full(q.shape[:-1], NEG_INF, dtype=torch.float32, device=q.device)
        for i, (row, qs, qe, ks, ke) in enumerate(pair.spans):
            at_q, at_k = self._at(row, qs, qe), self._at(row, ks, ke)
            out[at_q], lse[at_q] = self._fused(kernel, (a, b, i), q[at_q], k[at_k], v[at_k])
        return out, lse

    def backward(self, a, b, q, k, v, out, lse, grad_out) -> tuple[Tensor, Tensor, Tensor]:
        pair = self.mask.pairs[a, b]
        k, v = self._expand(k), self._expand(v)
        kernel = self.kernel(q, k, a == b)
        if kernel is BlockKernel.EXPLICIT:
            grad_out, out = grad_out.float(), out.float()
            probs = (self._scores(a, b, pair, q, k) - lse[..., None]).exp_()
            grad_probs = grad_out @ v.float().transpose(-1, -2)
            if self.drop is not None:
                kept = self._keep(a, b, probs.shape) / (1 - self.drop.p)
                dv, grad_probs = (probs * kept).transpose(-1, -2) @ grad_out, grad_probs * kept
            else:
                dv = probs.transpose(-1, -2) @ grad_out
            grad_scores = probs * (grad_probs - (grad_out * out).sum(-1, keepdim=True)) * self.scale
            dq, dk = grad_scores @ k.float(), grad_scores.transpose(-1, -2) @ q.float()
        elif pair.kind is not PairKind.SPANS:
            dq, dk, dv = self._fused_backward(kernel, (a, b), grad_out, q, k, v, out, lse)
        else:
            dq, dk, dv = (torch.zeros(t.shape, dtype=torch.float32, device=t.device) for t in (q, k, v))
            for i, (row, qs, qe, ks, ke) in enumerate(pair.spans):
                at_q, at_k = self._at(row, qs, qe), self._at(row, ks, ke)
                grads = self._fused_backward(
                    kernel, (a, b, i), grad_out[at_q], q[at_q], k[at_k], v[at_k], out[at_q], lse[at_q]
                )
                dq[at_q] += grads[0]
                dk[at_k] += grads[1]
                dv[at_k] += grads[2]
        return dq.float(), self._reduce(dk).float(), self._reduce(dv).float()
