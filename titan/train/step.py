"""One training step: each micro-batch forward and backward (or through the pipeline schedule), the loss as this
rank's share of the step's global mean, then clipping and the optimizer. What the step decides around the model
lives in StepRules, which `titan plan`'s trace follows too, with token_loss."""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor.parallel import loss_parallel

from titan.config import Config
from titan.data import IGNORE, Batch
from titan.observe.profiling import StepClock
from titan.optim import FiniteFlags, clip_grad_norm_, skip_if_nonfinite
from titan.optim.qk_clip import QKClip
from titan.parallel.cp.ring import all_reduce_gradients
from titan.parallel.float8 import precompute_scales as precompute_float8_scales
from titan.parallel.float8 import precomputes_scales
from titan.parallel.parallelize import ModelParts
from titan.parallel.tp import gradient_shares
from titan.rng import dropout_step
from titan.rng.shards import full_tensor
from titan.run_plan import RunPlan
from titan.train.model import resolve_model


@contextlib.contextmanager
def _loss_parallel():
    """torch's loss_parallel(), left however its block ends. torch's turns its cross-entropy ops off after its
    yield without a finally: a block that raises (a step stopped by a failed rank, a planned step that does not
    fit) would leave every later cross-entropy on DTensors in the process computed as if its logits were split by
    class."""
    context = loss_parallel()
    context.__enter__()
    try:
        yield
    finally:
        context.__exit__(None, None, None)


def token_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Summed token cross-entropy, in fp32 whatever the logits' dtype."""
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), reduction="sum", ignore_index=IGNORE)


