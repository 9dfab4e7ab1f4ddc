"""`titan plan`'s output: a table per pipeline rank, the figures as JSON, and the one line that says a rank does
not fit."""

from __future__ import annotations

from titan.parallel.ac_choices import GIB
from titan.train.estimate.experts import all_to_all_seconds
from titan.train.estimate.figures import RankEstimate, StepEstimate
from titan.train.estimate.graph import PLACEMENTS, GraphAnalysis
from titan.train.recovery.interval import snapshot_every


def shortfall(estimate: StepEstimate) -> str | None:
    """One line naming the first pipeline rank whose peak does not fit, or None when all fit."""
    for rank in estimate.ranks:
        if rank.peak > estimate.usable_bytes:
            return (
                f"{_rank_name(estimate, rank)} needs {rank.peak / GIB:.1f} GiB at its peak, {estimate.device.name} has "
                f"{estimate.usable_bytes / GIB:.1f} GiB usable ({estimate.device.memory_gib:g} GiB less "
                f"plan.headroom_fraction {estimate.config.plan.headroom_fraction:g}): "
                f"{(rank.peak - estimate.usable_bytes) / GIB:.1f} GiB short"
            )
    return None


def _rank_name(estimate: StepEstimate, rank: RankEstimate) -> str:
    if estimate.layout.pp == 1:
        return "every rank"
    stages = ", ".join(map(str, rank.stage_ids))
    return f"pipeline rank {rank.pp_rank} (stage{'s' * (len(rank.stage_ids) > 1)} {stages})"


def format_estimate(estimate: StepEstimate) -> str:
    """The estimate as text: what is planned, a table per pipeline rank, then the step time."""
    c, layout, device = estimate.config, estimate.layout, estimate.device
    degrees = " x ".join(f"{k} {v}" for k, v in vars(layout).items() if v > 1) or "one device"
    global_batch = estimate.run.global_rows
    schedule = f", {c.parallel.pp_schedule}" if layout.pp > 1 else ""
    lines = [
        f"{c.model.name} {c.model.flavor}, {_params(estimate.params)} parameters, on {layout.world_size} x "
        f"{device.name} ({degrees})",
        f"global batch {global_batch} x {c.training.seq_len} tokens: {_micro_batches(estimate.microbatches)} of "
        f"{estimate.rows} per rank{_share(estimate)}{schedule}{_runs(estimate.runs)}; "
        f"{_size(estimate.usable_bytes)} of {device.memory_gib:g} GiB usable "
        f"(plan.headroom_fraction {c.plan.headroom_fraction:g})",
        *_block_activations(estimate),
    ]
    if estimate.compiled_saving:
        keep = estimate.block_activations["none"]
        lines.append(
            f"compiled (compile.enable), a block that keeps everything keeps {_size(keep - estimate.compiled_saving)}: "
            "torch.compile's partitioner recomputes cheap ops in backward rather than keep their results"
        )
    if estimate.block_options:
        lines.append(
            f"activation_checkpoint auto, within {_budget(c)} per rank and micro-batch, "
            "chose from (bytes kept, seconds added per block and micro-batch): " + _block_options(estimate)
        )
    for rank in estimate.ranks:
        lines += ["", _rank_name(estimate, rank) + (f": layers {_spans(rank.layers)}" if layout.pp > 1 else "")]
        lines += [f"  {label:<24}{value}" for label, value in _rows(estimate, rank)]
    lines += [
        "",
        f"step {estimate.step_seconds:.3g} s (a lower bound), "
        f"{global_batch * c.training.seq_len / estimate.step_seconds:,.0f} tokens/s, "
        f"MFU {estimate.mfu:.1%} {MODELLED}, each op at the",
        f"slower of {device.peak_flops / 1e12:g} TFLOP/s and {device.hbm_gbs:g} GB/s of HBM, links at "
        f"{device.intra_node_gbs:g} GB/s within a node of {device.gpus_per_node} and {device.inter_node_gbs:g} GB/s "
        "between nodes",
    ]
    return "\n".join(lines)


def _block_activations(estimate: StepEstimate) -> list[str]:
    """What one block keeps per mode: one line per kind of block, when the model has several (a mixture of
    experts' dense and routed blocks)."""
    kinds = estimate.kind_activations
    if len(kinds) == 1:
        return [f"activations one block keeps for backward, per micro-batch: {_by_mode(estimate, *kinds.values())}"]
    modes = estimate.block_activations  # every kind's in the first one's order
    return [
        f"activations one {kind} block keeps for backward, per micro-batch: "
        + _by_mode(estimate, {mode: activations[mode] for mode in modes})
        for kind, activations in kinds.items()
    ]


