"""Local files' texts, read here rather than through HF datasets, which a cluster image may lack: a text file whole,
by paragraph or by line (newline dropped, as datasets' text loader does), one JSON object per line or one JSON array
of them, a parquet column through pyarrow, a dataset save_to_disk wrote. Text and JSON files may be compressed: they
are read as streams, and a document is bounded as it is read."""

from __future__ import annotations

import bz2
import gzip
import io
import itertools
import json
from collections.abc import Iterator
from pathlib import Path

from titan.data.zstd_frames import check_frames
from titan.errors import ConfigError, import_extra

COMPRESSED = (".gz", ".bz2", ".zst")  # text and JSON files read as streams ("a.txt.gz", "web.jsonl.zst")
# A document is tokenized whole, and the tokenizer holds hundreds of bytes per token while it works (2.7 GB for
# 16M characters): a longer one (a .txt file read whole, or a paragraph) is refused rather than read.
MAX_DOCUMENT_CHARS = 32 * 2**20
# A compressed file's text read to tell how much it holds: at least TEXT_SAMPLE_BYTES from at least
# TEXT_SAMPLE_FILE_BYTES of the file, at most TEXT_SAMPLE_MAX_BYTES.
TEXT_SAMPLE_BYTES, TEXT_SAMPLE_FILE_BYTES, TEXT_SAMPLE_MAX_BYTES = 1 << 22, 1 << 16, 1 << 28


FORMAT_BY_SUFFIX = {".txt": "text", ".text": "text", ".json": "json", ".jsonl": "json", ".parquet": "parquet"}


def format_of(file: Path) -> str | None:
    """The format a file's name says: text for "a.txt" and "a.txt.gz", json for "web.jsonl.zst", else None."""
    if file.suffix in COMPRESSED:
        fmt = FORMAT_BY_SUFFIX.get(Path(file.stem).suffix)
        return fmt if fmt in ("text", "json") else None  # parquet compresses inside; a compressed one is not read
    return FORMAT_BY_SUFFIX.get(file.suffix)


def text_bytes(file: Path) -> int:
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
            yield field_text(record, field, number, where), f.at()


def _by_rows(file: Path, texts: Iterator, rows: int, field: str, where: str) -> Iterator[tuple[str, int]]:
    """A table's texts, each with its share of the file's bytes by rows read: its columns are compressed inside."""
    size = file.stat().st_size
    for number, text in enumerate(texts, 1):
        yield field_text({field: text}, field, number, where), size * number // max(rows, 1)


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


TEXT_READERS = {"file": _text_file, "paragraph": _text_paragraphs, "line": _text_lines}
LOCAL_READERS = {"json": _json_records, "parquet": _parquet_records, "arrow": _arrow_records}


def field_text(record: dict, field: str, number: int, where: str) -> str:
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


def unreadable(file: Path, fmt: str, error: str) -> str:
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


def first_line(error: Exception) -> str:
    return str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
