"""What each rank of a recorded run computes, captured by hooks on the model parts and the optimizer and saved
as <run folder>/records/rank<r>.pt."""

from __future__ import annotations

from functools import partial
from pathlib import Path

import torch
from torch import nn

from titan.config import Config

RECORDS = "records"


def _local(t: torch.Tensor) -> torch.Tensor:
    """This rank's values of a tensor (a DTensor's local shard), as a float32 copy on the host."""
    from torch.distributed.tensor import DTensor

    if isinstance(t, DTensor):
        t = t._local_tensor  # to_local() would go through autograd
    return t.detach().float().cpu().clone()


class Recorder:
    """Copies of what this rank computes, taken by hooks on the model parts and the optimizer. Nothing is
    gathered (one all-gather per tensor would cost more than the step): a sharded parameter, gradient or
    optimizer state is kept as a piece, its local values with their flat indices in the full tensor, and the
    comparison assembles the ranks' pieces."""

    def __init__(self, model_parts, optimizer, stages=()):
        self.step = 0
        self.rows = None
        self.routes: dict = {}  # a MoE's name -> its router's experts (tokens, top_k) in this forward
        self.calls: dict = {}  # a module's name -> its calls in this forward
        self.inferring = False
        for stage in stages:
            # torch's pipeline stages run a forward on uninitialised tensors at their first step to learn the
            # shapes they exchange (private API; where it is absent there is nothing to skip).
            infer = getattr(stage, "_forward_metadata_inference", None)
            if infer is not None:
                stage._forward_metadata_inference = partial(self._inferring, infer)
        self.named = list(model_parts.named_parameters())
        self.indices = {name: _global_indices(p) for name, p in self.named}  # gradients and states share them
        self.placements = {name: getattr(p, "placements", None) for name, p in self.named}
        self.optimizer = optimizer
        self.tokens: list = []  # (step, rows, token ids)
        self.forward: list = []  # (step, module, rows, output)
        self.grads: dict = {}  # step -> {parameter: gradient}
        self.updated: dict = {}  # step -> {parameter/state: tensor} after the update
        self.init = {name: self._piece(name, p) for name, p in self.named}
        for part in model_parts.parts:
            part.register_forward_pre_hook(self._batch)
            for name, module in part.named_modules():
                if module is not part:
                    module.register_forward_hook(partial(self._output, name))
        optimizer.register_step_pre_hook(self._take_grads)
        optimizer.register_step_post_hook(self._take_update)

    def _inferring(self, infer, *args, **kwargs):
        self.inferring = True
        try:
            return infer(*args, **kwargs)
        finally:
            self.inferring = False

    def _batch(self, _module, args) -> None:
        if self.inferring:
            return
        # Stage inputs are (tokens or hidden states, rows, ...) positionally, as the trainer and schedules pass them.
        first = args[0]
        self.rows = args[1].cpu().clone() if len(args) > 1 else torch.arange(first.shape[0])
        self.calls = {}
        if not first.is_floating_point():
            self.tokens.append((self.step, self.rows, first.cpu().clone()))

    def _output(self, name: str, module: nn.Module, _args, output) -> None:
        # Activation checkpointing re-runs forwards inside backward: those are the same values, recorded once.
        if torch._C._current_graph_task_id() != -1 or self.inferring:
            return
        calls = self.calls[name] = self.calls.get(name, 0) + 1
        if calls > 1:  # a module that a forward calls again (a multi-token prediction's embedding and head)
            name = f"{name} (call {calls})"
        output = self._compared(name, module, output)
        if isinstance(output, torch.Tensor) and output.is_floating_point():
            rows = len(self.rows)
            if output.ndim and output.shape[0] != rows and output.shape[0] % rows == 0:
                # A MoE's modules take the rows' tokens flattened, all of each row's positions or, under tensor
                # parallelism, a tp rank's share of them: per row again, as the comparison matches rows (and finds
                # a share's chunk of the positions).
                output = output.view(rows, -1, *output.shape[1:])
            # A tensor-parallel shard stays local: the comparison finds its chunk of the reference.
            self.forward.append((self.step, name, self.rows, _local(output)))

    def _compared(self, name: str, module: nn.Module, output):
        """What of a module's output is compared: a tuple's first tensor, but for a MoE's router and experts,
        whose outputs follow the routing rather than the rows."""
        from titan.models.moe.experts import GroupedExperts
        from titan.models.moe.routing import Router, pair_order

        moe = name.rpartition(".")[0]
        if isinstance(module, Router):
            scores, experts, weights = output
            self.routes[moe] = experts
            # Each token's weight for each expert, 0 where not chosen: a token routed otherwise differs there.
            return torch.zeros_like(scores).scatter_(1, experts, weights)
        if isinstance(module, GroupedExperts):
            # The (token, expert) pairs of this rank's tokens sorted by expert (under expert parallelism, computed
            # on the experts' ranks and returned): in token order, (tokens, top_k, dim), as the MoE combines them.
            experts = self.routes.pop(moe)
            return torch.empty_like(output).index_copy_(0, pair_order(experts), output).view(*experts.shape, -1)
        if isinstance(output, tuple):
            return output[0] if output else None
        return output

    def _piece(self, name: str, t: torch.Tensor) -> tuple:
        from torch.distributed.tensor import DTensor, Replicate

        index = self.indices[name]
        if isinstance(t, DTensor) and t.placements != self.placements[name]:  # e.g. an embedding's gradient
            if any(p.is_partial() for p in t.placements):  # partial sums: add them up (all ranks get here)
                t = t.redistribute(placements=[Replicate() if p.is_partial() else p for p in t.placements])
            index = _global_indices(t)
        return _local(t).reshape(-1), index, tuple(t.shape)

    def _take_grads(self, _optimizer, _args, _kwargs) -> None:
        self.grads[self.step] = {name: self._piece(name, p.grad) for name, p in self.named if p.grad is not None}

    def _take_update(self, _optimizer, _args, _kwargs) -> None:
        after = {}
        for name, p in self.named:
            after[name] = self._piece(name, p)
            for key, value in self.optimizer.state.get(p, {}).items():
                if key != "step":
                    after[f"{name}:{key}"] = self._piece(name, value)
        self.updated[self.step] = after
        self.step += 1

    def save(self, path: Path, tp_rank: int, tp: int, positions: torch.Tensor | None) -> None:
        fields = ("tokens", "forward", "grads", "updated", "init")
        record = {"tp_rank": tp_rank, "tp": tp, "positions": positions, **{f: getattr(self, f) for f in fields}}
        torch.save(record, path)


