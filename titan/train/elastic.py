"""Elastic restarts: torchrun's agent (`--nnodes MIN:MAX --max-restarts N`) restarts every worker when one fails,
on the world it then has; titan's workers find they are restarted and continue the run from its newest state,
on a new run plan for that world (the same global batch and data order; docs/fault-tolerance.md)."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist


def restart_count(group) -> int:
    """torchrun's count of this job's worker restarts, the highest of any rank's: a node taken in at a restart
    starts counting at 0, and must resume as the others do. 0 outside torchrun and at the first start."""
    mine = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    if group is None:
        return mine
    count = torch.tensor([mine])
    dist.all_reduce(count, op=dist.ReduceOp.MAX, group=group)
    return int(count)
