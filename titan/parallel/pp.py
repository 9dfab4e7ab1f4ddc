"""Pipeline parallelism with torch.distributed.pipelining: layers split into stages, a schedule by name."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import PipelineScheduleMulti, get_schedule_class

from titan.config import Parallel
from titan.errors import ConfigError
from titan.models import StageIO


def schedule_class(name: str):
    try:
        return get_schedule_class(name)
    except ValueError as e:
        raise ConfigError(f"parallel.pp_schedule: {e}") from None


def build_schedule(
    cfg: Parallel,
    stage_modules: list[tuple[int, nn.Module]],
    stage_io: list[StageIO | None],
    n_stages: int,
    n_microbatches: int,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    device: torch.device,
    pp_group,
):
    """stage_io: each stage's tensors for one micro-batch (the model's pipeline_io). Given them, torch skips the
    forward and backward it otherwise runs at the first step to learn the shapes the stages exchange; None: it
    runs them."""
    stages = [
        PipelineStage(
            module,
            index,
            n_stages,
            device,
            input_args=io.inputs if io else None,
            output_args=io.outputs if io else None,
            group=pp_group,
        )
        for (index, module), io in zip(stage_modules, stage_io)
    ]
    cls = schedule_class(cfg.pp_schedule)
    multi = issubclass(cls, PipelineScheduleMulti)
    try:
        # scale_grads=False: titan's loss is already divided by the step's token count.
        return cls(stages if multi else stages[0], n_microbatches=n_microbatches, loss_fn=loss_fn, scale_grads=False)
    except (ValueError, AssertionError) as e:
        raise ConfigError(f"parallel.pp_schedule {cfg.pp_schedule} with {n_microbatches} micro-batches: {e}") from None


def move_stage_state(old: dict[str, dict[str, torch.Tensor]], new: dict[str, dict[str, torch.Tensor]], group) -> int:
    """After a pipeline re-split, fill `new` (this rank's state now: name -> its tensors, a parameter and its
    optimizer state's or a buffer) from `old` (the same, before), sending each moved one's tensors point to point
    from its old rank to its new one. Every rank of the pipeline group calls this; for
    plain tensors only (no FSDP or TP shards). Returns how many tensors this rank received."""
    owners_before: list[list[str]] = [None] * dist.get_world_size(group)  # type: ignore[list-item]
    owners_after: list[list[str]] = [None] * dist.get_world_size(group)  # type: ignore[list-item]
    dist.all_gather_object(owners_before, sorted(old), group=group)
    dist.all_gather_object(owners_after, sorted(new), group=group)
    before = {name: r for r, names in enumerate(owners_before) for name in names}
    after = {name: r for r, names in enumerate(owners_after) for name in names}
    me, ops, received = dist.get_rank(group), [], 0
    for name in sorted(after):
        source, target = before[name], after[name]
        if target == me and source == me:
            for key, tensor in new[name].items():
                tensor.copy_(old[name][key])
            continue
        elif source == me:
            peer = dist.get_global_rank(group, target)
            ops += [dist.P2POp(dist.isend, old[name][key], peer, group) for key in sorted(old[name])]
        elif target == me:
            peer = dist.get_global_rank(group, source)
            ops += [dist.P2POp(dist.irecv, new[name][key], peer, group) for key in sorted(new[name])]
            received += len(new[name])
    if ops:
        for work in dist.batch_isend_irecv(ops):
            work.wait()
    return received
