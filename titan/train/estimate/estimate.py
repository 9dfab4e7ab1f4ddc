"""`titan plan`: what a recipe's training step needs on each rank at its real world size, and how long it takes,
worked out on this CPU with no GPU and no other process.

Each pipeline rank's step is traced (trace.py): one micro-batch through its stages, then the optimizer
step, under fake tensors on a fake process group. The ranks of one pipeline rank hold alike shards, so one stands
for all. Blocks are alike too, so a rank is traced with 3 blocks per stage (TRACED_DEPTH), one rank again with
3 + every (activation checkpointing's period) in its longest stage, and every figure grows from there at that rate
per block to the stages' real depths (depth.py): parameters, activations, peaks, FLOPs, traffic.
Then:

- the pipeline schedule's own table of actions (pipeline.py) says how many micro-batches each rank
  holds at once, and replayed with each stage's times it gives the step time;
- an op takes the slower of its FLOPs at the device's peak and its bytes through HBM (a roofline),
  tensor-parallel collectives add to that, FSDP's overlap it (devices.py);
- so the step time is a lower bound (no kernel gaps, ideal overlap) and the MFU an upper bound.

The peaks under each way of running the blocks, and the activation budget, are activations.py's; the
figures land in figures.py's StepEstimate.
"""

from __future__ import annotations

import dataclasses
import logging

from titan.config import Config, Layout
from titan.errors import ConfigError
from titan.launcher import Launch
from titan.models import model_blocks
from titan.parallel.ac_choices import GIB
from titan.parallel.checks import check_layout
from titan.run_plan import run_plan
from titan.train.estimate.activations import (
    MODES,
    activation_budget,
    block_ways,
    choose_checkpointing,
    compiled_saving,
    mode_ways,
    peak_with,
)
from titan.train.estimate.depth import trace_ranks
from titan.train.estimate.devices import Links, planned_device
from titan.train.estimate.experts import all_to_all_formula
from titan.train.estimate.figures import StepEstimate
from titan.train.estimate.pipeline import replay, schedule_actions
from titan.train.estimate.trace import CPU, RankTrace, TraceContext, fake_world, trace_rank, with_checkpointing
from titan.train.model import resolve_model

log = logging.getLogger("titan")


def estimate_step(config: Config, world_size: int) -> StepEstimate:
    """Trace the recipe's step on every pipeline rank and put the figures together. With activation_checkpoint.mode
    = "auto" the step is traced with full recomputation, and each rank's blocks then take the ways the memory
    planner chooses from the traced bytes and roofline seconds of one block of its kind (ModelSpec.block_kinds: a
    mixture of experts' dense and routed blocks) run each way."""
    auto, compiled = config.activation_checkpoint.mode == "auto", config.compile.enable
    config = _as_traced(config)
    model = resolve_model(config)
    check_layout(config, model.args, Layout.from_config(config.parallel, world_size), lambda: CPU)
    run = run_plan(config, world_size, model_blocks(model.args))
    layout, layers = run.layout, [list(ids) for ids in run.stage_layers]
    rows, microbatches = run.largest_micro_batch
    estimate = StepEstimate(config, planned_device(config.plan), run, layout, rows, microbatches, run.schedule_runs)
    estimate.kinds = model.spec.block_kinds(model.args)
    estimate.kind_activations = {kind: {} for kind in estimate.kinds}  # the first layer's kind first
    with fake_world(layout) as mesh:
        context = TraceContext(model, run, mesh, rows, estimate.device)

        def trace(pp_rank: int, depth: int, traced: Config = config, forward_only=False, **options) -> RankTrace:
            runs = 0 if forward_only else min(microbatches, 2)  # the second one is the steady state
            return trace_rank(traced, context, pp_rank, depth, runs, **options)

        order = estimate.order = schedule_actions(config, run, mesh, microbatches) if layout.pp > 1 else None
        trace_ranks(estimate, trace, layers, order)
        # What one block of each kind holds under each mode, from one block's forward (and backward, for auto),
        # but the recipe's mode where the deep trace's first block was of that kind.
        one_block: dict[str, dict[str, RankTrace]] = {}
        for kind, activations in estimate.kind_activations.items():
            one_block[kind] = {}
            for mode in MODES:
                if auto or mode not in activations:
                    # The mode on the one block alone: blocks after the layers (a multi-token prediction's) run
                    # alike in every mode's trace, and the differences between the modes are the one block's.
                    traced = with_checkpointing(config, mode, every=2)
                    like = estimate.kinds.index(kind)
                    one_block[kind][mode] = trace(0, 1, traced=traced, forward_only=not auto, like=like)
                    activations[mode] = one_block[kind][mode].block_held[0]
        # The routed tokens' activations from the traces whose blocks keep them (the recipe's, when it keeps all).
        keeping = [traces["none"] for traces in one_block.values() if "none" in traces]
        if config.activation_checkpoint.mode == "none":
            keeping.append(estimate.ranks[0].trace)
        estimate.routed_activations = max((held for t in keeping for held in t.routed_held), default=0)
    if compiled:
        estimate.compiled_saving = compiled_saving(config, model, layout, rows)
        for rank in estimate.ranks:
            ways = mode_ways(estimate, rank, config.activation_checkpoint.mode)
            rank.peak, rank.activations, rank.in_flight = peak_with(estimate, rank, order, ways)
    for rank in estimate.ranks:
        rank.peak_by_mode = {m: peak_with(estimate, rank, order, mode_ways(estimate, rank, m))[0] for m in MODES}
    if auto:
        estimate.kind_options, block_costs = block_ways(estimate, one_block)
        for rank in estimate.ranks:
            choose_checkpointing(estimate, rank, order, block_costs)
    _step_time(estimate, model.spec.flops_per_token(model.args, config.training.seq_len), order)
    if layout.ep > 1:
        for rank in estimate.ranks:
            rank.all_to_all_formula = all_to_all_formula(estimate, rank, model.spec.routed_experts(model.args))
    return estimate


