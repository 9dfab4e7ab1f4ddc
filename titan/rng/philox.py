"""Philox4x32-10, the stream key, and the distributions titan draws.

Generator: Philox4x32-10, the counter-based generator of Random123, cuRAND and JAX (Salmon et al., "Parallel
random numbers: as easy as 1, 2, 3", SC'11). The state is a counter of four 32-bit words (c0, c1, c2, c3) and a
key of two (k0, k1). Each of the 10 rounds multiplies c0 by 0xD2511F53 and c2 by 0xCD9E8D57, each to a 64-bit
(hi, lo) pair, and sets the counter to (hi(c2) ^ c1 ^ k0, lo(c2), hi(c0) ^ c3 ^ k1, lo(c0)); between rounds
k0 += 0x9E3779B9 and k1 += 0xBB67AE85 (mod 2**32). The output is the final counter.

Integer arithmetic: words are 32-bit values held in int64 tensors, so the same code runs on CPU and CUDA. torch
has no unsigned 64-bit multiply and a 32 x 32-bit product can overflow int64, so each multiplier is split into
16-bit halves (:func:`_mulhilo`): every partial product stays below 2**49 and the (hi, lo) words come out exact.
On the CPU the words, the keep mask and the uniforms come from C kernels instead (:mod:`native`, ~40x faster),
bitwise the same; the torch ops remain the path on accelerators and where no C compiler is found.

Keying, one Philox block per element:
    key     = :func:`stream_key` (seed, stream): the seed and a hash of the stream name (a parameter's name for
              init, a dropout module's name);
    counter = (index & 0xffffffff, index >> 32, counter & 0xffffffff, counter >> 32), where index is the
              element's global flat index and counter the call's number (0 for init, the step for dropout).
No offset or generator state is kept anywhere, so pipeline stages, the order of initialisation and
activation-checkpoint recomputation all see the same values.

Distributions, from the words of the element's block:
    normal        Box-Muller on words 0 and 1: u1 = (w0 + 1/2) / 2**32 is kept away from 0, u2 = w1 / 2**32;
    trunc_normal  the inverse-CDF chain of ``torch.nn.init.trunc_normal_`` on a 53-bit uniform of words 0 and 1;
    keep mask     (dropout) True where the uniform (w0 >> 8) / 2**24 from the top 24 bits is below the keep
                  probability.
Floating transforms (log, cos, erfinv) are torch ops on both paths, in float64, rounded once to the output dtype,
so a last-ulp difference between two float64 code paths (vectorised body vs tail, CPU vs CUDA libm) almost never
shows.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable

import torch
from torch import Tensor

from titan.rng import native
from titan.rng.shards import flat_indices

_MASK32 = 0xFFFFFFFF
_MASK16 = 0xFFFF
_ROUNDS = 10
_PHILOX_M0 = 0xD2511F53
_PHILOX_M1 = 0xCD9E8D57
_PHILOX_W0 = 0x9E3779B9  # golden ratio
_PHILOX_W1 = 0xBB67AE85  # sqrt(3) - 1

# Elements generated per step: chunks bound memory for any tensor size. On CPU a chunk is large enough for ATen
# to split each torch op among its threads and for Python's per-chunk share to be small. (A pool of Python threads
# running chunks side by side was slower: its threads fight ATen's spinning OpenMP workers for the cores.)
# Accelerators want large launches.
_CPU_CHUNK = 1 << 18
_ACCEL_CHUNK = 1 << 22

_TWO_PI = 2.0 * math.pi
_2POW_M32 = 2.0**-32
_2POW_M53 = 2.0**-53
_ANGLE_SCALE = _2POW_M32 * _TWO_PI  # w1 * this = 2 pi w1 / 2**32, one rounding


def _mulhilo(a, m: int):
    """(hi, lo) 32-bit words of the 64-bit product a * m, exactly.

    ``a`` is an int64 tensor of 32-bit values (or a Python int), ``m`` a 32-bit constant. With m split in 16-bit
    halves, p1 = a * (m >> 16) and p0 = a * (m & 0xffff) are both < 2**48, and a * m = p1 * 2**16 + p0 gives
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


def _philox_words(c0, c1, c2, c3, k0, k1, need: int = 4):
    """The first ``need`` output words of Philox4x32-10 on word-wise inputs (tensors or Python ints, mixed).

    The last round's unused multiply is skipped when ``need <= 2``.
    """
    for r in range(_ROUNDS):
        if r:  # key schedule: bump after every round
            k0 = (k0 + _PHILOX_W0) & _MASK32
            k1 = (k1 + _PHILOX_W1) & _MASK32
        hi1, lo1 = _mulhilo(c2, _PHILOX_M1)
        if r == _ROUNDS - 1 and need <= 2:
            return (hi1 ^ c1 ^ k0, lo1)[:need]
        hi0, lo0 = _mulhilo(c0, _PHILOX_M0)
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
    return (c0, c1, c2, c3)[:need]


