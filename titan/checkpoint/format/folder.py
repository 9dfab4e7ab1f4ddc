"""The checkpoint folder and its manifest: every file's size and SHA-256, the COMPLETE marker written last, and
the checks of a folder against them."""

from __future__ import annotations

import hashlib
import json
import os
import re
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch.distributed as dist

from titan.errors import ConfigError
from titan.files import fsync, write_synced

MARKER = "COMPLETE"
# Written into a complete checkpoint once the step after it ran finite: its weights are known to train on. Its
# presence is all it says (it is empty and outside the manifest, so writing it never changes the checkpoint).
PROVEN = "NEXT_STEP_FINITE"
MANIFEST = "manifest.json"
INDEX = "tensors.json"
LEGACY_INDEX = ".metadata"  # DCP's pickled index, written by titan before tensors.json
_PLAIN_NAME = re.compile(r"(?!\.+$)[A-Za-z0-9_.-]+")  # a name in the folder: no "/", not "." or ".."


def is_count(value: Any) -> bool:
    """A size, an offset or a dim: an int (not a bool), not negative."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


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
        if not (isinstance(entry, dict) and is_count(entry.get("size")) and isinstance(entry.get("sha256"), str)):
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


def sealed_sizes(folder: Path) -> dict[str, int]:
    """{file: size} of a sealed checkpoint's files after the checks that read none (the hashes are verify's)."""
    files, problems = _listing(folder)
    if problems:
        raise ConfigError(f"checkpoint {folder} is corrupt: {problems[0]}")
    return {name: entry["size"] for name, entry in files.items()}


def plain_sizes(folder: Path) -> dict[str, int]:
    """{file: size} of the regular files of a folder titan itself wrote moments ago (a pipeline re-split's)."""
    return {p.name: p.stat().st_size for p in folder.iterdir() if p.is_file() and not p.is_symlink()}
