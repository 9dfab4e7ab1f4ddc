"""Writing prepared sources (`titan data prepare`): units tokenized into shards, resumably and in parts, then
merged into the source's folder."""

from __future__ import annotations

import collections
import dataclasses
import json
import logging
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from numpy.lib.format import open_memmap

from titan.config import DataSource
from titan.config import Tokenizer as TokenizerConfig
from titan.data.dataset import Documents, open_documents
from titan.data.hub_files import hub_listing
from titan.data.local_files import COMPRESSED
from titan.data.order import block_documents, block_offsets
from titan.data.prepared.cache import (
    _RERUN,
    FORMAT_VERSION,
    _folder,
    _identity,
    _is_complete,
    _key,
    _shard_name,
    _target,
    describe,
)
from titan.data.prepared.encode import TextLimit, _text_chunks, _Tokenizers
from titan.data.tokenizer import Tokenizer
from titan.errors import ConfigError
from titan.files import build_once, fsync, write_synced
from titan.progress import Progress

SHARD_TOKENS = 256 * 2**20  # at most ~512 MB of uint16 per shard file
UNIT_BYTES = 1 << 30  # text bytes per unit of preparation: what an interruption may cost again
DISK_MARGIN = 256 << 20  # free disk a preparation leaves, so that the machine it shares is not stopped by a full disk


@dataclass(frozen=True)
class Sizes:
    """Tokens per shard file, and bytes of text per unit of preparation."""

    shard_tokens: int = SHARD_TOKENS
    unit_bytes: int = UNIT_BYTES


_SMALL_SOURCE_BYTES = 8 * 2**20  # of text: prepared by this process alone unless told how many workers to use
_COPY_CHUNK = 1 << 24  # documents per pass when merging the units' lengths into offsets.npy
log = logging.getLogger("titan")


@dataclass(frozen=True)
class Unit:
    """Source files [first, stop) (of Documents.files; a hub dataset's one unit is (0, 0)), prepared together."""

    first: int
    stop: int

    @property
    def name(self) -> str:
        return f"unit-{self.first:06d}-{self.stop:06d}"


@dataclass(frozen=True)
class Encoding:
    """How a preparation tokenizes its units: the source's documents, the tokenizer and its JSON (which worker
    processes load), how many workers (0: by the source's size), whether to show progress, tokens per shard."""

    documents: Documents
    tokenizer: Tokenizer
    tokenizer_json: str
    workers: int
    progress: bool
    shard_tokens: int
    limit: TextLimit | None = None  # auto-prepare's bound on the text read


def units_of(documents: Documents, unit_bytes: int) -> list[Unit]:
    """The source's files in runs of at least `unit_bytes` of text (the last run may hold less), in order."""
    sizes = documents.text_bytes
    if not sizes:
        return [Unit(0, 0)]
    units, first, size = [], 0, 0
    for i, text_bytes in enumerate(sizes):
        size += text_bytes
        if size >= unit_bytes:
            units.append(Unit(first, i + 1))
            first, size = i + 1, 0
    if first < len(sizes):
        units.append(Unit(first, len(sizes)))
    return units


