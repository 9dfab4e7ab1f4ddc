"""Sources tokenized once into memory-mapped token shards plus a document index (`titan data prepare`).

In the spirit of Megatron's indexed datasets and nanoGPT's .bin files. A prepared source is a folder
<cache_root>/<slug>-<key>/ holding:

    tokens-00000.bin, ...  every document's tokens (BOS + text + EOS, as Tokenizer.encode gives them), concatenated
                           in the source's order as raw little-endian uint16 (uint32 when the vocabulary needs it);
                           a shard holds at most SHARD_TOKENS tokens, unless one document is longer, and ends at a
                           document boundary
    documents.npy          int64 rows (shard, offset in the shard, length), one per document
    meta.json              format version, key, source, tokenizer, dtype, counts, empty documents skipped
    COMPLETE               the key, written last

The key hashes everything the tokens depend on: the format version, the source's identity (local files: paths,
sizes and mtimes; hub datasets: name, subset and split), the text field, the tokenizer file's contents and the
BOS/EOS tokens; so a changed file or tokenizer never reuses stale tokens. A folder is written under a temporary
name and renamed once complete, under an flock on <folder>.lock: of several processes preparing one source (the
ranks of a job), the first prepares and the others wait for it and reuse its folder.
"""

from __future__ import annotations

import collections
import hashlib
import itertools
import json
import logging
import multiprocessing
import multiprocessing.forkserver
import os
import re
import struct
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import NoReturn

import numpy as np
from tokenizers import Tokenizer as HFTokenizer

from titan.config import Data, DataSource
from titan.config import Tokenizer as TokenizerConfig
from titan.data.dataset import Documents, iter_texts, open_documents
from titan.data.tokenizer import Tokenizer
from titan.errors import ConfigError
from titan.files import build_once, cache_root, fsync, write_synced

FORMAT_VERSION = 1
SHARD_TOKENS = 256 * 2**20  # at most ~512 MB of uint16 per shard file
_CHUNK_CHARS = 1 << 18  # text per tokenizer task: enough to amortise the inter-process transfer, little to hold
_SMALL_SOURCE_BYTES = 8 * 2**20  # prepared by this process alone unless told how many workers to use
_HEADER_BYTES = 128  # reserved at the start of documents.npy, whose row count is known only at the end
_RERUN = "run `titan data prepare --config <recipe>`"
log = logging.getLogger("titan")


def cache_root_for(data_cfg: Data) -> Path:
    """Where prepared sources live: data.cache_dir, else <titan cache>/prepared."""
    if data_cfg.cache_dir:
        return Path(data_cfg.cache_dir).expanduser()
    return cache_root() / "prepared"


def prepare(
    src: DataSource,
    tokenizer_cfg: TokenizerConfig,
    cache_root: Path,
    workers: int = 0,
    progress: bool = True,
    *,
    shard_tokens: int = SHARD_TOKENS,
) -> Path:
    """Tokenize `src` into <cache_root>/<slug>-<key>/ and return that folder; if a complete one exists, return it
    at once. `workers` tokenizer processes (0: one per CPU, at most 8, or this process alone for a local source
    under 8 MB; 1: this process)."""
    documents = open_documents(src)
    tokenizer = Tokenizer(tokenizer_cfg)  # checks the file and the BOS/EOS tokens
    tokenizer_json = tokenizer.path.read_bytes()
    identity = _identity(documents, tokenizer_cfg, tokenizer_json)
    folder = Path(cache_root) / _folder_name(documents, identity)

    def build(tmp: Path) -> None:
        args = (tokenizer_cfg, tokenizer, tokenizer_json.decode(), workers, progress, shard_tokens)
        _write(tmp, documents, identity, *args)

    return build_once(folder, _is_complete, build, "preparing")


