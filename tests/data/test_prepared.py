"""Prepared sources (titan/data/prepared/): the token shards read back exactly, their folder's name tracks the
source and the tokenizer, preparation survives interruption and concurrency, and bad sources give one-line errors."""

import json
import multiprocessing
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from conftest import DEBUG_RECIPE, ROOT, run_titan, run_titan_many
from helpers import assert_one_line_error
from titan.cli import app
from titan.config import DataSource
from titan.config import Tokenizer as TokenizerConfig
from titan.data import prepared
from titan.data.prepared import PreparedDocuments, Sizes, ensure_prepared, prepare
from titan.data.prepared.cache import _target
from titan.data.tokenizer import Tokenizer
from titan.errors import ConfigError, UserError

TOKENIZER = TokenizerConfig(path=str(ROOT / "data" / "tokenizer.json"))
TEXTS = [f"Story {i}: " + "the cat sat on the mat and looked at the sun. " * (i % 5) for i in range(40)]


def write_jsonl(path: Path, texts: list[str]) -> Path:
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    return path


def folder_files(folder: Path) -> dict[str, bytes]:
    return {f.name: f.read_bytes() for f in sorted(folder.iterdir())}


def leftovers(cache: Path) -> list[str]:
    """Anything in the cache but complete folders and their lock files."""
    return [
        p.name
        for p in cache.iterdir()
        if not p.name.endswith(".lock") and p.name != ".digests" and not (p / "COMPLETE").is_file()
    ]


def test_every_document_reads_back_as_the_tokenizer_encodes_it_across_shards(tmp_path):
    texts = TEXTS[:10] + ["", "   \n\t "] + TEXTS[10:]  # empty texts are skipped and counted
    source = DataSource(str(write_jsonl(tmp_path / "corpus.jsonl", texts)))
    path = prepare(source, TOKENIZER, tmp_path / "cache", workers=1, progress=False, sizes=Sizes(shard_tokens=100))
    documents = PreparedDocuments(path)
    expected = [Tokenizer(TOKENIZER).encode(t) for t in TEXTS]
    assert documents.n_documents == len(TEXTS) and documents.n_tokens == sum(map(len, expected))
    assert documents.offsets.dtype == np.int64 and np.diff(documents.offsets).tolist() == [len(e) for e in expected]
    assert all(documents.tokens(i).tolist() == e for i, e in enumerate(expected))
    assert documents.tokens(3, 2, 5).tolist() == expected[3][2:5]
    assert documents.tokens(3, -4).tolist() == expected[3][-4:] and documents.tokens(3, 5, 2).tolist() == []
    assert documents.tokens(3).dtype == np.int64
    meta = documents.meta
    assert meta["empty_documents_skipped"] == 2 and meta["dtype"] == "uint16"
    # Shards end at document boundaries and hold at most 100 tokens, unless one document alone is longer.
    offsets = np.load(path / "offsets.npy")
    assert len(meta["shard_tokens"]) > 5
    shard_ends = np.cumsum(meta["shard_tokens"])
    assert np.isin(shard_ends, offsets).all()
    for shard, size in enumerate(meta["shard_tokens"]):
        starts = offsets[(offsets >= shard_ends[shard] - size) & (offsets < shard_ends[shard])]
        assert size <= 100 or len(starts) == 1
        assert (path / f"tokens-{shard:05d}.bin").stat().st_size == 2 * size


def test_a_folder_of_text_files_reads_in_file_order_one_document_per_line(tmp_path):
    (tmp_path / "corpus" / "b").mkdir(parents=True)
    (tmp_path / "corpus" / "a.txt").write_text("first line\nsecond line\n")
    (tmp_path / "corpus" / "b" / "c.txt").write_text("third line\n\nfourth line\n")
    path = prepare(DataSource(str(tmp_path / "corpus"), text_unit="line"), TOKENIZER, tmp_path / "cache", 1, False)
    documents = PreparedDocuments(path)
    tokenizer = Tokenizer(TOKENIZER)
    assert [tokenizer.decode(documents.tokens(i, 1, -1).tolist()) for i in range(documents.n_documents)] == [
        "first line",
        "second line",
        "third line",
        "fourth line",
    ]
    assert documents.path.name.startswith("corpus-")


