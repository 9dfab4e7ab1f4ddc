"""The cost model of packing: a document's, a micro-batch's, a ring's and a rank's predicted seconds, and what the
micro-batches run on (Target) and where the documents went (Assignment)."""

from __future__ import annotations

from dataclasses import dataclass


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
        add_to_ring(shares, s, start, capacity)
        start += s
    return shares


def add_to_ring(shares: list[float], s: int, start: int, capacity: int) -> None:
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


def group_speeds(speeds: list[float], cp: int) -> list[float]:
    """Each cp group's speed for its rings: its slowest rank's."""
    return [min(speeds[g : g + cp]) for g in range(0, len(speeds), cp)]
