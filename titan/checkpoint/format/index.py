"""The index of a checkpoint's tensors, `tensors.json`: DCP's Metadata as JSON (index_of), and back, checked
entry by entry against the folder's files before any tensor is read (metadata_of)."""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)

from titan.checkpoint.format.chunks import boxes_tile
from titan.checkpoint.format.folder import INDEX, is_count
from titan.errors import ConfigError

FORMAT, VERSION = "titan-dcp-index", 1
DTYPES = {
    str(dtype).removeprefix("torch."): dtype
    for dtype in (torch.float32, torch.float64, torch.bfloat16, torch.float16, torch.int64, torch.int32, torch.int8,
                  torch.uint8, torch.bool, torch.float8_e4m3fn, torch.float8_e5m2)
}  # fmt: skip
_SHARD_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]*\.distcp")
_MAX_DIMS = 8


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


def metadata_of(index: Any, sizes: dict[str, int], folder: Path) -> Metadata:  # noqa: C901 (one check per field, in order)
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
        dtype = DTYPES.get(entry["dtype"]) if isinstance(entry["dtype"], str) else None
        shape = entry["shape"]
        if dtype is None:
            refuse(f"gives {fqn} the dtype {entry['dtype']!r}")
        if not (isinstance(shape, list) and len(shape) <= _MAX_DIMS and all(map(is_count, shape))):
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
                isinstance(v, list) and len(v) == len(shape) and all(map(is_count, v)) for v in (offsets, lengths)
            ):
                refuse(f"{where} has offsets {offsets!r} and sizes {lengths!r} for a tensor of shape {shape}")
            if any(o + n > dim for o, n, dim in zip(offsets, lengths, shape)):
                refuse(f"{where} lies outside the tensor's shape {shape}")
            if not (isinstance(file, str) and _SHARD_NAME.fullmatch(file) and file in sizes):
                refuse(f"{where} names the file {file!r}, which is not a shard file of the checkpoint")
            start, length = chunk["start"], chunk["length"]
            if not (is_count(start) and is_count(length) and start + length <= sizes[file]):
                refuse(f"{where} spans bytes {start!r}+{length!r} of {file}, which has {sizes[file]}")
            numel = math.prod(lengths)
            if numel * dtype.itemsize > length:
                refuse(f"{where} declares {numel} elements, more than its {length} bytes hold")
            elements += numel
            chunks.append(ChunkStorageMetadata(torch.Size(offsets), torch.Size(lengths)))
            storage[MetadataIndex(fqn, torch.Size(offsets), i)] = _StorageInfo(file, start, length)
        if elements != math.prod(shape):
            refuse(f"gives {fqn} chunks of {elements} elements in all, for a tensor of shape {shape}")
        if not boxes_tile(shape, [(c.offsets, c.sizes) for c in chunks]):
            refuse(f"gives {fqn} chunks that overlap (some of its elements are in two, others in none)")
        state[fqn] = TensorStorageMetadata(TensorProperties(dtype=dtype), torch.Size(shape), chunks)
    return Metadata(state_dict_metadata=state, storage_data=storage, storage_meta=StorageMeta())
