"""Recovery from failures, as the trainer calls it: `resume` where the run starts, `after_step` after each step's
saves, `ended` where training ends. It owns torchrun's restart count and why the run restarted (failures), the
in-memory snapshots and when to take them (elastic, interval), and the replay of spiked steps (spike_replay); the
watchdog it is given ends a rank that hangs or whose peer went silent (watchdog)."""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
import torch.distributed as dist

from titan.checkpoint.checkpointer import Checkpointer
from titan.config import Config
from titan.launcher import Launch
from titan.observe.metrics import MetricsLogger
from titan.observe.profiling import StepClock
from titan.train.digests import SpikeWatch
from titan.train.recovery.elastic import build_snapshots, resume
from titan.train.recovery.failures import log_restart
from titan.train.recovery.interval import SnapshotInterval
from titan.train.recovery.spike_replay import RunState, SpikeReplay
from titan.train.recovery.watchdog import Watchdog
from titan.train.stop import NonFinite, Preempted

log = logging.getLogger("titan")


class Recovery:
    """hook: the step's hook, outermost the digests a spike replay compares (replay.digests)."""

    def __init__(self, config: Config, launch: Launch, checkpointer: Checkpointer, metrics: MetricsLogger,
                 watchdog: Watchdog, clock: StepClock, hook):  # fmt: skip
        self.config, self.launch, self.checkpointer, self.metrics = config, launch, checkpointer, metrics
        self.watchdog, self.clock, self.hook = watchdog, clock, hook
        self.spikes = SpikeWatch(config.replay, config.run_dir, launch.rank)
        self.snapshots = self.interval = self.spike_replay = None

    def resume(self, layout: str) -> int:
        """Load the state to continue from (after an elastic restart: the newest the survivors hold; elastic.resume)
        and log the restart's line; returns the step."""
        restart = self._restart_count()
        config, checkpointer = self.config, self.checkpointer
        self.snapshots = build_snapshots(config, checkpointer, self.launch, restarted=restart > 0)
        if self.snapshots is not None:
            every, overhead = config.fault.snapshot_interval, config.fault.snapshot_overhead
            self.interval = SnapshotInterval(every, overhead, checkpointer.control_group)
            if self.launch.rank == 0:
                log.info("in-memory snapshots %s, each agent's in its host's shared memory (rank 0's: %s)",
                         self.interval.describe(), self.snapshots.folder)  # fmt: skip
        step = resume(checkpointer, self.snapshots, restarted=restart > 0)
        log_restart(self.metrics, restart, step, self.launch.rank, self.launch.world, layout, config.run_dir)
        if config.replay.on_spike:
            replay = (self.spikes, self.hook, self.snapshots, checkpointer, self.watchdog, self.clock, config.run_dir)
            self.spike_replay = SpikeReplay(*replay)
        return step

    def _restart_count(self) -> int:
        """torchrun's count of this job's worker restarts, the highest of any rank's: a node taken in at a restart
        starts counting at 0, and must resume as the others do. 0 outside torchrun and at the first start."""
        group = self.checkpointer.control_group
        count = torch.tensor([self.launch.restart])
        if group is not None:
            dist.all_reduce(count, op=dist.ReduceOp.MAX, group=group)
        return int(count)

    def after_step(self, step: int, tokens_seen: int, loss: Callable[[], float], saved: bool,
                   run_step: Callable[[int], object]) -> float:  # fmt: skip
        """After step `step`'s log and checkpoint (`saved`: one was): its snapshot where one is due and no
        checkpoint was saved, then the replay of the steps that spiked (run_step runs a step again on the loader's
        next batch); `loss`: the step's, settled when called. Returns the seconds training was blocked."""
        blocked, snapshotted = 0.0, False
        # Off (shared memory full): no snapshot, and the step's loss is left to settle with the next logged one.
        if self.snapshots is not None and not saved and not self.snapshots.off and self.interval.due(step):
            self.watchdog.enter("snapshot")
            taken = self.snapshots.take(step, tokens_seen, loss())
            if taken is not None:
                self.interval.taken(step, taken)
                self.metrics.log(step, {"snapshot_blocked_s": taken})
                blocked, snapshotted = taken, True
        if self.spike_replay is not None:
            blocked += self.spike_replay.after_step(RunState(step, tokens_seen, loss, snapshotted, run_step))
        return blocked

    def ended(self, error: BaseException | None = None) -> None:
        """Training ended, with `error` or not: free the snapshots where the run ends (host shared memory outlives
        it), not where torchrun restarts the workers to continue from them. A run ends where it finished, where a
        worker's exception is a stop titan chose (a preemption's, after its checkpoint; a NaN stop; a second
        Ctrl-C), or on any failure once torchrun has no restart left."""
        chosen = error is None or isinstance(error, (Preempted, NonFinite, KeyboardInterrupt))
        if self.snapshots is not None and (chosen or self.launch.restarts_left <= 0):
            self.snapshots.release()
