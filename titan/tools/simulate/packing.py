"""Cost-balanced against token-balanced packing at scales this machine cannot reach (`titan simulate packing`).

Each step draws documents with long-tailed lengths (lognormal, clipped) up to a token budget, and both
balancers of titan/data/packing/ place them on the data-parallel replicas; a step takes as long as the
slowest replica's predicted time. The cost model comes from a model flavor's FLOPs at a fixed rate: b from
the weight matmuls per token (6 x weights), a from causal attention (6 x layers x dim per pair of tokens), c
a fixed cost per micro-batch. Under a pipeline each micro-batch is padded to its capacity and one replica's
cost is one stage's share of the layers.

With context parallelism (cp > 1, simulate_cp) the replicas are the ranks of the dp x cp plane, a capacity is one
rank's share of a row, and documents reach cp x capacity tokens. The ring's cost per token and hop, r, is the
bytes a hop carries (titan.train.cost_fit.ring_bytes_per_token) over the link's bandwidth.
"""

from __future__ import annotations

import dataclasses
import math
import random
import statistics
import time
from dataclasses import dataclass

from titan.data.packing import CostModel, Target, balance_by_cost, balance_by_tokens
from titan.models import get_model_spec
from titan.train.cost_fit import ring_bytes_per_token


@dataclass
class PackingScenario:
    replicas: int = 64  # ranks that place documents: the dp x cp plane
    pp: int = 1
    flavor: str = "8B"
    model: str = "llama3"
    flops_per_s: float = 4e14  # sustained per device (an H100 at about 40% of its bf16 peak)
    micro_batch_s: float = 0.005  # fixed cost per micro-batch (launches, FSDP's collectives)
    capacity: int = 32768  # tokens per micro-batch
    micro_batches: int = 2  # per replica and step at full capacity (the pipeline's schedule length when pp > 1)
    fill: float = 0.9  # the step's token budget as a share of all micro-batches' capacity
    median_len: int = 1024
    sigma: float = 1.0  # of log length
    max_len: int = 32768
    steps: int = 20
    seed: int = 0
    cp: int = 1
    link_bytes_per_s: float = 3e11  # a cp group's ring link: about 2/3 of an H100's NVLink (450 GB/s a direction)

    def cost_model(self) -> CostModel:
        spec = get_model_spec(self.model)
        args = spec.flavors[self.flavor]
        per_token = spec.flops_per_token(args, 0)
        per_pair = (spec.flops_per_token(args, 1) - per_token) / 2  # causal: half the pairs
        share = 1 / self.pp  # one stage's layers
        ring = ring_bytes_per_token(spec.kv_width(args), args.n_layers, 2) * share / self.link_bytes_per_s  # bf16
        return CostModel(
            per_pair * share / self.flops_per_s, per_token * share / self.flops_per_s, self.micro_batch_s, ring
        )

    def target(self) -> Target:
        group = self.micro_batches if self.pp > 1 else 1
        return Target((self.capacity,) * self.replicas, self.pp, group, padded=self.pp > 1, cp=self.cp)


def documents(s: PackingScenario, rng: random.Random) -> list[int]:
    """One step's document lengths: drawn until the next would pass the budget."""
    budget = int(s.fill * s.replicas * s.micro_batches * s.capacity)
    lengths, total = [], 0
    while True:
        length = max(2, min(s.max_len, round(rng.lognormvariate(math.log(s.median_len), s.sigma))))
        if total + length > budget:
            return lengths
        lengths.append(length)
        total += length


