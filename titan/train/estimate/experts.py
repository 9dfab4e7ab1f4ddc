"""A mixture of experts in `titan plan`: expert parallelism's all-to-all per step by the formula (docs/planning.md),
which the trace's count on the fake process group must equal, and its time over the ep group's links.

The trace runs the real dispatch (titan/parallel/ep.py) on the split it assumes, fake tensors holding no counts:
every rank sends its (token, expert) pairs evenly over the ep ranks, and the traced rank is the most loaded, its
experts receiving plan.moe_load_imbalance times the mean from each rank. Its activations, expert matmuls and
all-to-all are that rank's, which the others wait for.
"""

from __future__ import annotations

import dataclasses

from titan.models import RoutedExperts
from titan.train.estimate.activations import mode_ways
from titan.train.estimate.devices import Links
from titan.train.estimate.figures import RankEstimate, StepEstimate

RECOMPUTING = ("selective", "full")  # ways whose backward runs the block's forward, and its all-to-alls, again


def all_to_all_formula(estimate: StepEstimate, rank: RankEstimate, routed: RoutedExperts) -> int:
    """The bytes a rank's all-to-alls carry per step in their busier direction: per MoE layer and micro-batch, the
    dispatch and the combine forward, their mirrors backward and, in a block that recomputes, its forward's again,
    each the f T k / ep rows (f the load imbalance, T the rank's tokens, top k) of dim x bytes that the most loaded
    rank receives from each of the ep - 1 others (a rank routes its share of each row's positions: over cp, and in
    the MoE layers over tp); and once per forward the experts' token counts (int64, an even
    share each)."""
    layout, config = estimate.layout, estimate.config
    if layout.ep == 1:
        return 0
    pairs = estimate.rows * config.training.seq_len // (layout.cp * layout.tp) * routed.top_k
    received = round(config.plan.moe_load_imbalance * pairs / layout.ep) * (layout.ep - 1)
    row = routed.width * (2 if estimate.run.precision.stream_bf16 else 4)
    mode = config.activation_checkpoint.mode  # auto was traced as full, and planned: rank.checkpointing
    ways = rank.checkpointing.choices if rank.checkpointing else _flat(mode_ways(estimate, rank, mode))
    moe = set(routed.expert_layers)
    layers = [layer in moe for layer in _flat(rank.layers)]
    if after := _blocks_after_layers(estimate, rank, routed):
        layers, ways = layers + [True] * len(after), [*ways, *after]
    recomputing = sum(way in RECOMPUTING for way, routed in zip(ways, layers) if routed)
    tokens = (4 * sum(layers) + 2 * recomputing) * received * row
    counts = (sum(layers) + recomputing) * routed.n_experts // layout.ep * (layout.ep - 1) * 8
    return estimate.microbatches * estimate.runs * (tokens + counts)


def _blocks_after_layers(estimate: StepEstimate, rank: RankEstimate, routed: RoutedExperts) -> list[str]:
    """How the routed blocks after the layers (a multi-token prediction's, ModelSpec.blocks' last) run on the rank
    that holds the last stage: the recipe's mode continuing its period over them; under auto, which plans the
    layers' blocks, in full, as traced (the trainer plans them too, from the last layer's kind's ways); [] on the
    other ranks."""
    after = [layer for layer in routed.expert_layers if layer >= len(estimate.kinds)]
    last = estimate.run.n_stages - 1
    if not after or last not in rank.stage_ids:
        return []
    if rank.checkpointing:
        return ["full"] * len(after)
    stage = rank.layers[rank.stage_ids.index(last)]
    continued = dataclasses.replace(rank, layers=[[*stage, *after]])
    return mode_ways(estimate, continued, estimate.config.activation_checkpoint.mode)[0][len(stage) :]


def all_to_all_seconds(estimate: StepEstimate, rank: RankEstimate) -> float:
    """The time the rank's counted all-to-all bytes take over the ep group's links, per step: exposed, as the
    dispatch waits for its tokens."""
    links = Links(estimate.device, estimate.layout.world_size)
    nbytes = rank.traffic.get(("all-to-all", "ep"), 0)
    return links.collective("all-to-all", nbytes, rank.trace.groups.get("ep", ())) if nbytes else 0.0


def _flat(nested: list[list]) -> list:
    return [item for inner in nested for item in inner]
