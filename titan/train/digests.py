"""What a run records for `titan verify --replay` (recipe section [replay], docs/verify.md): every step's digests on
each rank, which a replay of the step must match bitwise, and the loss and gradient-norm spikes that call for one.

A digest of a tensor is the sum, in int64, of its elements' bit patterns: any change of one element changes it
(the sum wraps around, but a change of at most 64 bits cannot be a multiple of 2**64), it is exact whatever the
summation order, and it costs one pass over the tensor on its device."""

from __future__ import annotations

import contextlib
import json
import logging
import math
import statistics
from collections import deque
from pathlib import Path

import torch

from titan.config import Replay
from titan.errors import ConfigError
from titan.parallel.parallelize import ModelParts
from titan.train.step import StepHook

log = logging.getLogger("titan")
DIGESTS = "digests"  # <run>/digests/rank<r>.jsonl
SPIKES = "spikes.jsonl"  # <run>/spikes.jsonl
_BITS = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def digest(t: torch.Tensor) -> torch.Tensor:
    """The int64 sum of this rank's elements' bit patterns (a DTensor's local shard), on their device."""
    from torch.distributed.tensor import DTensor

    if isinstance(t, DTensor):
        t = t._local_tensor  # to_local() would go through autograd
    t = t.detach()
    return t.reshape(-1).view(_BITS[t.element_size()]).sum(dtype=torch.int64)


class StepDigests(StepHook):
    """Wraps the run's step hook: after each step, one line per step in <run>/digests/rank<r>.jsonl with the step (the
    steps taken, as logs and checkpoints count them), this rank's loss share and the gradient norm as floats, and
    the digests of its gradients (as its backward left them) and of its parameters after the update, in the order
    of the header line before them (written again when a pipeline re-split changes this rank's parameters)."""

    def __init__(self, inner: StepHook, folder: Path, rank: int, world_size: int, tp: int, device: torch.device):
        self.inner, self.header, self.device = inner, {"rank": rank, "world": world_size, "tp": tp}, device
        folder.mkdir(parents=True, exist_ok=True)
        self.path = folder / f"rank{rank}.jsonl"
        self.names: list[str] = []
        self.parts: ModelParts | None = None
        self.grads: torch.Tensor | None = None
        self.recent: dict[int, dict] = {}  # step -> its line with "names", for an in-run replay (replay.on_spike)
        self.replayed: dict[int, dict] | None = None  # while a step is replayed: its lines, instead of the file

    @contextlib.contextmanager
    def replaying(self):
        """The steps run inside: their lines (with "names") into the dict yielded, not the file nor `recent`."""
        self.replayed = {}
        try:
            yield self.replayed
        finally:
            self.replayed = None

    def forget(self, through: int) -> None:
        """Drop the recent lines of steps up to `through` (no replay can start before them any more)."""
        self.recent = {step: line for step, line in self.recent.items() if step > through}

    def loss(self, step, loss):
        return self.inner.loss(step, loss)

    def gradients(self, step, parts):
        self.inner.gradients(step, parts)
        self.parts = parts
        zero = torch.zeros((), dtype=torch.int64, device=self.device)
        self.grads = torch.stack([zero if p.grad is None else digest(p.grad) for _, p in parts.named_parameters()])

    def step(self, step, batches, run):
        local, grad_norm = self.inner.step(step, batches, run)
        names, params = zip(*((n, digest(p)) for n, p in self.parts.named_parameters()))
        line = {
            "step": step + 1,
            "loss": float(local),
            "grad_norm": float(grad_norm),
            "grads": self.grads.tolist(),
            "params": torch.stack(params).tolist(),
        }
        if self.replayed is not None:
            self.replayed[step + 1] = {**line, "names": list(names)}
            return local, grad_norm
        lines = []
        if list(names) != self.names:
            self.names = list(names)
            lines.append({**self.header, "names": self.names})
        lines.append(line)
        self.recent[step + 1] = {**line, "names": self.names}
        with self.path.open("a") as f:
            f.writelines(json.dumps(line) + "\n" for line in lines)
        return local, grad_norm


