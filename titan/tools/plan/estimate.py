"""`titan plan`: what a recipe's training step needs on each rank at its real world size, and how long it takes,
worked out on this CPU with no GPU and no other process.

Each pipeline rank's step is traced (titan/tools/plan/trace.py): one micro-batch through its stages, then the optimizer
step, under fake tensors on a fake process group. The ranks of one pipeline rank hold alike shards, so one stands
for all. Blocks are alike too, so a rank is traced with 3 blocks per stage (TRACED_DEPTH), one rank again with
3 + every (activation checkpointing's period) in its longest stage, and every figure grows from there at that rate
per block to the stages' real depths: parameters, activations, peaks, FLOPs, traffic. Then:

- the pipeline schedule's own table of actions (titan/tools/plan/pipeline.py) says how many micro-batches each rank
  holds at once, and replayed with each stage's times it gives the step time;
- an op takes the slower of its FLOPs at the device's peak and its bytes through HBM (a roofline),
  tensor-parallel collectives add to that, FSDP's overlap it (titan/tools/plan/devices.py);
- so the step time is a lower bound (no kernel gaps, ideal overlap) and the MFU an upper bound.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import os
from dataclasses import dataclass, field

from titan.config import Config, Layout
from titan.errors import ConfigError
from titan.models import ModelSpec
from titan.parallel.memory_plan import GIB, BlockChoices, Option, fastest_choices
from titan.parallel.parallelize import check_layout, model_blocks
from titan.run_plan import RunPlan, run_plan
from titan.tools.plan.devices import Device, Links, planned_device
from titan.tools.plan.graph import saved_by_block
from titan.tools.plan.pipeline import replay, schedule_actions, schedule_peak, sends
from titan.tools.plan.trace import CPU, Cost, RankTrace, fake_world, trace_rank, with_checkpointing
from titan.train.build import resolve_model

MODES = ("none", "full", "selective")
# Each way a block can run (the trainer's names) and the checkpointing mode whose one-block trace shows it; offload
# runs a block as keep does, its kept bytes going to the host.
TRACED_AS = {"keep": "none", "selective": "selective", "full": "full", "offload": "none"}
# Blocks per stage in a rank's trace. A stage's first and last blocks run unlike the others under FSDP (the last
# keeps its weights gathered after forward, backward prefetches the next block's), so the rate per block must come
# from blocks between them: with 2 blocks, a 283M model's FSDP2 peak grew 32% faster per block than from 3 on.
TRACED_DEPTH = 3
log = logging.getLogger("titan")


@dataclass
class RankEstimate:
    """One pipeline rank's step at its real depth (every rank of that pipeline rank alike)."""

    pp_rank: int
    stage_ids: list[int]
    layers: list[list[int]]  # per stage
    trace: RankTrace  # grown to the stages' real depths
    in_flight: int  # most micro-batches whose activations the rank holds at once
    activations: int  # bytes they hold then
    peak: int
    peak_by_mode: dict[str, int]  # the peak under each activation checkpointing mode
    flops: float  # per step, recomputation included
    traffic: dict[tuple[str, str], float]  # bytes per step, by (collective, mesh dimension)
    seconds: float = 0.0  # the rank's forwards, backwards and optimizer step, without waiting
    checkpointing: BlockChoices | None = None  # activation_checkpoint.mode = "auto": each of its blocks' way, in order
    # ... within this many bytes per micro-batch (activation_checkpoint.budget_gib, or with 0 what the device leaves)
    budget: int = 0


@dataclass
class StepEstimate:
    config: Config
    device: Device
    run: RunPlan  # what each rank computes
    layout: Layout
    rows: int  # sequences per micro-batch
    microbatches: int  # per rank and schedule run (the pipeline's, under a pipeline)
    runs: int  # schedule runs per step: gradient accumulation under a pipeline, else 1
    params: int = 0  # the whole model's
    block_activations: dict[str, int] = field(default_factory=dict)  # one block, one micro-batch, per mode
    block_options: list[Option] = field(default_factory=list)  # mode = "auto": what the planner chose from
    # compile.enable: bytes less that a compiled block keeping everything keeps than an eager one, per rank
    compiled_saving: int = 0
    ranks: list[RankEstimate] = field(default_factory=list)
    order: list | None = None  # under a pipeline, each pipeline rank's schedule actions
    step_seconds: float = 0.0
    mfu: float = 0.0

    @property
    def usable_bytes(self) -> float:
        return self.device.memory_gib * (1 - self.config.plan.headroom_fraction) * GIB


