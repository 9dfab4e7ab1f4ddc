"""Documents from a local file or folder (read here), or a HF hub dataset (streamed with HF `datasets`)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from titan.config import Data, DataSource
from titan.errors import ConfigError, import_extra
from titan.progress import Progress

_FORMAT_BY_SUFFIX = {".txt": "text", ".text": "text", ".json": "json", ".jsonl": "json", ".parquet": "parquet"}


@dataclass
class Documents:
    """Where a source's records come from: local files of one format, read one file at a time (so errors and
    progress name the file), or a hub dataset."""

    cfg: Data | DataSource
    path: str  # cfg.source, with a `titan:` corpus resolved to its local file
    fmt: str  # text, json, parquet or hub
    files: list[Path]  # the local files in reading order; empty for a hub dataset

    @property
    def total_bytes(self) -> int:
        return sum(f.stat().st_size for f in self.files)


def _local_files(source: Path, fmt: str) -> tuple[str, list[Path]]:
    files = sorted(p for p in source.rglob("*") if p.is_file()) if source.is_dir() else [source]
    if fmt == "auto":
        formats = {_FORMAT_BY_SUFFIX.get(p.suffix) for p in files} - {None}
        if len(formats) != 1:
            found = sorted(formats) or "no .txt/.jsonl/.json/.parquet files"
            raise ConfigError(
                f"data.source: cannot tell the format of {source} (found {found}); "
                "set data.format to text, json or parquet"
            )
        fmt = formats.pop()
    files = [p for p in files if _FORMAT_BY_SUFFIX.get(p.suffix) == fmt] if source.is_dir() else [source]
    if not files:
        raise ConfigError(f"data.source: no {fmt} files in {source}")
    return fmt, files


def open_documents(cfg: Data | DataSource) -> Documents:
    """The source's local files, checked, or its hub dataset (opened only when read: no network here)."""
    path = cfg.source
    if path.startswith("titan:"):
        from titan.data.corpora import resolve_source  # fetches the corpus on first use

        path = resolve_source(path)
    source = Path(path).expanduser()
    looks_local = source.exists() or path.startswith((".", "/", "~")) or source.suffix in _FORMAT_BY_SUFFIX
    if cfg.format == "hub" or not looks_local:
        return Documents(cfg, path, "hub", [])
    if not source.exists():
        raise ConfigError(f"data.source: file or folder not found: {source}")
    fmt, files = _local_files(source, cfg.format)
    if all(f.stat().st_size == 0 for f in files):
        raise ConfigError(f"data.source: {cfg.source} has no documents (empty files)")
    return Documents(cfg, str(source), fmt, files)


def iter_texts(documents: Documents, file: Path | None = None) -> Iterator[str]:
    """The text of each record of `file` (one of documents.files), or of the whole source when None, in order."""
    if file is None and documents.files:
        for f in documents.files:
            yield from iter_texts(documents, f)
        return
    cfg = documents.cfg
    if file is None:
        yield from _hub_texts(documents)
        return
    try:
        for number, text in enumerate(_LOCAL_READERS[documents.fmt](file, cfg.text_field, str(file)), 1):
            if documents.fmt == "text" and "\x00" in text:  # valid UTF-8 may hold NUL bytes; text does not
                raise ConfigError(_unreadable(file, "text", f"line {number} holds NUL bytes (binary data?)"))
            yield text
    except ConfigError:
        raise
    except Exception as e:  # UnicodeDecodeError, JSONDecodeError, pyarrow's errors: assorted types
        raise ConfigError(_unreadable(file, documents.fmt, _first_line(e))) from None


# Local files are read here rather than through HF datasets, which a cluster image may lack: one record per line
# of a text file (newline dropped, as datasets' text loader does), one JSON object per line or one JSON array of
# them, and a parquet column through pyarrow.


def _text_lines(file: Path, field: str, where: str) -> Iterator[str]:
    with open(file, encoding="utf-8") as f:  # universal newlines: \r\n and \r end a line too
        for line in f:
            yield line.removesuffix("\n")


