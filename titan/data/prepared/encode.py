"""A source's texts to tokens: read in chunks, encoded by tokenizer processes that every unit of a preparation
shares."""

from __future__ import annotations

import collections
import itertools
import multiprocessing
import multiprocessing.forkserver
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer as HFTokenizer

from titan.data.dataset import Documents, read_texts
from titan.data.hub_files import HubFile
from titan.errors import ConfigError

_CHUNK_CHARS = 1 << 18  # text per tokenizer task: enough to amortise the inter-process transfer, little to hold


def _text_chunks(
    documents: Documents,
    files: list[Path | HubFile | None],
    counts: collections.Counter,
    limit: TextLimit | None = None,
) -> Iterator[tuple[list[str], int]]:
    """The non-empty texts of these files (None: the hub dataset) in chunks of about _CHUNK_CHARS characters,
    each with the progress it makes in bytes of the files read (of text, for the hub dataset). `limit`: the text
    the whole preparation may read, refused in one line past it."""
    chunk, chars, read = [], 0, 0
    for file in files:
        file_at = 0
        for text, at in read_texts(documents, file):
            if limit is not None:
                limit.read += len(text)
                if limit.read > limit.characters:
                    raise ConfigError(limit.refusal)
            read += len(text) if at is None else at - file_at
            file_at = file_at if at is None else at
            counts["records"] += 1
            if not text or text.isspace():
                counts["empty"] += 1
                continue
            chunk.append(text)
            chars += len(text)
            if chars >= _CHUNK_CHARS:
                yield chunk, read
                chunk, chars, read = [], 0, 0
        if file is not None:  # a reader's position may stop short of the file's end
            read += (file.size if isinstance(file, HubFile) else file.stat().st_size) - file_at
    yield chunk, read  # the last chunk, even empty, settles the progress


@dataclass
class TextLimit:
    """The most text a preparation reads (`characters`, of every unit together), and the one line that refuses it
    once `read` passes that: a compressed source can inflate far past what its file sizes say."""

    characters: int
    refusal: str
    read: int = 0


class _Encoder:
    """Texts -> (their documents' tokens concatenated, each document's length), documents framed by BOS (if the
    tokenizer has one: bos_id None otherwise) and EOS exactly as Tokenizer.encode frames them."""

    def __init__(self, tokenizer_json: str, bos_id: int | None, eos_id: int, dtype: str):
        self.tokenizer = HFTokenizer.from_str(tokenizer_json)
        self.bos_id, self.eos_id, self.dtype = bos_id, eos_id, dtype

    def __call__(self, texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
        # One call for the chunk: the tokenizer's own batch API, off the GIL (and on its threads where allowed).
        bodies = [e.ids for e in self.tokenizer.encode_batch(texts, add_special_tokens=False)]
        framing = 1 if self.bos_id is None else 2
        lengths = np.fromiter((len(body) + framing for body in bodies), dtype=np.int64, count=len(bodies))
        ends = np.cumsum(lengths)
        ids = np.empty(int(ends[-1]) if len(ends) else 0, dtype=self.dtype)
        inside = np.ones(len(ids), dtype=bool)
        inside[ends - 1] = False
        ids[ends - 1] = self.eos_id
        if self.bos_id is not None:
            inside[ends - lengths] = False
            ids[ends - lengths] = self.bos_id
        ids[inside] = np.fromiter(
            itertools.chain.from_iterable(bodies), dtype=self.dtype, count=len(ids) - framing * len(bodies)
        )
        return ids, lengths


_worker_encoder: _Encoder | None = None


def _init_worker(*args) -> None:
    global _worker_encoder
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one process per core already: no threads on top
    _worker_encoder = _Encoder(*args)


def _encode_in_worker(texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
    return _worker_encoder(texts)


class _Tokenizers:
    """`workers` tokenizer processes (1: this one) that every unit of a preparation shares."""

    def __init__(self, encoder_args: tuple, workers: int):
        self.encoder_args, self.workers = encoder_args, workers
        self.pool = None

    def __enter__(self) -> _Tokenizers:
        if self.workers > 1:
            # Not fork: torch (and CUDA) may live in this process. The fork server imports this module once, and
            # every worker forks from it instead of importing torch again through titan.data.
            context = multiprocessing.get_context("forkserver")
            context.set_forkserver_preload([__name__])
            multiprocessing.forkserver.ensure_running()
            self.pool = context.Pool(self.workers, initializer=_init_worker, initargs=self.encoder_args)
        return self

    def __exit__(self, *exc) -> None:
        if self.pool is not None:
            self.pool.terminate()
            self.pool.join()

    def map(self, chunks: Iterator[tuple[list[str], int]]) -> Iterator[tuple[np.ndarray, np.ndarray, int]]:
        """(tokens, lengths, progress) of each chunk, in order."""
        if self.pool is None:
            encode = _Encoder(*self.encoder_args)
            for texts, read in chunks:
                yield *encode(texts), read
            return
        # apply_async over a bounded window rather than Pool.imap, whose feeder thread would read the whole
        # source ahead of the tokenizers into memory.
        pending = collections.deque()
        for texts, read in chunks:
            pending.append((self.pool.apply_async(_encode_in_worker, (texts,)), read))
            if len(pending) >= 2 * self.workers:
                result, done = pending.popleft()
                yield *result.get(), done
        while pending:
            result, done = pending.popleft()
            yield *result.get(), done