def ensure_prepared(
    src: DataSource, tokenizer_cfg: TokenizerConfig, cache_root: Path, workers: int, auto_max_mb: float
) -> Path:
    """For `titan train`: the source's complete prepared folder. A missing local source of at most `auto_max_mb`
    is prepared here; anything else must be prepared beforehand with `titan data prepare`."""
    documents, folder = _target(src, tokenizer_cfg, cache_root)
    if _is_complete(folder):
        return folder
    if not documents.files:
        raise ConfigError(
            f"data source {src.source!r} (a hub dataset) is not prepared with this tokenizer; {_RERUN} first"
        )
    megabytes = documents.total_bytes / 2**20
    if megabytes > auto_max_mb:
        raise ConfigError(
            f"data source {src.source} ({megabytes:,.0f} MB) is not prepared with this tokenizer and is "
            f"larger than data.auto_prepare_max_mb = {auto_max_mb:g}; {_RERUN} first"
        )
    log.info("preparing data source %s (%.1f MB) into %s", src.source, megabytes, folder)
    start = time.perf_counter()
    path = prepare(src, tokenizer_cfg, cache_root, workers, progress=False)
    meta = json.loads((path / "meta.json").read_text())
    log.info("prepared %s: %s in %.1f s", src.source, describe(meta), time.perf_counter() - start)
    return path


def find_prepared(src: DataSource, tokenizer_cfg: TokenizerConfig, cache_root: Path) -> Path | None:
    """The complete prepared folder of `src` with this tokenizer, if there is one."""
    folder = _target(src, tokenizer_cfg, cache_root)[1]
    return folder if _is_complete(folder) else None


def describe(meta: dict) -> str:
    """'2,600 documents, 612,345 tokens' (plus the empty documents skipped, if any) from a meta.json."""
    empty = meta["empty_documents_skipped"]
    return f"{meta['documents']:,} documents, {meta['tokens']:,} tokens" + (
        f" ({empty:,} empty documents skipped)" if empty else ""
    )


class PreparedDocuments:
    """A prepared source, read through memory maps: `lengths` and `tokens(doc, start, stop)`."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self.meta, self._index = _check(self.path)
        self.fingerprint: str = self.meta["key"]
        self.n_documents: int = self.meta["documents"]
        self.n_tokens: int = self.meta["tokens"]
        self.lengths: np.ndarray = self._index[:, 2]
        self._dtype = np.dtype(self.meta["dtype"]).newbyteorder("<")
        self._shards: dict[int, np.memmap] = {}  # opened on first use: each map holds a file descriptor

    def tokens(self, doc: int, start: int = 0, stop: int | None = None) -> np.ndarray:
        """An int64 copy of document `doc`'s tokens[start:stop]."""
        shard, offset, length = (int(v) for v in self._index[doc])
        start, stop, _ = slice(start, stop).indices(length)
        if shard not in self._shards:
            self._shards[shard] = np.memmap(self.path / _shard_name(shard), dtype=self._dtype, mode="r")
        return self._shards[shard][offset + start : offset + max(start, stop)].astype(np.int64)


# ---------------------------------------------------------------------------------------------
# Identity and completeness


def _target(src: DataSource, tokenizer_cfg: TokenizerConfig, cache_root: Path) -> tuple[Documents, Path]:
    documents = open_documents(src)
    tokenizer = Tokenizer(tokenizer_cfg)  # a missing file or unknown BOS/EOS token: the tokenizer's own one-line error
    identity = _identity(documents, tokenizer_cfg, tokenizer.path.read_bytes())
    return documents, Path(cache_root) / _folder_name(documents, identity)