def _block_options(estimate: StepEstimate) -> str:
    """Auto checkpointing's ways to run a block, per kind of block when the model has several."""

    def ways(options) -> str:
        return ", ".join(f"{o.name} {_size(o.saved_bytes)} +{o.added_seconds:.3g} s" for o in options)

    if len(estimate.kind_options) == 1:
        return ways(estimate.block_options)
    return "; ".join(f"{kind} blocks {ways(options)}" for kind, options in estimate.kind_options.items())


def _share(estimate: StepEstimate) -> str:
    """Under context parallelism, what a rank computes of each row."""
    cp = estimate.layout.cp
    return f" ({estimate.config.training.seq_len // cp:,} tokens of each, its 2 of 2·cp chunks)" if cp > 1 else ""


# What the plan's step time and MFU are: the step as modelled (no kernel gaps, ideal overlap), not measured.
MODELLED = "(an upper bound): modelled, not measured"


def format_comparison(dimension: str, plans: dict[int, StepEstimate | str], world_size: int) -> str:
    """`titan plan --cp` or `--ep`: a line per degree of `dimension` (its plan, or why the recipe cannot take it),
    and the fastest that fits."""
    heading, columns = COMPARED[dimension]
    lines = [f"{dimension:>4}{heading}{'peak per rank':>15}  {'fits':<16}{'step':>9}{'tokens/s':>12}{'MFU':>7}"]
    fitting = {}
    for degree, plan in plans.items():
        if isinstance(plan, str):
            lines.append(f"{degree:>4}  cannot: {plan}")
            continue
        peak = max(rank.peak for rank in plan.ranks)
        fits = shortfall(plan) is None
        if fits:
            fitting[degree] = plan.step_seconds
        tokens = plan.run.tokens_per_step
        lines.append(
            f"{degree:>4}{columns(plan)}{_size(peak):>15}  "
            f"{'fits' if fits else _size(peak - plan.usable_bytes) + ' short':<16}"
            f"{plan.step_seconds:>8.3g}s{tokens / plan.step_seconds:>12,.0f}{plan.mfu:>7.1%}"
        )
    planned = [plan for plan in plans.values() if not isinstance(plan, str)]
    if planned:
        lines.append(f"step (a lower bound), tokens/s and MFU {MODELLED}")
    where = f"{world_size} x {planned[0].device.name}" if planned else f"{world_size} devices"
    if fitting:
        best = min(fitting, key=fitting.get)
        lines.append(f"fastest that fits on {where}: {dimension} {best} ({fitting[best]:.3g} s a step)")
    else:
        lines.append(f"no degree fits on {where}")
    return "\n".join(lines)


def _cp_columns(plan: StepEstimate) -> str:
    """What a context-parallel degree changes: the data-parallel ranks left, each rank's share of its rows."""
    share = plan.config.training.seq_len // plan.layout.cp
    micro_batches = f"{plan.microbatches * plan.runs} of {plan.rows} x {share:,} tokens"
    return f"{plan.layout.dp_shard:>10}  {micro_batches:<24}"


def _ep_columns(plan: StepEstimate) -> str:
    """What an expert-parallel degree changes: the ranks sharing one rank's experts by FSDP (whose all-gathers
    shrink as ep grows), and the all-to-all bytes of the most loaded rank."""
    layout, rank = plan.layout, max(plan.ranks, key=lambda r: r.traffic.get(("all-to-all", "ep"), 0))
    efsdp = layout.dp_shard * layout.cp // layout.ep
    return f"{efsdp:>7}  {_size(rank.traffic.get(('all-to-all', 'ep'), 0)):>20}"


# Per compared dimension: its columns' heading, and each degree's.
COMPARED = {
    "cp": (f"{'dp_shard':>10}  {'micro-batches per rank':<24}", _cp_columns),
    "ep": (f"{'efsdp':>7}  {'all-to-all per step':>20}", _ep_columns),
}


def _rows(estimate: StepEstimate, rank: RankEstimate) -> list[tuple[str, str]]:
    """The rank's table: what it holds, its peak, and what its step does."""
    t = rank.trace
    fits = "fits" if rank.peak <= estimate.usable_bytes else f"{_size(rank.peak - estimate.usable_bytes)} short"
    return [
        (
            "parameters",
            f"{_params(t.params)} in this rank's shards: {_size(t.param_bytes)}, gradients {_size(t.grad_bytes)}, "
            f"{_optimizer_state(estimate)} {_size(t.optimizer_bytes)}",
        ),
        *([("routed experts", _expert_sharding(estimate, t.expert_params))] if t.expert_params else []),
        ("activations at the peak", f"{_size(rank.activations)}, {_micro_batches(rank.in_flight)} in flight"),
        *([("routed tokens", _routed(estimate))] if estimate.routed_activations else []),
        ("largest temporary", f"{_size(t.largest[0])} ({t.largest[1]})"),
        ("peak", f"{_size(rank.peak)}: {fits}"),
        *([("checkpointing (auto)", _checkpointing(estimate, rank))] if rank.checkpointing else []),
        ("peak by checkpointing", _by_mode(estimate, rank.peak_by_mode)),
        ("FLOPs per step", f"{rank.flops:.3g}, recomputation included"),
        ("traffic per step", _traffic(rank.traffic)),
        *([("all-to-all (ep)", _all_to_all(estimate, rank))] if estimate.layout.ep > 1 else []),
        ("busy per step", f"{rank.seconds:.3g} s"),
        ("in-memory snapshot", _snapshot(estimate, t.param_bytes + t.optimizer_bytes, rank.seconds)),
    ]