def test_a_parquet_source_gives_the_tokens_of_the_same_texts_in_jsonl(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"text": TEXTS, "id": list(range(len(TEXTS)))}), tmp_path / "corpus.parquet")
    parquet = prepare(DataSource(str(tmp_path / "corpus.parquet")), TOKENIZER, tmp_path / "cache", 1, False)
    jsonl = prepare(
        DataSource(str(write_jsonl(tmp_path / "corpus.jsonl", TEXTS))), TOKENIZER, tmp_path / "cache", 1, False
    )
    assert parquet != jsonl
    for name in ("offsets.npy", "tokens-00000.bin"):
        assert (parquet / name).read_bytes() == (jsonl / name).read_bytes()


def test_preparing_twice_gives_identical_files_whatever_the_number_of_workers(tmp_path):
    source = DataSource(str(write_jsonl(tmp_path / "corpus.jsonl", TEXTS * 20)))
    one = prepare(source, TOKENIZER, tmp_path / "one", workers=1, progress=False, sizes=Sizes(shard_tokens=5000))
    two = prepare(source, TOKENIZER, tmp_path / "two", workers=2, progress=False, sizes=Sizes(shard_tokens=5000))
    assert one.name == two.name and len(json.loads((one / "meta.json").read_text())["shard_tokens"]) > 1
    assert folder_files(one) == folder_files(two)
    # A complete folder is reused at once.
    mtime = (one / "COMPLETE").stat().st_mtime_ns
    assert prepare(source, TOKENIZER, tmp_path / "one", workers=1, progress=False) == one
    assert (one / "COMPLETE").stat().st_mtime_ns == mtime


def test_the_folder_changes_with_the_tokenizer_and_the_source_files(tmp_path):
    source = DataSource(str(write_jsonl(tmp_path / "corpus.jsonl", TEXTS)))
    cache = tmp_path / "cache"
    base = prepare(source, TOKENIZER, cache, 1, False)
    assert base.name.startswith("corpus-") and PreparedDocuments(base).fingerprint == base.name.split("-")[-1]
    other_bos = TokenizerConfig(path=TOKENIZER.path, bos_token=TOKENIZER.eos_token)
    edited = tmp_path / "tokenizer.json"
    edited.write_text(Path(TOKENIZER.path).read_text() + "\n")  # the same vocabulary, another file
    names = {
        base.name,
        prepare(source, other_bos, cache, 1, False).name,
        prepare(source, TokenizerConfig(path=str(edited)), cache, 1, False).name,
    }
    assert len(names) == 3
    stat = Path(source.source).stat()
    os.utime(source.source, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1000))  # touched, same contents
    assert prepare(source, TOKENIZER, cache, 1, False) == base
    write_jsonl(Path(source.source), TEXTS[:-1] + ["Story 39: the dog"])  # the same size, other contents
    assert prepare(source, TOKENIZER, cache, 1, False).name not in names
    # Neither the split name nor a differently spelt path of the same file changes anything.
    same = DataSource(str(tmp_path / "." / "corpus.jsonl"), format="json", split="validation")
    assert prepare(same, TOKENIZER, cache, 1, False) == prepare(source, TOKENIZER, cache, 1, False)


