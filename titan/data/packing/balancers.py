"""The balancers: the cost-balanced assignment, the fastest predicted of its candidates, and the token-balanced
baseline."""

from __future__ import annotations

import numpy as np

from titan.data.packing.cost import Assignment, CostModel, Target, group_speeds
from titan.data.packing.dispatch import dispatch
from titan.data.packing.micro_batches import pack_all
from titan.data.packing.rings import arrange, as_rings, placement, row_share
from titan.errors import ConfigError


def balance_by_cost(
    lengths: list[int], cost: CostModel, target: Target, speeds: list[float] | None = None, place: bool = True
) -> Assignment:
    """The cost-balanced assignment of documents of these lengths (see the package's docstring); `speeds`: each
    rank's relative speed (its predicted times are divided by it; with context parallelism one per slot, and a
    ring runs at its group's slowest). `place`: with context parallelism, documents that fit one rank may train
    outside rings; False: every micro-batch is a ring (static CP), balanced by cost."""
    speeds = speeds or [1.0] * target.ranks
    _check_fits(lengths, target)
    if target.cp > 1:
        rows = balance_by_cost(lengths, row_share(cost, target.cp), target.rows(), group_speeds(speeds, target.cp))
        capacity = target.capacities[:: target.cp]
        rings = [
            [arrange(b, lengths, capacity[g], target.cp) for b in bins] for g, bins in enumerate(rows.micro_batches)
        ]
        candidates = [placement(lengths, cost, target, speeds)] if place else []
        candidates += [
            as_rings(rings, lengths, cost, target, speeds),
            balance_by_tokens(lengths, cost, target, speeds),
        ]
        return min(candidates, key=lambda assignment: assignment.step_time)  # the first of equals
    ranks = dispatch(lengths, cost, target, speeds)
    best = pack_all(ranks, lengths, cost, target, speeds, balanced=True)
    baseline = balance_by_tokens(lengths, cost, target, speeds)
    return baseline if baseline.step_time < best.step_time else best


def balance_by_tokens(
    lengths: list[int], cost: CostModel, target: Target, speeds: list[float] | None = None
) -> Assignment:
    """The token-balanced baseline: longest document first to the rank with the fewest tokens (relative to
    its capacity), then first-fit-decreasing packing into as few micro-batches as fit. With context parallelism
    (static CP): the same over cp groups and rows of cp x capacity tokens, every micro-batch a ring."""
    speeds = speeds or [1.0] * target.ranks
    _check_fits(lengths, target)
    if target.cp > 1:
        rows = balance_by_tokens(lengths, row_share(cost, target.cp), target.rows(), group_speeds(speeds, target.cp))
        return as_rings(rows.micro_batches, lengths, cost, target, speeds)
    fill = np.zeros(target.ranks)  # tokens over capacity
    capacities = np.asarray(target.capacities, dtype=np.float64)
    ranks: list[list[int]] = [[] for _ in range(target.ranks)]
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        after = fill + lengths[i] / capacities
        after[capacities < lengths[i]] = np.inf
        r = int(np.argmin(after))
        ranks[r].append(i)
        fill[r] = after[r]
    return pack_all(ranks, lengths, cost, target, speeds, balanced=False)


def _check_fits(lengths: list[int], target: Target) -> None:
    longest = target.cp * max(target.capacities)
    if lengths and max(lengths) > longest:
        where = "rank's micro-batch" if target.cp == 1 else f"cp group's ring of {target.cp} ranks"
        raise ConfigError(
            f"a document of {max(lengths)} tokens fits no {where} (at most {longest} tokens); "
            "lower data.max_document_len"
        )
