"""Layout-independent random numbers: every value is a pure function of
(seed, stream name, global element index, counter).

Why: torch's stateful generators make sharded init and dropout depend on the
parallel layout (see ``shared/notes/consistent-rng.md``): with a sharded
parameter every rank draws from its own generator, so the full tensor changes
with the TP/FSDP degree. Here each element's value is computed from its
*global* flat index with the counter-based Philox4x32-10 generator, so a shard
filled on any rank of any mesh is bitwise the slice of the tensor one process
would have produced, and nothing (no offset, no generator state) has to be
carried between calls, pipeline stages or activation-checkpoint recomputation.

Layout of the randomness:

* key     = :func:`stream_key` ``(seed, stream)``, stream = parameter FQN for init,
            module name (+ index) for dropout;
* counter = (global_index & 0xffffffff, global_index >> 32,
             counter & 0xffffffff, counter >> 32)  -- ``counter`` is the
            step / micro-batch / call index (< 2**32 keeps the fourth word 0);
* one Philox block per element; each distribution uses the first one or two
  output words of that block.

All integer arithmetic is done on int64 tensors holding 32-bit unsigned values,
so it runs unchanged on CPU and CUDA (on the device of the inputs). Floating
transforms (log, cos, erfinv) are done in float64 and rounded once to the
output dtype: a last-ulp difference between two float64 code paths (vectorised
body vs tail, CPU vs CUDA libm) then almost never changes the rounded value.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor

import torch
from torch import Tensor

__all__ = [
    "philox4x32",
    "stream_key",
    "uniform",
    "normal",
    "trunc_normal",
    "bernoulli_mask",
    "global_indices",
    "dtensor_global_indices",
    "fill_",
    "uniform_",
    "normal_",
    "trunc_normal_",
]

_MASK32 = 0xFFFFFFFF
_MASK16 = 0xFFFF
# Philox4x32 constants (Salmon et al., "Parallel random numbers: as easy as 1, 2, 3", SC'11).
_PHILOX_M0 = 0xD2511F53
_PHILOX_M1 = 0xCD9E8D57
_PHILOX_W0 = 0x9E3779B9  # golden ratio
_PHILOX_W1 = 0xBB67AE85  # sqrt(3) - 1

# Elements generated per step. On CPU the chunk stays below ATen's intra-op
# grain size (32768), so each op runs on one thread without a fork/join barrier
# (which stalls badly when another process holds a core); parallelism comes
# from running chunks on a pool of Python threads instead (torch ops release
# the GIL). Chunks also bound memory for any tensor size. Accelerators want
# large launches and run chunks in order.
_CPU_CHUNK = (1 << 15) - 1  # just below GRAIN_SIZE = 32768
_ACCEL_CHUNK = 1 << 22

_TWO_PI = 2.0 * math.pi
_2POW_M24 = 2.0**-24
_2POW_M32 = 2.0**-32
_2POW_M53 = 2.0**-53


# --------------------------------------------------------------------------------------
# Philox4x32
# --------------------------------------------------------------------------------------


def _mulhilo(a, m: int):
    """(hi, lo) 32-bit words of the 64-bit product a * m, exactly.

    ``a`` is an int64 tensor of 32-bit values (or a Python int), ``m`` a 32-bit
    constant. torch has no unsigned 64-bit multiply and a * m can overflow
    int64, so ``m`` is split into 16-bit halves: p1 = a * (m >> 16) and
    p0 = a * (m & 0xffff) are both < 2**48, and a * m = p1 * 2**16 + p0 gives
      hi = (p1 + (p0 >> 16)) >> 16                   (values < 2**49)
      lo = (p0 + (p1 & 0xffff) * 2**16) & 0xffffffff (values < 2**49).
    """
    if not isinstance(a, Tensor):
        p = a * m
        return p >> 32, p & _MASK32
    p1 = a * (m >> 16)
    p0 = a * (m & _MASK16)
    lo = torch.add(p0, p1 & _MASK16, alpha=1 << 16).bitwise_and_(_MASK32)
    hi = p1.add_(p0.bitwise_right_shift_(16)).bitwise_right_shift_(16)
    return hi, lo


def _philox_words(c0, c1, c2, c3, k0, k1, rounds: int = 10, need: int = 4):
    """Philox4x32-``rounds`` on word-wise inputs (tensors or Python ints, mixed).

    Returns the first ``need`` output words; the unused multiply of the last
    round is skipped when ``need <= 2``.
    """
    for r in range(rounds):
        if r:  # key schedule: bump after every round
            k0 = (k0 + _PHILOX_W0) & _MASK32
            k1 = (k1 + _PHILOX_W1) & _MASK32
        hi1, lo1 = _mulhilo(c2, _PHILOX_M1)
        if r == rounds - 1 and need <= 2:
            return (hi1 ^ c1 ^ k0, lo1)[:need]
        hi0, lo0 = _mulhilo(c0, _PHILOX_M0)
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
    return (c0, c1, c2, c3)[:need]


def philox4x32(counter: Tensor, key: Tensor, rounds: int = 10) -> Tensor:
    """Philox4x32-``rounds`` block function (Random123 / cuRAND / JAX compatible).

    Args:
        counter: int64 tensor ``[..., 4]`` of 32-bit values (word 0 first).
        key: int64 tensor ``[..., 2]`` of 32-bit values, broadcastable against
            ``counter[..., :2]``.
    Returns:
        int64 tensor ``[..., 4]`` of 32-bit output words, on ``counter``'s device.
    """
    if counter.shape[-1:] != (4,) or key.shape[-1:] != (2,):
        raise ValueError(f"counter must be [...,4] and key [...,2]; got {tuple(counter.shape)}, {tuple(key.shape)}")
    counter = counter.to(torch.int64)
    key = key.to(device=counter.device, dtype=torch.int64)
    c = [counter[..., i] & _MASK32 for i in range(4)]
    k = [key[..., i] & _MASK32 for i in range(2)]
    out = _philox_words(*c, *k, rounds=rounds)
    shape = torch.broadcast_shapes(counter.shape[:-1], key.shape[:-1])
    return torch.stack([o.expand(shape) for o in out], dim=-1)


def stream_key(seed: int, stream: str) -> tuple[int, int]:
    """Philox key ``(k0, k1)`` for a (seed, stream name) pair.

    ``h = blake2b(stream.encode('utf-8'), digest_size=8, person=b'titan.rng.v1',
    salt=(seed >> 32).to_bytes(8, 'little'))`` read as a little-endian 64-bit int;
    ``k0 = (seed & 0xffffffff) ^ (h >> 32)`` and ``k1 = h & 0xffffffff``.

    hashlib keeps it stable across processes and Python versions (``hash()`` is
    salted per process). Spreading the 64-bit stream hash over both key words
    means two streams only share a key for a given seed on a 64-bit collision,
    and two seeds below 2**32 never share a key for the same stream. The seed's
    high 32 bits salt the hash so 64-bit seeds are not truncated. Negative seeds
    are taken modulo 2**64.
    """
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise TypeError(f"seed must be an int, got {type(seed).__name__}")
    if not isinstance(stream, str):
        raise TypeError(f"stream must be a str, got {type(stream).__name__}")
    seed &= (1 << 64) - 1
    digest = hashlib.blake2b(
        stream.encode("utf-8"),
        digest_size=8,
        person=b"titan.rng.v1",
        salt=(seed >> 32).to_bytes(8, "little"),
    ).digest()
    h = int.from_bytes(digest, "little")
    return (seed & _MASK32) ^ (h >> 32), h & _MASK32


# --------------------------------------------------------------------------------------
# Element-wise distributions
# --------------------------------------------------------------------------------------


def _check_counter(counter: int) -> int:
    if isinstance(counter, bool) or not isinstance(counter, int) or not 0 <= counter < 1 << 64:
        raise ValueError(f"counter must be an int in [0, 2**64), got {counter!r}")
    return counter


def _words(idx: Tensor, key: tuple[int, int], counter: int, need: int):
    """First ``need`` Philox output words for counter (idx_lo, idx_hi, ctr_lo, ctr_hi)."""
    return _philox_words(
        idx & _MASK32, idx >> 32, counter & _MASK32, counter >> 32, key[0], key[1], need=need
    )


def _uniform24(w: Tensor) -> Tensor:
    """[0, 1) from the top 24 bits of a word; exact in float32 (and float64)."""
    return w.bitwise_right_shift_(8).to(torch.float64).mul_(_2POW_M24)


class _Dist:
    """A distribution: how many Philox words it needs and how it maps them to floats."""

    def __init__(self, need: int, fn: Callable[..., Tensor]):
        self.need = need
        self.fn = fn


def _uniform_from_words(w, low: float = 0.0, high: float = 1.0) -> Tensor:
    u = _uniform24(w[0])
    if low == 0.0 and high == 1.0:
        return u
    return u.mul_(high - low).add_(low)


def _normal_from_words(w, mean: float = 0.0, std: float = 1.0) -> Tensor:
    if not std >= 0.0:
        raise ValueError(f"normal needs std >= 0, got {std}")
    # Box-Muller on full 32-bit words: u1 = (w0 + 1/2) / 2**32 lies in (0, 1), so
    # log(u1) is finite (|z| <= sqrt(2 * 33 ln 2) ~ 6.8); u2 = w1 / 2**32 in [0, 1).
    u1 = w[0].to(torch.float64).add_(0.5).mul_(_2POW_M32)
    u2 = w[1].to(torch.float64).mul_(_2POW_M32 * _TWO_PI)
    z = u1.log_().mul_(-2.0).sqrt_().mul_(u2.cos_())
    if mean == 0.0 and std == 1.0:
        return z
    return z.mul_(std).add_(mean)


def _norm_cdf(x: float) -> float:
    return (1.0 + math.erf(x / math.sqrt(2.0))) / 2.0


def _trunc_normal_from_words(w, mean: float = 0.0, std: float = 1.0, a: float = -2.0, b: float = 2.0) -> Tensor:
    # The inverse-CDF chain of torch.nn.init.trunc_normal_: uniform on
    # [2 Phi(a') - 1, 2 Phi(b') - 1], erfinv, scale, shift, clamp. The uniform
    # uses 53 bits (two words) because erfinv stretches its spacing in the tails.
    if not (a < b and std > 0.0):
        raise ValueError(f"trunc_normal needs a < b and std > 0, got a={a}, b={b}, std={std}")
    lo = 2.0 * _norm_cdf((a - mean) / std) - 1.0
    hi = 2.0 * _norm_cdf((b - mean) / std) - 1.0
    u = (w[0] >> 5).mul_(1 << 26).add_(w[1] >> 6).to(torch.float64).mul_(_2POW_M53)
    x = u.mul_(hi - lo).add_(lo).erfinv_()
    return x.mul_(std * math.sqrt(2.0)).add_(mean).clamp_(min=a, max=b)


_DISTS = {
    "uniform": _Dist(1, _uniform_from_words),
    "normal": _Dist(2, _normal_from_words),
    "trunc_normal": _Dist(2, _trunc_normal_from_words),
}


def _for_chunks(n: int, device: torch.device, body: Callable[[int, int], None]) -> None:
    """Run ``body(start, end)`` over [0, n) in chunks (CPU chunks on a thread pool).

    Chunks write disjoint slices and each value depends only on its own index,
    so the result does not depend on the chunking or the thread schedule.
    """
    chunk = _CPU_CHUNK if device.type == "cpu" else _ACCEL_CHUNK
    bounds = [(s, min(s + chunk, n)) for s in range(0, n, chunk)]
    workers = min(torch.get_num_threads(), len(bounds)) if device.type == "cpu" else 1
    if workers <= 1:
        for s, e in bounds:
            body(s, e)
        return
    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="titan-rng") as pool:
        for _ in pool.map(lambda se: body(*se), bounds):
            pass


def _generate_into(
    out_flat: Tensor,
    index_chunk: Callable[[int, int], Tensor],
    seed: int,
    stream: str,
    counter: int,
    kind: str,
    params: dict,
) -> None:
    """Fill the 1-D ``out_flat``; ``index_chunk(s, e)`` gives the global indices of [s, e)."""
    dist = _DISTS[kind]
    key = stream_key(seed, stream)
    counter = _check_counter(counter)
    # Validate the parameters (names and values) before any element is written.
    empty = torch.empty(0, dtype=torch.int64)
    dist.fn([empty] * dist.need, **params)

    def body(s: int, e: int) -> None:
        with torch.no_grad():  # grad mode is per thread: pool threads must not record this fill
            vals = dist.fn(_words(index_chunk(s, e), key, counter, dist.need), **params)
            out_flat[s:e].copy_(vals)

    _for_chunks(out_flat.numel(), out_flat.device, body)


def _elementwise(kind: str, global_index: Tensor, seed, stream, counter, dtype, params) -> Tensor:
    if global_index.dtype != torch.int64:
        raise TypeError(f"global_index must be int64, got {global_index.dtype}")
    out = torch.empty(global_index.shape, dtype=dtype, device=global_index.device)
    flat_idx = global_index.reshape(-1)
    _generate_into(out.view(-1), lambda s, e: flat_idx[s:e], seed, stream, counter, kind, params)
    return out


def uniform(
    global_index: Tensor,
    seed: int,
    stream: str,
    counter: int = 0,
    *,
    low: float = 0.0,
    high: float = 1.0,
    dtype: torch.dtype = torch.float32,
) -> Tensor:
    """Uniform values on [low, high), one per global index (same shape and device).

    The unit uniform is ``(word0 >> 8) / 2**24``: exact in float32, never 1.0
    (a rounding to a low-precision dtype or a [low, high) rescale may reach ``high``).
    """
    return _elementwise("uniform", global_index, seed, stream, counter, dtype, dict(low=low, high=high))


def normal(
    global_index: Tensor,
    seed: int,
    stream: str,
    counter: int = 0,
    *,
    mean: float = 0.0,
    std: float = 1.0,
    dtype: torch.dtype = torch.float32,
) -> Tensor:
    """Normal(mean, std) values, one per global index, by Box-Muller on words 0 and 1."""
    return _elementwise("normal", global_index, seed, stream, counter, dtype, dict(mean=mean, std=std))


def trunc_normal(
    global_index: Tensor,
    seed: int,
    stream: str,
    counter: int = 0,
    *,
    mean: float = 0.0,
    std: float = 1.0,
    a: float = -2.0,
    b: float = 2.0,
    dtype: torch.dtype = torch.float32,
) -> Tensor:
    """Normal(mean, std) truncated to [a, b] (absolute bounds, as in ``nn.init.trunc_normal_``)."""
    return _elementwise(
        "trunc_normal", global_index, seed, stream, counter, dtype, dict(mean=mean, std=std, a=a, b=b)
    )


def bernoulli_mask(global_index: Tensor, seed: int, stream: str, counter: int = 0, *, p_keep: float) -> Tensor:
    """Dropout keep-mask: True where ``uniform(global_index, seed, stream, counter) < p_keep``.

    The comparison is exact (done on the 24-bit integer), so the mask agrees with
    ``uniform(..., dtype=torch.float64) < p_keep`` bit for bit.
    """
    if global_index.dtype != torch.int64:
        raise TypeError(f"global_index must be int64, got {global_index.dtype}")
    if not 0.0 <= p_keep <= 1.0:
        raise ValueError(f"p_keep must be in [0, 1], got {p_keep}")
    key = stream_key(seed, stream)
    counter = _check_counter(counter)
    # u = k / 2**24 < p  <=>  k < ceil(p * 2**24) for integer k (p * 2**24 is exact).
    threshold = math.ceil(p_keep * (1 << 24))
    flat_idx = global_index.reshape(-1)
    out = torch.empty(flat_idx.shape, dtype=torch.bool, device=global_index.device)

    def body(s: int, e: int) -> None:
        (w0,) = _words(flat_idx[s:e], key, counter, 1)
        torch.lt(w0.bitwise_right_shift_(8), threshold, out=out[s:e])

    _for_chunks(flat_idx.numel(), flat_idx.device, body)
    return out.view(global_index.shape)


# --------------------------------------------------------------------------------------
# Global indices of a DTensor-style shard
# --------------------------------------------------------------------------------------


def _placement_types():
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
    global_shape: Sequence[int],
    mesh_shape: Sequence[int],
    mesh_coord: Sequence[int],
    placements: Sequence,
) -> list[Tensor | None]:
    """Per tensor dim, the global indices (1-D, CPU) this rank holds; None = the whole dim.

    Mesh dims are applied left to right, each splitting the indices left by the
    previous ones, exactly like ``distribute_tensor`` and
    ``compute_local_shape_and_global_offset``.
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
                # FSDP2-over-TP: split into split_factor pieces, take chunk r of each, concatenate.
                sf = int(p.split_factor)
                v = torch.cat([_chunk(_chunk(v, sf, j), n, r) for j in range(sf)])
            else:
                v = _chunk(v, n, r)
            vecs[d] = v
        elif isinstance(p, (Replicate, Partial)):
            continue
        else:
            raise TypeError(f"unsupported placement {p!r} on mesh dim {md}")
    return vecs


