"""What a parallel layout asks of the recipe, its model and its device, refused with its reason before any work
starts: the trainer's pre-flight, `titan config show` and `titan plan` check a layout here. Torch-free: the model's
args answer for the model, and the device is asked for (torch loads with it) only by a check that needs it."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from titan.config import Config, Layout
from titan.errors import ConfigError
from titan.models import Args
from titan.run_plan import PP_SCHEDULES, V_SHAPED, stages_per_rank

if TYPE_CHECKING:
    import torch

# Schedules that split backward into input- and weight-gradient passes.
ZERO_BUBBLE = {"interleavedzerobubble", "zbvzerobubble", "dualpipev"}


def check_layout(config: Config, args: Args, layout: Layout, device: Callable[[], torch.device | None]) -> None:
    """Every combination that cannot work with this model and device, refused with its reason before any work
    starts (run_plan then checks the batch and the layer split). device(): the run's device, or None where it is
    not on this machine, which leaves what the layout asks of it to the run."""
    p = config.parallel
    several_stages = _runs_several_stages(p.pp_schedule)  # a misspelt schedule is an error even while pp = 1
    try:
        stages = layout.pp * stages_per_rank(p) if layout.pp > 1 else 1
        args.check_parallelism(layout.tp, stages, layout.ep, layout.cp)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    if layout.pp > 1:
        if stages_per_rank(p) > 1 and not several_stages:
            raise ConfigError(
                f"parallel.pp_schedule {p.pp_schedule} runs one stage per rank; set parallel.pp_stages_per_rank = 1"
            )
        if p.fsdp_reshard_after_forward == "always" and p.pp_schedule.lower() in ZERO_BUBBLE and layout.dp > 1:
            # Known on torch 2.13: the deferred weight-gradient pass then meets resharded parameters and the
            # gradients come out wrong without any error.
            raise ConfigError(
                f"parallel.fsdp_reshard_after_forward = 'always' with the zero-bubble schedule {p.pp_schedule} "
                "gives wrong "
                "gradients in torch 2.13; use 'default' or 'never'"
            )
        if config.validation.interval and p.pp_schedule.lower() in V_SHAPED:
            # torch 2.13: a V-shaped schedule's eval() still runs its backward actions and fails at the first
            # pair of adjacent stages on one rank ("can't steal_bwd_input").
            raise ConfigError(
                f"validation with the V-shaped schedule {p.pp_schedule} fails in torch 2.13 (its eval path runs "
                "backward actions); use another parallel.pp_schedule, or set validation.interval = 0"
            )
    _check_device(config, args, layout, device)


def _runs_several_stages(schedule: str) -> bool:
    """Whether torch's pipeline schedule of this name (in any case) may run several stages per rank."""
    by_name = {name.lower(): several for name, several in PP_SCHEDULES.items()}
    if schedule.lower() not in by_name:  # torch's own words, as its get_schedule_class refuses the name
        raise ConfigError(
            f"parallel.pp_schedule: Unknown schedule name '{schedule}'. The valid options are {list(PP_SCHEDULES)}"
        )
    return by_name[schedule.lower()]


def _check_device(config: Config, args: Args, layout: Layout, device: Callable[[], torch.device | None]) -> None:
    """What the layout asks of the device; a recipe that asks nothing of it leaves the device, and torch, unloaded."""
    p = config.parallel
    nccl = p.backend == "nccl" and layout.world_size > 1
    compiled_sequence_parallel = config.compile.enable and layout.tp > 1 and p.sequence_parallel
    if not (nccl or compiled_sequence_parallel or config.float8.enable):
        return
    here = device()
    if here is None:
        return
    if nccl and here.type != "cuda":
        raise ConfigError("parallel.backend = 'nccl' needs CUDA GPUs; use 'gloo' (or 'auto') on CPU")
    if compiled_sequence_parallel and here.type == "cpu":
        # torch 2.13: the backward of a compiled block with sequence-parallel DTensors fails on CPU.
        raise ConfigError(
            "compile.enable with parallel.tp > 1 and sequence_parallel fails on CPU in torch 2.13; "
            "set parallel.sequence_parallel = false or compile.enable = false"
        )
    if config.float8.enable:
        from titan import models
        from titan.parallel import float8  # torchao's float8 and the meta model it filters

        float8.check_float8(config, layout, here, models.get_model_spec(config.model.name), args)
