"""An export people share: `titan convert dcp-to-hf` writes a folder that batches in transformers (a pad token),
whose files have the modes the user's umask gives, with a model card (README.md) of the run, and that
`--push-to-hub` uploads through huggingface_hub, here to a local hub server (HF_ENDPOINT) that keeps what it is
sent."""

from __future__ import annotations

import base64
import json
import os
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlparse

import pytest
import torch

transformers = pytest.importorskip("transformers")

from conftest import ROOT, run_titan  # noqa: E402
from helpers import SMALL, assert_one_line_error  # noqa: E402
from runs import trained_run  # noqa: E402
from titan.checkpoint import hf as hf_io  # noqa: E402

# Four steps, validated and saved every two: a checkpoint before the run's end, whose card must not take the
# losses logged after it.
RUN = {
    **SMALL,
    "training.steps": "4",
    "lr_scheduler.warmup_steps": "0",
    "optimizer.lr": "1e-2",
    "validation.interval": "2",
    "validation.steps": "1",
    "checkpoint.enable": "true",
    "checkpoint.interval": "2",
}


@pytest.fixture(scope="module")
def run_dir() -> Path:
    return trained_run(**RUN) / "debug"


@pytest.fixture(scope="module")
def exported(run_dir, tmp_path_factory) -> Path:
    """The run's newest checkpoint (step 4) through the CLI."""
    out = tmp_path_factory.mktemp("export") / "hf"
    result = run_titan("convert", "dcp-to-hf", str(run_dir), str(out))
    assert result.returncode == 0, result.stderr
    return out


def metrics(run_dir: Path) -> tuple[dict[int, float], dict[int, float]]:
    """({step: training loss}, {step: validation loss}) as the run logged them."""
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train = {r["step"]: r["loss"] for r in records if "loss" in r}
    return train, {r["step"]: r["val_loss"] for r in records if "val_loss" in r}


# -- pad token: batches in transformers ----------------------------------------------------------------------------

PROMPTS = ["The dog ran", "Once upon a time there was a little girl who", "Tom"]


