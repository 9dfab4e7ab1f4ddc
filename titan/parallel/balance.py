"""Uneven plans for uneven devices: rows of the global batch per data-parallel rank, micro-batches that keep
FSDP's collectives in step, and layers per pipeline stage. Pure functions; the math of a step never depends
on the plan (rows keep their global index, the loss is divided by the global token count)."""

from __future__ import annotations

import heapq
import math


def data_shares(rows: int, weights: list[float], min_rows: int = 1) -> list[int]:
    """Integer rows per rank, summing to `rows`, that minimise the slowest rank's time max(r_i / w_i) (w_i:
    the rank's speed), each at least `min_rows`. Handing out rows one at a time to the rank that would finish
    soonest with it is optimal for this min-max problem (every row costs its rank the same time)."""
    if len(weights) * min_rows > rows:
        raise ValueError(f"{rows} rows cannot give {len(weights)} ranks at least {min_rows} each")
    shares = [min_rows] * len(weights)
    heap = [((min_rows + 1) / w, i) for i, w in enumerate(weights)]
    heapq.heapify(heap)
    for _ in range(rows - min_rows * len(weights)):
        _, i = heapq.heappop(heap)
        shares[i] += 1
        heapq.heappush(heap, ((shares[i] + 1) / weights[i], i))
    return shares


def micro_batch_sizes(shares: list[int], cap: int) -> list[list[int]]:
    """Each rank's rows cut into micro-batches of at most `cap` rows, the same number on every rank.

    FSDP's all-gathers and reduce-scatters run once per micro-batch on every rank, so every rank must run the
    same number of micro-batches; ranks with more rows run larger ones. The count is what the largest share
    needs under the cap; each rank's micro-batches differ by at most one row."""
    count = max(math.ceil(share / cap) for share in shares)
    if min(shares) < count:
        raise ValueError(
            f"every rank runs {count} micro-batches (its largest share, {max(shares)} rows, at most {cap} at a "
            f"time), but one rank has only {min(shares)} rows"
        )
    return [[share // count + (k < share % count) for k in range(count)] for share in shares]


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
