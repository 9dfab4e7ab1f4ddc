"""Goodput under failures (`titan simulate failures`): the share of a run's wall-clock time spent on steps that
count, with disk checkpoints every K minutes against in-memory snapshots every N steps.

The model: failures of the whole job come at random (exponential gaps, mean MTBF), during steps, saves and
restarts alike. A run is a series of segments: `work` seconds of steps, then a save of `save` seconds. A failure
loses the segment in progress and costs a restart of `restart` seconds (which a failure can interrupt too), after
which the segment starts again. For exponential failures the expected wall time of a segment is exactly
M e^(R/M) (e^((W+C)/M) - 1) (M the MTBF, R the restart, W + C the segment), and goodput is W over it.

The Monte Carlo draws the gaps between failures instead: each failure is a fresh start (exponential gaps have no
memory), after which the job restarts and then completes floor((gap - R) / (W + C)) segments before the next
failure; goodput is the work of all completed segments over the sum of the gaps.

The workload is titan's own plan of the recipe (`titan plan`'s estimator): its step time, and each rank's state
(weights and AdamW moments), which a checkpoint or a snapshot copies.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

GB = 1e9  # bandwidths are in GB/s, as datasheets give them


@dataclass(frozen=True)
class Workload:
    """What the plan says of a recipe on `world_size` devices."""

    what: str  # the model, the devices and the layout, in words
    world_size: int
    gpus_per_node: int
    step_s: float
    rank_bytes: int  # the largest rank's weights and optimizer state: what it saves
    host_gbs: float  # the device's link to host memory
    network_gbs: float  # one device's link to other nodes

    @property
    def nodes(self) -> int:
        return math.ceil(self.world_size / self.gpus_per_node)

    @property
    def node_bytes(self) -> int:
        """A node's share of a checkpoint: its ranks' states (an upper bound when replicas hold the same)."""
        return self.rank_bytes * min(self.world_size, self.gpus_per_node)


@dataclass(frozen=True)
class Assumptions:
    """What costs what at scale, where not measured. 0: the plan's device figure (its host link, one NIC)."""

    disk_write_gbs: float = 2.0  # per node, to the shared file system a checkpoint goes to
    disk_read_gbs: float = 4.0  # per node, from it
    host_gbs: float = 0.0  # per device, device memory to host memory
    network_gbs: float = 0.0  # per node, to its buddy node
    relaunch_s: float = 300.0  # a job relaunched by the scheduler: allocation, process start, process groups
    elastic_restart_s: float = 60.0  # torchrun's agent restarting the workers in place


@dataclass(frozen=True)
class Costs:
    """Seconds each event takes, for one workload."""

    save_s: float  # a disk checkpoint, every node writing its share at once
    load_s: float
    relaunch_s: float
    snapshot_s: float  # device to host memory, every device at once
    buddy_s: float  # a node's snapshot to its buddy's host memory, behind the next steps
    restore_s: float  # the lost node's state back from its buddy, then host to device
    elastic_restart_s: float


def costs(workload: Workload, assumed: Assumptions) -> Costs:
    host = (assumed.host_gbs or workload.host_gbs) * GB
    network = (assumed.network_gbs or workload.network_gbs) * GB
    snapshot, buddy = workload.rank_bytes / host, workload.node_bytes / network
    return Costs(
        save_s=workload.node_bytes / (assumed.disk_write_gbs * GB),
        load_s=workload.node_bytes / (assumed.disk_read_gbs * GB),
        relaunch_s=assumed.relaunch_s,
        snapshot_s=snapshot,
        buddy_s=buddy,
        restore_s=buddy + snapshot,
        elastic_restart_s=assumed.elastic_restart_s,
    )


def goodput(work_s: float, save_s: float, restart_s: float, mtbf_s: float) -> float:
    """The expected share of time spent on work that is kept (the module's exact form)."""
    segment = mtbf_s * math.exp(restart_s / mtbf_s) * math.expm1((work_s + save_s) / mtbf_s)
    return work_s / segment


def simulated_goodput(
    work_s: float, save_s: float, restart_s: float, mtbf_s: float, failures: int = 200_000, seed: int = 0
) -> float:
    """The same by Monte Carlo over `failures` exponential gaps between failures."""
    gaps = np.random.default_rng(seed).exponential(mtbf_s, failures)
    segments = np.floor(np.maximum(gaps - restart_s, 0.0) / (work_s + save_s))
    return float(work_s * segments.sum() / gaps.sum())


def young_daly(save_s: float, mtbf_s: float) -> float:
    """Young/Daly's interval of work between saves that loses the least: sqrt(2 x save cost x MTBF)."""
    return math.sqrt(2 * save_s * mtbf_s)


@dataclass(frozen=True)
class Policy:
    name: str
    steps: int  # between saves
    work_s: float
    save_s: float  # what training waits for at each save
    restart_s: float

    def goodput(self, mtbf_s: float) -> float:
        return goodput(self.work_s, self.save_s, self.restart_s, mtbf_s)

    def simulated(self, mtbf_s: float, failures: int, seed: int) -> float:
        return simulated_goodput(self.work_s, self.save_s, self.restart_s, mtbf_s, failures, seed)


