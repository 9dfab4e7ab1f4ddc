"""One training step: each micro-batch forward and backward (or through the pipeline schedule), the loss as this
rank's share of the step's global mean, then clipping and the optimizer. `titan plan`'s trace runs the same
pieces: token_loss, compute_precision and update."""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor.parallel import loss_parallel

from titan.config import Config
from titan.data import IGNORE, Batch
from titan.observe.profiling import StepClock
from titan.optim import FiniteFlags, clip_grad_norm_, skip_if_nonfinite
from titan.parallel.cp import all_reduce_gradients
from titan.parallel.float8 import precompute_scales as precompute_float8_scales
from titan.parallel.parallelize import ModelParts
from titan.rng import dropout_step
from titan.rng.shards import full_tensor
from titan.run_plan import Precision, RunPlan


def token_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Summed token cross-entropy, in fp32 whatever the logits' dtype."""
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), reduction="sum", ignore_index=IGNORE)


def compute_precision(rule: Precision, device_type: str):
    """The context the model runs in: autocast where the precision rule asks for it (bf16 without FSDP; with FSDP
    its mixed-precision policy casts the parameters itself)."""
    return torch.autocast(device_type, dtype=torch.bfloat16) if rule.autocast else contextlib.nullcontext()


def update(params: list[torch.Tensor], optimizer, max_grad_norm: float, pp_group=None) -> torch.Tensor:
    """Clip by the global gradient norm, step, drop the gradients; returns the norm. A NaN or inf norm leaves the
    weights and optimizer state as they were, decided on the device (the host reads the norm later)."""
    grad_norm = clip_grad_norm_(params, max_grad_norm or math.inf, pp_group)
    skip_if_nonfinite(optimizer, grad_norm)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return grad_norm


class StepHook:
    """Where a test or a tool looks into a step or changes it, instead of patching the trainer. `step` is the
    number of steps taken before this one. The defaults change nothing."""

    def step(self, step: int, batches: list[Batch], run: Callable) -> tuple[torch.Tensor, torch.Tensor]:
        """Run the step: `run(batches)` returns (this rank's loss share, gradient norm)."""
        return run(batches)

    def loss(self, step: int, loss: torch.Tensor) -> torch.Tensor:
        """Each micro-batch's loss share, before its backward."""
        return loss


