"""Muon's orthogonalisation of sharded matrices: each whole, once, on one rank of its mesh, each rank keeping its
shard of the result.

Matrices alike (same shape, mesh and placements: the same weight of every block) are stacked along a new first dim,
W at a time for a mesh of W ranks (zeros fill the last stack: they stay zeros). Resharding a stack from its
matrices' placements to Shard(0) over every mesh dim gives each rank one whole matrix (an all-to-all where the
matrices are split on one mesh dim); each rank orthogonalises its own, and the reverse resharding hands every rank
its shards of all W. A matrix whose every rank holds it whole (plain tensors, replicated DTensors, and the experts
of a stack split by expert only) is orthogonalised where it is, without collectives."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard


def orthogonalised_shards(
    params: list[torch.Tensor], updates: list[torch.Tensor], orthogonalise: Callable[[torch.Tensor], torch.Tensor]
) -> list[torch.Tensor]:
    """orthogonalise(whole matrix) of each of params' updates, as the local shard of its parameter: `updates` are
    local shards placed as their parameters are; a 3-D parameter is a stack of matrices, each done alone."""
    out: list[torch.Tensor | None] = [None] * len(params)
    alike: dict[tuple, list[int]] = {}
    for i, p in enumerate(params):
        if _whole_locally(p):
            out[i] = orthogonalise(updates[i])
        else:
            alike.setdefault((p.shape, p.device_mesh, p.placements), []).append(i)
    for (shape, mesh, placements), indices in alike.items():
        size = mesh.size()
        for start in range(0, len(indices), size):
            batch = indices[start : start + size]
            shards = _orthogonalise_stack([updates[i] for i in batch], shape, mesh, placements, orthogonalise)
            for i, shard in zip(batch, shards):
                out[i] = shard
    return out


def _whole_locally(param: torch.Tensor) -> bool:
    """Whether each rank's local tensor holds whole matrices: a plain tensor, a replicated one, or a stack of
    experts split by expert (dim 0) only."""
    if not isinstance(param, DTensor):
        return True
    return all(p.is_replicate() or (param.ndim == 3 and isinstance(p, Shard) and p.dim == 0) for p in param.placements)


def _orthogonalise_stack(
    locals_: list[torch.Tensor], shape: torch.Size, mesh, placements, orthogonalise
) -> list[torch.Tensor]:
    """The local shards of orthogonalise(each matrix) for up to mesh.size() alike matrices, each done on one rank."""
    size = mesh.size()
    stack = torch.stack(locals_ + [torch.zeros_like(locals_[0])] * (size - len(locals_)))
    stacked = [_shifted(p) for p in placements]
    whole_shape = (size, *shape)
    stride = torch.empty(whole_shape, device="meta").stride()
    one_each = [Shard(0)] * mesh.ndim
    mine = DTensor.from_local(stack, mesh, stacked, shape=whole_shape, stride=stride).redistribute(mesh, one_each)
    done = DTensor.from_local(orthogonalise(mine.to_local()), mesh, one_each, shape=whole_shape, stride=stride)
    return list(done.redistribute(mesh, stacked).to_local().unbind(0))[: len(locals_)]


def _shifted(p):
    """The placement of a stack of tensors placed `p`, stacked along a new first dim."""
    if isinstance(p, _StridedShard):
        return _StridedShard(p.dim + 1, split_factor=p.split_factor)
    if isinstance(p, Shard):
        return Shard(p.dim + 1)
    assert isinstance(p, Replicate), f"Muon cannot place an update {p}"
    return p