def _contiguous_strides(shape: Sequence[int]) -> list[int]:
    strides, acc = [], 1
    for size in reversed(shape):
        strides.append(acc)
        acc *= int(size)
    return strides[::-1]


class _ShardIndex:
    """Global flat indices of a local shard, produced lazily in flat ranges (bounded memory)."""

    def __init__(self, global_shape, mesh_shape=(), mesh_coord=(), placements=(), device=None):
        self.global_shape = tuple(int(s) for s in global_shape)
        vecs = _dim_index_vectors(self.global_shape, mesh_shape, mesh_coord, placements)
        self.local_shape = tuple(
            self.global_shape[d] if v is None else v.numel() for d, v in enumerate(vecs)
        )
        self.numel = math.prod(self.local_shape)
        self.trivial = all(v is None for v in vecs)
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self.vecs = [None if v is None else v.to(self.device) for v in vecs]
        self.gstrides = _contiguous_strides(self.global_shape)

    def flat(self, start: int, end: int) -> Tensor:
        """Global indices of local flat (row-major) positions [start, end)."""
        f = torch.arange(start, end, dtype=torch.int64, device=self.device)
        if self.trivial:
            return f
        out = torch.zeros_like(f)
        for d in reversed(range(len(self.local_shape))):
            size, v, gs = self.local_shape[d], self.vecs[d], self.gstrides[d]
            c = f.remainder(size) if d else f
            g = c if v is None else v[c]
            out.add_(g, alpha=gs) if gs != 1 else out.add_(g)
            if d:
                f = f.div(size, rounding_mode="floor")
        return out

    def full(self) -> Tensor:
        """All indices, shaped like the local shard."""
        ndim = len(self.global_shape)
        out = torch.zeros(self.local_shape, dtype=torch.int64, device=self.device)
        for d in range(ndim):
            v = self.vecs[d]
            if v is None:
                v = torch.arange(self.global_shape[d], device=self.device)
            view = [1] * ndim
            view[d] = -1
            out.add_(v.view(view) * self.gstrides[d])
        return out


