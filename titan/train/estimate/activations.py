"""What each pipeline rank's activations take: its peak under each way of running its blocks (keep, selective,
full, offload), what compiled blocks keep less, the activation budget a device leaves, and, with
activation_checkpoint.mode = "auto", the blocks' ways planned within it."""

from __future__ import annotations

from titan.config import Config, Layout
from titan.parallel.ac_choices import GIB, Option, fastest_choices
from titan.train.estimate.devices import Links
from titan.train.estimate.figures import RankEstimate, StepEstimate
from titan.train.estimate.graph import saved_by_block
from titan.train.estimate.pipeline import schedule_peak
from titan.train.estimate.trace import Cost, RankTrace
from titan.train.model import ResolvedModel

MODES = ("none", "full", "selective")


# Each way a block can run (the trainer's names) and the checkpointing mode whose one-block trace shows it; offload
# runs a block as keep does, its kept bytes going to the host.
TRACED_AS = {"keep": "none", "selective": "selective", "full": "full", "offload": "none"}


def compiled_saving(config: Config, model: ResolvedModel, layout: Layout, rows: int) -> int:
    """What compiling a block that keeps everything saves of its activations on a rank: the partitioner keeps less
    than eager autograd (graph.py's saved_by_block, one whole block on one device); tensor parallelism
    splits those activations over its ranks (by heads, or by sequence under sequence parallel). Recomputing
    blocks keep their input either way."""
    bf16, seq = config.training.mixed_precision == "bf16", config.training.seq_len
    eager, compiled = (saved_by_block(model, rows, seq, bf16, compiled=c) for c in (False, True))
    return max(0, eager - compiled) // layout.tp


def block_ways(
    estimate: StepEstimate, one_block: dict[str, dict[str, RankTrace]]
) -> tuple[dict[str, list[Option]], dict[str, dict[str, Cost]]]:
    """Per kind of block, the ways to run one, as ac.measure_options gives them on the training device, here from
    traces of one block of that kind: the bytes it keeps and the roofline seconds its forward and backward add over
    keeping everything; and the cost (FLOPs, traffic) of its forward and backward each way. On an accelerator
    offload keeps nothing on the device and copies what keep keeps out and back over the host link."""
    options, block_costs = {}, {}
    for kind, traces in one_block.items():
        options[kind], block_costs[kind] = _kind_ways(estimate, estimate.kind_activations[kind], traces)
    return options, block_costs


def _kind_ways(
    estimate: StepEstimate, activations: dict[str, int], one_block: dict[str, RankTrace]
) -> tuple[list[Option], dict[str, Cost]]:
    """block_ways of one kind of block, from its `activations` per mode and its traces."""
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
    options = [
        Option(way, activations[mode], max(0.0, seconds[mode] - seconds["none"]))
        for way, mode in TRACED_AS.items()
        if way != "offload"
    ]
    return [*options, Option("offload", 0, 2 * activations["none"] / (estimate.device.host_gbs * 1e9))], block_costs


