"""Evaluation in the run: [[validation.sets]] and [eval]'s lm-eval tasks between steps. What a run logs at a step
is what `titan eval` scores on the checkpoint of that step (the validation set's loss with --data, the tasks with
--tasks); a task that fails is one line and training goes on; on FSDP2 the run logs what one process does
(scenario). The tasks are local files under tests/fixtures/lm_eval_tasks."""

from __future__ import annotations

import json
import shutil

import pytest

from conftest import DEBUG_RECIPE, ROOT, run_titan, run_titan_ranks, tiny_overrides
from helpers import assert_one_line_error, trainer_for
from titan.config import load_config
from titan.errors import ConfigError
from titan.tools.compare import figure, load_run

TASKS = ROOT / "tests" / "fixtures" / "lm_eval_tasks"
BATCH, STEPS = 4, 2  # validation: 2 global batches of 4 sequences of 64 tokens


def held_out(tmp_path):
    """Two sources of their own, a set each: the first and the last 40 stories."""
    lines = (ROOT / "data" / "stories.jsonl").read_text().splitlines(keepends=True)
    (tmp_path / "head.jsonl").write_text("".join(lines[:40]))
    (tmp_path / "tail.jsonl").write_text("".join(lines[-40:]))
    return tmp_path / "head.jsonl", tmp_path / "tail.jsonl"


def eval_overrides(tmp_path, **extra) -> list[str]:
    head, tail = held_out(tmp_path)
    sets = f'[{{name = "head", source = "{head}"}}, {{name = "tail", source = "{tail}"}}]'
    return tiny_overrides(
        tmp_path,
        **{"training.steps": "4", "optimizer.lr": "1e-2", "checkpoint.enable": "true", "validation.interval": "2",
           "validation.steps": str(STEPS), "validation.sets": sets, "eval.interval": "2",
           "eval.tasks": "titan_stories_next", "eval.include_path": str(TASKS), **extra},
    )  # fmt: skip


def logged(run_dir, key: str) -> dict[int, float]:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r[key] for r in records if key in r}


def test_the_runs_evaluation_is_titan_eval_on_the_checkpoint_of_its_step(tmp_path):
    """A 4-step run evaluates at steps 2 and 4: both sets and the task, into metrics.jsonl and the plot. At step 4
    the head set's loss is `titan eval --data`'s on the step-4 checkpoint, over the same batches, and the task's
    scores (its continuations' perplexity, and how many were the greedy ones) are `titan eval --tasks`'. The task
    reads a local file: titan turns HF's offline switches on for it."""
    run = run_titan("train", "--config", str(DEBUG_RECIPE), *eval_overrides(tmp_path))
    assert run.returncode == 0, run.stderr
    run_dir = tmp_path / "debug"
    metrics = ("val/head/loss", "val/tail/loss", "eval/titan_stories_next/perplexity", "eval/titan_stories_next/acc")
    for key in metrics:
        assert sorted(logged(run_dir, key)) == [2, 4], key
    assert logged(run_dir, "val/head/loss")[2] > logged(run_dir, "val/head/loss")[4]  # it learns
    out = tmp_path / "results.json"
    reference = run_titan(
        "eval", "--checkpoint", str(run_dir / "checkpoints" / "step-4"), "--data", str(tmp_path / "head.jsonl"),
        "--batches", str(STEPS), "--batch-size", str(BATCH), "--tasks", "titan_stories_next",
        "--include-path", str(TASKS), "--output", str(out),
    )  # fmt: skip
    assert reference.returncode == 0, reference.stderr
    scored = json.loads(out.read_text())
    assert logged(run_dir, "val/head/loss")[4] == pytest.approx(scored["perplexity"]["loss"], rel=1e-5)
    next_word = scored["tasks"]["titan_stories_next"]
    assert logged(run_dir, "eval/titan_stories_next/perplexity")[4] == pytest.approx(
        next_word["perplexity,none"], rel=1e-5
    )
    assert logged(run_dir, "eval/titan_stories_next/acc")[4] == next_word["acc,none"]
    titles = [ax.get_title() for ax in figure([load_run(run_dir)]).axes]
    assert "validation sets: loss" in titles and "eval tasks" in titles


