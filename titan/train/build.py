"""The parts of a run, built from the recipe and its run plan: the device, the model (checked), the data plane and
the training step. The trainer holds them; a pipeline re-split builds the step again for a new plan."""

from __future__ import annotations

import dataclasses
import logging
import math
import shutil
from pathlib import Path

import torch
import torch.distributed as dist

from titan.checkpoint.checkpointer import Checkpointer, RunRecord
from titan.checkpoint.hf.files import copy_tokenizer_files
from titan.checkpoint.train_state import model_buffers, model_shapes
from titan.config import Config, decay_start, math_values, run_stages, to_toml
from titan.data import DocumentBatchLoader, build_loaders, document_pieces, prepared_record, validation_set_loaders
from titan.data.document_batches import Placement
from titan.data.packing import CostModel, Target
from titan.data.tokenizer import tokenizer_file
from titan.errors import ConfigError
from titan.files import hold_run_folder, write_error
from titan.hub import model_folder
from titan.observe.profiling import StepClock
from titan.optim import build_lr_scheduler, build_optimizer, describe_roles, model_roles
from titan.parallel import pp
from titan.parallel.mesh import new_gloo_group, on_rank_0
from titan.parallel.parallelize import build_model_parts, stage_batch
from titan.run_plan import Blocks, RankPlan, RunPlan, run_plan
from titan.train.cost_fit import (
    cached_cost_model,
    collective_seconds,
    ring_bytes_per_second,
    ring_bytes_per_token,
)
from titan.train.model import ResolvedModel, resolve_model
from titan.train.step import StepHook, StepLoss, StepRules, Trained, TrainStep

log = logging.getLogger("titan")


def build_model(config: Config, device: torch.device) -> torch.nn.Module:
    """The plain single-device model, initialised from the seed: the reference every layout must equal."""
    model = resolve_model(config)
    plan = run_plan(config, 1, Blocks(model.args.n_layers))  # one process: no layer split, so no block memory either
    return build_model_parts(config, model.spec, model.args, plan, 0, {}, device).parts[0]


def build_step(
    config: Config,
    model: ResolvedModel,
    plan: RunPlan,
    rank: int,
    mesh,
    device: torch.device,
    clock: StepClock,
    hook: StepHook,
) -> TrainStep:
    """Rank `rank`'s model parts for the plan's layout and layer split, initialised from the seed, with their
    optimizer, lr schedule and (under a pipeline) the schedule that runs them."""
    parts = build_model_parts(config, model.spec, model.args, plan, rank, mesh, device)
    roles = model_roles(model.spec, model.args, config.optimizer)
    if rank == 0:
        groups = describe_roles(roles, model_shapes(model.spec, model.args))
        log.info("optimizer: %s, parameter groups:\n%s", config.optimizer.name, groups)
    optimizer = build_optimizer(parts.parts, config.optimizer)
    decays_from = decay_start(run_stages(config, plan.global_rows))
    lr_scheduler = build_lr_scheduler(optimizer, config.lr_scheduler, config.training.steps, decays_from)
    loss = StepLoss(hook)
    schedule = _pipeline_schedule(config, model, plan, rank, parts, loss, mesh, device) if plan.layout.pp > 1 else None
    sequence = None
    if plan.layout.cp > 1:
        sequence = torch.cat([torch.arange(r.start, r.stop) for r in plan.rank(rank).sequence])
    rules = StepRules.of(plan, config, mesh)
    if rules.qk_clip is not None:
        rules.qk_clip.install(parts.parts)
    trained = Trained(parts, optimizer, lr_scheduler)
    return TrainStep(trained, rules, loss, schedule, sequence, device=device, clock=clock)


def _pipeline_schedule(
    config: Config, model: ResolvedModel, plan: RunPlan, rank: int, parts, loss: StepLoss, mesh, device
):
    n_microbatches = plan.pipeline_microbatches
    documents = config.data.batching == "tokens"
    # What the stages exchange for one micro-batch, so that the schedule need not run one to find out. Packed
    # documents come as one row of as many tokens, but evaluation reads rows: with both, torch finds the shapes of
    # each itself.
    rows, seq = plan.rank(rank).micro_batches[0] // n_microbatches, config.training.seq_len
    if documents:
        rows, seq = 1, rows * seq
    io = [
        model.spec.pipeline_io(model.args, stage_batch(plan, config.data.document_mask, rows, seq, stage))
        if not (documents and config.validation.interval)
        else None
        for stage in parts.stage_ids
    ]
    return pp.build_schedule(
        config.parallel,
        list(zip(parts.stage_ids, parts.parts)),
        io,
        plan.n_stages,
        n_microbatches,
        loss,
        device,
        mesh["pp"].get_group(),
    )


