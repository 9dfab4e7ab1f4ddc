"""The one training loop: build the parts the recipe names, then step, clip, log until done."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import platform
import signal
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel

import models
from titan import __version__
from titan.checkpoint import Checkpointer
from titan.compare import layout_name
from titan.config import Config, ConfigError, gradient_accumulation_steps, to_toml
from titan.data import Tokenizer, build_loader
from titan.float8 import precompute_scales as precompute_float8_scales
from titan.metrics import MetricsLogger, format_line, peak_flops, peak_memory_bytes, setup_logging
from titan.optim import build_lr_scheduler, build_optimizer, clip_grad_norm_
from titan.parallel import pp
from titan.parallel.mesh import ParallelDims, build_mesh, init_distributed
from titan.parallel.parallelize import build_model_parts, check_layout
from titan.parallel.rng import Dropout

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


def build_model(config: Config, device: torch.device) -> torch.nn.Module:
    """The plain single-device model, initialised from the seed: the reference every layout must equal."""
    spec, args = resolve_model(config)
    return build_model_parts(config, spec, args, ParallelDims(1, 1, 1, 1), {}, device).parts[0]


class Trainer:
    def __init__(self, config: Config):
        self.config = config
        t = config.training
        self.device = pick_device(t.device)
        # Everything that can be wrong with the recipe is checked before joining the other processes.
        self.dims = ParallelDims.from_config(config.parallel, int(os.environ.get("WORLD_SIZE", "1")))
        spec, self.model_args = resolve_model(config)
        self.spec = spec
        check_layout(config, spec, self.model_args, self.dims, self.device)
        self.rank, self.world_size = init_distributed(config.parallel.backend, self.device)
        setup_logging(self.rank)
        torch.manual_seed(config.job.seed)
        if config.job.deterministic:
            os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
            torch.use_deterministic_algorithms(True)
        self.tokenizer = Tokenizer(config.tokenizer)
        if self.tokenizer.vocab_size > self.model_args.vocab_size:
            raise ConfigError(
                f"tokenizer has {self.tokenizer.vocab_size} tokens but the model's vocab_size is {self.model_args.vocab_size}; "
                "use a matching tokenizer.path or set model.overrides.vocab_size"
            )
        self.mesh = build_mesh(self.dims, self.device)
        dp_rank = self.mesh["dp"].get_local_rank() if self.mesh else 0
        self.loader = build_loader(config, self.tokenizer, dp_rank, self.dims.dp)

        self.model_parts = build_model_parts(config, spec, self.model_args, self.dims, self.mesh, self.device)
        self.dropouts = [m for part in self.model_parts.parts for m in part.modules() if isinstance(m, Dropout)]
        self.dp_rank = dp_rank
        # One rank per data-parallel group writes the loader position: the first TP and PP rank.
        self.is_data_writer = not self.mesh or (self.mesh["tp"].get_local_rank() == 0 and self.mesh["pp"].get_local_rank() == 0)
        self.optimizer = build_optimizer(list(self.model_parts.parameters()), config.optimizer)
        self.lr_scheduler = build_lr_scheduler(self.optimizer, config.lr_scheduler, t.steps)

        self.grad_accum = gradient_accumulation_steps(config, self.world_size)
        self.tokens_per_step = t.local_batch_size * self.grad_accum * self.dims.dp * t.seq_len
        # Each rank's summed token loss times this is its share of the step's mean loss; gradients are then
        # summed over data-parallel ranks, so every layout computes the gradient of the same global mean.
        self.loss_scale = 1.0 / self.tokens_per_step
        self.loss_parallel = self.dims.tp > 1 and config.parallel.loss_parallel
        self.schedule = None
        if self.dims.pp > 1:
            self.schedule = pp.build_schedule(
                config.parallel, list(zip(self.model_parts.stage_ids, self.model_parts.parts)), self.model_parts.n_stages,
                pp.microbatches(config.parallel, t.local_batch_size), self.loss_fn, self.device, self.mesh["pp"].get_group(),
            )
        # FSDP's MixedPrecisionPolicy casts parameters itself; autocast covers the layouts without FSDP.
        self.autocast = (
            torch.autocast(self.device.type, dtype=torch.bfloat16)
            if t.mixed_precision == "bf16" and self.dims.dp == 1 else contextlib.nullcontext()
        )
        self.flops_per_token = spec.flops_per_token(self.model_args, t.seq_len)
        self.peak_flops = peak_flops(self.device, config.metrics.peak_flops)
        self.step_times: list[float] = []  # host wall time of each step, data loading included
        self.run_dir = config.run_dir
        self.metrics = MetricsLogger(config, self.run_dir, enabled=self.rank == 0, extra_info=self.run_info())
        if self.rank == 0:
            (self.run_dir / "config.toml").write_text(to_toml(config))
            (self.run_dir / "run_info.json").write_text(json.dumps(self.run_info(), indent=2) + "\n")
        self.checkpointer = Checkpointer(config.checkpoint, self.run_dir, self)
        self.step = self.checkpointer.resume()
        if config.checkpoint.init_from_hf:
            from titan.hf_io import init_from_hf  # a fresh start (nothing resumed) takes the HF weights

            init_from_hf(self)
        self.stop_signal: str | None = None
        log.info(
            "%s %s: %.2fM parameters on %s x %d (%s) | %d tokens/step (%d x %d seq x %d accum x %d dp) | %s",
            config.model.name, config.model.flavor, self.n_params() / 1e6, self.device.type, self.world_size,
            layout_name(self.run_info()), self.tokens_per_step, t.local_batch_size, t.seq_len, self.grad_accum, self.dims.dp,
            self.run_dir,
        )

    def n_params(self) -> int:
        """Parameters of the whole model (not this rank's shard)."""
        local = sum(p.numel() for _, p in self.model_parts.named_parameters())
        if self.dims.pp == 1:
            return local
        total = torch.tensor(local if self.mesh["tp"].get_local_rank() == 0 and self.mesh["dp"].get_local_rank() == 0 else 0)
        dist.all_reduce(total)
        return int(total)

    def run_info(self) -> dict:
        return {
            "titan_version": __version__,
            "torch_version": torch.__version__,
            "python_version": platform.python_version(),
            "device": str(self.device) if self.device.type == "cpu" else torch.cuda.get_device_name(self.device),
            "world_size": self.world_size,
            "layout": {"dp_replicate": self.dims.dp_replicate, "dp_shard": self.dims.dp_shard, "tp": self.dims.tp, "pp": self.dims.pp},
            "hostname": platform.node(),
        }

    def loss_fn(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """This rank's share of the step's mean token loss (see loss_scale)."""
        return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), reduction="sum") * self.loss_scale

    def train_step(self, micro_batches: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
        """One optimizer step over the micro-batches; returns (global mean loss, grad norm) as tensors."""
        loss = self.forward_backward(micro_batches)
        params = list(self.model_parts.parameters())
        pp_group = self.mesh["pp"].get_group() if self.dims.pp > 1 else None
        grad_norm = clip_grad_norm_(params, self.config.training.max_grad_norm or float("inf"), pp_group)
        self.optimizer.step()
        precompute_float8_scales(self.config, self.dims, self.model_parts.parts)  # no-op unless float8 all-gather
        self.optimizer.zero_grad(set_to_none=True)
        self.lr_scheduler.step()
        self.step += 1
        return self.global_loss(loss), grad_norm

    def forward_backward(self, micro_batches: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """Accumulate the step's gradients; returns this rank's share of the step's loss.

        The global batch is laid out as [data-parallel rank][micro-batch][row]; each sample's row in it keys
        its dropout masks, so every layout and accumulation drops the same elements.
        """
        for module in self.dropouts:
            module.step = self.step
        loss_sum = torch.zeros((), device=self.device)
        parallel_loss = loss_parallel() if self.loss_parallel else contextlib.nullcontext()
        first_row = self.dp_rank * sum(len(inputs) for inputs, _ in micro_batches)
        for inputs, labels in micro_batches:
            rows = torch.arange(first_row, first_row + len(inputs), device=self.device)
            first_row += len(inputs)
            inputs, labels = inputs.to(self.device, non_blocking=True), labels.to(self.device, non_blocking=True)
            if self.schedule is not None:
                loss_sum += self._pipeline_forward_backward(inputs, labels, rows, parallel_loss)
                continue
            with self.autocast:
                logits = self.model_parts.parts[0](inputs, rows)
            with parallel_loss:
                loss = self.loss_fn(logits, labels)
                loss.backward()
            loss_sum += (loss.full_tensor() if isinstance(loss, DTensor) else loss).detach()
        return loss_sum

    def _pipeline_forward_backward(self, inputs, labels, rows, parallel_loss) -> torch.Tensor:
        losses: list[torch.Tensor] = []
        last = self.model_parts.has_last_stage
        args = (inputs, rows) if self.model_parts.has_first_stage else ()
        with parallel_loss, self.autocast:
            self.schedule.step(*args, target=labels if last else None, losses=losses if last else None, return_outputs=False)
        if not last:
            return torch.zeros((), device=self.device)
        return torch.stack([(x.full_tensor() if isinstance(x, DTensor) else x).detach() for x in losses]).sum()

    def global_loss(self, local: torch.Tensor) -> torch.Tensor:
        """Sum the shares over data-parallel ranks, and take it from the last pipeline stage."""
        if not self.mesh:
            return local
        if self.dims.dp > 1:
            dist.all_reduce(local, group=self.mesh["dp"].get_group())
        if self.dims.pp > 1:
            dist.all_reduce(local, group=self.mesh["pp"].get_group())  # stages without the loss hold 0
        return local

    def train(self) -> list[float]:
        """Train to training.steps; returns the loss of every step run (metrics.jsonl holds the logged ones).

        SIGTERM or SIGUSR1 (a SLURM preemption notice) saves a checkpoint at the next step boundary and
        raises Preempted.
        """
        total = self.config.training.steps
        losses: list[torch.Tensor] = []
        self.model_parts.train()
        first_step, window_start, window_steps = self.step, time.perf_counter(), 0
        with _stop_on_signals(self):
            while self.step < total:
                step_start = time.perf_counter()
                batches = [next(self.loader) for _ in range(self.grad_accum)]
                lr = self.optimizer.param_groups[0]["lr"]
                loss, grad_norm = self.train_step(batches)
                losses.append(loss)
                window_steps += 1
                if self.step % self.config.metrics.log_freq == 0 or self.step in (total, first_step + 1):
                    if self.device.type == "cuda":
                        torch.cuda.synchronize(self.device)
                    self._log_step(loss, grad_norm, lr, (time.perf_counter() - window_start) / window_steps)
                    window_start, window_steps = time.perf_counter(), 0
                self.checkpointer.maybe_save(self.step, final=self.step == total)
                if self._stop_requested():
                    self.checkpointer.save(self.step, wait=True)
                    raise Preempted(f"stopped by {self.stop_signal} at step {self.step}; checkpoint saved in "
                                    f"{self.checkpointer.folder}: run the same command to resume")
                self.step_times.append(time.perf_counter() - step_start)
        self.checkpointer.finish_pending()
        self.metrics.close()
        return [loss.item() for loss in losses]

    def _log_step(self, loss, grad_norm, lr, step_time: float) -> None:
        total = self.config.training.steps
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
        log.info(format_line(self.step, total, metrics, eta_s=step_time * (total - self.step)))

    def _stop_requested(self) -> bool:
        """Whether any rank received a stop signal; all ranks agree, so they stop at the same step."""
        flag = torch.tensor(int(self.stop_signal is not None))
        if self.checkpointer.control_group is not None:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.checkpointer.control_group)
        if flag and self.stop_signal is None:
            self.stop_signal = "another rank's signal"
        return bool(flag)


class Preempted(Exception):
    """Training stopped early on a signal, after saving a checkpoint."""


@contextlib.contextmanager
def _stop_on_signals(trainer: Trainer):
    def request_stop(signum, _frame):
        trainer.stop_signal = signal.Signals(signum).name

    previous = {sig: signal.signal(sig, request_stop) for sig in (signal.SIGTERM, signal.SIGUSR1)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
