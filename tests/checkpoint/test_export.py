"""An export people share: `titan convert dcp-to-hf` writes a folder that batches in transformers (a pad token),
whose files have the modes the user's umask gives, with a model card (README.md) of the run, and that
`--push-to-hub` uploads through huggingface_hub, here to a local hub server (HF_ENDPOINT) that keeps what it is
sent."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from conftest import DEBUG_RECIPE, ROOT, run_titan, tiny_overrides  # noqa: E402
from helpers import SMALL  # noqa: E402
from titan.checkpoint import hf as hf_io  # noqa: E402
from titan.config import load_config  # noqa: E402
from titan.train.trainer import Trainer  # noqa: E402

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
def run_dir(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("run")
    Trainer(load_config(DEBUG_RECIPE, tiny_overrides(root, **RUN))).train()
    return root / "debug"


@pytest.fixture(scope="module")
def exported(run_dir) -> Path:
    """The run's newest checkpoint (step 4) through the CLI."""
    out = run_dir.parent / "hf"
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


@pytest.mark.parametrize("umask", [0o022, 0o077])
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
        "| data | data/stories.jsonl |",
        "| batch | 4 sequences of 32 tokens |",
        "| optimizer | adamw, lr 0.01, weight decay 0.1; no warmup, cosine decay to 0.1 x lr |",
        f"| final training loss (step 4) | {train[4]:.4f} |",
        f"| final validation loss (step 4) | {val[4]:.4f} |",
        f"| best validation loss (step {min(val, key=val.get)}) | {min(val.values()):.4f} |",
        "1,170 tokens; BOS `<|begin_of_text|>` (0), EOS `<|end_of_text|>` (1), which also pads",
        f'AutoTokenizer.from_pretrained("{exported}", padding_side="left")',  # the folder, where not pushed
    ):
        assert fact in text, (fact, text)


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
