"""How the MoE family is parallelised. Its blocks, pipeline stages and their tensors are Llama's
(titan/models/llama/parallelize.py); what differs is what the degrees must divide."""

from __future__ import annotations

from titan.models.llama import parallelize as llama
from titan.models.moe.args import MoEArgs


def check_parallelism(args: MoEArgs, tp: int, pp_stages: int, ep: int = 1, cp: int = 1) -> None:
    """Raise ValueError when the degrees cannot split this model."""
    if cp > 1 and args.aux_loss_coef:
        raise ValueError(
            f"parallel.cp = {cp} with the balance loss (model aux_loss_coef {args.aux_loss_coef}) is not supported "
            "yet: it counts each row's tokens per expert on one rank, and context parallelism splits a row's "
            "tokens over the cp group; set model.overrides.aux_loss_coef = 0 (the bias balances alone) or "
            "parallel.cp = 1"
        )
    if args.n_experts % ep:
        raise ValueError(
            f"parallel.ep = {ep} must divide the model's n_experts ({args.n_experts}): each expert-parallel rank "
            "holds as many experts; use a divisor of n_experts"
        )
    if tp > 1:
        raise ValueError(
            f"parallel.tp = {tp} is not supported for the moe family yet (tensor parallelism of the routed "
            "experts is not built); use parallel.tp = 1"
        )
    llama.check_parallelism(args, tp, pp_stages)
