"""The straggler simulator at 1,024 devices: titan's re-planner against static shares and an oracle."""

import pytest

from conftest import run_titan
from titan.tools.simulate.stragglers import Scenario, compare


def test_replanning_beats_static_shares_and_nears_the_oracle_at_1024_devices():
    results = compare(Scenario(devices=1024, tp=8, seed=0))  # one device 3x slower for steps 50-150, brief blips
    static, titan, oracle = results["static"], results["titan"], results["oracle"]
    assert titan["slow_phase_rows_per_s"] >= 1.5 * static["slow_phase_rows_per_s"]
    assert titan["rows_per_s"] >= 0.9 * oracle["rows_per_s"]
    assert titan["replans"] == 2  # once when the device slows, once when it recovers: brief blips move nothing
    assert static["replans"] == 0


def test_micro_batches_of_one_row_leave_nothing_to_move_and_of_two_rows_most_of_it():
    """Every plan is one the trainer runs: at one row per micro-batch each of the 128 replicas must run as many
    micro-batches as it has rows, so the shares stay even; at two rows the slow replica can run about half."""
    one, two = (compare(Scenario(local_batch_size=rows)) for rows in (1, 2))
    assert one["titan"]["slow_phase_rows_per_s"] == pytest.approx(one["static"]["slow_phase_rows_per_s"], rel=0.01)
    assert one["oracle"]["rows_per_s"] == pytest.approx(one["static"]["rows_per_s"], rel=1e-12)
    assert two["titan"]["slow_phase_rows_per_s"] >= 1.5 * two["static"]["slow_phase_rows_per_s"]
    assert two["titan"]["rows_per_s"] >= 0.95 * two["oracle"]["rows_per_s"]


def test_the_cli_prints_a_table_of_the_three_policies():
    result = run_titan(
        "simulate", "stragglers", "--devices", "64", "--tp", "4", "--steps", "200", "--local-batch-size", "2"
    )
    assert result.returncode == 0, result.stderr
    rows = {line.split()[0] for line in result.stdout.splitlines()[2:]}
    assert rows == {"static", "titan", "oracle"}
    assert "16 data-parallel replicas" in result.stdout and "micro-batches of at most 2 rows" in result.stdout


def test_the_packing_cli_compares_static_cp_with_cp_placement():
    result = run_titan("simulate", "packing", "--cp", "8", "--steps", "1", "--flavor", "1B")
    assert result.returncode == 0, result.stderr
    rows = [line.split() for line in result.stdout.splitlines() if line.startswith("1B")]
    assert [row[1] for row in rows] == ["tokens", "cost", "placed", "cut", "bound"]
    assert "64 ranks (8 cp groups of 8)" in result.stdout
