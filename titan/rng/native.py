"""Philox words and the other exact integer and float steps of titan's RNG in C, for CPU tensors.

The torch-op generator (:mod:`philox`) runs ~200 elementwise ops per element, each a pass over memory; in one C
loop an element costs a few nanoseconds (AVX2: four elements per vector, ~40x faster). Only exact steps move here:
the Philox words, dropout's 24-bit comparison, the uniforms (integer to float64 conversions and one multiply),
dropout's multiply and divide in float32, and a shard's global indices; all are IEEE-exact, built with
-ffp-contract=off so nothing is fused. The transcendental transforms (log, cos, erfinv) stay torch ops, so values
are bitwise those of the torch-op path by construction: a C libm or a vectorised erfinv would round differently
somewhere (and torch's erfinv, glibc's erf and exp, is already about as fast as a vectorised approximation here).

The source is compiled on first use with the system C compiler (a second or two) into titan's cache
($TITAN_CACHE, else ~/.cache/titan), keyed by a hash of the source and flags; a torch C++ extension
(``cpp_extension.load_inline``) takes about a minute to build. Without a compiler, on a failed build, or with
TITAN_RNG_NATIVE=0, :func:`library` is None and callers use the torch ops.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch
from torch import Tensor

log = logging.getLogger(__name__)

_SOURCE = r"""
#include <stdint.h>
#if defined(__AVX2__)
#include <immintrin.h>
#endif

enum { BLOCK = 256 };  /* elements per batch of words, on the stack */

static void philox_one(uint64_t index, uint32_t c2, uint32_t c3, uint32_t k0, uint32_t k1,
                       uint32_t *w0, uint32_t *w1) {
    uint32_t c0 = (uint32_t)index, c1 = (uint32_t)(index >> 32);
    for (int r = 0; r < 10; r++) {
        uint64_t p0 = (uint64_t)0xD2511F53u * c0, p1 = (uint64_t)0xCD9E8D57u * c2;
        uint32_t next0 = (uint32_t)(p1 >> 32) ^ c1 ^ k0, next2 = (uint32_t)(p0 >> 32) ^ c3 ^ k1;
        c0 = next0; c1 = (uint32_t)p1; c2 = next2; c3 = (uint32_t)p0;
        k0 += 0x9E3779B9u; k1 += 0xBB67AE85u;
    }
    *w0 = c0; *w1 = c1;
}

#if defined(__AVX2__)
/* Four elements, one 32-bit word per 64-bit lane. _mm256_mul_epu32 multiplies the lanes' low halves into full
   64-bit products, so words that only feed a multiply never need their high halves cleared. */
static void philox_four(const int64_t *index, uint32_t c2s, uint32_t c3s, uint32_t k0, uint32_t k1,
                        uint32_t *w0, uint32_t *w1) {
    const __m256i m0 = _mm256_set1_epi64x(0xD2511F53u), m1 = _mm256_set1_epi64x(0xCD9E8D57u);
    __m256i c0 = _mm256_loadu_si256((const __m256i *)index), c1 = _mm256_srli_epi64(c0, 32);
    __m256i c2 = _mm256_set1_epi64x(c2s), c3 = _mm256_set1_epi64x(c3s);
    for (int r = 0; r < 10; r++) {
        __m256i p0 = _mm256_mul_epu32(c0, m0), p1 = _mm256_mul_epu32(c2, m1);
        c0 = _mm256_xor_si256(_mm256_xor_si256(_mm256_srli_epi64(p1, 32), c1), _mm256_set1_epi64x(k0));
        c2 = _mm256_xor_si256(_mm256_xor_si256(_mm256_srli_epi64(p0, 32), c3), _mm256_set1_epi64x(k1));
        c1 = p1; c3 = p0;
        k0 += 0x9E3779B9u; k1 += 0xBB67AE85u;
    }
    const __m256i low_halves = _mm256_setr_epi32(0, 2, 4, 6, 0, 2, 4, 6);
    _mm_storeu_si128((__m128i *)w0, _mm256_castsi256_si128(_mm256_permutevar8x32_epi32(c0, low_halves)));
    _mm_storeu_si128((__m128i *)w1, _mm256_castsi256_si128(_mm256_permutevar8x32_epi32(c1, low_halves)));
}
#endif

/* Words 0 and 1 of Philox4x32-10 for the counters (index lo, index hi, counter lo, counter hi). */
static void words(const int64_t *index, int64_t n, uint32_t k0, uint32_t k1, uint64_t counter,
                  uint32_t *w0, uint32_t *w1) {
    uint32_t c2 = (uint32_t)counter, c3 = (uint32_t)(counter >> 32);
    int64_t i = 0;
#if defined(__AVX2__)
    for (; i + 4 <= n; i += 4) philox_four(index + i, c2, c3, k0, k1, w0 + i, w1 + i);
#endif
    for (; i < n; i++) philox_one((uint64_t)index[i], c2, c3, k0, k1, w0 + i, w1 + i);
}

/* The global indices of flat positions [start, start + count) of an index given as runs: position p holds
   row_starts[p / n] + last[p % n]. */
