"""docs/your-data.md, walked as a newcomer walks it: its commands, in its order, from a folder of gzipped books; its
recipe; and its transformers snippet, which must print what `titan generate` does."""

from __future__ import annotations

import ast
import gzip
import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import ROOT

pytest.importorskip("transformers")
pytest.importorskip("lm_eval")

PAGE = ROOT / "docs" / "your-data.md"
# What makes the page's run a test's: a minute, not the page's 300 steps of 256 tokens.
QUICK = ["--training.steps", "6", "--training.seq_len", "64", "--validation.interval", "3", "--validation.steps", "1",
         "--metrics.wandb", "disabled", "--metrics.tensorboard", "false"]  # fmt: skip
TASK = """task: my_task
dataset_path: json
dataset_kwargs:
  data_files:
    test: tasks/my_task.jsonl
test_split: test
output_type: multiple_choice
doc_to_text: "{{query}}"
doc_to_target: label
doc_to_choice: choices
metric_list:
  - metric: acc
"""


def blocks(language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", PAGE.read_text(), flags=re.S)


def write_books(folder: Path) -> list[str]:
    """The project's stories as 12 gzipped books of 200 and a held-out pair of 50: one document per file."""
    stories = [json.loads(line)["text"] for line in (ROOT / "data" / "stories.jsonl").read_text().splitlines()]
    (folder / "books").mkdir()
    (folder / "held_out").mkdir()
    for i in range(12):
        text = "\n\n".join(stories[200 * i : 200 * (i + 1)])
        (folder / "books" / f"book{i:02}.txt.gz").write_bytes(gzip.compress(text.encode()))
    for i in range(2):
        (folder / "held_out" / f"book{i}.txt").write_text("\n\n".join(stories[2400 + 50 * i : 2450 + 50 * i]))
    (folder / "tasks").mkdir()
    (folder / "tasks" / "my_task.yaml").write_text(TASK)
    docs = [{"query": s.split(".")[0].rsplit(" ", 1)[0], "choices": [" " + s.split(".")[0].rsplit(" ", 1)[1], " x"],
             "label": 0} for s in stories[2500:2510]]  # fmt: skip
    (folder / "tasks" / "my_task.jsonl").write_text("".join(json.dumps(d) + "\n" for d in docs))
    return stories


def titan(folder: Path, line: str) -> subprocess.CompletedProcess:
    words = shlex.split(line)
    assert words[0] == "titan"
    extra = QUICK if words[1] == "train" else []
    result = subprocess.run([sys.executable, "-m", "titan", *words[1:], *extra], cwd=folder, capture_output=True,
                            text=True, timeout=600, env={**os.environ, "WANDB_MODE": "disabled"})  # fmt: skip
    assert result.returncode == 0, (line, result.stderr[-3000:])
    return result


@pytest.mark.scenario
@pytest.mark.slow
def test_the_page_walks_from_books_to_a_shared_model(tmp_path):
    write_books(tmp_path)
    (tmp_path / "my-model.toml").write_text(blocks("toml")[0])
    lines = [line for block in blocks("bash") for line in block.splitlines() if line.startswith("titan ")]
    assert [shlex.split(line)[1] for line in lines] == ["tokenizer", "train", "eval", "eval", "generate", "convert"]
    out = {line: titan(tmp_path, line) for line in lines}

    tokenizer_line, train_line, ppl_line, task_line, _, export_line = lines
    assert "trained on 12 documents" in out[tokenizer_line].stdout  # a book is a document, gzipped or not
    summary = out[train_line].stdout + out[train_line].stderr
    assert "outputs/my-model/checkpoints/step-6" in summary
    assert re.search(r"perplexity [\d.]+", out[ppl_line].stdout), out[ppl_line].stdout
    assert re.search(r"my_task.*acc", out[task_line].stdout), out[task_line].stdout
    export = tmp_path / "my-model-hf"
    assert {"config.json", "model.safetensors", "tokenizer.json", "README.md"} <= {p.name for p in export.iterdir()}

    # The page's transformers snippet prints, for its prompts batched with padding, what titan generate prints.
    snippet = blocks("python")[0]
    prompts = ast.literal_eval(re.search(r"tokenizer\((\[.*?\])", snippet).group(1))
    new = re.search(r"max_new_tokens=(\d+)", snippet).group(1)
    printed = subprocess.run([sys.executable, "-c", snippet], cwd=tmp_path, capture_output=True, text=True,
                             timeout=600)  # fmt: skip
    assert printed.returncode == 0, printed.stderr[-3000:]
    generated = titan(tmp_path, shlex.join(["titan", "generate", "--checkpoint", "outputs/my-model",
                      *[a for p in prompts for a in ("--prompt", p)], "--max-new-tokens", new]))  # fmt: skip
    texts = [json.loads(line)["text"] for line in generated.stdout.splitlines()]
    assert ast.literal_eval(printed.stdout.strip().splitlines()[-1]) == texts
    assert all(texts), texts