def build_data(
    config: Config, plan: RunPlan, me: RankPlan, model: ResolvedModel, mesh, device: torch.device, control_group
):
    """The training loader (rows, or whole documents under data.batching = "tokens"), the validation loader (None
    without validation) and validation.sets' loaders by name, of the rank `me`."""
    loader, validation = build_loaders(config, plan.global_rows, me.rows, list(me.micro_batches))
    if config.data.batching == "tokens":  # whole documents, not rows
        loader = _document_loader(config, plan, me, model, mesh, device, control_group)
    return loader, validation, validation_set_loaders(config, plan.global_rows, me.rows, list(me.micro_batches))


def _document_loader(config: Config, plan: RunPlan, me: RankPlan, model: ResolvedModel, mesh, device, control_group):
    """Whole documents up to global batch x seq_len tokens a step, shared out by data.balance into micro-batches of
    the plan's document capacity (under context parallelism, on the slots of the dp x cp plane)."""
    d, t, layout = config.data, config.training, plan.layout
    pipeline_rows, capacity = plan.pipeline_microbatches, plan.document_capacity
    target = Target((capacity,) * layout.dp * layout.cp, layout.pp, pipeline_rows or 1, layout.pp > 1, layout.cp)
    placement = Placement(capacity, pipeline_rows, plan.sequence_shards, layout.cp)
    if d.cost_model:
        cost = CostModel(*d.cost_model)
    else:
        dtype = torch.bfloat16 if plan.precision.bf16 else torch.float32
        n_layers = math.ceil(model.args.n_layers / layout.pp)
        # Measured by rank 0 alone, so that every rank plans with the same costs, on a rank's own micro-batches;
        # a ring adds its traffic (below).
        longest = min(d.max_document_len or t.seq_len, capacity)
        cost = on_rank_0(
            lambda: cached_cost_model(model, n_layers, longest, capacity, device, dtype, config.job.seed),
            control_group,
        )
        # Each tensor-parallel rank computes its share of every layer's heads and hidden units.
        cost = dataclasses.replace(cost, a=cost.a / layout.tp, b=cost.b / layout.tp)
        if layout.dp > 1:
            seconds = _fsdp_seconds_per_micro_batch(model, plan, mesh, device, control_group)
            cost = dataclasses.replace(cost, c=cost.c + seconds)
        if layout.cp > 1:
            group = mesh["cp"].get_group()
            r = _ring_seconds_per_token(model, n_layers, dtype, layout.tp, group, device, control_group)
            cost = dataclasses.replace(cost, r=r)
    loader = DocumentBatchLoader(
        document_pieces(config), plan.tokens_per_step, d.balance, cost, target, placement, me.dp_rank, me.cp_rank
    )
    loader.speeds = list(plan.dp_weights)
    return loader


def _fsdp_seconds_per_micro_batch(
    model: ResolvedModel, plan: RunPlan, mesh, device: torch.device, control_group
) -> float:
    """FSDP's collectives per micro-batch, timed on the data-parallel group; the slowest rank's time, so that every
    rank plans with the same cost model."""
    with torch.device("meta"):
        n_params = sum(p.numel() for p in model.spec.build(model.args).parameters())
    dtype = torch.bfloat16 if plan.precision.bf16 else torch.float32
    share = n_params // (plan.layout.pp * plan.layout.tp)
    seconds = torch.tensor(collective_seconds(share, mesh["dp"].get_group(), device, dtype))
    dist.all_reduce(seconds, op=dist.ReduceOp.MAX, group=control_group)
    log.info("data.cost_model: c + %.3g s per micro-batch for FSDP's collectives (measured)", float(seconds))
    return float(seconds)


