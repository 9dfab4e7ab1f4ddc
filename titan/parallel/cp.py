"""Context parallelism: each sequence split across the ranks of a cp group, attention run as a ring.

Each row is cut into 2·cp equal chunks and cp rank i holds chunks i and 2·cp-1-i (RunPlan.sequence), so that
under a causal mask every rank has as many query-key pairs to compute. Attention is a ring: the keys and values
go round the group point to point, and each rank merges the partial results of its queries against every block
with the online-softmax (log-sum-exp) rule. The backward runs the ring again: keys and values go round once more,
and each block's key and value gradients travel with it back to the rank that owns it.

Work is planned per pair of chunks (a query chunk, a key chunk), from global positions: a pair whose keys all
come after its queries is skipped (the fully masked half, on and off the diagonal), so is one whose documents
never meet; a diagonal pair is causal, a pair below it is attended whole, and a pair where documents meet only
in part takes a mask. RoPE positions and document ids are the whole row's (the model computes them on the row and
takes this rank's positions), and dropout masks are keyed by global position (rng.Dropout.sequence and
keep_mask), so every mask is bitwise the one a single process draws.

On the CPU the blocks run on the CPU flash-attention kernels (`_scaled_dot_product_flash_attention_for_cpu` and
its backward, which take and return the log-sum-exp the merge needs); with attention dropout, or off the CPU,
they are computed explicitly. torch's `torch.distributed.tensor.experimental.context_parallel` is not used: it
shards buffers by DTensor placements and swaps SDPA for its ring only on CUDA, without document masks.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh

from titan import rng
from titan.run_plan import RunPlan

NEG_INF = float("-inf")
KV_TAG, GRAD_TAG = 0, 1  # the two streams of one backward step may be in flight between the same pair of ranks


@dataclass(frozen=True)
class PairMask:
    """How a query chunk attends to a key chunk: "causal" (the diagonal), "full", or "masked" by `bias` (0 or -inf,
    (batch, 1, chunk, chunk)); `empty`: the queries that attend to none of these keys, (batch, 1, chunk), or None."""

    kind: str
    bias: Tensor | None = None
    empty: Tensor | None = None


@dataclass(frozen=True)
class RingMask:
    """The chunk pairs (query chunk, key chunk), by global chunk index, that this rank's queries attend to."""

    pairs: dict[tuple[int, int], PairMask]


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
        self.next = dist.get_global_rank(group, (cp_rank + 1) % cp)
        self.prev = dist.get_global_rank(group, (cp_rank - 1) % cp)

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
        for a in self.chunks:
            for b in range(a + 1):  # keys after every query of the chunk: nothing to attend to
                if document_ids is None:
                    pairs[a, b] = PairMask("causal" if a == b else "full")
                    continue
                q_docs, k_docs = (document_ids[:, self.span(c, document_ids.device)] for c in (a, b))
                # Chunks whose id ranges are apart in every row share no document: no need to compare their ids.
                if not ((q_docs.amin(1) <= k_docs.amax(1)) & (k_docs.amin(1) <= q_docs.amax(1))).any():
                    continue
                same = q_docs[:, :, None] == k_docs[:, None, :]
                allowed = same.tril() if a == b else same
                if not allowed.any():
                    continue
                if bool(same.all()):  # one document across both chunks in every row
                    pairs[a, b] = PairMask("causal" if a == b else "full")
                    continue
                bias = torch.zeros(allowed.shape, device=allowed.device).masked_fill_(~allowed, NEG_INF)
                empty = ~allowed.any(-1)
                pairs[a, b] = PairMask("masked", bias[:, None], empty[:, None] if empty.any() else None)
        return RingMask(pairs)

    def attend(
        self, q: Tensor, k: Tensor, v: Tensor, mask: RingMask, rows: Tensor, dropout: rng.Dropout | None
    ) -> Tensor:
        """Causal attention of this rank's queries (batch, heads, local seq, head dim) to the whole sequence's keys
        and values (this rank's k and v: (batch, kv heads, local seq, head dim)), dropout on the probabilities by
        `dropout` (None or p = 0: none)."""
        return _Ring.apply(q, k, v, self, mask, rows, dropout if dropout is not None and dropout.p > 0 else None)

    # -- the ring's steps

    def exchange(self, send: Tensor, tag: int) -> tuple[Tensor, list]:
        """Send `send` to the next rank and receive the previous rank's into a new tensor (in flight: wait on the
        works before reading it)."""
        recv = torch.empty_like(send)
        ops = [
            dist.P2POp(dist.isend, send, self.next, self.group, tag),
            dist.P2POp(dist.irecv, recv, self.prev, self.group, tag),
        ]
        return recv, dist.batch_isend_irecv(ops)

    def steps(self):
        """(ring step, the cp rank whose keys and values this rank holds at that step)."""
        for s in range(self.cp):
            yield s, (self.cp_rank - s) % self.cp


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
    log-sum-exp): by the CPU flash-attention kernels, or explicitly with dropout or off the CPU."""

    def __init__(self, ring: ContextParallel, mask: RingMask, rows: Tensor, dropout, groups: int, scale: float):
        self.ring, self.mask, self.rows, self.drop = ring, mask, rows, dropout
        self.groups, self.scale = groups, scale

    def _expand(self, x: Tensor) -> Tensor:
        return x.repeat_interleave(self.groups, dim=1) if self.groups > 1 else x

    def _reduce(self, grad: Tensor) -> Tensor:
        """A gradient of expanded key or value heads, summed back onto the kv heads."""
        return grad.unflatten(1, (-1, self.groups)).sum(2) if self.groups > 1 else grad

    def _flash(self, q: Tensor) -> bool:
        return q.device.type == "cpu" and self.drop is None

    def _keep(self, a: int, b: int, shape) -> Tensor:
        ring, device = self.ring, self.rows.device
        given = {2: (ring.seq_len, ring.span(a, device)), 3: (ring.seq_len, ring.span(b, device))}
        if ring.tp > 1:  # this rank's heads, as DTensor splits them
            heads = shape[1]
            given[1] = (heads * ring.tp, torch.arange(ring.tp_rank * heads, (ring.tp_rank + 1) * heads))
        return self.drop.keep_mask(tuple(shape), self.rows, given)

    def _scores(self, pair: PairMask, q: Tensor, k: Tensor) -> Tensor:
        scores = (q.float() @ k.float().transpose(-1, -2)) * self.scale
        if pair.kind == "causal":
            above = torch.ones(scores.shape[-2:], dtype=torch.bool, device=scores.device).triu(1)
            return scores.masked_fill_(above, NEG_INF)
        return scores + pair.bias if pair.kind == "masked" else scores

    @staticmethod
    def _bias(pair: PairMask, q: Tensor) -> Tensor | None:
        return None if pair.bias is None else pair.bias.to(q.dtype)  # the kernel takes a mask of the queries' dtype

    def forward(self, a: int, b: int, q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        pair = self.mask.pairs[a, b]
        k, v = self._expand(k), self._expand(v)
        if self._flash(q):
            out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
                q, k, v, 0.0, pair.kind == "causal", attn_mask=self._bias(pair, q), scale=self.scale
            )
        else:
            scores = self._scores(pair, q, k)
            lse = scores.logsumexp(-1)
            probs = (scores - lse.masked_fill(lse == NEG_INF, 0)[..., None]).exp_()
            if self.drop is not None:
                probs = probs * self._keep(a, b, probs.shape) / (1 - self.drop.p)
            out = probs @ v.float()
        # The kernel gives a query with no key here a log-sum-exp of 0; it must weigh nothing in the merge.
        return out.float(), lse if pair.empty is None else lse.masked_fill(pair.empty, NEG_INF)

    def backward(self, a, b, q, k, v, out, lse, grad_out) -> tuple[Tensor, Tensor, Tensor]:
        pair = self.mask.pairs[a, b]
        k, v = self._expand(k), self._expand(v)
        if self._flash(q):
            dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
                grad_out, q, k, v, out, lse, 0.0, pair.kind == "causal", attn_mask=self._bias(pair, q), scale=self.scale
            )
        else:
            grad_out, out = grad_out.float(), out.float()
            probs = (self._scores(pair, q, k) - lse[..., None]).exp_()
            grad_probs = grad_out @ v.float().transpose(-1, -2)
            if self.drop is not None:
                kept = self._keep(a, b, probs.shape) / (1 - self.drop.p)
                dv, grad_probs = (probs * kept).transpose(-1, -2) @ grad_out, grad_probs * kept
            else:
                dv = probs.transpose(-1, -2) @ grad_out
            grad_scores = probs * (grad_probs - (grad_out * out).sum(-1, keepdim=True)) * self.scale
            dq, dk = grad_scores @ k.float(), grad_scores.transpose(-1, -2) @ q.float()
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
