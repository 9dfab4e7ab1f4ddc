"""Tests for titan.rng: Philox correctness, layout independence, statistics."""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import math
import random
import shutil

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset
from torch.distributed.tensor.placement_types import _StridedShard
from torch.testing._internal.distributed.fake_pg import FakeStore

from titan import rng
from titan.rng import native, philox
from titan.rng.philox import bernoulli_mask, stream_key
from titan.rng.shards import ShardIndex, global_indices

M32 = 0xFFFFFFFF
SEED = 1234


def sample(kind, index, seed=SEED, stream="w", counter=0, dtype=torch.float32, **params):
    """Distribution `kind` at arbitrary global indices, through the generation path the fills take."""
    out = torch.empty(index.shape, dtype=dtype)
    flat = index.reshape(-1)
    runs = (torch.zeros(1, dtype=torch.int64), flat)  # one run: the indices themselves
    philox.generate_into(out.view(-1), runs, seed, stream, counter, kind, params)
    return out


def uniform24(index, seed=SEED, stream="w", counter=0):
    """The documented 24-bit uniform dropout compares against: (word 0 >> 8) / 2**24."""
    (w0,) = philox._words(index, stream_key(seed, stream), counter, 1)
    return (w0 >> 8).double() / 2**24


# --------------------------------------------------------------------------------------
# Philox4x32-10
# --------------------------------------------------------------------------------------

# Random123 kat_vectors, philox4x32_10: (counter, key, expected output).
KAT = [
    ([0, 0, 0, 0], [0, 0], [0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8]),
    ([M32] * 4, [M32] * 2, [0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD]),
    (
        [0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344],
        [0xA4093822, 0x299F31D0],
        [0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1],
    ),
]


@pytest.mark.parametrize("counter,key,expected", KAT)
def test_philox_known_answers(counter, key, expected):
    words = philox._philox_words(*(torch.tensor([c]) for c in counter), *key)
    assert all(w.dtype == torch.int64 for w in words)
    assert [w.item() for w in words] == expected
    # as fills and dropout call it: tensors for the index words, Python ints for the counter words and the key
    words = philox._philox_words(torch.tensor([counter[0]]), torch.tensor([counter[1]]), *counter[2:], *key)
    assert [w.item() for w in words] == expected


def philox_reference(counter, key):
    """Scalar Philox4x32-10 with Python ints (arbitrary precision, so no overflow tricks)."""
    c0, c1, c2, c3 = counter
    k0, k1 = key
    for _ in range(10):
        p0 = 0xD2511F53 * c0
        p1 = 0xCD9E8D57 * c2
        c0, c1, c2, c3 = ((p1 >> 32) ^ c1 ^ k0) & M32, p1 & M32, ((p0 >> 32) ^ c3 ^ k1) & M32, p0 & M32
        k0 = (k0 + 0x9E3779B9) & M32
        k1 = (k1 + 0xBB67AE85) & M32
    return [c0, c1, c2, c3]


def _word(r: random.Random) -> int:
    kind = r.randrange(5)
    if kind == 0:
        return r.getrandbits(32)
    if kind == 1:
        return M32 - r.randrange(16)  # just below 2**32
    if kind == 2:
        return r.randrange(16)
    if kind == 3:  # 16-bit half boundaries
        return (r.choice([0xFFFF, 0x10000, 0xFFFF0000, 0x0000FFFF]) + r.randrange(-2, 3)) & M32
    return (1 << r.randrange(32)) + r.choice([-1, 0, 1]) & M32


def test_philox_matches_python_reference():
    r = random.Random(0)
    counters = torch.tensor([[_word(r) for _ in range(4)] for _ in range(400)])
    keys = torch.tensor([[_word(r) for _ in range(2)] for _ in range(400)])
    out = torch.stack(philox._philox_words(*counters.unbind(1), *keys.unbind(1)), dim=1)
    assert out.tolist() == [philox_reference(c, k) for c, k in zip(counters.tolist(), keys.tolist())]
    # the shortcut for one or two words gives the same first words
    for need in (1, 2):
        short = philox._philox_words(*counters.unbind(1), *keys.unbind(1), need=need)
        assert torch.equal(torch.stack(short, dim=1), out[:, :need])


