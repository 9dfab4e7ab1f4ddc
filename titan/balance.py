"""Uneven plans for uneven devices: rows of the global batch per data-parallel rank, micro-batches that keep
FSDP's collectives in step, and layers per pipeline stage. Pure functions; the math of a step never depends
on the plan (rows keep their global index, the loss is divided by the global token count)."""

from __future__ import annotations

import functools
import heapq
import math


def data_shares(rows: int, weights: list[float], min_rows: int = 1, max_rows: int | None = None) -> list[int]:
    """Integer rows per rank, summing to `rows`, each from `min_rows` to `max_rows` (default: no cap), that
    minimise the slowest rank's time max(r_i / w_i) (w_i: the rank's speed).

    Rank i's k-th row finishes at k / w_i, and a plan takes as long as its latest row: the optimum holds the
    earliest rows. Every row earlier than the time t at which the continuous shares clamp(t w_i) sum to `rows`
    is among them, so each rank starts with those, and the few left (at most two per rank) go one at a time to
    the rank that would finish soonest with it."""
    n, high = len(weights), rows if max_rows is None else max_rows
    if n * min_rows > rows:
        raise ValueError(f"{rows} rows cannot give {n} ranks at least {min_rows} each")
    if n * high < rows:
        raise ValueError(f"{rows} rows cannot go to {n} ranks at most {high} each")
    t = _fill_time(rows, weights, min_rows, high) * (1 - 1e-9)  # below it, so that rounding never overfills
    shares = [min(high, max(min_rows, math.floor(t * w))) for w in weights]
    heap = [((s + 1) / w, i) for i, (s, w) in enumerate(zip(shares, weights)) if s < high]
    heapq.heapify(heap)
    for _ in range(rows - sum(shares)):
        _, i = heapq.heappop(heap)
        shares[i] += 1
        if shares[i] < high:
            heapq.heappush(heap, ((shares[i] + 1) / weights[i], i))
    return shares


def _fill_time(rows: int, weights: list[float], low: int, high: int) -> float:
    """The time t at which sum(clamp(t w_i, low, high)) = rows: a piecewise-linear sum, whose slope (the
    weights of the ranks between their bounds) changes where a rank leaves `low` or reaches `high`."""
    events = sorted([(low / w, w, 1) for w in weights] + [(high / w, -w, -1) for w in weights])
    filled, slope, between, last = len(weights) * low, 0.0, 0, 0.0
    for t, change, count in events:
        if filled + slope * (t - last) >= rows:
            break
        filled, last, between = filled + slope * (t - last), t, between + count
        slope = slope + change if between else 0.0  # exactly flat where no rank is between its bounds
    return last + (rows - filled) / slope if slope > 0 else last


