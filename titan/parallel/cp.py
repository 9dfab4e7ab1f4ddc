"""Context parallelism: each sequence split across the ranks of a cp group, attention run as a ring.

Each row is cut into 2·cp equal chunks and cp rank i holds chunks i and 2·cp-1-i (RunPlan.sequence), so that
under a causal mask every rank has as many query-key pairs to compute. Attention is a ring: the keys and values
go round the group point to point, and each rank merges the partial results of its queries against every block
with the online-softmax (log-sum-exp) rule. The backward runs the ring again: keys and values go round once more,
and each block's key and value gradients travel with it back to the rank that owns it.

Work is planned per pair of chunks (a query chunk, a key chunk), from global positions: a pair whose keys all
come after its queries is skipped (the fully masked half, on and off the diagonal), so is one whose documents
never meet; a diagonal pair is causal, a pair below it is attended whole, and a pair where documents meet only
in part is attended document by document (each shared document's queries to its keys), as one process attends
one document at a time: a document of s tokens costs about s² whatever the chunks. RoPE positions and document
ids are the whole row's (the model computes them on the row and takes this rank's positions), and dropout masks
are keyed by global position (rng.Dropout.sequence and keep_mask), so every mask is bitwise the one a single
process draws.

Each block runs on a kernel that returns the log-sum-exp the merge needs (Blocks.kernel), never with a mask: a
pair where documents meet in part runs it once per shared document. On the CPU: the CPU flash-attention kernels
(`_scaled_dot_product_flash_attention_for_cpu` and its backward). On CUDA: the kernels torch's own context
parallelism runs its blocks on, `_scaled_dot_product_flash_attention` (bf16, fp16) or else
`_scaled_dot_product_efficient_attention` (fp32), with their backwards, where torch's SDPA checks accept the
shapes. With attention dropout every block is explicit: its masks are titan's, drawn by global position.

torch's context-parallel API (`torch.distributed.tensor.experimental.context_parallel`) is not used, on any backend;
the ring shares only its CUDA kernels. Its SDPA ring takes no mask (no documents, no dropout of titan's) and
dispatches only CUDA's kernels; where it applies, it computes what this ring computes, with the same kernels and the
same head-and-tail chunks (its load balancer's), so a second ring would only add a path the CPU tests cannot run.
Its flex-attention path takes document masks, but by all-gathering every rank's keys and values at each layer: the
whole sequence's keys and values on every rank, which the ring exists to avoid. So one ring serves every backend,
masks, dropout and tensor parallelism included, and only the block kernel depends on the device.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh

from titan import rng
from titan.run_plan import RunPlan

aten = torch.ops.aten
NEG_INF = float("-inf")
LSE_TILE = 32  # CUDA's memory-efficient kernel pads its log-sum-exp to whole tiles of this many queries
KV_TAG, GRAD_TAG = 0, 1  # the two streams of one backward step may be in flight between the same pair of ranks


@dataclass(frozen=True)
class PairMask:
    """How a query chunk attends to a key chunk: "causal" (the diagonal), "full", or by "spans": the documents the
    two chunks share, each as (row, query start, query stop, key start, key stop) within the chunks, causal on the
    diagonal (there a document's query and key spans are the same) and whole below it."""

    kind: str
    spans: tuple[tuple[int, int, int, int, int], ...] = ()

    def bias(self, batch: int, chunk: int, diagonal: bool, device) -> Tensor:
        """The spans as an additive mask (batch, 1, chunk, chunk): 0 where a query attends to a key, else -inf."""
        allowed = torch.zeros(batch, 1, chunk, chunk, dtype=torch.bool, device=device)
        for row, qs, qe, ks, ke in self.spans:
            allowed[row, 0, qs:qe, ks:ke] = True
        if diagonal:
            allowed = allowed.tril()
        return torch.zeros(allowed.shape, device=device).masked_fill_(~allowed, NEG_INF)


@dataclass(frozen=True)
class RingMask:
    """The chunk pairs (query chunk, key chunk), by global chunk index, that this rank's queries attend to."""

    pairs: dict[tuple[int, int], PairMask]


def document_runs(document_ids: Tensor) -> list[tuple[np.ndarray, np.ndarray]]:
    """Each row's documents as (starts, stops): runs of one id, as one process's CPU attention reads them."""
    runs = []
    for row in document_ids.cpu():
        _, counts = torch.unique_consecutive(row, return_counts=True)
        stops = counts.cumsum(0).numpy()
        runs.append((stops - counts.numpy(), stops))
    return runs


class ContextParallel:
    """One rank's share of the sequence and its ring, installed on the model by `apply_context_parallel`."""

    def __init__(
        self, group, cp_rank: int, cp: int, sequence: tuple[range, ...], seq_len: int, device, tp_rank=0, tp=1
    ):
        self.group, self.cp_rank, self.cp, self.seq_len = group, cp_rank, cp, seq_len
        self.tp_rank, self.tp = tp_rank, tp  # tensor parallelism gives each rank a slice of the heads
        self.chunk = seq_len // (2 * cp)
        self.chunks = tuple(r.start // self.chunk for r in sequence)  # this rank's chunks, by global index
        self.positions = torch.cat([torch.arange(r.start, r.stop) for r in sequence]).to(device)

    def owned(self, cp_rank: int) -> tuple[int, int]:
        """The chunks that cp rank `cp_rank` holds."""
        return cp_rank, 2 * self.cp - 1 - cp_rank

    @staticmethod
    def is_ring(mask) -> bool:
        """Whether attention with `mask` runs as the ring: a mask this made (a micro-batch the cp group shares),
        not a local micro-batch's own."""
        return isinstance(mask, RingMask)

    def span(self, chunk: int, device=None) -> Tensor:
        return torch.arange(chunk * self.chunk, (chunk + 1) * self.chunk, device=device)

    def mask(self, document_ids: Tensor | None) -> RingMask:
        """The pairs to compute for rows of these documents ((batch, seq), the whole rows; None: one causal
        sequence per row). Planned once per micro-batch and used by every layer, forward and backward."""
        pairs = {}
        runs = None if document_ids is None else document_runs(document_ids)
        for a in self.chunks:
            for b in range(a + 1):  # keys after every query of the chunk: nothing to attend to
                whole = PairMask("causal" if a == b else "full")
                if runs is None:
                    pairs[a, b] = whole
                    continue
                spans = self._shared(runs, a, b)
                if not spans:
                    continue
                # One document across both chunks in every row: the whole pair in one kernel call.
                one = len(spans) == len(runs) and all(
                    (qs, qe, ks, ke) == (0, self.chunk, 0, self.chunk) for _, qs, qe, ks, ke in spans
                )
                pairs[a, b] = whole if one else PairMask("spans", tuple(spans))
        return RingMask(pairs)

    def _shared(self, runs, a: int, b: int) -> list[tuple[int, int, int, int, int]]:
        """The documents that query chunk `a` and key chunk `b` (b <= a) share, as PairMask spans."""
        c, spans = self.chunk, []
        for row, (starts, stops) in enumerate(runs):
            if a == b:  # every document in the chunk, causal on itself
                lo, hi = a * c, (a + 1) * c
                first, last = np.searchsorted(stops, lo, "right"), np.searchsorted(starts, hi, "left")
                for start, stop in zip(starts[first:last].tolist(), stops[first:last].tolist()):
                    qs, qe = max(start, lo) - lo, min(stop, hi) - lo
                    spans.append((row, qs, qe, qs, qe))
                continue
            # Below the diagonal only a document holding the key chunk's last token and the query chunk's first
            # can be in both.
            i = np.searchsorted(stops, (b + 1) * c - 1, "right")
            if i < len(stops) and stops[i] > a * c:
                start, stop = int(starts[i]), int(stops[i])
                spans.append((row, 0, min(stop, (a + 1) * c) - a * c, max(start, b * c) - b * c, c))
        return spans

    # Compiled blocks call the ring eagerly (a graph break on each side): dynamo breaks at its sends anyway, and its
    # plan of chunk pairs changes with every micro-batch's documents, which guards would recompile for.
    @torch.compiler.disable
    def attend(
        self, q: Tensor, k: Tensor, v: Tensor, mask: RingMask, rows: Tensor, dropout: rng.Dropout | None
    ) -> Tensor:
        """Causal attention of this rank's queries (batch, heads, local seq, head dim) to the whole sequence's keys
        and values (this rank's k and v: (batch, kv heads, local seq, head dim)), dropout on the probabilities by
        `dropout` (None or p = 0: none)."""
        return _Ring.apply(q, k, v, self, mask, rows, dropout if dropout is not None and dropout.p > 0 else None)

    # -- the ring's steps

    def exchange(self, send: Tensor, tag: int) -> tuple[Tensor, list]:
        return ring_hop(send, self.group, tag)

    def steps(self):
        """(ring step, the cp rank whose keys and values this rank holds at that step)."""
        for s in range(self.cp):
            yield s, (self.cp_rank - s) % self.cp


def ring_hop(send: Tensor, group, tag: int = 0) -> tuple[Tensor, list]:
    """One hop of a ring over `group`: send `send` to the next rank and receive the previous rank's into a new tensor
    (in flight: wait on the works before reading it)."""
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    recv = torch.empty_like(send)
    ops = [
        dist.P2POp(dist.isend, send, dist.get_global_rank(group, (rank + 1) % size), group, tag),
        dist.P2POp(dist.irecv, recv, dist.get_global_rank(group, (rank - 1) % size), group, tag),
    ]
    return recv, dist.batch_isend_irecv(ops)


def _wait(works: list) -> None:
    for work in works:
        work.wait()


class _Ring(torch.autograd.Function):
    """The ring attention of ContextParallel.attend: forward merges the blocks' results as they come round, backward
    sends the blocks round again and their key and value gradients after them."""

    @staticmethod
    def forward(ctx, q, k, v, ring: ContextParallel, mask: RingMask, rows, dropout):
        blocks = Blocks(ring, mask, rows, dropout, q.shape[1] // k.shape[1], q.shape[-1] ** -0.5)
        queries = dict(zip(ring.chunks, q.split(ring.chunk, dim=2)))
        out: dict[int, Tensor] = {}
        lse: dict[int, Tensor] = {}
        kv = torch.stack([k, v])
        for s, owner in ring.steps():
            works = []
            if s < ring.cp - 1:  # the next block travels while this one is computed
                next_kv, works = ring.exchange(kv, KV_TAG)
            keys = dict(zip(ring.owned(owner), kv.split(ring.chunk, dim=3)))
            # The diagonal first: every query attends to itself there, so the running log-sum-exp is finite from
            # the first merge on.
            for a, b in sorted(((a, b) for a in queries for b in keys), key=lambda ab: ab[0] != ab[1]):
                if (a, b) not in mask.pairs:
                    continue
                o, o_lse = blocks.forward(a, b, queries[a], *keys[b])
                if a not in out:
                    out[a], lse[a] = o, o_lse
                else:
                    merged = torch.logaddexp(lse[a], o_lse)
                    out[a] = out[a] * (lse[a] - merged).exp()[..., None] + o * (o_lse - merged).exp()[..., None]
                    lse[a] = merged
            _wait(works)
            if works:
                kv = next_kv
        out_all = torch.cat([out[a].to(q.dtype) for a in ring.chunks], dim=2)
        ctx.blocks = blocks
        ctx.save_for_backward(q, k, v, out_all, torch.cat([lse[a] for a in ring.chunks], dim=2))
        return out_all

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse = ctx.saved_tensors
        blocks: Blocks = ctx.blocks
        ring, chunk = blocks.ring, blocks.ring.chunk
        split = lambda t: dict(zip(ring.chunks, t.split(chunk, dim=2)))  # noqa: E731
        queries, outs, lses, grads = split(q), split(out), split(lse), split(grad_out.contiguous())
        grad_q = {a: torch.zeros_like(x, dtype=torch.float32) for a, x in queries.items()}
        kv = torch.stack([k, v])
        pending, works = None, []  # the key/value gradients of the block this rank gets next, in flight
        for s, owner in ring.steps():
            kv_works = []
            if s < ring.cp - 1:
                next_kv, kv_works = ring.exchange(kv, KV_TAG)
            owned = ring.owned(owner)
            keys = dict(zip(owned, kv.split(chunk, dim=3)))
            grad_kv = torch.zeros(kv.shape, dtype=torch.float32, device=kv.device)
            grad_keys = dict(zip(owned, grad_kv.split(chunk, dim=3)))
            for a in queries:
                for b in keys:
                    if (a, b) not in blocks.mask.pairs:
                        continue
                    dq, dk, dv = blocks.backward(a, b, queries[a], *keys[b], outs[a], lses[a], grads[a])
                    grad_q[a] += dq
                    grad_keys[b][0] += dk
                    grad_keys[b][1] += dv
            _wait(works)
            if pending is not None:  # the sum so far of the earlier ranks' gradients for this block
                grad_kv += pending
            pending, works = ring.exchange(grad_kv, GRAD_TAG)  # on to the next rank; the last step's reaches the owner
            _wait(kv_works)
            if kv_works:
                kv = next_kv
        _wait(works)
        grad_q_all = torch.cat([grad_q[a] for a in ring.chunks], dim=2).to(q.dtype)
        return grad_q_all, pending[0].to(k.dtype), pending[1].to(v.dtype), None, None, None, None


class Blocks:
    """One block pair's attention, forward (its output and log-sum-exp) and backward (given the merged output and
    log-sum-exp), by the kernel `kernel` picks; a pair of "spans" runs it once per shared document."""

    def __init__(self, ring: ContextParallel, mask: RingMask, rows: Tensor, dropout, groups: int, scale: float):
        self.ring, self.mask, self.rows, self.drop = ring, mask, rows, dropout
        self.groups, self.scale = groups, scale
        self.state: dict[tuple, tuple] = {}  # a CUDA kernel's forward outputs that its backward takes, by call

    def _expand(self, x: Tensor) -> Tensor:
        return x.repeat_interleave(self.groups, dim=1) if self.groups > 1 else x

    def _reduce(self, grad: Tensor) -> Tensor:
        """A gradient of expanded key or value heads, summed back onto the kv heads."""
        return grad.unflatten(1, (-1, self.groups)).sum(2) if self.groups > 1 else grad

    def kernel(self, q: Tensor, k: Tensor, causal: bool) -> str:
        """Which kernel computes this block: the CPU's flash kernel ("cpu_flash"), CUDA's "flash" or "efficient"
        (where torch's checks accept its shapes and dtype: flash takes bf16 and fp16), or "explicit" (with attention
        dropout, whose masks are titan's; the module docstring says why)."""
        if self.drop is not None:
            return "explicit"
        if q.device.type == "cpu":
            return "cpu_flash"
        if q.device.type == "cuda":
            params = torch.backends.cuda.SDPAParams(q, k, k, None, 0.0, causal, False)
            if torch.backends.cuda.can_use_flash_attention(params):
                return "flash"
            if torch.backends.cuda.can_use_efficient_attention(params):
                return "efficient"
        return "explicit"

    def _keep(self, a: int, b: int, shape) -> Tensor:
        ring, device = self.ring, self.rows.device
        given = {2: (ring.seq_len, ring.span(a, device)), 3: (ring.seq_len, ring.span(b, device))}
        if ring.tp > 1:  # this rank's heads, as DTensor splits them
            heads = shape[1]
            given[1] = (heads * ring.tp, torch.arange(ring.tp_rank * heads, (ring.tp_rank + 1) * heads))
        return self.drop.keep_mask(tuple(shape), self.rows, given)

    def _scores(self, a: int, b: int, pair: PairMask, q: Tensor, k: Tensor) -> Tensor:
        scores = (q.float() @ k.float().transpose(-1, -2)) * self.scale
        if pair.kind == "causal":
            above = torch.ones(scores.shape[-2:], dtype=torch.bool, device=scores.device).triu(1)
            return scores.masked_fill_(above, NEG_INF)
        if pair.kind == "spans":
            return scores + pair.bias(q.shape[0], self.ring.chunk, a == b, scores.device)
        return scores

    def _fused(self, kernel: str, call: tuple, q: Tensor, k: Tensor, v: Tensor, causal: bool) -> tuple[Tensor, Tensor]:
        if kernel == "cpu_flash":
            return aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=self.scale)
        if kernel == "flash":
            out, lse, *rest = aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, scale=self.scale)
            self.state[call] = tuple(rest[:6])  # cumulative lengths, max lengths, philox seed and offset
            return out, lse
        out, lse, *philox = aten._scaled_dot_product_efficient_attention(
            q, k, v, None, True, 0.0, causal, scale=self.scale
        )
        self.state[call] = tuple(philox)
        return out, lse[..., : q.shape[2]]  # padded to whole tiles of queries

    def _fused_backward(self, kernel: str, call: tuple, grad_out, q, k, v, out, lse, causal: bool):
        if kernel == "cpu_flash":
            return aten._scaled_dot_product_flash_attention_for_cpu_backward(
                grad_out, q, k, v, out, lse, 0.0, causal, scale=self.scale
            )
        if kernel == "flash":
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
        if kernel == "explicit":
            scores = self._scores(a, b, pair, q, k)
            lse = scores.logsumexp(-1)
            probs = (scores - lse.masked_fill(lse == NEG_INF, 0)[..., None]).exp_()
            if self.drop is not None:
                probs = probs * self._keep(a, b, probs.shape) / (1 - self.drop.p)
            return probs @ v.float(), lse
        if pair.kind != "spans":
            out, lse = self._fused(kernel, (a, b), q, k, v, a == b)
            return out.float(), lse
        # Queries of no shared document keep a log-sum-exp of -inf: they weigh nothing in the merge.
        out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        lse = torch.full(q.shape[:-1], NEG_INF, dtype=torch.float32, device=q.device)
        for i, (row, qs, qe, ks, ke) in enumerate(pair.spans):
            at_q, at_k = self._at(row, qs, qe), self._at(row, ks, ke)
            out[at_q], lse[at_q] = self._fused(kernel, (a, b, i), q[at_q], k[at_k], v[at_k], a == b)
        return out, lse

    def backward(self, a, b, q, k, v, out, lse, grad_out) -> tuple[Tensor, Tensor, Tensor]:
        pair = self.mask.pairs[a, b]
        k, v = self._expand(k), self._expand(v)
        kernel = self.kernel(q, k, a == b)
        if kernel == "explicit":
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
        elif pair.kind != "spans":
            dq, dk, dv = self._fused_backward(kernel, (a, b), grad_out, q, k, v, out, lse, a == b)
        else:
            dq, dk, dv = (torch.zeros(t.shape, dtype=torch.float32, device=t.device) for t in (q, k, v))
            for i, (row, qs, qe, ks, ke) in enumerate(pair.spans):
                at_q, at_k = self._at(row, qs, qe), self._at(row, ks, ke)
                grads = self._fused_backward(
                    kernel, (a, b, i), grad_out[at_q], q[at_q], k[at_k], v[at_k], out[at_q], lse[at_q], a == b
                )
                dq[at_q] += grads[0]
                dk[at_k] += grads[1]
                dv[at_k] += grads[2]
        return dq.float(), self._reduce(dk).float(), self._reduce(dv).float()


def apply_context_parallel(model: nn.Module, plan: RunPlan, rank: int, mesh: DeviceMesh, device) -> ContextParallel:
    """Install rank `rank`'s ring on `model` (every module with a `context_parallel` slot: the model itself and its
    attention modules) and its positions on the dropout modules."""
    me, seq_len = plan.rank(rank), plan.seq_len
    ring = ContextParallel(
        mesh.get_group(), me.cp_rank, plan.layout.cp, me.sequence, seq_len, device, me.tp_rank, plan.layout.tp
    )
    for module in model.modules():
        if hasattr(module, "context_parallel"):
            module.context_parallel = ring
        if isinstance(module, rng.Dropout):
            module.sequence = (seq_len, ring.positions)
    return ring


def all_reduce_gradients(params: list[Tensor], group) -> None:
    """Sum the gradients over the cp group in one collective (without FSDP, which sums them itself): each rank's
    are those of its positions' share of the loss."""
    # Tensor-parallel gradients are DTensors: each rank sums its own shard with the cp ranks holding the same one.
    grads = [getattr(p.grad, "_local_tensor", p.grad) for p in params if p.grad is not None]
    if not grads:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, group=group)
    for g, summed in zip(grads, flat.split([g.numel() for g in grads])):
        g.copy_(summed.view_as(g))