@dataclasses.dataclass(frozen=True)
class StepRules:
    """What a step does around the model's forward and backward, decided once from the run plan, the recipe and the
    mesh: the trainer's TrainStep and `titan plan`'s trace both follow these, so the plan costs the step that runs.
    A decision added to the step goes here, or the trace cannot see it."""

    loss_parallel: bool  # the output projection's logits stay sharded over tp into the loss
    autocast: bool  # bf16 matmuls on fp32 parameters (bf16 without FSDP; with FSDP its policy casts)
    cp_gradient_group: dist.ProcessGroup | None  # without FSDP, the cp ranks sum their gradients themselves
    tp_gradient_group: dist.ProcessGroup | None  # tp ranks sum their own tokens' gradients (titan/parallel/tp.py)
    pp_group: dist.ProcessGroup | None  # the gradient norm sums over pipeline stages
    loss_groups: tuple[dist.ProcessGroup, ...]  # where the ranks' loss shares are summed
    token_groups: tuple[dist.ProcessGroup, ...]  # the ranks that split the step's tokens: expert loads sum over them
    max_grad_norm: float  # inf: no clipping
    float8_scales: bool  # each update ends by computing the next float8 all-gathers' scales
    qk_clip: QKClip | None = None  # after the update, attention heads whose logits passed tau are scaled back

    @classmethod
    def of(cls, plan: RunPlan, config: Config, mesh) -> StepRules:
        layout = plan.layout
        # FSDP sums gradients over dp_shard x cp; the pipeline's stages without the loss hold 0 of it.
        return cls(
            loss_parallel=layout.tp > 1 and config.parallel.loss_parallel,
            autocast=plan.precision.autocast,
            cp_gradient_group=mesh["cp"].get_group() if layout.cp > 1 and layout.dp == 1 else None,
            tp_gradient_group=mesh["tp"].get_group() if layout.tp > 1 else None,
            pp_group=mesh["pp"].get_group() if layout.pp > 1 else None,
            loss_groups=tuple(mesh[d].get_group() for d in ("dp", "cp", "pp") if getattr(layout, d) > 1),
            # A mixture of experts splits its tokens over tp too (titan/models/moe/parallelize.py).
            token_groups=tuple(mesh[d].get_group() for d in ("dp", "cp", "tp") if getattr(layout, d) > 1),
            max_grad_norm=config.training.max_grad_norm or math.inf,
            float8_scales=precomputes_scales(config, layout),
            qk_clip=QKClip.of(resolve_model(config), tau) if (tau := config.optimizer.qk_clip_tau) else None,
        )

    @classmethod
    def one_process(cls, autocast: bool) -> StepRules:
        """One process without parallelism, as `titan eval` scores a checkpoint: nothing to sum over ranks."""
        return cls(False, autocast, None, None, None, (), (), math.inf, False)

    def loss_context(self):
        """A fresh context per use: loss_parallel() is a generator-based context, usable once."""
        return _loss_parallel() if self.loss_parallel else contextlib.nullcontext()

    def precision(self, device_type: str):
        """The context the model runs in."""
        return torch.autocast(device_type, dtype=torch.bfloat16) if self.autocast else contextlib.nullcontext()

    def update(self, parts: list[nn.Module], optimizer, lr_scheduler, clock) -> tuple[torch.Tensor, dict]:
        """After the step's backwards: sum the gradients where FSDP did not, and those whose shares tp ranks hold,
        clip by the global gradient norm, step, drop the gradients, clip the attention logits (QK-clip), precompute
        float8's scales, move a mixture of experts' balancing biases, advance the lr; returns the norm and the step's
        metrics (tensors): QK-clip's largest logits, the routing's and the losses the model added to the objective
        (Model.step_losses, summed over the ranks as the loss is).
        A NaN or inf norm leaves the weights, biases and optimizer state as they were, decided on the device (the
        host reads the norm later)."""
        params = [p for part in parts for p in part.parameters()]
        if self.cp_gradient_group is not None:
            with clock.phase("backward"):
                all_reduce_gradients(params, self.cp_gradient_group)
        shares = gradient_shares(parts) if self.tp_gradient_group is not None else []
        if shares:
            with clock.phase("backward"):
                all_reduce_gradients(shares, self.tp_gradient_group)
        with clock.phase("optimizer"):  # with the gradient-norm all-reduce
            grad_norm = clip_grad_norm_(params, self.max_grad_norm, self.pp_group)
            skip_if_nonfinite(optimizer, grad_norm)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            metrics = self.qk_clip.after_step(parts, grad_norm.isfinite()) if self.qk_clip is not None else {}
            if self.float8_scales:
                precompute_float8_scales(parts)
            if routings := [part.routing for part in parts if part.routing is not None]:
                pipeline = () if self.pp_group is None else (self.pp_group,)
                metrics |= routings[0].end_step(self.token_groups + pipeline, grad_norm.isfinite(), tuple(routings[1:]))
            metrics |= self.model_losses([part.step_losses() for part in parts])
            lr_scheduler.step()
        return grad_norm, metrics

    def model_losses(self, parts: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        """The losses the model parts added to the step's objective (each part's step_losses), each summed over the
        parts and the ranks; no collective where none did, as on every rank then."""
        names = list(dict.fromkeys(name for losses in parts for name in losses))
        if not names:
            return {}
        shares = torch.stack([sum(losses[name] for losses in parts if name in losses) for name in names])
        return dict(zip(names, self.global_loss(shares)))

    def global_loss(self, local: torch.Tensor) -> torch.Tensor:
        """Sum the ranks' shares of the loss over data-, context- and pipeline-parallel ranks."""
        for group in self.loss_groups:
            dist.all_reduce(local, group=group)
        return local


class StepLoss:
    """Each micro-batch's loss as its rank's share of the step's mean token loss. `scale` is 1 / the step's
    loss-bearing tokens: each rank's summed token loss times it is its share, and gradients are then summed over
    data-parallel ranks, so every layout computes the gradient of the same global mean. The pipeline schedule
    calls it too, so it is made before the schedule and shared with it."""

    def __init__(self, hook: StepHook):
        self.hook = hook
        self.scale = 1.0
        self.step = 0  # the steps taken before the one running

    def __call__(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return self.hook.loss(self.step, token_loss(logits, labels) * self.scale)


class StepHook:
    """Where a test or a tool looks into a step or changes it, instead of patching the trainer. `step` is the
    number of steps taken before this one. The defaults change nothing."""

    def step(self, step: int, batches: list[Batch], run: Callable) -> tuple[torch.Tensor, torch.Tensor]:
        """Run the step: `run(batches)` returns (this rank's loss share, gradient norm)."""
        return run(batches)

    def loss(self, step: int, loss: torch.Tensor) -> torch.Tensor:
        """Each micro-batch's loss share, before its backward."""
        return loss

    def gradients(self, step: int, parts: ModelParts) -> None:
        """The step's gradients as this rank's backward left them (FSDP's reduced shards), before the sums over
        context- and tensor-parallel ranks, clipping and the update."""


@dataclasses.dataclass(frozen=True)
class Trained:
    """What a step trains on a rank: its model parts, with the optimizer and the lr schedule that update them."""

    parts: ModelParts
    optimizer: torch.optim.Optimizer
    lr_scheduler: torch.optim.lr_scheduler.LRScheduler


class TrainStep:
    """A rank's model parts, optimizer and lr schedule, and the step that trains them. Under a pipeline `schedule`
    runs the micro-batches (it was built with `loss`); under context parallelism `sequence` holds the positions of
    each row its cp group shares that this rank computes."""

    def __init__(
        self,
        trained: Trained,
        rules: StepRules,
        loss: StepLoss,
        schedule=None,
        sequence: torch.Tensor | None = None,
        *,
        device: torch.device,
        clock: StepClock,
    ):
        self.parts, self.optimizer, self.lr_scheduler = trained.parts, trained.optimizer, trained.lr_scheduler
        self.rules, self.loss, self.schedule, self.sequence = rules, loss, schedule, sequence
        self.device, self.clock = device, clock
        # The last step's metrics besides its loss and norm: a mixture of experts' expert loads, a multi-token
        # prediction's loss.
        self.metrics: dict[str, torch.Tensor] = {}

    def step_metrics(self) -> dict[str, float]:
        """The last step's metrics besides its loss and norm, for the log."""
        return {name: float(value) for name, value in self.metrics.items()}

    def __call__(self, batches: list[Batch], step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Step `step + 1`: returns (this rank's share of the loss, gradient norm), both on the device. The loop sums
        the shares over ranks only when it logs or saves: one collective per window rather than per step."""
        return self.loss.hook.step(step, batches, lambda b: self._step(b, step))

    def _step(self, batches: list[Batch], step: int) -> tuple[torch.Tensor, torch.Tensor]:
        local = self.forward_backward(batches, step)
        self.loss.hook.gradients(step, self.parts)
        grad_norm, self.metrics = self.rules.update(self.parts.parts, self.optimizer, self.lr_scheduler, self.clock)
        return local, grad_norm

    def forward_backward(self, batches: list[Batch], step: int) -> torch.Tensor:
        """Accumulate the step's gradients; returns this rank's share of the step's loss."""
        self.loss.scale, self.loss.step = 1.0 / batches[0].step_loss_tokens, step
        for part in self.parts.parts:
            if part.routing is not None:  # a mixture of experts' balance loss is on the step loss's scale
                part.routing.set_loss_scale(self.loss.scale)
        with dropout_step(step):
            return sum((self._micro_batch(b, train=True) for b in batches), torch.zeros((), device=self.device))

    @torch.no_grad()
    def evaluate(self, steps: list[list[Batch]]) -> torch.Tensor:
        """The mean token loss over the steps' batches, summed over the ranks."""
        self.loss.scale = 1.0 / sum(batches[0].step_loss_tokens for batches in steps)
        self.parts.train(False)
        loss = sum(
            (self._micro_batch(b, train=False) for batches in steps for b in batches),
            torch.zeros((), device=self.device),
        )
        self.parts.reshard()
        self.parts.train()
        return self.global_loss(loss)

    def global_loss(self, local: torch.Tensor) -> torch.Tensor:
        return self.rules.global_loss(local)

    def _micro_batch(self, batch: Batch, train: bool) -> torch.Tensor:
        """Forward (and backward, when training) one micro-batch; returns its scaled loss sum, detached."""
        if self.sequence is not None and not batch.local:
            batch = self.this_ranks_positions(batch)
        batch = batch.to(self.device)
        with self.rules.loss_context():
            if self.schedule is not None:
                return self._pipeline(batch, train)
            with self.clock.phase("forward"):
                with self.rules.precision(self.device.type):
                    labels = batch.labels if train else None  # a model that trains on more than the next token's
                    logits = self.parts.parts[0](
                        batch.inputs, batch.rows, batch.document_ids, local=batch.local, labels=labels
                    )
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
        # Every stage's forward takes the labels by keyword, as one model's does: a model that trains on more than
        # the next token reads them on its last stage.
        labels = {"labels": batch.labels} if train else {}
        with self.clock.phase("forward_backward"), self.rules.precision(self.device.type):  # interleaved
            run(
                *args,
                target=batch.labels if last else None,
                losses=losses if last else None,
                return_outputs=False,
                **labels,
            )
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
