"""The pre-flight: everything the recipe asks of the model, the layout and the device, checked before any process
group is joined, and the recipe as the run runs it (activation_checkpoint.budget_gib = 0 resolved). The trainer
runs it, and `titan config show`."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING

from titan import models
from titan.checkpoint.weights_tokenizer import with_weights_tokenizer
from titan.config import Config, Layout, require_inputs
from titan.data import Tokenizer
from titan.errors import ConfigError
from titan.models import Args, model_blocks
from titan.parallel.checks import check_layout
from titan.run_plan import Blocks, RunPlan, run_plan
from titan.train.model import ResolvedModel, resolve_args

if TYPE_CHECKING:
    import torch


@dataclasses.dataclass(frozen=True)
class CheckedRun:
    """What the recipe asks of the model and the device, checked: the recipe as it runs, the model's args, the
    layout for it, and the run plan with its blocks."""

    config: Config
    args: Args
    layout: Layout
    blocks: Blocks
    plan: RunPlan

    @property
    def model(self) -> ResolvedModel:
        """The model: its family's spec (torch loads with its code) and the checked args."""
        return ResolvedModel(models.get_model_spec(self.config.model.name), self.args)


def check_run(config: Config, world_size: int, device: Callable[[], torch.device | None]) -> CheckedRun:
    """Everything the recipe asks, checked before any process group is joined; torch-free but for the checks that
    ask for the device. device(): the run's device, or None where it is not on this machine, so what the layout
    asks of it, and the budget it leaves, wait for the run."""
    require_inputs(config)
    config = with_weights_tokenizer(config)
    args = resolve_args(config)
    per_row = args.per_row
    if config.data.batching == "tokens" and per_row is not None:
        raise ConfigError(
            f"data.batching = 'tokens' does not support {per_row.what} yet: {per_row.why}, and packing places a "
            f"document in other rows on every layout; {per_row.fix} in [model.overrides] or use data.batching = 'rows'"
        )
    layout = Layout.from_config(config.parallel, world_size)
    check_layout(config, args, layout, device)
    blocks = model_blocks(args)
    plan = run_plan(config, layout.world_size, blocks)
    if config.activation_checkpoint.mode == "auto":  # rank 0 measures on the first stage (its code loads torch)
        from titan.parallel.ac import measured_layers

        measured_layers(models.get_model_spec(config.model.name), args, plan.stage_layers[0])
    config = with_device_budget(config, layout.world_size, device)
    return CheckedRun(config, args, layout, blocks, plan)


def with_device_budget(config: Config, world_size: int, device: Callable[[], torch.device | None]) -> Config:
    """activation_checkpoint.mode = "auto" with budget_gib = 0: the budget this rank's device leaves, as `titan plan`
    works it out (none yet where the device is not on this machine)."""
    ac = config.activation_checkpoint
    if ac.mode != "auto" or ac.budget_gib:
        return config
    here = device()
    if here is None:
        return config
    from titan.train.device import device_memory
    from titan.train.estimate.estimate import with_activation_budget  # tracing's imports take a while

    return with_activation_budget(config, world_size, device_memory(here))


def check_tokenizer(config: Config, args: Args) -> None:
    """The tokenizer's ids fit the model's embedding."""
    tokenizer = Tokenizer(config.tokenizer)
    if tokenizer.vocab_size > args.vocab_size:
        raise ConfigError(
            f"tokenizer has {tokenizer.vocab_size} tokens but the model's vocab_size is {args.vocab_size}; "
            "use a matching tokenizer.path or set model.overrides.vocab_size"
        )
