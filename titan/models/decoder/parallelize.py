"""How the decoder is parallelised: its tensor-parallel plan (of the attention, the dense feed-forwards, the
embedding and the head), its blocks, and how it splits into pipeline stages (with the tensors the stages exchange,
and a block's own inputs for titan plan). A family adds the plan of its own feed-forwards.

titan's generic appliers (titan/parallel/) read these; the model itself stays plain PyTorch.
"""

from __future__ import annotations

import copy
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Placement, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    PrepareModuleInputOutput,
    RowwiseParallel,
    SequenceParallel,
)

from titan.models.contract import StageBatch, StageIO
from titan.models.decoder.args import DecoderArgs
from titan.models.decoder.latent_attention import LatentAttention
from titan.models.decoder.model import Decoder, FeedForward, TransformerBlock
from titan.models.decoder.rope import rope_table


def tp_plan(
    model: Decoder, sequence_parallel: bool, loss_parallel: bool, styles: tuple | None = None
) -> dict[str, nn.Module]:
    """Megatron-style plan: q/k/v (latent attention's wq or wq_b, and wkv_b) and w1/w3 split by output columns, wo
    and w2 by input rows, so each sub-layer (attention, feed-forward) moves its activations once each way: one
    all-reduce forward and one backward, or, with sequence parallel, an all-gather and a reduce-scatter forward and
    their mirror backward.
    With sequence parallel, norms and residuals run on sequence shards (Shard(1)) between the regions.
    styles: (colwise, rowwise, prepare_module_input) classes for the blocks' linears and their inputs, e.g.
    torchao's float8 styles; None: torch's own. The embedding and the output head always use torch's."""
    between = Shard(1) if sequence_parallel else Replicate()
    plan: dict[str, nn.Module] = {}
    if model.tok_embeddings is not None:
        plan["tok_embeddings"] = VocabParallelEmbedding(output_layout=between)
    if model.norm is not None:
        if sequence_parallel:
            plan["norm"] = SequenceParallel()
        plan["output"] = ColwiseParallel(
            input_layouts=between,
            output_layouts=Shard(-1) if loss_parallel else Replicate(),
            use_local_output=not loss_parallel,  # loss parallel computes cross-entropy on the DTensor shards
        )
    for name, block in model.layers.items():
        plan.update(block_plan(f"layers.{name}", block, sequence_parallel, styles))
    return plan


def block_plan(name: str, block: TransformerBlock, sequence_parallel: bool, styles: tuple | None = None) -> dict:
    """The plan of block `name`: its attention, and its feed-forward where that is a FeedForward."""
    prepare_input = styles[2] if styles else PrepareModuleInput
    between = Shard(1) if sequence_parallel else Replicate()
    plan: dict[str, nn.Module] = {}
    if sequence_parallel:
        plan[f"{name}.attention_norm"] = SequenceParallel()
        plan[f"{name}.ffn_norm"] = SequenceParallel()
    # The sub-layer's input stays a DTensor (use_local_output=False): the column-parallel linears that read it
    # then add their Partial input gradients, and the one redistribution back to `between` reduces them once
    # (a plain tensor would make each linear all-reduce its own). Rope, attention per document and dropout
    # still see plain local tensors: the column-parallel linears hand back their local head shards.
    plan[f"{name}.attention"] = prepare_input(
        input_layouts=(between, None, None, None),
        desired_input_layouts=(Replicate(), None, None, None),
        use_local_output=False,
    )
    # Dropout draws its mask by global position, so it must see how its local tensor is sharded:
    # attention probabilities by head (dim 1), residual branches by sequence (dim 1) under SP.
    plan[f"{name}.attention.dropout"] = _sharded_input(Shard(1))
    if sequence_parallel:
        plan[f"{name}.attention_dropout"] = _sharded_input(Shard(1))
        plan[f"{name}.ffn_dropout"] = _sharded_input(Shard(1))
    plan.update(attention_plan(f"{name}.attention", block.attention, between, styles))
    if isinstance(block.feed_forward, FeedForward):  # a family plans its other feed-forwards
        plan.update(dense_feed_forward_plan(f"{name}.feed_forward", between, styles))
    return plan


