"""What protects a run's checkpoints and says what went wrong: non-finite losses, recipe changes on resume,
rewinds, a second run on the same folder, damaged files, write errors."""

import json
import os
import re
import shutil
import subprocess
import sys

import pytest
import torch

from conftest import DEBUG_RECIPE, ROOT, run_titan, tiny_overrides
from helpers import SAVED, SMALL, assert_one_line_error, full_weights, start_long_run, trainer_for
from runs import trained_run
from titan.checkpoint.checkpointer import Checkpointer, RunRecord
from titan.checkpoint.format import seal, verify
from titan.checkpoint.resume import changed_keys, complete_checkpoints
from titan.config import load_config, math_values
from titan.errors import ConfigError
from titan.optim import FiniteFlags
from titan.train.step import StepHook
from titan.train.stop import NonFinite
from titan.train.trainer import Trainer


def train(tmp_path, **extra):
    return run_titan("train", "--config", str(DEBUG_RECIPE), *tiny_overrides(tmp_path, **{**SMALL, **extra}))


def checkpoints(tmp_path) -> dict:
    return complete_checkpoints(tmp_path / "debug" / "checkpoints")


def saved_loss(path) -> float | None:
    return json.loads((path / "train_state.json").read_text())["loss"]


def metrics(tmp_path) -> list[dict]:
    return [json.loads(line) for line in (tmp_path / "debug" / "metrics.jsonl").read_text().splitlines()]


# -- NaN and inf

HUGE_LR = {"optimizer.lr": "1e4", "checkpoint.interval": "1", "checkpoint.keep_latest_k": "2"}


def test_a_nan_run_stops_with_one_line_and_keeps_its_good_checkpoints(tmp_path):
    failed = train(tmp_path, **HUGE_LR)
    newest = max(checkpoints(tmp_path))
    good = newest - 1  # the newest holds the weights that the NaN step started from
    last_good = checkpoints(tmp_path)[good]
    assert_one_line_error(
        failed, f"step {newest + 1}", "nan", str(last_good), f"--checkpoint.load_step {good}",
        "--checkpoint.allow_changes optimizer.lr",
    )  # fmt: skip
    # Nothing was saved from the NaN step on, nothing good was pruned, and what is kept holds finite losses.
    assert sorted(checkpoints(tmp_path)) == [good, newest]
    assert all(saved_loss(p) is not None for p in checkpoints(tmp_path).values())
    lower = {**HUGE_LR, "optimizer.lr": "1e-3"}
    refused = train(tmp_path, **lower)
    assert_one_line_error(refused, "optimizer.lr 10000.0 -> 0.001", "--checkpoint.allow_changes optimizer.lr")
    # (That lr left weights too large to recover, so this resumed run soon stops again: a rerun only shows
    # where it resumes from; the next test trains on to the end.)
    resumed = train(
        tmp_path, **lower, **{"checkpoint.allow_changes": "optimizer.lr", "checkpoint.load_step": str(good)}
    )
    assert f"resumed from {last_good}" in resumed.stderr


def stopped_at(result) -> int:
    """The step a NaN stop names."""
    return int(re.search(r"^error: step (\d+):", result.stderr, re.MULTILINE).group(1))


class Diverging(StepHook):
    """A run that diverges at step `at_step` (its loss turns NaN) when trained at lr `lr` or more, or when it
    resumed from the weights that step started from: a stand-in for a learning rate too high that every machine
    rounds alike (the real run trains at that lr without trouble). `lr` and `start` are set from the trainer."""

    def __init__(self, at_step: int, lr: float):
        self.at_step, self.limit, self.lr, self.start = at_step, lr, None, None

    def loss(self, step, loss):
        poisoned = self.lr >= self.limit or self.start >= self.at_step - 1
        return loss * float("nan") if step + 1 == self.at_step and poisoned else loss


def diverging_trainer(tmp_path, overrides: dict) -> Trainer:
    trainer = trainer_for(tmp_path, Diverging(at_step=9, lr=3e-3), **overrides)
    trainer.hook.lr, trainer.hook.start = trainer.config.optimizer.lr, trainer.step
    return trainer


