"""Training metrics: throughput, MFU and memory, written to the console, metrics.jsonl, TensorBoard and wandb.

metrics.jsonl in the run folder is the source of truth; the trackers are views of it.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import logging
import os
import platform
import re
import resource
import secrets
import sys
import time
from pathlib import Path

import torch

from titan import __version__
from titan.config import Config, Layout, to_dict
from titan.errors import import_extra, installed, missing_extra
from titan.observe.runs import TRACKING, duration, flatten
from titan.schema import read_json

log = logging.getLogger("titan")

# Dense bf16 peak FLOP/s (no sparsity) of known GPUs, by their exact CUDA device name: a substring would read
# an "L40" as an "L4".
GPU_PEAK_FLOPS = {
    "NVIDIA H100 80GB HBM3": 989e12,
    "NVIDIA H100 PCIe": 756e12,
    "NVIDIA H100 NVL": 835e12,
    "NVIDIA H200": 989e12,
    "NVIDIA H200 NVL": 835e12,
    "NVIDIA GH200 480GB": 989e12,
    "NVIDIA B200": 2250e12,
    "NVIDIA A100-SXM4-80GB": 312e12,
    "NVIDIA A100-SXM4-40GB": 312e12,
    "NVIDIA A100 80GB PCIe": 312e12,
    "NVIDIA A100-PCIE-40GB": 312e12,
    "NVIDIA L40S": 362e12,
    "NVIDIA L40": 181e12,
    "NVIDIA L4": 121e12,
    "NVIDIA A10G": 70e12,
}


def peak_flops(device: torch.device, configured: float = 0.0, dtype: torch.dtype = torch.float32) -> tuple[float, str]:
    """Peak FLOP/s of one device, which MFU divides by, and what it is: the recipe's figure, the known GPU's
    datasheet figure, or on CPU this machine's measured matmul rate in the run's ``dtype``. An unknown GPU gives 0
    (no MFU)."""
    if configured:
        return configured, f"metrics.peak_flops = {configured:.3g} FLOP/s"
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        if name in GPU_PEAK_FLOPS:
            return GPU_PEAK_FLOPS[name], f"the {name}'s dense bf16 peak, {GPU_PEAK_FLOPS[name] / 1e12:.0f} TFLOP/s"
        return 0.0, f"unknown GPU {name!r}: no MFU is reported; set metrics.peak_flops to its peak FLOP/s"
    rate = measure_cpu_flops(dtype)
    kind = {torch.bfloat16: "bf16", torch.float32: "fp32"}.get(dtype, str(dtype))
    threads = torch.get_num_threads()
    return rate, (
        f"this CPU's measured {kind} matmul rate with {threads} thread{'s' * (threads != 1)}, {rate / 1e9:.0f} GFLOP/s "
        "(a ceiling measured here, not a datasheet peak)"
    )


def measure_cpu_flops(dtype: torch.dtype = torch.float32, size: int = 1024, repeats: int = 20) -> float:
    """Best matmul rate of this CPU in ``dtype`` with torch's threads: a realistic ceiling, not a datasheet number.

    Best of many short runs, after a warm-up, so a busy moment on the machine does not lower the figure.
    """
    a, b = torch.randn(size, size, dtype=dtype), torch.randn(size, size, dtype=dtype)
    for _ in range(3):
        a @ b
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - start)
    return 2 * size**3 / best


def peak_memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # Linux reports KiB
    return kib * 1024


class MetricsLogger:
    """Rank 0 writes; other ranks keep a no-op logger so the trainer needs no `if rank == 0` branches."""

    def __init__(self, config: Config, run_dir: Path, enabled: bool, extra_info: dict):
        self.enabled = enabled
        self._jsonl = self._tb = self._wandb = None
        self._start = time.perf_counter()
        if not enabled:
            return
        run_dir.mkdir(parents=True, exist_ok=True)
        self._jsonl = open(run_dir / "metrics.jsonl", "a")
        names = run_names(config, extra_info)
        try:
            previous = read_json(run_dir / "tracking.json", TRACKING)
        except (OSError, ValueError):  # none yet, or torn by a crash: the run starts its tracking afresh
            previous = {}
        tracking = {
            **names,
            "command": ["titan", *sys.argv[1:]] if sys.argv[0].endswith(("titan", "__main__.py")) else sys.argv,
            "started": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            "slurm": {key[6:].lower(): os.environ[key] for key in SLURM_KEYS if key in os.environ},
        }
        if config.metrics.tensorboard and not installed("tensorboard"):
            # On by default: an image without it still trains, and says so once.
            log.info("tensorboard: off, %s", missing_extra("tensorboard", "tracking", "metrics.tensorboard"))
        elif config.metrics.tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            # One folder per (group, layout): `tensorboard --logdir outputs` lists runs as
            # <job>/tensorboard/<group>-<layout>.
            tb_dir = run_dir / "tensorboard" / re.sub(r"[^A-Za-z0-9._=-]+", "_", f"{names['group']}-{names['layout']}")
            self._tb = SummaryWriter(log_dir=str(tb_dir))
            self._tb.add_text("run", _run_markdown(config, names, extra_info))
            tracking["tensorboard"] = str(tb_dir.relative_to(run_dir))
        mode = config.metrics.wandb
        if mode == "auto":
            mode = "online" if _wandb_credentials() else "disabled"
            if mode == "disabled":
                log.info("wandb: off (metrics.wandb = auto, no WANDB_API_KEY or `wandb login`; 'offline' logs here)")
            elif not installed("wandb"):
                mode = "disabled"
                log.info("wandb: off, %s", missing_extra("wandb", "tracking", "metrics.wandb"))
        # A requeued or resumed run keeps its wandb run: the id lives in the run folder.
        run_id = previous.get("wandb", {}).get("id") or secrets.token_hex(6)
        if mode != "disabled":
            self._wandb = _start_wandb(config, run_dir, mode, names, run_id, extra_info)
        if self._wandb is not None:
            url = self._wandb.url if mode == "online" else None  # an offline run has none: wandb warns if asked
            log.info("wandb: %s run %s", mode, url or run_dir / "wandb")
            tracking["wandb"] = {"project": config.metrics.wandb_project, "id": run_id, "mode": mode, "url": url}
        (run_dir / "tracking.json").write_text(json.dumps(tracking, indent=2) + "\n")

    def log(self, step: int, metrics: dict) -> None:
        if not self.enabled:
            return
        # elapsed_s: seconds since the trainer started (0 again after a restart); `titan compare` sums them.
        record = {"step": step, **metrics, "elapsed_s": round(time.perf_counter() - self._start, 3)}
        try:
            self._jsonl.write(json.dumps(record) + "\n")
            self._jsonl.flush()
        except OSError as e:  # a buffered write's error names no file
            e.filename = e.filename or self._jsonl.name
            raise
        if self._tb is not None:
            for key, value in metrics.items():
                self._tb.add_scalar(key, value, step)
        if self._wandb is not None:
            self._wandb.log(metrics, step=step)

    def close(self) -> None:
        if self._jsonl is not None:
            self._jsonl.close()
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()


SLURM_KEYS = (
    "SLURM_JOB_ID",
    "SLURM_JOB_NAME",
    "SLURM_JOB_NODELIST",
    "SLURM_NNODES",
    "SLURM_RESTART_COUNT",
    "SLURM_CLUSTER_NAME",
)


def run_names(config: Config, extra_info: dict) -> dict:
    """What the trackers call the run: name (job.name), group (metrics.wandb_group, else the recipe's file
    name, else job.name), layout (e.g. 'dp_shard2-tp2') and tags (recipe, model, layout, world size, and
    metrics.wandb_tags)."""
    recipe = Path(config.job.recipe).stem if config.job.recipe else ""
    layout = Layout(**extra_info["layout"]).name
    tags = [f"model:{config.model.name}-{config.model.flavor}", f"layout:{layout}"]
    if recipe:
        tags.insert(0, f"recipe:{recipe}")
    if "world_size" in extra_info:
        tags.append(f"world:{extra_info['world_size']}")
    return {
        "name": config.job.name,
        "recipe": config.job.recipe,
        "group": config.metrics.wandb_group or recipe or config.job.name,
        "layout": layout,
        "tags": [*tags, *(t for t in config.metrics.wandb_tags if t not in tags)],
    }


def _run_markdown(config: Config, names: dict, extra_info: dict) -> str:
    from titan.config import to_toml

    rows = [
        ("run", names["name"]),
        ("recipe", names["recipe"] or "-"),
        ("group", names["group"]),
        ("layout", names["layout"]),
        ("tags", ", ".join(names["tags"])),
    ]
    rows += [(key, json.dumps(value)) for key, value in extra_info.items() if key != "layout"]
    table = "\n".join(f"| {key} | {value} |" for key, value in rows)
    config_block = "\n".join("    " + line for line in to_toml(config).splitlines())
    return f"| | |\n|---|---|\n{table}\n\n{config_block}"


def format_line(step: int, total: int, metrics: dict, eta_s: float) -> str:
    mfu = f"mfu {100 * metrics['mfu']:.2f}%" if "mfu" in metrics else "mfu -"
    mtp = f" | mtp_loss {metrics['mtp_loss']:.4f}" if "mtp_loss" in metrics else ""  # a multi-token prediction's
    stage = f" | stage {metrics['stage']}" if "stage" in metrics else ""  # a run in [[data.stages]]
    return (
        f"step {step:>{len(str(total))}}/{total}{stage} | loss {metrics['loss']:.4f}{mtp} | grad_norm "
        f"{metrics['grad_norm']:.3f} | lr {metrics['lr']:.2e} | {metrics['tokens_per_s']:,.0f} tok/s | {mfu} "
        f"| {1000 * metrics['step_time_s']:.0f} ms/step | mem {metrics['peak_memory_gib']:.2f} GiB | eta "
        f"{duration(eta_s)}"
    )


class RemainingTime:
    """A run's ETA: the steps left at the measured seconds per step, plus the evaluations, checkpoint saves and
    benchmark tasks still to come (validation.interval, checkpoint.interval and eval.interval steps apart, and one of
    each at the last step) at the mean time each has taken. Before the first evaluation one is estimated at a third
    of a training step per validation batch (a forward of the batch, without the backward); a save and the tasks
    count once one has been timed."""

    def __init__(self, total: int, validation_interval: int, validation_steps: int, checkpoint_interval: int,
                 eval_interval: int = 0):  # fmt: skip
        self.total, self.validation_steps = total, validation_steps
        # 0: none
        self.intervals = {"validation": validation_interval, "checkpoint": checkpoint_interval, "eval": eval_interval}
        self.seconds: dict[str, list[float]] = {"validation": [], "checkpoint": [], "eval": []}

    def record(self, kind: str, seconds: float) -> None:
        """One evaluation ("validation"), one save's blocking time ("checkpoint") or one run of the tasks ("eval")."""
        self.seconds[kind].append(seconds)

    def add_to_last(self, kind: str, seconds: float) -> None:
        """More of the last one: a validation set, evaluated after the held-out split at the same step."""
        self.seconds[kind][-1] += seconds

    def eta(self, step: int, step_time: float) -> float:
        """Seconds from `step` to the end of the run, at `step_time` seconds per training step."""
        left = step_time * (self.total - step)
        for kind, interval in self.intervals.items():
            if not interval:
                continue
            times = self.seconds[kind]
            if times:
                each = sum(times) / len(times)
            else:
                each = step_time * self.validation_steps / 3 if kind == "validation" else 0.0
            left += each * due_after(step, self.total, interval)
        return left


