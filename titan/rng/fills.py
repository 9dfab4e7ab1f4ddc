"""What titan draws: in-place weight fills and dropout, identical on every parallel layout.

A fill gives each element of a parameter the value the unsharded tensor has at that element's global index
(Philox counter 0), so a shard filled on any rank of any mesh is bitwise the slice one process would produce.
Dropout keys its mask by the module's name, the optimizer step (the counter) and the element's index in the
step's global batch.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import Tensor

from titan.rng import native
from titan.rng.philox import _for_chunks, _use_native, generate_into, keep_mask_into
from titan.rng.shards import ShardIndex


def _fill(tensor: Tensor, kind: str, seed: int, stream: str, params: dict) -> Tensor:
    """Fill a plain tensor (the whole tensor) or a DTensor (its local shard) in place; meta tensors are left alone.

    Values follow the logical row-major position, so a non-contiguous tensor gets what a contiguous one would.
    """
    from torch.distributed.tensor import DTensor

    if isinstance(tensor, DTensor):
        mesh, placements = tensor.device_mesh, tuple(tensor.placements)
        coord = mesh.get_coordinate()
        if coord is None:  # a rank outside the mesh holds nothing
            return tensor
        # Writing the value on every rank would multiply a Partial("sum") tensor; parameters are never Partial.
        if any(p.is_partial() for p in placements):
            raise ValueError(f"cannot fill a DTensor with Partial placements {placements}")
        local, layout = tensor._local_tensor, (mesh.shape, coord, placements)  # to_local() would record autograd
    else:
        local, layout = tensor, ((), (), ())
    if not local.is_floating_point():
        raise TypeError(f"can only fill floating-point tensors, got {local.dtype}")
    if local.is_meta:
        return tensor
    index = ShardIndex(tensor.shape, *layout, device=local.device)
    if tuple(local.shape) != index.local_shape:  # the index maths split differently from DTensor: never write
        raise ValueError(f"local tensor of shape {tuple(local.shape)}, but layout {layout} gives {index.local_shape}")
    local = local.detach()  # same storage; autograd stays out of it
    if local.is_contiguous():
        generate_into(local.view(-1), index.runs, seed, stream, 0, kind, params)
    else:
        buf = torch.empty(local.shape, dtype=local.dtype, device=local.device)
        generate_into(buf.view(-1), index.runs, seed, stream, 0, kind, params)
        local.copy_(buf)
    return tensor


def normal_(tensor: Tensor, mean: float = 0.0, std: float = 1.0, *, seed: int, stream: str) -> Tensor:
    """Fill ``tensor`` (plain or DTensor) in place with Normal(mean, std) from (seed, stream); returns it."""
    return _fill(tensor, "normal", seed, stream, {"mean": mean, "std": std})


def trunc_normal_(
    tensor: Tensor, mean: float = 0.0, std: float = 1.0, a: float = -2.0, b: float = 2.0, *, seed: int, stream: str
) -> Tensor:
    """Fill ``tensor`` (plain or DTensor) in place with Normal(mean, std) truncated to the absolute bounds
    [a, b], as ``nn.init.trunc_normal_`` (same argument order), from (seed, stream); returns it."""
    return _fill(tensor, "trunc_normal", seed, stream, {"mean": mean, "std": std, "a": a, "b": b})


# The optimizer step that dropout masks are keyed by, given by `dropout_step`. A module global rather than a forward
# argument: pipeline stages pass only tensors between them, and activation checkpointing recomputes a block inside
# backward, on CUDA in autograd's device thread, where a ContextVar would read its default.
_step = 0


@contextmanager
def dropout_step(step: int) -> Iterator[None]:
    """Key the masks of every Dropout that runs inside by `step`: the trainer enters it around each step's forward
    and backward (recomputation included). Outside it the step is 0."""
    global _step
    outer, _step = _step, step
    try:
        yield
    finally:
        _step = outer


class Dropout(torch.nn.Module):
    """Inverted dropout whose mask is a pure function of (seed, this module's name, optimizer step, and
    the element's position in the step's global batch).

    So every layout drops exactly what one device would: a data-parallel rank or micro-batch passes the
    global batch rows it holds (`rows`), a tensor-parallel shard arrives as a DTensor (the TP plan says
    how the local tensor is sharded), and activation-checkpoint recomputation redraws the same mask.
    The owner sets `stream` (the module's name) and `seed` at init; the step comes from `dropout_step`.
    """

    def __init__(self, p: float):
        super().__init__()
        self.p, self.stream, self.seed = p, "", 0
        # Under context parallelism (set by titan/parallel/cp/ring.py): (the sequence's length, the positions along dim
        # 1 that this rank holds), as its chunks of the sequence are not one slice that a placement could describe.
        self.sequence: tuple[int, Tensor] | None = None

    def forward(self, x: Tensor, rows: Tensor) -> Tensor:
        if not self.training or self.p == 0:
            return x
        return _drop(self, x, rows)

    def keep_mask(self, shape: tuple[int, ...], rows: Tensor, given: dict[int, tuple[int, Tensor]]) -> Tensor:
        """The mask (True: kept) this module draws for a plain tensor of `shape` whose local row b is global row
        rows[b] and whose dims in `given` hold, of (global size, global indices), those indices: for attention
        that drops its probabilities block by block (the context-parallel ring)."""
        index = ShardIndex(shape, device=rows.device, rows=rows, given=given)
        if tuple(shape) != index.local_shape:
            raise ValueError(f"keep_mask: shape {tuple(shape)}, but the given indices make {index.local_shape}")
        keep = torch.empty(index.local_shape, dtype=torch.bool, device=rows.device)
        keep_mask_into(keep.view(-1), index.runs, self.seed, self.stream, _step, 1.0 - self.p)
        return keep

    def extra_repr(self) -> str:
        return f"p={self.p}"


# The step, seed and stream are read here, in eager code: a compiled block reading them would guard on their values
# and recompile for every step (and every module).
@torch.compiler.disable
def _drop(module: Dropout, x: Tensor, rows: Tensor) -> Tensor:
    given = None if module.sequence is None else {1: module.sequence}
    return dropout(x, module.p, rows, seed=module.seed, stream=module.stream, step=_step, given=given)


# Compiled blocks call dropout eagerly (a graph break): dynamo cannot trace the C kernels (a ctypes call on the
# tensors' memory), and eager draws exactly the masks of an uncompiled run.
@torch.compiler.disable
def dropout(
    x: Tensor,
    p: float,
    rows: Tensor,
    *,
    seed: int,
    stream: str,
    step: int,
    given: dict[int, tuple[int, Tensor]] | None = None,
) -> Tensor:
    """`x` (batch first; a plain tensor of whole rows, or a DTensor sharded along other dims) with elements
    dropped with probability p and the rest scaled by 1/(1-p). Local row b is row rows[b] of the global batch;
    `given` maps dims that hold some of a longer dim to (its global size, the global indices held)."""
    from torch.distributed.tensor import DTensor

    if isinstance(x, DTensor):
        if any(pl.is_shard(0) for pl in x.placements):
            raise ValueError("dropout: the batch dim must not be sharded within the DTensor's mesh; pass rows instead")
        local, layout = x.to_local(), (x.device_mesh.shape, x.device_mesh.get_coordinate(), tuple(x.placements))
    else:
        local, layout = x, ((), (), ())
    # x.shape is the global shape for a DTensor; dim 0's global indices are the rows.
    index = ShardIndex(x.shape, *layout, device=local.device, rows=rows, given=given)
    if tuple(local.shape) != index.local_shape:
        raise ValueError(f"dropout: local tensor of shape {tuple(local.shape)}, but {layout} gives {index.local_shape}")
    keep = torch.empty(local.shape, dtype=torch.bool, device=local.device)
    keep_mask_into(keep.view(-1), index.runs, seed, stream, step, 1.0 - p)
    if local.dtype == torch.float32 and _use_native(local):
        out = _MaskedScale.apply(local, keep, 1.0 - p)
    else:
        out = (local * keep.to(local.dtype)).div_(1.0 - p)  # in place: one (batch-sized) allocation fewer
    return DTensor.from_local(out, x.device_mesh, x.placements, run_check=False) if isinstance(x, DTensor) else out


class _MaskedScale(torch.autograd.Function):
    """(x * keep) / c in float32 by the C kernel, one pass each way, bitwise what the two torch ops give. Their
    autograd graph would make two passes each way and keep a float copy of the mask for backward."""

    @staticmethod
    def forward(ctx, x: Tensor, keep: Tensor, c: float) -> Tensor:
        ctx.save_for_backward(keep)
        ctx.c = c
        return _masked_scale(x, keep, c, backward=False)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None, None]:
        (keep,) = ctx.saved_tensors
        if not _use_native(grad):  # a tensor subclass (a collective's pending result): the two ops' backward
            return (grad / ctx.c) * keep.to(grad.dtype), None, None
        return _masked_scale(grad, keep, ctx.c, backward=True), None, None


def _masked_scale(x: Tensor, keep: Tensor, c: float, backward: bool) -> Tensor:
    x, out = x.contiguous(), torch.empty(x.shape, dtype=x.dtype, device=x.device)
    flat_x, flat_keep, flat_out = x.view(-1), keep.view(-1), out.view(-1)
    _for_chunks(
        x.numel(),
        x.device,
        lambda s, e: native.dropout_f32(flat_x[s:e], flat_keep[s:e], c, backward, flat_out[s:e]),
    )
    return out