def test_a_copied_source_reuses_its_tokens_and_the_cache_lists_and_cleans_what_is_stale(tmp_path):
    original = tmp_path / "corpus"
    original.mkdir()
    for i in range(2):
        write_jsonl(original / f"part{i}.jsonl", TEXTS[i::2])
    cache, runner = tmp_path / "cache", CliRunner()
    prepared_once = prepare(DataSource(str(original)), TOKENIZER, cache, 1, False)
    marker = (prepared_once / "COMPLETE").stat().st_mtime_ns
    copy = tmp_path / "copy"
    subprocess.run(["cp", "-r", str(original), str(copy)], check=True)  # new paths, times and inodes
    assert prepare(DataSource(str(copy)), TOKENIZER, cache, 1, False) == prepared_once
    assert (prepared_once / "COMPLETE").stat().st_mtime_ns == marker  # reused, not prepared again
    ls = lambda: runner.invoke(app, ["data", "ls", "--config", str(recipe)]).output  # noqa: E731
    recipe = tmp_path / "recipe.toml"
    recipe.write_text(f'[data]\ncache_dir = "{cache}"\n')
    assert f"{prepared_once.name}: current" in ls()
    write_jsonl(original / "part0.jsonl", TEXTS[:5])  # the source the folder was prepared from changes
    changed = prepare(DataSource(str(original)), TOKENIZER, cache, 1, False)
    assert changed != prepared_once
    listing = ls()
    assert f"{prepared_once.name}: source changed" in listing and f"{changed.name}: current" in listing
    assert "2 in" in listing.splitlines()[-1]
    result = runner.invoke(app, ["data", "clean", "--stale", "--config", str(recipe)])
    assert result.exit_code == 0 and f"removed {prepared_once.name} (source changed" in result.output
    assert not prepared_once.exists() and changed.exists()
    unknown = runner.invoke(app, ["data", "clean", "nothing-here", "--config", str(recipe)]).exception
    assert isinstance(unknown, UserError) and "no nothing-here in" in str(unknown)  # main() prints it in one line
    shutil.rmtree(original)
    assert f"{changed.name}: source missing" in ls()
    result = runner.invoke(app, ["data", "clean", changed.name, "--config", str(recipe)])
    assert result.exit_code == 0 and not changed.exists() and "0 in" in ls().splitlines()[-1]


def test_a_hub_source_s_key_holds_its_revision(tmp_path):
    names = {
        _target(DataSource("someone/corpus", format="hub", revision=revision), TOKENIZER, tmp_path)[1].name
        for revision in ("", "main", "0123abcd")
    }
    assert len(names) == 3


def test_an_interrupted_prepare_leaves_nothing_that_passes_for_complete_and_a_rerun_completes(tmp_path, monkeypatch):
    source = DataSource(str(write_jsonl(tmp_path / "corpus.jsonl", TEXTS * 10)))
    cache = tmp_path / "cache"
    monkeypatch.setattr(prepared.encode, "_CHUNK_CHARS", 1000)
    add = prepared.write._ShardWriter.add

    def add_then_interrupt(self, tokens, lengths):
        add(self, tokens, lengths)
        if self.documents > 50:
            raise KeyboardInterrupt

    monkeypatch.setattr(prepared.write._ShardWriter, "add", add_then_interrupt)
    with pytest.raises(KeyboardInterrupt):
        prepare(source, TOKENIZER, cache, workers=1, progress=False)
    (parts,) = leftovers(cache)  # where a rerun resumes: holding no unit, as the one unit was cut short
    assert parts.endswith(".parts") and not any((p / "COMPLETE").is_file() for p in (cache / parts).iterdir())
    monkeypatch.setattr(prepared.write._ShardWriter, "add", add)
    path = prepare(source, TOKENIZER, cache, workers=1, progress=False)
    assert PreparedDocuments(path).n_documents == len(TEXTS) * 10


def test_a_killed_prepare_is_cleaned_up_by_the_next_run(tmp_path):
    source = DataSource(str(write_jsonl(tmp_path / "corpus.jsonl", TEXTS)))
    cache = tmp_path / "cache"
    path = prepare(source, TOKENIZER, cache, 1, False)
    # What a SIGKILL leaves: a half-written temporary folder, and (say, after a partial copy) a folder without
    # its COMPLETE marker under the final name.
    (path / "COMPLETE").unlink()
    stale = cache / f".{path.name}.tmp-999999"
    stale.mkdir()
    (stale / "tokens-00000.bin").write_bytes(b"\0" * 10)
    with pytest.raises(ConfigError, match="not a complete prepared source.*titan data prepare"):
        PreparedDocuments(path)
    assert prepare(source, TOKENIZER, cache, 1, False) == path
    assert PreparedDocuments(path).n_documents == len(TEXTS) and leftovers(cache) == []
    # A truncated shard is caught too.
    with open(path / "tokens-00000.bin", "r+b") as f:
        f.truncate(10)
    with pytest.raises(ConfigError, match="tokens-00000.bin"):
        PreparedDocuments(path)


