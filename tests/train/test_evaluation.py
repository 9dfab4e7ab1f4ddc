"""Evaluation in the run: [[validation.sets]] and [eval]'s lm-eval tasks between steps. What a run logs at a step
is what `titan eval` scores on the checkpoint of that step (the validation set's loss with --data, the tasks with
--tasks); a task that fails is one line and training goes on; on FSDP2, TP2 (with sequence parallel and loss
parallel, the default test), CP2, EP2 and PP2 the run logs what one process does, and the sharded model decodes
and scores as one process (scenarios). The tasks are local files under tests/fixtures/lm_eval_tasks."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from conftest import DEBUG_RECIPE, ROOT, run_titan, run_titan_ranks, scenarios_beyond, tiny_overrides
from distributed import run_distributed
from helpers import assert_one_line_error, trainer_for
from titan.config import load_config
from titan.errors import ConfigError
from titan.tools.compare import figure, load_run

TASKS = ROOT / "tests" / "fixtures" / "lm_eval_tasks"
MOE_RECIPE = ROOT / "recipes" / "debug_moe.toml"
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


@pytest.mark.parametrize(("recipe", "layout"), [(DEBUG_RECIPE, "pp"), (DEBUG_RECIPE, "cp"), (DEBUG_RECIPE, "tp"),
                                                (MOE_RECIPE, "ep")])  # fmt: skip
def test_no_layout_is_refused_the_tasks(tmp_path, recipe, layout):
    """Every layout runs the tasks on the run's own model (the layouts' tests below), so none is refused them."""
    overrides = {"eval.tasks": "hellaswag", "eval.interval": "5", f"parallel.{layout}": "2"}
    assert load_config(recipe, tiny_overrides(tmp_path, **overrides), world_size=2).eval.tasks == ["hellaswag"]


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


# -- the tasks on sharded layouts, against one process

# A 2-step run that runs both tasks at step 2: the next word's log-likelihood (4 documents) and the first 8 lines of
# the Shakespeare cloze (24 requests).
LAYOUT_TASKS = "titan_stories_next,titan_shakespeare_cloze"
# Measured here: TP2's, CP2's and PP2's perplexity within 5e-7 relative of one process (their steps and TP's
# forwards add the same products in other orders), EP2's equal; 1e-5 leaves room for other CPUs' kernels. Which choice
# or word is likeliest is equal unless two scores tie within that: the accuracies must be equal.
TASK_METRICS = {
    "eval/titan_stories_next/perplexity": 1e-5,
    "eval/titan_stories_next/acc": 0,
    "eval/titan_shakespeare_cloze/acc": 0,
}


def task_overrides(tmp_path, **extra) -> list[str]:
    return tiny_overrides(
        tmp_path,
        **{"training.steps": "2", "optimizer.lr": "1e-2", "eval.interval": "2", "eval.tasks": LAYOUT_TASKS,
           "eval.include_path": str(TASKS), "eval.limit": "8", **extra},
    )  # fmt: skip


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    """The run folder of a recipe's one-process run, made when a test first asks for it."""
    runs = {}

    def run_of(recipe):
        if recipe not in runs:
            folder = tmp_path_factory.mktemp(f"one_process_{recipe.stem}")
            result = run_titan("train", "--config", str(recipe), *task_overrides(folder))
            assert result.returncode == 0, result.stderr
            runs[recipe] = folder / recipe.stem
        return runs[recipe]

    return run_of


