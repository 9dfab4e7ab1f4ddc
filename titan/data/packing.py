"""Which data-parallel rank trains which documents of a step, and in which micro-batch (after Hydraulis).

With document masking a step's math does not depend on where its documents go: each document attends only to
itself and the loss is divided by the step's global token count. So the assignment is free to chase speed. A
document of s tokens costs about a·s² + b·s seconds (attention, then all that is linear in tokens), a
micro-batch adds a constant c, and memory caps the tokens of a micro-batch. Balancing tokens leaves the rank
with the longest documents the most attention work; balancing predicted time takes two stages:

1. dispatch: documents to ranks, the most expensive first, each to the rank that would finish soonest with it;
   then moves and swaps away from the slowest rank while they lower its time;
2. packing: each rank's documents into the step's micro-batches under the token capacity, balancing their
   times (a pipeline waits for its slowest micro-batch in warm-up and cool-down). Every rank runs the same
   number of micro-batches (FSDP's collectives run once per micro-batch on every rank); the number with the
   lowest predicted step wins.

The token-balanced baseline (`balance_by_tokens`: equal tokens per rank, first-fit-decreasing packing) is also
a candidate, so the cost-balanced assignment is never predicted slower than it. All functions are pure and
deterministic: every rank computes the same assignment from the same lengths.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass, field

import numpy as np


@dataclass(frozen=True)
class CostModel:
    """Predicted seconds of one micro-batch on one rank: c + Σ over its documents of a·s² + b·s."""

    a: float
    b: float
    c: float

    def document(self, s: int) -> float:
        return self.a * s * s + self.b * s


@dataclass(frozen=True)
class Target:
    """What the micro-batches run on: `capacities` (tokens per micro-batch, per rank), the pipeline depth,
    and `group`: micro-batches come in runs of this many (one pipeline schedule each), so their count is a
    multiple of it. `padded`: every micro-batch is padded to its capacity (pipelines need fixed shapes), so
    its linear cost is the capacity's whatever it holds. `cp` > 1: context parallelism, whose ranks are the slots
    of the dp x cp plane (slot = dp_rank * cp + cp_rank), each capacity one rank's tokens; a cp group may run a
    document of up to cp times that as a ring."""

    capacities: tuple[int, ...]
    pipeline_stages: int = 1
    group: int = 1
    padded: bool = False
    cp: int = 1

    @property
    def ranks(self) -> int:
        return len(self.capacities)


@dataclass
class Assignment:
    """micro_batches[rank][k]: the indices of the documents in that rank's k-th micro-batch (the same count on
    every rank; some may be empty); times[rank]: its predicted seconds. rings[g] (Target.cp > 1): the
    micro-batches in which cp group g runs a ring, the same documents on every slot of the group."""

    micro_batches: list[list[list[int]]]
    times: list[float]
    rings: list[set[int]] = field(default_factory=list)

    @property
    def step_time(self) -> float:
        return max(self.times)

    @property
    def imbalance(self) -> float:
        """Slowest rank over the mean: 1 is perfect balance."""
        mean = sum(self.times) / len(self.times)
        return self.step_time / mean if mean > 0 else 1.0


def micro_batch_time(lengths: list[int], cost: CostModel, capacity: int, padded: bool) -> float:
    tokens = capacity if padded else sum(lengths)
    return cost.c + cost.b * tokens + cost.a * sum(s * s for s in lengths)


def rank_time(bins: list[list[int]], lengths: list[int], cost: CostModel, target: Target, rank: int) -> float:
    """Predicted seconds of one rank's micro-batches: each schedule run of `group` micro-batches takes their
    sum plus (stages - 1) times the slowest (the pipeline's warm-up and cool-down). Runs take the micro-batches
    in order of time, which makes the sum of the runs' maxima smallest."""
    times = sorted(
        (micro_batch_time([lengths[i] for i in b], cost, target.capacities[rank], target.padded) for b in bins),
        reverse=True,
    )
    runs = [times[k : k + target.group] for k in range(0, len(times), target.group)]
    return sum(sum(run) + (target.pipeline_stages - 1) * max(run) for run in runs)


def balance_by_cost(
    lengths: list[int], cost: CostModel, target: Target, speeds: list[float] | None = None
) -> Assignment:
    """The cost-balanced assignment of documents of these lengths (see the module's docstring); `speeds`:
    each rank's relative speed (its predicted times are divided by it)."""
    speeds = speeds or [1.0] * target.ranks
    _check_fits(lengths, target)
    ranks = _dispatch(lengths, cost, target, speeds)
    best = _pack_all(ranks, lengths, cost, target, speeds, balanced=True)
    baseline = balance_by_tokens(lengths, cost, target, speeds)
    return baseline if baseline.step_time < best.step_time else best


def balance_by_tokens(
    lengths: list[int], cost: CostModel, target: Target, speeds: list[float] | None = None
) -> Assignment:
    """The token-balanced baseline: longest document first to the rank with the fewest tokens (relative to
    its capacity), then first-fit-decreasing packing into as few micro-batches as fit."""
    speeds = speeds or [1.0] * target.ranks
    _check_fits(lengths, target)
    fill = np.zeros(target.ranks)  # tokens over capacity
    capacities = np.asarray(target.capacities, dtype=np.float64)
    ranks: list[list[int]] = [[] for _ in range(target.ranks)]
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        after = fill + lengths[i] / capacities
        after[capacities < lengths[i]] = np.inf
        r = int(np.argmin(after))
        ranks[r].append(i)
        fill[r] = after[r]
    return _pack_all(ranks, lengths, cost, target, speeds, balanced=False)


def _check_fits(lengths: list[int], target: Target) -> None:
    if lengths and max(lengths) > max(target.capacities):
        raise ValueError(
            f"a document of {max(lengths)} tokens fits no rank's micro-batch (at most {max(target.capacities)} tokens)"
        )


def _dispatch(lengths: list[int], cost: CostModel, target: Target, speeds: list[float]) -> list[list[int]]:
    """Documents to ranks by predicted time. Every rank pays the step's micro-batch constants (and, padded,
    the linear cost of the whole capacity) whatever it holds, estimated from the fewest micro-batches that
    could hold the step; a document then adds a·s² (+ b·s unpadded)."""
    per_micro_batch = cost.c + (cost.b * min(target.capacities) if target.padded else 0.0)
    count = math.ceil(math.ceil(sum(lengths) / sum(target.capacities)) / target.group) * target.group
    fixed = per_micro_batch * (count + (target.pipeline_stages - 1) * count // target.group)
    weight = [cost.a * s * s + (0.0 if target.padded else cost.b * s) for s in lengths]
    load = np.full(target.ranks, fixed)
    rates, capacities = np.asarray(speeds, dtype=np.float64), np.asarray(target.capacities)
    ranks: list[list[int]] = [[] for _ in range(target.ranks)]
    for i in sorted(range(len(lengths)), key=lambda i: (-weight[i], i)):
        finish = (load + weight[i]) / rates
        finish[capacities < lengths[i]] = np.inf
        r = int(np.argmin(finish))  # the first of equals: every rank makes the same choice
        ranks[r].append(i)
        load[r] += weight[i]
    load = load.tolist()
    _improve(ranks, load, weight, lengths, target.capacities, speeds)
    return ranks


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


def _pack_all(
    ranks: list[list[int]], lengths: list[int], cost: CostModel, target: Target, speeds: list[float], balanced: bool
) -> Assignment:
    """Pack every rank's documents into the same number of micro-batches: from the least that fits every rank
    (packed first-fit decreasing), trying larger counts while the predicted step time falls."""
    needed = max(len(_first_fit_decreasing(docs, lengths, target.capacities[r], None)) for r, docs in enumerate(ranks))
    count = max(target.group, math.ceil(needed / target.group) * target.group)
    best = None
    most = max(count, max(len(docs) for docs in ranks))
    while count <= most:
        bins = [_pack(docs, lengths, cost, target, r, count, balanced) for r, docs in enumerate(ranks)]
        times = [rank_time(b, lengths, cost, target, r) / speeds[r] for r, b in enumerate(bins)]
        if best is not None and max(times) >= best.step_time:
            break
        best = Assignment(bins, times)
        if not balanced or target.pipeline_stages == 1:  # then more micro-batches only add their constant
            break
        count += target.group
    return best


def _pack(docs: list[int], lengths: list[int], cost: CostModel, target: Target, rank: int, count: int, balanced: bool):
    """One rank's documents in `count` micro-batches: balanced by predicted time (largest first into the
    least-loaded micro-batch with room, then moves from the slowest one), or first-fit decreasing."""
    capacity = target.capacities[rank]
    if not balanced or target.pipeline_stages == 1:  # without a pipeline, the arrangement does not change the sum
        return _first_fit_decreasing(docs, lengths, capacity, count)
    bins: list[list[int]] = [[] for _ in range(count)]
    room, load = [capacity] * count, [0.0] * count
    for i in sorted(docs, key=lambda i: (-lengths[i], i)):
        open_bins = [k for k in range(count) if room[k] >= lengths[i]]
        if not open_bins:  # balancing by time could not fit them all: the tight packing does
            return _first_fit_decreasing(docs, lengths, capacity, count)
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


def _first_fit_decreasing(docs: list[int], lengths: list[int], capacity: int, count: int | None) -> list[list[int]]:
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


def place_on_cp_groups(
    lengths: list[int], cost: CostModel, target: Target, speeds: list[float] | None = None
) -> Assignment:
    """A simple placement for context parallelism (Target.cp > 1), until a cost-balanced one: documents longer
    than a rank's capacity go to ring micro-batches of a cp group (to the group with the fewest ring tokens,
    first-fit decreasing into rows of cp x capacity), the others to local micro-batches of single slots (to the
    slot with the fewest tokens, first-fit decreasing). A group runs its rings first, then its slots' local
    micro-batches; every slot gets as many micro-batches as the busiest group needs. A ring's predicted time is
    shared by its cp ranks."""
    speeds = speeds or [1.0] * target.ranks
    cp, capacity = target.cp, min(target.capacities)
    if lengths and max(lengths) > cp * capacity:
        raise ValueError(f"a document of {max(lengths)} tokens fits no ring of {cp} x {capacity} tokens")
    ring = [i for i in range(len(lengths)) if lengths[i] > capacity]
    local = [i for i in range(len(lengths)) if lengths[i] <= capacity]
    rings = [
        _first_fit_decreasing(docs, lengths, cp * capacity, None)
        for docs in _least_loaded(ring, lengths, target.ranks // cp)
    ]
    own = [_first_fit_decreasing(docs, lengths, capacity, None) for docs in _least_loaded(local, lengths, target.ranks)]
    count = max(len(rings[s // cp]) + len(own[s]) for s in range(target.ranks))
    micro_batches = [
        rings[s // cp] + own[s] + [[] for _ in range(count - len(rings[s // cp]) - len(own[s]))]
        for s in range(target.ranks)
    ]

    def seconds(docs: list[int], shared: bool) -> float:
        return micro_batch_time([lengths[i] for i in docs], cost, capacity, target.padded) / (cp if shared else 1)

    times = [
        sum(seconds(docs, m < len(rings[s // cp])) for m, docs in enumerate(bins)) / speeds[s]
        for s, bins in enumerate(micro_batches)
    ]
    return Assignment(micro_batches, times, [set(range(len(r))) for r in rings])


def _least_loaded(docs: list[int], lengths: list[int], bins: int) -> list[list[int]]:
    """Longest first, each to the bin with the fewest tokens so far (the first of equals)."""
    out: list[list[int]] = [[] for _ in range(bins)]
    load = [0] * bins
    for i in sorted(docs, key=lambda i: (-lengths[i], i)):
        k = min(range(bins), key=lambda k: (load[k], k))
        out[k].append(i)
        load[k] += lengths[i]
    return out