def test_the_export_pads_batches_and_left_padded_generation_is_each_prompts_own(exported, run_dir):
    """transformers' tokenizer pads a batch; greedy generate of a left-padded batch gives each prompt the tokens
    it gets alone, and the text `titan generate` prints."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(exported, padding_side="left")
    assert tokenizer.pad_token == tokenizer.eos_token
    generation = json.loads((exported / "generation_config.json").read_text())
    assert generation["pad_token_id"] == tokenizer.pad_token_id == tokenizer.eos_token_id
    batch = tokenizer(PROMPTS, padding=True, return_tensors="pt")
    assert batch["input_ids"].shape[0] == 3 and (batch["attention_mask"] == 0).any()  # lengths differ: padded

    model = transformers.AutoModelForCausalLM.from_pretrained(exported, dtype=torch.float32).eval()
    new = 16
    with torch.no_grad():
        batched = model.generate(**batch, max_new_tokens=new, do_sample=False)[:, batch["input_ids"].shape[1] :]
        alone = [model.generate(**tokenizer(p, return_tensors="pt"), max_new_tokens=new, do_sample=False)[0]
                 for p in PROMPTS]  # fmt: skip
    texts = [tokenizer.decode(row, skip_special_tokens=True) for row in batched]
    for prompt, row, single in zip(PROMPTS, texts, alone):
        ids = tokenizer(prompt)["input_ids"]
        assert row == tokenizer.decode(single[len(ids) :], skip_special_tokens=True), prompt

    generated = run_titan("generate", "--checkpoint", str(run_dir), *[a for p in PROMPTS for a in ("--prompt", p)],
                          "--max-new-tokens", str(new))  # fmt: skip
    assert generated.returncode == 0, generated.stderr
    assert [json.loads(line)["text"] for line in generated.stdout.splitlines()] == texts


# -- file modes ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("umask", [0o022, 0o077], ids=["umask022", "umask077"])
def test_exported_files_have_the_modes_the_users_umask_gives(run_dir, tmp_path, umask):
    out = tmp_path / "hf"
    command = [sys.executable, "-m", "titan", "convert", "dcp-to-hf", str(run_dir), str(out)]
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600,
                            preexec_fn=lambda: os.umask(umask))  # fmt: skip
    assert result.returncode == 0, result.stderr
    modes = {p.name: oct(p.stat().st_mode & 0o777) for p in out.iterdir()}
    assert "model.safetensors" in modes and modes == dict.fromkeys(modes, oct(0o666 & ~umask))
    assert out.stat().st_mode & 0o777 == 0o777 & ~umask


# -- the model card ------------------------------------------------------------------------------------------------


def card(folder: Path) -> tuple[dict, str]:
    """(the README's YAML front matter, as huggingface_hub reads a model card; its text)."""
    from huggingface_hub import ModelCard

    text = (folder / "README.md").read_text()
    return ModelCard(text).data.to_dict(), text


def test_the_model_card_holds_the_recipe_tokens_and_losses_of_the_run(exported, run_dir):
    data, text = card(exported)
    assert data["library_name"] == "transformers" and data["pipeline_tag"] == "text-generation"
    assert {"titan", "llama3"} <= set(data["tags"]) and "license" not in data
    assert "# license:" in text.split("---")[1]  # left for the user, who is told where
    train, val = metrics(run_dir)
    n_params = sum(p.numel() for p in transformers.AutoModelForCausalLM.from_pretrained(exported).parameters())
    for fact in (
        "| steps | 4 |",
        "| tokens seen | 512 |",  # 4 steps of 4 rows of 32 tokens
        f"| parameters | {n_params:,} |",
        "| model | llama3, flavor debug (dim = 64, n_heads = 4, n_kv_heads = 2, n_layers = 2, multiple_of = 32, "
        "resid_dropout = 0.1) |",
        "| data | stories.jsonl |",  # the file's name: the card says nothing of the machine's folders
        "| batch | 4 sequences of 32 tokens |",
        "| context length | trained at 32 tokens (positions up to 2,048) |",  # not the positions the model takes
        "| optimizer | adamw, lr 0.01, weight decay 0.1; no warmup, cosine decay to 0.1 x lr |",
        f"| final training loss (step 4) | {train[4]:.4f} |",
        f"| final validation loss (step 4) | {val[4]:.4f} |",
        f"| best validation loss (step {min(val, key=val.get)}) | {min(val.values()):.4f} |",
        "1,170 tokens; BOS `<|begin_of_text|>` (0), EOS `<|end_of_text|>` (1), which also pads",
        f'AutoTokenizer.from_pretrained("{exported}", padding_side="left")',  # the folder, where not pushed
    ):
        assert fact in text, (fact, text)


def test_the_card_names_sources_without_local_paths_and_keeps_each_value_in_its_cell():
    """A card is published: a local source is named by its file, not the folder it sat in on the training machine
    (a home folder, a user name); corpora and hub datasets by their names; a `|` or a line break in a recipe's
    value stays inside its table cell."""
    from titan.checkpoint.hf.card import _recipe_rows, _table

    sources = ["/home/alice/clients/acme/q3|notes.jsonl", "roneneldan/TinyStories", "titan:shakespeare"]
    recipe = {"model": {"name": "llama3", "flavor": "debug", "overrides": {"note": "a|b\nc"}},
              "data": {"sources": [{"source": s, "weight": 1.0} for s in sources]}}  # fmt: skip
    table = _table(_recipe_rows(recipe, {"step": 3, "tokens_seen": 9}, 10, 32))
    assert "/home" not in table and "alice" not in table
    assert "| data | q3\\|notes.jsonl (weight 1.0), roneneldan/TinyStories (weight 1.0), titan:shakespeare" in table
    assert "(note = a\\|b c) |" in table
    assert all(line.count("|") - line.count("\\|") == 3 for line in table.splitlines()), table


def test_the_card_of_a_run_in_stages_names_each_stage_and_where_it_began():
    from titan.checkpoint.hf.card import _recipe_rows, _table

    stages = [
        {"name": "pretrain", "start_step": 0, "start_tokens": 0, "sources": [{"source": "titan:shakespeare"}]},
        {"name": "anneal", "start_step": 140, "start_tokens": 0,
         "sources": [{"source": "/home/alice/stories.jsonl", "weight": 3.0}, {"source": "titan:shakespeare"}]},
    ]  # fmt: skip
    recipe = {"model": {"name": "llama3", "flavor": "debug"}, "data": {"source": "", "stages": stages}}
    table = _table(_recipe_rows(recipe, {"step": 200, "tokens_seen": 9}, 10, 32))
    want = "| data | pretrain: titan:shakespeare; anneal after 140 steps: stories.jsonl (weight 3.0), titan:shakespeare"
    assert want in table, table


def test_the_card_of_an_earlier_checkpoint_has_its_own_losses(run_dir, tmp_path):
    """Exported from step 2 of the 4-step run: the losses logged at step 2, not the run's last ones."""
    hf_io.dcp_to_hf(run_dir / "checkpoints" / "step-2", tmp_path / "step2")
    train, val = metrics(run_dir)
    _, text = card(tmp_path / "step2")
    assert "| steps | 2 |" in text and "| tokens seen | 256 |" in text
    assert f"| final training loss (step 2) | {train[2]:.4f} |" in text
    assert f"| final validation loss (step 2) | {val[2]:.4f} |" in text
    assert f"| best validation loss (step 2) | {val[2]:.4f} |" in text
    assert f"{val[4]:.4f}" not in text and f"{train[4]:.4f}" not in text


def test_the_card_of_weights_titan_did_not_train_says_so(exported, tmp_path):
    """HF -> titan -> HF: a step-0 checkpoint, whose recipe's data and optimizer are defaults that trained nothing."""
    hf_io.hf_to_dcp(exported, tmp_path / "dcp")
    hf_io.dcp_to_hf(tmp_path / "dcp", tmp_path / "back")
    _, text = card(tmp_path / "back")
    assert "not trained by titan" in text and "| training | none in titan (step 0) |" in text
    assert "| parameters |" in text and "| optimizer |" not in text and "| tokens seen |" not in text


# -- --push-to-hub -------------------------------------------------------------------------------------------------

TOKEN = "hf_local_test_token"
DENIED = "acme/denied"


class Hub:
    """A hub that answers what huggingface_hub's create_repo and upload_folder send: the repo's creation, the
    model card's check, the preupload check (every file a regular git blob, sent inline in the commit, base64),
    and the commit. It keeps each repo's files and refuses a request without TOKEN, and any upload to DENIED."""

    def __init__(self):
        self.repos: dict[str, dict[str, bytes]] = {}
        self.created: dict[str, dict] = {}  # repo -> what create_repo asked
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):  # quiet
                pass

            def do_POST(self):
                hub.answer(self)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def answer(self, request: BaseHTTPRequestHandler) -> None:
        path = unquote(urlparse(request.path).path)
        body = request.rfile.read(int(request.headers.get("Content-Length", 0)))
        if request.headers.get("Authorization") != f"Bearer {TOKEN}":
            return self.send(request, 401, {"error": "Invalid credentials in Authorization header"})
        if path == "/api/validate-yaml":  # the model card's front matter, checked before the upload
            return self.send(request, 200, {"errors": [], "warnings": []})
        if path == "/api/repos/create":
            payload = json.loads(body)
            repo = f"{payload['organization']}/{payload['name']}"
            if repo == DENIED:
                return self.send(request, 403, {"error": "You don't have the rights to create a model under acme"})
            self.repos.setdefault(repo, {})
            self.created[repo] = payload
            return self.send(request, 200, {"url": f"{self.url}/{repo}"})
        repo, action = "/".join(path.split("/")[3:5]), path.split("/")[5]
        if action == "preupload":
            files = [{"path": f["path"], "uploadMode": "regular", "shouldIgnore": False}
                     for f in json.loads(body)["files"]]  # fmt: skip
            return self.send(request, 200, {"files": files})
        if action == "commit":
            for line in body.decode().splitlines():
                item = json.loads(line)
                if item["key"] == "file":
                    self.repos[repo][item["value"]["path"]] = base64.b64decode(item["value"]["content"])
            return self.send(request, 200, {"commitUrl": f"{self.url}/{repo}/commit/1", "commitOid": "1" * 40})
        self.send(request, 404, {"error": "not found"})

    @staticmethod
    def send(request, status: int, payload: dict) -> None:
        data = json.dumps(payload).encode()
        request.send_response(status)
        request.send_header("Content-Type", "application/json")
        request.send_header("Content-Length", str(len(data)))
        request.end_headers()
        request.wfile.write(data)


