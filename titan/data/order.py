"""The order in which an epoch reads a source's documents, computed on demand: what a rank holds does not grow
with the number of documents.

A prepared source groups its documents into blocks of `block_documents` consecutive ones: one document per
block up to MAX_BLOCKS documents, larger blocks beyond so that there are never more than MAX_BLOCKS of them
(`block_documents`, fixed when the source is prepared). The index gives every block's token count at once
(`block_offsets`), so an epoch can order blocks, not documents:

1. it permutes the split's blocks (numpy's PCG64 seeded with [seed, stream, epoch]: the same permutation on
   every platform, rank and worker) and keeps the running token count at each block: two arrays of at most
   MAX_BLOCKS entries;
2. when blocks hold several documents, it shuffles the documents of each window of WINDOW_DOCUMENTS //
   block_documents consecutive permuted blocks (seeded with [seed, stream, epoch, window]), computed when a
   read falls in that window and kept in a small LRU.

A corpus of up to MAX_BLOCKS documents thus gets a full per-document shuffle (the order titan used before the
blocks), and a larger one a shuffle of blocks, then of documents within windows of about WINDOW_DOCUMENTS.
Validation holds out documents by a hash of their index (`held_out`), never by block: blocks grow with the
source, and a split that followed them would move most documents between training and validation whenever a
document is added. A split (`Split`) is therefore the blocks that hold any of its documents, with each one's
count of them and of their tokens, never one entry per document; a window keeps the split's documents as it is
read. The rows loader (PackedSamples) and token batching (DocumentPieces) both read documents through `EpochOrder`.
"""

from __future__ import annotations

import collections
import logging
import mmap
from dataclasses import dataclass

import numpy as np

from titan.errors import ConfigError

# In the loaders' checkpoint state: 1 ordered documents, 2 orders blocks (this module) and held out blocks, 3 holds
# out documents (the same split as 2 for sources of up to MAX_BLOCKS documents).
ORDER_VERSION = 3
MAX_BLOCKS = 2**20  # what a rank holds per split and epoch: 8 bytes per block in each of two arrays
WINDOW_DOCUMENTS = 2**16  # documents shuffled together when blocks hold several
# Past the first MAX_BLOCKS documents, validation holds out runs of this many consecutive documents: a rank then
# finds the held-out documents of 10^9 by hashing 2.4 10^5 runs, and reads their token counts at the held runs'
# ends (2 x 12,000 reads of offsets.npy at validation.fraction 0.05).
HOLD_OUT_RUN = 2**12
_RUN_KEYS = np.uint64(2**62)  # added to a run's index before hashing: no run hashes as a document does
_WINDOWS_KEPT = 4  # a global batch's rows span one or two windows; a few more cost little
log = logging.getLogger("titan")


