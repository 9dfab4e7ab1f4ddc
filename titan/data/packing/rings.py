"""Context-parallel placement: which documents train in a ring micro-batch of a cp group, in which order in its
row, and which on single ranks (after Hydraulis)."""

from __future__ import annotations

from titan.data.packing.cost import (
    Assignment,
    CostModel,
    Target,
    add_to_ring,
    group_speeds,
    ring_attention,
    ring_time,
)
from titan.data.packing.dispatch import document_weights, fixed_cost, greedy
from titan.data.packing.micro_batches import first_fit_decreasing, pack_all


def row_share(cost: CostModel, cp: int) -> CostModel:
    """One rank's share of a row's work over a cp group, the ring's traffic left out."""
    return CostModel(cost.a / cp, cost.b / cp, cost.c)


def as_rings(rows: list[list[list[int]]], lengths: list[int], cost: CostModel, target: Target, speeds) -> Assignment:
    """Each cp group's micro-batches `rows` as its ranks run them: every one a ring."""
    no_local = [[] for _ in range(target.ranks)]
    return pack_all(no_local, lengths, cost, target, speeds, balanced=False, rings=rows)


def placement(lengths: list[int], cost: CostModel, target: Target, speeds: list[float]) -> Assignment:
    """Context-parallel placement: the documents longer than every rank's capacity to cp groups by their share of
    a ring's time on each rank of the group, packed into rings; then the others to single ranks, whose loads start
    from their groups'."""
    cp, weight, fixed = target.cp, document_weights(lengths, cost, target), fixed_cost(lengths, cost, target)
    capacity, longest = target.capacities[::cp], max(target.capacities)
    # A ring document's seconds on each rank of its group: alone in its ring, with its share of the linear work.
    share = [ring_time([s], cost, longest, cp) - cost.c - cost.b * (cp * longest - s) / cp for s in lengths]
    long = [i for i, s in enumerate(lengths) if s > longest]
    slowest = group_speeds(speeds, cp)
    groups, _ = greedy(long, share, [fixed] * target.dp, lengths, target.rows().capacities, slowest)
    short = sorted((i for i, s in enumerate(lengths) if s <= longest), key=lambda i: (-lengths[i], i))
    rings = [
        [arrange(_fill(ring, short, lengths, cost, capacity[g], cp), lengths, capacity[g], cp)
         for ring in first_fit_decreasing(docs, lengths, cp * capacity[g], None)]
        for g, docs in enumerate(groups)
    ]  # fmt: skip
    ring_load = [sum(ring_time([lengths[i] for i in ring], cost, capacity[g], cp) - cost.c for ring in group)
                 for g, group in enumerate(rings)]  # fmt: skip
    # A rank's share of its group's rings, in its own seconds: the rings run at the group's slowest rank's pace.
    start = [fixed + ring_load[r // cp] * speeds[r] / slowest[r // cp] for r in range(target.ranks)]
    ranks, _ = greedy(short, weight, start, lengths, target.capacities, speeds)
    return pack_all(ranks, lengths, cost, target, speeds, balanced=True, rings=rings)


def arrange(ring: list[int], lengths: list[int], capacity: int, cp: int) -> list[int]:
    """The order of a ring's documents in its row, of this one and the longest at alternate ends (where a
    document's heavy last chunks share ranks with the other's light first ones), whose busiest rank has less
    attention (ring_attention)."""
    by_length = sorted(ring, key=lambda i: (-lengths[i], i))
    ends = by_length[::2] + by_length[1::2][::-1]
    return min((ring, ends), key=lambda docs: max(ring_attention([lengths[i] for i in docs], capacity, cp)))


def _fill(ring: list[int], pool: list[int], lengths: list[int], cost: CostModel, capacity: int, cp: int) -> list[int]:
    """A ring's row is cp x capacity tokens whatever it holds: short documents of `pool` (longest first; taken out
    of it) fill its room at the row's end while each costs the group less than it would alone on a rank (cp times
    what it adds to the busiest rank's attention, against its a·s² + b·s)."""
    shares = ring_attention([lengths[i] for i in ring], capacity, cp)
    used = sum(lengths[i] for i in ring)
    for i in list(pool):
        if used + lengths[i] > cp * capacity:
            continue
        trial = list(shares)
        add_to_ring(trial, lengths[i], used, capacity)
        if cp * cost.a * (max(trial) - max(shares)) < cost.document(lengths[i]):
            ring, shares, used = [*ring, i], trial, used + lengths[i]
            pool.remove(i)
    return ring