def _ring_seconds_per_token(model: ResolvedModel, n_layers: int, dtype, tp: int, group, device, control_group) -> float:
    """The cost model's ring term: the seconds one hop of a ring adds per token of a block (keys, values and their
    gradients over the stage's layers and this rank's heads), at the cp group's bandwidth, timed; the slowest
    rank's, so that every rank plans with the same cost model."""
    width = model.spec.kv_width(model.args) // tp
    per_token = ring_bytes_per_token(width, n_layers, torch.empty((), dtype=dtype).element_size())
    seconds = torch.tensor(per_token / ring_bytes_per_second(group, device))
    dist.all_reduce(seconds, op=dist.ReduceOp.MAX, group=control_group)
    log.info("data.cost_model: r = %.3g s per token and ring hop (the cp group's link, measured)", float(seconds))
    return float(seconds)


def build_checkpointer(
    config: Config, model: ResolvedModel, plan: RunPlan, states: dict, rank: int, control_group
) -> Checkpointer:
    """The run's checkpointer: `states` saved and restored by name, with what describes the run (the model, the
    recipe, its math), which a resume checks; DCP's collectives on a gloo group of their own."""
    shapes = model_shapes(model.spec, model.args)
    record = RunRecord(
        {"name": config.model.name, "flavor": config.model.flavor, "shapes": shapes},
        to_toml(with_absolute_tokenizer(config)),
        math_values(config, plan.global_rows) | prepared_record(config),
    )
    folder = config.run_dir / "checkpoints"
    return Checkpointer(
        config.checkpoint,
        folder,
        states,
        record,
        rank=rank,
        save_group=new_gloo_group(config.fault.collective_timeout_s),
        control_group=control_group,
    )


def with_absolute_tokenizer(config: Config) -> Config:
    """The recipe with a local tokenizer.path made absolute: as a checkpoint saves it, so that `titan generate`,
    `titan convert dcp-to-hf` and a resume read its tokenizer from any folder (a hub name or `titan:` corpus is
    found from anywhere as it is)."""
    path = Path(config.tokenizer.path).expanduser()
    if not config.tokenizer.path or not path.exists():
        return config
    return dataclasses.replace(config, tokenizer=dataclasses.replace(config.tokenizer, path=str(path.absolute())))


def keep_tokenizer(config: Config) -> Config:
    """The run's tokenizer copied into the run folder's tokenizer/, which `titan generate`, `titan eval` and
    `titan convert dcp-to-hf` read before the recipe's path: a run folder copied to another machine (or kept after
    its tokenizer's file changed) has the tokenizer it trained with. A tokenizer read from checkpoint.init_from_hf's
    folder (the HF model's own, which a recipe that names none takes) comes with its other files, and the recipe then
    names the copy, which outlives the HF folder, or cache. Rank 0's work, once the run folder is claimed."""
    if not config.tokenizer.path:
        return config
    given = tokenizer_file(config.tokenizer.path)
    folder = config.run_dir.absolute() / "tokenizer"
    if given.parent == folder:  # the copy already, as a run from HF weights names it on resuming
        return config
    folder.mkdir(exist_ok=True)
    source = config.checkpoint.init_from_hf
    if not source or given.parent != model_folder(source, "checkpoint.init_from_hf").absolute():
        shutil.copyfile(given, folder / "tokenizer.json")
        return config
    names = copy_tokenizer_files(given.parent, folder)
    log.info("tokenizer: %s of checkpoint.init_from_hf's %s, copied into %s", ", ".join(names), source, folder)
    return dataclasses.replace(config, tokenizer=dataclasses.replace(config.tokenizer, path=str(folder / names[0])))


def claim_run_folder(folder) -> None:
    """Create the run folder and hold its lock for the run's life: one run per folder."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
        hold_run_folder(folder)
    except BlockingIOError as e:
        raise ConfigError(
            f"run folder {folder} is in use by another titan run ({e.args[0]}); wait for it to end, or "
            "set job.name or job.output_dir to another folder"
        ) from None
    except OSError as e:
        raise ConfigError(f"job.output_dir: {write_error(e)}; choose another job.output_dir") from None


def init_from_hf(config: Config, model: ResolvedModel, parts, resumed: bool) -> None:
    """checkpoint.init_from_hf: the HF checkpoint's weights start a fresh run; a resumed run has its own."""
    if resumed:
        log.info("checkpoint.init_from_hf: not used, the run resumed from a checkpoint")
        return
    from titan.checkpoint import hf

    name = f"{config.model.name} {config.model.flavor}"
    buffers = [item for part in parts.parts for item in model_buffers(part).items()]
    tensors = [*parts.named_parameters(), *buffers]
    hf.init_from_hf(tensors, model.spec, model.args, config.checkpoint.init_from_hf, name)
