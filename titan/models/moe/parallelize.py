"""How the MoE family is parallelised. Its blocks and pipeline stages are the decoder's
(titan/models/decoder/parallelize.py), and so is its tensor-parallel plan but for the MoE layers: each tp rank
routes and computes its own share of the sequence, with the router and the routed experts whole on it (or split
over the ep group of the ranks with its tp index), and the shared experts split as a dense feed-forward."""

from __future__ import annotations

import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, PrepareModuleInputOutput, SequenceParallel

from titan.models.decoder import parallelize as decoder
from titan.models.moe.model import MoE, MoETransformer


def tp_plan(
    model: MoETransformer, sequence_parallel: bool, loss_parallel: bool, styles: tuple | None = None
) -> dict[str, nn.Module]:
    """The decoder's plan (attention, the dense layers' feed-forwards, the embedding and the head) with, in each MoE
    layer, the layer on this rank's sequence shard (TokenShards) and its shared experts split as a dense
    feed-forward, on the layer's tokens gathered over tp; and the multi-token prediction's blocks as the layers,
    its projection split by output columns and, under sequence parallelism, its norms on the sequence shards, as
    the blocks' norms."""
    plan = decoder.tp_plan(model, sequence_parallel, loss_parallel, styles)
    blocks = {f"layers.{name}": block for name, block in model.layers.items()}
    between = Shard(1) if sequence_parallel else Replicate()
    for layer, module in model.mtp.items():
        blocks[f"mtp.{layer}.block"] = module.block
        plan.update(decoder.block_plan(f"mtp.{layer}.block", module.block, sequence_parallel, styles))
        if sequence_parallel:
            plan |= {f"mtp.{layer}.{name}": SequenceParallel() for name in ("enorm", "hnorm", "norm")}
        # Split by output columns, as Megatron's and as the blocks' linears: no rank holds the whole 2 dim x dim
        # weight. Its output is the block's input: a local tensor laid out as between the blocks.
        plan[f"mtp.{layer}.eh_proj"] = ColwiseParallel(input_layouts=between, output_layouts=between)
    for name, block in blocks.items():
        if not isinstance(block.feed_forward, MoE):
            continue
        moe = f"{name}.feed_forward"
        plan[moe] = TokenShards(Shard(1) if sequence_parallel else Replicate())
        if block.feed_forward.shared is not None:
            plan.update(decoder.dense_feed_forward_plan(f"{moe}.shared", Shard(1), styles))
    return plan


def blocks(model: MoETransformer) -> list[nn.Module]:
    """The decoder's blocks, then the multi-token prediction's (built as a layer is, held after the stack)."""
    return decoder.blocks(model) + [module.block for module in model.mtp.values()]


def pipeline_stage(model: MoETransformer, layer_ids: list[int], first: bool, last: bool) -> MoETransformer:
    """The decoder's stage; the multi-token prediction's modules, which take the head's input, on the last alone."""
    stage = decoder.pipeline_stage(model, layer_ids, first, last)
    if not last:
        stage.mtp = nn.ModuleDict()
    return stage


class TokenShards(PrepareModuleInputOutput):
    """A MoE layer on its tp rank's share of the sequence (Shard(1): the sequence-parallel shard as it comes, or,
    without sequence parallelism, a slice of the replicated tokens, gathered back after). Its router and routed
    experts see only these tokens, so tp ranks route distinct tokens as data-parallel ranks do: no token is
    computed twice, and each rank's gradients of them are its tokens' share, which the step sums over tp."""

    def __init__(self, between: Placement):
        super().__init__(
            input_layouts=(between,),
            desired_input_layouts=(Shard(1),),
            use_local_input=True,
            output_layouts=(Shard(1),),
            desired_output_layouts=(between,),
        )

    def _apply(self, module: MoE, device_mesh: DeviceMesh) -> nn.Module:
        for whole in (module.router, module.experts):
            whole.tp_gradient_shares = True  # the model contract's mark: the step sums their gradients over tp
        # A sequence tp does not divide (decoding's prompt, or its one new token) is padded to one it does, and cut
        # back after: its shards must be even for the gathers of the shared experts' input and of the output.
        # Training's sequences divide, and are never padded.
        tp, lengths = device_mesh.size(), []

        def pad(_, args):
            lengths.append(args[0].shape[1])
            return (_pad_sequence(args[0], tp), *args[1:])

        module.register_forward_pre_hook(pad)
        super()._apply(module, device_mesh)  # its hooks run between these
        module.register_forward_hook(lambda _, args, out: out[:, : lengths.pop()])
        return module


def _pad_sequence(x, tp: int):
    """x (rows, seq, dim), a plain tensor, with zero tokens after its last to a multiple of tp; a DTensor as it is."""
    if isinstance(x, DTensor) or x.shape[1] % tp == 0:
        return x
    return F.pad(x, (0, 0, 0, -x.shape[1] % tp))
