"""`titan verify --replay`: the digests a run records, the spike that calls for a replay, the comparison's rules on
hand-made digests, and from the command line a planted silent data corruption named by rank and step, and a clean
step reproduced."""

import json
import logging
import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
import torch.distributed as dist

from conftest import DEBUG_RECIPE, run_titan, tiny_overrides
from distributed import run_distributed
from helpers import TINY_MODEL, assert_one_line_error, trainer_for
from titan.config import Replay, load_config
from titan.tools.verify.replay import bitwise
from titan.train.digests import DIGESTS, SPIKES, SpikeWatch, digest
from titan.train.step import StepHook
from titan.train.trainer import Trainer


def test_a_digest_changes_with_one_bit_of_one_element_and_not_with_the_order():
    t = torch.randn(1000, generator=torch.Generator().manual_seed(0))
    flipped = t.clone()
    flipped.view(torch.int32)[123] ^= 1  # the lowest mantissa bit
    assert digest(flipped) != digest(t)
    assert digest(t.flip(0)) == digest(t)
    assert digest(t.double()).dtype == torch.int64


def line(step, grads=(1, 2), params=(3, 4), loss=1.5, grad_norm=0.5):
    return {"step": step, "loss": loss, "grad_norm": grad_norm, "grads": list(grads), "params": list(params)}


def ranks(*lines_per_rank):
    """Each rank's digests: {"world", "tp", "steps": {step: line with names}}."""
    names = ["a.weight", "b.weight"]
    return [
        {"world": len(lines_per_rank), "tp": 1, "steps": {x["step"]: {**x, "names": names} for x in lines}}
        for lines in lines_per_rank
    ]


def test_the_rank_whose_result_differs_first_in_the_step_is_named():
    recorded = ranks([line(1), line(2)], [line(1), line(2)])
    assert bitwise(recorded, recorded, range(1, 3))[1] is None
    # Step 2: rank 1's gradient of b.weight differs; so does the norm, and then every rank's weights.
    replayed = ranks([line(1), line(2, params=(3, 9), grad_norm=0.6)], [line(1), line(2, (1, 7), (3, 9), 1.5, 0.6)])
    lines, (step, named) = bitwise(recorded, replayed, range(1, 3))
    assert step == 2 and [rank for rank, _ in named] == [1]
    assert "gradients differ bitwise, first at b.weight" in named[0][1]
    assert "step 1: bitwise equal on all 2 ranks" in lines[0]
    assert any("rank 0: gradient norm differs bitwise" in x for x in lines)


def test_a_spike_is_logged_with_its_replay_once_the_window_is_full(tmp_path, caplog):
    watch = SpikeWatch(Replay(spike_zscore=4, spike_window=5), tmp_path, rank=0)
    with caplog.at_level(logging.WARNING, logger="titan"):
        for step, norm in enumerate([50.0, 1.0, 1.1, 0.9, 1.0, 1.05, 1.0, 9.0], start=1):
            watch.check(step, 2.0, norm)
    # Step 1's 50 came before a full window: not judged. Step 8's 9 is a spike.
    assert [json.loads(x)["step"] for x in (tmp_path / SPIKES).read_text().splitlines()] == [8]
    assert f"titan verify --replay 8 --checkpoint {tmp_path / 'checkpoints'}" in caplog.text


class SpikeAt(StepHook):
    """Step `at`'s loss, and so its gradients, 100 times larger."""

    def __init__(self, at: int):
        self.at = at

    def loss(self, step, loss):
        return loss * 100 if step + 1 == self.at else loss


def test_a_run_records_digests_and_its_gradient_norm_spike(tmp_path):
    settings = {"replay.digests": "true", "replay.spike_zscore": "5", "replay.spike_window": "3"}
    trainer = trainer_for(tmp_path, SpikeAt(4), **settings, **{"training.steps": "4", "checkpoint.enable": "false"})
    trainer.train()
    spikes = [json.loads(x) for x in (trainer.run_dir / SPIKES).read_text().splitlines()]
    assert [(s["step"], s["what"]) for s in spikes] == [(4, "loss"), (4, "gradient norm")]
    lines = [json.loads(x) for x in (trainer.run_dir / DIGESTS / "rank0.jsonl").read_text().splitlines()]
    assert "names" in lines[0] and [x["step"] for x in lines[1:]] == [1, 2, 3, 4]
    assert len(lines[1]["grads"]) == len(lines[1]["params"]) == len(lines[0]["names"])