def prepare_in_a_process(source: Path, cache: Path, *options: str) -> subprocess.Popen:
    """A real prepare of `source` into `cache` with one worker, in a process a test can kill."""
    script = (
        "import sys; from pathlib import Path; from titan.config import DataSource, Tokenizer; "
        "from titan.data.prepared import Sizes, prepare; "
        "prepare(DataSource(sys.argv[1]), Tokenizer(sys.argv[2]), Path(sys.argv[3]), workers=1, progress=False"
        + "".join(f", {o}" for o in options)
        + ")"
    )
    return subprocess.Popen([sys.executable, "-c", script, str(source), TOKENIZER.path, str(cache)], cwd=ROOT)


@pytest.mark.slow
def test_killing_a_real_prepare_midway_then_rerunning_completes(tmp_path):
    source = write_jsonl(tmp_path / "corpus.jsonl", TEXTS * 3000)
    cache = tmp_path / "cache"
    child = prepare_in_a_process(source, cache)
    deadline = time.time() + 60
    while not any(p.name.startswith(".") and any(p.iterdir()) for p in cache.glob("*")) and time.time() < deadline:
        time.sleep(0.05)
    time.sleep(0.2)
    child.send_signal(signal.SIGKILL)
    child.wait()
    (parts,) = leftovers(cache)  # the killed run's units, complete or not
    folder = cache / parts[1:].removesuffix(".parts")
    with pytest.raises(ConfigError):
        ensure_prepared(DataSource(str(source)), TOKENIZER, cache, 1, auto_max_mb=0.001)
    assert prepare(DataSource(str(source)), TOKENIZER, cache, 1, False) == folder
    assert PreparedDocuments(folder).n_documents == len(TEXTS) * 3000 and leftovers(cache) == []


def _prepare_in_child(source: str, cache: str, log: str) -> None:
    write = prepared.write._write

    def slow_write(*args):
        with open(log, "a") as f:
            f.write(f"{os.getpid()}\n")
        time.sleep(0.5)  # long enough for the other process to find the lock taken
        write(*args)

    prepared.write._write = slow_write
    prepare(DataSource(source), TOKENIZER, Path(cache), workers=1, progress=False)


def test_two_processes_preparing_one_source_at_once_write_it_once(tmp_path):
    source = write_jsonl(tmp_path / "corpus.jsonl", TEXTS)
    cache, log = tmp_path / "cache", tmp_path / "writers.log"
    context = multiprocessing.get_context("fork")  # quick: this test's process has everything imported already
    children = [context.Process(target=_prepare_in_child, args=(str(source), str(cache), str(log))) for _ in range(2)]
    for child in children:
        child.start()
    for child in children:
        child.join(60)
    assert [child.exitcode for child in children] == [0, 0]
    assert len(log.read_text().split()) == 1  # one wrote, the other waited and reused its folder
    (folder,) = [p for p in cache.iterdir() if not p.name.endswith(".lock") and p.name != ".digests"]
    assert PreparedDocuments(folder).n_documents == len(TEXTS)


def test_a_process_waiting_on_a_unit_takes_the_work_of_the_one_that_merged_and_removed_it(tmp_path):
    """The other rank finishes the unit, merges the source and removes the units' folder, lock file and all,
    while this one waits for that lock: this one then finds the source complete, rather than crashing."""
    import threading

    from filelock import FileLock

    from titan.files import build_once

    parts = tmp_path / ".corpus.parts"
    unit, merged = parts / "unit-0-1", tmp_path / "corpus"
    parts.mkdir()
    holder = FileLock(unit.with_name(unit.name + ".lock"))
    holder.acquire()

    def build(tmp):
        raise AssertionError("the unit was built twice")

    found = {}
    waiter = threading.Thread(target=lambda: found.update(path=build_once(unit, lambda _: merged.exists(), build, "")))
    waiter.start()
    time.sleep(0.5)  # it waits on the lock
    merged.mkdir()
    shutil.rmtree(parts)
    holder.release()
    waiter.join(10)
    assert found == {"path": unit}