LAYOUTS = {  # name: (recipe, processes, overrides)
    "tp2": (DEBUG_RECIPE, 2, {"parallel.tp": "2"}),  # sequence parallel and loss parallel, as recipes default
    "tp2_plain": (DEBUG_RECIPE, 2, {"parallel.tp": "2", "parallel.sequence_parallel": "false",
                                    "parallel.loss_parallel": "false"}),
    "cp2": (DEBUG_RECIPE, 2, {"parallel.cp": "2"}),
    "ep2": (MOE_RECIPE, 2, {"parallel.ep": "2", "training.local_batch_size": "2"}),  # with FSDP2 over the same ranks
    "moe_tp2": (MOE_RECIPE, 2, {"parallel.tp": "2"}),
    "pp2": (DEBUG_RECIPE, 2, {"parallel.pp": "2"}),
    "moe_pp2": (MOE_RECIPE, 2, {"parallel.pp": "2"}),
    # Two stages a rank (a V); a pipeline of tp shards, its stages passing sequence-parallel shards and the last
    # gathering the vocabulary-sharded logits.
    "pp2_v": (DEBUG_RECIPE, 2, {"parallel.pp": "2", "parallel.pp_schedule": "ZBVZeroBubble"}),
    "pp2_tp2": (DEBUG_RECIPE, 4, {"parallel.pp": "2", "parallel.tp": "2"}),
}  # fmt: skip
IN_RUN = ["tp2", "tp2_plain", "cp2", "ep2", "moe_tp2", "pp2", "moe_pp2"]


@pytest.mark.distributed
@pytest.mark.parametrize("layout", scenarios_beyond(["tp2"], IN_RUN))
def test_a_sharded_run_logs_the_tasks_scores_of_one_process(tmp_path, one_process, layout):
    """Every rank runs the same requests through its share of the model, whose logits come whole to each (TP's
    vocabulary shards gathered, SP's sequence shards padded even, CP's rows attended whole on each rank, EP's
    copies of the batch through the experts' all-to-all, the pipeline's stages in order, each one's output
    broadcast): rank 0 logs one process's scores at the same step."""
    recipe, world, overrides = LAYOUTS[layout]
    result = run_titan_ranks(world, "train", "--config", str(recipe), *task_overrides(tmp_path, **overrides))
    assert result.returncode == 0, result.stderr
    assert "eval task" not in result.stderr  # no rank's task failed
    reference = one_process(recipe)
    for key, rel in TASK_METRICS.items():
        assert sorted(logged(tmp_path / recipe.stem, key)) == [2], key
        assert logged(tmp_path / recipe.stem, key) == pytest.approx(logged(reference, key), rel=rel, abs=0), key


def _decoded_and_scored(root, recipe, overrides: dict) -> tuple[list[str], list[tuple[float, bool]]]:
    """On this rank: the run's model at its first weights, as its tasks take it, continuing the stories' four
    openings (greedy, 9 tokens, two prompts of different lengths per batch) and scoring each right word after them."""
    from titan.train import harness
    from titan.train.trainer import Trainer

    trainer = Trainer(load_config(recipe, task_overrides(root, **{"eval.batch_size": "2", **overrides})))
    lm = trainer.evaluation.tasks.lm(trainer.model_parts)
    docs = [json.loads(line) for line in (TASKS / "stories_choice.jsonl").read_text().splitlines()]
    trainer.model_parts.train(False)
    with torch.no_grad():
        texts = harness.generations(lm, [(d["query"], {"until": ["\n"], "max_gen_toks": 9}) for d in docs])
        pairs = [(lm.tok_encode(d["query"]), lm.tok_encode(d["choices"][d["label"]], False)) for d in docs]
        scores = harness.loglikelihoods(lm, [(None, context, word) for context, word in pairs])
    return texts, scores


@pytest.mark.distributed
@pytest.mark.scenario
@pytest.mark.parametrize("layout", ["tp2", "cp2", "ep2", "pp2_v", "pp2_tp2"])
def test_a_sharded_model_decodes_and_scores_as_one_process(tmp_path, layout):
    """Generation (a KV cache of the rank's heads, or of its stages' layers; under SP each forward padded to even
    sequence shards, the padding's cache slots handed back, and a later stage's positions counted on the whole
    sequence) gives one process's texts, and the log-likelihoods are one process's within the tolerance above, on
    every rank."""
    recipe, world, overrides = LAYOUTS[layout]
    [(texts, scores)] = run_distributed(_decoded_and_scored, 1, tmp_path / "one", recipe, {})
    assert any(texts), texts  # something was generated
    for rank_texts, rank_scores in run_distributed(_decoded_and_scored, world, tmp_path / layout, recipe, overrides):
        assert rank_texts == texts
        assert [s for s, _ in rank_scores] == pytest.approx([s for s, _ in scores], rel=1e-5)
        assert [greedy for _, greedy in rank_scores] == [greedy for _, greedy in scores]