static void run_indices(const int64_t *row_starts, const int64_t *last, int64_t n, int64_t start, int64_t count,
                        int64_t *out) {
    int64_t r = start / n, j = start % n;
    for (int64_t i = 0; i < count; r++, j = 0) {
        int64_t m = n - j < count - i ? n - j : count - i;
        for (int64_t t = 0; t < m; t++) out[i + t] = row_starts[r] + last[j + t];
        i += m;
    }
}

/* Positions [start, start + count) a block at a time: their indices and words on the stack, then `body` for
   each element i of the block (output position s + i of the range). */
#define FOR_BLOCKS(body)                                                         \
    int64_t index[BLOCK];                                                        \
    uint32_t w0[BLOCK], w1[BLOCK];                                               \
    for (int64_t s = 0; s < count; s += BLOCK) {                                 \
        int64_t m = count - s < BLOCK ? count - s : BLOCK;                       \
        run_indices(j->row_starts, j->last, j->n, start + s, m, index);          \
        words(index, m, j->k0, j->k1, j->counter, w0, w1);                      \
        for (int64_t i = 0; i < m; i++) { body; }                                \
    }

enum { KEEP_MASK, NORMAL_UNIFORMS, UNIFORM53 };

/* One call: what to draw at which positions of an index given as runs, and where to write it. */
typedef struct {
    int kind;
    const int64_t *row_starts, *last;
    int64_t n, start, count;
    uint32_t k0, k1;
    uint64_t counter;
    uint32_t threshold;
    double angle_scale;
    void *out0, *out1;
} job;

/* Positions [start + offset, start + offset + count) of the job, written from output element `offset`. */
static void run_range(const job *j, int64_t offset, int64_t count) {
    int64_t start = j->start + offset;
    if (j->kind == KEEP_MASK) {
        uint8_t *keep = (uint8_t *)j->out0 + offset;
        FOR_BLOCKS(keep[s + i] = (w0[i] >> 8) < j->threshold)
    } else if (j->kind == NORMAL_UNIFORMS) {
        double *u1 = (double *)j->out0 + offset, *u2 = (double *)j->out1 + offset;
        FOR_BLOCKS(u1[s + i] = ((double)w0[i] + 0.5) * 0x1p-32; u2[s + i] = (double)w1[i] * j->angle_scale)
    } else {
        double *u = (double *)j->out0 + offset;
        FOR_BLOCKS(u[s + i] = (double)(((uint64_t)(w0[i] >> 5) << 26) + (w1[i] >> 6)) * 0x1p-53)
    }
}

/* Each element depends only on its own index, so the job splits into contiguous parts, one per thread. The
   threads are OpenMP's, and the library links the libgomp torch has loaded: they are torch's own intra-op
   threads, which spin for a while after each torch op, so threads of its own would fight them for the cores
   (on 2 cores, between torch ops, the words took 2x as long). */
static void run(const job *j, int threads) {
    enum { MIN_PART = 16384 };
    if (threads > j->count / MIN_PART) threads = (int)(j->count / MIN_PART);
    if (threads < 1) threads = 1;
    int64_t per = (j->count + threads - 1) / threads;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int t = 0; t < threads; t++) {
        int64_t offset = t * per;
        if (offset < j->count) run_range(j, offset, j->count - offset < per ? j->count - offset : per);
    }
}

#define RUNS_ARGS const int64_t *row_starts, const int64_t *last, int64_t n, int64_t start, int64_t count, \
                  uint32_t k0, uint32_t k1, uint64_t counter, int threads
#define JOB(kind) (job){kind, row_starts, last, n, start, count, k0, k1, counter

void titan_keep_mask(RUNS_ARGS, uint32_t threshold, uint8_t *keep) {
    job j = JOB(KEEP_MASK), threshold, 0.0, keep, 0};
    run(&j, threads);
}

void titan_normal_uniforms(RUNS_ARGS, double angle_scale, double *u1, double *u2) {
    job j = JOB(NORMAL_UNIFORMS), 0, angle_scale, u1, u2};
    run(&j, threads);
}

void titan_uniform53(RUNS_ARGS, double *u) {
    job j = JOB(UNIFORM53), 0, 0.0, u, 0};
    run(&j, threads);
}