def advice_overrides(error: str) -> dict:
    """The overrides the NaN stop's line says to add to the command."""
    flags = re.search(r"adding (.+) to the command", error).group(1).split()
    return {flag.removeprefix("--"): value for flag, value in zip(flags[::2], flags[1::2])}


# The NaN comes at step 9: every 8 steps, the only checkpoint holds the weights it came from.
@pytest.mark.parametrize("interval", ["1", "8"], ids=["a checkpoint known good", "none known good"])
def test_following_the_nan_stops_advice_trains_past_the_step_that_failed(tmp_path, interval):
    high = {**HUGE_LR, "optimizer.lr": "3e-3", "training.steps": "12", "checkpoint.interval": interval}
    with pytest.raises(NonFinite) as failed:
        diverging_trainer(tmp_path, high).train()
    assert "step 9:" in str(failed.value) and "lower learning rate" in str(failed.value)
    advice = advice_overrides(str(failed.value))
    assert float(advice["optimizer.lr"]) == 1.5e-3
    # The same run with the advice added, as the line says: it resumes from weights whose next step was healthy
    # (step 7's; resuming from step 8's would meet the NaN again), or starts again where none is known good.
    assert advice.get("checkpoint.load_step", advice.get("checkpoint.resume")) == ("7" if interval == "1" else "never")
    followed = diverging_trainer(tmp_path, {**high, **advice})
    start = followed.step
    assert start == (7 if interval == "1" else 0)
    assert len(followed.train()) == 12 - start


def test_a_checkpoint_whose_next_step_spiked_is_not_known_good(tmp_path):
    """A diverging run's loss spikes before it turns NaN: the weights the spiking step started from are already
    ruined, so the NaN stop names the checkpoint before them, by the run's own spike rule."""

    class SpikeThenNan(StepHook):
        def loss(self, step, loss):
            return loss * {8: 1e3, 9: float("nan")}.get(step + 1, 1.0)

    # A planted loss 1000 times the run's is tens of thousands of deviations above it; no step of this run's own
    # comes near 100.
    spike_rule = {"replay.spike_zscore": "100", "replay.spike_window": "4"}
    overrides = {**HUGE_LR, **spike_rule, "optimizer.lr": "3e-3", "checkpoint.keep_latest_k": "0"}
    trainer = trainer_for(tmp_path, SpikeThenNan(), **overrides)
    with pytest.raises(NonFinite) as stop:
        trainer.train()
    found = checkpoints(tmp_path)
    assert [step for step, path in found.items() if proven(path)] == [1, 2, 3, 4, 5, 6]
    assert f"last good checkpoint is {found[6]}:" in str(stop.value) and "--checkpoint.load_step 6" in str(stop.value)


def proven(path) -> bool:
    return (path / "NEXT_STEP_FINITE").is_file()


@pytest.mark.parametrize("async_save", ["false", "true"])
def test_pruning_keeps_the_checkpoint_whose_next_step_was_finite_and_never_names_the_poisoned_one(tmp_path, async_save):
    trainer = trainer_for(tmp_path, **{**HUGE_LR, "checkpoint.keep_latest_k": "1", "checkpoint.async_save": async_save})
    with pytest.raises(NonFinite) as stop:
        trainer.train()
    nan_step = trainer.step
    found = checkpoints(tmp_path)
    # step-(nan_step - 1) holds the weights the NaN step started from; the one before is the last good one.
    good, poisoned = found[nan_step - 2], found[nan_step - 1]
    assert sorted(found) == [nan_step - 2, nan_step - 1]
    assert f"last good checkpoint is {good}:" in str(stop.value)
    assert f"--checkpoint.load_step {nan_step - 2}" in str(stop.value)
    assert proven(good) and not proven(poisoned)
    assert verify(good) is None  # the mark is no file of the checkpoint's


def test_a_checkpoint_is_good_once_the_step_after_it_ran_finite_in_this_run_or_a_resumed_one(tmp_path):
    schedule = {"checkpoint.interval": "1", "checkpoint.keep_latest_k": "0"}
    trainer_for(tmp_path, **schedule, **{"training.steps": "3"}).train()
    # The final step's checkpoint is not known good: its next step has not run.
    assert [proven(p) for p in checkpoints(tmp_path).values()] == [True, True, False]
    trainer_for(tmp_path, **schedule, **{"training.steps": "4", "checkpoint.allow_changes": "training.steps"}).train()
    assert [proven(p) for p in checkpoints(tmp_path).values()] == [True, True, True, False]