def attention_plan(name: str, attention: nn.Module, between: Placement, styles: tuple | None = None) -> dict:
    """An attention's heads split over tp: the linears into heads by output columns, wo by input rows back to
    `between`. The modules whole on every rank are marked: a q or k norm applies to the rank's heads (HeadShares),
    latent attention's latent projections and norms compute the latent all heads share (LatentShares)."""
    colwise, rowwise, _ = styles or (ColwiseParallel, RowwiseParallel, PrepareModuleInput)
    whole: dict[str, ParallelStyle] = {}
    if isinstance(attention, LatentAttention):
        into_heads = ["wkv_b", "wq" if attention.wq is not None else "wq_b"]
        whole |= {"wkv_a": LatentShares(), "kv_norm": LatentShares(to_heads=True)}
        if attention.wq is None:
            whole |= {"wq_a": LatentShares(), "q_a_norm": LatentShares(to_heads=True)}
    else:
        into_heads = ["wq", "wk", "wv"]
        if attention.q_norm is not None:
            whole |= {"q_norm": HeadShares(), "k_norm": HeadShares()}
    plan = {f"{name}.{linear}": colwise() for linear in into_heads}
    plan |= {f"{name}.{module}": style for module, style in whole.items()}
    plan[f"{name}.wo"] = rowwise(output_layouts=between)
    return plan


def dense_feed_forward_plan(name: str, between: Placement, styles: tuple | None = None) -> dict[str, nn.Module]:
    """A FeedForward's: its input gathered from `between` (kept a DTensor, as the attention's), w1 and w3 split by
    output columns, w2 by input rows back to `between`."""
    colwise, rowwise, prepare_input = styles or (ColwiseParallel, RowwiseParallel, PrepareModuleInput)
    return {
        name: prepare_input(input_layouts=(between,), desired_input_layouts=(Replicate(),), use_local_output=False),
        f"{name}.w1": colwise(),
        f"{name}.w3": colwise(),
        f"{name}.w2": rowwise(output_layouts=between),
    }


class VocabParallelEmbedding(ParallelStyle):
    """Megatron's vocabulary-parallel embedding: each TP rank holds a slice of the vocabulary's rows (Shard(0)), looks
    up the tokens that fall in it (zeros for the others), and the slices' sum goes to `output_layout` (a
    reduce-scatter to sequence shards, or an all-reduce). torch's RowwiseParallel runs the lookup on DTensors, whose
    embedding backward in torch 2.13 returns a Replicate gradient: the whole vocabulary x dim matrix on every rank
    (7.8 GiB in fp32 on a 405B rank). Here autograd sees the local slice only, so its gradient is the slice."""

    def __init__(self, output_layout: Placement):
        super().__init__()
        self.output_layout = output_layout

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        module.weight = nn.Parameter(distribute_tensor(module.weight, device_mesh, [Shard(0)]))
        module.forward = partial(_vocab_slice_lookup, module, device_mesh, self.output_layout)
        return module


def _vocab_slice_lookup(module: nn.Embedding, mesh: DeviceMesh, output_layout: Placement, ids: torch.Tensor):
    rows = module.weight.to_local()  # a Shard(0) DTensor gradient comes back through to_local, without communication
    start = mesh.get_local_rank() * rows.shape[0]
    outside = (ids < start) | (ids >= start + rows.shape[0])
    looked_up = F.embedding((ids - start).masked_fill(outside, 0), rows).masked_fill(outside.unsqueeze(-1), 0)
    summed = DTensor.from_local(looked_up, mesh, [Partial()], run_check=False)
    return summed.redistribute(mesh, [output_layout]).to_local()