def test_elements_use_documented_counter_layout():
    """normal, trunc_normal and the keep mask are the documented functions of one Philox block per element."""
    seed, stream = 7, "layers.3.attention.wq.weight"
    key = stream_key(seed, stream)
    idx = [0, 1, 5, M32, 1 << 32, (1 << 40) + 12345, (1 << 62) + 3]
    t = torch.tensor(idx)
    for counter in [0, 9, M32, (1 << 32) + 5, (1 << 64) - 1]:
        words = [philox_reference([i & M32, i >> 32, counter & M32, counter >> 32], key) for i in idx]
        for p_keep in (0.5, 0.3):
            m = bernoulli_mask(t, seed, stream, counter, p_keep=p_keep)
            assert m.tolist() == [(w[0] >> 8) / 2**24 < p_keep for w in words]
        z = sample("normal", t, seed, stream, counter, dtype=torch.float64)
        ref = [
            math.sqrt(-2.0 * math.log((w[0] + 0.5) / 2**32)) * math.cos(2.0 * math.pi * (w[1] / 2**32)) for w in words
        ]
        torch.testing.assert_close(z, torch.tensor(ref, dtype=torch.float64), rtol=1e-13, atol=1e-13)
        mean, std, a, b = 0.1, 2.0, -1.0, 2.5
        x = sample("trunc_normal", t, seed, stream, counter, dtype=torch.float64, mean=mean, std=std, a=a, b=b)
        lo, hi = (math.erf((v - mean) / std / math.sqrt(2)) for v in (a, b))  # 2 Phi(.) - 1
        u53 = torch.tensor([((w[0] >> 5) * 2**26 + (w[1] >> 6)) / 2**53 for w in words], dtype=torch.float64)
        ref = torch.erfinv(lo + u53 * (hi - lo)) * std * math.sqrt(2) + mean
        torch.testing.assert_close(x, ref, rtol=1e-12, atol=1e-12)


def test_trunc_normal_extreme_words_stay_inside_bounds():
    """The smallest / largest 53-bit uniforms map to the bounds; the clamp catches erfinv rounding."""
    words = [torch.tensor([0, M32]), torch.tensor([0, M32])]
    for mean, std, a, b in [(0.0, 1.0, -2.0, 2.0), (0.0, 1.0, -0.1, 0.3), (1.0, 3.0, -5.0, 0.2)]:
        x = philox._trunc_normal_from_words([w.clone() for w in words], mean, std, a, b)
        assert x[0].item() == a and a < x[1].item() <= b
        assert b - x[1].item() < 1e-12


def test_stream_key_is_documented_blake2b():
    for seed, stream in [(0, ""), (1, "tok_embeddings.weight"), ((1 << 40) + 3, "x"), (-1, "y")]:
        s = seed % (1 << 64)
        h = int.from_bytes(
            hashlib.blake2b(
                stream.encode(), digest_size=8, person=b"titan.rng.v1", salt=(s >> 32).to_bytes(8, "little")
            ).digest(),
            "little",
        )
        assert stream_key(seed, stream) == ((s & M32) ^ (h >> 32), h & M32)
    # distinct seeds below 2**32 never collide for one stream; streams differ for one seed
    assert len({stream_key(s, "w") for s in range(1000)}) == 1000
    assert len({stream_key(0, f"layers.{i}.w") for i in range(1000)}) == 1000
    with pytest.raises(TypeError):
        stream_key(1.0, "w")


# --------------------------------------------------------------------------------------
# Determinism and independence of seeds / streams / counters
# --------------------------------------------------------------------------------------

GENERATORS = {
    "normal": lambda idx, seed, stream, counter: sample("normal", idx, seed, stream, counter, mean=0.1, std=0.02),
    "trunc_normal": lambda idx, seed, stream, counter: sample(
        "trunc_normal", idx, seed, stream, counter, std=0.02, a=-0.04, b=0.03
    ),
    "mask": lambda idx, seed, stream, counter: bernoulli_mask(idx, seed, stream, counter, p_keep=0.5),
}