class NanLoss(StepHook):
    """The loss of step `at_step` turns NaN, as an overflow in it would make it: the loss and its gradients."""

    def __init__(self, at_step: int):
        self.at_step, self.steps_run = at_step, []

    def loss(self, step, loss):
        self.steps_run.append(step + 1)
        return loss * float("nan") if step + 1 == self.at_step else loss


class NanGradient(StepHook):
    """The gradients of step `at_step` turn NaN (its loss stays finite), as an overflow in backward would make
    them; keeps each step's gradient norm."""

    def __init__(self, at_step: int):
        self.at_step, self.norm = at_step, None

    def loss(self, step, loss):
        if step + 1 == self.at_step:
            loss.register_hook(lambda grad: grad * float("nan"))
        return loss

    def step(self, step, batches, run):
        local, self.norm = run(batches)
        return local, self.norm


def test_after_a_nan_stop_the_resumed_run_equals_an_uninterrupted_one(tmp_path):
    schedule = {"checkpoint.interval": "2", "checkpoint.keep_latest_k": "2"}
    straight = trainer_for(tmp_path / "straight", **schedule).train()
    poisoned = trainer_for(tmp_path / "run", NanLoss(at_step=6), **schedule)
    with pytest.raises(NonFinite, match=r"step 6: loss nan.*last good checkpoint is .*step-4"):
        poisoned.train()
    assert sorted(checkpoints(tmp_path / "run")) == [2, 4]
    resumed = trainer_for(tmp_path / "run", **schedule)
    assert resumed.step == 4
    assert resumed.train() == straight[4:]  # bitwise


def test_a_nan_stops_the_run_before_the_next_step_between_logs(tmp_path):
    """The loop brings losses to the host only where it logs; a NaN still stops it before the step after it."""
    nan = NanLoss(at_step=3)
    trainer = trainer_for(
        tmp_path, nan, **{"metrics.log_freq": "10", "training.steps": "10", "checkpoint.interval": "100"}
    )
    with pytest.raises(NonFinite, match=r"step 3: loss nan"):
        trainer.train()
    assert trainer.step == 3 and max(nan.steps_run) == 3  # step 4 never ran


def test_finite_flags_are_read_lag_steps_late_and_once():
    flags = FiniteFlags(torch.device("cpu"))
    assert flags.lag == 0
    flags.lag = 1  # a GPU's lag, with the CPU's flags
    norms = [1.0, float("nan"), 2.0, 3.0]
    due = []
    for norm in norms:
        due.append(flags.nonfinite_due())  # as each step starts
        flags.add(torch.tensor(norm))
    assert due == [False, False, False, True]  # step 2's NaN is read as step 4 starts
    assert not flags.nonfinite_due()
    flags.add(torch.tensor(float("inf")))
    flags.clear()  # the loop settled every step itself
    flags.add(torch.tensor(1.0))
    assert not flags.nonfinite_due() and not flags.nonfinite_due()


def test_skipped_steps_leave_weights_and_optimizer_untouched_and_keep_the_last_finite_checkpoint(tmp_path):
    nan_gradient = NanGradient(at_step=3)
    trainer = trainer_for(
        tmp_path, nan_gradient, **{"training.on_nonfinite": "skip", "training.max_skipped_steps": "3"}
    )
    trainer.train(until=2)
    before = full_weights(trainer)
    moments = {n: trainer.optimizer.state[p]["exp_avg"].clone() for n, p in trainer.model_parts.named_parameters()}
    trainer.train(until=3)  # counted, not raised
    norm = nan_gradient.norm
    assert trainer.step == 3 and trainer.nonfinite.skipped_in_a_row == 1 and not torch.isfinite(norm)
    for name, value in full_weights(trainer).items():
        assert torch.equal(value, before[name]), name
    for name, p in trainer.model_parts.named_parameters():
        assert torch.equal(trainer.optimizer.state[p]["exp_avg"], moments[name]), name
    trainer.train(until=4)
    norm = nan_gradient.norm
    assert trainer.nonfinite.skipped_in_a_row == 0 and torch.isfinite(norm)


