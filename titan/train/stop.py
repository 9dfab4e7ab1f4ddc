"""Stopping early. SIGTERM or SIGUSR1 (a SLURM preemption notice) on any rank stops every rank at the same step,
after a checkpoint, and the run exits 75 (EX_TEMPFAIL) so that a batch script requeues it; Ctrl-C (SIGINT) stops
the same way and exits 130, as an interrupted command does, and a second Ctrl-C quits at once. A NaN or inf gradient
norm stops the run without saving (or skips the step, as the recipe says), naming the last checkpoint whose next
step was finite: the checkpoint of the step before the NaN holds the weights the NaN came from."""

from __future__ import annotations

import contextlib
import logging
import math
import signal

import torch
import torch.distributed as dist

from titan.checkpoint.resume import complete_checkpoints
from titan.config import Config
from titan.errors import UserError
from titan.observe.metrics import MetricsLogger

log = logging.getLogger("titan")

# How often the ranks agree on whether to stop: bounds how late a stop starts.
STOP_VOTE_SECONDS = 1.0


class Preempted(Exception):
    """Training stopped early on a signal, after saving a checkpoint; `reason`: the signal's name (StopVote.reason)."""

    def __init__(self, message: str, reason: str):
        super().__init__(message)
        self.reason = reason


class StopVote:
    """Whether the run stops at this step. A stop is requested on one rank (`request`: what the signal handlers
    call, and what a test or a step hook may call); the ranks then agree, so that all stop at the same step.
    They vote about once a second rather than every step: each vote also agrees on the slowest rank's step time,
    from which every rank computes the same step for the next vote."""

    def __init__(self, control_group, vote_seconds: float = STOP_VOTE_SECONDS):
        self.group, self.vote_seconds = control_group, vote_seconds
        self.reason: str | None = None  # why this rank asked to stop, e.g. "SIGTERM"
        self.next_vote = 0  # the step at which the ranks next vote

    def request(self, reason: str) -> None:
        self.reason = reason

    @contextlib.contextmanager
    def on_signals(self):
        """SIGTERM, SIGUSR1 and SIGINT request a stop while the block runs; the previous handlers come back after it."""
        handlers = {signal.SIGTERM: self._on_signal, signal.SIGUSR1: self._on_signal, signal.SIGINT: self._on_ctrl_c}
        previous = {sig: signal.signal(sig, handler) for sig, handler in handlers.items()}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def _on_signal(self, signum: int, _frame) -> None:
        self.request(signal.Signals(signum).name)

    def _on_ctrl_c(self, signum: int, frame) -> None:
        """The first Ctrl-C stops at the step's end, as SIGTERM does; the second quits at once (a save it interrupts
        is left under its temporary name: the last complete checkpoint stays as it was)."""
        if self.reason == "SIGINT":
            raise KeyboardInterrupt
        self._on_signal(signum, frame)
        log.info("Ctrl-C: stopping at the end of this step (Ctrl-C again to quit at once, saving nothing)")

    def agreed(self, step: int, step_seconds: float) -> bool:
        """Whether every rank stops after `step` (the last step took `step_seconds` on this rank)."""
        if self.group is None:
            return self.reason is not None
        if step < self.next_vote:
            return False
        vote = torch.tensor([float(self.reason is not None), step_seconds], dtype=torch.float64)
        dist.all_reduce(vote, op=dist.ReduceOp.MAX, group=self.group)
        self.next_vote = step + max(1, int(self.vote_seconds / max(float(vote[1]), 1e-9)))
        if vote[0] and self.reason is None:
            self.reason = "another rank's signal"
        return bool(vote[0])


class NonFinite(UserError):
    """The loss or gradient norm became NaN or inf: training stopped without saving (a recipe problem, most
    often a learning rate too high for the model)."""


class NonFiniteSteps:
    """Stop at a NaN or inf gradient norm (nothing is saved after the last good step), or count the step as skipped
    (training.on_nonfinite = "skip"). The norm is global, so every rank decides alike."""

    def __init__(self, config: Config, checkpointer, metrics: MetricsLogger):
        self.config, self.checkpointer, self.metrics = config, checkpointer, metrics
        self.skipped_in_a_row = 0

    def check(self, step: int, loss: float, grad_norm: float, spiked: bool = False) -> None:
        """`spiked`: the run's spike rule (replay.spike_zscore) flagged the step."""
        self.checkpointer.step_ran(step, healthy=math.isfinite(loss) and math.isfinite(grad_norm) and not spiked)
        if math.isfinite(grad_norm):
            self.skipped_in_a_row = 0
            return
        t = self.config.training
        self.skipped_in_a_row += 1
        self.metrics.log(step, {"skipped_step": 1})
        what = f"step {step}: loss {loss}, gradient norm {grad_norm}"
        if t.on_nonfinite == "skip" and self.skipped_in_a_row < t.max_skipped_steps:
            log.warning("%s: update skipped (%d in a row)", what, self.skipped_in_a_row)
            return
        self.checkpointer.finish_pending()  # a save in flight holds an earlier state
        if t.on_nonfinite == "skip":
            what += f" ({self.skipped_in_a_row} steps in a row skipped, training.max_skipped_steps)"
        lr = f"--optimizer.lr {self.config.optimizer.lr / 2:.3g}"
        good = self.checkpointer.last_good()
        saved = complete_checkpoints(self.checkpointer.folder)
        if good is None and saved:
            raise NonFinite(
                f"{what}; no checkpoint is known good (none whose next step was healthy): start again with a lower "
                f"learning rate, adding {lr} --checkpoint.resume never to the command"
            )
        if good is None:
            raise NonFinite(f"{what}; no checkpoint was saved before: start again with a lower learning rate ({lr})")
        newest = max(saved)
        good_step = int(good.name.removeprefix("step-"))
        rewind = f" --checkpoint.load_step {good_step}" if good_step != newest else ""
        raise NonFinite(
            f"{what}; nothing was saved from this step on. The last good checkpoint is {good}: resume from it with "
            f"a lower learning rate, adding {lr}{rewind} --checkpoint.allow_changes optimizer.lr to the command"
        )
