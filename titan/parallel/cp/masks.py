"""The ring's masks: which chunk pairs a rank computes, and how each pair's queries attend to its keys.

Work is planned per pair of chunks (a query chunk, a key chunk), from global positions: a pair whose keys all
come after its queries is skipped (the fully masked half, on and off the diagonal), so is one whose documents
never meet; a diagonal pair is causal, a pair below it is attended whole, and a pair where documents meet only
in part is attended document by document (each shared document's queries to its keys), as one process attends
one document at a time: a document of s tokens costs about s² whatever the chunks. RoPE positions and document
ids are the whole row's (the model computes them on the row and takes this rank's positions), and dropout masks
are keyed by global position (rng.Dropout.sequence and keep_mask), so every mask is bitwise the one a single
process draws.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

NEG_INF = float("-inf")


class PairKind(enum.Enum):
    """How a query chunk attends to a key chunk."""

    CAUSAL = "causal"  # the diagonal
    FULL = "full"  # every query to every key
    SPANS = "spans"  # by the documents the two chunks share


@dataclass(frozen=True)
class PairMask:
    """How a query chunk attends to a key chunk: CAUSAL (the diagonal), FULL, or by SPANS: the documents the two
    chunks share, each as (row, query start, query stop, key start, key stop) within the chunks, causal on the
    diagonal (there a document's query and key spans are the same) and whole below it."""

    kind: PairKind
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


def ring_mask(chunks: tuple[int, ...], chunk: int, document_ids: Tensor | None) -> RingMask:
    """The pairs to compute for query chunks `chunks` (by global index, of `chunk` tokens each) of rows of these
    documents ((batch, seq), the whole rows; None: one causal sequence per row)."""
    pairs = {}
    runs = None if document_ids is None else document_runs(document_ids)
    for a in chunks:
        for b in range(a + 1):  # keys after every query of the chunk: nothing to attend to
            whole = PairMask(PairKind.CAUSAL if a == b else PairKind.FULL)
            if runs is None:
                pairs[a, b] = whole
                continue
            spans = shared_documents(runs, chunk, a, b)
            if not spans:
                continue
            # One document across both chunks in every row: the whole pair in one kernel call.
            one = len(spans) == len(runs) and all(
                (qs, qe, ks, ke) == (0, chunk, 0, chunk) for _, qs, qe, ks, ke in spans
            )
            pairs[a, b] = whole if one else PairMask(PairKind.SPANS, tuple(spans))
    return RingMask(pairs)


def shared_documents(runs, chunk: int, a: int, b: int) -> list[tuple[int, int, int, int, int]]:
    """The documents that query chunk `a` and key chunk `b` (b <= a) share, as PairMask spans."""
    c, spans = chunk, []
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