def _identity(documents: Documents, tokenizer_cfg: TokenizerConfig, tokenizer_json: bytes) -> dict:
    """Everything the tokens depend on; its hash names the folder."""
    cfg = documents.cfg
    if documents.files:
        root = Path(documents.path)
        # Local data files are all read into the one split, whatever its name: split and subset change nothing.
        source = {
            "files": [
                [f.relative_to(root).as_posix() if root.is_dir() else f.name, s.st_size, s.st_mtime_ns]
                for f in documents.files
                for s in [f.stat()]
            ],
            "format": documents.fmt,
            "text_field": cfg.text_field,
        }
    else:
        source = {"hub": documents.path, "subset": cfg.subset, "split": cfg.split, "text_field": cfg.text_field}
    tokenizer = {
        "sha256": hashlib.sha256(tokenizer_json).hexdigest(),
        "bos_token": tokenizer_cfg.bos_token,
        "eos_token": tokenizer_cfg.eos_token,
    }
    return {"format_version": FORMAT_VERSION, "source": source, "tokenizer": tokenizer}


def _folder_name(documents: Documents, identity: dict) -> str:
    if documents.files:
        path = Path(documents.path).resolve()
        name = path.stem if path.is_file() else path.name
    else:
        name = "-".join(part for part in (documents.path, documents.cfg.subset, documents.cfg.split) if part)
    slug = re.sub(r"[^A-Za-z0-9._-]+", "-", name).strip(".-")[:48] or "source"
    return f"{slug}-{_key(identity)}"


def _key(identity: dict) -> str:
    return hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:16]


def _shard_name(shard: int) -> str:
    return f"tokens-{shard:05d}.bin"


def _check(path: Path) -> tuple[dict, np.ndarray]:
    """(meta, document index) of a complete prepared folder; ConfigError saying what is wrong otherwise."""

    def fail(problem: str) -> NoReturn:
        raise ConfigError(f"{path} is not a complete prepared source ({problem}); {_RERUN} to prepare it again")

    if not (path / "COMPLETE").is_file():
        fail("no COMPLETE marker: its preparation never finished" if path.is_dir() else "no such folder")
    try:
        meta = json.loads((path / "meta.json").read_text())
        index = np.load(path / "documents.npy", mmap_mode="r")
    except (OSError, ValueError) as e:
        fail(f"unreadable meta.json or documents.npy: {e}")
    if meta.get("format_version") != FORMAT_VERSION:
        fail(f"format version {meta.get('format_version')}; this titan reads version {FORMAT_VERSION}")
    if (path / "COMPLETE").read_text() != meta["key"]:
        fail("its COMPLETE marker belongs to another preparation")
    if index.shape != (meta["documents"], 3) or index.dtype != np.int64:
        fail(f"documents.npy holds {index.shape} {index.dtype}, not ({meta['documents']}, 3) int64")
    itemsize = np.dtype(meta["dtype"]).itemsize
    for shard, tokens in enumerate(meta["shard_tokens"]):
        file = path / _shard_name(shard)
        if not file.is_file() or file.stat().st_size != tokens * itemsize:
            fail(f"{file.name} should hold {tokens * itemsize} bytes")
    return meta, index


def _is_complete(path: Path) -> bool:
    try:
        _check(path)
    except ConfigError:
        return False
    return True


# ---------------------------------------------------------------------------------------------
# Writing


