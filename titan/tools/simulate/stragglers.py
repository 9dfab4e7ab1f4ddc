"""A cluster simulator for straggler policies at scales this machine cannot reach (`titan simulate stragglers`).

N devices in a dp x tp x pp layout train synchronously: a data-parallel replica (tp x pp devices) runs at the
speed of its slowest device, and a step takes as long as the slowest replica needs for its rows. Three
policies share the global batch's rows between replicas, each with plan_shares (titan/balance.py), so
only plans the trainer can run: micro-batches of 1 to `local_batch_size` rows, as many on every replica (and
under a pipeline, of a multiple of pp rows):
- static: even shares, always;
- titan: the StragglerDetector of titan/train/straggler.py on noisy probe times, re-planning for the speeds it
  measured and paying `replan_cost_s` for each re-plan;
- oracle: the best runnable shares for the true speeds of every step, at no cost.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from titan.balance import plan_shares
from titan.train.straggler import StragglerDetector


@dataclass
class Scenario:
    devices: int = 1024
    tp: int = 8
    pp: int = 1
    steps: int = 300
    global_rows: int = 4096
    local_batch_size: int = 8  # most rows per micro-batch (each replica runs as many micro-batches)
    row_time_s: float = 0.01  # one row's forward and backward on a device at full speed
    comm_s: float = 0.05  # the step's collectives, the same for every policy
    replan_cost_s: float = 0.1
    # One device slows down by `slow_factor` from `slow_start` to `slow_end` (a throttled GPU) ...
    slow_factor: float = 3.0
    slow_start: int = 50
    slow_end: int = 150
    # ... and any device, at random, briefly (a noisy neighbour): probability per device and step.
    blip_rate: float = 1e-5
    blip_factor: float = 1.5
    blip_steps: int = 2
    probe_noise: float = 0.05  # relative noise on each probe time
    seed: int = 0

    @property
    def replicas(self) -> int:
        return self.devices // (self.tp * self.pp)

    def shares(self, weights: list[float]) -> list[int]:
        """The trainer's plan for these replica speeds (under a pipeline, titan's default of pp schedule
        micro-batches in each micro-batch)."""
        return plan_shares(self.global_rows, weights, self.local_batch_size, self.pp if self.pp > 1 else 0)


def speed_trace(s: Scenario) -> list[list[float]]:
    """Each replica's speed (1 = full) at every step: the slowest of its devices."""
    rng = random.Random(s.seed)
    group = s.tp * s.pp
    blips: dict[int, int] = {}  # device -> last step of its slowdown
    trace = []
    for step in range(s.steps):
        for device in range(s.devices):
            if rng.random() < s.blip_rate:
                blips[device] = step + s.blip_steps - 1
        blipped = {device // group for device, end in blips.items() if end >= step}
        speeds = [1 / s.blip_factor if replica in blipped else 1.0 for replica in range(s.replicas)]
        if s.slow_start <= step < s.slow_end:
            speeds[0] = min(speeds[0], 1 / s.slow_factor)
        trace.append(speeds)
    return trace


def run_policy(s: Scenario, trace: list[list[float]], policy: str) -> tuple[list[float], int]:
    """Step times under `policy`, and the number of re-plans."""
    rng = random.Random(s.seed + 1)
    shares = s.shares([1.0] * s.replicas)
    detector = StragglerDetector(s.replicas)
    replans, times = 0, []
    for speeds in trace:
        extra = 0.0
        if policy == "oracle":
            shares = s.shares(speeds)
        elif policy == "titan":
            probes = [(1 + rng.uniform(-s.probe_noise, s.probe_noise)) / v for v in speeds]
            weights = detector.update(probes)
            if weights is not None:
                shares, replans, extra = s.shares(weights), replans + 1, s.replan_cost_s
        compute = max(rows * s.row_time_s / v for rows, v in zip(shares, speeds))
        times.append(compute + s.comm_s + extra)
    return times, replans


def compare(s: Scenario) -> dict[str, dict[str, float]]:
    """Throughput (rows/s) over the whole trace and during the slow phase, and re-plans, per policy."""
    trace = speed_trace(s)
    results = {}
    for policy in ("static", "titan", "oracle"):
        times, replans = run_policy(s, trace, policy)
        slow = times[s.slow_start : s.slow_end]
        results[policy] = {
            "rows_per_s": s.global_rows * len(times) / sum(times),
            "slow_phase_rows_per_s": s.global_rows * len(slow) / sum(slow),
            "replans": replans,
        }
    return results
