"""The pre-flight: everything the recipe asks of the model, the layout and the device, checked before any process
group is joined, and the recipe as the run runs it (activation_checkpoint.budget_gib = 0 resolved). The trainer
runs it, and `titan config show`."""

from __future__ import annotations

import dataclasses

import torch

from titan.checkpoint.hf import with_weights_tokenizer
from titan.config import Config, Layout, require_inputs
from titan.data import Tokenizer
from titan.errors import ConfigError
from titan.models import Args
from titan.parallel.ac import measured_layers
from titan.parallel.parallelize import check_layout, model_blocks
from titan.run_plan import Blocks, RunPlan, run_plan
from titan.train.device import device_memory
from titan.train.model import ResolvedModel, resolve_model


@dataclasses.dataclass(frozen=True)
class CheckedRun:
    """What the recipe asks of the model and the device, checked: the recipe as it runs, the model, the layout for
    it, and the run plan with its blocks."""

    config: Config
    model: ResolvedModel
    layout: Layout
    blocks: Blocks
    plan: RunPlan


def check_run(config: Config, world_size: int, device: torch.device | None) -> CheckedRun:
    """Everything the recipe asks, checked before any process group is joined. device None: not on this machine,
    so what the layout asks of it, and the budget it leaves, wait for the run."""
    require_inputs(config)
    config = with_weights_tokenizer(config)
    model = resolve_model(config)
    per_row = model.args.per_row
    if config.data.batching == "tokens" and per_row is not None:
        raise ConfigError(
            f"data.batching = 'tokens' does not support {per_row.what} yet: {per_row.why}, and packing places a "
            f"document in other rows on every layout; {per_row.fix} in [model.overrides] or use data.batching = 'rows'"
        )
    layout = Layout.from_config(config.parallel, world_size)
    check_layout(config, model.spec, model.args, layout, device)
    blocks = model_blocks(model.spec, model.args)
    plan = run_plan(config, layout.world_size, blocks)
    if config.activation_checkpoint.mode == "auto":
        measured_layers(model.spec, model.args, plan.stage_layers[0])  # rank 0 measures on the first stage
    if device is not None:
        config = with_device_budget(config, layout.world_size, device)
    return CheckedRun(config, model, layout, blocks, plan)


def with_device_budget(config: Config, world_size: int, device: torch.device) -> Config:
    """activation_checkpoint.mode = "auto" with budget_gib = 0: the budget this rank's device leaves, as `titan plan`
    works it out."""
    ac = config.activation_checkpoint
    if ac.mode != "auto" or ac.budget_gib:
        return config
    from titan.train.estimate.estimate import with_activation_budget  # tracing's imports take a while

    return with_activation_budget(config, world_size, device_memory(device))


def check_tokenizer(config: Config, args: Args) -> None:
    """The tokenizer's ids fit the model's embedding."""
    tokenizer = Tokenizer(config.tokenizer)
    if tokenizer.vocab_size > args.vocab_size:
        raise ConfigError(
            f"tokenizer has {tokenizer.vocab_size} tokens but the model's vocab_size is {args.vocab_size}; "
            "use a matching tokenizer.path or set model.overrides.vocab_size"
        )
