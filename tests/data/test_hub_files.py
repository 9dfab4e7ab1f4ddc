"""A hub dataset prepared by its files (`titan data prepare` of FineWeb-Edu's kind: many parquet files), against a
local hub (HF_ENDPOINT) that this test serves: its subset and split resolved to files by HF datasets' rules, the
files spread over `--part`s, a failed file resumed without fetching the others again, and the listing pinned to one
commit while the branch moves. Each preparation runs in its own process: huggingface_hub reads HF_ENDPOINT when
imported."""

from __future__ import annotations

import hashlib
import io
import json
import os
import subprocess
import sys
from http.server import BaseHTTPRequestHandler
from urllib.parse import parse_qs, unquote, urlparse

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from conftest import ROOT
from hub_server import LocalHub
from titan.config import Tokenizer as TokenizerConfig
from titan.data.prepared import PreparedDocuments
from titan.data.tokenizer import Tokenizer

REPO = "acme/web"
FIRST, MOVED = "1" * 40, "2" * 40  # the commits `main` names before and after it moves
TOKENIZER = TokenizerConfig(path=str(ROOT / "data" / "tokenizer.json"))
CARD = b"""---
configs:
- config_name: default
  data_files:
  - split: train
    path: data/*/*
- config_name: sample
  data_files:
  - split: train
    path: sample/*
- config_name: tables
  data_files:
  - split: train
    path: tables/*
---
"""


def parquet(texts: list[str]) -> bytes:
    buffer = io.BytesIO()
    pq.write_table(pa.table({"text": texts, "url": [f"u{i}" for i in range(len(texts))]}), buffer)
    return buffer.getvalue()


DATA = {
    "data/CC-1/000.parquet": ["The dog ran home.", "A cat sat."],
    "data/CC-1/001.parquet": ["Rain fell all day on the hills."],
    "data/CC-2/000.parquet": ["Bread and butter.", "", "Three texts here."],
    "sample/000.parquet": ["Only in the sample."],
}


class DatasetHub(LocalHub):
    """REPO's files at FIRST, and, once `move()` is called, `main` at MOVED with one more file; `failing` names a
    file answered with a server error. `served` lists the data files sent."""

    def __init__(self):
        files = {"README.md": CARD, "tables/000.csv": b"text\nA row.\n", **{n: parquet(t) for n, t in DATA.items()}}
        self.commits = {FIRST: files}
        self.main, self.failing, self.served = FIRST, None, []
        super().__init__()

    def move(self) -> None:
        self.commits[MOVED] = {**self.commits[FIRST], "data/CC-3/000.parquet": parquet(["Added later."])}
        self.main = MOVED

    def answer(self, request: BaseHTTPRequestHandler, body: bool) -> None:
        url = urlparse(request.path)
        path = unquote(url.path)
        api, resolve = f"/api/datasets/{REPO}/", f"/datasets/{REPO}/resolve/"
        if not path.startswith((api, resolve)):
            return self.send(request, 404, b'{"error": "not found"}', {"X-Error-Code": "RepoNotFound"}, body)
        if path.startswith(resolve):
            revision, name = path.removeprefix(resolve).split("/", 1)
            commit = self.main if revision == "main" else revision
            if name not in self.commits.get(commit, {}):
                return self.send(request, 404, b"{}", {"X-Error-Code": "EntryNotFound"}, body)
            if name == self.failing:
                return self.send(request, 500, b"{}", {}, body)
            if body and name.endswith(".parquet"):
                self.served.append((commit, name))
            data = self.commits[commit][name]
            headers = {"X-Repo-Commit": commit, "ETag": f'"{hashlib.sha256(data).hexdigest()}"'}
            return self.send(request, 200, data, headers, body)
        kind, revision, *rest = path.removeprefix(api).split("/", 2)
        commit = self.main if revision == "main" else revision
        files = self.commits[commit]
        if kind == "revision":
            siblings = [{"rfilename": name} for name in files]
            return self.send(request, 200, json.dumps({"id": REPO, "sha": commit, "siblings": siblings}).encode(),
                             {}, body)  # fmt: skip
        if kind == "tree":  # the folder's entries, or with recursive=true everything under it
            under = rest[0].rstrip("/") + "/" if rest else ""
            recursive = parse_qs(url.query).get("recursive", ["false"])[0] == "true"
            entries = {}
            for name, data in files.items():
                if not name.startswith(under):
                    continue
                parts = name[len(under) :].split("/")
                for depth in range(1, len(parts) if recursive else min(2, len(parts))):
                    folder = under + "/".join(parts[:depth])
                    entries[folder] = {"type": "directory", "path": folder, "oid": "0" * 40}
                if recursive or len(parts) == 1:
                    entries[name] = {"type": "file", "path": name, "size": len(data),
                                     "oid": hashlib.sha1(data).hexdigest()}  # fmt: skip
            return self.send(request, 200, json.dumps(list(entries.values())).encode(), {}, body)
        return self.send(request, 404, b"{}", {"X-Error-Code": "EntryNotFound"}, body)