@pytest.fixture(scope="module")
def hub():
    server = Hub()
    yield server
    server.server.shutdown()


def hub_env(hub: Hub, tmp_path: Path, token: str = TOKEN) -> dict:
    """The local hub, and no credentials but `token` (none cached)."""
    return {"HF_ENDPOINT": hub.url, "HF_TOKEN": token, "HF_TOKEN_PATH": str(tmp_path / "no-token"),
            "HF_HOME": str(tmp_path / "hf-home"), "HF_HUB_DISABLE_TELEMETRY": "1"}  # fmt: skip


def test_push_to_hub_uploads_the_exported_files(run_dir, hub, tmp_path):
    out = tmp_path / "hf"
    result = run_titan("convert", "dcp-to-hf", str(run_dir), str(out), "--push-to-hub", "acme/tiny-story",
                       "--private", env=hub_env(hub, tmp_path))  # fmt: skip
    assert result.returncode == 0, result.stderr
    files = {p.name: p.read_bytes() for p in out.iterdir()}
    assert {"model.safetensors", "config.json", "README.md", *hf_io.TOKENIZER_FILES} <= files.keys()
    assert hub.repos["acme/tiny-story"] == files  # every file, byte for byte
    assert f"{hub.url}/acme/tiny-story" in result.stdout
    assert hub.created["acme/tiny-story"].get("visibility") == "private"
    assert 'from_pretrained("acme/tiny-story")' in files["README.md"].decode()  # the card names the repo


