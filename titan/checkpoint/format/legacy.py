"""Checkpoints of titan before tensors.json: their pickled `.metadata` read through an allow-list of DCP's exact
metadata classes (legacy_index), and rewritten once as tensors.json (upgrade, `titan convert upgrade`)."""

from __future__ import annotations

import io
import json
import pickle
from pathlib import Path

from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)

from titan.checkpoint.format.folder import (
    INDEX,
    LEGACY_INDEX,
    MANIFEST,
    read_manifest,
    sealed_sizes,
    sha256_files,
    verify,
)
from titan.checkpoint.format.index import DTYPES, index_of, metadata_of
from titan.checkpoint.format.storage import dcp_error
from titan.errors import ConfigError
from titan.files import fsync, write_synced


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
        *(("torch", name) for name in DTYPES),
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
    metadata_of(json.loads(json.dumps(index)), sealed_sizes(folder), folder)  # JSON types, then every check
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