# ---------------------------------------------------------------------------------------------------------------
# From the command line
# ---------------------------------------------------------------------------------------------------------------

CORRUPT_STEP, CORRUPT_RANK = 3, 1
RUN = {
    **TINY_MODEL,
    "training.seq_len": "32",
    "training.local_batch_size": "2",
    "training.steps": "3",
    "parallel.dp_shard": "2",
    "checkpoint.interval": "1",
    "replay.digests": "true",
}


class FlipOneBit(StepHook):
    """Silent data corruption: the sign bit of the largest element of rank `rank`'s first gradient shard flipped at
    step `at`, after its backward and before the update. (A flip of its magnitude alone can leave the update as it
    was: Adam's first update of an element is the sign of its gradient times the lr.)"""

    def __init__(self, at: int, rank: int):
        self.at, self.rank = at, rank

    def gradients(self, step, parts):
        if step + 1 == self.at and dist.get_rank() == self.rank:
            grad = next(p.grad for _, p in parts.named_parameters() if p.grad is not None)
            shard = grad._local_tensor.view(-1)  # FSDP's: a DTensor's
            shard.view(torch.int32)[shard.abs().argmax()] ^= -(2**31)  # the sign bit


def train_with_corruption(tmp):
    Trainer(load_config(DEBUG_RECIPE, tiny_overrides(tmp, **RUN)), FlipOneBit(CORRUPT_STEP, CORRUPT_RANK)).train()


@pytest.mark.distributed
@pytest.mark.slow
def test_a_replay_names_the_rank_and_step_of_a_planted_corruption_and_reproduces_a_clean_step(tmp_path):
    run_distributed(train_with_corruption, 2, tmp_path)
    checkpoints = str(tmp_path / "debug" / "checkpoints")
    # The replays' processes use one thread, as the run's did: the same layout must compute bitwise as it did.
    env = {"OMP_NUM_THREADS": "1"}
    with ThreadPoolExecutor(2) as pool:
        clean, corrupt = pool.map(
            lambda step: run_titan("verify", "--replay", str(step), "--checkpoint", checkpoints, env=env),
            (CORRUPT_STEP - 1, CORRUPT_STEP),
        )
    assert clean.returncode == 0, clean.stdout + clean.stderr[-3000:]
    assert f"step {CORRUPT_STEP - 1}: bitwise equal on all 2 ranks" in clean.stdout, clean.stdout
    assert "reproduced: the run's layout bitwise, layout single within tolerance" in clean.stdout, clean.stdout
    assert corrupt.returncode == 1, corrupt.stdout + corrupt.stderr[-3000:]
    verdict = corrupt.stdout.splitlines()[-1]
    first = f"NOT reproduced: step {CORRUPT_STEP} differs from the run first on rank {CORRUPT_RANK} ("
    assert first in verdict, verdict
    assert "gradients differ bitwise, first at tok_embeddings.weight" in verdict, verdict
    # One process computes the step as the replay did, and so departs from the run's weights.
    assert "layout single agrees with the replay and departs from the run" in verdict, corrupt.stdout


def test_a_replay_without_its_checkpoint_or_digests_is_a_clear_error(tmp_path):
    trainer_for(tmp_path, **{"training.steps": "2", "checkpoint.interval": "1"}).train()
    checkpoints = str(tmp_path / "debug" / "checkpoints")
    for args, words in (
        (["--replay", "2"], ["give --checkpoint DIR"]),
        (["--replay", "1", "--checkpoint", checkpoints], ["no checkpoint in", "before step 1 (steps [1, 2])"]),
        (["--replay", "2", "--checkpoint", checkpoints], ["recorded no digests of step 2", "replay.digests = true"]),
        (["--replay", "2", "--checkpoint", str(tmp_path / "nothing")], ["--checkpoint", "does not exist"]),
    ):
        assert_one_line_error(run_titan("verify", *args), *words)


# ---------------------------------------------------------------------------------------------------------------
# In the run (replay.on_spike): a spiked step replayed from the in-memory snapshot before it
# ---------------------------------------------------------------------------------------------------------------

