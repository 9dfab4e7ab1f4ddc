"""The one training loop: build the parts the recipe names, then step, clip, log until done."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import platform
import time

import torch
import torch.nn.functional as F

import models
from titan import __version__
from titan.config import Config, ConfigError, data_parallel_size, gradient_accumulation_steps, to_toml
from titan.data import Tokenizer, build_loader
from titan.metrics import MetricsLogger, format_line, peak_flops, peak_memory_bytes, setup_logging
from titan.optim import build_lr_scheduler, build_optimizer

log = logging.getLogger("titan")


def pick_device(name: str) -> torch.device:
    if name == "cuda" and not torch.cuda.is_available():
        raise ConfigError("training.device = 'cuda' but no CUDA GPU is visible; use 'auto' or 'cpu'")
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda":
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cpu")


def resolve_model(config: Config):
    """The registry spec and the model args (flavor + overrides) the recipe names."""
    try:
        spec = models.get_model_spec(config.model.name)
        # The RoPE table only needs to cover the training sequence length.
        overrides = {"max_seq_len": config.training.seq_len, **config.model.overrides}
        return spec, models.model_args(spec, config.model.flavor, overrides)
    except (KeyError, ValueError) as e:
        raise ConfigError(str(e).strip("'\"")) from None


def build_model(config: Config, device: torch.device):
    """The plain model on `device`, initialised from the seed; returns (model, model args, spec)."""
    spec, args = resolve_model(config)
    with torch.device("meta"):
        model = spec.build(args)
    model.to_empty(device=device)
    model.init_weights(config.job.seed)
    return model, args, spec


class Trainer:
    def __init__(self, config: Config):
        self.config = config
        self.rank, self.world_size = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
        setup_logging(self.rank)
        self.device = pick_device(config.training.device)
        torch.manual_seed(config.job.seed)
        if config.job.deterministic:
            os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
            torch.use_deterministic_algorithms(True)

        self.tokenizer = Tokenizer(config.tokenizer)
        self.model, self.model_args, spec = build_model(config, self.device)
        if self.tokenizer.vocab_size > self.model_args.vocab_size:
            raise ConfigError(
                f"tokenizer has {self.tokenizer.vocab_size} tokens but the model's vocab_size is {self.model_args.vocab_size}; "
                "use a matching tokenizer.path or set model.overrides.vocab_size"
            )
        self.optimizer = build_optimizer(self.model, config.optimizer)
        self.lr_scheduler = build_lr_scheduler(self.optimizer, config.lr_scheduler, config.training.steps)

        self.dp_size = data_parallel_size(config, self.world_size)
        self.dp_rank = 0
        self.grad_accum = gradient_accumulation_steps(config, self.world_size)
        self.loader = build_loader(config, self.tokenizer, self.dp_rank, self.dp_size)

        t = config.training
        self.tokens_per_step = t.local_batch_size * self.grad_accum * self.dp_size * t.seq_len
        self.flops_per_token = spec.flops_per_token(self.model_args, t.seq_len)
        self.peak_flops = peak_flops(self.device, config.metrics.peak_flops)
        self.autocast = (
            torch.autocast(self.device.type, dtype=torch.bfloat16) if t.mixed_precision == "bf16" else contextlib.nullcontext()
        )
        self.step = 0
        self.step_times: list[float] = []  # host wall time of each step, data loading included
        self.run_dir = config.run_dir
        self.metrics = MetricsLogger(config, self.run_dir, enabled=self.rank == 0, extra_info=self.run_info())
        if self.rank == 0:
            (self.run_dir / "config.toml").write_text(to_toml(config))
            (self.run_dir / "run_info.json").write_text(json.dumps(self.run_info(), indent=2) + "\n")
        n_params = sum(p.numel() for p in self.model.parameters())
        log.info(
            "%s %s: %.2fM parameters on %s | %d tokens/step (%d x %d seq x %d accum x %d dp) | %s",
            config.model.name, config.model.flavor, n_params / 1e6, self.device, self.tokens_per_step,
            t.local_batch_size, t.seq_len, self.grad_accum, self.dp_size, self.run_dir,
        )

    def run_info(self) -> dict:
        return {
            "titan_version": __version__,
            "torch_version": torch.__version__,
            "python_version": platform.python_version(),
            "device": str(self.device) if self.device.type == "cpu" else torch.cuda.get_device_name(self.device),
            "world_size": self.world_size,
            "layout": {"dp": self.dp_size, "tp": self.config.parallel.tp, "pp": self.config.parallel.pp},
            "hostname": platform.node(),
        }

    def train_step(self, micro_batches: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
        """One optimizer step over the micro-batches; returns (loss, grad norm) as tensors."""
        loss = self.forward_backward(micro_batches)
        max_norm = self.config.training.max_grad_norm or float("inf")
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.lr_scheduler.step()
        return loss, grad_norm

    def forward_backward(self, micro_batches: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """Accumulate the step's gradients; returns the step's mean token loss.

        Each micro-batch's summed token loss is divided by the step's total token count, so accumulating
        N micro-batches gives exactly the gradient of one batch N times larger.
        """
        step_tokens = sum(labels.numel() for _, labels in micro_batches)
        loss_sum = torch.zeros((), device=self.device)
        for inputs, labels in micro_batches:
            inputs, labels = inputs.to(self.device, non_blocking=True), labels.to(self.device, non_blocking=True)
            with self.autocast:
                logits = self.model(inputs)
            loss = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), reduction="sum") / step_tokens
            loss.backward()
            loss_sum += loss.detach()
        return loss_sum

    def train(self) -> list[float]:
        """Train to training.steps; returns the per-step losses (also in metrics.jsonl at log steps)."""
        cfg = self.config
        losses: list[torch.Tensor] = []
        log_freq, total = cfg.metrics.log_freq, cfg.training.steps
        self.model.train()
        window_start, window_steps, run_start = time.perf_counter(), 0, time.perf_counter()
        while self.step < total:
            step_start = time.perf_counter()
            batches = [next(self.loader) for _ in range(self.grad_accum)]
            lr = self.optimizer.param_groups[0]["lr"]
            loss, grad_norm = self.train_step(batches)
            self.step += 1
            window_steps += 1
            losses.append(loss)
            if self.step % log_freq == 0 or self.step == total or self.step == 1:
                if self.device.type == "cuda":
                    torch.cuda.synchronize(self.device)
                now = time.perf_counter()
                step_time = (now - window_start) / window_steps
                tokens_per_s = self.tokens_per_step / step_time
                metrics = {
                    "loss": float(loss),
                    "grad_norm": float(grad_norm),
                    "lr": lr,
                    "tokens_per_s": tokens_per_s,
                    "tokens_per_s_per_device": tokens_per_s / self.world_size,
                    "mfu": tokens_per_s * self.flops_per_token / (self.peak_flops * self.world_size),
                    "step_time_s": step_time,
                    "peak_memory_gib": peak_memory_bytes(self.device) / 2**30,
                    "tokens_seen": self.step * self.tokens_per_step,
                }
                self.metrics.log(self.step, metrics)
                eta = (now - run_start) / self.step * (total - self.step)
                log.info(format_line(self.step, total, metrics, eta))
                window_start, window_steps = time.perf_counter(), 0
            self.step_times.append(time.perf_counter() - step_start)
        self.metrics.close()
        return [loss.item() for loss in losses]