def test_ensure_prepared_prepares_small_local_sources_and_refuses_large_or_hub_ones(tmp_path):
    source = DataSource(str(write_jsonl(tmp_path / "corpus.jsonl", TEXTS)))
    cache = tmp_path / "cache"
    with pytest.raises(ConfigError, match=r"corpus.jsonl .*data.auto_prepare_max_mb.*titan data prepare --config"):
        ensure_prepared(source, TOKENIZER, cache, 1, auto_max_mb=0.001)
    path = ensure_prepared(source, TOKENIZER, cache, 1, auto_max_mb=1)
    assert PreparedDocuments(path).n_documents == len(TEXTS)
    assert ensure_prepared(source, TOKENIZER, cache, 1, auto_max_mb=0.001) == path  # prepared: no size limit
    with pytest.raises(ConfigError, match=r"hub dataset.*titan data prepare --config") as error:
        ensure_prepared(DataSource("someone/some-dataset"), TOKENIZER, cache, 1, auto_max_mb=1e9)
    assert "\n" not in str(error.value)


def test_cache_root_follows_the_recipe_then_the_environment(monkeypatch, tmp_path):
    from titan.config import Data

    assert prepared.cache_root_for(Data(cache_dir=str(tmp_path))) == tmp_path
    monkeypatch.setenv("TITAN_CACHE", str(tmp_path / "titan"))
    assert prepared.cache_root_for(Data()) == tmp_path / "titan" / "prepared"
    monkeypatch.delenv("TITAN_CACHE")
    assert prepared.cache_root_for(Data()) == Path.home() / ".cache" / "titan" / "prepared"


# Bad sources: (file name, contents, words of the one-line error).
BAD_SOURCES = {
    "empty_file": ("corpus.jsonl", b"", ["corpus.jsonl", "has no documents"]),
    "no_records": ("corpus.jsonl", b"\n\n", ["corpus.jsonl", "has no documents"]),
    "only_empty_texts": ("corpus.jsonl", b'{"text": ""}\n{"text": "  "}\n', ["corpus.jsonl", "empty"]),
    "malformed_record": (
        "corpus.jsonl",
        b'{"text": "fine"}\n\n{"text": "also fine"}\n{"text": broken\n',
        ["corpus.jsonl", "line 4", "not valid JSON"],
    ),
    "not_an_object": ("corpus.jsonl", b'{"text": "fine"}\n["a", "list"]\n', ["corpus.jsonl", "line 2"]),
    "binary_jsonl": ("corpus.jsonl", b'{"text": "a\x00b"}\n\xff\xfe\x00\x01', ["corpus.jsonl", "line 1", "NUL"]),
    "binary_txt_nul": ("corpus.txt", b"one line\nanother\x00line\n", ["corpus.txt", "line 2", "NUL"]),
    "binary_txt_utf8": ("corpus.txt", b"one line\n\xff\xfe\x80\n", ["corpus.txt", "line 2", "UTF-8"]),
    "missing_text_field": ("corpus.jsonl", b'{"body": "a"}\n', ["corpus.jsonl", "'text'", "body"]),
    "non_text_field": ("corpus.jsonl", b'{"text": "a"}\n{"text": 5}\n', ["corpus.jsonl", "record 2", "int"]),
    "text_field_in_some": ("corpus.jsonl", b'{"text": "a"}\n{"body": "b"}\n', ["corpus.jsonl", "record 2", "'text'"]),
    "corrupt_gzip": ("corpus.txt.gz", b"not gzip data\n", ["corpus.txt.gz", "Not a gzipped file"]),
}