def prepare(
    src: DataSource,
    tokenizer_cfg: TokenizerConfig,
    cache_root: Path,
    workers: int = 0,
    progress: bool = True,
    *,
    part: tuple[int, int] = (0, 1),
    sizes: Sizes = Sizes(),
    limit: TextLimit | None = None,
) -> Path | None:
    """Tokenize `src` into <cache_root>/<slug>-<key>/ and return that folder; if a complete one exists, return it
    at once. `part` (i, N): prepare only the i-th of N runs of units, and return None if units of other parts
    are still missing. `workers` tokenizer processes (0: one per CPU, at most 8, or this process alone for a
    local source under 8 MB; 1: this process). limit: the most text it reads, refused in one line past it."""
    documents = open_documents(src)
    tokenizer = Tokenizer(tokenizer_cfg)  # checks the file and the BOS/EOS tokens
    tokenizer_json = tokenizer.path.read_bytes()
    identity = _identity(documents, tokenizer_cfg, tokenizer_json, Path(cache_root))
    folder = _folder(Path(cache_root), documents, identity)
    if _is_complete(folder):
        return folder
    index, parts = part
    work = folder.with_name(f".{folder.name}.parts")
    if documents.fmt == "hub" and (listing := hub_listing(src, documents.path, work)):
        documents = dataclasses.replace(documents, fmt=listing.fmt, hub_files=listing.files)
    if parts > 1 and not documents.files_to_read:
        raise ConfigError(
            f"--part {index}/{parts}: {src.source} is a hub dataset whose files titan does not read one by one "
            "(not json or parquet), which one process prepares; leave --part out"
        )
    units = units_of(documents, sizes.unit_bytes)
    mine = units[len(units) * index // parts : len(units) * (index + 1) // parts]
    encoding = Encoding(documents, tokenizer, tokenizer_json.decode(), workers, progress, sizes.shard_tokens, limit)
    try:
        _prepare_units(folder, work, mine, encoding)
        if not all(_unit_complete(work / unit.name) for unit in units):
            return folder if _is_complete(folder) else None  # another part's units are missing, or it merged
        merge = lambda tmp: _merge(tmp, work, units, documents, identity, tokenizer_cfg, tokenizer)
        path = build_once(folder, _is_complete, merge, "merging")
    except ConfigError:  # the source must change before it can be prepared, and its key with it
        shutil.rmtree(work, ignore_errors=True)
        raise
    shutil.rmtree(work, ignore_errors=True)
    return path


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
    megabytes = sum(documents.text_bytes) / 2**20
    packed = sum(f.stat().st_size for f in documents.files if f.suffix in COMPRESSED) / 2**20
    # A compressed file's size says little of its text (a 37 KB .bz2 can hold 200 MB): its text is what counts.
    size = f"about {megabytes:,.1f} MB of text, {packed:,.1f} MB compressed" if packed else f"{megabytes:,.1f} MB"
    if megabytes > auto_max_mb:
        raise ConfigError(
            f"data source {src.source} ({size}) is not prepared with this tokenizer and is larger than "
            f"data.auto_prepare_max_mb = {auto_max_mb:g}; {_RERUN} first"
        )
    log.info("preparing data source %s (%s) into %s", src.source, size, folder)
    # The text is counted as it is read, too: a compressed file's start may not say how far it inflates.
    refusal = (f"data source {src.source} inflates past data.auto_prepare_max_mb = {auto_max_mb:g} MB of text; "
               f"{_RERUN} first")  # fmt: skip
    limit = TextLimit(int(min(auto_max_mb * 2**20, 2**62)), refusal) if packed else None
    start = time.perf_counter()
    path = prepare(src, tokenizer_cfg, cache_root, workers, progress=False, limit=limit)
    meta = json.loads((path / "meta.json").read_text())
    log.info("prepared %s: %s in %.1f s", src.source, describe(meta), time.perf_counter() - start)
    return path


def _hub_commit(documents: Documents) -> dict:
    """The commit a hub dataset's files were read at, for the record (its key holds the revision asked for)."""
    return {"commit": documents.hub_files[0].commit} if documents.hub_files else {}


def _unit_complete(path: Path) -> bool:
    return (path / "COMPLETE").is_file()


def _prepare_units(folder: Path, work: Path, units: list[Unit], encoding: Encoding) -> None:
    """Tokenize each of these units not complete yet into work/<unit>, unless the source's folder is complete."""
    todo = [u for u in units if not _unit_complete(work / u.name)]
    if not todo or _is_complete(folder):
        return
    documents, tokenizer, workers = encoding.documents, encoding.tokenizer, encoding.workers
    dtype = "<u2" if tokenizer.vocab_size <= 2**16 else "<u4"
    todo_bytes = sum(sum(documents.file_bytes[u.first : u.stop]) for u in todo)  # what the bar counts
    by_file = bool(documents.files_to_read)
    if not workers:  # starting tokenizer processes takes seconds: more than a small source takes in this one
        text_bytes = sum(sum(documents.text_bytes[u.first : u.stop]) for u in todo)
        workers = 1 if by_file and text_bytes < _SMALL_SOURCE_BYTES else min(8, os.cpu_count() or 1)
    # A streamed hub dataset counts its records itself (titan.data.dataset), having no bytes to count.
    bar = Progress(folder.name.rsplit("-", 1)[0], todo_bytes, "B", enabled=encoding.progress and by_file)
    encoder = (encoding.tokenizer_json, tokenizer.bos_id, tokenizer.eos_id, dtype)
    with bar, _Tokenizers(encoder, workers) as tokenizers:
        for unit in todo:
            build_once(
                work / unit.name,
                lambda path: _unit_complete(path) or _is_complete(folder),
                lambda tmp, unit=unit: _write(tmp, encoding, unit, tokenizers, dtype, bar),
                "preparing",
            )


def _write(folder: Path, encoding: Encoding, unit: Unit, tokenizers: _Tokenizers, dtype: str, bar) -> None:
    """Tokenize one unit's files into `folder`: its shards, lengths.bin (int64 per document) and meta.json."""
    counts = collections.Counter()
    documents = encoding.documents
    files = documents.files_to_read[unit.first : unit.stop] or [None]
    start = time.perf_counter()
    with _ShardWriter(folder, dtype, encoding.shard_tokens) as writer:
        for tokens, lengths, read in tokenizers.map(_text_chunks(documents, files, counts, encoding.limit)):
            writer.add(tokens, lengths)
            bar.update(read)
            tokens_per_s = writer.tokens / max(time.perf_counter() - start, 1e-9)
            bar.detail(f"{writer.documents:,} documents, {tokens_per_s:,.0f} tokens/s")
    meta = {"records": counts["records"], "empty": counts["empty"], "documents": writer.documents,
            "tokens": writer.tokens, "shard_tokens": writer.sizes}  # fmt: skip
    write_synced(folder / "meta.json", json.dumps(meta).encode())
    write_synced(folder / "COMPLETE", b"")


def _merge(
    folder: Path,
    work: Path,
    units: list[Unit],
    documents: Documents,
    identity: dict,
    tokenizer_cfg: TokenizerConfig,
    tokenizer: Tokenizer,
) -> None:
    """The source's folder from its complete units: their shards linked under the source's numbering, their
    lengths running into offsets.npy, then blocks.npy, meta.json and COMPLETE."""
    cfg = documents.cfg
    metas = [json.loads((work / u.name / "meta.json").read_text()) for u in units]
    records, empty = sum(m["records"] for m in metas), sum(m["empty"] for m in metas)
    n_documents, n_tokens = sum(m["documents"] for m in metas), sum(m["tokens"] for m in metas)
    if not records:
        raise ConfigError(f"data.source: {cfg.source} has no documents")
    if not n_documents:
        raise ConfigError(
            f"data.source: all {records:,} documents of {cfg.source} are empty or whitespace; "
            f"check data.text_field ({cfg.text_field!r})"
        )
    if empty:
        log.info("data source %s: skipped %d empty documents", cfg.source, empty)
    shard_tokens = []
    offsets = open_memmap(folder / "offsets.npy", mode="w+", dtype="<i8", shape=(n_documents + 1,))
    offsets[0] = 0
    at = 0
    for unit, meta in zip(units, metas):
        for shard in range(len(meta["shard_tokens"])):
            _link(work / unit.name / _shard_name(shard), folder / _shard_name(len(shard_tokens)))
            shard_tokens.append(meta["shard_tokens"][shard])
        lengths = np.memmap(work / unit.name / "lengths.bin", dtype="<i8", mode="r")
        for begin in range(0, len(lengths), _COPY_CHUNK):
            chunk = lengths[begin : begin + _COPY_CHUNK]
            offsets[at + 1 : at + 1 + len(chunk)] = offsets[at] + np.cumsum(chunk)
            at += len(chunk)
        del lengths
    offsets.flush()
    per_block = block_documents(n_documents)
    np.save(folder / "blocks.npy", block_offsets(offsets, per_block))
    del offsets
    for name in ("offsets.npy", "blocks.npy"):
        fsync(folder / name)
    meta = {
        "format_version": FORMAT_VERSION,
        "key": _key(identity),
        "source": {"source": cfg.source, "path": documents.path, **identity["source"], **_hub_commit(documents)},
        "tokenizer": {
            "path": tokenizer_cfg.path,
            **identity["tokenizer"],
            "vocab_size": tokenizer.vocab_size,
            "bos_id": tokenizer.bos_id,
            "eos_id": tokenizer.eos_id,
        },
        "dtype": np.dtype("<u2" if tokenizer.vocab_size <= 2**16 else "<u4").name,
        "documents": n_documents,
        "tokens": n_tokens,
        "empty_documents_skipped": empty,
        "shard_tokens": shard_tokens,
        "block_documents": per_block,
    }
    write_synced(folder / "meta.json", json.dumps(meta, indent=1).encode())
    write_synced(folder / "COMPLETE", meta["key"].encode())
    fsync(folder)


def _link(source: Path, target: Path) -> None:
    """A hard link: no byte copied, and the unit stays whole until the source's folder is in place."""
    try:
        os.link(source, target)
    except OSError:  # a file system without hard links
        shutil.copyfile(source, target)
        fsync(target)


class _ShardWriter:
    """Appends documents to token shards of at most `shard_tokens` tokens (a longer document gets a shard of its
    own), and their lengths to lengths.bin (raw int64)."""

    def __init__(self, folder: Path, dtype: str, shard_tokens: int):
        self.folder, self.dtype, self.shard_tokens = folder, dtype, shard_tokens
        self.sizes: list[int] = []  # tokens in each shard
        self.documents = self.tokens = 0
        self.shard = None
        self.lengths = open(folder / "lengths.bin", "wb")

    def add(self, tokens: np.ndarray, lengths: np.ndarray) -> None:
        free = shutil.disk_usage(self.folder).free
        if free < tokens.nbytes + 8 * len(lengths) + DISK_MARGIN:  # said before the disk is full, not after
            raise ConfigError(
                f"preparing data: the disk of {self.folder.parent} has {free / 2**20:,.0f} MB free, too little for "
                f"the next shard's tokens and {DISK_MARGIN >> 20} MB to spare; free space or set data.cache_dir "
                "elsewhere (what this preparation wrote is removed)"
            )
        ends = np.cumsum(lengths)
        first = 0
        while first < len(lengths):
            start = int(ends[first - 1]) if first else 0
            fill = self.sizes[-1] if self.sizes else self.shard_tokens  # no shard yet: as good as a full one
            last = int(np.searchsorted(ends, start + self.shard_tokens - fill, side="right"))
            if last == first:  # the next document does not fit: a new shard takes at least that one
                if fill:
                    self._new_shard()
                last = max(first + 1, int(np.searchsorted(ends, start + self.shard_tokens, side="right")))
            stop = int(ends[last - 1])
            self.shard.write(tokens[start:stop])
            self.sizes[-1] += stop - start
            self.documents, self.tokens, first = self.documents + last - first, self.tokens + stop - start, last
        self.lengths.write(np.asarray(lengths, dtype="<i8").tobytes())

    def _new_shard(self) -> None:
        self._close(self.shard)
        self.shard = open(self.folder / _shard_name(len(self.sizes)), "wb")
        self.sizes.append(0)

    def __enter__(self) -> _ShardWriter:
        return self

    def __exit__(self, *exc) -> None:
        self._close(self.shard)
        self._close(self.lengths)

    @staticmethod
    def _close(file) -> None:
        if file is not None:
            file.flush()
            os.fsync(file.fileno())
            file.close()