def share_bounds(count: int, cap: int, pipeline: int = 0) -> tuple[int, int, int]:
    """The shares a rank can run in `count` micro-batches: multiples of `step` rows from `least` to `most`, as
    (step, least, most). The one rule of runnable plans, which the planner (plan_shares) and the trainer
    (micro_batch_sizes) both apply.

    FSDP's all-gathers and reduce-scatters run once per micro-batch on every rank, so every rank runs the same
    number of micro-batches, each of 1 to `cap` rows (training.local_batch_size). A pipeline cuts each
    micro-batch into `pipeline` schedule micro-batches, and its buffers take one shape: a rank's micro-batches
    are then equal, and a multiple of `pipeline` rows."""
    if pipeline:
        return count * pipeline, count * pipeline, count * (cap // pipeline * pipeline)
    return 1, count, count * cap


def runnable_counts(shares: list[int], cap: int, pipeline: int = 0) -> list[int]:
    """The numbers of micro-batches in which every rank can run its share; none: the plan cannot run."""

    def runs_in(count: int) -> bool:
        step, least, most = share_bounds(count, cap, pipeline)
        return all(share % step == 0 and least <= share <= most for share in shares)

    return [count for count in range(1, min(shares) + 1) if runs_in(count)]


def micro_batch_sizes(shares: list[int], cap: int, pipeline: int = 0) -> list[list[int]]:
    """Each rank's rows cut into micro-batches: the fewest that runnable_counts allows (the largest
    micro-batches), so a rank with more rows runs larger ones; a rank's micro-batches differ by at most one row."""
    counts = runnable_counts(shares, cap, pipeline)
    if not counts:
        raise ValueError(f"shares of {shares} rows {_cannot_be_cut(len(shares), cap, pipeline)}")
    count = counts[0]
    return [[share // count + (k < share % count) for k in range(count)] for share in shares]


def plan_shares(rows: int, weights: list[float], cap: int, pipeline: int = 0) -> list[int]:
    """Rows per rank for speeds `weights` that the trainer can run (share_bounds) and that minimise the slowest
    rank's time max(share / weight) among all such plans; of equally fast plans, the one in the fewest
    micro-batches (the largest ones run best). Raises ValueError only when no plan runs, whatever the speeds.

    The speed-optimal shares often cannot run: at one row per micro-batch, shares of 11 and 5 rows need 11
    micro-batches on every rank and the second rank has 5 rows. A plan can then raise every rank's number of
    micro-batches (smaller ones), or move fewer rows than the speeds ask for. Both are choices of the count c,
    and for each count data_shares finds the best plan within share_bounds. Without a pipeline, a larger c lets
    the fast ranks take more rows (c * cap) but makes every rank, the slowest too, take at least c: the best
    time for c is T(c) = max(c / w_min, U(c)), U(c) being the best time under the upper bounds alone. U never
    rises with c and c / w_min does, so T falls and then rises: a binary search on where it starts to rise
    finds the best count, and another the fewest micro-batches as fast. Under a pipeline, shares are multiples
    of c * pipeline rows, so c divides rows / pipeline, and those few counts are tried one by one."""
    n = len(weights)

    @functools.cache
    def best(count: int) -> tuple[float, list[int]] | None:
        """The best shares in `count` micro-batches per rank and their time; None if no shares run in them."""
        step, least, most = share_bounds(count, cap, pipeline)
        if rows % step or not n * least <= rows <= n * most:
            return None
        shares = [step * k for k in data_shares(rows // step, weights, least // step, most // step)]
        return max(s / w for s, w in zip(shares, weights)), shares

    def slower(a: int, b: int) -> bool:
        """Count a's plan is slower than count b's, beyond rounding."""
        return best(a)[0] * (1 - 1e-12) > best(b)[0]

    if pipeline:
        counts = [c for c in range(1, rows // (n * pipeline) + 1) if best(c)]
        if not counts:
            raise ValueError(f"{rows} rows {_cannot_be_cut(n, cap, pipeline)}")
        fastest = min(counts, key=lambda c: best(c)[0])
        return best(next(c for c in counts if not slower(c, fastest)))[1]
    if rows < n:
        raise ValueError(f"{rows} rows cannot give {n} ranks at least 1 each")
    fewest, most = math.ceil(rows / (n * cap)), rows // n  # every count between has runnable plans
    if fewest > most:
        raise ValueError(f"{rows} rows {_cannot_be_cut(n, cap, pipeline)}")
    low, high = fewest, most
    while low < high:  # the first count from which T rises
        mid = (low + high) // 2
        if slower(mid + 1, mid):
            high = mid
        else:
            low = mid + 1
    fastest, high, low = low, low, fewest
    while low < high:  # the fewest micro-batches as fast: T does not rise up to the best count
        mid = (low + high) // 2
        if slower(mid, fastest):
            low = mid + 1
        else:
            high = mid
    return best(low)[1]


def _cannot_be_cut(ranks: int, cap: int, pipeline: int) -> str:
    each = f"of at most {cap} row{'s' if cap > 1 else ''}"
    if pipeline:
        each = f"a multiple of {pipeline} rows (the pipeline's micro-batches) and at most {cap}"
    return f"cannot be cut into the same number of micro-batches on every data-parallel rank ({ranks}), each {each}"


def layer_split(
    layer_costs: list[float], speeds: list[float], layer_memory: list[float] | None = None,
    memory_caps: list[float] | None = None, min_layers: int = 1,
) -> list[int]:  # fmt: skip
    """Layers per pipeline stage (contiguous, in order) minimising the slowest stage's time
    sum(costs of its layers) / its speed, with each stage's layers' memory within its cap.

    Threshold search: for a time limit T, filling each stage in turn with as many layers as fit (in time and
    memory, leaving `min_layers` for each later stage) succeeds if any split does, since a longer prefix
    leaves a shorter suffix. The optimal T is one stage's time for some contiguous run of layers, so a binary
    search over those candidates finds it exactly."""
    n, stages = len(layer_costs), len(speeds)
    memory = layer_memory or [0.0] * n
    caps = memory_caps or [math.inf] * stages
    prefix_cost, prefix_memory = [0.0], [0.0]
    for cost, mem in zip(layer_costs, memory):
        prefix_cost.append(prefix_cost[-1] + cost)
        prefix_memory.append(prefix_memory[-1] + mem)

    def fill(limit: float) -> list[int] | None:
        counts, start = [], 0
        for s in range(stages):
            last = n - min_layers * (stages - 1 - s)  # leave enough layers for the later stages
            stop = start + min_layers
            if stop > last or not fits(s, start, stop, limit):
                return None
            while stop < last and fits(s, start, stop + 1, limit):
                stop += 1
            counts.append(stop - start)
            start = stop
        return counts if start == n else None

    def fits(stage: int, start: int, stop: int, limit: float) -> bool:
        time = (prefix_cost[stop] - prefix_cost[start]) / speeds[stage]
        return time <= limit * (1 + 1e-12) and prefix_memory[stop] - prefix_memory[start] <= caps[stage]

    candidates = sorted(
        {(prefix_cost[j] - prefix_cost[i]) / speed for speed in speeds for i in range(n) for j in range(i + 1, n + 1)}
    )
    if fill(candidates[-1]) is None:
        raise ValueError("no split of the layers fits the stages' memory caps")
    lo, hi = 0, len(candidates) - 1  # fill(candidates[hi]) succeeds
    while lo < hi:
        mid = (lo + hi) // 2
        if fill(candidates[mid]) is None:
            lo = mid + 1
        else:
            hi = mid
    return fill(candidates[lo])