def with_activation_budget(config: Config, world_size: int, device_bytes: int) -> Config:
    """The recipe for a run on devices of `device_bytes` each, its activation_checkpoint.budget_gib = 0 replaced
    by what such a device leaves (activation_budget, less plan.headroom_fraction): `titan train` calls this, so
    that the trainer plans its blocks within the budget that `titan plan` shows for that device."""
    estimate = estimate_step(config, world_size)
    usable = device_bytes * (1 - config.plan.headroom_fraction)
    pp_rank = estimate.run.rank(Launch.from_env().rank).pp_rank
    budget = activation_budget(estimate, estimate.ranks[pp_rank], usable)
    log.info(
        "activation_checkpoint.budget_gib = 0: the blocks may keep %.4g GiB per micro-batch, what %.4g GiB of device "
        "memory (plan.headroom_fraction %g) leaves after the rest of the step",
        budget / GIB, usable / GIB, config.plan.headroom_fraction,
    )  # fmt: skip
    if budget <= 0:
        raise ConfigError(
            f"activation_checkpoint.budget_gib = 0: the step needs more than the {usable / GIB:.4g} GiB usable on "
            "this device before any activations; run `titan plan` on the recipe to see where it goes"
        )
    ac = dataclasses.replace(config.activation_checkpoint, budget_gib=budget / GIB)
    return dataclasses.replace(config, activation_checkpoint=ac)


def _as_traced(config: Config) -> Config:
    """The recipe as the planner runs it: eagerly (estimate_step then takes off what compiled blocks keep less), on
    causal rows, with the CPU's flash attention kept by selective checkpointing wherever the GPU's would be, and
    auto checkpointing as full (estimate_step then plans the blocks): a recomputing step's trace holds what
    recomputation adds in backward, and the peaks derived from it for the other ways come out a little high
    rather than low (a trace keeping everything gave a 405B pipeline rank's all-full peak 13% low)."""
    ac = config.activation_checkpoint
    save_ops = list(ac.save_ops)
    if "aten._scaled_dot_product_flash_attention" in save_ops:
        save_ops.append("aten._scaled_dot_product_flash_attention_for_cpu")
    mode = "full" if ac.mode == "auto" else ac.mode
    return dataclasses.replace(
        config,
        compile=dataclasses.replace(config.compile, enable=False),
        activation_checkpoint=dataclasses.replace(ac, mode=mode, save_ops=save_ops),
        # The trace holds one document per row, which a document mask leaves causal; a GPU's flex attention keeps
        # no mask for backward, where the traceable model's dense one would (seq² bf16 per row and block).
        data=dataclasses.replace(config.data, document_mask=False),
    )


def _step_time(estimate: StepEstimate, flops_per_token: float, order) -> None:
    """The step's time: the pipeline replayed with each stage's times (or the micro-batches one after another),
    then the optimizer step; and the MFU that gives."""
    layout = estimate.layout
    links = Links(estimate.device, layout.world_size)
    forward, backward, once, optimizer, runs = {}, {}, 0.0, 0.0, estimate.runs
    for rank in estimate.ranks:
        t = rank.trace
        for stage in rank.stage_ids:
            forward[stage] = links.seconds(t.forward[stage], t.groups)
            backward[stage] = links.seconds(t.backward[stage], t.groups)
        rank_once, rank_optimizer = links.seconds(t.once, t.groups), links.seconds(t.optimizer, t.groups)
        compute = estimate.microbatches * sum(forward[s] + backward[s] for s in rank.stage_ids)
        rank.seconds = runs * (compute + rank_once) + rank_optimizer
        # The once-a-run and once-a-step costs, which the replay leaves out.
        once, optimizer = max(once, rank_once), max(optimizer, rank_optimizer)
    if order:
        hop = links.transfer(estimate.ranks[0].trace.boundary_bytes, (0, layout.world_size // layout.pp))
        estimate.step_seconds = runs * (replay(order, forward, backward, hop) + once) + optimizer
    else:
        estimate.step_seconds = estimate.ranks[0].seconds
    tokens = estimate.run.tokens_per_step
    estimate.mfu = flops_per_token * tokens / (estimate.step_seconds * estimate.device.peak_flops * layout.world_size)
