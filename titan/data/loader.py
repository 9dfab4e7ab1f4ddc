"""One global batch per step, the same for every layout; each data-parallel rank reads its rows of it.

The sample order is a pure function of (seed, epoch): every epoch shuffles the documents of each source,
concatenates them, and cuts the stream into windows of seq_len + 1 tokens (inputs and, shifted by one,
labels); a window never spans two epochs, and the tail that fills no window is dropped. With several
sources, a fixed blend pattern says which source serves each global sample (`Blend`). Global sample g is
row g % G of step g // G for a global batch of G rows, so the loader's whole state is one integer, the next
global sample: resuming costs the same at any position, and a run resumed with another data-parallel size
reads exactly the batches the original run would have read.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np
import torch

from titan.config import blend_period
from titan.errors import ConfigError

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
        )


def epoch_order(subset: np.ndarray, seed: int, stream: int, epoch: int, shuffle: bool) -> np.ndarray:
    """The documents of `subset` in this epoch's order: numpy's PCG64 seeded with explicit integers gives the
    same permutation on every platform and rank."""
    if not shuffle:
        return subset
    return subset[np.random.default_rng([seed, stream, epoch]).permutation(len(subset))]


class PackedSamples:
    """Windows of seq_len + 1 tokens cut from a set of documents, in a shuffled order per epoch.

    `documents` is anything with `lengths` (int64 per document) and `tokens(doc, start, stop)`, such as
    PreparedDocuments; `subset` picks the documents (a train or validation split) by index.
    """

    def __init__(self, documents, subset: np.ndarray, seq_len: int, seed: int, shuffle: bool, stream: int = 0):
        self.documents, self.subset = documents, np.asarray(subset, dtype=np.int64)
        self.window = seq_len + 1
        self.seed, self.shuffle, self.stream = seed, shuffle, stream
        self.samples_per_epoch = int(np.asarray(documents.lengths)[self.subset].sum()) // self.window
        self._epochs: dict[int, tuple[np.ndarray, np.ndarray]] = {}

    def _epoch(self, epoch: int) -> tuple[np.ndarray, np.ndarray]:
        """(documents in this epoch's order, the stream offset where each starts, plus the end)."""
        if epoch not in self._epochs:
            order = epoch_order(self.subset, self.seed, self.stream, epoch, self.shuffle)
            starts = np.zeros(len(order) + 1, dtype=np.int64)
            np.cumsum(np.asarray(self.documents.lengths)[order], out=starts[1:])
            self._epochs = {e: v for e, v in self._epochs.items() if e == epoch - 1}  # rows may straddle two epochs
            self._epochs[epoch] = (order, starts)
        return self._epochs[epoch]

    def sample(self, index: int) -> tuple[np.ndarray, list[int]]:
        """Sample `index` (counted across epochs): its window of tokens and the length of each document
        segment in it, in order."""
        epoch, k = divmod(index, self.samples_per_epoch)
        order, starts = self._epoch(epoch)
        begin, end = k * self.window, (k + 1) * self.window
        doc = int(np.searchsorted(starts, begin, side="right")) - 1
        pieces, lengths = [], []
        while begin < end:
            stop = min(end, int(starts[doc + 1]))
            offset = begin - int(starts[doc])
            pieces.append(self.documents.tokens(int(order[doc]), offset, offset + stop - begin))
            lengths.append(stop - begin)
            begin, doc = stop, doc + 1
        return np.concatenate(pieces), lengths

    def segments(self, indices: np.ndarray) -> np.ndarray:
        """How many document segments each of these samples holds, without reading any token."""
        counts = np.empty(len(indices), dtype=np.int64)
        epochs, ks = np.divmod(indices, self.samples_per_epoch)
        for epoch in np.unique(epochs):
            _, starts = self._epoch(int(epoch))
            k = ks[epochs == epoch]
            first = np.searchsorted(starts, k * self.window, side="right")
            last = np.searchsorted(starts, (k + 1) * self.window - 1, side="right")
            counts[epochs == epoch] = last - first + 1
        return counts


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
        self.document_mask = document_mask
        self.assign(rows, micro_batches)
        self.next_sample = 0

    def assign(self, rows: range, micro_batches: list[int]) -> None:
        if sum(micro_batches) != len(rows) or not 0 <= rows.start <= rows.stop <= self.global_batch:
            raise ValueError(f"micro-batches {micro_batches} do not cover rows {rows} of {self.global_batch}")
        self.rows, self.micro_batches = rows, list(micro_batches)

    def state_dict(self) -> dict:
        return {"next_sample": self.next_sample, "global_batch": self.global_batch}

    def load_state_dict(self, state: dict) -> None:
        self.next_sample = int(state["next_sample"])

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


def held_out(n_documents: int, fraction: float) -> np.ndarray:
    """Whether each document belongs to the validation split: a hash of its index below `fraction`, so the
    split never depends on the seed, the layout or the other documents."""
    x = np.arange(n_documents, dtype=np.uint64)
    with np.errstate(over="ignore"):  # splitmix64: wrapping 64-bit arithmetic is the point
        x = x + np.uint64(0x9E3779B97F4A7C15)
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        x = x ^ (x >> np.uint64(31))
    return (x >> np.uint64(11)).astype(np.float64) * 2.0**-53 < fraction


def check_enough_tokens(samples: PackedSamples, what: str) -> None:
    if samples.samples_per_epoch == 0:
        tokens = int(np.asarray(samples.documents.lengths)[samples.subset].sum())
        raise ConfigError(
            f"{what} has {tokens} tokens in {len(samples.subset)} documents, fewer than one sequence of "
            f"training.seq_len + 1 = {samples.window}; use more data or a shorter training.seq_len"
        )