def choose_checkpointing(
    estimate: StepEstimate, rank: RankEstimate, order, block_costs: dict[str, dict[str, Cost]]
) -> None:
    """The rank's blocks planned within the budget, as the trainer plans them (each from its kind's ways); its peak,
    FLOPs, traffic and time follow (`block_costs`: one block's forward and backward under each way, per kind)."""
    kinds = [[estimate.kinds[layer] for layer in layers] for layers in rank.layers]
    blocks = [estimate.kind_options[kind] for stage in kinds for kind in stage]
    rank.budget = int(estimate.config.activation_checkpoint.budget_gib * GIB)
    if not rank.budget:  # what the device leaves; if too little, the least the blocks keep (the peak says so)
        least = sum(min(o.saved_bytes for o in options) for options in blocks)
        rank.budget = max(activation_budget(estimate, rank, estimate.usable_bytes), least)
    rank.checkpointing = chosen = fastest_choices(blocks, rank.budget)
    ways, first = [], 0
    for layers in rank.layers:  # the trainer gives each model part's blocks their choices in this order
        ways.append(list(chosen.choices[first : first + len(layers)]))
        first += len(layers)
    rank.peak, rank.activations, rank.in_flight = peak_with(estimate, rank, order, ways)
    # The trace ran every block with full recomputation (see estimate.py's _as_traced): each block's way replaces
    # that in backward, where recomputation and copies happen.
    added = {kind: {o.name: o.added_seconds for o in options} for kind, options in estimate.kind_options.items()}
    per_step = estimate.microbatches * estimate.runs
    for stage, stage_ways, stage_kinds in zip(rank.stage_ids, ways, kinds):
        change = Cost()  # what the chosen ways cost over recomputing every block in full
        for way, kind in zip(stage_ways, stage_kinds):
            change.add(block_costs[kind][way])
            change.add(block_costs[kind]["full"], -1)
        pairs = zip(stage_ways, stage_kinds)
        rank.trace.backward[stage].seconds += sum(added[k][w] - added[k]["full"] for w, k in pairs)
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
    peak, _, in_flight = peak_with(estimate, rank, estimate.order, full)
    kept = in_flight * sum(map(sum, _by_block(estimate, rank, full, _traced)))
    return max(0, int(usable_bytes - (peak - kept)) // in_flight)


def rank_peak(
    trace: RankTrace, held: dict[int, int], actions: list | None, recomputed: int = 0
) -> tuple[int, int, int]:
    """(peak bytes, activation bytes then held, micro-batches then held) of the rank's step when its stages' forwards
    hold `held` each and backward brings back `recomputed` bytes more than the trace's, over the pipeline's
    `actions` or the micro-batches one after another."""
    change = sum(held.values()) - sum(trace.held.values()) + recomputed
    if actions is None:
        peak, activations, in_flight = trace.peak + change, sum(held.values()), 1
    else:
        peak, activations, in_flight = schedule_peak(actions, held, trace.first_peak + change, trace.peak + change)
    return max(peak, trace.optimizer_peak), activations, in_flight


def mode_ways(estimate: StepEstimate, rank: RankEstimate, mode: str) -> list[list[str]]:
    """Per stage of the rank, how each block runs under `mode` with the recipe's period (every Nth block)."""
    ac = estimate.config.activation_checkpoint
    way = {m: w for w, m in TRACED_AS.items() if w != "offload"}[mode]
    return [[way if i % ac.every == 0 else "keep" for i in range(len(layers))] for layers in rank.layers]


def _recomputed(keep: list[list[int]], kept: list[list[int]]) -> int:
    """The most bytes backward holds beyond what the blocks keep (`kept`, per stage and block): a block that
    recomputes or reloads its activations holds them again as keep does (`keep`, per stage and block), while it
    runs its backward, and the blocks after it have freed what they kept."""
    extra = 0
    for stage_keep, stage in zip(keep, kept):
        freed = 0
        for whole, block in zip(reversed(stage_keep), reversed(stage)):
            extra = max(extra, whole - block - freed)
            freed += block
    return extra


def _by_block(estimate: StepEstimate, rank: RankEstimate, ways: list[list[str]], bytes_of) -> list[list[int]]:
    """Per stage and block of the rank, `bytes_of(activations, way)` for its block run `ways` (per stage and
    block), `activations` being one block's of its kind, per mode."""
    return [
        [bytes_of(estimate.kind_activations[estimate.kinds[layer]], way) for layer, way in zip(layers, stage)]
        for layers, stage in zip(rank.layers, ways)
    ]


def _traced(activations: dict[str, int], way: str) -> int:
    """What a block keeps run `way`, as traced (eagerly)."""
    return 0 if way == "offload" else activations[TRACED_AS[way]]


def peak_with(estimate: StepEstimate, rank: RankEstimate, order, ways: list[list[str]]) -> tuple[int, int, int]:
    """The rank's (peak, activations then held, micro-batches then held) if its blocks ran `ways` (per stage and
    block: keep, selective, full or offload) instead of the recipe's."""

    def kept_by(activations: dict[str, int], way: str) -> int:  # compiled blocks that keep everything keep less
        return _traced(activations, way) - estimate.compiled_saving * (way == "keep")

    kept = _by_block(estimate, rank, ways, kept_by)
    traced = _by_block(estimate, rank, mode_ways(estimate, rank, estimate.config.activation_checkpoint.mode), _traced)
    held = {s: rank.trace.held[s] + sum(k) - sum(t) for s, k, t in zip(rank.stage_ids, kept, traced)}
    keep = _by_block(estimate, rank, ways, lambda activations, _: activations["none"])
    recomputed = _recomputed(keep, kept) - _recomputed(keep, traced)
    return rank_peak(rank.trace, held, order[rank.pp_rank] if order else None, recomputed)