def _optimizer_state(estimate: StepEstimate) -> str:
    if estimate.config.optimizer.name == "muon":
        return "Muon's momentum and AdamW's moments"  # one tensor per Muon parameter, two per AdamW one
    return "AdamW moments"


def _snapshot(estimate: StepEstimate, state: int, step_s: float) -> str:
    """A snapshot's cost for a rank holding `state` bytes of parameters and optimizer moments: host memory for
    its own copy and the one it keeps of a buddy's, and the time to copy it to the host and send it to the buddy;
    under "auto", the interval that time and the step's `step_s` call for."""
    device, fault = estimate.device, estimate.config.fault
    seconds = state / (device.host_gbs * 1e9) + state / (device.inter_node_gbs * 1e9)
    every = fault.snapshot_interval
    when = f"fault.snapshot_interval {every}" if every else "off: fault.snapshot_interval 0"
    if every == "auto":
        n = snapshot_every(seconds, step_s, fault.snapshot_overhead)
        when = (
            f"fault.snapshot_interval auto: every {n} step{'s' * (n > 1)} under torchrun --max-restarts, "
            f"{100 * seconds / (n * step_s):.2g}% of a {step_s:.3g} s step"
        )
    return (
        f"{_size(2 * state)} of host memory (its state and a buddy's copy), {seconds:.3g} s each at "
        f"{device.host_gbs:g} GB/s to the host and {device.inter_node_gbs:g} GB/s to the buddy ({when})"
    )


def _expert_sharding(estimate: StepEstimate, params: int) -> str:
    """How a mixture of experts' routed experts are sharded, against the other parameters."""
    layout = estimate.layout
    fsdp = layout.dp_shard * layout.cp
    if layout.ep == 1:
        return f"{_params(params)} of those, sharded over fsdp {fsdp} as the rest"
    efsdp = fsdp // layout.ep
    return (
        f"{_params(params)} of those: 1/{layout.ep} of the experts (ep {layout.ep}), FSDP-sharded over the {efsdp} "
        f"rank{'s' * (efsdp > 1)} holding the same (efsdp); the rest over fsdp {fsdp}"
    )


def _routed(estimate: StepEstimate) -> str:
    """The routed tokens' activations per MoE layer, and at which load."""
    imbalance = estimate.config.plan.moe_load_imbalance
    load = (
        f"the most loaded ep rank's, at {imbalance:g} x the mean load (plan.moe_load_imbalance)"
        if estimate.layout.ep > 1
        else "each rank's own tokens (no expert parallelism: no imbalance)"
    )
    return f"{_size(estimate.routed_activations)} per MoE layer and micro-batch kept without checkpointing: {load}"


def _all_to_all(estimate: StepEstimate, rank: RankEstimate) -> str:
    """Expert parallelism's all-to-all per step: counted on the fake process group, by the formula, its time."""
    counted = rank.traffic.get(("all-to-all", "ep"), 0)
    return (
        f"{_size(counted)} counted, {_size(rank.all_to_all_formula)} by the formula (docs/planning.md), "
        f"{all_to_all_seconds(estimate, rank):.3g} s a step"
    )


def _budget(config) -> str:
    if config.activation_checkpoint.budget_gib:
        return f"{config.activation_checkpoint.budget_gib:g} GiB"
    return "what the device leaves (budget_gib 0)"


def _checkpointing(estimate: StepEstimate, rank: RankEstimate) -> str:
    """Auto checkpointing of the rank's blocks: how many take each way, what they keep, the time it adds per step."""
    choices, names = rank.checkpointing.choices, [o.name for o in estimate.block_options]
    counts = ", ".join(f"{choices.count(name)} {name}" for name in names if name in choices)
    return (
        f"{counts}: {_size(rank.checkpointing.saved_bytes)} of {_size(rank.budget)} kept per micro-batch, "
        f"+{rank.checkpointing.added_seconds * estimate.microbatches * estimate.runs:.3g} s per step"
    )


