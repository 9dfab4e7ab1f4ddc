"""What a titan checkpoint folder is, and the checks that make reading one safe.

A checkpoint folder holds DCP's tensor shards (`*.distcp`), their index `tensors.json`, titan's JSON files
(train_state.json, data.json), `manifest.json` (every other file's size and SHA-256) and, written last, the
`COMPLETE` marker (and later, once the step after it ran finite, the `NEXT_STEP_FINITE` mark). Nothing in it is
code:

* DCP's own writer pickles its index (`.metadata`) and its reader unpickles it, so a shared checkpoint could run
  code on whoever loads it. titan writes the same index as JSON (CheckpointWriter) and turns it back into DCP's
  Metadata itself (CheckpointReader), after checking every entry against the folder: plain file names that the
  manifest lists, byte ranges inside those files, chunks that tile their tensor (each element in exactly one).
  A tensor's declared size is therefore bounded by the bytes on disk.
* Each shard entry is a tensor saved with torch.save, which DCP reads with torch.load(weights_only=True), once
  its zip records are known to be stored and no larger than its bytes (archive_problem).
* DCP stores values that are not tensors as "bytes" entries and reads them with torch.load(weights_only=False),
  which runs code. titan never writes them (its state is tensors and JSON), and the JSON index cannot express one.

Checkpoints of titan before this format hold the pickled `.metadata`; `titan convert upgrade` rewrites one to
`tensors.json` once, reading the pickle through an allow-list of DCP's exact metadata classes, setting the state
of no object but those it made (legacy_index).
"""

from __future__ import annotations

import hashlib
import io
import itertools
import json
import math
import os
import pickle
import re
import struct
import zipfile
from collections import Counter
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, BinaryIO

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException  # a BaseException, not an Exception
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadPlan, SavePlan, WriteItem

from titan.errors import ConfigError
from titan.files import fsync, write_synced
from titan.progress import Progress

MARKER = "COMPLETE"
# Written into a complete checkpoint once the step after it ran finite: its weights are known to train on. Its
# presence is all it says (it is empty and outside the manifest, so writing it never changes the checkpoint).
PROVEN = "NEXT_STEP_FINITE"
MANIFEST = "manifest.json"
INDEX = "tensors.json"
LEGACY_INDEX = ".metadata"  # DCP's pickled index, written by titan before tensors.json
FORMAT, VERSION = "titan-dcp-index", 1
_DTYPES = {
    str(dtype).removeprefix("torch."): dtype
    for dtype in (torch.float32, torch.float64, torch.bfloat16, torch.float16, torch.int64, torch.int32, torch.int8,
                  torch.uint8, torch.bool, torch.float8_e4m3fn, torch.float8_e5m2)
}  # fmt: skip
_PLAIN_NAME = re.compile(r"(?!\.+$)[A-Za-z0-9_.-]+")  # a name in the folder: no "/", not "." or ".."
_SHARD_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]*\.distcp")
_MAX_DIMS = 8


# -- the folder and its manifest ---------------------------------------------------------------------------


def sha256_files(folder: Path, names: list[str]) -> dict[str, dict]:
    """{name: {"size", "sha256"}} of files in `folder`, hashed in threads (hashlib releases the GIL)."""

    def digest(name: str) -> tuple[str, dict]:
        with open(folder / name, "rb") as f:
            return name, {"size": os.fstat(f.fileno()).st_size, "sha256": hashlib.file_digest(f, "sha256").hexdigest()}

    with ThreadPoolExecutor(max(1, min(4, os.cpu_count() or 1))) as pool:
        return dict(pool.map(digest, names))


def seal(folder: Path, files: dict[str, dict] | None = None) -> None:
    """Write the manifest (`files`, else every file's hash now) and then the COMPLETE marker, all on disk."""
    if files is None:
        files = sha256_files(folder, sorted(p.name for p in folder.iterdir() if p.is_file()))
    write_synced(folder / MANIFEST, json.dumps({"files": files}, indent=1).encode())
    write_synced(folder / MARKER, b"")
    fsync(folder)