def test_a_failing_task_is_one_line_and_training_goes_on(tmp_path, capfd, monkeypatch):
    """A task whose data file is gone by the time it runs fails inside lm-eval: one warning line, the other task
    still scores, and every step trains."""
    for switch in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE"):  # what the run would set, undone after the test
        monkeypatch.setenv(switch, "1")
    folder = tmp_path / "tasks"
    shutil.copytree(TASKS, folder)
    gone = (folder / "stories_choice.yaml").read_text().replace("task: titan_stories_choice", "task: titan_gone")
    (folder / "gone.yaml").write_text(gone.replace("tests/fixtures/lm_eval_tasks", str(tmp_path / "nowhere")))
    trainer = trainer_for(tmp_path, **{"training.steps": "2", "eval.interval": "2", "eval.include_path": str(folder),
                                       "eval.tasks": "titan_gone,titan_stories_next"})  # fmt: skip
    assert len(trainer.train()) == 2
    failed = [line for line in capfd.readouterr().err.splitlines() if "eval task" in line]  # the trainer's handler
    assert len(failed) == 1 and "step 2: eval task titan_gone failed (FileNotFoundError" in failed[0], failed
    assert failed[0].endswith("training goes on")
    assert sorted(logged(tmp_path / "debug", "eval/titan_stories_next/perplexity")) == [2]


@pytest.mark.parametrize(
    ("overrides", "words"),
    [
        ({"eval.interval": "5"}, ["eval.tasks and eval.interval go together"]),
        ({"eval.tasks": "hellaswag"}, ["eval.tasks and eval.interval go together"]),
        ({"eval.tasks": "hellaswag", "eval.interval": "5", "parallel.pp": "2"}, ["pp = 2", "titan eval --checkpoint"]),
        ({"eval.tasks": "hellaswag", "eval.interval": "5", "eval.include_path": "no/such"}, ["eval.include_path"]),
        ({"validation.sets": '[{name = "a", source = "data/stories.jsonl"}]', "validation.interval": "5"},
         ["validation.sets[0].source", "memorisation"]),
        ({"validation.sets": '[{name = "a", source = "x.txt"}, {name = "a", source = "y.txt"}]',
          "validation.interval": "5"}, ["two sets are named 'a'"]),
        ({"validation.sets": '[{name = "a/b", source = "x.txt"}]', "validation.interval": "5"}, ["letters, digits"]),
        ({"validation.sets": '[{name = "a", source = "x.txt"}]'}, ["validation.interval, which is 0"]),
    ],
)  # fmt: skip
def test_the_recipe_is_refused_in_one_line(tmp_path, overrides, words):
    with pytest.raises(ConfigError) as refused:
        load_config(DEBUG_RECIPE, tiny_overrides(tmp_path, **overrides), world_size=2)
    assert "\n" not in str(refused.value) and all(w in str(refused.value) for w in words), str(refused.value)


@pytest.mark.scenario
def test_a_task_lm_eval_does_not_know_is_refused_at_start_up(tmp_path):
    """Refused before any step, in one line naming the key (lm-eval's whole task index is read: seconds)."""
    result = run_titan("train", "--config", str(DEBUG_RECIPE), *eval_overrides(tmp_path, **{"eval.tasks": "nope"}))
    assert_one_line_error(result, "eval.tasks: nope is no lm-eval task", "lm_eval ls tasks")
    assert not (tmp_path / "debug" / "metrics.jsonl").exists() or not logged(tmp_path / "debug", "loss")


@pytest.mark.scenario
def test_fsdp2_evaluates_as_one_process(tmp_path):
    """Every rank runs the tasks through its shard of the model: the scores and the sets' losses are one
    process's."""
    one, two = tmp_path / "one", tmp_path / "two"
    one.mkdir(), two.mkdir()
    assert run_titan("train", "--config", str(DEBUG_RECIPE), *eval_overrides(one)).returncode == 0
    fsdp2 = {"parallel.dp_shard": "2", "training.local_batch_size": "2"}
    fsdp = run_titan_ranks(2, "train", "--config", str(DEBUG_RECIPE), *eval_overrides(two, **fsdp2))
    assert fsdp.returncode == 0, fsdp.stderr
    for key in (
        "val/head/loss",
        "val/tail/loss",
        "eval/titan_stories_next/perplexity",
        "eval/titan_stories_next/acc",
    ):
        assert logged(two / "debug", key) == pytest.approx(logged(one / "debug", key), rel=1e-5), key