def stream_key(seed: int, stream: str) -> tuple[int, int]:
    """Philox key ``(k0, k1)`` for a (seed, stream name) pair.

    ``h = blake2b(stream.encode('utf-8'), digest_size=8, person=b'titan.rng.v1',
    salt=(seed >> 32).to_bytes(8, 'little'))`` read as a little-endian 64-bit int;
    ``k0 = (seed & 0xffffffff) ^ (h >> 32)`` and ``k1 = h & 0xffffffff``.

    hashlib keeps it stable across processes and Python versions (``hash()`` is salted per process). Spreading
    the 64-bit stream hash over both key words means two streams only share a key for a given seed on a 64-bit
    collision, and two seeds below 2**32 never share a key for the same stream. The seed's high 32 bits salt the
    hash so 64-bit seeds are not truncated. Negative seeds are taken modulo 2**64.
    """
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise TypeError(f"seed must be an int, got {type(seed).__name__}")
    if not isinstance(stream, str):
        raise TypeError(f"stream must be a str, got {type(stream).__name__}")
    seed &= (1 << 64) - 1
    digest = hashlib.blake2b(
        stream.encode("utf-8"), digest_size=8, person=b"titan.rng.v1", salt=(seed >> 32).to_bytes(8, "little")
    ).digest()
    h = int.from_bytes(digest, "little")
    return (seed & _MASK32) ^ (h >> 32), h & _MASK32


def _check_counter(counter: int) -> int:
    if isinstance(counter, bool) or not isinstance(counter, int) or not 0 <= counter < 1 << 64:
        raise ValueError(f"counter must be an int in [0, 2**64), got {counter!r}")
    return counter


def _words(idx: Tensor, key: tuple[int, int], counter: int, need: int):
    """First ``need`` Philox output words for counter (idx_lo, idx_hi, ctr_lo, ctr_hi)."""
    return _philox_words(idx & _MASK32, idx >> 32, counter & _MASK32, counter >> 32, key[0], key[1], need=need)


def _normal_uniforms(w) -> tuple[Tensor, Tensor]:
    # u1 in (0, 1) keeps log(u1) finite (|z| <= sqrt(2 * 33 ln 2) ~ 6.8); the angle 2 pi u2, u2 in [0, 1).
    return w[0].to(torch.float64).add_(0.5).mul_(_2POW_M32), w[1].to(torch.float64).mul_(_ANGLE_SCALE)


def _normal(u: tuple[Tensor, Tensor], mean: float = 0.0, std: float = 1.0) -> Tensor:
    if not std >= 0.0:
        raise ValueError(f"normal needs std >= 0, got {std}")
    u1, angle = u
    z = u1.log_().mul_(-2.0).sqrt_().mul_(angle.cos_())
    if mean == 0.0 and std == 1.0:
        return z
    return z.mul_(std).add_(mean)


def _norm_cdf(x: float) -> float:
    return (1.0 + math.erf(x / math.sqrt(2.0))) / 2.0


def _uniform53(w) -> tuple[Tensor]:
    # 53 bits (two words) because erfinv stretches the uniform's spacing in the tails.
    return ((w[0] >> 5).mul_(1 << 26).add_(w[1] >> 6).to(torch.float64).mul_(_2POW_M53),)


def _trunc_normal(u: tuple[Tensor], mean: float = 0.0, std: float = 1.0, a: float = -2.0, b: float = 2.0) -> Tensor:
    # torch.nn.init.trunc_normal_'s chain: uniform on [2 Phi(a') - 1, 2 Phi(b') - 1], erfinv, scale, shift, clamp.
    if not (a < b and std > 0.0):
        raise ValueError(f"trunc_normal needs a < b and std > 0, got a={a}, b={b}, std={std}")
    lo = 2.0 * _norm_cdf((a - mean) / std) - 1.0
    hi = 2.0 * _norm_cdf((b - mean) / std) - 1.0
    x = u[0].mul_(hi - lo).add_(lo).erfinv_()
    return x.mul_(std * math.sqrt(2.0)).add_(mean).clamp_(min=a, max=b)


def _trunc_normal_from_words(w, mean: float = 0.0, std: float = 1.0, a: float = -2.0, b: float = 2.0) -> Tensor:
    return _trunc_normal(_uniform53(w), mean, std, a, b)


