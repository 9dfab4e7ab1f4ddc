"""Documents from a local file or folder (read here), or a HF hub dataset (streamed with HF `datasets`)."""

from __future__ import annotations

import bz2
import functools
import gzip
import io
import itertools
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from titan.config import Data, DataSource
from titan.data.zstd_frames import check_frames
from titan.errors import ConfigError, import_extra
from titan.progress import Progress
from titan.schema import FILE_NAME, ListOf, Table, read_json

_FORMAT_BY_SUFFIX = {".txt": "text", ".text": "text", ".json": "json", ".jsonl": "json", ".parquet": "parquet"}
COMPRESSED = (".gz", ".bz2", ".zst")  # text and JSON files read as streams ("a.txt.gz", "web.jsonl.zst")
# A document is tokenized whole, and the tokenizer holds hundreds of bytes per token while it works (2.7 GB for
# 16M characters): a longer one (a .txt file read whole, or a paragraph) is refused rather than read.
MAX_DOCUMENT_CHARS = 32 * 2**20
# A compressed file's text read to tell how much it holds: at least TEXT_SAMPLE_BYTES from at least
# TEXT_SAMPLE_FILE_BYTES of the file, at most TEXT_SAMPLE_MAX_BYTES.
TEXT_SAMPLE_BYTES, TEXT_SAMPLE_FILE_BYTES, TEXT_SAMPLE_MAX_BYTES = 1 << 22, 1 << 16, 1 << 28


@dataclass
class Documents:
    """Where a source's records come from: local files of one format, read one file at a time (so errors and
    progress name the file), or a hub dataset."""

    cfg: Data | DataSource
    path: str  # cfg.source, with a `titan:` corpus resolved to its local file
    fmt: str  # text, json, parquet, arrow (a dataset saved by HF datasets) or hub
    files: list[Path]  # the local files in reading order; empty for a hub dataset

    @functools.cached_property
    def text_bytes(self) -> list[int]:
        """About how many bytes of text each file holds (what units and auto-prepare's bound count)."""
        return [_text_bytes(f) for f in self.files]


def _format_of(file: Path) -> str | None:
    """The format a file's name says: text for "a.txt" and "a.txt.gz", json for "web.jsonl.zst", else None."""
    if file.suffix in COMPRESSED:
        fmt = _FORMAT_BY_SUFFIX.get(Path(file.stem).suffix)
        return fmt if fmt in ("text", "json") else None  # parquet compresses inside; a compressed one is not read
    return _FORMAT_BY_SUFFIX.get(file.suffix)


def _local_files(source: Path, fmt: str) -> tuple[str, list[Path]]:
    files = sorted(p for p in source.rglob("*") if p.is_file()) if source.is_dir() else [source]
    if fmt == "auto":
        formats = {_format_of(p) for p in files} - {None}
        if len(formats) != 1:
            found = sorted(formats) or "no .txt/.jsonl/.json/.parquet files, plain or .gz/.bz2/.zst"
            raise ConfigError(
                f"data.source: cannot tell the format of {source} (found {found}); "
                "set data.format to text, json or parquet"
            )
        fmt = formats.pop()
    files = [p for p in files if _format_of(p) == fmt] if source.is_dir() else [source]
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
        or _format_of(source) is not None
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


def read_texts(documents: Documents, file: Path | None) -> Iterator[tuple[str, int | None]]:
    """Each text of `file` (None: the hub dataset) with how far into the file's own bytes it was read: what its
    progress counts, as a compressed file's text says little of its size. None for the hub dataset."""
    cfg = documents.cfg
    if file is None:
        yield from ((text, None) for text in _hub_texts(documents))
        return
    read = _TEXT_READERS[cfg.text_unit] if documents.fmt == "text" else _LOCAL_READERS[documents.fmt]
    try:
        for text, at in read(file, cfg.text_field, str(file)):
            if documents.fmt == "text" and "\x00" in text:  # valid UTF-8 may hold NUL bytes; text does not
                raise ConfigError(_unreadable(file, "text", "holds NUL bytes (binary data?)"))
            yield text, at
    except ConfigError:
        raise
    except EOFError as e:  # a compressed stream cut short: gzip's, bz2's and check_frames' own words
        raise ConfigError(f"data.source: {file} is damaged: {_first_line(e)}; copy or compress it again") from None
    except Exception as e:  # UnicodeDecodeError, JSONDecodeError, pyarrow's errors: assorted types
        raise ConfigError(_unreadable(file, documents.fmt, _first_line(e))) from None


# Local files are read here rather than through HF datasets, which a cluster image may lack: a text file whole,
# by paragraph or by line (newline dropped, as datasets' text loader does), one JSON object per line or one JSON
# array of them, a parquet column through pyarrow. Text and JSON files may be compressed: they are read as streams.


