"""The global flat index of every element of a local shard, so a shard can draw what the whole tensor holds there.

For each tensor dim, start from ``arange(global_size)``. For each mesh dim in order, apply its placement: a
``Shard(d)`` keeps this rank's chunk of dim d's vector, split exactly as DTensor chunks (``torch.chunk`` sizes,
trailing chunks possibly empty), and FSDP2-over-TP's ``_StridedShard(d, split_factor=k)`` splits it into k pieces
and keeps this rank's chunk of each; ``Replicate`` and ``Partial`` leave the vectors alone. The per-dim vectors
combined with the global row-major strides give the flat indices.

And the other way: :func:`full_tensor`, the whole tensor of a shard.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor


def _placement_types():
    # Imported on use: torch.distributed.tensor takes about a second to import and plain tensors never need it.
    from torch.distributed.tensor import Partial, Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    return Shard, _StridedShard, Replicate, Partial


def _chunk(v: Tensor, num_chunks: int, i: int) -> Tensor:
    """Chunk ``i`` of ``torch.chunk(v, num_chunks)`` padded with empty chunks (DTensor's rule)."""
    n = v.numel()
    size = -(-n // num_chunks)  # ceil
    start = min(i * size, n)
    return v[start : min(start + size, n)]


def _dim_index_vectors(
    global_shape: Sequence[int], mesh_shape: Sequence[int], mesh_coord: Sequence[int], placements: Sequence
) -> list[Tensor | None]:
    """Per tensor dim, the global indices (1-D, CPU) this rank holds; None = the whole dim.

    Mesh dims are applied left to right, each splitting the indices left by the previous ones, exactly like
    ``distribute_tensor`` and ``compute_local_shape_and_global_offset``.
    """
    Shard, _StridedShard, Replicate, Partial = _placement_types()
    ndim = len(global_shape)
    if not (len(mesh_shape) == len(mesh_coord) == len(placements)):
        raise ValueError(
            f"mesh_shape {tuple(mesh_shape)}, mesh_coord {tuple(mesh_coord)} and placements "
            f"{tuple(placements)} must have one entry per mesh dim"
        )
    vecs: list[Tensor | None] = [None] * ndim
    for md, p in enumerate(placements):
        n, r = int(mesh_shape[md]), int(mesh_coord[md])
        if not 0 <= r < n:
            raise ValueError(f"mesh coordinate {r} out of range for mesh dim {md} of size {n}")
        if isinstance(p, (Shard, _StridedShard)):
            d = p.dim + ndim if p.dim < 0 else p.dim
            if not 0 <= d < ndim:
                raise ValueError(f"{p} shards dim {p.dim} of a {ndim}-d tensor")
            v = vecs[d] if vecs[d] is not None else torch.arange(int(global_shape[d]))
            if isinstance(p, _StridedShard):
                sf = int(p.split_factor)
                v = torch.cat([_chunk(_chunk(v, sf, j), n, r) for j in range(sf)])
            else:
                v = _chunk(v, n, r)
            vecs[d] = v
        elif not isinstance(p, (Replicate, Partial)):
            raise TypeError(f"unsupported placement {p!r} on mesh dim {md}")
    return vecs


def _contiguous_strides(shape: Sequence[int]) -> list[int]:
    strides, acc = [], 1
    for size in reversed(shape):
        strides.append(acc)
        acc *= int(size)
    return strides[::-1]


def flat_indices(runs: tuple[Tensor, Tensor], start: int, end: int) -> Tensor:
    """The global indices of flat positions [start, end) of an index given as runs ``(row_starts, last)``: position
    p holds row_starts[p // n] + last[p % n], n = last.numel(). Adding the two needs no per-element division (an
    int64 division per element per dim cost ~4x the generator)."""
    rows, last = runs
    n = last.numel()
    (r0, j0), (r1, j1) = divmod(start, n), divmod(end, n)
    if start >= end:
        return torch.empty(0, dtype=torch.int64, device=last.device)
    if r0 == r1:
        return rows[r0] + last[j0:j1]
    # The tail of row r0, whole rows r0 + 1 .. r1 - 1, the head of row r1: written in place, one pass.
    out = torch.empty(end - start, dtype=torch.int64, device=last.device)
    torch.add(last[j0:], rows[r0], out=out[: n - j0])
    torch.add(rows[r0 + 1 : r1, None], last, out=out[n - j0 : end - start - j1].view(-1, n))
    if j1:
        torch.add(last[:j1], rows[r1], out=out[end - start - j1 :])
    return out


class ShardIndex:
    """Global flat indices of one rank's local shard, whole (:meth:`full`) or by flat ranges (:meth:`flat`,
    bounded memory). With no mesh dims the shard is the whole tensor. ``rows``, where given, are dim 0's global
    indices instead (dropout: each local row's row in the step's global batch). ``given`` maps a dim of
    ``global_shape`` that is itself part of a longer one to (that one's size, the indices the dim holds of it), which
    any placement on the dim then picks from (dropout under context parallelism: the sequence positions a rank
    holds, which no placement describes, perhaps split again by sequence parallelism).

    ``runs``: row-major, the shard is rows along the last dim, row r holding row_starts[r] + last (see
    :func:`flat_indices`); the C kernels take the index in this form and never hold it element by element."""

    def __init__(self, global_shape, mesh_shape=(), mesh_coord=(), placements=(), device=None, rows=None, given=None):
        shape = [int(s) for s in global_shape]
        vecs = _dim_index_vectors(shape, mesh_shape, mesh_coord, placements)
        if rows is not None:
            vecs[0] = rows.reshape(-1).to(torch.int64)
        for d, (size, indices) in (given or {}).items():
            indices = indices.reshape(-1).to(torch.int64).cpu()
            vecs[d] = indices if vecs[d] is None else indices[vecs[d]]
            shape[d] = size
        self.global_shape = tuple(shape)
        self.local_shape = tuple(self.global_shape[d] if v is None else v.numel() for d, v in enumerate(vecs))
        self.trivial = all(v is None for v in vecs)
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self.vecs = [None if v is None else v.to(self.device) for v in vecs]
        self.gstrides = _contiguous_strides(self.global_shape)
        ndim = len(self.global_shape)
        if ndim == 0:  # a scalar: one run of one element
            self.runs = (torch.zeros(1, dtype=torch.int64, device=self.device),) * 2
        else:
            self.runs = (self._combine(range(ndim - 1)).view(-1), self._vector(ndim - 1).contiguous())

    def _vector(self, d: int) -> Tensor:
        v = self.vecs[d]
        return torch.arange(self.global_shape[d], device=self.device) if v is None else v

    def _combine(self, dims: range) -> Tensor:
        """The global index of each element of the sub-grid of ``dims`` (the other dims at 0), local-shaped."""
        out = torch.zeros([self.local_shape[d] for d in dims], dtype=torch.int64, device=self.device)
        for i, d in enumerate(dims):
            view = [1] * len(dims)
            view[i] = -1
            out.add_(self._vector(d).view(view) * self.gstrides[d])
        return out

    def flat(self, start: int, end: int) -> Tensor:
        """Global indices of local flat (row-major) positions [start, end)."""
        if self.trivial or start >= end:
            return torch.arange(start, max(start, end), dtype=torch.int64, device=self.device)
        return flat_indices(self.runs, start, end)

    def full(self) -> Tensor:
        """All indices, shaped like the local shard."""
        return self._combine(range(len(self.global_shape)))


def global_indices(
    global_shape: Sequence[int],
    mesh_shape: Sequence[int],
    mesh_coord: Sequence[int],
    placements: Sequence,
    device: torch.device | str | None = None,
) -> Tensor:
    """Flat row-major global index (int64, shaped like the local shard) of every element of the shard that the
    rank at ``mesh_coord`` of a ``mesh_shape`` mesh holds under ``placements`` (one per mesh dim)."""
    return ShardIndex(global_shape, mesh_shape, mesh_coord, placements, device).full()


def full_tensor(tensor: Tensor) -> Tensor:
    """A DTensor gathered whole on every rank (a collective: every rank of its mesh calls it); any other tensor
    as it is."""
    from torch.distributed.tensor import DTensor  # imported on use, as in _placement_types

    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def dtensor_global_indices(tensor, device: torch.device | str | None = None) -> Tensor:
    """:func:`global_indices` of this rank's shard of the DTensor ``tensor`` (on its device unless ``device``);
    a rank outside the mesh gets an empty index tensor, as its local tensor is empty too."""
    mesh = tensor.device_mesh
    device = tensor.device if device is None else device
    coord = mesh.get_coordinate()
    if coord is None:
        return torch.empty(0, dtype=torch.int64, device=device)
    return global_indices(tuple(tensor.shape), mesh.shape, coord, tuple(tensor.placements), device)
