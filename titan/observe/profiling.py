"""Where a step's time goes: torch profiler traces of a window of steps, memory snapshots, and a per-step
breakdown into phases (the `[profiling]` section)."""

from __future__ import annotations

import contextlib
import json
import logging
import time
from collections.abc import Callable
from pathlib import Path

import torch

from titan.config import Profiling

log = logging.getLogger("titan")


class Profiler:
    """Traces steps wait + warmup + 1 to wait + warmup + active of the run (counted from its first step, a
    resumed run's included) into <run>/profiling/rank<R>-step<N>.pt.trace.json: Chrome trace format, which
    Perfetto (ui.perfetto.dev) and TensorBoard's profiler plugin open. With `memory`, a CUDA run also records
    its allocator's history over the window and dumps a snapshot (rank<R>-step<N>.memory.pickle, for
    pytorch.org/memory_viz); on CPU torch has no such snapshot, and the trace's allocation events are what
    there is. Use it as a context, calling step() after every training step."""

    def __init__(self, cfg: Profiling, folder: Path, rank: int, device: torch.device):
        self.cfg, self.folder, self.rank, self.device = cfg, folder, rank, device
        self.profile: torch.profiler.profile | None = None
        self.step_count = 0

    def __enter__(self) -> Profiler:
        if not self.cfg.enable:
            return self
        self.folder.mkdir(parents=True, exist_ok=True)
        activities = [torch.profiler.ProfilerActivity.CPU]
        if self.device.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        c = self.cfg
        self.profile = torch.profiler.profile(
            activities=activities,
            schedule=torch.profiler.schedule(wait=c.wait, warmup=c.warmup, active=c.active, repeat=1),
            on_trace_ready=self._save,
            profile_memory=c.memory,
        )
        self.profile.__enter__()
        if c.memory and self.device.type == "cpu" and self.rank == 0:
            log.info("profiling.memory on CPU: the trace holds the allocation events; torch has no CPU memory snapshot")
        return self

    def step(self) -> bool:
        """Mark the end of a step; whether that wrote the window's trace."""
        if self.profile is None:
            return False
        self.step_count += 1
        if self.cfg.memory and self.device.type == "cuda" and self.step_count == self.cfg.wait + self.cfg.warmup:
            torch.cuda.memory._record_memory_history(max_entries=200_000)
        self.profile.step()
        return self.step_count == self.cfg.wait + self.cfg.warmup + self.cfg.active

    def __exit__(self, *exc) -> None:
        if self.profile is not None:
            self.profile.__exit__(*exc)
            self.profile = None

    def _save(self, profile: torch.profiler.profile) -> None:
        name = f"rank{self.rank}-step{self.step_count}"
        trace = self.folder / f"{name}.pt.trace.json"
        profile.export_chrome_trace(str(trace))
        if self.cfg.memory and self.device.type == "cuda":
            torch.cuda.memory._dump_snapshot(str(self.folder / f"{name}.memory.pickle"))
            torch.cuda.memory._record_memory_history(enabled=None)
        shares = time_shares(profile)
        (self.folder / f"{name}.summary.json").write_text(json.dumps(shares, indent=2) + "\n")
        if self.rank == 0:
            log.info("profiling: %d steps traced into %s (one file per rank)", self.cfg.active, trace)
            log.info("profiling: rank 0's traced time: %s", ", ".join(f"{k} {v:.0%}" for k, v in shares.items()))


# Operator name patterns -> what the time is spent on; the first match wins. Self time only, so nested ops
# are not counted twice.
CATEGORIES = (
    ("collectives", ("c10d", "gloo", "nccl", "wait_tensor", "all_reduce", "allreduce", "all_gather", "allgather",
                     "reduce_scatter", "broadcast", "send", "recv")),
    ("matmul", ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::_scaled_mm", "aten::linear")),
    ("attention", ("scaled_dot_product", "flash_attention", "efficient_attention", "aten::_softmax")),
    ("optimizer", ("_foreach", "Optimizer.", "aten::_fused_adam")),
    # Layout changes and dtype casts: DTensor redistributions, FSDP's buffers, autocast.
    ("copies", ("aten::copy_", "aten::cat", "aten::clone", "aten::_to_copy")),
)  # fmt: skip


def time_shares(profile: torch.profiler.profile) -> dict[str, float]:
    """Each category's share of the traced steps' wall time; "other ops" is the remaining operator time and
    "outside ops" what no operator covers (Python, the data loader, waits outside collectives)."""
    events = profile.key_averages()
    wall = sum(e.cpu_time_total for e in events if e.key.startswith("ProfilerStep"))  # "ProfilerStep*"
    shares = dict.fromkeys([name for name, _ in CATEGORIES] + ["other ops"], 0.0)
    for e in events:
        if e.key.startswith("ProfilerStep"):
            continue
        category = next((name for name, patterns in CATEGORIES if any(p in e.key for p in patterns)), "other ops")
        shares[category] += e.self_cpu_time_total
    if wall <= 0:
        return {}
    shares = {k: v / wall for k, v in shares.items()}
    shares["outside ops"] = max(0.0, 1.0 - sum(shares.values()))
    return shares


class DeviceTimer:
    """Seconds between start() and stop() as the device ran them. On a GPU the host only queues kernels, so its
    clock would time their launches: CUDA events recorded in the stream time the kernels themselves, and reading
    waits for the stop event alone, not the whole device. On the CPU, the host clock."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.marks: list = []

    def start(self) -> None:
        self.marks = [self._mark()]

    def stop(self) -> None:
        self.marks.append(self._mark())

    def seconds(self) -> float:
        begin, end = self.marks
        if self.cuda:
            end.synchronize()
            return begin.elapsed_time(end) / 1e3  # milliseconds
        return end - begin

    def _mark(self):
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event


class StepClock:
    """Seconds of each phase of the current step (profiling.step_breakdown). On a GPU every phase boundary
    synchronises the device, which costs time: off by default."""

    def __init__(self, enabled: bool, device: torch.device):
        self.enabled, self.device = enabled, device
        self.seconds: dict[str, float] = {}
        self.on_phase: Callable[[str], None] = lambda name: None  # told of every phase entered (the watchdog)

    @contextlib.contextmanager
    def phase(self, name: str):
        self.on_phase(name)
        if not self.enabled:
            yield
            return
        self._sync()
        start = time.perf_counter()
        try:
            yield
        finally:
            self._sync()
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - start

    def take(self) -> dict[str, float]:
        """This step's phases as metrics ({"data_s": ..., ...}), and start the next step's."""
        taken = {f"{name}_s": seconds for name, seconds in self.seconds.items()}
        self.seconds = {}
        return taken

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
