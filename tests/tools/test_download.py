"""`titan download`: through huggingface_hub, against a local hub mirror (HF_ENDPOINT) that this test serves from
its own files, into a hub cache it owns; then offline (HF_HUB_OFFLINE=1) from that cache.

The mirror answers the requests huggingface_hub's snapshot_download makes: the repo's revision, its file tree,
and each file (HEAD for its metadata, GET for its bytes). It logs the files it served, so the test can tell what
was fetched.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from urllib.parse import unquote, urlparse

import pytest
from safetensors.torch import save_file

from conftest import ROOT, run_titan
from helpers import assert_one_line_error
from hub_server import LocalHub

COMMIT = "0123456789abcdef0123456789abcdef01234567"
MODEL = "acme/tiny-llama"
GATED = "acme/gated"


def model_files(folder: Path) -> dict[str, bytes]:
    """What the mirror's model holds: config, tokenizer (the project's), two weight shards and their index."""
    import torch

    folder.mkdir()
    gen = torch.Generator().manual_seed(0)
    shards = {"model-00001-of-00002.safetensors": "a", "model-00002-of-00002.safetensors": "b"}
    for file, name in shards.items():
        save_file({name: torch.randn(64, 64, generator=gen)}, str(folder / file), metadata={"format": "pt"})
    files = {file: (folder / file).read_bytes() for file in shards}
    files["model.safetensors.index.json"] = json.dumps({"weight_map": {v: k for k, v in shards.items()}}).encode()
    files["config.json"] = json.dumps({"model_type": "llama", "hidden_size": 64}).encode()
    files["tokenizer.json"] = (ROOT / "data" / "tokenizer.json").read_bytes()
    files["tokenizer_config.json"] = b'{"tokenizer_class": "PreTrainedTokenizerFast"}'
    files["README.md"] = b"# not fetched: titan asks for config, tokenizer and weights only\n"
    return files


class Mirror(LocalHub):
    """A hub that serves MODEL's files, answers GATED as gated and any other repo as not found."""

    def __init__(self, files: dict[str, bytes]):
        self.files, self.served = files, []
        super().__init__()

    def answer(self, request: BaseHTTPRequestHandler, body: bool) -> None:
        path = unquote(urlparse(request.path).path)
        repo = "/".join(path.removeprefix("/api/models/").split("/")[:2]) if path.startswith("/api/") else ""
        repo = repo or "/".join(path.lstrip("/").split("/")[:2])
        if repo == GATED:
            return self.send(request, 401, b'{"error": "gated"}', {"X-Error-Code": "GatedRepo"}, body)
        if repo != MODEL:
            return self.send(request, 404, b'{"error": "not found"}', {"X-Error-Code": "RepoNotFound"}, body)
        if path.startswith(f"/api/models/{MODEL}/revision/"):
            siblings = [{"rfilename": name} for name in self.files]
            return self.send(request, 200, json.dumps({"id": MODEL, "sha": COMMIT, "siblings": siblings}).encode(),
                             {}, body)  # fmt: skip
        if path.startswith(f"/api/models/{MODEL}/tree/"):
            tree = [{"type": "file", "path": name, "size": len(data), "oid": hashlib.sha1(data).hexdigest()}
                    for name, data in self.files.items()]  # fmt: skip
            return self.send(request, 200, json.dumps(tree).encode(), {}, body)
        name = path.removeprefix(f"/{MODEL}/resolve/{COMMIT}/")
        if name not in self.files:
            return self.send(request, 404, b"{}", {"X-Error-Code": "EntryNotFound"}, body)
        if body:
            self.served.append(name)
        data = self.files[name]
        headers = {"X-Repo-Commit": COMMIT, "ETag": f'"{hashlib.sha256(data).hexdigest()}"'}
        self.send(request, 200, data, headers, body)


@pytest.fixture(scope="module")
def mirror(tmp_path_factory):
    hub = Mirror(model_files(tmp_path_factory.mktemp("hub") / "model"))
    yield hub
    hub.server.shutdown()


def hub_env(mirror: Mirror, cache: Path, offline: bool = False) -> dict:
    return {"HF_ENDPOINT": mirror.url, "HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1" if offline else "0",
            "HF_TOKEN": "", "HF_HUB_DISABLE_TELEMETRY": "1"}  # fmt: skip


