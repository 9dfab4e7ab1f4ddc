"""Dispatch: documents to ranks, the most expensive first, each to the rank that would finish soonest with it,
then moves and swaps away from the slowest rank while they lower its time."""

from __future__ import annotations

import bisect
import math

import numpy as np

from titan.data.packing.cost import CostModel, Target


def dispatch(lengths: list[int], cost: CostModel, target: Target, speeds: list[float]) -> list[list[int]]:
    """Documents to ranks by predicted time, from the micro-batch constants every rank pays (fixed_cost)."""
    weight = document_weights(lengths, cost, target)
    fixed = fixed_cost(lengths, cost, target)
    ranks, _ = greedy(range(len(lengths)), weight, [fixed] * target.ranks, lengths, target.capacities, speeds)
    return ranks


def document_weights(lengths: list[int], cost: CostModel, target: Target) -> list[float]:
    """A document's seconds on the rank that runs it: a·s² (+ b·s unpadded; padded, the capacity's is fixed)."""
    return [cost.a * s * s + (0.0 if target.padded else cost.b * s) for s in lengths]


def fixed_cost(lengths: list[int], cost: CostModel, target: Target) -> float:
    """What every rank pays whatever it holds: the step's micro-batch constants (and, padded, the linear cost of
    the whole capacity), estimated from the fewest micro-batches that could hold the step."""
    per_micro_batch = cost.c + (cost.b * min(target.capacities) if target.padded else 0.0)
    count = math.ceil(math.ceil(sum(lengths) / sum(target.capacities)) / target.group) * target.group
    return per_micro_batch * (count + (target.pipeline_stages - 1) * count // target.group)


def greedy(docs, weight, load, lengths, capacities, speeds) -> tuple[list[list[int]], list[float]]:
    """`docs` to ranks, the heaviest first, each to the rank that would finish soonest with it (of those that can
    hold it), then _improve; `load`: each rank's seconds before. Returns each rank's documents and seconds."""
    load = np.asarray(load, dtype=np.float64)
    rates, room = np.asarray(speeds, dtype=np.float64), np.asarray(capacities)
    ranks: list[list[int]] = [[] for _ in capacities]
    for i in sorted(docs, key=lambda i: (-weight[i], i)):
        finish = (load + weight[i]) / rates
        finish[room < lengths[i]] = np.inf
        r = int(np.argmin(finish))  # the first of equals: every rank makes the same choice
        ranks[r].append(i)
        load[r] += weight[i]
    load = load.tolist()
    _improve(ranks, load, weight, lengths, capacities, speeds)
    return ranks, load


def _improve(ranks, load, weight, lengths, capacities, speeds) -> None:
    """Local search: move one document of the slowest rank to one of the fastest ranks, or swap it for a
    lighter one there, while that lowers the slower of the pair. For a pair the best transfer of weight d is
    where both finish together; bisection over each rank's sorted weights finds the documents nearest it."""
    fastest_to_try = 4
    for _ in range(8 * len(ranks)):
        times = [load[r] / speeds[r] for r in range(len(ranks))]
        slow = max(range(len(ranks)), key=lambda r: (times[r], -r))
        worst = times[slow]
        best = None  # (the pair's new slower time, document moved, rank it goes to, document moved back or None)
        for fast in sorted(range(len(ranks)), key=lambda r: (times[r], r))[:fastest_to_try]:
            if fast == slow:
                continue
            ideal = (load[slow] * speeds[fast] - load[fast] * speeds[slow]) / (speeds[slow] + speeds[fast])
            mine = sorted((weight[i], i) for i in ranks[slow] if lengths[i] <= capacities[fast])
            theirs = sorted((weight[j], j) for j in ranks[fast] if lengths[j] <= capacities[slow])
            candidates = [(i, None) for _, i in _nearest(mine, ideal)]
            for w, i in mine:
                candidates += [(i, j) for _, j in _nearest(theirs, w - ideal) if weight[j] < w]
            for i, j in candidates:
                delta = weight[i] - (weight[j] if j is not None else 0.0)
                pair = max((load[slow] - delta) / speeds[slow], (load[fast] + delta) / speeds[fast])
                if pair < worst * (1 - 1e-9) and (best is None or pair < best[0]):
                    best = (pair, i, fast, j)
        if best is None:
            return
        _, i, fast, j = best
        ranks[slow].remove(i)
        ranks[fast].append(i)
        load[slow] -= weight[i]
        load[fast] += weight[i]
        if j is not None:
            ranks[fast].remove(j)
            ranks[slow].append(j)
            load[fast] -= weight[j]
            load[slow] += weight[j]


def _nearest(items: list[tuple[float, int]], value: float) -> list[tuple[float, int]]:
    """The (at most two) items of a sorted list whose first element is nearest `value` from below and above."""
    k = bisect.bisect_left(items, (value, -1))
    return items[max(0, k - 1) : k + 1]
