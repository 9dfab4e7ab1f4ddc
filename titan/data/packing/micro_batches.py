"""Packing: each rank's documents into the step's micro-batches under the token capacity, the same number on
every rank, balanced by predicted time under a pipeline or first-fit decreasing."""

from __future__ import annotations

import math

from titan.data.packing.cost import Assignment, CostModel, Target, group_speeds, rank_time


def pack_all(
    ranks: list[list[int]],
    lengths: list[int],
    cost: CostModel,
    target: Target,
    speeds: list[float],
    balanced: bool,
    rings: list[list[list[int]]] | None = None,
) -> Assignment:
    """Pack every rank's documents into the same number of micro-batches: from the least that fits every rank
    (packed first-fit decreasing), trying larger counts while the predicted step time falls. `rings`: each cp
    group's ring micro-batches, which come first on each of its ranks (the step starts them together)."""
    cp = target.cp
    rings = rings or [[] for _ in range(target.dp)]
    before = [len(rings[r // cp]) for r in range(target.ranks)]
    slowest = group_speeds(speeds, cp)
    needed = max(
        before[r] + len(first_fit_decreasing(docs, lengths, target.capacities[r], None)) for r, docs in enumerate(ranks)
    )
    count = max(target.group, math.ceil(needed / target.group) * target.group)
    best = None
    most = max(count, max(before[r] + len(docs) for r, docs in enumerate(ranks)))
    while count <= most:
        bins = [
            [list(b) for b in rings[r // cp]] + _pack(docs, lengths, cost, target, r, count - before[r], balanced)
            for r, docs in enumerate(ranks)
        ]
        times = [
            rank_time(b, lengths, cost, target, r, range(before[r]), speeds[r] / slowest[r // cp]) / speeds[r]
            for r, b in enumerate(bins)
        ]
        if best is not None and max(times) >= best.step_time:
            break
        best = Assignment(bins, times, [set(range(len(group))) for group in rings])
        if not balanced or target.pipeline_stages == 1:  # then more micro-batches only add their constant
            break
        count += target.group
    return best


def _pack(docs: list[int], lengths: list[int], cost: CostModel, target: Target, rank: int, count: int, balanced: bool):
    """One rank's documents in `count` micro-batches: balanced by predicted time (largest first into the
    least-loaded micro-batch with room, then moves from the slowest one), or first-fit decreasing."""
    capacity = target.capacities[rank]
    if not balanced or target.pipeline_stages == 1:  # without a pipeline, the arrangement does not change the sum
        return first_fit_decreasing(docs, lengths, capacity, count)
    bins: list[list[int]] = [[] for _ in range(count)]
    room, load = [capacity] * count, [0.0] * count
    for i in sorted(docs, key=lambda i: (-lengths[i], i)):
        open_bins = [k for k in range(count) if room[k] >= lengths[i]]
        if not open_bins:  # balancing by time could not fit them all: the tight packing does
            return first_fit_decreasing(docs, lengths, capacity, count)
        k = min(open_bins, key=lambda k: (load[k], k))
        bins[k].append(i)
        room[k] -= lengths[i]
        load[k] += cost.document(lengths[i])
    for _ in range(4 * len(docs)):
        slow = max(range(count), key=lambda k: load[k])
        moves = [
            (max(load[slow] - cost.document(lengths[i]), load[k] + cost.document(lengths[i])), i, k)
            for i in bins[slow]
            for k in range(count)
            if k != slow and room[k] >= lengths[i]
        ]
        pair, i, k = min(moves, default=(math.inf, None, None))
        if pair >= load[slow] * (1 - 1e-9):
            break
        bins[slow].remove(i)
        bins[k].append(i)
        room[slow], room[k] = room[slow] + lengths[i], room[k] - lengths[i]
        load[slow], load[k] = load[slow] - cost.document(lengths[i]), load[k] + cost.document(lengths[i])
    return bins


def first_fit_decreasing(docs: list[int], lengths: list[int], capacity: int, count: int | None) -> list[list[int]]:
    """Longest first, each into the first micro-batch with room; a new one when none has room (count None),
    else exactly `count` micro-batches (some may stay empty), failing with ValueError if they cannot hold them."""
    bins: list[list[int]] = [[] for _ in range(count or 0)]
    room = [capacity] * len(bins)
    for i in sorted(docs, key=lambda i: (-lengths[i], i)):
        k = next((k for k in range(len(bins)) if room[k] >= lengths[i]), None)
        if k is None:
            if count is not None:
                raise ValueError(f"{len(docs)} documents do not fit {count} micro-batches of {capacity} tokens")
            bins.append([])
            room.append(capacity)
            k = len(bins) - 1
        bins[k].append(i)
        room[k] -= lengths[i]
    return bins
