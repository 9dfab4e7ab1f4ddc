"""DCP's storage layer for titan's folders: CheckpointWriter writes the index as JSON, CheckpointReader reads it
back after the folder's checks and each chunk's before torch.load reads it; DCP's errors as one line."""

from __future__ import annotations

import contextlib
import json
import math
import os
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException  # a BaseException, not an Exception
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import LoadPlan, SavePlan, WriteItem

from titan.checkpoint.format.chunks import archive_problem
from titan.checkpoint.format.folder import INDEX, LEGACY_INDEX, plain_sizes, sealed_sizes
from titan.checkpoint.format.index import index_of, metadata_of
from titan.errors import ConfigError
from titan.files import write_synced
from titan.progress import Progress


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
        sizes = sealed_sizes(folder) if self.sealed else plain_sizes(folder)
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


@contextlib.contextmanager
def single_process_quiet():
    """DCP warns that it assumes a single process when torch.distributed is not initialised: that is the intent."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        yield