def global_indices(
    global_shape: Sequence[int],
    mesh_shape: Sequence[int] = (),
    mesh_coord: Sequence[int] = (),
    placements: Sequence = (),
    device: torch.device | str | None = None,
) -> Tensor:
    """Flat row-major global index of every element of this rank's local shard.

    ``placements`` are ``torch.distributed.tensor`` placements, one per mesh dim:
    ``Shard(d)`` and FSDP2's ``_StridedShard(d, split_factor=k)`` split a tensor
    dim with DTensor's chunking (``torch.chunk`` sizes, trailing shards possibly
    empty; several mesh dims on one tensor dim apply in mesh-dim order);
    ``Replicate()`` and ``Partial()`` leave indices alone. Returns an int64
    tensor of the local shard's shape.
    """
    return _ShardIndex(global_shape, mesh_shape, mesh_coord, placements, device).full()


def _dtensor_layout(x):
    """(mesh, placements, global_shape) of a DTensor."""
    return x.device_mesh, tuple(x.placements), tuple(x.shape)


def dtensor_global_indices(
    tensor_or_mesh,
    placements: Sequence | None = None,
    global_shape: Sequence[int] | None = None,
    device: torch.device | str | None = None,
) -> Tensor:
    """:func:`global_indices` for this rank of a DTensor, or of ``(mesh, placements, global_shape)``.

    The mesh coordinate comes from ``mesh.get_coordinate()``; a rank outside the
    mesh gets an empty index tensor (its DTensor local tensor is empty too).
    """
    from torch.distributed.tensor import DTensor

    if isinstance(tensor_or_mesh, DTensor):
        mesh, placements, global_shape = _dtensor_layout(tensor_or_mesh)
        if device is None:
            device = tensor_or_mesh.device
    else:
        mesh = tensor_or_mesh
        if placements is None or global_shape is None:
            raise ValueError("pass a DTensor, or a mesh together with placements and global_shape")
    coord = mesh.get_coordinate()
    if coord is None:
        return torch.empty(0, dtype=torch.int64, device=device)
    return global_indices(global_shape, mesh.shape, coord, placements, device)