@pytest.mark.parametrize("case", BAD_SOURCES)
def test_a_bad_source_raises_one_line_naming_the_file(tmp_path, case):
    name, content, words = BAD_SOURCES[case]
    (tmp_path / name).write_bytes(content)
    with pytest.raises(ConfigError) as error:
        prepare(DataSource(str(tmp_path / name)), TOKENIZER, tmp_path / "cache", 1, False)
    message = str(error.value)
    assert "\n" not in message and all(w in message for w in words), (words, message)
    assert not (tmp_path / "cache").exists() or leftovers(tmp_path / "cache") == []


def prepare_args(source: Path, cache: Path, *extra: str) -> list[str]:
    """`titan data prepare` of the debug recipe with the tests' tokenizer, one worker."""
    return ["data", "prepare", "--config", str(DEBUG_RECIPE), "--tokenizer.path", TOKENIZER.path,
            "--data.source", str(source), "--data.cache_dir", str(cache), "--workers", "1", *extra]  # fmt: skip


def test_bad_sources_through_the_cli_exit_2_with_one_error_line(tmp_path):
    runs = []
    for case, (name, content, _) in BAD_SOURCES.items():
        (tmp_path / case).mkdir()
        (tmp_path / case / name).write_bytes(content)
        runs.append((prepare_args(tmp_path / case / name, tmp_path / "cache"), {}))
    for case, result in zip(BAD_SOURCES, run_titan_many(runs)):
        assert_one_line_error(result, *BAD_SOURCES[case][2])


def test_the_cli_prepares_every_source_of_the_recipe_and_prints_its_figures(tmp_path):
    train = write_jsonl(tmp_path / "train.jsonl", TEXTS + [" "])
    held = write_jsonl(tmp_path / "held.jsonl", TEXTS[:5])
    args = prepare_args(train, tmp_path / "cache", "--validation.source", str(held))
    result = run_titan(*args)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert len(lines) == 2 and lines[0].startswith(f"{train}: {tmp_path / 'cache'}/train-")
    assert f"40 documents, {sum(len(Tokenizer(TOKENIZER).encode(t)) for t in TEXTS):,} tokens" in lines[0]
    assert "(1 empty documents skipped)" in lines[0] and " s, " in lines[0] and lines[0].endswith("tokens/s")
    assert lines[1].startswith(f"{held}: ") and "5 documents" in lines[1]
    again = CliRunner().invoke(app, args)  # in this process: a second real CLI would only import torch again
    assert again.exit_code == 0, again.output
    assert [line.endswith("already prepared") for line in again.stdout.splitlines()] == [True, True]


def test_tokenizer_path_may_name_a_hub_model_in_the_local_hf_cache(tmp_path, monkeypatch):
    """The HF cache layout (models--org--name/snapshots/<commit>/tokenizer.json, refs/main naming the commit),
    filled here with the project's tokenizer: no download."""
    import huggingface_hub.constants

    repo = tmp_path / "models--acme--tiny-llama"
    (repo / "snapshots" / "abc123").mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("abc123")
    shutil.copy(ROOT / "data" / "tokenizer.json", repo / "snapshots" / "abc123" / "tokenizer.json")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path))
    from_hub = Tokenizer(TokenizerConfig(path="acme/tiny-llama"))
    local = Tokenizer(TokenizerConfig(path=str(ROOT / "data" / "tokenizer.json")))
    assert from_hub.path == repo / "snapshots" / "abc123" / "tokenizer.json"
    assert from_hub.encode("Once upon a time") == local.encode("Once upon a time")
    with pytest.raises(ConfigError, match="nor a hub model whose tokenizer.json is in the local HF cache"):
        Tokenizer(TokenizerConfig(path="acme/not-downloaded"))