def test_push_to_hub_without_credentials_or_rights_is_one_line(run_dir, hub, tmp_path):
    """No token: refused before exporting. A bad name: the same. A hub that refuses: the export is kept."""
    args = ["convert", "dcp-to-hf", str(run_dir), str(tmp_path / "hf"), "--push-to-hub"]
    result = run_titan(*args, "acme/tiny", env=hub_env(hub, tmp_path, token=""))
    assert_one_line_error(result, "--push-to-hub acme/tiny", "no Hugging Face credentials", "hf auth login", "HF_TOKEN")
    assert_one_line_error(run_titan(*args, "not a repo", env=hub_env(hub, tmp_path)), "'not a repo'", "owner/name")
    assert not (tmp_path / "hf").exists()
    result = run_titan(*args, DENIED, env=hub_env(hub, tmp_path))
    assert_one_line_error(result, f"--push-to-hub {DENIED}", "403", "the export in", "is complete", "hf upload")
    assert (tmp_path / "hf" / "model.safetensors").is_file()
    nowhere = {**hub_env(hub, tmp_path), "HF_ENDPOINT": "http://127.0.0.1:9"}  # nothing listens on port 9
    result = run_titan(*args[:3], str(tmp_path / "hf2"), "--push-to-hub", "acme/tiny", env=nowhere)
    assert_one_line_error(result, "--push-to-hub acme/tiny", "cannot reach the hub at http://127.0.0.1:9")


def test_a_run_folder_moved_away_from_its_tokenizer_generates_and_exports_with_the_one_it_trained_with(tmp_path):
    """The run folder holds a copy of its tokenizer: moved to where the recipe's tokenizer.path does not exist (as
    on another machine), `titan generate` and `titan convert dcp-to-hf` read the copy, and the export has a
    tokenizer."""
    import shutil

    from conftest import DEBUG_RECIPE, tiny_overrides
    from titan.config import load_config
    from titan.train.trainer import Trainer

    own = tmp_path / "mine" / "tokenizer.json"
    own.parent.mkdir()
    shutil.copyfile(ROOT / "data" / "tokenizer.json", own)
    overrides = {**SMALL, "training.steps": "1", "tokenizer.path": str(own)}
    Trainer(load_config(DEBUG_RECIPE, tiny_overrides(tmp_path / "runs", **overrides))).train()
    moved = tmp_path / "elsewhere"
    shutil.move(tmp_path / "runs" / "debug", moved)
    shutil.rmtree(own.parent)
    generated = run_titan("generate", "--checkpoint", str(moved), "--prompt", "Once upon", "--max-new-tokens", "3")
    assert generated.returncode == 0, generated.stderr
    assert generated.stdout.strip()  # the continuation
    result = run_titan("convert", "dcp-to-hf", str(moved), str(tmp_path / "hf"))
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "hf" / "tokenizer.json").read_bytes() != b""
    assert transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")("Once upon")["input_ids"][0] == 0  # its BOS