def plan_run(config: Config, world_size: int) -> StepEstimate:
    """Trace the recipe's step on every pipeline rank and put the figures together. With activation_checkpoint.mode
    = "auto" the step is traced with full recomputation, and each rank's blocks then take the ways the memory
    planner chooses from the traced bytes and roofline seconds of one block run each way."""
    auto, compiled = config.activation_checkpoint.mode == "auto", config.compile.enable
    config = _as_traced(config)
    spec, args = resolve_model(config)
    check_layout(config, spec, args, Layout.from_config(config.parallel, world_size), CPU)
    run = run_plan(config, world_size, model_blocks(spec, args))
    layout, layers = run.layout, [list(ids) for ids in run.stage_layers]
    rows, microbatches = run.largest_micro_batch
    estimate = StepEstimate(config, planned_device(config.plan), run, layout, rows, microbatches, run.schedule_runs)
    with fake_world(layout) as mesh:

        def trace(pp_rank: int, depth: int, traced: Config = config, forward_only=False, **options) -> RankTrace:
            runs = 0 if forward_only else min(microbatches, 2)  # the second one is the steady state
            return trace_rank(traced, spec, args, run, mesh, pp_rank, depth, rows, runs, estimate.device, **options)

        order = estimate.order = schedule_actions(config, run, mesh, microbatches) if layout.pp > 1 else None
        _trace_ranks(estimate, trace, layers, order)
        one_block = {}  # what one block holds under each mode, from one block's forward (and backward, for auto)
        for mode in MODES:
            if auto or mode != config.activation_checkpoint.mode:
                one_block[mode] = trace(0, 1, traced=with_checkpointing(config, mode), forward_only=not auto)
                estimate.block_activations[mode] = one_block[mode].block_held[0]
    if compiled:
        estimate.compiled_saving = _compiled_saving(config, spec, args, layout, rows)
        for rank in estimate.ranks:
            ways = _ways(estimate, rank, config.activation_checkpoint.mode)
            rank.peak, rank.activations, rank.in_flight = _peak_with(estimate, rank, order, ways)
    for rank in estimate.ranks:
        rank.peak_by_mode = {m: _peak_with(estimate, rank, order, _ways(estimate, rank, m))[0] for m in MODES}
    if auto:
        estimate.block_options, block_costs = _block_ways(estimate, one_block)
        for rank in estimate.ranks:
            _plan_checkpointing(estimate, rank, order, block_costs)
    _step_time(estimate, spec.flops_per_token(args, config.training.seq_len), order)
    return estimate


def _compiled_saving(config: Config, spec: ModelSpec, args, layout: Layout, rows: int) -> int:
    """What compiling a block that keeps everything saves of its activations on a rank: the partitioner keeps less
    than eager autograd (titan/tools/plan/graph.py's saved_by_block, one whole block on one device); tensor parallelism
    splits those activations over its ranks (by heads, or by sequence under sequence parallel). Recomputing
    blocks keep their input either way."""
    bf16, seq = config.training.mixed_precision == "bf16", config.training.seq_len
    eager, compiled = (saved_by_block(spec, args, rows, seq, bf16, compiled=c) for c in (False, True))
    return max(0, eager - compiled) // layout.tp


