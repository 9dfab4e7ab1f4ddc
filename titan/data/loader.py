"""One global batch per step, the same for every layout; each data-parallel rank reads its rows of it.

The sample order is a pure function of (seed, epoch): every epoch orders the documents of each source
(titan.data.order, computed on demand), concatenates them, and cuts the stream into windows of seq_len + 1
tokens (inputs and, shifted by one, labels); a window never spans two epochs, and the tail that fills no window
is dropped. With several sources, a fixed blend pattern says which source serves each global sample (`Blend`; one
per stage of a run in [[data.stages]], titan/data/stages.py).
Global sample g is row g % G of step g // G for a global batch of G rows, so the loader's whole state is one
integer, the next global sample: resuming costs the same at any position, and a run resumed with another
data-parallel size reads exactly the batches the original run would have read.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np
import torch

from titan.config import blend_period
from titan.data.order import ORDER_VERSION, EpochOrder, warn_if_order_changed
from titan.errors import ConfigError
from titan.run_plan import RankPlan, RunPlan

IGNORE = -100  # label of a token that carries no loss (F.cross_entropy's default ignore_index)


@dataclass
class Batch:
    """Rows of one micro-batch, with everything the model, dropout and the loss read."""

    inputs: torch.Tensor  # (rows, seq_len) token ids
    labels: torch.Tensor  # (rows, seq_len) next tokens; IGNORE where the next token is another document's
    rows: torch.Tensor  # (rows,) each row's index in the step's global batch: dropout masks are keyed by it
    # (rows, seq_len) the document of each token: tokens attend only within their document, and positions
    # (for RoPE) restart at 0 where the id changes. None: each row is one causal sequence.
    document_ids: torch.Tensor | None
    loss_tokens: int  # labels of this micro-batch that carry a loss
    step_loss_tokens: int  # ... of the step's whole global batch: every rank divides its loss sum by this
    # Under context parallelism: rows of this rank's own (tokens batching's local micro-batches), attended without
    # the ring, rather than rows its cp group shares, of which the step takes this rank's positions.
    local: bool = False

    def to(self, device: torch.device) -> Batch:
        # From pinned memory the copy to a GPU runs in the background; from pageable memory the host waits.
        pin = device.type == "cuda"
        move = lambda t: None if t is None else (t.pin_memory() if pin else t).to(device, non_blocking=True)  # noqa: E731
        return Batch(
            move(self.inputs),
            move(self.labels),
            move(self.rows),
            move(self.document_ids),
            self.loss_tokens,
            self.step_loss_tokens,
            self.local,
        )


class PackedSamples:
    """Windows of seq_len + 1 tokens cut from the stream of a split's documents in each epoch's order
    (titan.data.order).

    `documents` is anything EpochOrder reads (such as PreparedDocuments) that also gives
    `tokens(doc, start, stop)`; `split` picks the documents (a train or validation split, or block ids).
    """

    def __init__(self, documents, split, seq_len: int, seed: int, shuffle: bool, stream: int = 0):
        self.documents = documents
        self.order = EpochOrder(documents, split, seed, stream, shuffle)
        self.window = seq_len + 1
        self.samples_per_epoch = self.order.tokens_per_epoch // self.window

    def sample(self, index: int) -> tuple[np.ndarray, list[int]]:
        """Sample `index` (counted across epochs): its window of tokens and the length of each document
        segment in it, in order."""
        segments = self._segments(index)
        tokens = [self.documents.tokens(doc, start, start + length) for doc, start, length in segments]
        return np.concatenate(tokens), [length for _, _, length in segments]

    def segments(self, indices: np.ndarray) -> np.ndarray:
        """How many document segments each of these samples holds, without reading any token."""
        return np.array([len(self._segments(int(i))) for i in indices], dtype=np.int64)

    def _segments(self, index: int) -> list[tuple[int, int, int]]:
        epoch, k = divmod(index, self.samples_per_epoch)
        return self.order.segments(epoch, k * self.window, (k + 1) * self.window)


class Blend:
    """Which source serves each global sample: a fixed pattern of `blend_period(weights)` samples, repeated, in
    which each source serves its share of the period to within one sample (the largest remainders get the
    samples that rounding down leaves), its k-th sample placed near (k + 1/2) / count of the way through.
    Sample g is then the n-th sample of its source with n known in O(1), so a mixture resumes anywhere at once."""

    def __init__(self, weights: list[float]):
        self.period = blend_period(weights)
        exact = np.asarray(weights, dtype=np.float64) / sum(weights) * self.period
        counts = np.floor(exact).astype(np.int64)
        left = self.period - int(counts.sum())
        counts[np.argsort(counts - exact, kind="stable")[:left]] += 1
        # Each source's slots in order of their ideal places; a stable sort keeps every source's own order.
        place = np.concatenate([(np.arange(n) + 0.5) / n for n in counts])
        order = np.argsort(place, kind="stable")
        self.pattern = np.repeat(np.arange(len(counts)), counts)[order]
        self.ordinal = np.concatenate([np.arange(n) for n in counts])[order]  # earlier slots of the same source
        self.per_period = counts

    def locate(self, sample: int) -> tuple[int, int]:
        """(source, that source's own sample index) of global sample `sample`."""
        cycle, slot = divmod(sample, self.period)
        source = int(self.pattern[slot])
        return source, cycle * int(self.per_period[source]) + int(self.ordinal[slot])

    def counts(self, n_samples: int) -> np.ndarray:
        """Samples each source serves among the first n_samples."""
        cycles, rest = divmod(n_samples, self.period)
        return cycles * self.per_period + np.bincount(self.pattern[:rest], minlength=len(self.per_period))


class GlobalBatchLoader:
    """This rank's micro-batches of each step's global batch.

    `rows` are this rank's rows of the global batch (contiguous, so shares may differ between ranks), read
    in micro-batches of `micro_batches` rows each (their sizes, summing to len(rows)). `assign` changes both
    at a step boundary (a re-plan): the global batches stay the same, only who reads which rows changes.
    """

    def __init__(
        self,
        sources: list[PackedSamples],
        blend: Blend,
        global_batch: int,
        rows: range,
        micro_batches: list[int],
        document_mask: bool,
    ):
        self.sources, self.blend, self.global_batch = sources, blend, global_batch
        self.seq_len = sources[0].window - 1
        self.document_mask = document_mask
        self.assign(rows, micro_batches)
        self.next_sample = 0

    def follow(self, plan: RunPlan, me: RankPlan) -> None:
        """Read this rank's rows of `plan` from the next step on."""
        self.assign(me.rows, list(me.micro_batches))

    def step_tokens(self, batches: list[Batch]) -> int:
        """The tokens of the step these batches belong to: the whole global batch's."""
        return self.global_batch * self.seq_len

    def describe(self, plan: RunPlan, me: RankPlan) -> str:
        """What a step holds, for the run's first log line."""
        rows = " + ".join(map(str, me.micro_batches))
        return f"{plan.tokens_per_step} tokens/step ({plan.global_rows} x {self.seq_len} seq; this rank {rows} rows)"

    def assign(self, rows: range, micro_batches: list[int]) -> None:
        if sum(micro_batches) != len(rows) or not 0 <= rows.start <= rows.stop <= self.global_batch:
            raise ValueError(f"micro-batches {micro_batches} do not cover rows {rows} of {self.global_batch}")
        self.rows, self.micro_batches = rows, list(micro_batches)

    def state_dict(self) -> dict:
        return {"next_sample": self.next_sample, "global_batch": self.global_batch, "order": ORDER_VERSION}

    def load_state_dict(self, state: dict) -> None:
        self.next_sample = int(state["next_sample"])
        warn_if_order_changed(state, [s.order for s in self.sources])

    def __iter__(self):
        return self

    def __next__(self) -> list[Batch]:
        batches = self.batches_at(self.next_sample)
        self.next_sample += self.global_batch
        return batches

    def batches_at(self, first_sample: int) -> list[Batch]:
        """The micro-batches of this rank's rows of the global batch that starts at global sample
        `first_sample` (a pure function of it)."""
        step_loss_tokens = self._loss_tokens(np.arange(first_sample, first_sample + self.global_batch))
        bounds = [self.rows.start, *(self.rows.start + n for n in itertools.accumulate(self.micro_batches))]
        return [
            self._batch(first_sample, range(start, stop), step_loss_tokens)
            for start, stop in zip(bounds[:-1], bounds[1:])
        ]

    def _loss_tokens(self, samples: np.ndarray) -> int:
        """Labels carrying a loss in these samples: every token but the window's last, less one for each
        document boundary when documents are masked (a document's last token does not predict the next's first).
        Counted for the whole global batch from the sample order alone, with no collective."""
        window = self.sources[0].window - 1
        if not self.document_mask:
            return len(samples) * window
        located = np.array([self.blend.locate(int(s)) for s in samples]).reshape(-1, 2)
        total = 0
        for source_id, source in enumerate(self.sources):
            mine = located[located[:, 0] == source_id, 1]
            total += int((window - (source.segments(mine) - 1)).sum())
        return total

    def _batch(self, first_sample: int, rows: range, step_loss_tokens: int) -> Batch:
        tokens, document_ids = [], []
        for row in rows:
            source_id, index = self.blend.locate(first_sample + row)
            window, lengths = self.sources[source_id].sample(index)
            tokens.append(window)
            document_ids.append(np.repeat(np.arange(len(lengths)), lengths))
        tokens = torch.from_numpy(np.stack(tokens))
        # Copies, not views: masking labels must not write into the inputs (a one-row slice counts as
        # contiguous, so .contiguous() would return a view), and pipelining sends contiguous tensors.
        inputs, labels = tokens[:, :-1].clone(), tokens[:, 1:].clone()
        batch_rows = torch.arange(rows.start, rows.stop)
        if not self.document_mask:
            return Batch(inputs, labels, batch_rows, None, labels.numel(), step_loss_tokens)
        ids = torch.from_numpy(np.stack(document_ids))
        labels[ids[:, 1:] != ids[:, :-1]] = IGNORE
        return Batch(
            inputs, labels, batch_rows, ids[:, :-1].contiguous(), int((labels != IGNORE).sum()), step_loss_tokens
        )


def check_enough_tokens(samples: PackedSamples, what: str) -> None:
    if samples.samples_per_epoch == 0:
        order = samples.order
        raise ConfigError(
            f"{what} has {order.tokens_per_epoch} tokens in {order.documents_per_epoch} documents, fewer than one "
            f"sequence of training.seq_len + 1 = {samples.window}; use more data or a shorter training.seq_len"
        )
