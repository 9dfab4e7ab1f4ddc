"""Local sources as users have them: .txt read by file, paragraph or line, compressed text and JSON lines, folders
of parquet files, and datasets saved with HF datasets' save_to_disk."""

import bz2
import collections
import gzip
import json
import sys
from pathlib import Path

import pytest

from conftest import DEBUG_RECIPE, ROOT, run_titan
from titan.config import DataSource
from titan.config import Tokenizer as TokenizerConfig
from titan.data import local_files
from titan.data.prepared import PreparedDocuments, cached_sources, prepare
from titan.data.tokenizer import Tokenizer
from titan.errors import ConfigError

TOKENIZER = TokenizerConfig(path=str(ROOT / "data" / "tokenizer.json"))
# Three small books: a title, paragraphs of one or more lines, blank lines (one holds spaces) between them.
BOOKS = {
    "a.txt": "THE CAT\n\nThe cat sat on the mat.\nIt looked at the sun.\n\nThe end.\n",
    "b.txt": "THE DOG\n\n\nThe dog ran.\n   \nIt ran far away,\nand home again.\n",
    "c.txt": "A POEM\n\nRoses are red.\n",
}
TEXTS = [f"Story {i}: " + "the cat sat on the mat and looked at the sun. " * (i % 5) for i in range(20)]


def write_books(folder: Path, compress=None, suffix: str = "") -> Path:
    folder.mkdir()
    for name, text in BOOKS.items():
        data = text.encode()
        (folder / (name + suffix)).write_bytes(compress(data) if compress else data)
    return folder


def texts_of(path: Path) -> list[list[int]]:
    """The tokens of each document of a prepared folder."""
    documents = PreparedDocuments(path)
    return [documents.tokens(i).tolist() for i in range(documents.n_documents)]


def encoded(texts: list[str]) -> list[list[int]]:
    tokenizer = Tokenizer(TOKENIZER)
    return [tokenizer.encode(t) for t in texts]


def write_jsonl(path: Path, texts: list[str]) -> Path:
    path.write_text("".join(json.dumps({"text": t, "id": i}) + "\n" for i, t in enumerate(texts)))
    return path


def test_a_txt_file_is_one_document_by_default_or_one_per_paragraph_or_line(tmp_path):
    books = write_books(tmp_path / "books")
    cache = tmp_path / "cache"
    by_file = prepare(DataSource(str(books)), TOKENIZER, cache, 1, False)
    assert texts_of(by_file) == encoded(list(BOOKS.values()))
    paragraphs = [
        "THE CAT", "The cat sat on the mat.\nIt looked at the sun.", "The end.",
        "THE DOG", "The dog ran.", "It ran far away,\nand home again.",
        "A POEM", "Roses are red.",
    ]  # fmt: skip
    by_paragraph = prepare(DataSource(str(books), text_unit="paragraph"), TOKENIZER, cache, 1, False)
    assert texts_of(by_paragraph) == encoded(paragraphs)
    lines = [line for text in BOOKS.values() for line in text.splitlines() if line.strip()]
    by_line = prepare(DataSource(str(books), text_unit="line"), TOKENIZER, cache, 1, False)
    assert texts_of(by_line) == encoded(lines)
    # The unit is part of the prepared tokens' key: each unit has its own folder.
    assert len({by_file, by_paragraph, by_line}) == 3


COMPRESSIONS = {
    "gz": gzip.compress,
    "bz2": bz2.compress,
    "zst": lambda data: __import__("zstandard").ZstdCompressor().compress(data),
}


@pytest.mark.parametrize("suffix", COMPRESSIONS)
def test_compressed_text_and_json_lines_give_the_documents_of_the_plain_files(tmp_path, suffix):
    compress, cache = COMPRESSIONS[suffix], tmp_path / "cache"
    plain_books = write_books(tmp_path / "plain")
    packed_books = write_books(tmp_path / "packed", compress, f".{suffix}")
    for unit in ("file", "paragraph", "line"):
        plain = prepare(DataSource(str(plain_books), text_unit=unit), TOKENIZER, cache, 1, False)
        packed = prepare(DataSource(str(packed_books), text_unit=unit), TOKENIZER, cache, 1, False)
        assert texts_of(packed) == texts_of(plain), unit
    jsonl = write_jsonl(tmp_path / "web.jsonl", TEXTS)
    packed_jsonl = tmp_path / f"web.jsonl.{suffix}"
    packed_jsonl.write_bytes(compress(jsonl.read_bytes()))
    assert texts_of(prepare(DataSource(str(packed_jsonl)), TOKENIZER, cache, 1, False)) == encoded(TEXTS)


