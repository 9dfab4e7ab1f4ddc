"""Each pipeline rank's step at its real depth: traced with TRACED_DEPTH blocks per stage, then grown at the rate
per block that a deeper trace of the longest stage shows."""

from __future__ import annotations

import copy

from titan.train.estimate.activations import rank_peak
from titan.train.estimate.figures import RankEstimate, StepEstimate
from titan.train.estimate.pipeline import sends
from titan.train.estimate.trace import Cost, RankTrace

# Blocks per stage in a rank's trace. A stage's first and last blocks run unlike the others under FSDP (the last
# keeps its weights gathered after forward, backward prefetches the next block's), so the rate per block must come
# from blocks between them: with 2 blocks, a 283M model's FSDP2 peak grew 32% faster per block than from 3 on.
TRACED_DEPTH = 3


def trace_ranks(estimate: StepEstimate, trace, layers: list[list[int]], order) -> None:
    """Each pipeline rank's step at its real depth. The rate per block comes from the rank with the longest stage,
    traced with TRACED_DEPTH blocks per stage and again with `every` more in that stage; every rank's trace with
    TRACED_DEPTH per stage grows from there. Ranks whose stages have the same ends (embedding, head) and whose
    traced blocks are of the same kinds (a dense first layer, say, in a mixture of experts) share a trace."""
    config, layout = estimate.config, estimate.layout
    every = config.activation_checkpoint.every if config.activation_checkpoint.mode != "none" else 1
    ids = [list(estimate.run.stages(r)) for r in range(layout.pp)]
    longest = max(range(layout.pp), key=lambda r: max(len(layers[s]) for s in ids[r]))
    rate = (trace(longest, TRACED_DEPTH), trace(longest, TRACED_DEPTH, deeper=every))
    grows = rate[1].param_bytes > rate[0].param_bytes  # not when no stage is deeper: all are traced whole
    kinds = estimate.kinds
    ends = [
        tuple((s == 0, s == len(layers) - 1, tuple(kinds[layer] for layer in layers[s][:TRACED_DEPTH])) for s in stages)
        for stages in ids
    ]
    traces = {ends[longest]: rate[0]}
    for pp_rank, stages in enumerate(ids):
        if ends[pp_rank] not in traces:
            traces[ends[pp_rank]] = trace(pp_rank, TRACED_DEPTH, optimizer=not grows)
            if grows:
                _optimizer_from_rate(traces[ends[pp_rank]], *rate)
        grown = _grow(traces[ends[pp_rank]], *rate, [len(layers[s]) for s in stages], stages)
        estimate.ranks.append(_rank_estimate(estimate, pp_rank, [layers[s] for s in stages], grown, order))
    estimate.params = sum(rank.trace.total_params for rank in estimate.ranks)
    # One block's activations under the recipe's checkpointing, for its kind: the first of each period runs its way.
    deepest = max(ids[longest], key=lambda s: len(layers[s]))
    kind = estimate.kinds[layers[deepest][0]]
    estimate.kind_activations[kind][config.activation_checkpoint.mode] = rate[1].block_held[0]


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
    sizes = ("params", "total_params", "expert_params", "param_bytes", "grad_bytes", "optimizer_bytes")
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
    peak, activations, in_flight = rank_peak(trace, trace.held, order[pp_rank] if order else None)
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