@pytest.mark.parametrize("kind", sorted(GENERATORS))
def test_same_inputs_same_values_and_any_change_differs(kind):
    gen = GENERATORS[kind]
    idx = torch.arange(4096)
    base = gen(idx, SEED, "w", 3)
    assert torch.equal(base, gen(idx.clone(), SEED, "w", 3))
    # values depend on the index itself, not on the position in the input tensor
    perm = torch.randperm(4096, generator=torch.Generator().manual_seed(0))
    assert torch.equal(gen(idx[perm], SEED, "w", 3), base[perm])
    for other in [gen(idx, SEED + 1, "w", 3), gen(idx, SEED, "w2", 3), gen(idx, SEED, "w", 4)]:
        same = (other == base).float().mean().item()
        assert same < (0.6 if kind == "mask" else 0.01), same


def test_streams_counters_and_neighbours_are_uncorrelated():
    n = 200_000
    idx = torch.arange(n)
    a = sample("normal", idx, SEED, "a", 0, dtype=torch.float64)
    others = [
        sample("normal", idx, SEED, "b", 0, dtype=torch.float64),
        sample("normal", idx, SEED, "a", 1, dtype=torch.float64),
        sample("normal", idx, SEED + 1, "a", 0, dtype=torch.float64),
        sample("normal", idx + 1, SEED, "a", 0, dtype=torch.float64),  # neighbouring elements
    ]
    for b in others:
        corr = torch.corrcoef(torch.stack([a, b]))[0, 1].item()
        assert abs(corr) < 6 / math.sqrt(n), corr


def test_dtype_is_a_single_rounding_of_the_float64_value():
    for fill in (rng.normal_, rng.trunc_normal_):
        ref = fill(torch.empty(10_000, dtype=torch.float64), seed=SEED, stream="w")
        for dt in (torch.float32, torch.bfloat16, torch.float16):
            assert torch.equal(fill(torch.empty(10_000, dtype=dt), seed=SEED, stream="w"), ref.to(dt))


def test_chunking_does_not_change_values(monkeypatch):
    shape = (5, 7, 11)
    idx = torch.arange(math.prod(shape)).view(shape)

    def draw(x):
        return rng.trunc_normal_(x, std=0.02, a=-0.04, b=0.03, seed=SEED, stream="w")

    ref = draw(torch.empty(shape))
    ref_mask = bernoulli_mask(idx, SEED, "w", 2, p_keep=0.5)
    assert torch.equal(ref, sample("trunc_normal", idx, std=0.02, a=-0.04, b=0.03))
    monkeypatch.setattr(philox, "_CPU_CHUNK", 13)
    assert torch.equal(draw(torch.zeros(shape)), ref)
    assert torch.equal(bernoulli_mask(idx, SEED, "w", 2, p_keep=0.5), ref_mask)
    # a parameter that requires grad, filled in several chunks
    p = torch.nn.Parameter(torch.zeros(shape))
    draw(p)
    assert torch.equal(p.detach(), ref) and p.requires_grad and p.grad_fn is None


def test_fill_of_plain_tensors():
    shape = (6, 9)
    idx = torch.arange(54).view(shape)
    x = torch.empty(shape, dtype=torch.float64)
    assert rng.normal_(x, 0.5, 2.0, seed=SEED, stream="w") is x
    assert torch.equal(x, sample("normal", idx, dtype=torch.float64, mean=0.5, std=2.0))
    # non-contiguous view: values follow the view's logical (row-major) positions
    t = torch.empty(9, 6).t()
    rng.trunc_normal_(t, seed=SEED, stream="w")
    assert torch.equal(t, sample("trunc_normal", idx))
    # parameters that require grad, and meta tensors
    p = torch.nn.Parameter(torch.empty(shape))
    rng.normal_(p, std=0.02, seed=SEED, stream="w")
    assert torch.equal(p.detach(), sample("normal", idx, std=0.02))
    rng.normal_(torch.empty(shape, device="meta"), seed=SEED, stream="w")
    with pytest.raises(TypeError):
        rng.normal_(torch.empty(shape, dtype=torch.int64), seed=SEED, stream="w")
    # bad parameters are rejected before anything is written
    before = x.clone()
    with pytest.raises(ValueError):
        rng.trunc_normal_(x, a=1.0, b=-1.0, seed=SEED, stream="w")
    with pytest.raises(ValueError):
        rng.normal_(x, std=-1.0, seed=SEED, stream="w")
    assert torch.equal(x, before)
    for counter in (-1, 1 << 64):
        with pytest.raises(ValueError):
            bernoulli_mask(idx, SEED, "w", counter, p_keep=0.5)