class SpikeWatch:
    """A step whose loss or gradient norm is replay.spike_zscore standard deviations above the last
    replay.spike_window steps' (judged once that many steps ran) is logged with the replay that checks it, and
    recorded in <run>/spikes.jsonl. With replay.on_spike the trainer replays it (train/recovery/spike_replay.py):
    every rank flags the same steps, as it judges the same global loss and norm."""

    def __init__(self, cfg: Replay, run_dir: Path, rank: int):
        self.threshold, self.rank, self.run_dir = cfg.spike_zscore, rank, run_dir
        self.recent = {what: deque(maxlen=cfg.spike_window) for what in ("loss", "gradient norm")}
        self.flagged: list[int] | None = [] if cfg.on_spike else None  # the spiked steps not yet replayed

    def check(self, step: int, loss: float, grad_norm: float) -> bool:
        """Whether the step's loss or gradient norm is a spike."""
        spiked = False
        if not self.threshold:
            return spiked
        for what, value in (("loss", loss), ("gradient norm", grad_norm)):
            recent = self.recent[what]
            if not math.isfinite(value):
                continue  # a non-finite step is the non-finite check's
            if len(recent) == recent.maxlen and (spread := statistics.pstdev(recent)) > 0:
                zscore = (value - statistics.fmean(recent)) / spread
                if zscore > self.threshold:
                    spiked = True
                    if self.rank == 0:
                        self._report(step, what, value, zscore)
                    if self.flagged is not None and step not in self.flagged:
                        self.flagged.append(step)
            recent.append(value)
        return spiked

    def _report(self, step: int, what: str, value: float, zscore: float) -> None:
        log.warning(
            "step %d: %s %.4g is %.1f standard deviations above the last %d steps' (replay.spike_zscore %g): to check "
            "it for silent data corruption, run titan verify --replay %d --checkpoint %s",
            step, what, value, zscore, self.recent[what].maxlen, self.threshold, step, self.run_dir / "checkpoints",
        )  # fmt: skip
        with (self.run_dir / SPIKES).open("a") as f:
            f.write(json.dumps({"step": step, "what": what, "value": value, "zscore": zscore}) + "\n")


# What a rank's digest line holds, in the order the step computes it.
FIELDS = {
    "loss": "loss share",
    "grads": "gradients",
    "grad_norm": "gradient norm",
    "params": "weights after the update",
}


def bitwise(recorded: list[dict], replayed: list[dict], steps: range) -> tuple[list[str], tuple[int, list] | None]:
    """Report lines, and (step, [(rank, what differs)]) for the first step where a rank's result differs: the ranks
    whose first difference comes first in the step."""
    if len(replayed) != len(recorded):
        raise ConfigError(f"the same-layout replay ran {len(replayed)} ranks, the run {len(recorded)}")
    lines = []
    for step in steps:
        found = []
        for rank, (was, now) in enumerate(zip(recorded, replayed)):
            if difference := _first_difference(was["steps"][step], now["steps"][step]):
                found.append((rank, difference))
        if not found:
            lines.append(f"    step {step}: bitwise equal on all {len(recorded)} ranks")
            continue
        first = min(d[0] for _, d in found)
        for rank, (_, what) in found:
            lines.append(f"    step {step}: rank {rank}: {what}")
        return lines, (step, [(rank, what) for rank, (order, what) in found if order == first])
    return lines, None


def _first_difference(want: dict, got: dict) -> tuple[int, str] | None:
    """(its place in FIELDS, a description) of the first field of a rank's step line that differs."""
    for order, (field, what) in enumerate(FIELDS.items()):
        a, b = want[field], got[field]
        if isinstance(a, float):
            if a != b and not (math.isnan(a) and math.isnan(b)):
                return order, f"{what} differs bitwise: {a!r} recorded, {b!r} replayed"
        elif a != b:
            where = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), 0)
            return order, f"{what} differ bitwise, first at {want['names'][where]}"
    return None
