"""Cost-balanced against token-balanced packing at scales this machine cannot reach (`titan simulate packing`).

Each step draws documents with long-tailed lengths (lognormal, clipped) up to a token budget, and both
balancers of titan/data/packing.py place them on the data-parallel replicas; a step takes as long as the
slowest replica's predicted time. The cost model comes from a model flavor's FLOPs at a fixed rate: b from
the weight matmuls per token (6 x weights), a from causal attention (6 x layers x dim per pair of tokens), c
a fixed cost per micro-batch. Under a pipeline each micro-batch is padded to its capacity and one replica's
cost is one stage's share of the layers.
"""

from __future__ import annotations

import math
import random
import statistics
import time
from dataclasses import dataclass

from titan.data.packing import CostModel, Target, balance_by_cost, balance_by_tokens
from titan.models import get_model_spec


@dataclass
class PackingScenario:
    replicas: int = 64
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

    def cost_model(self) -> CostModel:
        spec = get_model_spec(self.model)
        args = spec.flavors[self.flavor]
        per_token = spec.flops_per_token(args, 0)
        per_pair = (spec.flops_per_token(args, 1) - per_token) / 2  # causal: half the pairs
        share = 1 / self.pp  # one stage's layers
        return CostModel(per_pair * share / self.flops_per_s, per_token * share / self.flops_per_s, self.micro_batch_s)

    def target(self) -> Target:
        group = self.micro_batches if self.pp > 1 else 1
        return Target((self.capacity,) * self.replicas, self.pp, group, padded=self.pp > 1)


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
    least the mean, and at least what the rank holding the most expensive document takes."""
    capacity, stages = target.capacities[0], target.pipeline_stages
    count = math.ceil(math.ceil(sum(lengths) / (capacity * target.ranks)) / target.group) * target.group
    per_micro_batch = cost.c + (cost.b * capacity if target.padded else 0.0)
    base = per_micro_batch * (count + (stages - 1) * count // target.group)
    work = [cost.a * n * n + (0.0 if target.padded else cost.b * n) for n in lengths]
    return max(base + sum(work) / target.ranks, base + stages * max(work))


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