@pytest.fixture
def hub():
    server = DatasetHub()
    yield server
    server.server.shutdown()


def prepare_part(hub: DatasetHub, tmp_path, part: tuple[int, int], subset: str = "", split: str = "train"):
    """`prepare` of REPO in a process of its own, each file a unit: (return code, the folder it printed or the
    error's line)."""
    code = (
        "import sys; from pathlib import Path\n"
        "from titan.config import DataSource, Tokenizer\n"
        "from titan.data.prepared import Sizes, prepare\n"
        "from titan.errors import UserError\n"
        "try:\n"
        f"    path = prepare(DataSource({REPO!r}, subset={subset!r}, split={split!r}), "
        f"Tokenizer(path={TOKENIZER.path!r}), Path({str(tmp_path / 'cache')!r}), 1, False, part={part!r}, "
        "sizes=Sizes(unit_bytes=1))\n"
        "    print(path)\n"
        "except UserError as e:\n"
        "    print(e); sys.exit(2)\n"
    )
    env = {**os.environ, "HF_ENDPOINT": hub.url, "HF_HUB_CACHE": str(tmp_path / "hub"), "HF_TOKEN": "",
           "HF_DATASETS_CACHE": str(tmp_path / "datasets"), "HF_HUB_DISABLE_TELEMETRY": "1",
           "HF_HUB_DISABLE_PROGRESS_BARS": "1", "PYTHONPATH": str(ROOT)}  # fmt: skip
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                            timeout=300)  # fmt: skip
    assert result.returncode in (0, 2), result.stderr
    return result.returncode, result.stdout.strip().splitlines()[-1]


def texts_of(names: list[str]) -> list[str]:
    """The split's texts in the order its files resolve (sorted paths), the empty ones left out, as titan keeps."""
    return [text for name in sorted(names) for text in DATA.get(name, ["Added later."]) if text]


def test_a_hub_dataset_is_prepared_by_its_files_in_parts_at_one_commit(hub, tmp_path):
    """The default subset's train split is its three data/ files (not the sample's), each a unit: part 0/2 fetches
    the first, then `main` moves, and part 1/2 fetches the other two at the commit part 0 listed and merges. The
    documents are the files' texts in order, tokenised as the tokenizer encodes each."""
    code, line = prepare_part(hub, tmp_path, (0, 2))
    assert (code, line) == (0, "None")  # other parts' units remain
    assert hub.served == [(FIRST, "data/CC-1/000.parquet")]
    hub.move()
    code, line = prepare_part(hub, tmp_path, (1, 2))
    assert code == 0, line
    assert hub.served[1:] == [(FIRST, "data/CC-1/001.parquet"), (FIRST, "data/CC-2/000.parquet")]
    documents = PreparedDocuments(line)
    assert documents.meta["source"]["commit"] == FIRST
    expected = texts_of([name for name in DATA if name.startswith("data/")])
    tokenizer = Tokenizer(TOKENIZER)
    assert [documents.tokens(i).tolist() for i in range(documents.n_documents)] == list(map(tokenizer.encode, expected))
    assert not list((tmp_path / "cache").glob(".*.parts"))  # the parts, the listing and the fetched files are gone


@pytest.mark.scenario
def test_a_file_that_fails_is_one_line_and_the_next_prepare_resumes_there(hub, tmp_path):
    hub.failing = "data/CC-1/001.parquet"
    code, line = prepare_part(hub, tmp_path, (0, 1))
    assert code == 2 and "could not fetch data/CC-1/001.parquet of hub dataset 'acme/web'" in line, line
    assert "resume from this file" in line
    hub.failing, hub.served = None, []
    code, line = prepare_part(hub, tmp_path, (0, 1))
    assert code == 0 and hub.served == [(FIRST, "data/CC-1/001.parquet"), (FIRST, "data/CC-2/000.parquet")]
    assert PreparedDocuments(line).n_documents == len(texts_of([n for n in DATA if n.startswith("data/")]))


@pytest.mark.scenario
def test_a_subset_reads_its_own_files_and_a_missing_split_is_named(hub, tmp_path):
    code, line = prepare_part(hub, tmp_path, (0, 1), subset="sample")
    assert code == 0 and hub.served == [(FIRST, "sample/000.parquet")]
    assert PreparedDocuments(line).n_documents == 1
    code, line = prepare_part(hub, tmp_path, (0, 1), split="validation")
    assert code == 2 and line.startswith("data.split: hub dataset 'acme/web' has the splits train, not 'validation'")
    code, line = prepare_part(hub, tmp_path, (0, 2), subset="tables")  # CSV: streamed whole, by one process
    assert code == 2 and "acme/web is a hub dataset whose files titan does not read one by one" in line, line
