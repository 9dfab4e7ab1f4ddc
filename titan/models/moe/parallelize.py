"""How the MoE family is parallelised. Its blocks, pipeline stages and their tensors are Llama's
(titan/models/llama/parallelize.py); what differs is what the degrees must divide."""

from __future__ import annotations

from titan.models.llama import parallelize as llama
from titan.models.moe.args import MoEArgs


def check_parallelism(args: MoEArgs, tp: int, pp_stages: int) -> None:
    """Raise ValueError when the degrees cannot split this model."""
    if tp > 1:
        raise ValueError(
            f"parallel.tp = {tp} is not supported for the moe family yet (tensor parallelism of the routed "
            "experts is not built); use parallel.tp = 1"
        )
    llama.check_parallelism(args, tp, pp_stages)
