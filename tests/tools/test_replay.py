"""`titan verify --replay`: the digests a run records, the spike that calls for a replay, the comparison's rules on
hand-made digests, and from the command line a planted silent data corruption named by rank and step, and a clean
step reproduced."""

import json
import logging
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
