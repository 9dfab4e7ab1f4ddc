"""replay.on_spike: a spiked step replayed in the run, on its layout, from the in-memory snapshot before it, and its
digests compared bitwise, rank by rank, with those the run recorded (docs/verify.md). The trainer's state is then
restored to where it was: the run goes on as it would have without the replay."""

from __future__ import annotations

import json
import logging
import shutil
import time
from collections import deque
from collections.abc import Callable

import torch.distributed as dist

from titan.checkpoint.resume import PARTS
from titan.train.digests import SPIKES, StepDigests, bitwise

log = logging.getLogger("titan")


class SpikeReplay:
    """Replays the steps the trainer's SpikeWatch flagged, at the boundary of the step that settled them. `trainer`
    lends its stepper, loader, checkpointer, snapshots and digests (replay.digests, the hook outermost)."""

    def __init__(self, trainer):
        self.trainer = trainer
        self.digests: StepDigests = trainer.hook
        self.snapshotted: deque[int] = deque(maxlen=2)  # the steps of the snapshots held (BuddySnapshots keeps two)

    def after_step(self, loss: Callable[[], float], snapshotted: bool) -> float:
        """After step `trainer.step`'s saves (`snapshotted`: one of them an in-memory snapshot): replay the steps
        flagged since the last call; returns the seconds that took. loss(): the step's global loss, settled."""
        t = self.trainer
        if snapshotted:
            self._held(t.step)
        flagged, t.spikes.flagged[:] = sorted(t.spikes.flagged), []
        if not flagged:
            return 0.0
        start = time.perf_counter()
        if not snapshotted:  # the state to come back to
            t.snapshots.save(t.step, t.tokens_seen, loss(), wait=True)
            self._held(t.step)
        for step in flagged:
            self._replay(step)
        t.watchdog.enter("spike replay", t.step)
        if self._load(after=t.step - 1, before=t.step + 1) is None:
            raise RuntimeError(f"step {t.step}'s snapshot, which the spike replay was to return to, is not held whole")
        t.clock.take()  # the replays' phases are no step's
        return time.perf_counter() - start

    def _held(self, step: int) -> None:
        """A snapshot of `step` was saved: a replay starts from one of the two newest, so needs no digests of the
        steps up to the older one."""
        self.snapshotted.append(step)
        self.digests.forget(through=self.snapshotted[0])

    def _load(self, after: int, before: int) -> int | None:
        """Load the newest snapshot between the steps `after` and `before` into the live state; its step, or None
        if no snapshot there is held whole."""
        t = self.trainer
        folder, _ = t.snapshots.gather(after=after, before=before)
        if folder is None:
            return None
        step = t.checkpointer.load(folder, PARTS)
        shutil.rmtree(folder, ignore_errors=True)
        return step

    def _replay(self, spiked: int) -> None:
        """Run steps again from the snapshot before `spiked` through it, and compare them with the run's."""
        t = self.trainer
        t.watchdog.enter("spike replay", spiked)
        start = self._load(after=0, before=spiked)
        steps = range(start + 1, spiked + 1) if start is not None else range(0)
        if not steps or any(s not in self.digests.recent for s in steps):
            self._record(spiked, "not replayed: no in-memory snapshot before it held, with this process's digests "
                         "since", {"replay": "none"})  # fmt: skip
            return
        with self.digests.replaying() as replayed:
            for step in steps:
                t.watchdog.enter("spike replay", step)
                t.stepper(next(t.loader), step - 1)
        mine = ({s: self.digests.recent[s] for s in steps}, replayed)
        everyone = [mine] if t.control_group is None else [None] * t.world_size
        if t.control_group is not None:
            dist.all_gather_object(everyone, mine, group=t.control_group)
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
        t = self.trainer
        if t.rank != 0:
            return
        (log.info if entry["replay"] == "reproduced" else log.warning)("step %d's spike %s", spiked, verdict)
        with (t.run_dir / SPIKES).open("a") as f:
            f.write(json.dumps({"step": spiked, **entry}) + "\n")
