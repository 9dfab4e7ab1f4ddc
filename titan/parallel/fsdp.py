"""FSDP2 (`fully_shard`) per block and at the root; HSDP when the mesh has a replicate dim."""

from __future__ import annotations

import warnings
from functools import partial

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from torch.distributed.tensor import DTensor, Shard

from titan.parallel.ep import expert_modules


def apply_fsdp(
    model: nn.Module,
    blocks: list[nn.Module],
    dp_mesh: DeviceMesh,
    param_dtype: torch.dtype | None,
    reshard_after_forward: bool,
    cpu_offload: bool,
    expert_mesh: DeviceMesh | None = None,
) -> None:
    """expert_mesh: under expert parallelism, the ranks that hold the same experts, over which FSDP shards them."""
    # Gradients are reduced in fp32 whatever the compute dtype: bf16 sums lose the small updates.
    policy = dict(
        mesh=dp_mesh,
        mp_policy=MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32),
        offload_policy=CPUOffloadPolicy() if cpu_offload else OffloadPolicy(),
    )
    # A block's hidden states arrive in the compute dtype already. Not casting its other inputs keeps the rope table
    # in fp32, as autocast does on one device, and keeps FSDP's cast out of the block: its pre-forward hook runs
    # before checkpointing's in forward but inside the recomputation, which selective checkpointing refuses.
    block_policy = {**policy, "mp_policy": MixedPrecisionPolicy(param_dtype, torch.float32, cast_forward_inputs=False)}
    if expert_mesh is not None:
        # torch warns on every forward that the experts' unit returns a view, which an in-place op would cut off
        # from its backward hook; the MoE layer only reads it (index_copy_ into a new tensor).
        warnings.filterwarnings("ignore", r"FSDP2-wrapped module \(FSDPGroupedExperts\) returned a view", UserWarning)
    for i, block in enumerate(blocks):
        # The last block's parameters are the first needed by backward: resharding them would be wasted work.
        reshard = reshard_after_forward and i < len(blocks) - 1
        for experts in expert_modules(block) if expert_mesh is not None else ():
            # Their own FSDP unit, before the block's: the block's mesh would shard them across experts' ranks.
            fully_shard(
                experts,
                reshard_after_forward=reshard,
                shard_placement_fn=partial(expert_placement, ranks=expert_mesh.size()),
                **{**block_policy, "mesh": expert_mesh},
            )
        fully_shard(block, reshard_after_forward=reshard, **block_policy)
    fully_shard(model, reshard_after_forward=reshard_after_forward, **policy)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            # titan's loss is already divided by the global token count: gradients are summed, not averaged.
            module.set_gradient_divide_factor(1.0)
            # Plain SUM collectives: gloo has no PREMUL_SUM, and NCCL copies less with SUM.
            module.set_force_sum_reduction_for_comms(True)


def expert_placement(param: nn.Parameter, ranks: int) -> Shard:
    """How FSDP shards an expert weight (expert, out, in) over the `ranks` holding the same experts: by expert where
    they divide this rank's experts, else by output row. By expert, one expert over 16 ranks (8 experts, ep 8 on
    128 ranks) would leave every rank a padded whole expert."""
    local = param.to_local() if isinstance(param, DTensor) else param
    return Shard(0) if local.shape[0] % ranks == 0 else Shard(1)
