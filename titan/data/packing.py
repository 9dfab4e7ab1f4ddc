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

With context parallelism (`Target.cp` > 1) the ranks come in cp groups, one per data-parallel rank. A ring
micro-batch is one row of up to cp x capacity tokens split over a group (titan/parallel/cp/): each of its ranks
does the linear work of its chunks and the attention of their queries while keys and values go round
(ring_time). Without placement (static CP, what titan does without it) every micro-batch is a ring. Placement,
after Hydraulis, gives long documents more parallelism and short ones less: a document longer than one rank's
capacity goes to a ring of a cp group (dispatched to groups first, by its time there), short ones fill a ring's
room where that costs less, and the rest go to single ranks (dispatched to ranks whose loads start from their
groups' rings), where they pay no ring traffic. The cost-balanced assignment is the fastest predicted of placement,
static CP balanced by cost, and static CP balanced by tokens.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass

import numpy as np

from titan.errors import ConfigError


@dataclass(frozen=True)
class CostModel:
    """Predicted seconds of one micro-batch on one rank: c + Σ over its documents of a·s² + b·s. `r`: seconds per
    token of one ring hop's key and value traffic (forward and backward, every layer), for the part of a ring
    micro-batch's traffic that attention does not hide (micro_batch_time)."""

    a: float
    b: float
    c: float
    r: float = 0.0

    def document(self, s: int) -> float:
        return self.a * s * s + self.b * s


@dataclass(frozen=True)
class Target:
    """What the micro-batches run on: `capacities` (tokens per micro-batch, per rank), the pipeline depth,
    and `group`: micro-batches come in runs of this many (one pipeline schedule each), so their count is a
    multiple of it. `padded`: every micro-batch is padded to its capacity (pipelines need fixed shapes), so
    its linear cost is the capacity's whatever it holds. `cp`: the context-parallel degree; with cp > 1,
    `capacities` has an entry per rank of the dp x cp plane (rank dp_rank * cp + cp_rank), one rank's share of a
    row (training.seq_len / cp), the same within each cp group."""

    capacities: tuple[int, ...]
    pipeline_stages: int = 1
    group: int = 1
    padded: bool = False
    cp: int = 1

    def __post_init__(self):
        groups = {self.capacities[g : g + self.cp] for g in range(0, self.ranks, self.cp)}
        if self.ranks % self.cp or any(len(set(capacities)) > 1 for capacities in groups):
            raise ValueError(f"capacities {self.capacities} do not form cp groups of {self.cp} equal ones")

    @property
    def ranks(self) -> int:
        return len(self.capacities)

    @property
    def dp(self) -> int:
        """Data-parallel ranks: one per cp group."""
        return self.ranks // self.cp

    def rows(self) -> Target:
        """The cp groups as ranks whose micro-batches are rows of cp x capacity tokens (padded: ring_time)."""
        rows = tuple(self.cp * capacity for capacity in self.capacities[:: self.cp])
        return Target(rows, self.pipeline_stages, self.group, padded=True)


@dataclass
class Assignment:
    """micro_batches[rank][k]: the indices of the documents in that rank's k-th micro-batch (the same count on
    every rank; some may be empty); times[rank]: its predicted seconds; rings[g]: the k in which cp group g runs a
    ring micro-batch (the same documents on each of its ranks, at most cp x capacity tokens); empty without
    context parallelism."""

    micro_batches: list[list[list[int]]]
    times: list[float]
    rings: list[set[int]]

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


def ring_time(lengths: list[int], cost: CostModel, capacity: int, cp: int) -> float:
    """Predicted seconds of a ring micro-batch on each rank of its cp group. Its row is cp x capacity tokens (the
    ring's chunks are fixed: RunPlan.sequence), so every rank does the linear work of `capacity` tokens, and the
    hops wait for the rank with the most attention (ring_attention). Each of the cp - 1 hops sends a block of
    `capacity` tokens while attention runs on the block before it; what attention does not hide is exposed (a
    rank's attention taken as spread evenly over the cp blocks it meets; the linear work hides nothing)."""
    attention = cost.a * max(ring_attention(lengths, capacity, cp))
    exposed = (cp - 1) * max(0.0, cost.r * capacity - attention / cp)
    return cost.c + cost.b * capacity + attention + exposed


def ring_attention(lengths: list[int], capacity: int, cp: int) -> list[float]:
    """Each cp rank's attention in a ring row, in units of one document's s² (a·s² seconds on one rank): the
    documents in order from the row's start, the row cut into 2·cp chunks of capacity / 2 tokens, rank k holding
    chunks k and 2·cp - 1 - k (RunPlan.sequence). A document's work splits as its queries' counts of keys do."""
    shares, start = [0.0] * cp, 0
    for s in lengths:
        _add_to_ring(shares, s, start, capacity)
        start += s
    return shares


def _add_to_ring(shares: list[float], s: int, start: int, capacity: int) -> None:
    """Add to each rank's attention (ring_attention) that of a document of s tokens at `start` in the row."""
    half, cp, pairs = capacity // 2, len(shares), s * (s + 1) / 2
    for chunk in range(start // half, (start + s - 1) // half + 1):
        first, end = max(0, chunk * half - start), min(s, (chunk + 1) * half - start)  # the chunk's queries
        shares[min(chunk, 2 * cp - 1 - chunk)] += s * s * (end * (end + 1) - first * (first + 1)) / 2 / pairs


def rank_time(
    bins: list[list[int]],
    lengths: list[int],
    cost: CostModel,
    target: Target,
    rank: int,
    rings=frozenset(),
    ring_pace: float = 1.0,
) -> float:
    """Predicted seconds of one rank's micro-batches: each schedule run of `group` micro-batches takes their sum
    plus (stages - 1) times the slowest (the pipeline's warm-up and cool-down). Runs take the micro-batches in order
    of time, which makes the sum of the runs' maxima smallest. `rings`: the indices of ring micro-batches, which
    take `ring_pace` times their time (this rank's speed over its cp group's slowest: a ring waits for it)."""
    capacity, padded = target.capacities[rank], target.padded

    def seconds(k: int, docs: list[int]) -> float:
        if k in rings:
            return ring_pace * ring_time([lengths[i] for i in docs], cost, capacity, target.cp)
        return micro_batch_time([lengths[i] for i in docs], cost, capacity, padded)

    times = sorted((seconds(k, b) for k, b in enumerate(bins)), reverse=True)
    runs = [times[k : k + target.group] for k in range(0, len(times), target.group)]
    return sum(sum(run) + (target.pipeline_stages - 1) * max(run) for run in runs)


def balance_by_cost(
    lengths: list[int], cost: CostModel, target: Target, speeds: list[float] | None = None, place: bool = True
) -> Assignment:
    """The cost-balanced assignment of documents of these lengths (see the module's docstring); `speeds`: each
    rank's relative speed (its predicted times are divided by it; with context parallelism one per slot, and a
    ring runs at its group's slowest). `place`: with context parallelism, documents that fit one rank may train
    outside rings; False: every micro-batch is a ring (static CP), balanced by cost."""
    speeds = speeds or [1.0] * target.ranks
    _check_fits(lengths, target)
    if target.cp > 1:
        rows = balance_by_cost(lengths, _row_share(cost, target.cp), target.rows(), _group_speeds(speeds, target.cp))
        capacity = target.capacities[:: target.cp]
        rings = [
            [_arrange(b, lengths, capacity[g], target.cp) for b in bins] for g, bins in enumerate(rows.micro_batches)
        ]
        candidates = [_place(lengths, cost, target, speeds)] if place else []
        candidates += [
            _as_rings(rings, lengths, cost, target, speeds),
            balance_by_tokens(lengths, cost, target, speeds),
        ]
        return min(candidates, key=lambda assignment: assignment.step_time)  # the first of equals
    ranks = _dispatch(lengths, cost, target, speeds)
    best = _pack_all(ranks, lengths, cost, target, speeds, balanced=True)
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
        rows = balance_by_tokens(lengths, _row_share(cost, target.cp), target.rows(), _group_speeds(speeds, target.cp))
        return _as_rings(rows.micro_batches, lengths, cost, target, speeds)
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
    longest = target.cp * max(target.capacities)
    if lengths and max(lengths) > longest:
        where = "rank's micro-batch" if target.cp == 1 else f"cp group's ring of {target.cp} ranks"
        raise ConfigError(
            f"a document of {max(lengths)} tokens fits no {where} (at most {longest} tokens); "
            "lower data.max_document_len"
        )


def _row_share(cost: CostModel, cp: int) -> CostModel:
    """One rank's share of a row's work over a cp group, the ring's traffic left out."""
    return CostModel(cost.a / cp, cost.b / cp, cost.c)


def _group_speeds(speeds: list[float], cp: int) -> list[float]:
    """Each cp group's speed for its rings: its slowest rank's."""
    return [min(speeds[g : g + cp]) for g in range(0, len(speeds), cp)]


def _as_rings(rows: list[list[list[int]]], lengths: list[int], cost: CostModel, target: Target, speeds) -> Assignment:
    """Each cp group's micro-batches `rows` as its ranks run them: every one a ring."""
    no_local = [[] for _ in range(target.ranks)]
    return _pack_all(no_local, lengths, cost, target, speeds, balanced=False, rings=rows)


def _dispatch(lengths: list[int], cost: CostModel, target: Target, speeds: list[float]) -> list[list[int]]:
    """Documents to ranks by predicted time, from the micro-batch constants every rank pays (_fixed_cost)."""
    weight = _weights(lengths, cost, target)
    fixed = _fixed_cost(lengths, cost, target)
    ranks, _ = _greedy(range(len(lengths)), weight, [fixed] * target.ranks, lengths, target.capacities, speeds)
    return ranks


def _place(lengths: list[int], cost: CostModel, target: Target, speeds: list[float]) -> Assignment:
    """Context-parallel placement: the documents longer than every rank's capacity to cp groups by their share of
    a ring's time on each rank of the group, packed into rings; then the others to single ranks, whose loads start
    from their groups'."""
    cp, weight, fixed = target.cp, _weights(lengths, cost, target), _fixed_cost(lengths, cost, target)
    capacity, longest = target.capacities[::cp], max(target.capacities)
    # A ring document's seconds on each rank of its group: alone in its ring, with its share of the linear work.
    share = [ring_time([s], cost, longest, cp) - cost.c - cost.b * (cp * longest - s) / cp for s in lengths]
    long = [i for i, s in enumerate(lengths) if s > longest]
    slowest = _group_speeds(speeds, cp)
    groups, _ = _greedy(long, share, [fixed] * target.dp, lengths, target.rows().capacities, slowest)
    short = sorted((i for i, s in enumerate(lengths) if s <= longest), key=lambda i: (-lengths[i], i))
    rings = [
        [_arrange(_fill(ring, short, lengths, cost, capacity[g], cp), lengths, capacity[g], cp)
         for ring in _first_fit_decreasing(docs, lengths, cp * capacity[g], None)]
        for g, docs in enumerate(groups)
    ]  # fmt: skip
    ring_load = [sum(ring_time([lengths[i] for i in ring], cost, capacity[g], cp) - cost.c for ring in group)
                 for g, group in enumerate(rings)]  # fmt: skip
    # A rank's share of its group's rings, in its own seconds: the rings run at the group's slowest rank's pace.
    start = [fixed + ring_load[r // cp] * speeds[r] / slowest[r // cp] for r in range(target.ranks)]
    ranks, _ = _greedy(short, weight, start, lengths, target.capacities, speeds)
    return _pack_all(ranks, lengths, cost, target, speeds, balanced=True, rings=rings)


def _arrange(ring: list[int], lengths: list[int], capacity: int, cp: int) -> list[int]:
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
        _add_to_ring(trial, lengths[i], used, capacity)
        if cp * cost.a * (max(trial) - max(shares)) < cost.document(lengths[i]):
            ring, shares, used = [*ring, i], trial, used + lengths[i]
            pool.remove(i)
    return ring


def _weights(lengths: list[int], cost: CostModel, target: Target) -> list[float]:
    """A document's seconds on the rank that runs it: a·s² (+ b·s unpadded; padded, the capacity's is fixed)."""
    return [cost.a * s * s + (0.0 if target.padded else cost.b * s) for s in lengths]


def _fixed_cost(lengths: list[int], cost: CostModel, target: Target) -> float:
    """What every rank pays whatever it holds: the step's micro-batch constants (and, padded, the linear cost of
    the whole capacity), estimated from the fewest micro-batches that could hold the step."""
    per_micro_batch = cost.c + (cost.b * min(target.capacities) if target.padded else 0.0)
    count = math.ceil(math.ceil(sum(lengths) / sum(target.capacities)) / target.group) * target.group
    return per_micro_batch * (count + (target.pipeline_stages - 1) * count // target.group)


def _greedy(docs, weight, load, lengths, capacities, speeds) -> tuple[list[list[int]], list[float]]:
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


def _pack_all(
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
    slowest = _group_speeds(speeds, cp)
    needed = max(
        before[r] + len(_first_fit_decreasing(docs, lengths, target.capacities[r], None))
        for r, docs in enumerate(ranks)
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