# --------------------------------------------------------------------------------------
# In-place fills (what model init calls)
# --------------------------------------------------------------------------------------


def _partial_fill_rule(mesh_coord: Sequence[int], placements: Sequence) -> bool:
    """Whether this rank writes the values (True) or zeros (False) under Partial placements.

    An in-place fill must give the DTensor the sampled *value*: for Partial("sum")
    only coordinate 0 of that mesh dim holds it and the others hold 0 (exact,
    unlike dividing by n); for avg/max/min every rank holds it.
    """
    _, _, _, Partial = _placement_types()
    write = True
    for md, p in enumerate(placements):
        if isinstance(p, Partial):
            op = str(p.reduce_op)
            if op == "sum":
                write = write and int(mesh_coord[md]) == 0
            elif op not in ("avg", "max", "min"):
                raise ValueError(f"cannot fill a tensor that is {p!r} on mesh dim {md}")
    return write


def fill_(
    tensor: Tensor,
    kind: str,
    seed: int,
    stream: str,
    counter: int = 0,
    *,
    global_shape: Sequence[int] | None = None,
    mesh_shape: Sequence[int] | None = None,
    mesh_coord: Sequence[int] | None = None,
    placements: Sequence | None = None,
    **params,
) -> Tensor:
    """Fill ``tensor`` in place with the values the unsharded tensor has at its positions.

    ``kind`` is "uniform" (low, high), "normal" (mean, std) or "trunc_normal"
    (mean, std, a, b); ``params`` go to that distribution.

    * plain tensor: it is the whole tensor (index = flat row-major position);
    * plain tensor + ``global_shape, mesh_shape, mesh_coord, placements``: it is
      that rank's local shard (lets one process build any rank's shard);
    * DTensor: its local tensor is filled, the layout read from the DTensor.

    Partial("sum") mesh dims: coordinate 0 gets the values and the rest zeros, so
    the DTensor's value is the sample (see :func:`_partial_fill_rule`).
    Meta tensors are left alone. Returns ``tensor``.
    """
    if kind not in _DISTS:
        raise ValueError(f"unknown kind {kind!r}; expected one of {sorted(_DISTS)}")
    from torch.distributed.tensor import DTensor

    if isinstance(tensor, DTensor):
        if placements is not None or global_shape is not None:
            raise ValueError("layout arguments are read from the DTensor; do not pass them")
        mesh, placements, global_shape = _dtensor_layout(tensor)
        mesh_shape, mesh_coord = mesh.shape, mesh.get_coordinate()
        local = tensor._local_tensor  # to_local() would go through autograd when grad is enabled
        if mesh_coord is None:  # rank outside the mesh holds nothing
            return tensor
    else:
        local = tensor
        if placements is None:
            if global_shape is not None and tuple(global_shape) != tuple(tensor.shape):
                raise ValueError("global_shape given without placements must equal tensor.shape")
            global_shape, mesh_shape, mesh_coord, placements = tuple(tensor.shape), (), (), ()
        elif global_shape is None or mesh_shape is None or mesh_coord is None:
            raise ValueError("placements need global_shape, mesh_shape and mesh_coord")
    if not local.is_floating_point():
        raise TypeError(f"can only fill floating-point tensors, got {local.dtype}")
    if local.is_meta:
        return tensor

    index = _ShardIndex(global_shape, mesh_shape, mesh_coord, placements, device=local.device)
    if tuple(local.shape) != index.local_shape:
        raise ValueError(
            f"local tensor has shape {tuple(local.shape)} but {tuple(placements)} on mesh "
            f"{tuple(mesh_shape)} at {tuple(mesh_coord)} gives {index.local_shape}"
        )
    local = local.detach()  # same storage; autograd stays out of it (worker threads included)
    if not _partial_fill_rule(mesh_coord, placements):
        local.zero_()
    elif local.is_contiguous():
        _generate_into(local.view(-1), index.flat, seed, stream, counter, kind, params)
    else:
        buf = torch.empty(local.shape, dtype=local.dtype, device=local.device)
        _generate_into(buf.view(-1), index.flat, seed, stream, counter, kind, params)
        local.copy_(buf)
    return tensor