def snapshot(cache: Path) -> Path:
    return cache / f"models--{MODEL.replace('/', '--')}" / "snapshots" / COMMIT


CONFIG_AND_TOKENIZER = {"config.json", "tokenizer.json", "tokenizer_config.json"}
WEIGHTS = {"model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors", "model.safetensors.index.json"}


def test_download_fetches_config_and_tokenizer_then_weights_and_works_offline(mirror, tmp_path):
    cache = tmp_path / "cache"
    mirror.served.clear()
    result = run_titan("download", MODEL, env=hub_env(mirror, cache))
    assert result.returncode == 0, result.stderr
    folder = snapshot(cache)
    assert set(mirror.served) == CONFIG_AND_TOKENIZER  # no weights, no README
    assert {p.name for p in folder.iterdir()} == CONFIG_AND_TOKENIZER
    assert all((folder / name).read_bytes() == mirror.files[name] for name in CONFIG_AND_TOKENIZER)
    assert str(folder) in result.stdout and f'tokenizer.path = "{MODEL}"' in result.stdout

    # Offline, a recipe finds the tokenizer by the model's name in the cache.
    check = f"from titan.data.tokenizer import tokenizer_file; print(tokenizer_file({MODEL!r}))"
    found = run_python(check, hub_env(mirror, cache, offline=True))[0]
    assert found.strip() == str(folder / "tokenizer.json")
    # Offline, the weights are not there: one line, no traceback.
    assert_one_line_error(
        run_titan("download", MODEL, "--weights", env=hub_env(mirror, cache, offline=True)),
        MODEL,
        "cannot be reached",
        "its weights",
    )

    mirror.served.clear()
    result = run_titan("download", MODEL, "--weights", env=hub_env(mirror, cache))
    assert result.returncode == 0, result.stderr
    assert set(mirror.served) == WEIGHTS  # the config and tokenizer came from the cache
    assert all((folder / name).read_bytes() == mirror.files[name] for name in WEIGHTS)
    assert f'checkpoint.init_from_hf = "{folder}"' in result.stdout
    offline = run_titan("download", MODEL, "--weights", env=hub_env(mirror, cache, offline=True))
    assert offline.returncode == 0 and str(folder) in offline.stdout, offline.stderr


def run_python(code: str, env: dict) -> tuple[str, str]:
    """(stdout, stderr) of `code` run by Python in the repository root with `env` added."""
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env={**os.environ, **env}, capture_output=True,
                            text=True, timeout=120)  # fmt: skip
    assert result.returncode == 0, result.stderr
    return result.stdout, result.stderr


def test_gated_unknown_and_malformed_models_are_one_line_errors(mirror, tmp_path):
    env = hub_env(mirror, tmp_path / "cache")
    assert_one_line_error(run_titan("download", GATED, env=env), GATED, "gated", "hf auth login")
    assert_one_line_error(run_titan("download", "acme/nope", env=env), "no model acme/nope", "hf auth login")
    assert_one_line_error(run_titan("download", "not a name", env=env), "not a hub model name")


def test_a_download_to_a_log_file_reports_its_bytes_in_log_lines(mirror, tmp_path):
    """Where stderr is no terminal huggingface_hub draws no bar; titan's log lines count the bytes written."""
    from tqdm import tqdm

    code = (
        "from titan import progress; from titan.tools.download import download\n"
        "progress.LOG_EVERY_S = 0  # a line at every update\n"
        f"download({MODEL!r}, weights=True)"
    )
    stderr = run_python(code, hub_env(mirror, tmp_path / "cache"))[1]
    lines = [line.split(" ", 1)[1] for line in stderr.splitlines() if " downloading: " in line]
    total = tqdm.format_sizeof(sum(len(mirror.files[name]) for name in CONFIG_AND_TOKENIZER | WEIGHTS), "B", 1024)
    assert len(lines) > 2 and lines[-1].startswith("downloading: done"), stderr
    assert "\r" not in stderr and "Fetching" not in stderr  # no bar: its redraws would pile up in a log file
    assert lines[-2].startswith(f"downloading: {total} of {total} (100%), "), lines