def test_dropout_of_plain_tensors():
    """Dropout keeps where the mask of (module name, step, global row and position) is True and scales by 1/(1-p)."""
    drop = rng.Dropout(0.25)
    drop.stream, drop.seed = "layers.1.ffn_dropout", 42
    x = torch.randn(4, 6, 8, generator=torch.Generator().manual_seed(0))
    rows = torch.tensor([7, 2, 9, 4])
    mask = bernoulli_mask(rows.view(-1, 1, 1) * 48 + torch.arange(48).view(6, 8), 42, drop.stream, 5, p_keep=0.75)
    with rng.dropout_step(5):
        assert torch.equal(drop(x, rows), x * mask.float() / 0.75)
        # a row's mask does not depend on which other rows are in the batch
        assert torch.equal(drop(x[1:3], rows[1:3]), drop(x, rows)[1:3])
    assert not torch.equal(drop(x, rows), x * mask.float() / 0.75)  # outside, the step is 0
    drop.eval()
    assert drop(x, rows) is x


# --------------------------------------------------------------------------------------
# The C kernels against the torch-op path (the fallback where no C compiler is found)
# --------------------------------------------------------------------------------------


def test_native_kernels_build_where_a_compiler_is():
    if not any(shutil.which(c) for c in ("cc", "gcc", "clang")):
        pytest.skip("no C compiler here: the torch-op path is the only one")
    assert native.library() is not None