def test_skip_mode_stops_after_max_skipped_steps_and_pruning_spares_the_last_finite_checkpoint(tmp_path):
    failed = train(tmp_path, **HUGE_LR, **{"training.on_nonfinite": "skip", "training.max_skipped_steps": "3"})
    assert_one_line_error(failed, "3 steps in a row skipped", "training.max_skipped_steps")
    found = checkpoints(tmp_path)
    finite = [s for s, p in found.items() if saved_loss(p) is not None]
    skipped = [s for s, p in found.items() if saved_loss(p) is None]
    # keep_latest_k = 2 keeps the two skipped steps' checkpoints, and the last good one besides: not the one
    # before the first skipped step, whose weights made it non-finite.
    assert len(skipped) == 2 and finite == [min(skipped) - 2], found
    assert f"last good checkpoint is {found[finite[0]]}" in failed.stderr  # not the newest, a skipped step's
    assert f"--checkpoint.load_step {finite[0]}" in failed.stderr


# -- resuming with another recipe


def test_a_changed_lr_is_refused_without_allow_changes_and_applies_with_it(tmp_path):
    common = {
        "training.steps": "6",
        "checkpoint.interval": "3",
        "lr_scheduler.decay": "constant",
        "lr_scheduler.warmup_steps": "1",
    }
    first = train(tmp_path, **{**common, "training.steps": "3"})
    assert first.returncode == 0, first.stderr
    refused = train(tmp_path, **common, **{"optimizer.lr": "1e-4"})
    # (A constant schedule does not depend on training.steps: the longer run needs no permission.)
    assert_one_line_error(refused, "optimizer.lr 0.003 -> 0.0001", "--checkpoint.allow_changes optimizer.lr")
    resumed = train(tmp_path, **common, **{"optimizer.lr": "1e-4", "checkpoint.allow_changes": "optimizer.lr"})
    assert resumed.returncode == 0, resumed.stderr
    assert "resuming with a changed recipe (checkpoint.allow_changes): optimizer.lr 0.003 -> 0.0001" in resumed.stderr
    lrs = {m["step"]: m["lr"] for m in metrics(tmp_path) if "lr" in m}
    assert lrs[3] == 3e-3 and lrs[4] == lrs[6] == 1e-4  # constant after a one-step warmup


def test_a_changed_batch_size_keeps_counting_tokens_from_the_checkpoint(tmp_path):
    first = train(tmp_path, **{"training.steps": "2", "lr_scheduler.warmup_steps": "1"})
    assert first.returncode == 0, first.stderr
    change = {"training.steps": "4", "lr_scheduler.warmup_steps": "1", "training.local_batch_size": "2"}
    refused = train(tmp_path, **change)
    assert_one_line_error(refused, "training.global_batch 4 -> 2")
    resumed = train(tmp_path, **change, **{"checkpoint.allow_changes": "training.global_batch,training.steps"})
    assert resumed.returncode == 0, resumed.stderr
    tokens = {m["step"]: m["tokens_seen"] for m in metrics(tmp_path) if "tokens_seen" in m}
    assert tokens[2] == 2 * 4 * 32 and tokens[4] == tokens[2] + 2 * 2 * 32


def test_a_finished_run_says_so_and_exits_0(tmp_path):
    done = train(tmp_path, **{"training.steps": "2", "lr_scheduler.warmup_steps": "1"})
    again = train(tmp_path, **{"training.steps": "2", "lr_scheduler.warmup_steps": "1"})
    assert done.returncode == again.returncode == 0, again.stderr
    assert "already at step 2 of training.steps 2: nothing to train" in again.stderr
    assert sorted(checkpoints(tmp_path)) == [2]