def _block_ways(estimate: StepEstimate, one_block: dict[str, RankTrace]) -> tuple[list[Option], dict[str, Cost]]:
    """The ways to run a block, as ac.measure_options gives them on the training device, here from traces of one
    block: the bytes it keeps and the roofline seconds its forward and backward add over keeping everything; and
    the cost (FLOPs, traffic) of its forward and backward each way. On an accelerator offload keeps nothing on the
    device and copies what keep keeps out and back over the host link."""
    links = Links(estimate.device, estimate.layout.world_size)
    costs = {mode: [*t.forward.values(), *t.backward.values()] for mode, t in one_block.items()}
    # A rank of an interleaved pipeline holds several stages, each traced with its one block: per block, divide.
    blocks = {mode: sum(t.blocks) for mode, t in one_block.items()}
    seconds = {
        mode: sum(links.seconds(c, one_block[mode].groups) for c in cs) / blocks[mode] for mode, cs in costs.items()
    }
    block_costs = {}
    for way, mode in TRACED_AS.items():
        block_costs[way] = Cost()
        for cost in costs[mode]:
            block_costs[way].add(cost, 1 / blocks[mode])
    keep_bytes = estimate.block_activations["none"]
    options = [
        Option(way, estimate.block_activations[mode], max(0.0, seconds[mode] - seconds["none"]))
        for way, mode in TRACED_AS.items()
        if way != "offload"
    ]
    return [*options, Option("offload", 0, 2 * keep_bytes / (estimate.device.host_gbs * 1e9))], block_costs


def _plan_checkpointing(estimate: StepEstimate, rank: RankEstimate, order, block_costs: dict[str, Cost]) -> None:
    """The rank's blocks planned within the budget, as the trainer plans them; its peak, FLOPs, traffic and time
    follow (`block_costs`: one block's forward and backward under each way)."""
    n_blocks = sum(map(len, rank.layers))
    rank.budget = int(estimate.config.activation_checkpoint.budget_gib * GIB)
    if not rank.budget:  # what the device leaves; if too little, the least the blocks keep (the peak says so)
        least = n_blocks * min(o.saved_bytes for o in estimate.block_options)
        rank.budget = max(activation_budget(estimate, rank, estimate.usable_bytes), least)
    rank.checkpointing = chosen = fastest_choices([estimate.block_options] * n_blocks, rank.budget)
    ways, first = [], 0
    for layers in rank.layers:  # the trainer gives each model part's blocks their choices in this order
        ways.append(list(chosen.choices[first : first + len(layers)]))
        first += len(layers)
    rank.peak, rank.activations, rank.in_flight = _peak_with(estimate, rank, order, ways)
    # The trace ran every block with full recomputation (see _as_traced): each block's way replaces that in
    # backward, where recomputation and copies happen.
    added = {o.name: o.added_seconds for o in estimate.block_options}
    per_step = estimate.microbatches * estimate.runs
    for stage, stage_ways in zip(rank.stage_ids, ways):
        change = Cost()  # what the chosen ways cost over recomputing every block in full
        for way in stage_ways:
            change.add(block_costs[way])
            change.add(block_costs["full"], -1)
        rank.trace.backward[stage].seconds += sum(added[w] - added["full"] for w in stage_ways)
        rank.trace.backward[stage].flops += change.flops
        rank.flops += change.flops * per_step
        for key, nbytes in change.traffic.items():  # a block that keeps its activations gathers nothing again
            rank.traffic[key] = rank.traffic.get(key, 0) + nbytes * per_step


