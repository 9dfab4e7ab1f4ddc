"""The prepared-data cache: a source's key and folder, the checks that a folder is complete, and the listing and
removal behind `titan data ls` and `titan data clean`."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import NoReturn

import numpy as np
from filelock import FileLock, Timeout

from titan.config import Data, DataSource
from titan.config import Tokenizer as TokenizerConfig
from titan.data.dataset import Documents, open_documents
from titan.data.tokenizer import Tokenizer
from titan.errors import ConfigError
from titan.files import cache_root

FORMAT_VERSION = 2  # 1: documents.npy held (shard, offset, length) per document, 24 bytes
_RERUN = "run `titan data prepare --config <recipe>`"


def cache_root_for(data_cfg: Data) -> Path:
    """Where prepared sources live: data.cache_dir, else <titan cache>/prepared."""
    if data_cfg.cache_dir:
        return Path(data_cfg.cache_dir).expanduser()
    return cache_root() / "prepared"


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
        # Text files by line, as titan read them before text_unit, keep the key they had then.
        if documents.fmt == "text" and cfg.text_unit != "line":
            source["text_unit"] = cfg.text_unit
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
