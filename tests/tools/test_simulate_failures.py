"""`titan simulate failures`: goodput with disk checkpoints against in-memory snapshots, by the formula and by
Monte Carlo."""

import math
import re

import numpy as np
import pytest

from conftest import DEBUG_RECIPE, run_titan
from helpers import assert_one_line_error
from titan.tools.simulate.failures import (
    Assumptions,
    Workload,
    costs,
    goodput,
    memory_policy,
    simulated_goodput,
    young_daly,
)

HOUR = 3600.0


def test_the_formula_gives_a_hand_computed_goodput():
    """MTBF 1 h; a segment (work + save) and a restart of ln 2 hours each: e^(R/M) = 2 and e^((W+C)/M) - 1 = 1, so
    a segment takes 2 h on average. Its 2,000 s of work make 2000 / 7200 = 5/18 of the time."""
    ln2_hour = math.log(2) * HOUR
    assert goodput(2000, ln2_hour - 2000, ln2_hour, HOUR) == pytest.approx(5 / 18, rel=1e-12)
    # Failures so rare that only the saves cost anything: 600 s of work per 60 s save is 10/11.
    assert goodput(600, 60, 300, 1e15) == pytest.approx(10 / 11, rel=1e-9)


@pytest.mark.parametrize("work, save, restart", [(600, 60, 300), (2000, 5, 60), (9, 0.2, 62), (3600, 53, 330)])
def test_the_monte_carlo_agrees_with_the_formula(work, save, restart):
    simulated = simulated_goodput(work, save, restart, 2 * HOUR, failures=200_000, seed=1)
    assert simulated == pytest.approx(goodput(work, save, restart, 2 * HOUR), abs=0.003)


def test_young_daly_nears_the_best_interval_of_the_simulation():
    """The brute-force optimum of the simulated goodput over the interval, on one set of failure times, is within
    10% of Young/Daly's sqrt(2 x save cost x MTBF), a first-order optimum."""
    save, restart, mtbf = 60.0, 300.0, 2 * HOUR
    intervals = np.arange(300.0, 3000.0, 10.0)
    simulated = [simulated_goodput(w, save, restart, mtbf, failures=200_000, seed=0) for w in intervals]
    best = intervals[int(np.argmax(simulated))]
    assert young_daly(save, mtbf) == pytest.approx(math.sqrt(2 * 60 * 7200))
    assert best == pytest.approx(young_daly(save, mtbf), rel=0.1)


def test_more_frequent_failures_lower_the_goodput():
    hours = [16, 8, 4, 2, 1, 0.5]
    for work, save, restart in ((600, 60, 300), (90, 0.2, 62)):
        formula = [goodput(work, save, restart, h * HOUR) for h in hours]
        simulated = [simulated_goodput(work, save, restart, h * HOUR, failures=50_000, seed=0) for h in hours]
        assert all(a > b for a, b in zip(formula, formula[1:])), formula
        assert all(a > b for a, b in zip(simulated, simulated[1:])), simulated


def test_costs_come_from_the_state_and_the_bandwidths():
    """8 GB per rank, 8 ranks per node (64 GB): 32 s to write at 2 GB/s, 16 s to read at 4; a device copies its 8 GB
    to host memory in 0.125 s at 64 GB/s, a node its 64 GB to the buddy in 1.28 s at 50 GB/s."""
    workload = Workload("test", 64, 8, step_s=1.0, rank_bytes=8 * 10**9, host_gbs=64, network_gbs=50)
    c = costs(workload, Assumptions())
    assert (c.save_s, c.load_s, c.relaunch_s, c.elastic_restart_s) == (32, 16, 300, 60)
    assert (c.snapshot_s, c.buddy_s, c.restore_s) == pytest.approx((0.125, 1.28, 1.405))
    # A snapshot every step waits for the 0.28 s of the previous buddy copy that one 1 s step leaves; every 2 not.
    assert memory_policy("every 1", 1, 1.0, c).save_s == pytest.approx(0.125 + 0.28)
    assert memory_policy("every 2", 2, 1.0, c).save_s == pytest.approx(0.125)
    assert memory_policy("every 2", 2, 1.0, c).restart_s == pytest.approx(60 + 1.405)


def test_the_cli_prints_disk_and_memory_policies_with_their_sources():
    result = run_titan("simulate", "failures", "--config", str(DEBUG_RECIPE), "--node-mtbf-hours", "4")
    assert result.returncode == 0, result.stderr
    assert "mean time between failures 4 h: 4 h per node over 1 node" in result.stdout
    assert "job relaunch 300 s (assumed)" in result.stdout and "elastic restart 60 s (assumed)" in result.stdout
    table = result.stdout.split("\npolicy")[1].splitlines()[1:-1]  # below the heading, above the footnote
    names = [line[:32].strip() for line in table]
    assert names[:3] == ["disk every 10 min", "disk every 30 min", "disk every 60 min"]
    assert names[3].startswith("disk, Young/Daly") and names[-1].startswith("memory, Young/Daly")
    assert names[4:7] == ["memory every 1 step", "memory every 10 steps", "memory every 100 steps"]


def test_measure_times_this_machine_and_uses_its_restarts():
    result = run_titan("simulate", "failures", "--config", str(DEBUG_RECIPE), "--measure", "--failures", "1000")
    assert result.returncode == 0, result.stderr
    assert "measured on this machine, the debug model" in result.stdout
    # The restarts measured, the bandwidths (a cluster's, not this machine's) assumed.
    assert re.search(r"job relaunch [\d.]+ s \(measured\)", result.stdout), result.stdout
    assert re.search(r"elastic restart [\d.]+ s \(measured\)", result.stdout), result.stdout
    assert "save 0.024 s (2 GB/s per node, assumed)" in result.stdout


@pytest.mark.parametrize(
    "args, words",
    [
        (["--mtbf-hours", "0"], ["--mtbf-hours must be > 0", "0.0"]),
        (["--node-mtbf-hours", "-1"], ["--node-mtbf-hours must be > 0"]),
        (["--mtbf-hours", "2", "--node-mtbf-hours", "16"], ["give --mtbf-hours or --node-mtbf-hours, not both"]),
        (["--every-steps", "0,10"], ["--every-steps 0,10", "intervals > 0"]),
        (["--disk-write-gbs", "nan"], ["--disk-write-gbs must be > 0", "nan"]),
        (["--config", "recipes/llama3_70b.toml", "--world-size", "8"], ["do not multiply to the world size 8"]),
        (["--world-size", "0"], ["--world-size must be > 0, got 0"]),
    ],
    ids=["mtbf zero", "node mtbf negative", "both mtbfs", "interval zero", "bandwidth nan", "world size", "no world"],
)
def test_bad_input_is_one_line(args, words):
    config = [] if "--config" in args else ["--config", str(DEBUG_RECIPE)]
    assert_one_line_error(run_titan("simulate", "failures", *config, *args), *words)
