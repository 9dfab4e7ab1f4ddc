"""Tokenize documents, pack them into fixed-length sequences, and batch them for one data-parallel rank.

Document i of the stream belongs to data-parallel rank i % dp_size, so ranks never share a document.
The state is (epoch, index of the next document, tokens left over from packing): restoring it resumes at
exactly the next sequence. The state does not depend on `datasets`' own iterator state or shuffle buffer;
resuming re-reads the stream up to the saved document (a cost linear in the documents already seen).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator

import torch

from titan.config import ConfigError


class PackedLoader:
    def __init__(
        self,
        texts: Callable[[], Iterator[str]],  # a fresh pass over the documents, from the start
        encode: Callable[[str], list[int]],
        seq_len: int,
        batch_size: int,
        dp_rank: int = 0,
        dp_size: int = 1,
        source_name: str = "the dataset",
    ):
        self._texts, self._encode = texts, encode
        self.seq_len, self.batch_size = seq_len, batch_size
        self.dp_rank, self.dp_size = dp_rank, dp_size
        self._source_name = source_name
        self._epoch, self._next_doc, self._buffer = 0, 0, []
        self._stream: Iterator[tuple[int, str]] | None = None

    def state_dict(self) -> dict:
        return {"epoch": self._epoch, "next_doc": self._next_doc, "buffer": list(self._buffer), "dp_rank": self.dp_rank, "dp_size": self.dp_size}

    def load_state_dict(self, state: dict) -> None:
        self._epoch, self._next_doc, self._buffer = state["epoch"], state["next_doc"], list(state["buffer"])
        self._stream = None  # reopened lazily at the saved document

    def _open(self) -> Iterator[tuple[int, str]]:
        docs = enumerate(self._texts())
        return itertools.islice(docs, self._next_doc, None)

    def _next_document(self) -> list[int]:
        seen_any = False
        while True:
            if self._stream is None:
                self._stream = self._open()
            for index, text in self._stream:
                seen_any = True
                self._next_doc = index + 1
                if index % self.dp_size == self.dp_rank:
                    return self._encode(text)
            # End of an epoch: start over, unless the pass yielded nothing for this rank.
            if self._next_doc <= self.dp_rank:
                if self._next_doc == 0 and not seen_any:
                    raise ConfigError(f"data.source: {self._source_name} has no documents")
                raise ConfigError(
                    f"data.source: {self._source_name} has {self._next_doc} documents, fewer than the data-parallel size {self.dp_size}"
                )
            self._epoch, self._next_doc, self._stream, seen_any = self._epoch + 1, 0, None, False

    def next_sequence(self) -> torch.Tensor:
        """seq_len + 1 tokens: the inputs and, shifted by one, the labels."""
        while len(self._buffer) < self.seq_len + 1:
            self._buffer.extend(self._next_document())
        sequence, self._buffer = self._buffer[: self.seq_len + 1], self._buffer[self.seq_len + 1 :]
        return torch.tensor(sequence, dtype=torch.long)

    def __iter__(self):
        return self

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, labels), each (batch_size, seq_len)."""
        batch = torch.stack([self.next_sequence() for _ in range(self.batch_size)])
        return batch[:, :-1], batch[:, 1:]