def due_after(step: int, total: int, interval: int) -> int:
    """How many of the steps after `step`, up to `total`, are multiples of `interval` or `total` itself."""
    if step >= total:
        return 0
    return total // interval - step // interval + (total % interval != 0)


def setup_logging(rank: int) -> None:
    """Rank 0 logs INFO to stderr; other ranks only warnings, so a job prints each line once."""
    logging.basicConfig(
        level=logging.INFO if rank == 0 else logging.WARNING,
        format="%(asctime)s %(message)s" if rank == 0 else f"%(asctime)s [rank {rank}] %(message)s",
        datefmt="%H:%M:%S",
        stream=sys.stderr,
        force=True,
    )


def log_to_file(path: Path) -> None:
    """Also write the console's log lines to `path`, appended (a resumed run continues its file), with the date:
    a file's lines may span days."""
    handler = logging.FileHandler(path, mode="a", encoding="utf-8")
    handler.setFormatter(logging.Formatter("%(asctime)s %(message)s", datefmt="%Y-%m-%d %H:%M:%S"))
    logging.getLogger().addHandler(handler)  # the root's: setup_logging's basicConfig(force=True) closes it


class ThroughputWindow:
    """The steps since the last log line, for throughput: evaluation, traces and checkpoints restart it."""

    def __init__(self):
        self.restart()

    def restart(self) -> None:
        self.start, self.steps, self.tokens = time.perf_counter(), 0, 0

    def add(self, tokens: int) -> None:
        self.steps, self.tokens = self.steps + 1, self.tokens + tokens

    def exclude(self, seconds: float) -> None:
        """Leave out `seconds` that were not steps (a blocking save, a snapshot, a replay)."""
        self.start += seconds

    def seconds_per_step(self) -> float:
        return (time.perf_counter() - self.start) / self.steps

    def tokens_per_s(self) -> float:
        return self.tokens / (time.perf_counter() - self.start)


