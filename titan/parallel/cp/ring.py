"""The ring: each rank's queries attend to the whole sequence as its keys and values go round the cp group.

Attention is a ring: the keys and values go round the group point to point, and each rank merges the partial
results of its queries against every block with the online-softmax (log-sum-exp) rule. The backward runs the ring
again: keys and values go round once more, and each block's key and value gradients travel with it back to the rank
that owns it.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh

from titan import rng
from titan.parallel.cp.blocks import BlockAttention
from titan.parallel.cp.masks import RingMask, ring_mask
from titan.run_plan import RunPlan

KV_TAG, GRAD_TAG = 0, 1  # the two streams of one backward step may be in flight between the same pair of ranks


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

    def whole_rows(self, x: Tensor) -> Tensor:
        """This rank's positions of each row (batch, seq / cp, ...) -> the whole rows, gathered over the group. For
        ids (tokens, labels): no gradient flows back."""
        parts = [torch.empty_like(x) for _ in range(self.cp)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        whole = x.new_empty(x.shape[0], self.seq_len, *x.shape[2:])
        for cp_rank, part in enumerate(parts):
            whole[:, torch.cat([self.span(chunk, x.device) for chunk in self.owned(cp_rank)])] = part
        return whole

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
        return ring_mask(self.chunks, self.chunk, document_ids)

    # Compiled blocks call the ring eagerly (a graph break on each side): dynamo breaks at its sends anyway, and its
    # plan of chunk pairs changes with every micro-batch's documents, which guards would recompile for.
    @torch.compiler.disable
    def attend(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        mask: RingMask,
        rows: Tensor,
        dropout: rng.Dropout | None,
        scale: float | None = None,
        logit_max=None,
    ) -> Tensor:
        """Causal attention of this rank's queries (batch, heads, local seq, head dim) to the whole sequence's keys
        and values (this rank's k and v: (batch, kv heads, local seq, head dim), v's width may differ), dropout on
        the probabilities by `dropout` (None or p = 0: none), scores scaled by `scale` (None: 1/sqrt(q's width)).
        logit_max: QK-clip's HeadMax (None: off), which takes each head's largest logit over the blocks."""
        dropout = dropout if dropout is not None and dropout.p > 0 else None
        scale = q.shape[-1] ** -0.5 if scale is None else scale
        blocks = BlockAttention(self, mask, rows, dropout, q.shape[1] // k.shape[1], scale, logit_max)
        return _Ring.apply(q, k, v, blocks)

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


def _padded(t: Tensor, width: int) -> Tensor:
    """t zero-padded on its last dim to `width`: zeros add nothing to a score or to an output."""
    return F.pad(t, (0, width - t.shape[-1])) if t.shape[-1] < width else t


def _wait(works: list) -> None:
    for work in works:
        work.wait()


class _Ring(torch.autograd.Function):
    """The ring attention of ContextParallel.attend: forward merges the blocks' results as they come round, backward
    sends the blocks round again and their key and value gradients after them. Values narrower (or wider) than the
    keys, as latent attention's, are padded to one width with zeros: the fused kernels take one width, and keys and
    values travel as one tensor."""

    @staticmethod
    def forward(ctx, q, k, v, blocks: BlockAttention):
        ctx.widths = q.shape[-1], v.shape[-1]
        q, k, v = (_padded(t, max(ctx.widths)) for t in (q, k, v))
        ring, mask = blocks.ring, blocks.mask
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
                if blocks.logit_max is not None:
                    blocks.logit_max.add(blocks.head_max(a, b, queries[a], keys[b][0]))
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
        return out_all[..., : ctx.widths[1]]

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse = ctx.saved_tensors
        blocks: BlockAttention = ctx.blocks
        ring, chunk = blocks.ring, blocks.ring.chunk
        split = lambda t: dict(zip(ring.chunks, t.split(chunk, dim=2)))  # noqa: E731
        queries, outs, lses = split(q), split(out), split(lse)
        grads = split(_padded(grad_out, q.shape[-1]).contiguous())
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
        qk, v_width = ctx.widths
        grad_k, grad_v = pending[0][..., :qk].to(k.dtype), pending[1][..., :v_width].to(v.dtype)
        return grad_q_all[..., :qk], grad_k, grad_v, None


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
