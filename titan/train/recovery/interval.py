"""When to snapshot: every N steps, or under "auto" the fewest steps whose snapshot costs at most
fault.snapshot_overhead of their time, from the measured times (the plan shows the same rule's choice)."""

from __future__ import annotations

import logging
import math
import statistics
import time

import torch
import torch.distributed as dist

log = logging.getLogger("titan")


def snapshot_every(snapshot_s: float, step_s: float, overhead: float) -> int:
    """The fewest steps between two snapshots for which a snapshot's `snapshot_s` is at most `overhead` of their
    time (`step_s` each): the smallest N >= 1 with snapshot_s / (N x step_s) <= overhead."""
    within = lambda n: snapshot_s / (n * step_s) <= overhead  # noqa: E731
    n = max(1, math.ceil(snapshot_s / (overhead * step_s)))
    while n > 1 and within(n - 1):  # the division above rounds either way: the condition itself decides
        n -= 1
    while not within(n):
        n += 1
    return n


class SnapshotInterval:
    """When to snapshot: every N steps (fault.snapshot_interval = N), or under "auto" from measurements: the
    first two steps, then every N steps for the smallest N whose snapshot costs at most fault.snapshot_overhead
    of their time (snapshot_every), from the medians of the latest snapshots' blocked time and of the time per
    step between two, each measurement the highest of any rank's: every rank picks the same N."""

    LATEST = 5  # measurements in the medians: the first snapshot's one-time costs are outvoted from the third on

    def __init__(self, every: int | str, overhead: float, group):
        self.auto, self.overhead, self.group = every == "auto", overhead, group
        self.steps = 1 if self.auto else every
        self.next = 0  # under auto: the step of the next snapshot
        self.blocked: list[float] = []
        self.step_s: list[float] = []
        self.last: tuple[int, float] | None = None  # the step of the latest snapshot, and when it ended

    def due(self, step: int) -> bool:
        return step >= self.next if self.auto else step % self.steps == 0

    def describe(self) -> str:
        """When snapshots are taken, as the run's start says it."""
        if not self.auto:
            return f"every {self.steps} steps" if self.steps > 1 else "every step"
        return (f"at steps 1 and 2, then every N steps for the smallest N at which a snapshot costs at most "
                f"{self.overhead:.0%} of their time (fault.snapshot_overhead; `titan plan` estimates N for this "
                "hardware)")  # fmt: skip

    def taken(self, step: int, blocked: float) -> None:
        """Snapshot `step` blocked training `blocked` seconds: under auto, measure, and choose the next step."""
        if not self.auto:
            return
        now = time.perf_counter()
        step_s = (now - blocked - self.last[1]) / (step - self.last[0]) if self.last else 0.0
        figures = torch.tensor([blocked, step_s], dtype=torch.float64)
        if self.group is not None:
            dist.all_reduce(figures, op=dist.ReduceOp.MAX, group=self.group)
        self.blocked.append(float(figures[0]))
        self.step_s += [float(figures[1])] if self.last else []
        self.last = (step, time.perf_counter())
        if self.step_s:
            self._choose()
        self.next = step + self.steps

    def _choose(self) -> None:
        """The interval from the medians. Once chosen, N changes only where a snapshot every N steps would cost
        more than the overhead, or where N/2 steps would do: noise at a boundary neither flaps it nor floods the
        log."""
        snapshot_s = statistics.median(self.blocked[-self.LATEST :])
        step_s = statistics.median(self.step_s[-self.LATEST :])
        steps = snapshot_every(snapshot_s, step_s, self.overhead)
        if len(self.step_s) == 1 or steps > self.steps or 2 * steps <= self.steps:
            log.info("fault.snapshot_interval auto: a snapshot every %d step%s (it blocks %.3g s, a step takes "
                     "%.3g s: %.2g%% of their time, fault.snapshot_overhead %g)", steps, "s" * (steps > 1),
                     snapshot_s, step_s, 100 * snapshot_s / (steps * step_s), self.overhead)  # fmt: skip
            self.steps = steps
