"""replay.on_spike: a spiked step replayed in the run, on its layout, from the in-memory snapshot before it, and its
digests compared bitwise, rank by rank, with those the run recorded (docs/verify.md). The trainer's state is then
restored to where it was: the run goes on as it would have without the replay."""

from __future__ import annotations

import json
import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from titan.checkpoint.checkpointer import Checkpointer
from titan.checkpoint.snapshots.store import Snapshots
from titan.observe.profiling import StepClock
from titan.train.digests import SPIKES, SpikeWatch, StepDigests, bitwise
from titan.train.recovery.watchdog import Watchdog

log = logging.getLogger("titan")


@dataclass
class RunState:
    """Where the run is when a replay is due: its step, the tokens seen, its settled loss, whether the step was
    just snapshotted, and how to run step s again (on the loader's next batch)."""

    step: int
    tokens_seen: int
    loss: Callable[[], float]
    snapshotted: bool
    run_step: Callable[[int], object]


class SpikeReplay:
    """Replays the steps `spikes` flagged, at the boundary of the step that settled them, from `snapshots` (loaded
    through `checkpointer`), comparing `digests` (replay.digests, the hook outermost)."""

    def __init__(self, spikes: SpikeWatch, digests: StepDigests, snapshots: Snapshots, checkpointer: Checkpointer,
                 watchdog: Watchdog, clock: StepClock, run_dir: Path):  # fmt: skip
        self.spikes, self.digests, self.snapshots, self.checkpointer = spikes, digests, snapshots, checkpointer
        self.watchdog, self.clock, self.run_dir = watchdog, clock, run_dir
        self.rank = snapshots.rank
        self.snapshotted: deque[int] = deque(maxlen=2)  # the steps of the snapshots held (they keep two)

    def after_step(self, run: RunState) -> float:
        """After step `run.step`'s saves: replay the steps flagged since the last call; returns the seconds that
        took."""
        if run.snapshotted:
            self._held(run.step)
        flagged, self.spikes.flagged[:] = sorted(self.spikes.flagged), []
        if not flagged:
            return 0.0
        start = time.perf_counter()
        if not run.snapshotted:  # the state to come back to
            if self.snapshots.take(run.step, run.tokens_seen, run.loss()) is None:
                for step in flagged:  # snapshots turned off (shared memory full): nothing to replay from
                    self._record(step, "not replayed: snapshots are off", {"replay": "none"})
                return time.perf_counter() - start
            self._held(run.step)
        for step in flagged:
            self._replay(step, run.run_step)
        self.watchdog.enter("spike replay", run.step)
        if self._load(after=run.step - 1, before=run.step + 1) is None:
            raise RuntimeError(f"step {run.step}'s snapshot, which the spike replay returns to, is not held whole")
        self.clock.take()  # the replays' phases are no step's
        return time.perf_counter() - start

    def _held(self, step: int) -> None:
        """A snapshot of `step` was saved: a replay starts from one of the two newest, so needs no digests of the
        steps up to the older one."""
        self.snapshotted.append(step)
        self.digests.forget(through=self.snapshotted[0])

    def _load(self, after: int, before: int) -> int | None:
        """Load the newest snapshot between the steps `after` and `before` into the live state; its step, or None
        if no snapshot there is held whole."""
        folder, _ = self.snapshots.gather(self.checkpointer, after=after, before=before)
        return None if folder is None else self.snapshots.load(self.checkpointer, folder)

    def _replay(self, spiked: int, run_step: Callable[[int], object]) -> None:
        """Run steps again from the snapshot before `spiked` through it, and compare them with the run's."""
        self.watchdog.enter("spike replay", spiked)
        start = self._load(after=0, before=spiked)
        steps = range(start + 1, spiked + 1) if start is not None else range(0)
        if not steps or any(s not in self.digests.recent for s in steps):
            self._record(spiked, "not replayed: no in-memory snapshot before it held, with this process's digests "
                         "since", {"replay": "none"})  # fmt: skip
            return
        with self.digests.replaying() as replayed:
            for step in steps:
                self.watchdog.enter("spike replay", step)
                run_step(step)
        mine = ({s: self.digests.recent[s] for s in steps}, replayed)
        everyone = self.snapshots.everyone(mine)
        recorded, again = ([{"steps": lines[i]} for lines in everyone] for i in (0, 1))
        _, culprit = bitwise(recorded, again, steps)
        source = f"replayed from the in-memory snapshot of step {start} on the run's layout"
        if culprit is None:
            self._record(spiked, f"{source}: reproduced bitwise on all {len(everyone)} ranks (not a device fault)",
                         {"replay": "reproduced", "from": start})  # fmt: skip
            return
        at, ranks = culprit
        self._record(
            spiked,
            f"{source}: NOT reproduced: step {at} differs first on rank{'s' if len(ranks) > 1 else ''} "
            f"{', '.join(str(r) for r, _ in ranks)} ({'; '.join(f'rank {r}: {what}' for r, what in ranks)}): silent "
            "data corruption on that device, or a computation that is not deterministic",
            {"replay": "differs", "from": start, "at": at, "ranks": [r for r, _ in ranks],
             "what": [what for _, what in ranks]},
        )  # fmt: skip

    def _record(self, spiked: int, verdict: str, entry: dict) -> None:
        """The verdict on step `spiked`: one log line and a line in spikes.jsonl, by rank 0."""
        if self.rank != 0:
            return
        (log.info if entry["replay"] == "reproduced" else log.warning)("step %d's spike %s", spiked, verdict)
        with (self.run_dir / SPIKES).open("a") as f:
            f.write(json.dumps({"step": spiked, **entry}) + "\n")