def _text_bytes(file: Path) -> int:
    """A file's size or, compressed, about how much text it holds: its size times the ratio of a sample of its
    text (exact for a file read to its end). A file it cannot read counts its size: reading it says what is
    wrong."""
    size = file.stat().st_size
    if file.suffix not in COMPRESSED:
        return size
    try:
        with _Opened(file) as f:
            text = 0
            # A decompressor reads the file ahead, by 8 KB and by up to a block (bz2's: 900 KB of text): a sample of
            # a few blocks and many reads, short of the file's end (a file read ahead whole says no ratio).
            while text < TEXT_SAMPLE_MAX_BYTES and not (
                text >= TEXT_SAMPLE_BYTES and TEXT_SAMPLE_FILE_BYTES <= f.at() < size
            ):
                piece = len(f.stream.read(1 << 18))
                if not piece:
                    return text
                text += piece
            return text * size // max(f.at(), 1)
    except Exception:  # damaged, or zstandard missing
        return size


class _Opened:
    """A local file opened for reading, as bytes or (given an encoding) as text, however it is compressed; `at()`:
    how far into the file itself reading has got."""

    def __init__(self, file: Path, encoding: str | None = None):
        self.raw = open(file, "rb")
        try:
            stream = _decompressed(file, self.raw)
            # Universal newlines: \r\n and \r end a line.
            self.stream = io.TextIOWrapper(stream, encoding=encoding) if encoding else stream
        except BaseException:
            self.raw.close()
            raise

    def at(self) -> int:
        return self.raw.tell()

    def __enter__(self) -> _Opened:
        return self

    def __exit__(self, *exc) -> None:
        try:
            self.stream.close()  # gzip's and bz2's readers leave the file they were given open
        finally:
            self.raw.close()


def _decompressed(file: Path, raw: io.BufferedReader) -> io.BufferedIOBase:
    if file.suffix == ".gz":
        return gzip.GzipFile(fileobj=raw)
    if file.suffix == ".bz2":
        return bz2.BZ2File(raw)
    if file.suffix == ".zst":
        zstandard = import_extra("zstandard", "zstd", f"reading {file} (zstd)")
        check_frames(file)
        # Across frames: a file of concatenated frames is one stream. Long-window files (zstd --long) read too.
        reader = zstandard.ZstdDecompressor(max_window_size=2**31).stream_reader(
            raw, read_across_frames=True, closefd=False
        )
        return io.BufferedReader(reader)  # its own reader reads no lines
    return raw


# Each reader yields (text, the bytes of the file read through it).


def _text_file(file: Path, field: str, where: str) -> Iterator[tuple[str, int]]:
    with _Opened(file, "utf-8") as f:
        text = f.stream.read(MAX_DOCUMENT_CHARS + 1)
        at = f.at()
    if len(text) > MAX_DOCUMENT_CHARS:
        raise ConfigError(
            f"data.text_unit: {where} is one document of over {MAX_DOCUMENT_CHARS:,} characters, more than titan "
            "tokenizes at once; set data.text_unit = 'paragraph' or 'line' to split it, or split the file"
        )
    yield text, at


def _lines(f: io.TextIOWrapper, where: str) -> Iterator[tuple[int, str]]:
    """Each line of `f` with its number, its newline kept: read at most MAX_DOCUMENT_CHARS at a time, and refused in
    one line when longer (a 40M-character line of a 81 KB .gz took 7.5 GB to read whole)."""
    for number in itertools.count(1):
        line = f.readline(MAX_DOCUMENT_CHARS + 1)
        if not line:
            return
        if len(line) > MAX_DOCUMENT_CHARS and not line.endswith("\n"):
            raise ConfigError(
                f"data.source: line {number} of {where} runs over {MAX_DOCUMENT_CHARS:,} characters, more than "
                "titan tokenizes at once as one document; split it"
            )
        yield number, line


def _text_paragraphs(file: Path, field: str, where: str) -> Iterator[tuple[str, int]]:
    with _Opened(file, "utf-8") as f:
        lines, chars = [], 0
        for number, line in _lines(f.stream, where):
            if line.strip():
                lines.append(line)
                chars += len(line)
                if chars > MAX_DOCUMENT_CHARS:
                    raise ConfigError(
                        f"data.text_unit: the paragraph at line {number - len(lines) + 1} of {where} runs over "
                        f"{MAX_DOCUMENT_CHARS:,} characters, more than titan tokenizes at once; set "
                        "data.text_unit = 'line', or add blank lines between its paragraphs"
                    )
            elif lines:  # a blank line (or one of spaces) ends a paragraph
                yield "".join(lines).removesuffix("\n"), f.at()
                lines, chars = [], 0
        if lines:
            yield "".join(lines).removesuffix("\n"), f.at()


def _text_lines(file: Path, field: str, where: str) -> Iterator[tuple[str, int]]:
    with _Opened(file, "utf-8") as f:
        for _, line in _lines(f.stream, where):
            yield line.removesuffix("\n"), f.at()