def _write(
    folder: Path,
    documents: Documents,
    identity: dict,
    tokenizer_cfg: TokenizerConfig,
    tokenizer: Tokenizer,
    tokenizer_json: str,
    workers: int,
    progress: bool,
    shard_tokens: int,
) -> None:
    from tqdm import tqdm

    cfg = documents.cfg
    dtype = "<u2" if tokenizer.vocab_size <= 2**16 else "<u4"
    if not workers:  # starting tokenizer processes takes seconds: more than a small source takes in this one
        small = documents.files and documents.total_bytes < _SMALL_SOURCE_BYTES
        workers = 1 if small else min(8, os.cpu_count() or 1)
    counts = collections.Counter()
    chunks = _text_chunks(documents, counts)
    bar = tqdm(
        total=documents.total_bytes or None,
        unit="B",
        unit_scale=True,
        unit_divisor=1024,
        file=sys.stderr,
        disable=not progress,
        desc=_folder_name(documents, identity).rsplit("-", 1)[0],
        mininterval=0.5,
        delay=1,
    )  # not for a source done (or failing) within a second
    start = time.perf_counter()
    with bar, _ShardWriter(folder, dtype, shard_tokens) as writer:
        for tokens, lengths, read in _tokenized(
            chunks, (tokenizer_json, tokenizer.bos_id, tokenizer.eos_id, dtype), workers
        ):
            writer.add(tokens, lengths)
            bar.update(read)
            tokens_per_s = writer.tokens / max(time.perf_counter() - start, 1e-9)
            bar.set_postfix_str(f"{writer.documents:,} documents, {tokens_per_s:,.0f} tokens/s", refresh=False)
    if not counts["records"]:
        raise ConfigError(f"data.source: {cfg.source} has no documents")
    if not writer.documents:
        raise ConfigError(
            f"data.source: all {counts['records']:,} documents of {cfg.source} are empty or whitespace; "
            f"check data.text_field ({cfg.text_field!r})"
        )
    if counts["empty"]:
        log.info("data source %s: skipped %d empty documents", cfg.source, counts["empty"])
    meta = {
        "format_version": FORMAT_VERSION,
        "key": _key(identity),
        "source": {"source": cfg.source, "path": documents.path, **identity["source"]},
        "tokenizer": {
            "path": tokenizer_cfg.path,
            **identity["tokenizer"],
            "vocab_size": tokenizer.vocab_size,
            "bos_id": tokenizer.bos_id,
            "eos_id": tokenizer.eos_id,
        },
        "dtype": np.dtype(dtype).name,
        "documents": writer.documents,
        "tokens": writer.tokens,
        "empty_documents_skipped": counts["empty"],
        "shard_tokens": writer.sizes,
    }
    write_synced(folder / "meta.json", json.dumps(meta, indent=1).encode())
    write_synced(folder / "COMPLETE", meta["key"].encode())
    fsync(folder)


def _text_chunks(documents: Documents, counts: collections.Counter) -> Iterator[tuple[list[str], int]]:
    """The source's non-empty texts in chunks of about _CHUNK_CHARS characters, each with the progress it makes
    in bytes: the text read, as a stand-in for the file bytes it came from, settled at the end of each file."""
    chunk, chars, read = [], 0, 0
    for file in documents.files or [None]:
        file_bytes, file_read = (file.stat().st_size if file else None), 0
        for text in iter_texts(documents, file):
            counts["records"] += 1
            if not text or text.isspace():
                counts["empty"] += 1
                continue
            chunk.append(text)
            chars += len(text)
            step = len(text) if file_bytes is None else max(0, min(len(text), file_bytes - file_read))
            file_read, read = file_read + step, read + step
            if chars >= _CHUNK_CHARS:
                yield chunk, read
                chunk, chars, read = [], 0, 0
        if file_bytes is not None:
            read += file_bytes - file_read
    yield chunk, read  # the last chunk, even empty, settles the progress


