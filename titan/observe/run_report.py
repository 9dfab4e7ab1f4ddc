"""A training run's own lines: what it trains at the start, each logged step, each evaluation and the summary at
its end, in the console (and console.log, rank 0) and, with their figures, in the metrics."""

from __future__ import annotations

import json
import logging
import math
import time
from pathlib import Path

import torch

from titan.config import Config, Stage, to_toml
from titan.observe.metrics import (
    MetricsLogger,
    RemainingTime,
    ThroughputWindow,
    format_line,
    peak_flops,
    peak_memory_bytes,
    run_info,
)
from titan.observe.runs import duration
from titan.run_plan import Layout

log = logging.getLogger("titan")


class RunReport:
    """flops_per_token and peak_flops (0: unknown) give the MFU; remaining gives the ETA, and learns from the
    evaluations reported here."""

    def __init__(self, config: Config, metrics: MetricsLogger, device: torch.device, world_size: int,
                 flops_per_token: float, peak_flops: float, remaining: RemainingTime, started: float):  # fmt: skip
        self.config, self.metrics, self.device, self.world_size = config, metrics, device, world_size
        self.flops_per_token, self.peak_flops, self.remaining = flops_per_token, peak_flops, remaining
        self.started = started  # the run's start (time.perf_counter()): its wall time, in its summary
        self.val_loss: float | None = None  # the last evaluation's
        self.best_val: tuple[float, int] | None = None  # the lowest validation loss reported, and its step

    @classmethod
    def of_run(cls, config: Config, device: torch.device, rank: int, world_size: int, layout: Layout,
               flops_per_token: float, bf16: bool, started: float) -> RunReport:  # fmt: skip
        """The run's report, its metrics logged by rank 0 (which also writes the resolved recipe as config.toml
        and what the run runs on as run_info.json into the run folder); bf16: the precision its MFU is of."""
        peak, peak_is = peak_flops(device, config.metrics.peak_flops, torch.bfloat16 if bf16 else torch.float32)
        (log.info if peak else log.warning)("MFU: relative to %s", peak_is)
        info = run_info(device, world_size, layout)
        metrics = MetricsLogger(config, config.run_dir, enabled=rank == 0, extra_info=info)
        if rank == 0:
            (config.run_dir / "config.toml").write_text(to_toml(config))
            (config.run_dir / "run_info.json").write_text(json.dumps(info, indent=2) + "\n")
        t, v, c = config.training, config.validation, config.checkpoint
        remaining = RemainingTime(t.steps, v.interval, v.steps, c.interval if c.enable else 0, config.eval.interval)
        return cls(config, metrics, device, world_size, flops_per_token, peak, remaining, started)

    def start(self, params: int, layout: str, batching: str) -> None:
        """What the run trains: its model and its `params` parameters, on what, and its batches."""
        c = self.config
        log.info("%s %s: %.2fM parameters on %s x %d (%s) | %s | %s", c.model.name, c.model.flavor, params / 1e6,
                 self.device.type, self.world_size, layout, batching, c.run_dir)  # fmt: skip

    def step(self, step: int, figures: dict, window: ThroughputWindow, tokens_seen: int) -> None:
        """A logged step: its `figures` (loss, gradient norm, lr, phases and the step's own), with the throughput
        of the steps in `window` and the memory and MFU they give."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        step_time, tokens_per_s = window.seconds_per_step(), window.tokens_per_s()
        metrics = {
            "loss": float(figures.pop("loss")),
            "grad_norm": float(figures.pop("grad_norm")),
            "lr": figures.pop("lr"),
            "tokens_per_s": tokens_per_s,
            "tokens_per_s_per_device": tokens_per_s / self.world_size,
            "step_time_s": step_time,
            "peak_memory_gib": peak_memory_bytes(self.device) / 2**30,
            "tokens_seen": tokens_seen,
        }
        if self.peak_flops:
            metrics["mfu"] = tokens_per_s * self.flops_per_token / (self.peak_flops * self.world_size)
        metrics.update(figures)
        self.metrics.log(step, metrics)
        eta = self.remaining.eta(step, step_time)
        log.info(format_line(step, self.config.training.steps, metrics, eta_s=eta))

    def stage(self, stage: Stage, step: int, first_step: int, tokens_seen: int) -> None:
        """A data stage's start, at 0-based `step` with `tokens_seen` tokens trained before it: said at its first
        step, and where this call of train() starts (`first_step`: a resume) inside it."""
        if step == stage.first_step or step == first_step:
            verb = "begins" if step == stage.first_step else "goes on"
            mixture = ", ".join(f"{source.source} (weight {source.weight:g})" for source in stage.sources)
            log.info("data stage %d %r %s at step %d, after %d tokens: %s", stage.index, stage.name, verb, step + 1,
                     tokens_seen, mixture)  # fmt: skip

    def validation(self, step: int, loss: float, seconds: float) -> None:
        perplexity = math.exp(min(loss, 50.0))
        self.metrics.log(step, {"val_loss": loss, "val_perplexity": perplexity, "val_time_s": seconds})
        self.val_loss = loss
        self.best_val = min(self.best_val or (loss, step), (loss, step))
        self.remaining.record("validation", seconds)
        log.info("step %d validation: loss %.4f | perplexity %.2f | %.1fs", step, loss, perplexity, seconds)

    def validation_set(self, step: int, name: str, loss: float, seconds: float) -> None:
        """One of validation.sets: its loss, perplexity and seconds, as val/<name>/..."""
        perplexity = math.exp(min(loss, 50.0))
        self.metrics.log(step, {f"val/{name}/loss": loss, f"val/{name}/perplexity": perplexity,
                                f"val/{name}/time_s": seconds})  # fmt: skip
        self.remaining.add_to_last("validation", seconds)
        log.info("step %d validation %s: loss %.4f | perplexity %.2f | %.1fs", step, name, loss, perplexity, seconds)

    def tasks(self, step: int, metrics: dict[str, float], seconds: float) -> None:
        """The eval.tasks' metrics (eval/<task>/<metric>), with the seconds they took as eval_time_s."""
        self.metrics.log(step, {**metrics, "eval_time_s": seconds})
        self.remaining.record("eval", seconds)
        scores = " | ".join(f"{key.removeprefix('eval/')} {value:.4f}" for key, value in metrics.items())
        log.info("step %d eval: %s | %.1fs", step, scores or "no task gave a result", seconds)

    def summary(self, begun: tuple[int, int, float], step: int, tokens_seen: int, loss: float,
                checkpoint: Path | None) -> None:  # fmt: skip
        """The run's end in one block: what this call trained and how fast, its last losses, and where its
        checkpoint and metrics are. begun: the step, tokens seen and time it started from; loss: the last step's;
        checkpoint: the newest saved."""
        first_step, first_tokens, start = begun
        if step == first_step:
            return  # nothing trained: said when training began
        steps = f"steps {first_step + 1}-{step}" if step > first_step + 1 else f"step {step}"
        tokens_per_s = (tokens_seen - first_tokens) / (time.perf_counter() - start)
        memory = f"{peak_memory_bytes(self.device) / 2**30:.2f} GiB" + (" (rank 0)" if self.world_size > 1 else "")
        validation = ""
        if self.best_val is not None:
            best, at = self.best_val
            validation = f" | validation loss {self.val_loss:.4f} (best {best:.4f}, step {at})"
        run_dir = self.config.run_dir
        files = ["metrics.jsonl", "console.log"]
        if checkpoint is not None:
            files.insert(0, str(checkpoint.relative_to(run_dir)))
        wall = duration(time.perf_counter() - self.started)
        log.info(
            f"run summary: {steps} of {self.config.training.steps} | {tokens_seen:,} tokens seen | {wall} wall "
            f"time | {tokens_per_s:,.0f} tokens/s mean | peak memory {memory}\n  loss {loss:.4f}{validation}\n  "
            f"in {run_dir}: {', '.join(files)}" + ("" if checkpoint else " (no checkpoint: checkpoint.enable = false)")
        )
