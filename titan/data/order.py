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
Validation holds out whole blocks (`held_out`), so a split is a list of block ids, never one entry per document.
The rows loader (PackedSamples) and token batching (DocumentPieces) both read documents through `EpochOrder`.
"""

from __future__ import annotations

import collections
import logging

import numpy as np

from titan.errors import ConfigError

ORDER_VERSION = 2  # in the loaders' checkpoint state: 1 ordered documents, 2 orders blocks (this module)
MAX_BLOCKS = 2**20  # what a rank holds per split and epoch: 8 bytes per block in each of two arrays
WINDOW_DOCUMENTS = 2**16  # documents shuffled together when blocks hold several
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


def held_out(n_blocks: int, fraction: float) -> np.ndarray:
    """Whether each block belongs to the validation split: a hash of its index below `fraction`, so the split
    never depends on the seed, the layout or the other blocks."""
    x = np.arange(n_blocks, dtype=np.uint64)
    with np.errstate(over="ignore"):  # splitmix64: wrapping 64-bit arithmetic is the point
        x = x + np.uint64(0x9E3779B97F4A7C15)
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        x = x ^ (x >> np.uint64(31))
    return (x >> np.uint64(11)).astype(np.float64) * 2.0**-53 < fraction


class EpochOrder:
    """The documents of some blocks of a source in each epoch's order, as one stream of tokens per epoch.

    `documents` gives `n_documents`, `offsets` (each document's first token in the source, and the total: a
    memory map is fine, it is read a window at a time), `block_documents` and `block_offsets`. `blocks` are the
    split's block ids. Each document counts its length less `less` tokens in the stream (1: token batching
    counts (input, label) pairs); a document holds at least `less` tokens.
    """

    def __init__(self, documents, blocks, seed: int, stream: int, shuffle: bool, less: int = 0):
        self.documents, self.offsets = documents, documents.offsets
        self.blocks = np.asarray(blocks, dtype=np.int64)
        self.seed, self.stream, self.shuffle, self.less = seed, stream, shuffle, less
        self.per_block = documents.block_documents
        edges = np.asarray(documents.block_offsets, dtype=np.int64)
        first = self.blocks * self.per_block
        self.block_counts = np.minimum(first + self.per_block, documents.n_documents) - first
        self.block_tokens = edges[self.blocks + 1] - edges[self.blocks] - less * self.block_counts
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
            docs = np.arange(ends[-1]) + np.repeat(blocks * self.per_block - (ends - counts), counts)
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

    A checkpoint of order 1 (no "order" key) resumes rather than being refused: up to MAX_BLOCKS documents a
    block is one document, so order 1 and 2 are the same and nothing is said; a larger source's order and
    validation split changed, and going on from the same position costs at most some repeated or skipped
    documents in the current epoch, less than restarting a long run.
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
            "%d (sources of more than %d documents are shuffled by blocks and hold out validation by blocks), so "
            "the run goes on from the same position in the new order: this epoch may repeat or skip documents",
            version, ORDER_VERSION, MAX_BLOCKS,
        )  # fmt: skip
