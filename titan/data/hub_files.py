"""A hub dataset as its data files, so that a pretraining corpus of thousands of parquet shards (FineWeb-Edu's) is
prepared by units of files as a local folder is: spread over machines with `--part i/N`, and resumed at its first
unfinished unit.

The subset and split are resolved to files by HF datasets' own rules (the card's `configs`, else its default
patterns), at the commit the revision names when the preparation starts. That listing is kept with the
preparation's parts, so every part and every resume reads the same files, whatever the branch has since become.
Each file is fetched when its unit is prepared and removed after: the corpus need not fit on the disk twice.
"""

from __future__ import annotations

import contextlib
import json
import re
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from titan.config import Data, DataSource
from titan.data.local_files import first_line, format_of
from titan.errors import ConfigError, UserError, import_extra
from titan.files import build_once, write_synced

# How HF datasets names a resolved data file: hf://datasets/<repo>@<commit>/<path in the repo>.
_RESOLVED = re.compile(r"hf://datasets/(?P<repo>[^@]+)@(?P<commit>[0-9a-f]{40})/(?P<path>.+)")


@dataclass(frozen=True)
class HubFile:
    """One data file of a hub dataset, at a commit."""

    repo: str
    commit: str
    path: str
    size: int  # bytes in the repo (parquet's are compressed): what units and progress count
    into: Path  # where it is fetched to be read: the preparation's parts, beside the cache it fills

    @contextlib.contextmanager
    def fetched(self) -> Iterator[Path]:
        """The file, fetched into a temporary folder and removed when done."""
        hub = import_extra("huggingface_hub", "hub", f"hub dataset {self.repo!r}")
        self.into.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=self.into, prefix=".fetch-") as tmp:
            try:
                local = hub.hf_hub_download(
                    self.repo, self.path, repo_type="dataset", revision=self.commit, local_dir=tmp
                )
            except Exception as e:  # network and hub errors: assorted types. Not a ConfigError, which discards
                raise UserError(  # the units prepared: the source is fine, and the next prepare resumes here
                    f"data.source: could not fetch {self.path} of hub dataset {self.repo!r} at {self.commit[:12]}: "
                    f"{first_line(e)}; run titan data prepare again to "
                    "resume from this file"
                ) from None
            yield Path(local)


@dataclass(frozen=True)
class HubListing:
    """A hub source's data files, all of one format titan reads (json or parquet)."""

    fmt: str
    files: list[HubFile]


def hub_listing(cfg: Data | DataSource, path: str, folder: Path) -> HubListing | None:
    """The listing of hub dataset `path` kept in `folder` (a preparation's parts), made there by the first process
    to ask; None where its files are of no format titan reads one by one, which is then streamed as one unit."""
    kept = folder / "listing"
    build_once(kept, lambda p: (p / "files.json").is_file(), lambda tmp: _list(cfg, path, tmp), "listing")
    listing = json.loads((kept / "files.json").read_text())
    if listing["format"] is None:
        return None
    files = [HubFile(listing["repo"], listing["commit"], name, size, folder) for name, size in listing["files"]]
    return HubListing(listing["format"], files)


def _list(cfg: Data | DataSource, path: str, into: Path) -> None:
    datasets = import_extra("datasets", "hub", f"data.source {path!r} (a hub dataset)")
    hub = import_extra("huggingface_hub", "hub", f"data.source {path!r} (a hub dataset)")
    try:
        builder = datasets.load_dataset_builder(path, cfg.subset or None, revision=cfg.revision or None)
        data_files = builder.config.data_files or {}
    except Exception as e:  # network and hub errors: assorted types
        raise ConfigError(
            f"data.source: could not list hub dataset {path!r} (subset {cfg.subset or 'default'!r}): "
            f"{first_line(e)}. Without internet, use a local file or folder"
        ) from None
    if cfg.split not in data_files:
        raise ConfigError(
            f"data.split: hub dataset {path!r} has the splits {', '.join(data_files) or 'none'}, not {cfg.split!r}; "
            "set data.split to one of them"
        )
    resolved = [_RESOLVED.fullmatch(url) for url in data_files[cfg.split]]
    formats = {format_of(Path(m["path"])) if m else None for m in resolved}
    listing = {"repo": path, "commit": None, "format": None, "files": []}
    if len(formats) == 1 and None not in formats and len({(m["repo"], m["commit"]) for m in resolved}) == 1:
        repo, commit = resolved[0]["repo"], resolved[0]["commit"]
        wanted = {m["path"] for m in resolved}
        sizes = {
            entry.path: entry.size
            for entry in hub.HfApi().list_repo_tree(repo, repo_type="dataset", revision=commit, recursive=True)
            if entry.path in wanted
        }
        files = [[m["path"], sizes.get(m["path"], 0)] for m in resolved]
        listing = {"repo": repo, "commit": commit, "format": formats.pop(), "files": files}
    write_synced(into / "files.json", json.dumps(listing).encode())
