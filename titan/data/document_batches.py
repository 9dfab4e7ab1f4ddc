"""Document-level global batches (`data.batching = "tokens"`).

Each step takes whole documents from the shuffled stream until the next would pass a token budget, and a
balancer (titan/data/packing/) decides which data-parallel rank trains each one and in which micro-batch.
The documents of a step depend on (seed, step) only; where they go may differ between layouts, which
document masking makes irrelevant to the math (each document attends only to itself, the loss is divided
by the step's token count). Every rank computes the whole assignment from the step's lengths, so they agree
without a collective; a worker thread builds the next step's micro-batches while this one trains.

Under context parallelism the documents go to the slots of the dp x cp plane: a document longer than one rank's
capacity to a cp group's ring micro-batch (one row of cp times the capacity, which every rank of the group reads
whole and the step cuts to the rank's positions), the others to single ranks' local micro-batches (a row of the
rank's own, attended without the ring).
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import torch

from titan.data.loader import IGNORE, Batch
from titan.data.order import ORDER_VERSION, EpochOrder, warn_if_order_changed
from titan.data.packing import Assignment, CostModel, Target, balance_by_cost, balance_by_tokens
from titan.errors import ConfigError
from titan.run_plan import RankPlan, RunPlan

# Padding carries no loss and is cut into "documents" of PAD_BLOCK tokens (or a piece's most, if fewer) with ids
# -1, -2, ...: its attention
# then costs little, its positions stay within the RoPE table, and every weight still gets a gradient on every
# rank (FSDP reduce-scatters only the gradients that exist: a rank whose micro-batch left a weight without one
# would send fewer bytes than the others).
PAD_BLOCK = 64


class DocumentPieces:
    """A split's documents as pieces of at most `max_len` (input, label) pairs, in each epoch's order (the order
    PackedSamples reads, titan.data.order). A document of n tokens holds n - 1 pairs, cut into pieces at every
    max_len pairs from its start; piece (doc, start, length) reads its tokens [start, start + length + 1).
    A position in the stream is counted in pairs across epochs, at a piece's start."""

    def __init__(self, documents, split, max_len: int, seed: int, shuffle: bool, stream: int = 0):
        self.documents, self.max_len = documents, max_len
        self.order = EpochOrder(documents, split, seed, stream, shuffle, less=1)
        self.tokens_per_epoch = self.order.tokens_per_epoch  # pairs

    def step(self, first: int, budget: int) -> tuple[list[tuple[int, int, int]], int]:
        """The pieces (doc, start, length) of the step that starts at position `first`: as many as fit the budget
        in pairs (at least one), never across an epoch's end; and the next step's first position."""
        epoch, k = divmod(first, self.tokens_per_epoch)
        end = min(k + max(budget, self.max_len), self.tokens_per_epoch)
        pieces, taken = [], 0
        for doc, start, length in self.order.segments(epoch, k, end):
            pairs = self.order.document_length(doc) - 1
            while length:
                size = min(length, self.max_len - start % self.max_len)
                # A piece the range cut short, or one past the budget once a piece is taken: the next step's.
                if (size < self.max_len - start % self.max_len and start + size < pairs) or (
                    pieces and taken + size > budget
                ):
                    return pieces, epoch * self.tokens_per_epoch + k + taken
                pieces.append((doc, start, size))
                start, length, taken = start + size, length - size, taken + size
        return pieces, epoch * self.tokens_per_epoch + k + taken

    def tokens(self, doc: int, start: int, length: int) -> np.ndarray:
        return self.documents.tokens(doc, start, start + length + 1)

    def position_of_piece(self, piece: int) -> int:
        """The position where the `piece`-th piece (counted across epochs, as data order 1 counted) starts: a
        walk over the documents of up to two epochs, run once to resume such a checkpoint."""

        def walk(epoch: int, wanted: int | None) -> int:
            """Pieces in the epoch when `wanted` is None, else the position of the epoch's `wanted`-th."""
            seen = 0
            for _, running in self.order.windows(epoch):
                counts = -(-np.diff(running) // self.max_len)
                total = int(counts.sum())
                if wanted is not None and seen + total > wanted:
                    before = np.cumsum(counts) - counts
                    j = int(np.searchsorted(before, wanted - seen, side="right")) - 1
                    return int(running[j]) + (wanted - seen - int(before[j])) * self.max_len
                seen += total
            return seen if wanted is None else self.tokens_per_epoch

        epoch, k = divmod(piece, walk(0, None))
        return epoch * self.tokens_per_epoch + walk(epoch, k)


@dataclass(frozen=True)
class Placement:
    """The shape of this rank's Batches. Under a pipeline (`pipeline_rows` > 0) a Batch holds one schedule's
    micro-batches, a row each, padded to `capacity` tokens (the stages' buffers take one shape); otherwise a
    Batch is one micro-batch, one row of its own length padded to a multiple of `pad_multiple` (sequence
    parallelism splits the sequence over the tensor-parallel ranks). Under context parallelism (`cp` > 1) a ring
    micro-batch's row is padded to cp x capacity tokens, the length the ring cuts into chunks."""

    capacity: int
    pipeline_rows: int = 0
    pad_multiple: int = 1
    cp: int = 1


class DocumentBatchLoader:
    """This rank's micro-batches of each step's documents, placed by `balance` ("cost" or "tokens"); the rank is
    data-parallel rank `dp_rank` and, under context parallelism (target.cp > 1), cp rank `cp_rank` of its group."""

    def __init__(
        self,
        pieces: DocumentPieces,
        budget: int,
        balance: str,
        cost: CostModel,
        target: Target,
        placement: Placement,
        dp_rank: int,
        cp_rank: int = 0,
    ):
        self.pieces, self.budget, self.cost, self.target = pieces, budget, cost, target
        self.balance = balance_by_cost if balance == "cost" else balance_by_tokens
        self.balance_name = balance
        self.placement, self.dp_rank = placement, dp_rank
        self.slot = dp_rank * target.cp + cp_rank  # this rank's micro-batches in the assignment
        # Data-parallel ranks' relative speeds (a straggler re-plan sets them); a cp group's ranks share theirs.
        self.speeds = [1.0] * (target.ranks // target.cp)
        self.next_token = 0
        self.last_assignment: Assignment | None = None  # that of the step last returned, and the seconds it took
        self.assign_seconds = 0.0
        self._worker = ThreadPoolExecutor(1, thread_name_prefix="titan-batches")
        self._ahead = None  # (first piece, speeds, future of the step starting there)

    def follow(self, plan: RunPlan, me: RankPlan) -> None:
        """Dispatch the next step's documents by `plan`'s data-parallel speeds."""
        self.speeds = list(plan.dp_weights)

    def step_tokens(self, batches: list[Batch]) -> int:
        """The tokens of the step these batches belong to: its whole documents'."""
        return batches[0].step_loss_tokens

    def describe(self, plan: RunPlan, me: RankPlan) -> str:
        """What a step holds, for the run's first log line."""
        placed = f"placed by {self.balance_name} in micro-batches of at most {plan.document_capacity} tokens"
        if self.target.cp > 1:
            placed = (
                f"placed on rings of {plan.seq_len} tokens per cp group and local micro-batches of at most "
                f"{plan.document_capacity} tokens per rank"
            )
        return f"documents up to {plan.tokens_per_step} tokens/step, {placed}"

    def packing_metrics(self, measured: list[float]) -> dict[str, float]:
        """The last step's plan against what it took: predicted seconds per data-parallel rank (the slowest, and
        slowest over mean), and each rank's `measured` time for the step's micro-batches (waits at collectives
        included, so under FSDP every rank reads about the slowest's time); under context parallelism, how many
        micro-batches ran as rings and how many locally."""
        assigned = self.last_assignment
        mean = sum(measured) / len(measured)
        metrics = {
            "micro_batches": len(assigned.micro_batches[0]), "predicted_step_s": assigned.step_time,
            "predicted_imbalance": assigned.imbalance, "measured_step_s": max(measured),
            "measured_imbalance": max(measured) / mean if mean > 0 else 1.0,
            "plan_ms": self.assign_seconds * 1e3,
        }  # fmt: skip
        cp = self.target.cp
        if cp > 1:  # the cp groups' rings, and the single ranks' micro-batches that hold documents
            metrics["ring_micro_batches"] = sum(map(len, assigned.rings))
            metrics["local_micro_batches"] = sum(
                bool(docs) and m not in assigned.rings[slot // cp]
                for slot, bins in enumerate(assigned.micro_batches)
                for m, docs in enumerate(bins)
            )
        return metrics

    def state_dict(self) -> dict:
        return {"next_token": self.next_token, "budget": self.budget, "order": ORDER_VERSION}

    def load_state_dict(self, state: dict) -> None:
        if "next_token" in state:
            self.next_token = int(state["next_token"])
        elif "next_piece" in state:  # data order 1 counted pieces
            self.next_token = self.pieces.position_of_piece(int(state["next_piece"]))
        else:
            raise ConfigError("the checkpoint's data position counts rows (data.batching = 'rows'), not documents")
        warn_if_order_changed(state, [self.pieces.order])

    def __iter__(self):
        return self

    def __next__(self) -> list[Batch]:
        key = (self.next_token, tuple(self.speeds))
        if self._ahead is None or self._ahead[0] != key:
            self._ahead = (key, self._worker.submit(self._step, *key))
        batches, self.next_token, self.last_assignment, self.assign_seconds = self._ahead[1].result()
        key = (self.next_token, tuple(self.speeds))
        self._ahead = (key, self._worker.submit(self._step, *key))
        return batches

    def _step(self, first: int, speeds: tuple[float, ...]):
        pieces, following = self.pieces.step(first, self.budget)
        lengths = [length for _, _, length in pieces]
        start = time.perf_counter()
        slot_speeds = [s for s in speeds for _ in range(self.target.cp)]
        assignment = self.balance(lengths, self.cost, self.target, slot_speeds)
        seconds = time.perf_counter() - start
        total = sum(lengths)
        mine = assignment.micro_batches[self.slot]
        if self.target.cp > 1:  # no pipeline: a Batch per micro-batch
            rings = assignment.rings[self.dp_rank]
            batches = [self._batch([docs], pieces, total, ring=m in rings) for m, docs in enumerate(mine)]
        else:
            rows = self.placement.pipeline_rows or 1
            batches = [self._batch(mine[g : g + rows], pieces, total) for g in range(0, len(mine), rows)]
        return batches, following, assignment, seconds

    def _batch(
        self, micro_batches: list[list[int]], pieces: list[tuple[int, int, int]], step_tokens: int, ring: bool = False
    ) -> Batch:
        """One Batch: a row per micro-batch, its pieces one after another, then padding. `ring`: a cp group's row,
        padded to the ring's length."""
        p = self.placement
        rows = [self._row([pieces[i] for i in docs]) for docs in micro_batches]
        longest = max(len(r[0]) for r in rows)
        if ring:
            width = p.cp * p.capacity
        elif p.pipeline_rows:
            width = p.capacity
        else:
            width = max(p.pad_multiple, -(-longest // p.pad_multiple) * p.pad_multiple)
        inputs = torch.zeros(len(rows), width, dtype=torch.int64)
        labels = torch.full((len(rows), width), IGNORE, dtype=torch.int64)
        # No longer than a piece either: the model's RoPE table covers the longest piece's positions, no more.
        block = min(PAD_BLOCK, self.pieces.max_len)
        ids = (-1 - torch.arange(width) // block).repeat(len(rows), 1)
        for r, (x, y, d) in enumerate(rows):
            inputs[r, : len(x)], labels[r, : len(x)], ids[r, : len(x)] = x, y, d
        loss_tokens = int((labels != IGNORE).sum())
        local = p.cp > 1 and not ring
        return Batch(inputs, labels, torch.arange(len(rows)), ids, loss_tokens, step_tokens, local)

    def _row(self, pieces: list[tuple[int, int, int]]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if not pieces:
            empty = torch.zeros(0, dtype=torch.int64)
            return empty, empty, empty
        tokens = [self.pieces.tokens(*piece) for piece in pieces]
        inputs = torch.from_numpy(np.concatenate([t[:-1] for t in tokens]).astype(np.int64))
        labels = torch.from_numpy(np.concatenate([t[1:] for t in tokens]).astype(np.int64))
        ids = torch.from_numpy(np.repeat(np.arange(len(tokens)), [len(t) - 1 for t in tokens]))
        return inputs, labels, ids