def _json_array(file: Path) -> bool:
    """Whether a JSON file holds one array of records, rather than one record per line."""
    with _Opened(file, "utf-8-sig") as f:
        return f.stream.read(4096).lstrip().startswith("[")


def _json_records(file: Path, field: str, where: str) -> Iterator[tuple[str, int]]:
    array = _json_array(file)
    with _Opened(file, "utf-8-sig") as f:
        if array:  # read whole: a document's bound holds for the file
            text = f.stream.read(MAX_DOCUMENT_CHARS + 1)
            if len(text) > MAX_DOCUMENT_CHARS:
                raise ConfigError(
                    f"data.source: {where} is one JSON array of over {MAX_DOCUMENT_CHARS:,} characters, which titan "
                    "would read whole; write one record per line (JSON lines: jq -c '.[]' in.json > out.jsonl)"
                )
            records = enumerate(json.loads(text), 1)
        else:
            records = ((number, json.loads(line)) for number, line in _lines(f.stream, where) if line.strip())
        for number, (position, record) in enumerate(records, 1):
            if not isinstance(record, dict):
                raise ValueError(f"{'record' if array else 'line'} {position} is not a JSON object")
            yield _field_text(record, field, number, where), f.at()


def _by_rows(file: Path, texts: Iterator, rows: int, field: str, where: str) -> Iterator[tuple[str, int]]:
    """A table's texts, each with its share of the file's bytes by rows read: its columns are compressed inside."""
    size = file.stat().st_size
    for number, text in enumerate(texts, 1):
        yield _field_text({field: text}, field, number, where), size * number // max(rows, 1)


def _parquet_records(file: Path, field: str, where: str) -> Iterator[tuple[str, int]]:
    parquet = import_extra("pyarrow.parquet", "hub", f"reading {file.name} (parquet)")
    table = parquet.ParquetFile(file)
    _check_column(table.schema_arrow.names, field, where)
    texts = (text for batch in table.iter_batches(columns=[field]) for text in batch.column(0).to_pylist())
    yield from _by_rows(file, texts, table.metadata.num_rows, field, where)


def _arrow_records(file: Path, field: str, where: str) -> Iterator[tuple[str, int]]:
    """One .arrow file of a dataset HF datasets saved (save_to_disk), memory-mapped: read by file, as the other
    formats are, so that a preparation's units, progress and errors name the file."""
    datasets = import_extra("datasets", "hub", f"reading {file} (a dataset saved by datasets' save_to_disk)")
    dataset = datasets.Dataset.from_file(str(file))
    _check_column(dataset.column_names, field, where)
    texts = (text for batch in dataset.select_columns([field]).iter(batch_size=1024) for text in batch[field])
    yield from _by_rows(file, texts, dataset.num_rows, field, where)


def _check_column(columns: list[str], field: str, where: str) -> None:
    if field not in columns:
        raise ConfigError(f"data.text_field: records of {where} have no field {field!r}; fields: {', '.join(columns)}")


_TEXT_READERS = {"file": _text_file, "paragraph": _text_paragraphs, "line": _text_lines}
_LOCAL_READERS = {"json": _json_records, "parquet": _parquet_records, "arrow": _arrow_records}


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
            f"data.source: could not open hub dataset {documents.path!r} (split {cfg.split!r}), nor is it a local "
            f"file or folder: {_first_line(e)}. Without internet, use a local file or a dataset already in the HF cache"
        ) from None


def _split_records(dataset, split: str) -> int | None:
    """The split's number of records where the dataset's card declares it, else None (no total to show)."""
    splits = getattr(dataset.info, "splits", None) or {}
    return splits[split].num_examples if split in splits else None


def _unreadable(file: Path, fmt: str, error: str) -> str:
    """The message for a local file the reader failed on: binary data, or the first malformed JSON line."""
    try:
        if fmt in ("text", "json") and (binary := _binary_line(file)):
            return f"data.source: {file} is not a text file: {binary}; remove it from the source"
        if fmt == "json" and (bad := _bad_json_line(file)):
            return f"data.source: {file}: {bad}; fix or remove that line"
    except Exception:  # a damaged compressed file fails here as it did in the reader: the reader's error says it
        pass
    return f"data.source: could not read {file} as {fmt}: {error}"


def _binary_line(file: Path) -> str | None:
    """Where a file first holds a NUL byte or invalid UTF-8, e.g. 'line 3 holds NUL bytes (binary data?)'."""
    with _Opened(file) as f:
        for number, line in enumerate(f.stream, 1):
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
    array = _json_array(file)
    with _Opened(file, "utf-8-sig") as f:
        if array:  # one JSON array: parse it whole
            try:
                json.load(f.stream)
            except json.JSONDecodeError as e:
                return f"line {e.lineno} is not valid JSON ({e.msg}, column {e.colno})"
            return None
        for number, line in enumerate(f.stream, 1):
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