def activation_budget(estimate: StepEstimate, rank: RankEstimate, usable_bytes: float) -> int:
    """What activation_checkpoint.budget_gib = 0 stands for: the bytes per micro-batch that the blocks of pipeline
    rank `rank` may keep within `usable_bytes` of device memory. With every block recomputed in full (the least
    it can keep), its peak less what its blocks then keep is what its step needs besides them (the embedding's
    and the head's activations, and backward's recomputation, included); what the device leaves is shared by
    the micro-batches it holds at once."""
    full = [["full"] * len(layers) for layers in rank.layers]
    peak, _, in_flight = _peak_with(estimate, rank, estimate.order, full)
    kept = in_flight * sum(map(len, full)) * estimate.block_activations["full"]
    return max(0, int(usable_bytes - (peak - kept)) // in_flight)


def with_activation_budget(config: Config, world_size: int, device_bytes: int) -> Config:
    """The recipe for a run on devices of `device_bytes` each, its activation_checkpoint.budget_gib = 0 replaced
    by what such a device leaves (activation_budget, less plan.headroom_fraction): `titan train` calls this, so
    that the trainer plans its blocks within the budget that `titan plan` shows for that device."""
    estimate = plan_run(config, world_size)
    usable = device_bytes * (1 - config.plan.headroom_fraction)
    pp_rank = estimate.run.rank(int(os.environ.get("RANK", "0"))).pp_rank
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
    """The recipe as the planner runs it: eagerly (plan_run then takes off what compiled blocks keep less), on
    causal rows, with the CPU's flash attention kept by selective checkpointing wherever the GPU's would be, and
    auto checkpointing as full (plan_run then plans the blocks): a recomputing step's trace holds what
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


def _trace_ranks(estimate: StepEstimate, trace, layers: list[list[int]], order) -> None:
    """Each pipeline rank's step at its real depth. The rate per block comes from the rank with the longest stage,
    traced with TRACED_DEPTH blocks per stage and again with `every` more in that stage; every rank's trace with
    TRACED_DEPTH per stage grows from there. Ranks whose stages have the same ends (embedding, head) share a
    trace."""
    config, layout = estimate.config, estimate.layout
    every = config.activation_checkpoint.every if config.activation_checkpoint.mode != "none" else 1
    ids = [list(estimate.run.stages(r)) for r in range(layout.pp)]
    longest = max(range(layout.pp), key=lambda r: max(len(layers[s]) for s in ids[r]))
    rate = (trace(longest, TRACED_DEPTH), trace(longest, TRACED_DEPTH, deeper=every))
    grows = rate[1].param_bytes > rate[0].param_bytes  # not when no stage is deeper: all are traced whole
    ends = [tuple((s == 0, s == len(layers) - 1) for s in stages) for stages in ids]
    traces = {ends[longest]: rate[0]}
    for pp_rank, stages in enumerate(ids):
        if ends[pp_rank] not in traces:
            traces[ends[pp_rank]] = trace(pp_rank, TRACED_DEPTH, optimizer=not grows)
            if grows:
                _optimizer_from_rate(traces[ends[pp_rank]], *rate)
        grown = _grow(traces[ends[pp_rank]], *rate, [len(layers[s]) for s in stages], stages)
        estimate.ranks.append(_rank_estimate(estimate, pp_rank, [layers[s] for s in stages], grown, order))
    estimate.params = sum(rank.trace.total_params for rank in estimate.ranks)
    # One block's activations under the recipe's checkpointing: the first of each period runs its way.
    estimate.block_activations[config.activation_checkpoint.mode] = rate[1].block_held[0]


def _optimizer_from_rate(trace: RankTrace, shallow: RankTrace, deep: RankTrace) -> None:
    """The optimizer step of a rank traced without it, from the rate ranks': clipping and AdamW work elementwise,
    so their memory, time and traffic grow with the parameter bytes they update, at the rate between the two."""
    times = (trace.param_bytes - shallow.param_bytes) / (deep.param_bytes - shallow.param_bytes)
    trace.optimizer_peak = round(shallow.optimizer_peak + times * (deep.optimizer_peak - shallow.optimizer_peak))
    trace.optimizer = Cost()
    trace.optimizer.add(shallow.optimizer, 1 - times)
    trace.optimizer.add(deep.optimizer, times)


def _grow(start: RankTrace, shallow: RankTrace, deep: RankTrace, counts: list[int], ids: list[int]) -> RankTrace:
    """`start`, a trace of the stages `ids` or of another rank's stages with the same ends, grown to `counts` blocks
    per stage at the rate per block from `shallow` to `deep`: each block adds the same parameters, activations,
    peak, FLOPs and traffic."""
    grown = copy.deepcopy(start)
    for name in ("held", "forward", "backward"):  # under this rank's stage ids
        setattr(grown, name, {new: getattr(grown, name)[old] for old, new in zip(start.stage_ids, ids)})
    grown.stage_ids, grown.blocks = ids, counts
    gained = sum(deep.blocks) - sum(shallow.blocks)
    if gained == 0:  # no stage is deeper than `shallow`: all were traced whole
        return grown
    more = sum(counts) - sum(start.blocks)
    sizes = ("params", "total_params", "param_bytes", "grad_bytes", "optimizer_bytes")
    for name in (*sizes, "first_peak", "peak", "optimizer_peak"):
        setattr(grown, name, getattr(grown, name) + more * (getattr(deep, name) - getattr(shallow, name)) // gained)
    for name in ("once", "optimizer"):
        getattr(grown, name).add(getattr(deep, name), more / gained)
        getattr(grown, name).add(getattr(shallow, name), -more / gained)
    for i, stage in enumerate(ids):
        times = (counts[i] - start.blocks[i]) / gained
        grown.held[stage] += round(times * (sum(deep.held.values()) - sum(shallow.held.values())))
        for phase in ("forward", "backward"):
            for traced in deep.stage_ids:
                getattr(grown, phase)[stage].add(getattr(deep, phase)[traced], times)
                getattr(grown, phase)[stage].add(getattr(shallow, phase)[traced], -times)
    return grown


def _rank_estimate(
    estimate: StepEstimate, pp_rank: int, layers: list[list[int]], trace: RankTrace, order
) -> RankEstimate:
    """The rank's step: the trace held one micro-batch in each stage; a pipeline holds more."""
    peak, activations, in_flight = _peak(trace, trace.held, order[pp_rank] if order else None)
    step = Cost()
    for stage in trace.stage_ids:
        step.add(trace.forward[stage], estimate.microbatches * estimate.runs)
        step.add(trace.backward[stage], estimate.microbatches * estimate.runs)
    step.add(trace.once, estimate.runs)  # each schedule run reduces FSDP's gradients once
    step.add(trace.optimizer)
    if order:
        step.traffic[("send", "pp")] += trace.boundary_bytes * sends(order, pp_rank) * estimate.runs
    return RankEstimate(
        pp_rank, trace.stage_ids, layers, trace, in_flight, activations, peak, {}, step.flops, dict(step.traffic)
    )


def _peak(trace: RankTrace, held: dict[int, int], actions: list | None, recomputed: int = 0) -> tuple[int, int, int]:
    """(peak bytes, activation bytes then held, micro-batches then held) of the rank's step when its stages' forwards
    hold `held` each and backward brings back `recomputed` bytes more than the trace's, over the pipeline's
    `actions` or the micro-batches one after another."""
    change = sum(held.values()) - sum(trace.held.values()) + recomputed
    if actions is None:
        peak, activations, in_flight = trace.peak + change, sum(held.values()), 1
    else:
        peak, activations, in_flight = schedule_peak(actions, held, trace.first_peak + change, trace.peak + change)
    return max(peak, trace.optimizer_peak), activations, in_flight


def _ways(estimate: StepEstimate, rank: RankEstimate, mode: str) -> list[list[str]]:
    """Per stage of the rank, how each block runs under `mode` with the recipe's period (every Nth block)."""
    ac = estimate.config.activation_checkpoint
    way = {m: w for w, m in TRACED_AS.items() if w != "offload"}[mode]
    return [[way if i % ac.every == 0 else "keep" for i in range(len(layers))] for layers in rank.layers]


def _recomputed(keep: int, kept: list[list[int]]) -> int:
    """The most bytes backward holds beyond what the blocks keep (`kept`, per stage and block): a block that
    recomputes or reloads its activations holds them again as keep does, while it runs its backward, and the
    blocks after it have freed what they kept."""
    extra = 0
    for stage in kept:
        freed = 0
        for block in reversed(stage):
            extra = max(extra, keep - block - freed)
            freed += block
    return extra


def _peak_with(estimate: StepEstimate, rank: RankEstimate, order, ways: list[list[str]]) -> tuple[int, int, int]:
    """The rank's (peak, activations then held, micro-batches then held) if its blocks ran `ways` (per stage and
    block: keep, selective, full or offload) instead of the recipe's."""
    a = estimate.block_activations
    traced_by_way = {way: 0 if way == "offload" else a[mode] for way, mode in TRACED_AS.items()}
    kept_by_way = {**traced_by_way, "keep": traced_by_way["keep"] - estimate.compiled_saving}  # traced eagerly
    kept = [[kept_by_way[w] for w in stage] for stage in ways]
    traced = [
        [traced_by_way[w] for w in stage] for stage in _ways(estimate, rank, estimate.config.activation_checkpoint.mode)
    ]
    held = {s: rank.trace.held[s] + sum(k) - sum(t) for s, k, t in zip(rank.stage_ids, kept, traced)}
    recomputed = _recomputed(a["none"], kept) - _recomputed(a["none"], traced)
    return _peak(rank.trace, held, order[rank.pp_rank] if order else None, recomputed)


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