def disk_policy(name: str, minutes: float, step_s: float, c: Costs) -> Policy:
    """Disk checkpoints every `minutes` of steps (whole steps, at least one): a failure relaunches the job, which
    loads the last checkpoint."""
    steps = max(1, round(minutes * 60 / step_s))
    return Policy(name, steps, steps * step_s, c.save_s, c.relaunch_s + c.load_s)


def memory_policy(name: str, steps: int, step_s: float, c: Costs) -> Policy:
    """In-memory snapshots every `steps` steps: training waits for the copy to host memory, and for what is left of
    the previous buddy copy when the steps between snapshots are shorter than it; a failure restarts the workers in
    place, which restore from host memory (the lost node's state from its buddy)."""
    work = steps * step_s
    return Policy(name, steps, work, c.snapshot_s + max(0.0, c.buddy_s - work), c.elastic_restart_s + c.restore_s)


def policies(step_s: float, c: Costs, mtbf_s: float, minutes: list[float], steps: list[int]) -> list[Policy]:
    """Disk checkpoints every K of `minutes` and at Young/Daly's K; in-memory snapshots every N of `steps` and at
    Young/Daly's N."""
    disk_optimum = young_daly(c.save_s, mtbf_s)
    memory_optimum = max(1, round(young_daly(c.snapshot_s, mtbf_s) / step_s))
    return [
        *(disk_policy(f"disk every {k:g} min", k, step_s, c) for k in minutes),
        disk_policy(f"disk, Young/Daly {disk_optimum / 60:.3g} min", disk_optimum / 60, step_s, c),
        *(memory_policy(f"memory every {n} step{'s' * (n > 1)}", n, step_s, c) for n in steps),
        memory_policy(f"memory, Young/Daly {memory_optimum} steps", memory_optimum, step_s, c),
    ]


def planned_workload(config, world_size: int) -> Workload:
    """The recipe's workload as `titan plan` works it out (its estimator, on this CPU)."""
    from titan.train.estimate.estimate import estimate_step  # imported late: torch takes a while to import

    estimate = estimate_step(config, world_size)
    device, layout = estimate.device, estimate.layout
    degrees = " x ".join(f"{k} {v}" for k, v in vars(layout).items() if v > 1) or "one device"
    return Workload(
        what=f"{config.model.name} {config.model.flavor} on {world_size} x {device.name} ({degrees})",
        world_size=world_size,
        gpus_per_node=device.gpus_per_node,
        step_s=estimate.step_seconds,
        rank_bytes=max(r.trace.param_bytes + r.trace.optimizer_bytes for r in estimate.ranks),
        host_gbs=device.host_gbs,
        network_gbs=device.inter_node_gbs,
    )


def format_costs(workload: Workload, assumed: Assumptions, c: Costs, sources: dict[str, str]) -> str:
    """What the plan gives, and each cost with the figure it comes from and whether that is measured or assumed.
    `sources`: for relaunch_s and elastic_restart_s, "measured", "given" or "assumed"."""
    w, gib = workload, 2**30
    host = f"{assumed.host_gbs:g} GB/s, assumed" if assumed.host_gbs else f"{w.host_gbs:g} GB/s, the device's link"
    network = f"{assumed.network_gbs:g} GB/s, assumed" if assumed.network_gbs else f"{w.network_gbs:g} GB/s, one NIC"
    return "\n".join([
        f"{w.what}, {w.nodes} node{'s' * (w.nodes > 1)}; from titan plan: a step {w.step_s:.3g} s, "
        f"{w.rank_bytes / gib:.3g} GiB of weights and AdamW state per rank, {w.node_bytes / gib:.3g} GiB per node",
        f"disk checkpoint: save {c.save_s:.3g} s ({assumed.disk_write_gbs:g} GB/s per node, assumed), load "
        f"{c.load_s:.3g} s ({assumed.disk_read_gbs:g} GB/s, assumed), job relaunch {c.relaunch_s:.3g} s "
        f"({sources['relaunch_s']})",
        f"in-memory snapshot: to host memory {c.snapshot_s:.3g} s ({host}), to the buddy node {c.buddy_s:.3g} s behind "
        f"the next steps ({network}), restore {c.restore_s:.3g} s, elastic restart {c.elastic_restart_s:.3g} s "
        f"({sources['elastic_restart_s']})",
    ])  # fmt: skip


def format_table(chosen: list[Policy], mtbf_s: float, failures: int, seed: int) -> str:
    """A line per policy: its interval, what a save and a restart cost, its goodput by the formula and simulated."""
    lines = [f"{'policy':<32}{'steps':>9}{'save s':>9}{'restart s':>11}{'goodput':>9}{'simulated':>11}"]
    for p in chosen:
        lines.append(
            f"{p.name:<32}{p.steps:>9,}{p.save_s:>9.3g}{p.restart_s:>11.4g}{p.goodput(mtbf_s):>9.1%}"
            f"{p.simulated(mtbf_s, failures, seed):>11.1%}"
        )
    lines.append(
        f"goodput: the share of wall time spent on steps that are kept, by the formula (exact for exponential "
        f"failures) and by Monte Carlo over {failures:,} failures (seed {seed})"
    )
    return "\n".join(lines)
