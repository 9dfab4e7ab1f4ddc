"""A prepared source read back through memory maps."""

from __future__ import annotations

import collections
from pathlib import Path

import numpy as np

from titan.data.prepared.cache import _check, _shard_name

OPEN_SHARDS = 64  # shard maps a reader keeps open (each holds a file descriptor), the least recently read closed


class PreparedDocuments:
    """A prepared source, read through memory maps: what titan.data.order reads (`n_documents`, `offsets`,
    `block_documents`, `block_offsets`) and `tokens(doc, start, stop)`. At most `open_shards` shard maps stay
    open, the least recently read closed first."""

    def __init__(self, path: Path, open_shards: int = OPEN_SHARDS):
        self.path = Path(path)
        self.meta, self.offsets = _check(self.path)
        self.fingerprint: str = self.meta["key"]
        self.n_documents: int = self.meta["documents"]
        self.n_tokens: int = self.meta["tokens"]
        self.block_documents: int = self.meta["block_documents"]
        self.block_offsets = np.load(self.path / "blocks.npy")
        self._shard_starts = np.concatenate([[0], np.cumsum(self.meta["shard_tokens"])])
        self._dtype = np.dtype(self.meta["dtype"]).newbyteorder("<")
        self._open_shards = open_shards
        self._shards: collections.OrderedDict[int, np.memmap] = collections.OrderedDict()

    def tokens(self, doc: int, start: int = 0, stop: int | None = None) -> np.ndarray:
        """An int64 copy of document `doc`'s tokens[start:stop]."""
        first, end = int(self.offsets[doc]), int(self.offsets[doc + 1])
        start, stop, _ = slice(start, stop).indices(end - first)
        shard = int(np.searchsorted(self._shard_starts, first, side="right")) - 1
        offset = first - int(self._shard_starts[shard])
        return self._shard(shard)[offset + start : offset + max(start, stop)].astype(np.int64)

    def _shard(self, shard: int) -> np.memmap:
        if shard in self._shards:
            self._shards.move_to_end(shard)
        else:
            self._shards[shard] = np.memmap(self.path / _shard_name(shard), dtype=self._dtype, mode="r")
            if len(self._shards) > self._open_shards:
                # Dropping the last reference unmaps it and closes its descriptor (reads copy, keeping no view).
                self._shards.popitem(last=False)
        return self._shards[shard]
