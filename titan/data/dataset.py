"""Documents from a local file or folder (read by local_files.py), or a HF hub dataset (streamed with HF `datasets`)."""

from __future__ import annotations

import functools
import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from titan.config import Data, DataSource
from titan.data.hub_files import HubFile
from titan.data.local_files import (
    LOCAL_READERS,
    TEXT_READERS,
    field_text,
    first_line,
    format_of,
    text_bytes,
    unreadable,
)
from titan.errors import ConfigError, import_extra
from titan.progress import Progress
from titan.schema import FILE_NAME, ListOf, Table, read_json


@dataclass
class Documents:
    """Where a source's records come from: local files of one format, read one file at a time (so errors and
    progress name the file), or a hub dataset."""

    cfg: Data | DataSource
    path: str  # cfg.source, with a `titan:` corpus resolved to its local file
    fmt: str  # text, json, parquet, arrow (a dataset saved by HF datasets), or hub until its files are listed
    files: list[Path]  # the local files in reading order; empty for a hub dataset
    hub_files: list[HubFile] = field(default_factory=list)  # a hub dataset's, once listed (hub_files.py)

    @property
    def files_to_read(self) -> list[Path | HubFile]:
        """The files read one at a time: the local ones, or a listed hub dataset's (none: a hub dataset streamed)."""
        return self.files or self.hub_files

    @functools.cached_property
    def text_bytes(self) -> list[int]:
        """About how many bytes of text each file holds (what units and auto-prepare's bound count)."""
        return [text_bytes(f) for f in self.files] or [f.size for f in self.hub_files]

    @property
    def file_bytes(self) -> list[int]:
        """Each file's own size, local or in the hub: what a preparation's progress counts."""
        return [f.stat().st_size for f in self.files] or [f.size for f in self.hub_files]


def _local_files(source: Path, fmt: str) -> tuple[str, list[Path]]:
    files = sorted(p for p in source.rglob("*") if p.is_file()) if source.is_dir() else [source]
    if fmt == "auto":
        formats = {format_of(p) for p in files} - {None}
        if len(formats) != 1:
            found = sorted(formats) or "no .txt/.jsonl/.json/.parquet files, plain or .gz/.bz2/.zst"
            raise ConfigError(
                f"data.source: cannot tell the format of {source} (found {found}); "
                "set data.format to text, json or parquet"
            )
        fmt = formats.pop()
    files = [p for p in files if format_of(p) == fmt] if source.is_dir() else [source]
    if not files:
        raise ConfigError(f"data.source: no {fmt} files in {source}")
    return fmt, files


# What titan reads of the state.json of a save_to_disk folder: the names of its .arrow files, each of the folder.
SAVED_STATE = Table(
    {"_data_files": ListOf(Table({"filename": FILE_NAME}, required=frozenset({"filename"})))},
    required=frozenset({"_data_files"}),
)


def _saved_dataset(source: Path, split: str) -> tuple[Path, list[Path]] | None:
    """A folder HF datasets' save_to_disk wrote: (the folder of its Dataset, or of the `split` of a DatasetDict,
    and that Dataset's .arrow files in order), else None."""
    try:
        if (source / "dataset_dict.json").is_file():  # a DatasetDict: a Dataset's folder per split
            splits = json.loads((source / "dataset_dict.json").read_text())["splits"]
            if split not in splits:
                raise ConfigError(
                    f"data.split: {source} holds the splits {', '.join(splits)}, not {split!r}; set data.split "
                    "to one of them"
                )
            source = source / split
        if not (source / "state.json").is_file():
            return None
        state = read_json(source / "state.json", SAVED_STATE)  # its files' names: plain names, in the folder
        return source, [source / file["filename"] for file in state["_data_files"]]
    except ConfigError:
        raise
    except (ValueError, KeyError, TypeError) as e:  # malformed JSON, or not the layout datasets writes
        raise ConfigError(f"data.source: {source} is not a folder datasets' save_to_disk wrote: {e!r}") from None