def _json_records(file: Path, field: str, where: str) -> Iterator[str]:
    with open(file, encoding="utf-8-sig") as f:
        array = f.read(4096).lstrip().startswith("[")  # one JSON array of records, else one record per line
        f.seek(0)
        if array:
            records = enumerate(json.load(f), 1)
        else:
            records = ((number, json.loads(line)) for number, line in enumerate(f, 1) if line.strip())
        for number, (position, record) in enumerate(records, 1):
            if not isinstance(record, dict):
                raise ValueError(f"{'record' if array else 'line'} {position} is not a JSON object")
            yield _field_text(record, field, number, where)


def _parquet_records(file: Path, field: str, where: str) -> Iterator[str]:
    parquet = import_extra("pyarrow.parquet", "hub", f"reading {file.name} (parquet)")
    table = parquet.ParquetFile(file)
    if field not in table.schema_arrow.names:
        raise ConfigError(
            f"data.text_field: records of {where} have no field {field!r}; "
            f"fields: {', '.join(table.schema_arrow.names)}"
        )
    number = 0
    for batch in table.iter_batches(columns=[field]):
        for text in batch.column(0).to_pylist():
            number += 1
            yield _field_text({field: text}, field, number, where)


_LOCAL_READERS = {"text": _text_lines, "json": _json_records, "parquet": _parquet_records}


def _field_text(record: dict, field: str, number: int, where: str) -> str:
    if field not in record:
        raise ConfigError(
            f"data.text_field: record {number} of {where} has no field {field!r}; its fields: {', '.join(record)}"
        )
    text = record[field]
    if text is None:
        raise ConfigError(f"data.text_field: record {number} of {where} has no {field!r} (or null)")
    if not isinstance(text, str):
        raise ConfigError(
            f"data.text_field: record {number} of {where}: {field!r} holds {type(text).__name__}, not text"
        )
    return text


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
            yield _field_text(record, cfg.text_field, number, where)
        progress.close()
    except ConfigError:
        raise
    except Exception as e:  # network and hub errors: assorted types
        raise ConfigError(
            f"data.source: could not open hub dataset {documents.path!r} (split {cfg.split!r}): {_first_line(e)}. "
            "Without internet, use a local file or a dataset already in the HF cache"
        ) from None


def _split_records(dataset, split: str) -> int | None:
    """The split's number of records where the dataset's card declares it, else None (no total to show)."""
    splits = getattr(dataset.info, "splits", None) or {}
    return splits[split].num_examples if split in splits else None


def _unreadable(file: Path, fmt: str, error: str) -> str:
    """The message for a local file the reader failed on: binary data, or the first malformed JSON line."""
    if fmt in ("text", "json") and (binary := _binary_line(file)):
        return f"data.source: {file} is not a text file: {binary}; remove it from the source"
    if fmt == "json" and (bad := _bad_json_line(file)):
        return f"data.source: {file}: {bad}; fix or remove that line"
    return f"data.source: could not read {file} as {fmt}: {error}"


def _binary_line(file: Path) -> str | None:
    """Where a file first holds a NUL byte or invalid UTF-8, e.g. 'line 3 holds NUL bytes (binary data?)'."""
    with open(file, "rb") as f:
        for number, line in enumerate(f, 1):
            if b"\x00" in line:
                return f"line {number} holds NUL bytes (binary data?)"
            try:
                line.decode("utf-8")
            except UnicodeDecodeError:
                return f"line {number} is not UTF-8 text (binary data?)"
    return None


def _bad_json_line(file: Path) -> str | None:
    """The first line of a JSON file that is not a JSON object, e.g. 'line 3 is not valid JSON (...)'.

    A parse error names a column of the line it was given; on one, the file is read again for the line number.
    """
    with open(file, encoding="utf-8-sig") as f:
        if f.read(4096).lstrip().startswith("["):  # one JSON array: parse it whole
            f.seek(0)
            try:
                json.load(f)
            except json.JSONDecodeError as e:
                return f"line {e.lineno} is not valid JSON ({e.msg}, column {e.colno})"
            return None
        f.seek(0)
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                return f"line {number} is not valid JSON ({e.msg}, column {e.colno})"
            if not isinstance(record, dict):
                return f"line {number} is not a JSON object (one {{...}} record per line)"
    return None


def _first_line(error: Exception) -> str:
    return str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