@pytest.mark.parametrize("kept", [0.6, 0.99])
@pytest.mark.parametrize("suffix", COMPRESSIONS)
def test_a_compressed_file_cut_short_is_refused_in_one_line(tmp_path, suffix, kept):
    """Cut to 60% or 99% of its bytes, a compressed text or JSON-lines file is damaged, whichever the compression:
    refused in one line, never read as shorter text (zstandard's reader ends quietly inside a frame) nor as a
    malformed JSON line."""
    data = (ROOT / "data" / "stories.jsonl").read_bytes()
    for name in (f"book.txt.{suffix}", f"web.jsonl.{suffix}"):
        whole = COMPRESSIONS[suffix](data)
        source = tmp_path / name
        source.write_bytes(whole[: int(len(whole) * kept)])
        with pytest.raises(ConfigError) as error:
            prepare(DataSource(str(source)), TOKENIZER, tmp_path / "cache", 1, False)
        message = str(error.value)
        assert "\n" not in message and name in message, message
        assert f"{source} is damaged: " in message and "not valid JSON" not in message, message


def test_zstd_without_zstandard_is_one_line_naming_the_extra(tmp_path, monkeypatch):
    source = tmp_path / "web.jsonl.zst"
    source.write_bytes(b"(\xb5/\xfd")
    monkeypatch.setitem(sys.modules, "zstandard", None)  # as if not installed: importing it fails
    with pytest.raises(ConfigError) as error:
        prepare(DataSource(str(source)), TOKENIZER, tmp_path / "cache", 1, False)
    message = str(error.value)
    assert "\n" not in message and "web.jsonl.zst" in message and "titan-pretrain[zstd]" in message


