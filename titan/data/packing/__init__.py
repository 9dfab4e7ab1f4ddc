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

cost.py holds the cost model, dispatch.py stage 1, micro_batches.py stage 2, rings.py the placement with context
parallelism, and balancers.py the two entry points.
"""

from titan.data.packing.balancers import balance_by_cost, balance_by_tokens
from titan.data.packing.cost import (
    Assignment,
    CostModel,
    Target,
    micro_batch_time,
    rank_time,
    ring_attention,
    ring_time,
)

__all__ = [
    "Assignment",
    "CostModel",
    "Target",
    "balance_by_cost",
    "balance_by_tokens",
    "micro_batch_time",
    "rank_time",
    "ring_attention",
    "ring_time",
]