def test_every_key_that_changes_which_tokens_train_or_validate_is_checked_on_resume():
    base = math_values(load_config(DEBUG_RECIPE), 8)
    changes = {
        "validation.fraction": "0.1",
        "validation.source": "data/held_out.jsonl",
        "validation.format": "json",
        "validation.text_field": "body",
        "validation.split": "test",
        "validation.revision": "main",
        "validation.steps": "8",
        "tokenizer.bos_token": "<|end_of_text|>",
        "tokenizer.eos_token": "<|begin_of_text|>",
        "data.format": "json",
        "data.split": "test",
        "data.subset": "en",
        "data.revision": "main",
        "float8.skip": "output,w2",
    }
    for key, value in changes.items():
        refused, _ = changed_keys(base, math_values(load_config(DEBUG_RECIPE, [f"--{key}", value]), 8), [])
        assert [change.split(" ")[0] for change in refused] == [key]


def grown(corpus) -> None:
    with open(corpus, "a") as f:
        f.write(json.dumps({"text": "One more story, appended after the run began."}) + "\n")


def test_a_source_that_grew_behind_the_same_path_is_refused_and_resumes_with_allow_changes(tmp_path, capsys):
    corpus = tmp_path / "stories.jsonl"
    shutil.copy(ROOT / "data" / "stories.jsonl", corpus)
    run = {**SAVED, "data.source": str(corpus)}
    trainer_for(tmp_path, **run).train()
    grown(corpus)
    with pytest.raises(ConfigError) as refused:
        trainer_for(tmp_path, **run)
    message = str(refused.value)
    assert "data.prepared" in message and "\n" not in message
    assert "'documents': 2600" in message and "'documents': 2601" in message
    assert "--checkpoint.allow_changes data.prepared" in message
    capsys.readouterr()
    resumed = trainer_for(tmp_path, **run, **{"checkpoint.allow_changes": "data.prepared"})
    assert resumed.step == 2
    (line,) = [line for line in capsys.readouterr().err.splitlines() if "allow_changes" in line]
    assert "data.prepared" in line and "'documents': 2601" in line


def test_a_checkpoint_without_the_data_record_resumes_with_one_warning(tmp_path, capsys):
    """A checkpoint of a titan that recorded neither the prepared data nor the validation keys: nothing to compare
    them with, so the run resumes and says once what it could not check."""
    trainer_for(tmp_path, **SAVED).train()
    (path,) = checkpoints(tmp_path).values()
    state = json.loads((path / "train_state.json").read_text())
    for key in ("data.prepared", "validation.fraction", "validation.source"):
        state["math"].pop(key, None)
    (path / "train_state.json").write_text(json.dumps(state))
    (path / "manifest.json").unlink()
    (path / "COMPLETE").unlink()
    seal(path)
    capsys.readouterr()
    resumed = trainer_for(tmp_path, **SAVED, **{"validation.fraction": "0.1"})
    assert resumed.step == 2
    (line,) = [line for line in capsys.readouterr().err.splitlines() if "older titan" in line]
    assert "validation.fraction" in line and "data.prepared" in line and "not checked" in line


# -- rewinding and replacing


def test_a_rewound_run_replaces_its_later_checkpoints(tmp_path):
    first = train(tmp_path, **{"training.steps": "6", "checkpoint.interval": "2", "checkpoint.keep_latest_k": "0"})
    assert first.returncode == 0, first.stderr
    old = {s: (p / "__0_0.distcp").stat().st_mtime_ns for s, p in checkpoints(tmp_path).items()}
    # Rewind to step 2 with another lr: steps 4 and 6 are trained again, differently.
    rewound = train(
        tmp_path,
        **{"training.steps": "6", "checkpoint.interval": "2", "checkpoint.keep_latest_k": "0"},
        **{"checkpoint.load_step": "2", "optimizer.lr": "1e-3", "checkpoint.allow_changes": "optimizer.lr"},
    )
    assert rewound.returncode == 0, rewound.stderr
    found = checkpoints(tmp_path)
    assert sorted(found) == [2, 4, 6]
    for step in (4, 6):
        assert (found[step] / "__0_0.distcp").stat().st_mtime_ns > old[step]
        assert verify(found[step]) is None
    (aside,) = (tmp_path / "debug" / "checkpoints" / "rewound").iterdir()
    assert sorted(p.name for p in aside.iterdir()) == ["step-4", "step-6"]
    assert "rewound to step 2" in rewound.stderr