def block_documents(n_documents: int) -> int:
    """Documents per block of a source of `n_documents`: 1 up to MAX_BLOCKS documents, then as few as keep
    the number of blocks at MAX_BLOCKS or below."""
    return max(1, -(-n_documents // MAX_BLOCKS))


def block_offsets(offsets: np.ndarray, per_block: int) -> np.ndarray:
    """The token offset of every block's first document, and the source's token count after them."""
    n_documents = len(offsets) - 1
    return np.asarray(offsets[np.r_[0:n_documents:per_block, n_documents]], dtype=np.int64)


def held_out(documents: int | np.ndarray, fraction: float) -> np.ndarray:
    """Whether each document (an array of indices, or a count n: documents 0 to n - 1) belongs to the validation
    split: a hash of its index below `fraction`, of its own among the first MAX_BLOCKS documents, of its run of
    HOLD_OUT_RUN beyond. It depends on the index alone, never on the seed, the layout, the blocks or the number
    of documents, so a source that grows keeps every document on its side."""
    docs = np.arange(documents) if np.isscalar(documents) else np.asarray(documents)
    docs = docs.astype(np.uint64)
    x = np.where(docs < MAX_BLOCKS, docs, docs // np.uint64(HOLD_OUT_RUN) + _RUN_KEYS)
    with np.errstate(over="ignore"):  # splitmix64: wrapping 64-bit arithmetic is the point
        x = x + np.uint64(0x9E3779B97F4A7C15)
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        x = x ^ (x >> np.uint64(31))
    return (x >> np.uint64(11)).astype(np.float64) * 2.0**-53 < fraction


@dataclass(frozen=True)
class Split:
    """Some documents of a source: `blocks`, the ids of the blocks holding any of them, and of each block, how
    many of its documents (`counts`) and their tokens (`tokens`) belong to the split. `side` None: every document
    of those blocks; True or False: those whose held_out(·, fraction) is `side` (validation's or training's)."""

    blocks: np.ndarray
    counts: np.ndarray
    tokens: np.ndarray
    fraction: float = 0.0
    side: bool | None = None

    def keep(self, docs: np.ndarray) -> np.ndarray:
        """Those of `docs` (documents of the split's blocks) that belong to it."""
        return docs if self.side is None else docs[held_out(docs, self.fraction) == self.side]


def whole_blocks(documents, blocks) -> Split:
    """The split of every document of these blocks (their ids)."""
    blocks = np.asarray(blocks, dtype=np.int64)
    edges = np.asarray(documents.block_offsets, dtype=np.int64)
    first = blocks * documents.block_documents
    counts = np.minimum(first + documents.block_documents, documents.n_documents) - first
    return Split(blocks, counts, edges[blocks + 1] - edges[blocks])


def hold_out(documents, fraction: float) -> tuple[Split, Split]:
    """(training, validation) documents of a source, validation holding out those held_out picks."""
    n_blocks = len(documents.block_offsets) - 1
    if documents.block_documents == 1:  # a block is a document: whole blocks on either side
        held = held_out(n_blocks, fraction)
        return whole_blocks(documents, np.flatnonzero(~held)), whole_blocks(documents, np.flatnonzero(held))
    every = whole_blocks(documents, np.arange(n_blocks))
    counts, tokens = _held_per_block(documents, fraction)
    return _side(every.counts - counts, every.tokens - tokens, fraction, False), _side(counts, tokens, fraction, True)


def _side(counts: np.ndarray, tokens: np.ndarray, fraction: float, side: bool) -> Split:
    """One side of the split from every block's count of its documents and tokens, over the blocks holding any."""
    some = np.flatnonzero(counts)
    return Split(some, counts[some], tokens[some], fraction, side)


def _held_per_block(documents, fraction: float) -> tuple[np.ndarray, np.ndarray]:
    """How many of each block's documents validation holds out, and their tokens: from the held-out ranges of
    documents and the token offsets at their ends, so only the offsets of those ends are read."""
    starts, ends = _held_ranges(documents.n_documents, fraction)
    range_tokens = _entries(documents.offsets, ends) - _entries(documents.offsets, starts)
    # Held-out documents and tokens before each block's first document (and the source's end): the ranges that
    # end by then, and the part before it of the range it falls in, if any.
    bounds = np.minimum(np.arange(len(documents.block_offsets)) * documents.block_documents, documents.n_documents)
    done = np.searchsorted(ends, bounds, side="right")
    docs_before = np.r_[0, np.cumsum(ends - starts)][done]
    tokens_before = np.r_[0, np.cumsum(range_tokens)][done]
    inside = np.flatnonzero(done < len(starts))
    inside = inside[starts[done[inside]] < bounds[inside]]
    cut = starts[done[inside]]
    docs_before[inside] += bounds[inside] - cut
    tokens_before[inside] += np.asarray(documents.block_offsets)[inside] - _entries(documents.offsets, cut)
    return np.diff(docs_before), np.diff(tokens_before)


def _entries(array, indices: np.ndarray) -> np.ndarray:
    """array[indices]; from a memory map (of a whole .npy file), through a map of its own that reads each page
    alone: a fault on a plain map reads read_ahead_kb around it (megabytes on some systems), so entries spread
    over a large offsets.npy would read most of it."""
    if not isinstance(array, np.memmap):
        return np.asarray(array[indices])
    with open(array.filename, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as pages:
        pages.madvise(mmap.MADV_RANDOM)
        return np.frombuffer(pages, array.dtype, count=array.size, offset=array.offset)[indices].astype(np.int64)


def _held_ranges(n_documents: int, fraction: float) -> tuple[np.ndarray, np.ndarray]:
    """The documents held_out picks from a source of n_documents, as sorted, disjoint ranges [start, end): one
    document each among the first MAX_BLOCKS, then runs of HOLD_OUT_RUN, hashed MAX_BLOCKS runs at a time."""
    singles = np.flatnonzero(held_out(min(n_documents, MAX_BLOCKS), fraction))
    starts, ends = [singles], [singles + 1]
    n_runs = -(-n_documents // HOLD_OUT_RUN)
    for first in range(MAX_BLOCKS // HOLD_OUT_RUN, n_runs, MAX_BLOCKS):
        runs = np.arange(first, min(first + MAX_BLOCKS, n_runs))
        begin = np.maximum(runs * HOLD_OUT_RUN, MAX_BLOCKS)  # a run's documents past the first MAX_BLOCKS
        end = np.minimum((runs + 1) * HOLD_OUT_RUN, n_documents)
        held = (begin < end) & held_out(begin, fraction)
        starts.append(begin[held])
        ends.append(end[held])
    return np.concatenate(starts).astype(np.int64), np.concatenate(ends).astype(np.int64)


class EpochOrder:
    """The documents of a split of a source in each epoch's order, as one stream of tokens per epoch.

    `documents` gives `n_documents`, `offsets` (each document's first token in the source, and the total: a
    memory map is fine, it is read a window at a time), `block_documents` and `block_offsets`. `split` is a
    Split, or block ids (every document of those blocks). Each document counts its length less `less` tokens in
    the stream (1: token batching counts (input, label) pairs); a document holds at least `less` tokens.
    """

    def __init__(self, documents, split, seed: int, stream: int, shuffle: bool, less: int = 0):
        self.documents, self.offsets = documents, documents.offsets
        self.split = split if isinstance(split, Split) else whole_blocks(documents, split)
        self.blocks = self.split.blocks
        self.seed, self.stream, self.shuffle, self.less = seed, stream, shuffle, less
        self.per_block = documents.block_documents
        self.block_counts = self.split.counts
        self.block_tokens = self.split.tokens - less * self.block_counts
        self.documents_per_epoch = int(self.block_counts.sum())
        self.tokens_per_epoch = int(self.block_tokens.sum())
        self.window_blocks = max(1, WINDOW_DOCUMENTS // self.per_block)
        self._epochs: collections.OrderedDict = collections.OrderedDict()  # epoch -> (blocks, running tokens)
        self._windows: collections.OrderedDict = collections.OrderedDict()  # (epoch, window) -> (docs, running)

    def segments(self, epoch: int, begin: int, end: int) -> list[tuple[int, int, int]]:
        """Where tokens [begin, end) of the epoch's stream come from: (document, its first token used, tokens
        used), in order; documents that add no token to the stream are left out."""
        if begin >= end:
            return []
        blocks_running = self._epoch(epoch)[1]
        window = (int(np.searchsorted(blocks_running, begin, side="right")) - 1) // self.window_blocks
        docs, running = self._window(epoch, window)
        j = int(np.searchsorted(running, begin, side="right")) - 1
        out = []
        while begin < end:
            if j >= len(docs):  # the window's end: the next window starts at this very token
                window += 1
                docs, running = self._window(epoch, window)
                j = 0
                continue
            stop = min(end, int(running[j + 1]))
            if stop > begin:
                out.append((int(docs[j]), begin - int(running[j]), stop - begin))
            begin, j = stop, j + 1
        return out

    def windows(self, epoch: int):
        """(documents, running token counts) of each window of the epoch, in order."""
        for window in range(-(-len(self.blocks) // self.window_blocks)):
            yield self._window(epoch, window)

    def document_length(self, doc: int) -> int:
        return int(self.offsets[doc + 1] - self.offsets[doc])

    def _epoch(self, epoch: int) -> tuple[np.ndarray, np.ndarray]:
        """(the split's blocks in this epoch's order, the stream's token count before each, plus the end)."""
        if epoch not in self._epochs:
            order = np.arange(len(self.blocks))
            if self.shuffle:
                order = np.random.default_rng([self.seed, self.stream, epoch]).permutation(len(self.blocks))
            running = np.zeros(len(order) + 1, dtype=np.int64)
            np.cumsum(self.block_tokens[order], out=running[1:])
            self._epochs[epoch] = (self.blocks[order], running)
            if len(self._epochs) > 2:  # reads near an epoch's end may still ask for the one before
                self._epochs.popitem(last=False)
        self._epochs.move_to_end(epoch)
        return self._epochs[epoch]

    def _window(self, epoch: int, window: int) -> tuple[np.ndarray, np.ndarray]:
        """(the documents of one window of the epoch, in order; the stream's token count before each, plus the
        window's end)."""
        key = (epoch, window)
        if key not in self._windows:
            blocks, blocks_running = self._epoch(epoch)
            first_block = window * self.window_blocks
            blocks = blocks[first_block : first_block + self.window_blocks]
            if not len(blocks):
                raise IndexError(f"token {blocks_running[-1]} is past the end of epoch {epoch}'s stream")
            # Each block's documents, consecutive ids from its first: block b holds b * per_block onwards.
            counts = np.minimum((blocks + 1) * self.per_block, self.documents.n_documents) - blocks * self.per_block
            ends = np.cumsum(counts)
            docs = self.split.keep(np.arange(ends[-1]) + np.repeat(blocks * self.per_block - (ends - counts), counts))
            if self.per_block > 1 and self.shuffle:
                rng = np.random.default_rng([self.seed, self.stream, epoch, window])
                docs = docs[rng.permutation(len(docs))]
            lengths = np.asarray(self.offsets[docs + 1]) - np.asarray(self.offsets[docs]) - self.less
            running = np.empty(len(docs) + 1, dtype=np.int64)
            running[0] = blocks_running[first_block]
            np.cumsum(lengths, out=running[1:])
            running[1:] += running[0]
            self._windows[key] = (docs, running)
            if len(self._windows) > _WINDOWS_KEPT:
                self._windows.popitem(last=False)
        self._windows.move_to_end(key)
        return self._windows[key]


def warn_if_order_changed(state: dict, orders: list[EpochOrder]) -> None:
    """One warning line when a checkpoint's data position counts in another data order than this titan's.

    A checkpoint of an older order (1: no "order" key) resumes rather than being refused: up to MAX_BLOCKS
    documents a block is one document and validation holds out the same documents, so orders 1 to 3 are the
    same and nothing is said; a larger source's order and validation split changed, and going on from the same
    position costs at most some repeated or skipped documents in the current epoch, less than restarting a long
    run.
    """
    version = int(state.get("order", 1))
    if version > ORDER_VERSION:
        raise ConfigError(
            f"the checkpoint's data position counts in data order version {version}, newer than this titan's "
            f"({ORDER_VERSION}); resume it with the titan that wrote it"
        )
    if version < ORDER_VERSION and any(order.per_block > 1 for order in orders):
        log.warning(
            "data order changed: the checkpoint counts samples in data order version %d, this titan reads version "
            "%d (sources of more than %d documents are shuffled by blocks, and hold out validation by document "
            "since version 3), so the run goes on from the same position in the new order: this epoch may repeat "
            "or skip documents, and some documents changed sides between training and validation",
            version, ORDER_VERSION, MAX_BLOCKS,
        )  # fmt: skip