def test_native_path_is_bitwise_the_torch_op_path(monkeypatch):
    """A few million elements of every distribution, at indices above 2**32 and non-zero counters."""
    if native.library() is None:
        pytest.skip("no C compiler here: the torch-op path is the only one")
    n = 1 << 20
    cases = [
        (torch.arange(n) + (1 << 32) - n // 2, (1 << 32) + 5),  # the index's high word goes from 0 to 1
        (torch.randint(0, 2**63 - 1, (n,), generator=torch.Generator().manual_seed(0)), (1 << 64) - 1),
    ]
    draws = {
        "normal": lambda idx, c: sample("normal", idx, SEED, "w", c, mean=0.1, std=0.02),
        "normal float64": lambda idx, c: sample("normal", idx, SEED, "w", c, dtype=torch.float64),
        "trunc_normal": lambda idx, c: sample("trunc_normal", idx, SEED, "w", c, std=0.02, a=-0.04, b=0.03),
        "trunc_normal bfloat16": lambda idx, c: sample(
            "trunc_normal", idx, SEED, "w", c, dtype=torch.bfloat16, mean=1.0, std=3.0, a=-5.0, b=0.2
        ),
        "mask": lambda idx, c: bernoulli_mask(idx, SEED, "w", c, p_keep=0.9),
    }
    native_values = {(name, i): draw(*case) for name, draw in draws.items() for i, case in enumerate(cases)}
    monkeypatch.setattr(native, "library", lambda: None)
    for (name, i), values in native_values.items():
        assert torch.equal(values, draws[name](*cases[i])), (name, i)


def test_native_kernels_run_on_torch_s_openmp_threads_and_draw_as_a_serial_build(monkeypatch, tmp_path):
    """Built with OpenMP, the kernels use the libgomp torch loaded, not a second runtime whose threads would fight
    torch's for the cores; built without it (a compiler lacking OpenMP) they draw the same values on one thread."""
    if native.library() is None:
        pytest.skip("no C compiler here: the torch-op path is the only one")
    with open("/proc/self/maps") as maps:
        runtimes = {line.split()[-1] for line in maps if "libgomp" in line}
    assert len(runtimes) == 1, runtimes
    idx = torch.arange(1 << 21) + (1 << 32)

    def draw():
        return [bernoulli_mask(idx, SEED, "w", 3, p_keep=0.9), sample("trunc_normal", idx, SEED, "w", 0, std=0.02)]

    threaded = draw()
    serial_flags = native._flags(openmp=False)
    monkeypatch.setenv("TITAN_CACHE", str(tmp_path))
    monkeypatch.setattr(native, "_flags", lambda openmp: serial_flags)
    native.library.cache_clear()
    try:
        serial = draw()
        assert list((tmp_path / "rng").glob("philox-*.so"))  # this test's serial build, not the cached one
    finally:
        native.library.cache_clear()
    assert all(torch.equal(a, b) for a, b in zip(threaded, serial))


def test_native_dropout_is_bitwise_the_torch_ops_with_gradients(monkeypatch):
    """Dropout's float32 multiply and divide in C round as torch's ops do, forward and backward, bit for bit
    (infinities, NaN and signed zeros included)."""
    if native.library() is None:
        pytest.skip("no C compiler here: the torch-op path is the only one")
    g = torch.Generator().manual_seed(0)
    x = torch.randn(6, 40, 50, generator=g) * 10
    x.view(-1)[:5] = torch.tensor([float("inf"), float("-inf"), float("nan"), -0.0, 1e-40])
    grad = torch.randn(x.shape, generator=g)
    grad.view(-1)[:3] = torch.tensor([float("nan"), float("inf"), -0.0])
    rows = torch.tensor([5, 0, 9, 2, 7, 1])

    def run():
        leaf = x.clone().requires_grad_()
        out = rng.fills.dropout(leaf, 0.3, rows, seed=SEED, stream="d", step=7)
        out.backward(grad)
        return out.detach().view(torch.int32), leaf.grad.view(torch.int32)

    fast = run()
    monkeypatch.setattr(native, "library", lambda: None)
    slow = run()
    assert torch.equal(fast[0], slow[0]) and torch.equal(fast[1], slow[1])


# --------------------------------------------------------------------------------------
# Statistics (1e6 samples; bounds are 6 standard errors unless stated)
# --------------------------------------------------------------------------------------

N = 1_000_000
KS_BOUND = 1.63 / math.sqrt(N) * 1.5  # 1.5x the 1% critical value of the KS statistic


def ks_statistic(samples: torch.Tensor, cdf) -> float:
    x, _ = torch.sort(samples.to(torch.float64))
    f = cdf(x)
    n = x.numel()
    i = torch.arange(1, n + 1, dtype=torch.float64)
    return max((i / n - f).max().item(), (f - (i - 1) / n).max().item())


def phi(x):
    return torch.exp(-0.5 * x * x) / math.sqrt(2 * math.pi)


@pytest.fixture(scope="module")
def big_index():
    return torch.arange(N) + (1 << 33)  # exercise the high index word too


def test_uniform_statistics(big_index):
    u = uniform24(big_index, SEED, "stats", 5)
    assert u.min() >= 0.0 and u.max() < 1.0
    assert abs(u.mean().item() - 0.5) < 6 * math.sqrt(1 / 12 / N)
    var_se = math.sqrt((1 / 80 - 1 / 144) / N)  # (mu4 - sigma^4) / n
    assert abs(u.var().item() - 1 / 12) < 6 * var_se
    assert ks_statistic(u, lambda x: x) < KS_BOUND


def test_normal_statistics(big_index):
    mean, std = 0.25, 3.0
    z = sample("normal", big_index, SEED, "stats", 5, mean=mean, std=std).double()
    assert abs(z.mean().item() - mean) < 6 * std / math.sqrt(N)
    assert abs(z.var().item() / std**2 - 1.0) < 6 * math.sqrt(2 / N)
    assert ks_statistic(z, lambda x: torch.special.ndtr((x - mean) / std)) < KS_BOUND
    assert torch.isfinite(z).all()


@pytest.mark.parametrize("mean,std,a,b", [(0.0, 1.0, -2.0, 2.0), (0.5, 2.0, -1.0, 3.0), (0.0, 0.02, -0.04, 0.01)])
def test_trunc_normal_statistics(big_index, mean, std, a, b):
    x = sample("trunc_normal", big_index, SEED, "stats", 5, mean=mean, std=std, a=a, b=b).double()
    assert x.min() >= a and x.max() <= b
    al, be = (a - mean) / std, (b - mean) / std
    t = torch.tensor([al, be], dtype=torch.float64)
    cdf_a, cdf_b = torch.special.ndtr(t).tolist()
    pdf_a, pdf_b = phi(t).tolist()
    z = cdf_b - cdf_a
    mu = mean + std * (pdf_a - pdf_b) / z
    var = std**2 * (1 + (al * pdf_a - be * pdf_b) / z - ((pdf_a - pdf_b) / z) ** 2)
    assert abs(x.mean().item() - mu) < 6 * math.sqrt(var / N)
    m4 = ((x - mu) ** 4).mean().item()
    assert abs(x.var().item() - var) < 6 * math.sqrt((m4 - var**2) / N)
    ks = ks_statistic(x, lambda v: (torch.special.ndtr((v - mean) / std) - cdf_a) / z)
    assert ks < KS_BOUND


def test_bernoulli_mask_statistics(big_index):
    u = uniform24(big_index, SEED, "drop", 2)
    for p in [0.9, 0.1, 0.5]:
        m = bernoulli_mask(big_index, SEED, "drop", 2, p_keep=p)
        assert m.dtype == torch.bool
        assert abs(m.double().mean().item() - p) < 6 * math.sqrt(p * (1 - p) / N)
        assert torch.equal(m, u < p)
    # exact at the boundary: keep iff u < p_keep, with p_keep equal to / just above a drawn u
    idx = big_index[:64]
    for i in range(64):
        p = u[i].item()
        assert not bernoulli_mask(idx[i : i + 1], SEED, "drop", 2, p_keep=p).item()
        assert bernoulli_mask(idx[i : i + 1], SEED, "drop", 2, p_keep=p + 2**-30).item()
    assert bernoulli_mask(big_index[:1000], SEED, "d", p_keep=1.0).all()
    assert not bernoulli_mask(big_index[:1000], SEED, "d", p_keep=0.0).any()


# --------------------------------------------------------------------------------------
# Sharding: a shard's global indices, fills and dropout are bitwise the slice of the full tensor
# --------------------------------------------------------------------------------------


def ref_split(full: torch.Tensor, mesh_shape, coord, placements) -> torch.Tensor:
    """This rank's shard by DTensor's own splitting (what distribute_tensor does), mesh dims in order."""
    t = full
    for md, p in enumerate(placements):
        if isinstance(p, (Shard, _StridedShard)):
            shards, _ = p._split_tensor(t, mesh_shape[md], with_padding=False, contiguous=False)
            t = shards[coord[md]]
    return t


def ref_offset_slice(full: torch.Tensor, mesh_shape, coord, placements) -> torch.Tensor:
    """This rank's shard from torch's compute_local_shape_and_global_offset (Shard placements only)."""
    shape, offset = _compute_local_shape_and_global_offset(
        tuple(full.shape), tuple(mesh_shape), list(coord), placements
    )
    return full[tuple(slice(o, o + s) for o, s in zip(offset, shape))]


MESHES = [(2,), (3,), (2, 2), (2, 3)]
SHAPES = [(5, 7), (9, 10, 11), (33, 11, 13)]


def layouts(shape, mesh_shape, partial=True):
    """Every mix of Replicate, (Partial,) and Shard over the mesh dims, and FSDP2-over-TP strided shards."""
    options = [Replicate()] + [Partial()] * partial + [Shard(d) for d in range(len(shape))]
    out = [list(p) for p in itertools.product(options, repeat=len(mesh_shape))]
    if len(mesh_shape) == 2:
        out += [[_StridedShard(d, split_factor=mesh_shape[1]), Shard(d)] for d in range(len(shape))]
    return out


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_global_indices_are_dtensors_split(shape):
    """Every rank's indices are DTensor's own shard of arange, and together they cover the tensor once per replica."""
    full = torch.arange(math.prod(shape)).view(shape)
    for mesh_shape in MESHES:
        for placements in layouts(shape, mesh_shape):
            sharded = [isinstance(p, (Shard, _StridedShard)) for p in placements]
            n_replicas = math.prod(n for n, s in zip(mesh_shape, sharded) if not s)
            covered = torch.zeros(full.numel(), dtype=torch.int64)
            for coord in itertools.product(*(range(n) for n in mesh_shape)):
                gi = global_indices(shape, mesh_shape, coord, placements)
                expected = ref_split(full, mesh_shape, coord, placements)
                assert gi.shape == expected.shape and torch.equal(gi, expected), (mesh_shape, coord, placements)
                if not any(isinstance(p, _StridedShard) for p in placements):
                    assert torch.equal(expected, ref_offset_slice(full, mesh_shape, coord, placements))
                covered.index_add_(0, gi.reshape(-1), torch.ones(gi.numel(), dtype=torch.int64))
            assert torch.equal(covered, torch.full_like(covered, n_replicas)), (mesh_shape, placements)


@pytest.mark.parametrize(
    "shape,mesh_shape,placements",
    [
        # FSDP2 over TP on dim 0: dp mesh dim gets _StridedShard(0, split_factor=tp)
        ((12, 5), (2, 3), [_StridedShard(0, split_factor=3), Shard(0)]),
        ((7, 3), (3, 2), [_StridedShard(0, split_factor=2), Shard(0)]),  # uneven, with empty shards
        ((9, 10, 11), (2, 2), [_StridedShard(1, split_factor=3), Partial()]),
        ((9, 10, 11), (3,), [_StridedShard(1, split_factor=2)]),
    ],
)
def test_strided_shard(shape, mesh_shape, placements):
    full = torch.arange(math.prod(shape)).view(shape)
    for coord in itertools.product(*(range(n) for n in mesh_shape)):
        gi = global_indices(shape, mesh_shape, coord, placements)
        assert torch.equal(gi, ref_split(full, mesh_shape, coord, placements))


def test_strided_shard_is_right_to_left_sharding_when_even():
    """[_StridedShard(0, sf=tp), Shard(0)] on (dp, tp) = chunk by tp first, then by dp (FSDP2 over TP)."""
    full = torch.arange(12 * 5).view(12, 5)
    dp, tp = 2, 3
    for d, t in itertools.product(range(dp), range(tp)):
        gi = global_indices((12, 5), (dp, tp), (d, t), [_StridedShard(0, split_factor=tp), Shard(0)])
        assert torch.equal(gi, full.chunk(tp)[t].chunk(dp)[d])


def test_negative_shard_dim_and_errors():
    a = global_indices((4, 6), (2,), (1,), [Shard(-1)])
    assert torch.equal(a, global_indices((4, 6), (2,), (1,), [Shard(1)]))
    with pytest.raises(ValueError):
        global_indices((4, 6), (2,), (2,), [Shard(0)])  # coordinate out of range
    with pytest.raises(ValueError):
        global_indices((4, 6), (2,), (0,), [Shard(2)])


@pytest.mark.parametrize("path", ["native", "torch ops"])
def test_flat_ranges_are_slices_of_the_full_index(path, monkeypatch):
    """flat(s, e), whatever rows the range starts and stops in, is full()[s:e]; rows replace dim 0's indices."""
    if path == "torch ops":
        monkeypatch.setattr(native, "library", lambda: None)
    r = random.Random(0)
    for shape, mesh_shape in [((9, 10, 11), (2, 3)), ((33, 7), (3,)), ((40,), (3,)), ((5, 1), (2,))]:
        for placements in layouts(shape, mesh_shape, partial=False):
            for coord in itertools.product(*(range(n) for n in mesh_shape)):
                index = ShardIndex(shape, mesh_shape, coord, placements)
                full = index.full().reshape(-1)
                for _ in range(4):
                    s = r.randrange(full.numel() + 1)
                    e = r.randrange(s, full.numel() + 1)
                    assert torch.equal(index.flat(s, e), full[s:e]), (shape, placements, coord, s, e)
    rows = torch.tensor([7, 2, 9])
    expected = (rows.view(-1, 1, 1) * 20 + torch.arange(20).view(4, 5)).reshape(-1)
    index = ShardIndex((3, 4, 5), rows=rows)
    assert torch.equal(index.full().reshape(-1), expected)
    assert all(torch.equal(index.flat(s, e), expected[s:e]) for s, e in [(0, 60), (3, 27), (20, 40), (41, 42)])


@contextlib.contextmanager
def as_rank(rank: int, world: int):
    """This process as rank `rank` of `world` on torch's fake process group: real DTensors, no peers."""
    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    dist.init_process_group("fake", rank=rank, world_size=world, store=FakeStore())
    try:
        yield
    finally:
        dist.destroy_process_group()


def local_dtensor(shape, mesh, placements, dtype=torch.float32, fill=0.0):
    local_shape = ref_split(torch.empty(shape), mesh.shape, mesh.get_coordinate(), placements).shape
    local = torch.full(local_shape, fill, dtype=dtype)
    return DTensor.from_local(
        local, mesh, placements, shape=torch.Size(shape), stride=torch.empty(shape).stride(), run_check=False
    )


DROP_STEP = 4


def one_process(shape):
    """What one process draws for the whole tensor: the fills, and dropout of ones at global rows 3, 5, ..."""
    drop = rng.Dropout(0.3)
    drop.stream, drop.seed = "layers.0.attention.dropout", 9
    with rng.dropout_step(DROP_STEP):
        dropped = drop(torch.ones(shape), 3 + 2 * torch.arange(shape[0]))
    return {
        "normal": rng.normal_(torch.empty(shape), 0.1, 0.02, seed=SEED, stream="w"),
        "trunc_normal": rng.trunc_normal_(
            torch.empty(shape, dtype=torch.bfloat16), 0.0, 1.0, -0.5, 1.5, seed=SEED, stream="w"
        ),
        "dropout": dropped,
    }, drop


@pytest.mark.parametrize("mesh_shape", MESHES, ids=str)
def test_dtensor_fills_and_dropout_are_slices_of_one_process(mesh_shape):
    """On every rank of every layout, the public fills and Dropout give a DTensor's local tensor exactly the
    slice of what one process draws (each rank is played in turn on a fake process group)."""
    fulls = {shape: one_process(shape) for shape in SHAPES}
    for rank in range(math.prod(mesh_shape)):
        with as_rank(rank, math.prod(mesh_shape)):
            mesh = init_device_mesh("cpu", mesh_shape)
            coord = mesh.get_coordinate()
            for shape, (full, drop) in fulls.items():
                for placements in layouts(shape, mesh_shape):
                    d = local_dtensor(shape, mesh, placements)
                    gi = global_indices(shape, mesh_shape, coord, placements)
                    assert torch.equal(rng.dtensor_global_indices(d), gi)
                    if any(isinstance(p, Partial) for p in placements):
                        with pytest.raises(ValueError):  # writing every rank would multiply a Partial("sum") value
                            rng.normal_(d, seed=SEED, stream="w")
                    else:
                        rng.normal_(d, 0.1, 0.02, seed=SEED, stream="w")
                        assert torch.equal(d.to_local(), ref_split(full["normal"], mesh_shape, coord, placements))
                        d = local_dtensor(shape, mesh, placements, torch.bfloat16)
                        rng.trunc_normal_(d, 0.0, 1.0, -0.5, 1.5, seed=SEED, stream="w")
                        assert torch.equal(d.to_local(), ref_split(full["trunc_normal"], mesh_shape, coord, placements))
                    if any(isinstance(p, (Shard, _StridedShard)) and p.dim in (0, -len(shape)) for p in placements):
                        continue  # a sharded batch dim arrives as plain local rows, not as a DTensor
                    # Partial too: every rank drops the same elements of its partial value
                    x = local_dtensor(shape, mesh, placements, fill=1.0)
                    with rng.dropout_step(DROP_STEP):
                        out = drop(x, 3 + 2 * torch.arange(shape[0]))
                    assert torch.equal(out.to_local(), ref_split(full["dropout"], mesh_shape, coord, placements))


def test_rank_outside_the_mesh_holds_nothing():
    with as_rank(3, 4):
        d = DTensor.from_local(
            torch.empty(0),
            DeviceMesh("cpu", [0, 1]),
            [Shard(0)],
            shape=torch.Size((6, 4)),
            stride=(4, 1),
            run_check=False,
        )
        assert d.to_local().numel() == 0
        assert rng.dtensor_global_indices(d).numel() == 0
        assert rng.normal_(d, seed=SEED, stream="w") is d