def read_manifest(folder: Path) -> dict[str, dict] | str:
    """The manifest's entries, or what is wrong with it."""
    try:
        files = json.loads((folder / MANIFEST).read_text())["files"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        return f"{MANIFEST} is missing or unreadable ({e.__class__.__name__})"
    if not isinstance(files, dict):
        return f"{MANIFEST} is malformed"
    for name, entry in files.items():
        if not _PLAIN_NAME.fullmatch(name) or name in (MANIFEST, MARKER, PROVEN):
            return f"{MANIFEST} lists {name!r}, which is not a file name of a checkpoint"
        if not (isinstance(entry, dict) and _count(entry.get("size")) and isinstance(entry.get("sha256"), str)):
            return f"{MANIFEST} is malformed (the entry of {name})"
    return files


def folder_problems(folder: Path, files: dict[str, dict]) -> list[str]:
    """What is wrong with the folder's entries against its manifest's, without reading any file: every entry
    a regular file (no links, no folders), the manifest's files and no others, each of its saved size."""
    problems, entries = [], sorted(folder.iterdir())
    for path in entries:
        name = path.name
        if path.is_symlink() or not path.is_file():
            problems.append(f"{name} is {'a symbolic link' if path.is_symlink() else 'not a regular file'}")
        elif name not in files and name not in (MANIFEST, MARKER, PROVEN):
            problems.append(f"{name} is not listed in {MANIFEST}")
        elif name in files and path.stat().st_size != files[name]["size"]:
            problems.append(f"{name} has {path.stat().st_size} bytes, {files[name]['size']} were saved")
    names = {path.name for path in entries}
    return problems + [f"{name} is missing" for name in files if name not in names]


def verify(folder: Path, rank: int = 0, world: int = 1, group=None) -> str | None:
    """None if the folder holds exactly its manifest's files, each matching its size and SHA-256, else the first
    problem. With several ranks (and `group`), each hashes its share of the files and all learn the verdict."""
    files, problems = _listing(folder)
    if not problems:
        names = sorted(files)[rank::world]
        problems = [
            f"{name} does not match its SHA-256 (its bytes changed after the save)"
            for name, entry in sha256_files(folder, names).items()
            if entry["sha256"] != files[name]["sha256"]
        ]
    if group is not None:
        gathered: list = [None] * world
        dist.all_gather_object(gathered, problems, group=group)
        problems = [p for share in gathered for p in share]
    return f"{folder}: {problems[0]}" if problems else None


def _listing(folder: Path) -> tuple[dict[str, dict], list[str]]:
    """(the manifest's entries, what is wrong with the folder against them), reading no file but the manifest."""
    files = read_manifest(folder)
    return ({}, [files]) if isinstance(files, str) else (files, folder_problems(folder, files))


def _sealed_sizes(folder: Path) -> dict[str, int]:
    """{file: size} of a sealed checkpoint's files after the checks that read none (the hashes are verify's)."""
    files, problems = _listing(folder)
    if problems:
        raise ConfigError(f"checkpoint {folder} is corrupt: {problems[0]}")
    return {name: entry["size"] for name, entry in files.items()}


def _plain_sizes(folder: Path) -> dict[str, int]:
    """{file: size} of the regular files of a folder titan itself wrote moments ago (a pipeline re-split's)."""
    return {p.name: p.stat().st_size for p in folder.iterdir() if p.is_file() and not p.is_symlink()}


# -- the index: DCP's Metadata as JSON, and back -----------------------------------------------------------


def _count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def index_of(metadata: Metadata, storage: dict[MetadataIndex, _StorageInfo]) -> dict:
    """The JSON index of DCP's Metadata and the writer's storage entries. Only tensors: titan has no other."""
    tensors: dict[str, dict] = {}
    for fqn, entry in metadata.state_dict_metadata.items():
        if not isinstance(entry, TensorStorageMetadata):
            raise TypeError(f"{fqn} is a {type(entry).__name__}: titan checkpoints hold tensors only")
        tensors[fqn] = {"dtype": str(entry.properties.dtype).removeprefix("torch."), "shape": list(entry.size),
                        "chunks": []}  # fmt: skip
    for key, info in storage.items():
        if info.transform_descriptors:
            raise TypeError(f"{key.fqn} was written through stream transforms, which titan does not read")
        sizes = next(c.sizes for c in metadata.state_dict_metadata[key.fqn].chunks if c.offsets == key.offset)
        tensors[key.fqn]["chunks"].append(
            {"offsets": list(key.offset), "sizes": list(sizes), "file": info.relative_path, "start": info.offset,
             "length": info.length}
        )  # fmt: skip
    for entry in tensors.values():
        entry["chunks"].sort(key=lambda c: c["offsets"])
    return {"format": FORMAT, "version": VERSION, "tensors": tensors}


def metadata_of(index: Any, sizes: dict[str, int], folder: Path) -> Metadata:
    """DCP's Metadata of a JSON index, checked against the folder's files ({name: size}): ConfigError if anything
    in it is not what titan writes, before any tensor is read."""

    def refuse(what: str):
        raise ConfigError(f"checkpoint {folder} is corrupt: its {INDEX} {what}")

    if not isinstance(index, dict) or set(index) != {"format", "version", "tensors"} or index["format"] != FORMAT:
        refuse(f"is not a {FORMAT}")
    if index["version"] != VERSION:
        refuse(f"is of version {index['version']!r}; this titan reads version {VERSION} (upgrade titan)")
    if not isinstance(index["tensors"], dict) or not index["tensors"]:
        refuse("lists no tensors")
    state: dict[str, TensorStorageMetadata] = {}
    storage: dict[MetadataIndex, _StorageInfo] = {}
    for fqn, entry in index["tensors"].items():
        if not isinstance(entry, dict) or set(entry) != {"dtype", "shape", "chunks"}:
            refuse(f"entry of {fqn!r} is not a tensor (titan writes no other entries)")
        dtype = _DTYPES.get(entry["dtype"]) if isinstance(entry["dtype"], str) else None
        shape = entry["shape"]
        if dtype is None:
            refuse(f"gives {fqn} the dtype {entry['dtype']!r}")
        if not (isinstance(shape, list) and len(shape) <= _MAX_DIMS and all(map(_count, shape))):
            refuse(f"gives {fqn} the shape {shape!r}")
        if not isinstance(entry["chunks"], list) or not entry["chunks"]:
            refuse(f"gives {fqn} no chunks")
        chunks, elements = [], 0
        for i, chunk in enumerate(entry["chunks"]):
            where = f"chunk {i} of {fqn}"
            if not isinstance(chunk, dict) or set(chunk) != {"offsets", "sizes", "file", "start", "length"}:
                refuse(f"{where} is malformed")
            offsets, lengths, file = chunk["offsets"], chunk["sizes"], chunk["file"]
            if not all(
                isinstance(v, list) and len(v) == len(shape) and all(map(_count, v)) for v in (offsets, lengths)
            ):
                refuse(f"{where} has offsets {offsets!r} and sizes {lengths!r} for a tensor of shape {shape}")
            if any(o + n > dim for o, n, dim in zip(offsets, lengths, shape)):
                refuse(f"{where} lies outside the tensor's shape {shape}")
            if not (isinstance(file, str) and _SHARD_NAME.fullmatch(file) and file in sizes):
                refuse(f"{where} names the file {file!r}, which is not a shard file of the checkpoint")
            start, length = chunk["start"], chunk["length"]
            if not (_count(start) and _count(length) and start + length <= sizes[file]):
                refuse(f"{where} spans bytes {start!r}+{length!r} of {file}, which has {sizes[file]}")
            numel = math.prod(lengths)
            if numel * dtype.itemsize > length:
                refuse(f"{where} declares {numel} elements, more than its {length} bytes hold")
            elements += numel
            chunks.append(ChunkStorageMetadata(torch.Size(offsets), torch.Size(lengths)))
            storage[MetadataIndex(fqn, torch.Size(offsets), i)] = _StorageInfo(file, start, length)
        if elements != math.prod(shape):
            refuse(f"gives {fqn} chunks of {elements} elements in all, for a tensor of shape {shape}")
        if not _tile(shape, [(c.offsets, c.sizes) for c in chunks]):
            refuse(f"gives {fqn} chunks that overlap (some of its elements are in two, others in none)")
        state[fqn] = TensorStorageMetadata(TensorProperties(dtype=dtype), torch.Size(shape), chunks)
    return Metadata(state_dict_metadata=state, storage_data=storage, storage_meta=StorageMeta())


def _tile(shape: list[int], boxes: list[tuple[Sequence[int], Sequence[int]]]) -> bool:
    """Whether the boxes (offsets, sizes) inside a tensor of `shape` hold each of its elements exactly once. A box's
    indicator is the signed sum of the orthants at its 2^d corners (+ at an even number of far ends, - at an odd),
    and distinct orthants are linearly independent: the boxes tile the tensor iff the signed counts of their
    corners are the tensor's own. O(boxes x 2^d), where comparing boxes pairwise would be O(boxes^2)."""
    counts: Counter[tuple[int, ...]] = Counter()

    def add(offsets: Sequence[int], sizes: Sequence[int], sign: int) -> None:
        for far in itertools.product((0, 1), repeat=len(sizes)):
            corner = tuple(o + n * f for o, n, f in zip(offsets, sizes, far))
            counts[corner] += -sign if sum(far) % 2 else sign

    for offsets, sizes in boxes:
        add(offsets, sizes, 1)
    add([0] * len(shape), shape, -1)
    return not any(counts.values())


class _Counted:
    """A DCP planner whose items count as progress when the storage layer takes one to write (resolve_data,
    called just before its write) or hands one back read (commit_tensor); every other call goes to `planner`."""

    def __init__(self, planner, progress: Progress, size: Callable[[Any], int]):
        self._planner, self._progress, self._size = planner, progress, size

    def __getattr__(self, name: str):
        return getattr(self._planner, name)

    def resolve_data(self, item):
        data = self._planner.resolve_data(item)
        self._progress.update(self._size(item))
        return data

    def commit_tensor(self, item, tensor) -> None:
        self._planner.commit_tensor(item, tensor)
        self._progress.update(self._size(item))


def _write_item_bytes(item: WriteItem) -> int:
    chunk = item.tensor_data
    return 0 if chunk is None else math.prod(chunk.chunk.sizes) * chunk.properties.dtype.itemsize


class CheckpointWriter(dcp.FileSystemWriter):
    """DCP's file writer, writing the index as JSON (tensors.json) instead of a pickle. With `progress`, it shows
    this rank's writing as that: only for a save that blocks, never one in the background."""

    def __init__(self, path: str | os.PathLike, progress: str | None = None):
        super().__init__(path)
        self.progress = progress

    def write_data(self, plan: SavePlan, planner):
        if self.progress is None:
            return super().write_data(plan, planner)
        total = sum(map(_write_item_bytes, plan.items))
        with Progress(self.progress, total, "B") as progress:  # DCP's file writer is done when write_data returns
            return super().write_data(plan, _Counted(planner, progress, _write_item_bytes))

    def finish(self, metadata: Metadata, results: list) -> None:
        storage = {result.index: result.storage_data for rank_results in results for result in rank_results}
        index = json.dumps(index_of(metadata, storage), separators=(",", ":")).encode()
        write_synced(Path(self.path) / INDEX, index)


class CheckpointReader(dcp.FileSystemReader):
    """DCP's file reader, reading the JSON index after the folder's checks; no pickle is read. `sealed`: a
    checkpoint with its manifest (every titan checkpoint); unsealed only for titan's own scratch folders. With
    `progress`, it shows this rank's reading as that."""

    def __init__(self, path: str | os.PathLike, sealed: bool = True, progress: str | None = None):
        super().__init__(path)
        self.sealed, self.progress = sealed, progress

    def read_data(self, plan: LoadPlan, planner):
        self._check_archives(plan)
        if self.progress is None:
            return super().read_data(plan, planner)
        size = lambda item: self.storage_data[item.storage_index].length  # noqa: E731
        with Progress(self.progress, sum(map(size, plan.items)), "B") as progress:
            return super().read_data(plan, _Counted(planner, progress, size))

    def _check_archives(self, plan: LoadPlan) -> None:
        """ConfigError unless each chunk the plan reads is an archive that torch.load reads within its bytes."""
        chunks: dict[str, dict[tuple[int, int], str]] = {}  # {file: {(start, length): tensor}}
        for item in plan.items:
            info = self.storage_data[item.storage_index]
            chunks.setdefault(info.relative_path, {})[info.offset, info.length] = item.storage_index.fqn
        for name, spans in chunks.items():
            with open(Path(self.path) / name, "rb") as file:
                for (start, length), fqn in sorted(spans.items()):
                    problem = archive_problem(file, start, length)
                    if problem:
                        raise ConfigError(f"the chunk of {fqn} at bytes {start}+{length} of {name} {problem}")

    def read_metadata(self, *args, **kwargs) -> Metadata:
        folder = Path(self.path)
        sizes = _sealed_sizes(folder) if self.sealed else _plain_sizes(folder)
        if INDEX not in sizes:
            if LEGACY_INDEX in sizes:
                raise ConfigError(
                    f"checkpoint {folder} was written by an older titan (a pickled {LEGACY_INDEX}, which titan no "
                    f"longer reads): convert it once with `titan convert upgrade {folder}`"
                )
            raise ConfigError(f"checkpoint {folder} is corrupt: it has no {INDEX}")
        try:
            index = json.loads((folder / INDEX).read_bytes())
        except (OSError, ValueError) as e:
            raise ConfigError(f"checkpoint {folder} is corrupt: its {INDEX} is not JSON ({e})") from None
        metadata = metadata_of(index, sizes, folder)
        metadata.storage_meta.load_id = self.load_id
        return metadata


class _ByteRange(io.RawIOBase):
    """Bytes [start, start + length) of an open file as a file of their own: a chunk's zip directory is read
    through it without reading the chunk."""

    def __init__(self, file: BinaryIO, start: int, length: int):
        super().__init__()
        self._file, self._start, self.length, self._at = file, start, length, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._at

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        at = offset + (0, self._at, self.length)[whence]
        if at < 0:
            raise ValueError(f"seek to byte {at}, before the chunk")
        self._at = at
        return at

    def readinto(self, buffer) -> int:
        self._file.seek(self._start + self._at)
        read = self._file.readinto(memoryview(buffer)[: max(0, self.length - self._at)])
        self._at += read
        return read


def archive_problem(file: BinaryIO, start: int, length: int) -> str | None:
    """What would make torch.load take more memory for the torch.save archive at bytes [start, start + length) of
    `file` than those bytes, or None.

    torch.load allocates each record it reads at the size the zip directory declares, and a deflated record
    declares what it likes (a 64-float view of a 100M-float storage in 390 KB took 394 MiB): the records must be
    stored, no larger together than the chunk. Checked, then read by torch.load rather than by titan, so that
    torch's own weights-only unpickler still rebuilds the tensor (storage, view, dtype). zipfile reads the
    directory it finds right before the end record, torch's zip reader (miniz) the one at the offset the end
    record states: the archive must end with its directory and end record, so that both read the same."""
    chunk = _ByteRange(file, start, length)
    entries = _directory_entries(chunk)
    if entries is None:
        return "is not a torch.save archive (its zip directory is not where its end record says)"
    try:
        with zipfile.ZipFile(chunk) as archive:
            records = archive.infolist()
    except (zipfile.BadZipFile, ValueError, EOFError, OSError) as e:
        return f"is not a torch.save archive ({e})"
    if len(records) != entries:
        return f"is not a torch.save archive (its zip directory holds {len(records)} records, its end record {entries})"
    if any(r.compress_type != zipfile.ZIP_STORED or r.compress_size != r.file_size for r in records):
        return "holds compressed records (torch.save writes none; torch.load would inflate them whole)"
    if sum(r.file_size for r in records) > chunk.length:
        return f"declares records of {sum(r.file_size for r in records)} bytes, more than its {chunk.length}"
    return None


def _directory_entries(chunk: _ByteRange) -> int | None:
    """The number of records the archive's end record (zip64's where there is one) declares, if the archive ends
    with it (no comment) and its central directory lies right before it; else None."""
    end = chunk.length - zipfile.sizeEndCentDir
    try:
        chunk.seek(end)
        sig, *_, entries, size, offset, comment = struct.unpack(
            zipfile.structEndArchive, chunk.read(zipfile.sizeEndCentDir)
        )
        if sig != zipfile.stringEndArchive or comment:
            return None
        chunk.seek(end - zipfile.sizeEndCentDir64Locator)
        sig, _, record, _ = struct.unpack(
            zipfile.structEndArchive64Locator, chunk.read(zipfile.sizeEndCentDir64Locator)
        )
        if sig == zipfile.stringEndArchive64Locator:  # zip64: its end record, right before the locator
            end = end - zipfile.sizeEndCentDir64Locator - zipfile.sizeEndCentDir64
            chunk.seek(end)
            sig, *_, entries, size, offset = struct.unpack(
                zipfile.structEndArchive64, chunk.read(zipfile.sizeEndCentDir64)
            )
            if sig != zipfile.stringEndArchive64 or record != end:
                return None
    except (struct.error, ValueError):  # too short for the records
        return None
    return entries if offset + size == end else None


def dcp_error(e: BaseException) -> str:
    """One line for a DCP failure: the first failing rank's error, never the tracebacks DCP's text embeds."""
    failures = getattr(e, "failures", None) if isinstance(e, CheckpointException) else None
    if failures:
        rank, failure = min(failures.items(), key=lambda item: item[0])
        error = failure[0] if isinstance(failure, tuple) else failure
        return f"{type(error).__name__} on rank {rank}: {_first_line(error)}"
    return f"{type(e).__name__}: {_first_line(e)}"


def _first_line(e: BaseException) -> str:
    lines = str(e).strip().splitlines()
    return lines[0][:300] if lines else "(no message)"


# -- checkpoints of titan before tensors.json ----------------------------------------------------------------


class _LegacyIndexUnpickler(pickle._Unpickler):
    """Exactly the classes DCP's pickled index is made of; a name is looked up whole, never as a dotted path. BUILD
    (setting an object's state) only on the index's own objects, which this pickle made: on an admitted class or
    a shared object (an enum member) it would change that for the rest of the process (PosixPath.is_symlink, say).
    pickle's Python unpickler, as its C one has no hook per opcode: an index is read once, by `convert upgrade`."""

    _BUILT = (Metadata, TensorStorageMetadata, ChunkStorageMetadata, TensorProperties, MetadataIndex, StorageMeta,
              _StorageInfo)  # fmt: skip

    _ALLOWED = {
        *(("torch.distributed.checkpoint.metadata", name) for name in (
            "Metadata", "TensorStorageMetadata", "ChunkStorageMetadata", "TensorProperties", "MetadataIndex",
            "StorageMeta", "_MEM_FORMAT_ENCODING")),
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
        ("torch.serialization", "_get_layout"),
        ("torch", "Size"),
        ("pathlib", "PosixPath"),
        ("pathlib", "PurePosixPath"),
        *(("torch", name) for name in _DTYPES),
    }  # fmt: skip

    def find_class(self, module: str, name: str):
        if (module, name) not in self._ALLOWED:
            raise pickle.UnpicklingError(f"{module}.{name} is not part of a DCP index")
        return super().find_class(module, name)

    def load_build(self) -> None:
        target = self.stack[-2]  # under the state
        if type(target) not in self._BUILT:
            kind = target if isinstance(target, type) else type(target)
            what = f"{kind.__module__}.{kind.__qualname__}" + ("" if kind is target else " object")
            raise pickle.UnpicklingError(f"sets the state of {what}, which is not an object of a DCP index")
        super().load_build()

    dispatch = {**pickle._Unpickler.dispatch, pickle.BUILD[0]: load_build}


def legacy_index(folder: Path) -> dict:
    """The JSON index of a checkpoint's pickled `.metadata`, checked like any index."""
    try:
        metadata = _LegacyIndexUnpickler(io.BytesIO((folder / LEGACY_INDEX).read_bytes())).load()
        if not isinstance(metadata, Metadata) or not isinstance(metadata.state_dict_metadata, dict):
            raise pickle.UnpicklingError("it holds no DCP Metadata")
        storage = metadata.storage_data
        if not isinstance(storage, dict) or not all(
            isinstance(k, MetadataIndex) and type(v) is _StorageInfo for k, v in storage.items()
        ):
            raise pickle.UnpicklingError("its storage entries are not DCP's")
        index = index_of(metadata, storage)
    except (pickle.UnpicklingError, TypeError) as e:
        raise ConfigError(f"checkpoint {folder} is not trusted: its {LEGACY_INDEX} {e}") from None
    except Exception as e:  # whatever a damaged pickle raises
        raise ConfigError(f"checkpoint {folder} is corrupt: cannot read its {LEGACY_INDEX} ({dcp_error(e)})") from None
    metadata_of(json.loads(json.dumps(index)), _sealed_sizes(folder), folder)  # JSON types, then every check
    return index


def upgrade(folder: Path) -> str:
    """Rewrite a checkpoint of titan before tensors.json in place: tensors.json and its manifest entry written,
    then `.metadata` removed. Each step leaves a folder that this function finishes when run again."""
    files = read_manifest(folder)
    if isinstance(files, str):
        raise ConfigError(f"checkpoint {folder} is corrupt: {files}")
    manifest = folder / f".{MANIFEST}.tmp"
    manifest.unlink(missing_ok=True)  # left by an upgrade interrupted before its rename
    if INDEX in files:
        if (folder / LEGACY_INDEX).exists():
            (folder / LEGACY_INDEX).unlink()  # an upgrade interrupted after its manifest was written
        return f"{folder} is in the current format already"
    (folder / INDEX).unlink(missing_ok=True)  # likewise
    problem = verify(folder)
    if problem:
        raise ConfigError(f"checkpoint {problem}; upgrade another checkpoint")
    index = legacy_index(folder)
    write_synced(folder / INDEX, json.dumps(index, separators=(",", ":")).encode())
    files = {name: entry for name, entry in files.items() if name != LEGACY_INDEX}
    files.update(sha256_files(folder, [INDEX]))
    write_synced(manifest, json.dumps({"files": files}, indent=1).encode())
    manifest.rename(folder / MANIFEST)  # atomic: the folder is the old checkpoint or the new one
    fsync(folder)
    (folder / LEGACY_INDEX).unlink()
    return f"upgraded {folder}: {len(index['tensors'])} tensors indexed in {INDEX}; {LEGACY_INDEX} removed"