class _Encoder:
    """Texts -> (their documents' tokens concatenated, each document's length), documents framed by BOS and EOS
    exactly as Tokenizer.encode frames them."""

    def __init__(self, tokenizer_json: str, bos_id: int, eos_id: int, dtype: str):
        self.tokenizer = HFTokenizer.from_str(tokenizer_json)
        self.bos_id, self.eos_id, self.dtype = bos_id, eos_id, dtype

    def __call__(self, texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
        ids, lengths = [], np.empty(len(texts), dtype=np.int64)
        for i, text in enumerate(texts):
            body = self.tokenizer.encode(text, add_special_tokens=False).ids
            ids.append(self.bos_id)
            ids.extend(body)
            ids.append(self.eos_id)
            lengths[i] = len(body) + 2
        return np.array(ids, dtype=self.dtype), lengths


_worker_encoder: _Encoder | None = None


def _init_worker(*args) -> None:
    global _worker_encoder
    _worker_encoder = _Encoder(*args)


def _encode_in_worker(texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
    return _worker_encoder(texts)


def _tokenized(
    chunks: Iterator[tuple[list[str], int]], encoder_args: tuple, workers: int
) -> Iterator[tuple[np.ndarray, np.ndarray, int]]:
    """(tokens, lengths, progress) of each chunk, in order, tokenized by `workers` processes (1: this one)."""
    if workers == 1:
        encode = _Encoder(*encoder_args)
        for texts, read in chunks:
            yield *encode(texts), read
        return
    # Not fork: torch (and CUDA) may live in this process. The fork server imports this module once, and every
    # worker forks from it instead of importing torch again through titan.data; it starts while the source opens.
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload([__name__])
    multiprocessing.forkserver.ensure_running()
    chunks = itertools.chain([next(chunks)], chunks)  # there is always one
    with context.Pool(workers, initializer=_init_worker, initargs=encoder_args) as pool:
        # apply_async over a bounded window rather than Pool.imap, whose feeder thread would read the whole
        # source ahead of the tokenizers into memory.
        pending = collections.deque()
        for texts, read in chunks:
            pending.append((pool.apply_async(_encode_in_worker, (texts,)), read))
            if len(pending) >= 2 * workers:
                result, done = pending.popleft()
                yield *result.get(), done
        while pending:
            result, done = pending.popleft()
            yield *result.get(), done


class _ShardWriter:
    """Appends documents to token shards of at most `shard_tokens` tokens (a longer document gets a shard of its
    own), and their (shard, offset, length) rows to documents.npy."""

    def __init__(self, folder: Path, dtype: str, shard_tokens: int):
        self.folder, self.dtype, self.shard_tokens = folder, dtype, shard_tokens
        self.sizes: list[int] = []  # tokens in each shard
        self.documents = self.tokens = 0
        self.shard = None
        self.index = open(folder / "documents.npy", "wb")
        self.index.write(bytes(_HEADER_BYTES))

    def add(self, tokens: np.ndarray, lengths: np.ndarray) -> None:
        ends = np.cumsum(lengths)
        first = 0
        while first < len(lengths):
            start = int(ends[first - 1]) if first else 0
            fill = self.sizes[-1] if self.sizes else self.shard_tokens  # no shard yet: as good as a full one
            last = int(np.searchsorted(ends, start + self.shard_tokens - fill, side="right"))
            if last == first:  # the next document does not fit: a new shard takes at least that one
                if fill:
                    self._new_shard()
                    fill = 0
                last = max(first + 1, int(np.searchsorted(ends, start + self.shard_tokens, side="right")))
            stop = int(ends[last - 1])
            rows = np.empty((last - first, 3), dtype=np.int64)
            rows[:, 0] = len(self.sizes) - 1
            rows[:, 1] = fill + ends[first:last] - lengths[first:last] - start
            rows[:, 2] = lengths[first:last]
            self.shard.write(tokens[start:stop])
            self.index.write(rows)
            self.sizes[-1] += stop - start
            self.documents, self.tokens, first = self.documents + last - first, self.tokens + stop - start, last

    def _new_shard(self) -> None:
        self._close(self.shard)
        self.shard = open(self.folder / _shard_name(len(self.sizes)), "wb")
        self.sizes.append(0)

    def __enter__(self) -> _ShardWriter:
        return self

    def __exit__(self, *exc) -> None:
        self._close(self.shard)
        # The .npy header, now that the row count is known, space-padded to the size reserved for it.
        header = f"{{'descr': '<i8', 'fortran_order': False, 'shape': ({self.documents}, 3), }}"
        self.index.seek(0)
        self.index.write(
            b"\x93NUMPY\x01\x00"
            + struct.pack("<H", _HEADER_BYTES - 10)
            + header.encode().ljust(_HEADER_BYTES - 11)
            + b"\n"
        )
        self._close(self.index)

    @staticmethod
    def _close(file) -> None:
        if file is not None:
            file.flush()
            os.fsync(file.fileno())
            file.close()