def uniform_(
    tensor: Tensor, low: float = 0.0, high: float = 1.0, *, seed: int, stream: str, counter: int = 0, **layout
) -> Tensor:
    """In-place :func:`uniform` fill of a plain tensor, a described shard, or a DTensor (see :func:`fill_`)."""
    return fill_(tensor, "uniform", seed, stream, counter, low=low, high=high, **layout)


def normal_(
    tensor: Tensor, mean: float = 0.0, std: float = 1.0, *, seed: int, stream: str, counter: int = 0, **layout
) -> Tensor:
    """In-place :func:`normal` fill of a plain tensor, a described shard, or a DTensor (see :func:`fill_`)."""
    return fill_(tensor, "normal", seed, stream, counter, mean=mean, std=std, **layout)


def trunc_normal_(
    tensor: Tensor,
    mean: float = 0.0,
    std: float = 1.0,
    a: float = -2.0,
    b: float = 2.0,
    *,
    seed: int,
    stream: str,
    counter: int = 0,
    **layout,
) -> Tensor:
    """In-place :func:`trunc_normal` fill (same signature order as ``nn.init.trunc_normal_``)."""
    return fill_(tensor, "trunc_normal", seed, stream, counter, mean=mean, std=std, a=a, b=b, **layout)


# --------------------------------------------------------------------------------------
# Dropout
# --------------------------------------------------------------------------------------


