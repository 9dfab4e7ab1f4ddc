"""Hangs become failures. A thread on every rank watches how long the rank has been in its current phase (the
trainer and the step say where they are: "data", "forward", "backward", "optimizer", "checkpoint save", ...); one
that lasts longer than fault.step_timeout_s is a hang: the rank prints one line naming itself, its step and phase,
and the ranks it waits for, and exits 1, so that torchrun's elastic agent restarts the workers (a hung collective
would otherwise hold every rank until the process group's timeout, or for ever).

The ranks it waits for: every rank's thread writes a heartbeat (its step, phase and wall time) into the job's
TCP store about once a second. A rank that is stopped, dead or wedged in the interpreter stops writing, and is
named as silent; else the ranks in another step or phase are named.

A lost peer ends the wait sooner: a rank that has waited fault.peer_silence_s in one phase reads the heartbeat of
the next rank (one read a beat, whatever the world's size), and if that rank has been silent as long, it exits
naming it. One such exit is enough: torchrun's agent then restarts every worker."""

from __future__ import annotations

import datetime
import json
import os
import sys
import threading
import time

import torch.distributed as dist

from titan.train.recovery.failures import recorder

# A heartbeat older than this many beats is a silent rank's.
SILENT_BEATS = 3


class Watchdog:
    def __init__(self, timeout_s: float, rank: int, world_size: int, silence_s: float = 0.0, on_exit=None):
        """timeout_s: the longest a phase may last (0: no watchdog, enter() alone keeps the position); silence_s:
        how long the next rank may be silent while this one waits (0: only the timeout); on_exit(step, line): told
        why before the rank exits."""
        self.timeout_s, self.rank, self.world_size = timeout_s, rank, world_size
        self.silence_s, self.on_exit = silence_s, on_exit
        self.beat_s = min(1.0, timeout_s / 4) if timeout_s else 1.0
        self.where = (0, "start-up", time.monotonic())  # the step in progress, its phase, and since when
        self._stopped = threading.Event()
        self._thread: threading.Thread | None = None
        self._store = None

    @classmethod
    def of_run(cls, fault, rank: int, world_size: int, run_dir) -> Watchdog:
        """The run's watchdog: the recipe's fault timeouts, and why it ends a rank recorded for the restart's line."""
        return cls(fault.step_timeout_s, rank, world_size, fault.peer_silence_s, recorder(run_dir, rank, world_size))

    def enter(self, phase: str, step: int | None = None) -> None:
        """The rank now works on `phase` of step `step` (default: the same step). One assignment: the thread reads
        the tuple whole."""
        self.where = (self.where[0] if step is None else step, phase, time.monotonic())

    def start(self) -> None:
        if not self.timeout_s or self._thread is not None:
            return
        self._stopped.clear()
        self._store = self._connect() if self.world_size > 1 else None
        self._thread = threading.Thread(target=self._watch, name="titan-watchdog", daemon=True)
        self._thread.start()

    def close(self) -> None:
        if self._thread is not None:
            self._stopped.set()
            self._thread.join()
            self._thread = None

    def _connect(self):
        """A client of the job's TCP store (torchrun's agent's, or rank 0's) of its own, with a short timeout: a
        store that does not answer delays the watch by seconds, never for good."""
        host, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
        if not host or not port:
            return None
        timeout = datetime.timedelta(seconds=max(2 * self.beat_s, 2.0))
        try:
            return dist.TCPStore(host, int(port), is_master=False, timeout=timeout, wait_for_workers=False)
        except (RuntimeError, ValueError):  # no store there: the watch goes on, naming no other rank
            return None

    def _watch(self) -> None:
        while True:  # a beat at once: a rank stopped in its first second is named with where it was
            step, phase, since = self.where
            self._beat(step, phase)
            stuck = time.monotonic() - since
            lost = self._lost_next(step, phase) if self.silence_s and stuck > self.silence_s else None
            if lost or stuck > self.timeout_s:
                line = lost or self._hang_line(step, phase, stuck)
                sys.stderr.write(line + "\n")
                sys.stderr.flush()
                if self.on_exit is not None:
                    self.on_exit(step, line.removeprefix(f"titan: rank {self.rank} ").split("; exiting so that")[0])
                os._exit(1)
            if self._stopped.wait(self.beat_s):
                return

    def _beat(self, step: int, phase: str) -> None:
        if self._store is None:
            return
        try:
            self._store.set(f"titan/heartbeat/{self.rank}", json.dumps([step, phase, time.time()]))
        except (RuntimeError, ValueError):  # a store that went away is named in the hang's line, if one comes
            pass

    def _lost_next(self, step: int, phase: str) -> str | None:
        """The line to exit with if the next rank has been silent for silence_s (its process or node lost)."""
        peer = (self.rank + 1) % self.world_size
        if self._store is None or peer == self.rank:
            return None
        try:
            key = f"titan/heartbeat/{peer}"
            at = float(json.loads(self._store.get(key))[2]) if self._store.check([key]) else None
        except (RuntimeError, ValueError, TypeError, IndexError):
            return None  # no store to judge by: the step timeout stands
        if at is None or time.time() - at <= self.silence_s:
            return None
        return (
            f"titan: rank {self.rank} waited at step {step} in {phase} on rank {peer}, silent for "
            f"{time.time() - at:.0f}s (fault.peer_silence_s = {self.silence_s:g}: its process or node lost); exiting "
            "so that the elastic agent restarts the workers"
        )

    def _hang_line(self, step: int, phase: str, stuck: float) -> str:
        waits = self._suspects(step, phase)
        return (
            f"titan: rank {self.rank} hung at step {step} in {phase} for {stuck:.0f}s (fault.step_timeout_s = "
            f"{self.timeout_s:g}); {waits}; exiting so that the elastic agent restarts the workers"
        )

    def _suspects(self, step: int, phase: str) -> str:
        """The ranks this one waits for, from their heartbeats: the silent ones, else those elsewhere."""
        if self._store is None:
            return "the other ranks are unknown (no store)"
        silent, elsewhere = [], []
        for rank in range(self.world_size):
            if rank == self.rank:
                continue
            try:
                key = f"titan/heartbeat/{rank}"
                beat = self._store.get(key) if self._store.check([key]) else None
            except (RuntimeError, ValueError):
                return "the store does not answer"
            if beat is None:
                silent.append(f"rank {rank} (no heartbeat)")
                continue
            try:  # whatever else wrote that key, the watch goes on: a hang must still end the rank
                their_step, their_phase, at = json.loads(beat)
                age = time.time() - float(at)
            except (TypeError, ValueError):
                silent.append(f"rank {rank} (a heartbeat titan cannot read: {bytes(beat)[:40]!r})")
                continue
            if age > SILENT_BEATS * self.beat_s:
                silent.append(f"rank {rank} (silent for {age:.0f}s, last at step {their_step} in {their_phase})")
            elif (their_step, their_phase) != (step, phase):
                elsewhere.append(f"rank {rank} (at step {their_step} in {their_phase})")
        if silent:
            return "waiting for " + ", ".join(silent)
        if elsewhere:
            return "the others are elsewhere: " + ", ".join(elsewhere)
        return "every rank is in the same phase"
