"""Pipeline parallelism with torch.distributed.pipelining: layers split into stages, a schedule by name."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import PipelineScheduleMulti, get_schedule_class

from titan.balance import layer_split
from titan.config import Parallel
from titan.errors import ConfigError
from titan.models import StageIO
from titan.run_plan import stages_per_rank

# Schedules whose stages sit on the ranks in a V (rank r holds stages r and 2*pp-1-r).
V_SHAPED = {"zbvzerobubble", "dualpipev"}
# Schedules that split backward into input- and weight-gradient passes.
ZERO_BUBBLE = {"interleavedzerobubble", "zbvzerobubble", "dualpipev"}


def schedule_class(name: str):
    try:
        return get_schedule_class(name)
    except ValueError as e:
        raise ConfigError(f"parallel.pp_schedule: {e}") from None


def stage_layers(n_layers: int, cfg: Parallel, layer_gib: float = 0.0) -> list[list[int]]:
    """Layer ids of every stage: the recipe's explicit counts, a split by stage speeds and memory caps, or an
    even split (earlier stages take the remainder, since the last stage also carries the output head)."""
    n_stages = cfg.pp * stages_per_rank(cfg)
    if cfg.pp_schedule.lower() in V_SHAPED and stages_per_rank(cfg) != 2:
        raise ConfigError(f"parallel.pp_schedule {cfg.pp_schedule} needs parallel.pp_stages_per_rank = 2")
    counts = cfg.pp_layers_per_stage
    if not counts and n_stages > n_layers:
        raise ConfigError(
            f"parallel.pp = {cfg.pp} with {stages_per_rank(cfg)} stages per rank needs {n_stages} layers; the "
            f"model has {n_layers}"
        )
    if not counts and (cfg.pp_stage_speeds or cfg.pp_stage_memory_gib):
        speeds = cfg.pp_stage_speeds or [1.0] * n_stages  # memory caps alone bound a split of even speeds
        if len(speeds) != n_stages or min(speeds) <= 0:
            raise ConfigError(
                f"parallel.pp_stage_speeds {speeds} must list {n_stages} positive speeds (pp x stages per rank)"
            )
        caps = cfg.pp_stage_memory_gib or None
        if caps is not None and len(caps) != n_stages:
            raise ConfigError(f"parallel.pp_stage_memory_gib {caps} must list {n_stages} caps, one per stage")
        try:
            counts = layer_split([1.0] * n_layers, speeds, [layer_gib] * n_layers, caps)
        except ValueError:
            raise ConfigError(
                f"parallel.pp_stage_memory_gib {caps}: no split of the {n_layers} layers ({layer_gib:.3g} GiB of "
                "weights, gradients and Adam moments each) fits; raise the caps or use more stages"
            ) from None
    if counts:
        if len(counts) != n_stages or sum(counts) != n_layers or min(counts) < 0:
            raise ConfigError(
                f"parallel.pp_layers_per_stage {counts} must list {n_stages} non-negative counts (pp x stages per "
                "rank) "
                f"summing to the model's {n_layers} layers"
            )
    else:
        counts = [n_layers // n_stages + (1 if s < n_layers % n_stages else 0) for s in range(n_stages)]
    starts = [sum(counts[:s]) for s in range(n_stages)]
    return [list(range(start, start + count)) for start, count in zip(starts, counts)]


def stage_ids(pp_rank: int, pp: int, n_stages: int, schedule: str) -> list[int]:
    if schedule.lower() in V_SHAPED:
        return [pp_rank, 2 * pp - 1 - pp_rank]
    return list(range(pp_rank, n_stages, pp))  # looped: rank r holds stages r, r + pp, ...


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
    if not multi and len(stages) != 1:
        raise ConfigError(
            f"parallel.pp_schedule {cfg.pp_schedule} runs one stage per rank; set parallel.pp_stages_per_rank = 1"
        )
    try:
        # scale_grads=False: titan's loss is already divided by the step's token count.
        return cls(stages if multi else stages[0], n_microbatches=n_microbatches, loss_fn=loss_fn, scale_grads=False)
    except (ValueError, AssertionError) as e:
        raise ConfigError(f"parallel.pp_schedule {cfg.pp_schedule} with {n_microbatches} micro-batches: {e}") from None


def move_stage_state(old: dict[str, dict[str, torch.Tensor]], new: dict[str, dict[str, torch.Tensor]], group) -> int:
    """After a pipeline re-split, fill `new` (this rank's parameters now: name -> {"param": tensor, and its
    optimizer state's tensors}) from `old` (the same, before), sending each moved parameter and its optimizer
    state point to point from its old rank to its new one. Every rank of the pipeline group calls this; for
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