class Dropout(torch.nn.Module):
    """Inverted dropout whose mask is a pure function of (seed, this module's name, optimizer step, and
    the element's position in the step's global batch).

    So every layout drops exactly what one device would: a data-parallel rank or micro-batch passes the
    global batch rows it holds (`rows`), a tensor-parallel shard arrives as a DTensor (the TP plan says
    how the local tensor is sharded), and activation-checkpoint recomputation redraws the same mask.
    The owner sets `stream` (the module's name) and `seed` at init; the trainer sets `step`.
    """

    def __init__(self, p: float):
        super().__init__()
        self.p, self.stream, self.seed, self.step = p, "", 0, 0

    def forward(self, x: Tensor, rows: Tensor) -> Tensor:
        if not self.training or self.p == 0:
            return x
        return dropout(x, self.p, rows, seed=self.seed, stream=self.stream, step=self.step)

    def extra_repr(self) -> str:
        return f"p={self.p}"


def dropout(x: Tensor, p: float, rows: Tensor, *, seed: int, stream: str, step: int) -> Tensor:
    """`x` (batch first; a plain tensor of whole rows, or a DTensor sharded along other dims) with elements
    dropped with probability p and the rest scaled by 1/(1-p). Local row b is row rows[b] of the global batch."""
    from torch.distributed.tensor import DTensor

    local = x.to_local() if isinstance(x, DTensor) else x
    if isinstance(x, DTensor):
        if any(pl.is_shard(0) for pl in x.placements):
            raise ValueError("dropout: the batch dim must not be sharded within the DTensor's mesh; pass rows instead")
        index = dtensor_global_indices(x)
    else:
        index = torch.arange(local.numel(), device=local.device).view(local.shape)
    per_row = math.prod(x.shape[1:])  # x.shape is the global shape for a DTensor
    row_shift = (rows.to(index.device) - torch.arange(local.shape[0], device=index.device)) * per_row
    index = index + row_shift.view(-1, *([1] * (local.dim() - 1)))
    mask = bernoulli_mask(index, seed, stream, step, p_keep=1.0 - p)
    out = local * mask.to(local.dtype) / (1.0 - p)
    return DTensor.from_local(out, x.device_mesh, x.placements, run_check=False) if isinstance(x, DTensor) else out