/* Dropout's float32 arithmetic, rounded as torch's two ops round it: (x * keep) / c, and backward (g / c) * keep. */
void titan_dropout_f32(const float *x, const uint8_t *keep, int64_t n, float c, int backward, float *out) {
    if (backward)
        for (int64_t i = 0; i < n; i++) out[i] = (x[i] / c) * (float)keep[i];
    else
        for (int64_t i = 0; i < n; i++) out[i] = (x[i] * (float)keep[i]) / c;
}
"""

_P, _I64 = ctypes.c_void_p, ctypes.c_int64
# runs, range, key, counter, threads
_RUNS_ARGS = [_P, _P, _I64, _I64, _I64, ctypes.c_uint32, ctypes.c_uint32, ctypes.c_uint64, ctypes.c_int]
_SIGNATURES = {
    "titan_keep_mask": [*_RUNS_ARGS, ctypes.c_uint32, _P],
    "titan_normal_uniforms": [*_RUNS_ARGS, ctypes.c_double, _P, _P],
    "titan_uniform53": [*_RUNS_ARGS, _P],
    "titan_dropout_f32": [_P, _P, _I64, ctypes.c_float, ctypes.c_int, _P],
}


def _flags(openmp: bool) -> list[str]:
    # AVX2 only where the CPU has it: the cached library must run on the machine that loads it, and -march=native
    # would tie a shared cache to one CPU model. The key below includes the flags. Without OpenMP (a compiler
    # lacking it) the kernels run on one thread.
    avx2 = platform.machine().lower() in ("x86_64", "amd64") and torch.backends.cpu.get_cpu_capability() in (
        "AVX2",
        "AVX512",
    )
    extra = [*(["-fopenmp"] if openmp else []), *(["-mavx2"] if avx2 else [])]
    return ["-O3", "-shared", "-fPIC", "-ffp-contract=off", *extra]


def _build(path: Path, compiler: str, flags: list[str]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=path.parent) as tmp:
        src, lib = Path(tmp, "philox.c"), Path(tmp, path.name)
        src.write_text(_SOURCE)
        subprocess.run([compiler, *flags, str(src), "-o", str(lib)], check=True, capture_output=True, timeout=120)
        os.replace(lib, path)  # atomic: ranks building at once each install a complete library


@functools.cache
def library() -> ctypes.CDLL | None:
    """The compiled kernels (built on first use), or None where they cannot be had."""
    if os.environ.get("TITAN_RNG_NATIVE", "1") == "0":
        return None
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if compiler is None:
        log.warning("no C compiler found: titan's RNG runs on torch ops (slower, same values)")
        return None
    from titan.files import cache_root

    for openmp in (True, False):
        flags = _flags(openmp)
        key = hashlib.sha256("\0".join([_SOURCE, compiler, platform.machine(), *flags]).encode()).hexdigest()[:16]
        path = cache_root() / "rng" / f"philox-{key}.so"
        try:
            if not path.exists():
                _build(path, compiler, flags)
            lib = ctypes.CDLL(str(path))
            break
        except (OSError, subprocess.SubprocessError) as e:
            detail = e.stderr.decode(errors="replace")[-2000:] if isinstance(e, subprocess.CalledProcessError) else e
    else:
        log.warning("could not build titan's RNG kernels, running on torch ops (slower, same values): %s", detail)
        return None
    for name, argtypes in _SIGNATURES.items():
        getattr(lib, name).argtypes = argtypes
    return lib


def _check(t: Tensor, dtype: torch.dtype) -> Tensor:
    # A tensor subclass (an AsyncCollectiveTensor from to_local(), a fake tensor) has no data of its own to point at.
    if type(t) is not Tensor or t.dtype != dtype or t.device.type != "cpu":
        raise TypeError(f"the kernels read plain {dtype} CPU tensors, got {type(t).__name__} {t.dtype} on {t.device}")
    return t.contiguous()


def _call(name: str, runs: tuple[Tensor, Tensor], start: int, end: int, key: tuple[int, int], counter: int, *args):
    # The kernel splits the range over as many threads as torch's ops use.
    row_starts, last = (_check(t, torch.int64) for t in runs)
    span = (row_starts.data_ptr(), last.data_ptr(), last.numel(), start, end - start)
    getattr(library(), name)(*span, key[0], key[1], counter, torch.get_num_threads(), *args)


def keep_mask(runs, start: int, end: int, key: tuple[int, int], counter: int, threshold: int, out: Tensor) -> None:
    """``out`` (bool, contiguous, end - start elements) = (word 0 >> 8) < threshold at positions [start, end) of
    the index ``runs`` (see :func:`titan.rng.shards.flat_indices`)."""
    _call("titan_keep_mask", runs, start, end, key, counter, threshold, out.data_ptr())


def normal_uniforms(runs, start: int, end: int, key: tuple[int, int], counter: int, angle_scale: float):
    """Box-Muller's inputs in float64: ((word 0 + 1/2) / 2**32, word 1 * angle_scale)."""
    u1 = torch.empty(end - start, dtype=torch.float64)
    u2 = torch.empty_like(u1)
    _call("titan_normal_uniforms", runs, start, end, key, counter, angle_scale, u1.data_ptr(), u2.data_ptr())
    return u1, u2


def uniform53(runs, start: int, end: int, key: tuple[int, int], counter: int) -> tuple[Tensor]:
    """The 53-bit uniform ((word 0 >> 5) * 2**26 + (word 1 >> 6)) / 2**53 in float64."""
    u = torch.empty(end - start, dtype=torch.float64)
    _call("titan_uniform53", runs, start, end, key, counter, u.data_ptr())
    return (u,)


def dropout_f32(x: Tensor, keep: Tensor, c: float, backward: bool, out: Tensor) -> None:
    """``out`` = (x * keep) / c, or (x / c) * keep when ``backward``, all contiguous float32 (``keep`` bool)."""
    x, keep = _check(x, torch.float32), _check(keep, torch.bool)
    library().titan_dropout_f32(x.data_ptr(), keep.data_ptr(), x.numel(), c, int(backward), out.data_ptr())