SPIKED = 5
ON_SPIKE = {
    **RUN,
    "model.overrides.resid_dropout": "0.1",  # the replay must draw the step's dropout again
    "training.steps": "7",
    "checkpoint.enable": "false",
    "fault.snapshot_interval": "1",
    "replay.spike_zscore": "5",
    "replay.spike_window": "3",
    "replay.on_spike": "true",
}


class BlowUpOnce(StepHook):
    """Silent data corruption that spikes the gradient norm: the largest element of rank `rank`'s first gradient
    shard 10^4 times larger at step `at`, the first time only (the replay computes it as it should be)."""

    def __init__(self, at: int, rank: int):
        self.at, self.rank, self.done = at, rank, False

    def gradients(self, step, parts):
        if step + 1 == self.at and dist.get_rank() == self.rank and not self.done:
            self.done = True
            shard = next(p.grad for _, p in parts.named_parameters() if p.grad is not None)._local_tensor.view(-1)
            shard[shard.abs().argmax()] *= 1e4


def train_on_spike(tmp, hook, **extra) -> list[float]:
    os.environ["TITAN_SNAPSHOT_DIR"] = str(tmp / "shm")  # this node's shared memory
    (tmp / "shm").mkdir(parents=True, exist_ok=True)
    return Trainer(load_config(DEBUG_RECIPE, tiny_overrides(tmp, **{**ON_SPIKE, **extra})), hook).train()


def replays(run_dir) -> list[dict]:
    return [e for e in map(json.loads, (run_dir / SPIKES).read_text().splitlines()) if "replay" in e]


def with_and_without_replays(tmp, hooks: Callable[[], StepHook]) -> tuple[list[float], list[float]]:
    """The losses of the run with replay.on_spike (in <tmp>/replayed) and without (<tmp>/straight)."""
    straight = train_on_spike(tmp / "straight", hooks(), **{"replay.on_spike": "false"})
    return train_on_spike(tmp / "replayed", hooks()), straight


def assert_nothing_changed(tmp, replayed: list[float], straight: list[float]) -> None:
    """The runs with and without replays the same, bit for bit: every step's loss and each rank's digests (the
    weights after every step); the replayed step neither logged nor recorded twice."""
    assert replayed == straight
    metrics = [json.loads(x) for x in (tmp / "replayed" / "debug" / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics if "loss" in m] == list(range(1, 8))
    for rank in (0, 1):
        digests = [(tmp / run / "debug" / DIGESTS / f"rank{rank}.jsonl").read_text().splitlines()
                   for run in ("replayed", "straight")]  # fmt: skip
        assert [json.loads(x).get("step") for x in digests[0][1:]] == list(range(1, 8))
        assert digests[0] == digests[1]


@pytest.mark.distributed
def test_a_spiked_step_replayed_in_the_run_names_the_rank_whose_gradients_were_corrupted(tmp_path):
    hooks = lambda: BlowUpOnce(SPIKED, CORRUPT_RANK)  # noqa: E731
    losses = run_distributed(with_and_without_replays, 2, tmp_path, hooks)[0]
    run_dir = tmp_path / "replayed" / "debug"
    first = replays(run_dir)[0]
    assert first["step"] == SPIKED and first["replay"] == "differs", first
    assert first["at"] == SPIKED and first["ranks"] == [CORRUPT_RANK], first
    assert "gradients differ bitwise, first at tok_embeddings.weight" in first["what"][0], first
    console = (run_dir / "console.log").read_text()
    verdict = f"NOT reproduced: step {SPIKED} differs first on rank {CORRUPT_RANK} (rank {CORRUPT_RANK}: gradients"
    assert verdict in console, console[-3000:]
    # The run goes on from its own (corrupted) step, not the replay's.
    assert_nothing_changed(tmp_path, *losses)


@pytest.mark.distributed
def test_a_clean_spike_replayed_in_the_run_is_reproduced_and_changes_nothing(tmp_path):
    losses = run_distributed(with_and_without_replays, 2, tmp_path, lambda: SpikeAt(SPIKED))[0]  # the data's spike
    found = replays(tmp_path / "replayed" / "debug")
    assert found and found[0] == {"step": SPIKED, "replay": "reproduced", "from": SPIKED - 1}, found
    assert all(e["replay"] == "reproduced" for e in found), found
    assert_nothing_changed(tmp_path, *losses)
