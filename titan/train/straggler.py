"""Straggler detection: each data-parallel rank times the same small matmul probe, the times are gathered, and
the data shares follow the ranks' speeds, with hysteresis so that noise never moves them.

Why a probe rather than timing the step's own forward and backward: under FSDP every rank waits inside
forward and backward for the collectives, so the slowest rank makes every rank's step equally long and the
step time cannot say who is slow. A fixed probe measures each device's current speed (throttling, a noisy
neighbour, a contended core) with nothing to wait for; it costs a few milliseconds every `interval` steps.
"""

from __future__ import annotations

import statistics
from collections import deque

import torch
import torch.distributed as dist

from titan.config import Layout
from titan.observe.profiling import DeviceTimer


class StragglerDetector:
    """Turns probe times (seconds, one per rank, the same work on each) into data-parallel weights.

    Each rank's time is the median of its last `window` probes, and its speed that time relative to the
    fastest rank's (1 for the fastest). A rank is a straggler when the fastest is at least `threshold` times
    quicker. The candidate weights are the stragglers' speeds and 1 for every other rank. The plan changes
    only when some candidate weight differs from the weight in force by more than `hysteresis`: noise of +-20%
    around one speed never gets there, a rank falling to a third of the others' speed does at once, and the
    plan then holds while the speeds stay. (With the defaults, even shares change once a rank is about 1.43x
    slower.)
    """

    def __init__(self, ranks: int, threshold: float = 1.2, hysteresis: float = 0.3, window: int = 7):
        self.threshold, self.hysteresis = threshold, hysteresis
        self.history = [deque(maxlen=window) for _ in range(ranks)]
        self.weights = [1.0] * ranks  # the plan in force

    def speeds(self) -> list[float]:
        medians = [statistics.median(h) for h in self.history]
        return [min(medians) / m for m in medians]

    def update(self, times: list[float]) -> list[float] | None:
        """Record one probe per rank; returns the new weights when the plan must change, else None."""
        for history, t in zip(self.history, times):
            history.append(t)
        if len(self.history[0]) < self.history[0].maxlen:
            return None
        # Stragglers get their speed; every other rank counts as fast (noise among them moves nothing).
        candidate = [s if s * self.threshold <= 1 else 1.0 for s in self.speeds()]
        if max(abs(c - w) for c, w in zip(candidate, self.weights)) <= self.hysteresis:
            return None
        self.weights = candidate
        return candidate


class Probe:
    """A fixed matmul workload, timed on this rank's device."""

    def __init__(self, device: torch.device, size: int = 256, repeats: int = 8):
        generator = torch.Generator().manual_seed(0)
        self.a = torch.randn(size, size, generator=generator).to(device)
        self.repeats, self.device = repeats, device

    def seconds(self) -> float:
        x, timer = self.a, DeviceTimer(self.device)
        timer.start()
        for _ in range(self.repeats):
            x = torch.tanh(x @ self.a)
        timer.stop()
        return timer.seconds()


def gather_times(seconds: float, index: int, count: int, device: torch.device) -> list[float]:
    """The probe time of each of `count` groups of ranks (data-parallel or pipeline ranks; this rank is in
    group `index`): the slowest of the group's ranks. One all-reduce over every rank, so that all of them,
    tensor-parallel peers included, see the same times and make the same plan."""
    times = torch.zeros(count, dtype=torch.float64, device=device)
    times[index] = seconds
    if dist.is_initialized():
        dist.all_reduce(times, op=dist.ReduceOp.MAX)
    return times.tolist()


def foreign_plan(measured_on: dict | None, here: dict) -> str | None:
    """Why a saved re-plan does not hold for this run, or None when it does. `measured_on` and `here`: the
    layout (degrees) and each rank's device (host and local rank), in rank order, of the run that measured the
    speeds and of this one. On another layout the plan's weights or layer counts do not fit the ranks; on other
    devices (another allocation, or the same hosts in another order) they would slow a healthy one."""
    if measured_on is None:
        return "it does not say which devices it was measured on"
    if measured_on["layout"] != here["layout"]:
        saved, current = (Layout(**x["layout"]).name for x in (measured_on, here))
        return f"it was measured on layout {saved} and this run is {current}"
    if measured_on["devices"] != here["devices"]:
        moved = sum(a != b for a, b in zip(measured_on["devices"], here["devices"]))
        return f"{moved} of the {len(here['devices'])} ranks are on other devices (host:local rank) than it measured"
    return None