def lower_bound(lengths: list[int], cost: CostModel, target: Target) -> float:
    """No placement of these documents on equal ranks predicts a faster step: every rank runs at least the
    micro-batches that the step's tokens need, each paying its constant (and, padded, the capacity's linear
    cost) plus, in a pipeline, (stages - 1) slowest micro-batches per schedule run; the slowest rank takes at
    least the mean, and at least what the rank holding the most expensive document takes. With context
    parallelism a document is split over at most the ranks whose chunks of a ring's row it can cover (at most cp:
    its busiest rank takes at least that share of its attention), and a ring's rank does the linear work of a
    whole capacity (ring_time), at least the document's or a capacity's."""
    capacity, stages, cp = target.capacities[0], target.pipeline_stages, target.cp
    count = math.ceil(math.ceil(sum(lengths) / (capacity * target.ranks)) / target.group) * target.group
    per_micro_batch = cost.c + (cost.b * capacity if target.padded else 0.0)
    base = per_micro_batch * (count + (stages - 1) * count // target.group)
    work = [cost.a * n * n + (0.0 if target.padded else cost.b * n) for n in lengths]
    spread = [1 if cp == 1 else min(cp, (n - 1) // (capacity // 2) + 2) for n in lengths]
    least = [
        cost.a * n * n / m + (0.0 if target.padded else cost.b * min(n, capacity)) for n, m in zip(lengths, spread)
    ]
    return max(base + sum(work) / target.ranks, base + stages * max(least))


def simulate(s: PackingScenario) -> dict[str, float]:
    """Mean predicted step time of each balancer, their ratio, the lower bound, and the median time the cost
    balancer takes to assign a step."""
    rng, cost, target = random.Random(s.seed), s.cost_model(), s.target()
    times: dict[str, list[float]] = {"tokens": [], "cost": [], "bound": []}
    assign_s, imbalance = [], {"tokens": [], "cost": []}
    for _ in range(s.steps):
        lengths = documents(s, rng)
        times["bound"].append(lower_bound(lengths, cost, target))
        for name, balance in (("tokens", balance_by_tokens), ("cost", balance_by_cost)):
            start = time.perf_counter()
            assignment = balance(lengths, cost, target)
            if name == "cost":
                assign_s.append(time.perf_counter() - start)
            times[name].append(assignment.step_time)
            imbalance[name].append(assignment.imbalance)
    return {
        "tokens_step_s": statistics.mean(times["tokens"]),
        "cost_step_s": statistics.mean(times["cost"]),
        "speedup": statistics.mean(times["tokens"]) / statistics.mean(times["cost"]),
        "bound_step_s": statistics.mean(times["bound"]),
        "tokens_imbalance": statistics.mean(imbalance["tokens"]),
        "cost_imbalance": statistics.mean(imbalance["cost"]),
        "plan_ms": 1e3 * statistics.median(assign_s),  # named as the trainer's metric of the same time
    }


CP_POLICIES = {
    "tokens": "token-balanced, static CP (every micro-batch a ring)",
    "cost": "cost-balanced, static CP",
    "placed": "cost-balanced with CP placement",
    "cut": "cost-balanced, documents cut at one rank's capacity (no CP; other math)",
}


def simulate_cp(s: PackingScenario) -> dict[str, dict[str, float]]:
    """The same documents each step under each of CP_POLICIES: mean predicted step time, its ratio to the lower
    bound (of the documents uncut), imbalance, and the median time each takes to assign a step; and the bound."""
    rng, cost, target = random.Random(s.seed), s.cost_model(), s.target()
    local = dataclasses.replace(target, cp=1)
    policies = {
        "tokens": lambda lengths: balance_by_tokens(lengths, cost, target),
        "cost": lambda lengths: balance_by_cost(lengths, cost, target, place=False),
        "placed": lambda lengths: balance_by_cost(lengths, cost, target),
        "cut": lambda lengths: balance_by_cost(cut(lengths, s.capacity), cost, local),
    }
    runs: dict[str, dict[str, list[float]]] = {name: {"step": [], "imbalance": [], "ms": []} for name in policies}
    bounds = []
    for _ in range(s.steps):
        lengths = documents(s, rng)
        bounds.append(lower_bound(lengths, cost, target))
        for name, balance in policies.items():
            start = time.perf_counter()
            assignment = balance(lengths)
            runs[name]["ms"].append(1e3 * (time.perf_counter() - start))
            runs[name]["step"].append(assignment.step_time)
            runs[name]["imbalance"].append(assignment.imbalance)
    bound = statistics.mean(bounds)
    results = {
        name: {
            "step_s": statistics.mean(run["step"]),
            "over_bound": statistics.mean(run["step"]) / bound,
            "imbalance": statistics.mean(run["imbalance"]),
            "plan_ms": statistics.median(run["ms"]),
        }
        for name, run in runs.items()
    }
    results["bound"] = {"step_s": bound}
    return results


def cut(lengths: list[int], capacity: int) -> list[int]:
    """The documents cut into pieces of at most `capacity` tokens."""
    return [min(capacity, s - start) for s in lengths for start in range(0, s, capacity)]