class TrainStep:
    """A rank's model parts, optimizer and lr schedule, and the step that trains them."""

    def __init__(
        self,
        parts: ModelParts,
        optimizer,
        lr_scheduler,
        plan: RunPlan,
        config: Config,
        mesh,
        device: torch.device,
        clock: StepClock,
        hook: StepHook,
    ):
        self.parts, self.optimizer, self.lr_scheduler = parts, optimizer, lr_scheduler
        self.plan, self.config, self.mesh, self.device, self.clock, self.hook = plan, config, mesh, device, clock, hook
        self.schedule = None  # the pipeline schedule, under a pipeline (build.build_step sets it)
        # Under context parallelism, the positions of each row its cp group shares that this rank computes
        # (build.build_step sets them).
        self.sequence: torch.Tensor | None = None
        self.loss_parallel = plan.layout.tp > 1 and config.parallel.loss_parallel
        self.precision = compute_precision(plan.precision, device.type)
        # Each rank's summed token loss times this is its share of the step's mean loss (1 / the step's loss-bearing
        # tokens); gradients are then summed over data-parallel ranks, so every layout computes the gradient of
        # the same global mean.
        self.loss_scale = 1.0
        self.step = 0  # the steps taken before the one running

    def __call__(self, batches: list[Batch], step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Step `step + 1`: returns (this rank's share of the loss, gradient norm), both on the device. The loop sums
        the shares over ranks only when it logs or saves: one collective per window rather than per step."""
        return self.hook.step(step, batches, lambda b: self._step(b, step))

    def _step(self, batches: list[Batch], step: int) -> tuple[torch.Tensor, torch.Tensor]:
        local = self.forward_backward(batches, step)
        layout = self.plan.layout
        if layout.cp > 1 and layout.dp == 1:  # FSDP sums them over dp_shard x cp; without it, the cp ranks do
            with self.clock.phase("backward"):
                all_reduce_gradients(list(self.parts.parameters()), self.mesh["cp"].get_group())
        with self.clock.phase("optimizer"):  # with the gradient-norm all-reduce
            pp_group = self.mesh["pp"].get_group() if self.plan.layout.pp > 1 else None
            grad_norm = update(list(self.parts.parameters()), self.optimizer, self.config.training.max_grad_norm,
                               pp_group)  # fmt: skip
            precompute_float8_scales(self.config, self.plan.layout, self.parts.parts)  # no-op unless fp8 AG
            self.lr_scheduler.step()
        return local, grad_norm

    def forward_backward(self, batches: list[Batch], step: int) -> torch.Tensor:
        """Accumulate the step's gradients; returns this rank's share of the step's loss."""
        self.loss_scale, self.step = 1.0 / batches[0].step_loss_tokens, step
        with dropout_step(step):
            return sum((self._micro_batch(b, train=True) for b in batches), torch.zeros((), device=self.device))

    @torch.no_grad()
    def evaluate(self, steps: list[list[Batch]]) -> torch.Tensor:
        """The mean token loss over the steps' batches, summed over the ranks."""
        self.loss_scale = 1.0 / sum(batches[0].step_loss_tokens for batches in steps)
        self.parts.train(False)
        loss = sum(
            (self._micro_batch(b, train=False) for batches in steps for b in batches),
            torch.zeros((), device=self.device),
        )
        self.parts.reshard()
        self.parts.train()
        return self.global_loss(loss)

    def loss(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """This rank's share of the step's mean token loss (see loss_scale)."""
        return self.hook.loss(self.step, token_loss(logits, labels) * self.loss_scale)

    def global_loss(self, local: torch.Tensor) -> torch.Tensor:
        """Sum the shares over data- and context-parallel ranks, and take it from the last pipeline stage."""
        layout = self.plan.layout
        if layout.dp > 1:
            dist.all_reduce(local, group=self.mesh["dp"].get_group())
        if layout.cp > 1:
            dist.all_reduce(local, group=self.mesh["cp"].get_group())
        if layout.pp > 1:
            dist.all_reduce(local, group=self.mesh["pp"].get_group())  # stages without the loss hold 0
        return local

    def _micro_batch(self, batch: Batch, train: bool) -> torch.Tensor:
        """Forward (and backward, when training) one micro-batch; returns its scaled loss sum, detached."""
        if self.sequence is not None and not batch.local:
            batch = self.this_ranks_positions(batch)
        batch = batch.to(self.device)
        # A fresh context per micro-batch: loss_parallel() is a generator-based context, usable once.
        with loss_parallel() if self.loss_parallel else contextlib.nullcontext():
            if self.schedule is not None:
                return self._pipeline(batch, train)
            with self.clock.phase("forward"):
                with self.precision:
                    logits = self.parts.parts[0](batch.inputs, batch.rows, batch.document_ids, local=batch.local)
                loss = self.loss(logits, batch.labels)
            if train:
                with self.clock.phase("backward"):
                    loss.backward()
        return full_tensor(loss).detach()

    def this_ranks_positions(self, batch: Batch) -> Batch:
        """The tokens and labels this context-parallel rank computes; the document ids stay whole, as positions and
        documents are the whole row's."""
        labels = batch.labels[:, self.sequence]
        loss_tokens = int((labels != IGNORE).sum())
        return dataclasses.replace(batch, inputs=batch.inputs[:, self.sequence], labels=labels, loss_tokens=loss_tokens)

    def _pipeline(self, batch: Batch, train: bool) -> torch.Tensor:
        losses: list[torch.Tensor] = []
        last = self.parts.has_last_stage
        args = ()
        if self.parts.has_first_stage:
            args = tuple(x for x in (batch.inputs, batch.rows, batch.document_ids) if x is not None)
        run = self.schedule.step if train else self.schedule.eval
        with self.clock.phase("forward_backward"), self.precision:  # the schedule interleaves them
            run(*args, target=batch.labels if last else None, losses=losses if last else None, return_outputs=False)
        if not last:
            return torch.zeros((), device=self.device)
        return torch.stack([full_tensor(x).detach() for x in losses]).sum()


class UnsettledSteps:
    """The steps whose loss and gradient norm are still on the device. Settling brings them to the host in one
    collective and one device sync and acts on any non-finite one. Every rank settles at the same steps: before
    anything is logged or saved, so a skipped step is known and logged in order."""

    def __init__(self, global_loss: Callable, check_finite: Callable, device: torch.device):
        self.global_loss, self.check_finite = global_loss, check_finite
        self.pending: list[tuple[int, torch.Tensor, torch.Tensor]] = []  # (step, loss share, gradient norm)
        # Each step's finiteness, read at most one step later: a NaN stops the run then, not at the next log.
        self.finite_flags = FiniteFlags(device)
        self.losses: list[float] = []  # every settled step's global loss

    def add(self, step: int, local_loss: torch.Tensor, grad_norm: torch.Tensor) -> None:
        self.pending.append((step, local_loss, grad_norm))
        self.finite_flags.add(grad_norm)

    def settle_if_nonfinite(self) -> None:
        if self.finite_flags.nonfinite_due():
            self.settle()

    def settle(self) -> float | None:
        """Settle the pending steps; returns the last step's global loss."""
        if self.pending:
            steps, shares, norms = zip(*self.pending)
            self.pending.clear()
            self.finite_flags.clear()
            step_losses = self.global_loss(torch.stack(shares)).tolist()
            for step, loss, norm in zip(steps, step_losses, torch.stack(norms).tolist()):
                self.losses.append(loss)
                self.check_finite(step, loss, norm)
        return self.losses[-1] if self.losses else None