def open_documents(cfg: Data | DataSource) -> Documents:
    """The source's local files, checked, or its hub dataset (opened only when read: no network here)."""
    path = cfg.source
    if path.startswith("titan:"):
        from titan.data.corpora import resolve_source  # fetches the corpus on first use

        path = resolve_source(path)
    source = Path(path).expanduser()
    # A hub dataset's name is "name" or "owner/name": a trailing slash or a deeper path names a folder.
    looks_local = (
        source.exists()
        or path.startswith((".", "/", "~"))
        or path.endswith("/")
        or path.count("/") > 1
        or format_of(source) is not None
    )
    if cfg.format == "hub" or not looks_local:
        return Documents(cfg, path, "hub", [])
    if not source.exists():
        raise ConfigError(f"data.source: file or folder not found: {source}")
    # "arrow" is no format a recipe names: it is what a saved dataset's prepared tokens record (titan data ls).
    if cfg.format in ("auto", "arrow") and (saved := _saved_dataset(source, cfg.split)):
        source, files = saved
        return Documents(cfg, str(source), "arrow", files)
    fmt, files = _local_files(source, cfg.format)
    if all(f.stat().st_size == 0 for f in files):
        raise ConfigError(f"data.source: {cfg.source} has no documents (empty files)")
    return Documents(cfg, str(source), fmt, files)


def iter_texts(documents: Documents, file: Path | None = None) -> Iterator[str]:
    """The text of each record of `file` (one of documents.files), or of the whole source when None, in order."""
    for f in documents.files if file is None and documents.files else [file]:
        for text, _ in read_texts(documents, f):
            yield text


def read_texts(documents: Documents, file: Path | HubFile | None) -> Iterator[tuple[str, int | None]]:
    """Each text of `file` (a listed hub dataset's is fetched first; None: the hub dataset, streamed) with how far
    into the file's own bytes it was read: what its progress counts, as a compressed file's text says little of its
    size. None for the streamed hub dataset."""
    cfg = documents.cfg
    if file is None:
        yield from ((text, None) for text in _hub_texts(documents))
        return
    if isinstance(file, HubFile):
        with file.fetched() as local:
            yield from read_texts(documents, local)
        return
    read = TEXT_READERS[cfg.text_unit] if documents.fmt == "text" else LOCAL_READERS[documents.fmt]
    try:
        for text, at in read(file, cfg.text_field, str(file)):
            if documents.fmt == "text" and "\x00" in text:  # valid UTF-8 may hold NUL bytes; text does not
                raise ConfigError(unreadable(file, "text", "holds NUL bytes (binary data?)"))
            yield text, at
    except ConfigError:
        raise
    except EOFError as e:  # a compressed stream cut short: gzip's, bz2's and check_frames' own words
        raise ConfigError(f"data.source: {file} is damaged: {first_line(e)}; copy or compress it again") from None
    except Exception as e:  # UnicodeDecodeError, JSONDecodeError, pyarrow's errors: assorted types
        raise ConfigError(unreadable(file, documents.fmt, first_line(e))) from None


def _hub_texts(documents: Documents) -> Iterator[str]:
    """A hub dataset's texts, streamed with HF datasets (from the network, or its cache)."""
    cfg, where = documents.cfg, repr(documents.path)
    datasets = import_extra("datasets", "hub", f"data.source {documents.path!r} (a hub dataset)")
    datasets.disable_progress_bars()
    try:
        dataset = datasets.load_dataset(
            documents.path, cfg.subset or None, split=cfg.split, revision=cfg.revision or None, streaming=True
        )
        # HF's own bars are off (above): the records read show titan's, against the split's size if known.
        progress = Progress(f"{documents.path} ({cfg.split})", _split_records(dataset, cfg.split), " records")
        for number, record in enumerate(dataset, 1):
            progress.update()
            if cfg.text_field not in record:
                raise ConfigError(
                    f"data.text_field: records of {where} have no field {cfg.text_field!r}; fields: {', '.join(record)}"
                )
            yield field_text(record, cfg.text_field, number, where)
        progress.close()
    except ConfigError:
        raise
    except Exception as e:  # network and hub errors: assorted types
        raise ConfigError(
            f"data.source: could not open hub dataset {documents.path!r} (split {cfg.split!r}), nor is it a local "
            f"file or folder: {first_line(e)}. Without internet, use a local file or a dataset already in the HF cache"
        ) from None


def _split_records(dataset, split: str) -> int | None:
    """The split's number of records where the dataset's card declares it, else None (no total to show)."""
    splits = getattr(dataset.info, "splits", None) or {}
    return splits[split].num_examples if split in splits else None