def _checkpointer(folder, model):
    from titan.config import Checkpoint
    from titan.parallel.parallelize import ModelParts

    optimizer = torch.optim.AdamW(model.parameters())
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)

    class Loader:
        def state_dict(self):
            return {"next_sample": 0}

        def load_state_dict(self, state):
            pass

    shapes = {n: list(p.shape) for n, p in model.named_parameters()}
    states = {"model": ModelParts([model], [0], 1), "optimizer": optimizer, "lr_scheduler": scheduler, "data": Loader()}
    record = RunRecord({"name": "toy", "flavor": "-", "shapes": shapes}, recipe="")
    return Checkpointer(Checkpoint(), folder, states, record, rank=0, save_group=None, control_group=None)


def test_an_existing_step_is_replaced_and_a_replacement_cut_short_is_undone(tmp_path):
    folder = tmp_path / "checkpoints"
    model = torch.nn.Linear(3, 2)
    _checkpointer(folder, model).save(3, tokens_seen=0, loss=1.0)
    with torch.no_grad():
        model.weight.fill_(7.0)
    _checkpointer(folder, model).save(3, tokens_seen=0, loss=1.0)
    assert sorted(p.name for p in folder.iterdir()) == ["step-3"]
    fresh = torch.nn.Linear(3, 2)
    _checkpointer(folder, fresh).resume()
    assert torch.equal(fresh.weight, model.weight)
    # A crash between moving the old step-3 aside and renaming the new one into place: the old one comes back.
    (folder / "step-3").rename(folder / ".replaced-step-3")
    (folder / ".tmp-step-3").mkdir()
    _checkpointer(folder, fresh)
    assert sorted(p.name for p in folder.iterdir()) == ["step-3"] and verify(folder / "step-3") is None


def test_incomplete_step_folders_are_removed_at_start_up(tmp_path):
    folder = tmp_path / "checkpoints"
    (folder / "step-8").mkdir(parents=True)  # no COMPLETE marker
    (folder / "step-8" / "__0_0.distcp").write_bytes(b"partial")
    _checkpointer(folder, torch.nn.Linear(3, 2))
    assert not (folder / "step-8").exists()


# -- one run per folder


def test_a_second_run_on_the_same_folder_is_refused_and_a_dead_runs_lock_is_taken_over(tmp_path):
    first = start_long_run(tmp_path)
    try:
        second = train(tmp_path, **{"training.steps": "3000"})
        assert_one_line_error(second, str(tmp_path / "debug"), "in use by another titan run", f"PID {first.pid}")
    finally:
        first.kill()  # SIGKILL: no clean-up, the lock file stays behind
        first.wait()
    assert (tmp_path / "debug" / ".lock").exists()
    third = train(tmp_path, **{"training.steps": "2", "lr_scheduler.warmup_steps": "1",
                               "checkpoint.allow_changes": "training.steps"})  # fmt: skip
    assert third.returncode == 0, third.stderr


# -- damaged checkpoints


@pytest.fixture(scope="module")
def two_checkpoints():
    return trained_run(**{"training.steps": "4", "checkpoint.interval": "2", "lr_scheduler.warmup_steps": "1"})


def copy_run(source, tmp_path):
    shutil.copytree(source / "debug" / "checkpoints", tmp_path / "debug" / "checkpoints")
    return checkpoints(tmp_path)


RESUME_4 = {"training.steps": "4", "checkpoint.interval": "2", "lr_scheduler.warmup_steps": "1"}