def _by_mode(estimate: StepEstimate, values: dict[str, int]) -> str:
    """Figures per activation checkpointing mode, the recipe's marked (auto: none is)."""
    mode = estimate.config.activation_checkpoint.mode if not estimate.block_options else None
    return " | ".join(f"{m} {_size(b)}{' (recipe)' * (m == mode)}" for m, b in values.items())


def estimate_json(estimate: StepEstimate) -> dict:
    """The estimate's figures for programs (`titan plan --json`): bytes, FLOPs and seconds."""
    return {
        "params": estimate.params,
        "world_size": estimate.layout.world_size,
        "device": estimate.device.name,
        "usable_bytes": int(estimate.usable_bytes),
        "step_seconds": estimate.step_seconds,
        "mfu": estimate.mfu,
        "block_activation_bytes": estimate.block_activations,
        "block_options": [vars(o) for o in estimate.block_options],
        # The same per kind of block (the first layer's kind first), and each layer's kind
        "block_activation_bytes_by_kind": estimate.kind_activations,
        "block_options_by_kind": {kind: [vars(o) for o in options] for kind, options in estimate.kind_options.items()},
        "block_kinds": estimate.kinds,
        "routed_activation_bytes": estimate.routed_activations,
        "moe_load_imbalance": estimate.config.plan.moe_load_imbalance,
        "ranks": [
            {
                "pp_rank": r.pp_rank,
                "stages": r.stage_ids,
                "layers": r.layers,
                "params": r.trace.params,
                "expert_params": r.trace.expert_params,
                "param_bytes": r.trace.param_bytes,
                "grad_bytes": r.trace.grad_bytes,
                "optimizer_bytes": r.trace.optimizer_bytes,
                "activation_bytes": r.activations,
                "micro_batches_in_flight": r.in_flight,
                "peak_bytes": r.peak,
                "peak_bytes_by_checkpointing": r.peak_by_mode,
                "checkpointing": vars(r.checkpointing) if r.checkpointing else None,
                "activation_budget_bytes": r.budget if r.checkpointing else None,
                "flops": r.flops,
                "traffic_bytes": {f"{role} {kind}": nbytes for (kind, role), nbytes in r.traffic.items()},
                "all_to_all_formula_bytes": r.all_to_all_formula,
                "busy_seconds": r.seconds,
            }
            for r in estimate.ranks
        ],
    }


def _micro_batches(n: int) -> str:
    return f"{n} micro-batch{'es' * (n != 1)}"


def _runs(runs: int) -> str:
    return f", run {runs} times a step (gradient accumulation)" if runs > 1 else ""


def _size(nbytes: float) -> str:
    return f"{nbytes / GIB:.3g} GiB" if nbytes >= GIB else f"{nbytes / 2**20:.3g} MiB"


def _params(n: int) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.3g}M"


def _traffic(traffic: dict[tuple[str, str], float]) -> str:
    moved = [f"{role} {kind} {_size(nbytes)}" for (kind, role), nbytes in sorted(traffic.items()) if nbytes >= 2**20]
    return ", ".join(moved) or "none"


def _spans(layers: list[list[int]]) -> str:
    return ", ".join(f"{ids[0]}-{ids[-1]}" if len(ids) > 1 else str(ids[0]) for ids in layers if ids)


def format_graph(analysis: GraphAnalysis, what: str) -> str:
    """`titan plan --graph`: the peak and the static layouts of the traced order and of the best reordering."""
    lines = [
        what,
        f"{analysis.ops} ops; the inputs (parameters, the block's input, its output's gradient) take "
        f"{_size(analysis.input_bytes)} throughout and are not counted below",
        "",
        f"{'order':<34}{'peak':>10}" + "".join(f"{p:>22}" for p in PLACEMENTS),
    ]
    for figures in (analysis.traced, analysis.memory_aware):
        name = "traced" if figures is analysis.traced else f"reordered: {figures.name}"
        arenas = [f"{_size(a)} (+{a / figures.peak - 1:.1%})" for a in figures.arenas.values()]
        lines.append(f"{name:<34}{_size(figures.peak):>10}" + "".join(f"{a:>22}" for a in arenas))
    gain = 1 - analysis.memory_aware.peak / analysis.traced.peak
    verdict = f"lowers the peak by {gain:.1%}" if gain > 0 else f"raises the peak by {-gain:.1%}: keep the traced order"
    lines += [
        "",
        f"the best reordering {verdict}.",
        "Static layouts: one address per storage, first fit, storages placed in each column's order; their excess",
        "over the peak (the least memory any allocator needs) is fragmentation. With compile.enable, Inductor",
        "reorders its fused kernels for peak memory itself (compile.reorder_for_peak_memory).",
    ]
    return "\n".join(lines)