def test_a_recipe_laid_out_for_many_gpus_prepares_on_one_machine(tmp_path):
    """`titan data prepare` on a login node: the layout of the run it prepares for does not matter."""
    train = write_jsonl(tmp_path / "train.jsonl", TEXTS)
    layout = ["--parallel.dp_shard", "8", "--parallel.tp", "8", "--parallel.pp", "2"]
    result = CliRunner().invoke(app, prepare_args(train, tmp_path / "cache", *layout))
    assert result.exit_code == 0, result.output
    assert "40 documents" in result.output


def test_help_keeps_the_brackets_of_recipe_keys():
    result = CliRunner().invoke(app, ["data", "prepare", "--help"])
    assert result.exit_code == 0 and "[[data.sources]]" in result.output


def write_files(folder: Path, count: int, repeat: int = 1) -> Path:
    """A source of `count` JSONL files, each with texts of its own."""
    folder.mkdir()
    for i in range(count):
        write_jsonl(folder / f"part-{i:02d}.jsonl", [f"file {i}. {t}" for t in TEXTS * repeat])
    return folder


def test_parts_prepared_one_after_another_merge_into_what_one_prepare_makes(tmp_path):
    source = DataSource(str(write_files(tmp_path / "corpus", 7)))
    whole = prepare(source, TOKENIZER, tmp_path / "whole", 1, False, sizes=Sizes(shard_tokens=500, unit_bytes=1))
    cache = tmp_path / "parts"
    parts = [
        prepare(source, TOKENIZER, cache, 1, False, part=(i, 3), sizes=Sizes(shard_tokens=500, unit_bytes=1))
        for i in range(3)
    ]
    assert parts[:2] == [None, None] and parts[2].name == whole.name  # the last part merges
    assert folder_files(parts[2]) == folder_files(whole) and leftovers(cache) == []
    documents = PreparedDocuments(whole)
    assert documents.n_documents == 7 * len(TEXTS) and len(documents.meta["shard_tokens"]) >= 7
    tokenizer = Tokenizer(TOKENIZER)
    assert documents.tokens(3 * len(TEXTS) + 5).tolist() == tokenizer.encode(f"file 3. {TEXTS[5]}")


def test_the_cli_prepares_a_part_and_says_what_remains(tmp_path):
    corpus = write_files(tmp_path / "corpus", 3)
    first = CliRunner().invoke(app, prepare_args(corpus, tmp_path / "cache", "--part", "0/2"))
    assert first.exit_code == 0, first.output
    assert "part 0/2 prepared" in first.output and "other parts' files remain" in first.output
    last = CliRunner().invoke(app, prepare_args(corpus, tmp_path / "cache", "--part", "1/2"))
    assert last.exit_code == 0 and f"{3 * len(TEXTS)} documents" in last.output, last.output
    assert_one_line_error(run_titan(*prepare_args(corpus, tmp_path / "cache", "--part", "2/2")), "--part 2/2", "i/N")


@pytest.mark.slow
def test_a_killed_prepare_resumes_with_the_units_it_completed(tmp_path, monkeypatch):
    corpus = write_files(tmp_path / "corpus", 6, repeat=100)
    cache = tmp_path / "cache"
    child = prepare_in_a_process(corpus, cache, "sizes=Sizes(unit_bytes=1)")
    done = lambda: sorted(p.parent.name for p in cache.glob(".*.parts/unit-*/COMPLETE"))  # noqa: E731
    deadline = time.time() + 120
    while len(done()) < 2 and child.poll() is None and time.time() < deadline:
        time.sleep(0.02)
    child.send_signal(signal.SIGKILL)
    child.wait()
    kept = done()
    assert 2 <= len(kept) < 6, kept  # killed midway
    written = []
    write = prepared.write._write

    def counted_write(tmp, encoding, unit, *args):
        written.append(unit.name)
        write(tmp, encoding, unit, *args)

    monkeypatch.setattr(prepared.write, "_write", counted_write)
    path = prepare(DataSource(str(corpus)), TOKENIZER, cache, 1, False, sizes=Sizes(unit_bytes=1))
    assert written and not set(written) & set(kept) and len(written) + len(kept) == 6
    whole = prepare(DataSource(str(corpus)), TOKENIZER, tmp_path / "whole", 1, False, sizes=Sizes(unit_bytes=1))
    assert folder_files(path) == folder_files(whole) and leftovers(cache) == []