class HeadShares(ParallelStyle):
    """A module applied to each of its tp rank's heads with its parameters whole (a q or k norm): its gradients on a
    rank are its heads' share, marked for the step to sum over tp (the model contract's `tp_gradient_shares`)."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        module.tp_gradient_shares = True
        return module


class LatentShares(ParallelStyle):
    """A latent projection or norm of latent attention (wq_a, q_a_norm, wkv_a, kv_norm), whole on every tp rank,
    where it computes the same latent from the attention's whole input; only the rank's heads read it (wq_b and wkv_b
    are split by them), so its gradients on a rank are those heads' share, marked for the step to sum over tp. The
    gradient it sends back is such a share too: it reads the attention's input (a Replicate DTensor) as a local tensor
    whose gradient is Partial, summed with the other linears' where that input is reduced once. `to_heads`: its output
    goes to a column-parallel linear as a Replicate DTensor whose gradient stays this rank's Partial share (the
    linear's own conversion of a plain tensor would all-reduce it there)."""

    def __init__(self, to_heads: bool = False):
        super().__init__()
        self.to_heads = to_heads

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        module.tp_gradient_shares = True
        module.register_forward_pre_hook(_local_shares)
        if self.to_heads:
            module.register_forward_hook(partial(_replicated_shares, device_mesh))
        return module


def _local_shares(module: nn.Module, args: tuple) -> tuple:
    return tuple(a.to_local(grad_placements=[Partial()]) if isinstance(a, DTensor) else a for a in args)


def _replicated_shares(mesh: DeviceMesh, module: nn.Module, args: tuple, output: torch.Tensor) -> DTensor:
    return DTensor.from_local(output, mesh, [Replicate()], run_check=False, grad_placements=[Partial()])


def _sharded_input(placement) -> PrepareModuleInputOutput:
    """Hand the module its local input as a DTensor with this placement, and take back a local tensor."""
    return PrepareModuleInputOutput(
        input_layouts=(placement, None),
        desired_input_layouts=(placement, None),
        use_local_input=False,
        output_layouts=(placement,),
        desired_output_layouts=(placement,),
        use_local_output=True,
    )


def blocks(model: Decoder) -> list[nn.Module]:
    """The units that activation checkpointing, compile and FSDP wrap one by one."""
    return list(model.layers.values())


def pipeline_stage(model: Decoder, layer_ids: list[int], first: bool, last: bool) -> Decoder:
    """A copy of the (meta) model holding only `layer_ids`; names stay those of the full model, so
    initialisation and checkpoints see the same parameter names on every layout."""
    stage = copy.deepcopy(model)
    for name in list(stage.layers):
        if int(name) not in layer_ids:
            del stage.layers[name]
    if not first:
        stage.tok_embeddings = None
    if not last:
        stage.norm = None
        stage.output = None
    return stage


def pipeline_io(args: DecoderArgs, batch: StageBatch) -> StageIO:
    """Meta tensors of one stage's inputs and outputs for a micro-batch, as forward takes and returns them. Stages
    pass hidden states (sequence-sharded under sequence parallel) with the rows and, with document masking, the
    document ids."""
    meta = dict(device="meta")
    seq = batch.seq_len // batch.context_shards  # the positions this rank computes
    ids = torch.empty(batch.rows, batch.seq_len, dtype=torch.long, **meta)  # document ids: whole rows
    tokens = torch.empty(batch.rows, seq, dtype=torch.long, **meta)
    states = torch.empty(batch.rows, seq // batch.seq_shards, args.stage_width, dtype=batch.dtype, **meta)
    states.requires_grad_()
    passed = (torch.empty(batch.rows, dtype=torch.long, **meta),) + ((ids,) if batch.documents else ())
    inputs = ((tokens,) if batch.first else (states,)) + passed
    if batch.last:
        return StageIO(inputs, (torch.empty(batch.rows, seq, args.vocab_size, **meta),))
    return StageIO(inputs, (states,) + passed)


def block_inputs(args: DecoderArgs, rows: int, seq_len: int, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    """A block's positional inputs, one causal sequence per row: hidden states, the RoPE table's first seq_len
    positions and the rows."""
    x = torch.empty(rows, seq_len, args.dim, dtype=dtype, requires_grad=True)
    return x, rope_table(args)[:seq_len].unsqueeze(0), torch.arange(rows)