def _global_indices(p: torch.Tensor) -> torch.Tensor | None:
    """Flat indices of a DTensor's local elements in the full tensor; None for a whole tensor."""
    from torch.distributed.tensor import DTensor

    from titan.rng import dtensor_global_indices

    return dtensor_global_indices(p, device="cpu").reshape(-1) if isinstance(p, DTensor) else None


def add_rounding_noise(model_parts, seed: int = 0) -> None:
    """Move every leaf module's fp32 output one unit in the last place, up or down at random (a fixed seed;
    gradients pass through unchanged): the floor run's stand-in for another layout's order of sums. Splitting the
    micro-batch alone can leave whole tensors bitwise equal on some CPUs' kernels (MKL's row blocking), and a floor
    of 0 hides what the optimizer makes of rounding: Adam divides a near-zero gradient's rounding by eps, moving its
    weight by up to lr. One ulp everywhere shows that on every machine."""
    generator = torch.Generator().manual_seed(seed)  # its own: the run's RNG (dropout) stays the reference's

    def nudge(_module, _args, output):
        # fp32 only: a bf16 output's own rounding hides most of a changed fp32 sum, and a whole bf16 ulp on every
        # element stands for more than a layout's rounding (a floor 3x TP2's own differences on the debug model).
        if not isinstance(output, torch.Tensor) or output.dtype not in (torch.float32, torch.float64):
            return None
        signs = torch.randint(0, 2, output.shape, generator=generator).to(output.device, torch.bool)
        infinity = torch.tensor(float("inf"), dtype=output.dtype, device=output.device)
        moved = torch.nextafter(output.detach(), torch.where(signs, infinity, -infinity))
        return output + (moved - output.detach())

    for part in model_parts.parts:
        for module in part.modules():
            if next(module.children(), None) is None:
                module.register_forward_hook(nudge)


def record(config: Config, steps: int, rounding_noise: bool = False) -> None:
    """Train `steps` steps of the recipe, recording this rank into <run folder>/records/rank<r>.pt; with
    `rounding_noise`, every module's fp32 output moved by one ulp (the floor run: add_rounding_noise)."""
    import torch.distributed as dist

    from titan.train.trainer import Trainer

    trainer = Trainer(config)
    if rounding_noise:
        add_rounding_noise(trainer.model_parts)
    schedule = trainer.stepper.schedule
    stages = getattr(schedule, "_stages", None) or [getattr(schedule, "_stage", None)] if schedule else []
    recorder = Recorder(trainer.model_parts, trainer.optimizer, [s for s in stages if s is not None])
    trainer.train(until=steps)
    folder = config.run_dir / RECORDS
    folder.mkdir(exist_ok=True)
    tp = trainer.layout.tp
    tp_rank = trainer.mesh["tp"].get_local_rank() if tp > 1 else 0
    recorder.save(folder / f"rank{trainer.rank}.pt", tp_rank, tp, trainer.stepper.sequence)
    if dist.is_initialized():
        dist.barrier(group=trainer.control_group)


def replay_run(config: Config, until: int) -> None:
    """Train from the recipe's checkpoint (checkpoint.resume) to step `until`, where the trainer saves: its digests
    (replay.digests) and that checkpoint are what the replay compares."""
    from titan.train.trainer import Trainer

    Trainer(config).train(until=until)
