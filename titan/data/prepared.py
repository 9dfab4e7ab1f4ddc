"""Sources tokenized once into memory-mapped token shards plus a document index (`titan data prepare`).

In the spirit of Megatron's indexed datasets and nanoGPT's .bin files. A prepared source is a folder
<cache_root>/<slug>-<key>/ holding:

    tokens-00000.bin, ...  every document's tokens (BOS + text + EOS, as Tokenizer.encode gives them), concatenated
                           in the source's order as raw little-endian uint16 (uint32 when the vocabulary needs it);
                           a shard holds at most SHARD_TOKENS tokens, unless one document is longer, ends at a
                           document boundary and holds the documents of one unit (below)
    offsets.npy            int64, one per document and one more: where each document starts in the source's tokens
                           (the shards one after another), then their count: 8 bytes per document, memory-mapped
    blocks.npy             int64: offsets.npy at every block's first document (titan.data.order), then the count
    meta.json              format version, key, source, tokenizer, dtype, counts, shards, documents per block
    COMPLETE               the key, written last

The key hashes everything the tokens depend on: the format version, the source's identity (local files: paths
and contents, whose digests <cache_root>/.digests/ remembers; hub datasets: name, subset, split and revision), the
text field, the tokenizer file's contents and the BOS/EOS tokens; so a changed file or tokenizer never reuses
stale tokens, and a copied or touched source reuses its own.

Preparation goes by units: runs of consecutive source files of at least UNIT_BYTES (a hub dataset is one unit),
each tokenized into <cache_root>/.<slug>-<key>.parts/unit-<first>-<stop>/ and kept once complete. A prepare that
is interrupted resumes at the first unit it had not completed; `--part i/N` prepares the i-th of N contiguous
runs of units, so machines sharing the cache split a source; whoever completes the last unit merges the units
into the folder (the shards are hard-linked, offsets.npy is written once) and removes the parts. Every folder
is written under a temporary name and renamed once complete, under a lock on <folder>.lock (titan.files): of
several processes preparing one source (the ranks of a job), the first prepares and the others wait and reuse.
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
import shutil
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import NoReturn

import numpy as np
from filelock import FileLock, Timeout
from numpy.lib.format import open_memmap
from tokenizers import Tokenizer as HFTokenizer

from titan.config import Data, DataSource
from titan.config import Tokenizer as TokenizerConfig
from titan.data.dataset import Documents, iter_texts, open_documents
from titan.data.order import block_documents, block_offsets
from titan.data.tokenizer import Tokenizer
from titan.errors import ConfigError
from titan.files import build_once, cache_root, fsync, write_synced
from titan.progress import Progress

FORMAT_VERSION = 2  # 1: documents.npy held (shard, offset, length) per document, 24 bytes
SHARD_TOKENS = 256 * 2**20  # at most ~512 MB of uint16 per shard file
UNIT_BYTES = 1 << 30  # source bytes per unit of preparation: what an interruption may cost again
OPEN_SHARDS = 64  # shard maps a reader keeps open (each holds a file descriptor), the least recently read closed
_CHUNK_CHARS = 1 << 18  # text per tokenizer task: enough to amortise the inter-process transfer, little to hold
_SMALL_SOURCE_BYTES = 8 * 2**20  # prepared by this process alone unless told how many workers to use
_COPY_CHUNK = 1 << 24  # documents per pass when merging the units' lengths into offsets.npy
_RERUN = "run `titan data prepare --config <recipe>`"
log = logging.getLogger("titan")


def cache_root_for(data_cfg: Data) -> Path:
    """Where prepared sources live: data.cache_dir, else <titan cache>/prepared."""
    if data_cfg.cache_dir:
        return Path(data_cfg.cache_dir).expanduser()
    return cache_root() / "prepared"


@dataclass(frozen=True)
class Unit:
    """Source files [first, stop) (of Documents.files; a hub dataset's one unit is (0, 0)), prepared together."""

    first: int
    stop: int

    @property
    def name(self) -> str:
        return f"unit-{self.first:06d}-{self.stop:06d}"


def units_of(documents: Documents, unit_bytes: int) -> list[Unit]:
    """The source's files in runs of at least `unit_bytes` (the last run may hold less), in order."""
    if not documents.files:
        return [Unit(0, 0)]
    units, first, size = [], 0, 0
    for i, file in enumerate(documents.files):
        size += file.stat().st_size
        if size >= unit_bytes:
            units.append(Unit(first, i + 1))
            first, size = i + 1, 0
    if first < len(documents.files):
        units.append(Unit(first, len(documents.files)))
    return units


def prepare(
    src: DataSource,
    tokenizer_cfg: TokenizerConfig,
    cache_root: Path,
    workers: int = 0,
    progress: bool = True,
    *,
    part: tuple[int, int] = (0, 1),
    shard_tokens: int = SHARD_TOKENS,
    unit_bytes: int = UNIT_BYTES,
) -> Path | None:
    """Tokenize `src` into <cache_root>/<slug>-<key>/ and return that folder; if a complete one exists, return it
    at once. `part` (i, N): prepare only the i-th of N runs of units, and return None if units of other parts
    are still missing. `workers` tokenizer processes (0: one per CPU, at most 8, or this process alone for a
    local source under 8 MB; 1: this process)."""
    documents = open_documents(src)
    tokenizer = Tokenizer(tokenizer_cfg)  # checks the file and the BOS/EOS tokens
    tokenizer_json = tokenizer.path.read_bytes()
    identity = _identity(documents, tokenizer_cfg, tokenizer_json, Path(cache_root))
    folder = _folder(Path(cache_root), documents, identity)
    if _is_complete(folder):
        return folder
    index, parts = part
    if parts > 1 and not documents.files:
        raise ConfigError(
            f"--part {index}/{parts}: {src.source} is a hub dataset, which one process prepares; leave --part out"
        )
    units = units_of(documents, unit_bytes)
    work = folder.with_name(f".{folder.name}.parts")
    mine = units[len(units) * index // parts : len(units) * (index + 1) // parts]
    args = (documents, tokenizer, tokenizer_json.decode(), workers, progress, shard_tokens)
    try:
        _prepare_units(folder, work, mine, *args)
        if not all(_unit_complete(work / unit.name) for unit in units):
            return folder if _is_complete(folder) else None  # another part's units are missing, or it merged
        path = build_once(
            folder, _is_complete, lambda tmp: _merge(tmp, work, units, documents, identity, tokenizer_cfg, tokenizer),
            "merging",
        )  # fmt: skip
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


@dataclass(frozen=True)
class CachedSource:
    """A folder of the prepared-data cache: a prepared source, or what an unfinished preparation left."""

    path: Path
    state: str  # current; source changed, source missing, tokenizer changed, unreadable (stale); unfinished
    nbytes: int
    meta: dict | None  # a prepared source's meta.json

    @property
    def name(self) -> str:
        return self.path.name


def cached_sources(cache_root: Path) -> list[CachedSource]:
    """Every folder of the cache, with whether it still matches its source: a local source whose files are gone
    or hold other bytes now, or whose tokenizer file changed, can never be read again (a hub source is not
    checked: that needs the network)."""
    found = []
    for path in sorted(Path(cache_root).iterdir()) if Path(cache_root).is_dir() else []:
        if not path.is_dir() or path.name == ".digests":
            continue
        nbytes = sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
        if not _is_complete(path):  # with a COMPLETE marker: of another format version, or damaged
            state = "unreadable" if (path / "COMPLETE").is_file() else "unfinished"
            found.append(CachedSource(path, state, nbytes, None))
            continue
        meta = json.loads((path / "meta.json").read_text())
        found.append(CachedSource(path, _source_state(meta, Path(cache_root)), nbytes, meta))
    return found


def _source_state(meta: dict, cache_root: Path) -> str:
    source, tokenizer = meta["source"], meta["tokenizer"]
    tokenizer_file = Path(tokenizer["path"]).expanduser()
    if tokenizer_file.is_file() and hashlib.sha256(tokenizer_file.read_bytes()).hexdigest() != tokenizer["sha256"]:
        return "tokenizer changed"
    if "files" not in source:
        return "current"
    try:
        now = open_documents(DataSource(source["path"], source["format"], source["text_field"]))
    except ConfigError:
        return "source missing"
    return "current" if _file_entries(now, cache_root) == source["files"] else "source changed"


def remove_cached(source: CachedSource) -> bool:
    """Delete a cache folder, unless a process is preparing it now (False)."""
    final = source.path.name.removeprefix(".").split(".parts")[0].split(".tmp-")[0]
    lock = FileLock(source.path.with_name(final + ".lock"))
    try:
        lock.acquire(blocking=False)
    except Timeout:
        return False
    try:
        shutil.rmtree(source.path)
    finally:
        lock.release()
    return True


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


# ---------------------------------------------------------------------------------------------
# Identity and completeness


def _target(src: DataSource, tokenizer_cfg: TokenizerConfig, cache_root: Path) -> tuple[Documents, Path]:
    documents = open_documents(src)
    tokenizer = Tokenizer(tokenizer_cfg)  # a missing file or unknown BOS/EOS token: the tokenizer's own one-line error
    identity = _identity(documents, tokenizer_cfg, tokenizer.path.read_bytes(), Path(cache_root))
    return documents, _folder(Path(cache_root), documents, identity)


def _identity(documents: Documents, tokenizer_cfg: TokenizerConfig, tokenizer_json: bytes, cache_root: Path) -> dict:
    """Everything the tokens depend on; its hash names the folder. Local files count by name and contents, so a
    copied or touched source keeps its key (file_digest)."""
    cfg = documents.cfg
    if documents.files:
        # Local data files are all read into the one split, whatever its name: split and subset change nothing.
        source = {
            "files": _file_entries(documents, cache_root),
            "format": documents.fmt,
            "text_field": cfg.text_field,
        }
    else:
        source = {"hub": documents.path, "subset": cfg.subset, "split": cfg.split, "text_field": cfg.text_field}
        if cfg.revision:
            source["revision"] = cfg.revision
    tokenizer = {
        "sha256": hashlib.sha256(tokenizer_json).hexdigest(),
        "bos_token": tokenizer_cfg.bos_token,
        "eos_token": tokenizer_cfg.eos_token,
    }
    return {"format_version": FORMAT_VERSION, "source": source, "tokenizer": tokenizer}


def _file_entries(documents: Documents, cache_root: Path) -> list[list]:
    """[name within the source, size, sha256] of each of a local source's files."""
    root = Path(documents.path)
    name = lambda f: f.relative_to(root).as_posix() if root.is_dir() else f.name  # noqa: E731
    return [[name(f), f.stat().st_size, file_digest(f, cache_root)] for f in documents.files]


def file_digest(file: Path, cache_root: Path) -> str:
    """sha256 of a source file's bytes, remembered in the cache by the file's path, size, times and inode: an
    unchanged file is read once; a copied or touched one is read again, and with the same bytes has the same
    digest."""
    stat = file.stat()
    stamp = [stat.st_size, stat.st_mtime_ns, stat.st_ctime_ns, stat.st_ino]
    memo = cache_root / ".digests" / f"{hashlib.sha256(str(file.resolve()).encode()).hexdigest()[:32]}.json"
    try:
        saved = json.loads(memo.read_text())
        if saved["stamp"] == stamp:
            return saved["sha256"]
    except (OSError, ValueError, KeyError):
        pass
    digest = hashlib.sha256()
    with open(file, "rb") as f:
        while chunk := f.read(1 << 22):
            digest.update(chunk)
    try:  # written whole and renamed: a reader never sees half a memo
        memo.parent.mkdir(parents=True, exist_ok=True)
        temporary = memo.with_name(f"{memo.name}.{os.getpid()}.tmp")
        temporary.write_text(json.dumps({"stamp": stamp, "sha256": digest.hexdigest()}))
        temporary.replace(memo)
    except OSError:  # a read-only cache: the file is read again next time
        pass
    return digest.hexdigest()


def _folder(cache_root: Path, documents: Documents, identity: dict) -> Path:
    """The source's folder: a complete one with its key under any name (a copy of a source prepared under its
    first name), else <slug>-<key>, the slug from the source's name."""
    for folder in sorted(cache_root.glob(f"*-{_key(identity)}")):
        if not folder.name.startswith(".") and _is_complete(folder):
            return folder
    return cache_root / _folder_name(documents, identity)


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
    """(meta, memory map of offsets.npy) of a complete prepared folder; ConfigError saying what is wrong otherwise."""

    def fail(problem: str) -> NoReturn:
        raise ConfigError(f"{path} is not a complete prepared source ({problem}); {_RERUN} to prepare it again")

    if not (path / "COMPLETE").is_file():
        fail("no COMPLETE marker: its preparation never finished" if path.is_dir() else "no such folder")
    try:
        meta = json.loads((path / "meta.json").read_text())
        offsets = np.load(path / "offsets.npy", mmap_mode="r")
        blocks = np.load(path / "blocks.npy", mmap_mode="r")
    except (OSError, ValueError) as e:
        fail(f"unreadable meta.json, offsets.npy or blocks.npy: {e}")
    if meta.get("format_version") != FORMAT_VERSION:
        fail(f"format version {meta.get('format_version')}; this titan reads version {FORMAT_VERSION}")
    if (path / "COMPLETE").read_text() != meta["key"]:
        fail("its COMPLETE marker belongs to another preparation")
    n, per_block = meta["documents"], meta["block_documents"]
    if offsets.shape != (n + 1,) or offsets.dtype != np.int64 or int(offsets[-1]) != meta["tokens"]:
        fail(f"offsets.npy holds {offsets.shape} {offsets.dtype}, not ({n + 1},) int64 ending at {meta['tokens']}")
    if blocks.shape != (-(-n // per_block) + 1,) or blocks.dtype != np.int64:
        fail(f"blocks.npy holds {blocks.shape} {blocks.dtype}, not one int64 per block of {per_block} and one more")
    itemsize = np.dtype(meta["dtype"]).itemsize
    for shard, tokens in enumerate(meta["shard_tokens"]):
        file = path / _shard_name(shard)
        if not file.is_file() or file.stat().st_size != tokens * itemsize:
            fail(f"{file.name} should hold {tokens * itemsize} bytes")
    return meta, offsets


def _is_complete(path: Path) -> bool:
    try:
        _check(path)
    except ConfigError:
        return False
    return True


def _unit_complete(path: Path) -> bool:
    return (path / "COMPLETE").is_file()


# ---------------------------------------------------------------------------------------------
# Writing


def _prepare_units(folder: Path, work: Path, units: list[Unit], documents: Documents, tokenizer: Tokenizer,
                   tokenizer_json: str, workers: int, progress: bool, shard_tokens: int) -> None:  # fmt: skip
    """Tokenize each of these units not complete yet into work/<unit>, unless the source's folder is complete."""
    todo = [u for u in units if not _unit_complete(work / u.name)]
    if not todo or _is_complete(folder):
        return
    dtype = "<u2" if tokenizer.vocab_size <= 2**16 else "<u4"
    todo_bytes = sum(f.stat().st_size for u in todo for f in documents.files[u.first : u.stop])
    if not workers:  # starting tokenizer processes takes seconds: more than a small source takes in this one
        workers = 1 if documents.files and todo_bytes < _SMALL_SOURCE_BYTES else min(8, os.cpu_count() or 1)
    # A hub dataset counts its records itself (titan.data.dataset), having no bytes to count.
    bar = Progress(folder.name.rsplit("-", 1)[0], todo_bytes, "B", enabled=progress and bool(documents.files))
    with bar, _Tokenizers((tokenizer_json, tokenizer.bos_id, tokenizer.eos_id, dtype), workers) as tokenizers:
        for unit in todo:
            build_once(
                work / unit.name,
                lambda path: _unit_complete(path) or _is_complete(folder),
                lambda tmp, unit=unit: _write(tmp, documents, unit, tokenizers, dtype, shard_tokens, bar),
                "preparing",
            )


def _write(folder: Path, documents: Documents, unit: Unit, tokenizers: _Tokenizers, dtype: str, shard_tokens: int,
           bar) -> None:  # fmt: skip
    """Tokenize one unit's files into `folder`: its shards, lengths.bin (int64 per document) and meta.json."""
    counts = collections.Counter()
    files = documents.files[unit.first : unit.stop] if documents.files else [None]
    start = time.perf_counter()
    with _ShardWriter(folder, dtype, shard_tokens) as writer:
        for tokens, lengths, read in tokenizers.map(_text_chunks(documents, files, counts)):
            writer.add(tokens, lengths)
            bar.update(read)
            tokens_per_s = writer.tokens / max(time.perf_counter() - start, 1e-9)
            bar.detail(f"{writer.documents:,} documents, {tokens_per_s:,.0f} tokens/s")
    meta = {"records": counts["records"], "empty": counts["empty"], "documents": writer.documents,
            "tokens": writer.tokens, "shard_tokens": writer.sizes}  # fmt: skip
    write_synced(folder / "meta.json", json.dumps(meta).encode())
    write_synced(folder / "COMPLETE", b"")


def _merge(folder: Path, work: Path, units: list[Unit], documents: Documents, identity: dict,
           tokenizer_cfg: TokenizerConfig, tokenizer: Tokenizer) -> None:  # fmt: skip
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
        "source": {"source": cfg.source, "path": documents.path, **identity["source"]},
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


def _text_chunks(
    documents: Documents, files: list[Path | None], counts: collections.Counter
) -> Iterator[tuple[list[str], int]]:
    """The non-empty texts of these files (None: the hub dataset) in chunks of about _CHUNK_CHARS characters,
    each with the progress it makes in bytes: the text read, as a stand-in for the file bytes it came from,
    settled at the end of each file."""
    chunk, chars, read = [], 0, 0
    for file in files:
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
        # One call for the chunk: the tokenizer's own batch API, off the GIL (and on its threads where allowed).
        bodies = [e.ids for e in self.tokenizer.encode_batch(texts, add_special_tokens=False)]
        lengths = np.fromiter((len(body) + 2 for body in bodies), dtype=np.int64, count=len(bodies))
        ends = np.cumsum(lengths)
        ids = np.empty(int(ends[-1]) if len(ends) else 0, dtype=self.dtype)
        inside = np.ones(len(ids), dtype=bool)
        inside[ends - lengths] = inside[ends - 1] = False
        ids[ends - lengths], ids[ends - 1] = self.bos_id, self.eos_id
        ids[inside] = np.fromiter(
            itertools.chain.from_iterable(bodies), dtype=self.dtype, count=len(ids) - 2 * len(bodies)
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