def test_a_folder_of_parquet_files_gives_the_documents_of_its_files_in_order(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    (tmp_path / "corpus").mkdir()
    for i, part in enumerate((TEXTS[:7], TEXTS[7:])):
        pq.write_table(pa.table({"text": part}), tmp_path / "corpus" / f"part-{i}.parquet")
    assert texts_of(prepare(DataSource(str(tmp_path / "corpus")), TOKENIZER, tmp_path / "cache", 1, False)) == (
        encoded(TEXTS)
    )


def test_a_dataset_saved_by_save_to_disk_gives_the_documents_of_its_jsonl(tmp_path):
    datasets = pytest.importorskip("datasets")
    datasets.disable_progress_bars()
    jsonl = write_jsonl(tmp_path / "corpus.jsonl", TEXTS)
    saved = datasets.Dataset.from_json(str(jsonl), cache_dir=str(tmp_path / "hf"))
    saved.save_to_disk(str(tmp_path / "saved"), num_shards=3)
    cache = tmp_path / "cache"
    expected = texts_of(prepare(DataSource(str(jsonl)), TOKENIZER, cache, 1, False))
    assert texts_of(prepare(DataSource(str(tmp_path / "saved")), TOKENIZER, cache, 1, False)) == expected
    # A DatasetDict holds a folder per split: data.split picks one.
    splits = datasets.DatasetDict(train=saved, validation=saved.select(range(5)))
    splits.save_to_disk(str(tmp_path / "splits"))
    train = prepare(DataSource(str(tmp_path / "splits")), TOKENIZER, cache, 1, False)
    assert texts_of(train) == expected
    held = prepare(DataSource(str(tmp_path / "splits"), split="validation"), TOKENIZER, cache, 1, False)
    assert texts_of(held) == expected[:5]
    # titan data ls finds each prepared source (the jsonl, the saved dataset, its two splits) matches its files.
    assert [source.state for source in cached_sources(cache)] == ["current"] * 4
    with pytest.raises(ConfigError, match=r"^data.split: .*splits holds the splits train, validation, not 'test'"):
        prepare(DataSource(str(tmp_path / "splits"), split="test"), TOKENIZER, cache, 1, False)
    with pytest.raises(ConfigError, match=r"^data.text_field: records of .*00003.arrow have no field 'body'"):
        prepare(DataSource(str(tmp_path / "saved"), text_field="body"), TOKENIZER, cache, 1, False)


@pytest.mark.parametrize("unit", ["file", "paragraph"])
def test_a_document_too_long_to_tokenize_at_once_is_one_line(tmp_path, monkeypatch, unit):
    monkeypatch.setattr(local_files, "MAX_DOCUMENT_CHARS", 30)
    books = write_books(tmp_path / "books")
    with pytest.raises(ConfigError) as error:
        prepare(DataSource(str(books), text_unit=unit), TOKENIZER, tmp_path / "cache", 1, False)
    message = str(error.value)
    assert "\n" not in message and "a.txt" in message and "30 characters" in message, message
    assert ("'paragraph' or 'line'" if unit == "file" else "'line'") in message, message


def test_the_cli_prepares_a_folder_of_gzipped_books(tmp_path):
    books = write_books(tmp_path / "books", gzip.compress, ".gz")
    (books / "more").mkdir()
    (books / "more" / "d.txt.gz").write_bytes(gzip.compress(b"ANOTHER BOOK\n\nIts one paragraph.\n"))
    result = run_titan(
        "data", "prepare", "--config", str(DEBUG_RECIPE), "--tokenizer.path", TOKENIZER.path,
        "--data.source", str(books), "--data.cache_dir", str(tmp_path / "cache"), "--workers", "1",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith(f"{books}: {tmp_path / 'cache'}/books-") and "4 documents" in result.stdout


@pytest.mark.parametrize("suffix, unit", [(".txt", "line"), (".jsonl", "file")])
def test_a_line_is_read_up_to_the_document_bound_and_refused_past_it(tmp_path, monkeypatch, suffix, unit):
    """A line is read at most MAX_DOCUMENT_CHARS characters at a time: one of exactly that many (newline aside)
    trains, one more character is refused in one line naming it, as text or as a JSON-lines record."""
    from titan.data import local_files
    from titan.data.dataset import iter_texts, open_documents

    monkeypatch.setattr(local_files, "MAX_DOCUMENT_CHARS", 100)
    first, line = (
        ("first\n", "a" * 100) if suffix == ".txt" else ('{"text": "first"}\n', json.dumps({"text": "a" * 88}))
    )
    assert len(line) == 100
    fits, over = tmp_path / f"fits{suffix}.gz", tmp_path / f"over{suffix}.gz"
    fits.write_bytes(gzip.compress(f"{first}{line}\n".encode()))
    over.write_bytes(gzip.compress(f"{first}{line}b\n".encode()))
    source = lambda path: open_documents(DataSource(str(path), text_unit=unit))  # noqa: E731
    last = list(iter_texts(source(fits)))[-1]
    assert last == {"line": line, "file": "a" * 88}[unit]
    with pytest.raises(ConfigError, match=rf"line 2 of {over} runs over 100 characters"):
        list(iter_texts(source(over)))


@pytest.mark.parametrize(
    "name, unit",
    [("book.txt.gz", "line"), ("book.txt.bz2", "paragraph"), ("book.txt.zst", "line"), ("web.jsonl.gz", "line"),
     ("web.parquet", "line")],
)  # fmt: skip
def test_a_compressed_files_progress_follows_its_text_and_ends_at_its_size(tmp_path, monkeypatch, name, unit):
    """A preparation's progress counts the file's own bytes as its text is read, so a compressed file (a .gz of
    3x, a parquet file's compressed columns) reaches 100% at its end, not a third of the way in."""
    import random

    import pyarrow as pa
    import pyarrow.parquet as pq

    from titan.data.dataset import open_documents
    from titan.data.prepared import encode

    words = [f"w{i}" for i in range(2000)]
    rng = random.Random(0)
    texts = [" ".join(rng.choices(words, k=rng.randint(5, 60))) for _ in range(30_000)]  # about 4 MB
    source = tmp_path / name
    if name.endswith(".parquet"):
        pq.write_table(pa.table({"text": texts}), source, row_group_size=1000)
    else:
        records = "".join(json.dumps({"text": t}) + "\n" for t in texts) if ".jsonl" in name else "\n\n".join(texts)
        level = {"bz2": lambda data: bz2.compress(data, 1)}  # 100 KB blocks: bz2 reads a block before any text
        source.write_bytes(level.get(name.rsplit(".", 1)[1], COMPRESSIONS[name.rsplit(".", 1)[1]])(records.encode()))
    monkeypatch.setattr(encode, "_CHUNK_CHARS", 1 << 14)
    documents = open_documents(DataSource(str(source), text_unit=unit))
    total_chars, size = sum(map(len, texts)), source.stat().st_size
    assert size < 0.7 * total_chars  # compressed: its text says little of its size
    chars = progress = 0
    for chunk, read in encode._text_chunks(documents, documents.files, collections.Counter()):
        chars, progress = chars + sum(map(len, chunk)), progress + read
        assert abs(progress / size - chars / total_chars) < 0.1, (progress / size, chars / total_chars)
    assert (chars, progress) == (total_chars, size)


def test_a_tokenizer_without_bos_frames_documents_with_eos_alone(tmp_path):
    """tokenizer.bos_token = "" (Qwen's tokenizers have no BOS): every prepared document is its text then EOS, as
    Tokenizer.encode frames it, and the prepared folder is another than the BOS-framed one."""
    source = write_jsonl(tmp_path / "web.jsonl", TEXTS)
    no_bos = TokenizerConfig(path=TOKENIZER.path, bos_token="")
    tokenizer = Tokenizer(no_bos)
    cache = tmp_path / "cache"
    path = prepare(DataSource(str(source)), no_bos, cache, 1, False)
    assert texts_of(path) == [tokenizer.encode(t) for t in TEXTS]
    assert all(doc[0] != Tokenizer(TOKENIZER).bos_id and doc[-1] == tokenizer.eos_id for doc in texts_of(path))
    assert path != prepare(DataSource(str(source)), TOKENIZER, cache, 1, False)