# kind -> (its uniforms from Philox words in torch ops, the same from the C kernels, float64 values from them)
_DISTS: dict[str, tuple[Callable, Callable, Callable[..., Tensor]]] = {
    "normal": (
        _normal_uniforms,
        lambda runs, s, e, key, counter: native.normal_uniforms(runs, s, e, key, counter, _ANGLE_SCALE),
        _normal,
    ),
    "trunc_normal": (_uniform53, native.uniform53, _trunc_normal),
}


def _use_native(out: Tensor) -> bool:
    """Whether to compute ``out`` with the C kernels: a plain, contiguous CPU tensor (a subclass may hold no data
    of its own). Builds them here, on first use, before any worker thread asks."""
    return out.device.type == "cpu" and type(out) is Tensor and out.is_contiguous() and native.library() is not None


def _for_chunks(n: int, device: torch.device, body: Callable[[int, int], None]) -> None:
    """Run ``body(start, end)`` over [0, n) in chunks. Each value depends only on its own index, so the result does
    not depend on the chunking."""
    chunk = _CPU_CHUNK if device.type == "cpu" else _ACCEL_CHUNK
    for s in range(0, n, chunk):
        body(s, min(s + chunk, n))


def generate_into(
    out_flat: Tensor,
    runs: tuple[Tensor, Tensor],
    seed: int,
    stream: str,
    counter: int,
    kind: str,
    params: dict,
) -> None:
    """Fill the 1-D ``out_flat`` with distribution ``kind`` ("normal": mean, std; "trunc_normal": mean, std,
    a, b, absolute bounds) at the global indices ``runs`` gives (see :func:`~titan.rng.shards.flat_indices`).

    Parameters are checked before any element is written.
    """
    from_words, from_native, values = _DISTS[kind]
    key = stream_key(seed, stream)
    counter = _check_counter(counter)
    values(from_words([torch.empty(0, dtype=torch.int64)] * 2), **params)
    use_native = _use_native(out_flat)

    def body(s: int, e: int) -> None:
        if use_native:
            u = from_native(runs, s, e, key, counter)
        else:
            u = from_words(_words(flat_indices(runs, s, e), key, counter, 2))
        with torch.no_grad():
            out_flat[s:e].copy_(values(u, **params))

    _for_chunks(out_flat.numel(), out_flat.device, body)


def keep_mask_into(
    out_flat: Tensor, runs: tuple[Tensor, Tensor], seed: int, stream: str, counter: int, p_keep: float
) -> None:
    """Fill the 1-D bool ``out_flat`` with dropout's keep mask at the global indices ``runs`` gives (see
    :func:`~titan.rng.shards.flat_indices`): True where the element's 24-bit uniform is below ``p_keep``.

    The comparison is done exactly on the 24-bit integer.
    """
    if not 0.0 <= p_keep <= 1.0:
        raise ValueError(f"p_keep must be in [0, 1], got {p_keep}")
    if out_flat.dtype != torch.bool:
        raise TypeError(f"the keep mask is bool, got {out_flat.dtype}")
    key = stream_key(seed, stream)
    counter = _check_counter(counter)
    # u = k / 2**24 < p  <=>  k < ceil(p * 2**24) for integer k (p * 2**24 is exact).
    threshold = math.ceil(p_keep * (1 << 24))
    if _use_native(out_flat):  # no temporaries to bound: one call, which the kernel splits over the threads
        native.keep_mask(runs, 0, out_flat.numel(), key, counter, threshold, out_flat)
        return

    def body(s: int, e: int) -> None:
        (w0,) = _words(flat_indices(runs, s, e), key, counter, 1)
        torch.lt(w0.bitwise_right_shift_(8), threshold, out=out_flat[s:e])

    _for_chunks(out_flat.numel(), out_flat.device, body)


def bernoulli_mask(global_index: Tensor, seed: int, stream: str, counter: int = 0, *, p_keep: float) -> Tensor:
    """Dropout keep-mask of ``global_index``'s shape (see :func:`keep_mask_into`)."""
    if global_index.dtype != torch.int64:
        raise TypeError(f"global_index must be int64, got {global_index.dtype}")
    flat_idx = global_index.reshape(-1)
    out = torch.empty(flat_idx.shape, dtype=torch.bool, device=global_index.device)
    runs = (torch.zeros(1, dtype=torch.int64, device=flat_idx.device), flat_idx)  # one run: the index itself
    keep_mask_into(out, runs, seed, stream, counter, p_keep)
    return out.view(global_index.shape)