@pytest.mark.parametrize("damage", ["flipped byte", "missing data.json"])
def test_a_damaged_checkpoint_is_skipped_and_auto_resume_falls_back(tmp_path, two_checkpoints, damage):
    found = copy_run(two_checkpoints, tmp_path)
    if damage == "flipped byte":
        shard = found[4] / "__0_0.distcp"
        data = bytearray(shard.read_bytes())
        data[len(data) // 2] ^= 0x01
        shard.write_bytes(bytes(data))
        problem = "__0_0.distcp does not match its SHA-256"
    else:
        (found[4] / "data.json").unlink()
        problem = "data.json is missing"
    resumed = train(tmp_path, **RESUME_4)
    assert resumed.returncode == 0, resumed.stderr
    assert f"skipping damaged checkpoint {found[4]}: {problem}" in resumed.stderr
    assert f"resumed from {found[2]}" in resumed.stderr
    assert verify(checkpoints(tmp_path)[4]) is None  # step 4 trained again and saved whole
    explicit = train(tmp_path / "other", **RESUME_4, **{"checkpoint.resume": str(found[2].parent / "step-4")})
    assert explicit.returncode == 0, explicit.stderr  # the re-saved step 4 is good


def test_resuming_explicitly_from_a_damaged_checkpoint_is_a_clear_error(tmp_path, two_checkpoints):
    found = copy_run(two_checkpoints, tmp_path)
    with open(found[4] / "__0_0.distcp", "r+b") as f:
        f.seek(100)
        byte = f.read(1)
        f.seek(100)
        f.write(bytes([byte[0] ^ 0xFF]))
    result = train(tmp_path / "other", **RESUME_4, **{"checkpoint.resume": str(found[4])})
    assert_one_line_error(result, str(found[4]), "__0_0.distcp does not match its SHA-256", "another checkpoint")


# -- write errors


def test_a_full_disk_is_named_in_one_line(tmp_path):
    run = tmp_path / "debug"
    run.mkdir()
    os.symlink("/dev/full", run / "metrics.jsonl")  # every write to it fails with ENOSPC
    result = train(tmp_path, **{"training.steps": "2", "lr_scheduler.warmup_steps": "1"})
    assert_one_line_error(result, "metrics.jsonl", "no space left on device")


def test_a_full_disk_during_a_save_names_the_checkpoint_and_keeps_the_last_one(tmp_path, monkeypatch):
    import errno

    from titan.checkpoint.checkpointer import SaveError
    from titan.checkpoint.format import CheckpointWriter

    folder = tmp_path / "checkpoints"
    model = torch.nn.Linear(3, 2)
    _checkpointer(folder, model).save(1, tokens_seen=0, loss=1.0)

    def full_disk(writer, plan, planner):  # where DCP's writer fails on a full disk: DCP wraps it per rank
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(writer.path) + "/__0_0.distcp")

    monkeypatch.setattr(CheckpointWriter, "write_data", full_disk)
    with pytest.raises(SaveError) as error:
        _checkpointer(folder, model).save(2, tokens_seen=0, loss=1.0)
    assert re.fullmatch(
        r"checkpoint step 2: cannot write \S*__0_0.distcp: no space left on device; .*step-1, is intact\)",
        str(error.value),
    ), str(error.value)
    assert sorted(complete_checkpoints(folder)) == [1]


@pytest.mark.parametrize("where", ["a file", "read-only"])
def test_an_output_folder_that_cannot_be_written_is_one_line(tmp_path, where):
    if where == "a file":
        target = tmp_path / "afile"
        target.write_text("")
        words = ["job.output_dir", "a file stands where a folder is needed"]
    elif os.geteuid() == 0:  # root writes through file modes: use a read-only mount instead
        target = "/sys/titan-test"
        words = ["job.output_dir", "cannot write", "/sys/titan-test"]
    else:
        target = tmp_path / "ro"
        target.mkdir()
        target.chmod(0o500)
        words = ["job.output_dir", "permission denied"]
    result = train(tmp_path, **{"job.output_dir": str(target)})
    assert_one_line_error(result, *words)


@pytest.mark.slow
def test_kill_9_at_random_moments_never_leaves_a_wrong_checkpoint_and_resumes_bitwise(tmp_path):
    """20 runs killed at random moments (tests/kill_trials.py), half of them saving asynchronously: every
    checkpoint that verification accepts holds exactly what the uninterrupted run saved at that step, and the
    resumed run's losses are bitwise the uninterrupted run's."""
    result = subprocess.run(
        [sys.executable, str(ROOT / "tests" / "kill_trials.py"), str(tmp_path), "20", "0"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=1200,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    trials = json.loads(result.stdout.splitlines()[-1])["trials"]
    assert len(trials) == 20
    for trial in trials:
        assert trial["differing"] == [] and trial["losses_equal"], trial
    assert any(t["during_save"] for t in trials)  # some kills landed in the middle of a save
    assert len({t["resumed_from"] for t in trials}) >= 4, trials  # ... and the others all along the run