def test_a_reader_keeps_a_bounded_number_of_shard_maps_open(tmp_path):
    source = DataSource(str(write_jsonl(tmp_path / "corpus.jsonl", TEXTS)))
    path = prepare(source, TOKENIZER, tmp_path / "cache", 1, False, sizes=Sizes(shard_tokens=100))
    documents = PreparedDocuments(path, open_shards=3)
    expected = [Tokenizer(TOKENIZER).encode(t) for t in TEXTS]
    assert len(documents.meta["shard_tokens"]) > 10

    def open_shard_files() -> int:
        fds = Path("/proc/self/fd")
        return sum("tokens-" in os.readlink(fd) for fd in fds.iterdir() if fd.exists())

    before = open_shard_files()
    for doc in list(range(len(TEXTS))) * 2:
        assert documents.tokens(doc).tolist() == expected[doc]
        assert open_shard_files() - before <= 3
    assert open_shard_files() - before == 3


def test_a_compressed_source_is_bounded_by_the_text_it_inflates_to(tmp_path, monkeypatch, caplog):
    """A 2.3 MB text in a .bz2 of a few hundred bytes is announced and bounded by its text: refused in one line
    under data.auto_prepare_max_mb = 1, prepared under 4. A file whose start compresses less than its rest, so
    that its sample says too little text, is stopped in one line once its text passes the bound, leaving nothing
    in the cache."""
    import bz2
    import gzip
    import random

    from titan.data import local_files

    source = tmp_path / "many.txt.bz2"
    source.write_bytes(bz2.compress(b"the same line of text, again\n" * 80_000))
    assert source.stat().st_size < 2**10
    src, cache = DataSource(str(source), text_unit="line"), tmp_path / "cache"
    with pytest.raises(ConfigError, match=r"many.txt.bz2 \(about 2.2 MB of text, 0.0 MB compressed\) .* larger than"):
        ensure_prepared(src, TOKENIZER, cache, 1, auto_max_mb=1)
    with caplog.at_level("INFO", logger="titan"):
        path = ensure_prepared(src, TOKENIZER, cache, 1, auto_max_mb=4)
    assert "many.txt.bz2 (about 2.2 MB of text, 0.0 MB compressed)" in caplog.text
    assert json.loads((path / "meta.json").read_text())["documents"] == 80_000

    monkeypatch.setattr(local_files, "TEXT_SAMPLE_BYTES", 1 << 16)
    rng = random.Random(0)
    start = "".join(f"{rng.randrange(10**9)}\n" for _ in range(30_000)).encode()  # 300 KB of digits, then 3 MB
    source = tmp_path / "misleading.txt.gz"
    source.write_bytes(gzip.compress(start + b"the same line of text, again\n" * 100_000))
    src = DataSource(str(source), text_unit="line")
    with pytest.raises(ConfigError, match=r"misleading.txt.gz inflates past data.auto_prepare_max_mb = 1 MB of text"):
        ensure_prepared(src, TOKENIZER, cache, 1, auto_max_mb=1)
    assert leftovers(cache) == []


def test_a_disk_that_fills_stops_the_preparation_in_one_line_before_it_is_full(tmp_path, monkeypatch):
    """A disk with less free than the next shard's tokens and the margin: the preparation stops in one line naming
    the space and what to do, and leaves nothing half-written."""
    from titan.data.prepared import write

    usage = shutil.disk_usage
    monkeypatch.setattr(write.shutil, "disk_usage", lambda path: usage(path)._replace(free=100 << 20))
    source, cache = write_jsonl(tmp_path / "corpus.jsonl", TEXTS), tmp_path / "cache"
    with pytest.raises(ConfigError, match=r"has 100 MB free, too little .* free space or set data.cache_dir"):
        prepare(DataSource(str(source)), TOKENIZER, cache, 1, False)
    assert leftovers(cache) == []