def run_info(device: torch.device, world_size: int, layout: Layout) -> dict:
    """What a run ran on: versions, device, world and layout (run_info.json and the trackers)."""
    return {
        "titan_version": __version__,
        "torch_version": torch.__version__,
        "python_version": platform.python_version(),
        "device": str(device) if device.type == "cpu" else torch.cuda.get_device_name(device),
        "world_size": world_size,
        "layout": dataclasses.asdict(layout),
        "hostname": platform.node(),
    }


WANDB_AUTO_TIMEOUT_S = 15  # what metrics.wandb = auto gives wandb to start its run: a tracker never holds up training


def _start_wandb(config: Config, run_dir: Path, mode: str, names: dict, run_id: str, extra_info: dict):
    """The run's wandb run, or None. Under
    metrics.wandb = auto a run wandb cannot start within WANDB_AUTO_TIMEOUT_S (no network, a server that does not
    answer) is left out with one line, and training goes on; asked for by name, its error is the run's."""
    auto = config.metrics.wandb == "auto"
    wandb = import_extra("wandb", "tracking", f"metrics.wandb = {mode!r}")
    settings = {"silent": True, **({"init_timeout": WANDB_AUTO_TIMEOUT_S} if auto else {})}
    try:
        return wandb.init(
            project=config.metrics.wandb_project,
            name=names["name"],
            group=names["group"],
            tags=names["tags"],
            id=run_id,
            resume="allow" if mode == "online" else None,
            dir=str(run_dir),
            mode=mode,
            config={**flatten(to_dict(config)), **extra_info, "recipe": names["recipe"]},
            settings=wandb.Settings(**settings),  # silent: titan prints the run's address itself, once
        )
    except Exception as e:  # wandb's CommError, or whatever its service raises
        if not auto:
            raise
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        log.warning("wandb: off, its run did not start within %d s (%s); training goes on without it (metrics.wandb "
                    "= offline logs here, for `wandb sync` later)", WANDB_AUTO_TIMEOUT_S, first)  # fmt: skip
        return None


def _wandb_credentials() -> bool:
    """Whether wandb can log online: an API key in the environment, or one `wandb login` saved in ~/.netrc."""
    if os.environ.get("WANDB_API_KEY"):
        return True
    import netrc
    from urllib.parse import urlparse

    host = urlparse(os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai")).hostname
    try:
        return netrc.netrc().authenticators(host) is not None
    except (OSError, netrc.NetrcParseError):
        return False
