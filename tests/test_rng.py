"""Tests for titan.parallel.rng: Philox correctness, layout independence, statistics."""

from __future__ import annotations

import hashlib
import itertools
import math
import random

import pytest
import torch
from torch.distributed.tensor import Partial, Replicate, Shard
from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset
from torch.distributed.tensor.placement_types import _StridedShard

from titan.parallel import rng

M32 = 0xFFFFFFFF
SEED = 1234


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
    out = rng.philox4x32(torch.tensor(counter), torch.tensor(key))
    assert out.dtype == torch.int64
    assert out.tolist() == expected


def philox_reference(counter, key, rounds=10):
    """Scalar Philox4x32 with Python ints (arbitrary precision, so no overflow tricks)."""
    c0, c1, c2, c3 = counter
    k0, k1 = key
    for _ in range(rounds):
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
    counters = [[_word(r) for _ in range(4)] for _ in range(400)]
    keys = [[_word(r) for _ in range(2)] for _ in range(400)]
    out = rng.philox4x32(torch.tensor(counters), torch.tensor(keys))
    expected = [philox_reference(c, k) for c, k in zip(counters, keys)]
    assert out.tolist() == expected
    # other round counts and a broadcast key
    out7 = rng.philox4x32(torch.tensor(counters), torch.tensor(keys[0]), rounds=7)
    assert out7.tolist() == [philox_reference(c, keys[0], rounds=7) for c in counters]


def test_elements_use_documented_counter_layout():
    """uniform/normal/mask are the documented functions of one Philox block per element."""
    seed, stream = 7, "layers.3.attention.wq.weight"
    key = rng.stream_key(seed, stream)
    idx = [0, 1, 5, M32, 1 << 32, (1 << 40) + 12345, (1 << 62) + 3]
    for counter in [0, 9, M32, (1 << 32) + 5, (1 << 64) - 1]:
        words = [philox_reference([i & M32, i >> 32, counter & M32, counter >> 32], key) for i in idx]
        t = torch.tensor(idx)
        u = rng.uniform(t, seed, stream, counter, dtype=torch.float64)
        assert u.tolist() == [(w[0] >> 8) / 2**24 for w in words]
        z = rng.normal(t, seed, stream, counter, dtype=torch.float64)
        ref = [
            math.sqrt(-2.0 * math.log((w[0] + 0.5) / 2**32)) * math.cos(2.0 * math.pi * (w[1] / 2**32))
            for w in words
        ]
        torch.testing.assert_close(z, torch.tensor(ref, dtype=torch.float64), rtol=1e-13, atol=1e-13)
        m = rng.bernoulli_mask(t, seed, stream, counter, p_keep=0.5)
        assert m.tolist() == [(w[0] >> 8) < (1 << 23) for w in words]
        mean, std, a, b = 0.1, 2.0, -1.0, 2.5
        x = rng.trunc_normal(t, seed, stream, counter, mean=mean, std=std, a=a, b=b, dtype=torch.float64)
        lo, hi = (math.erf((v - mean) / std / math.sqrt(2)) for v in (a, b))  # 2 Phi(.) - 1
        u53 = torch.tensor([((w[0] >> 5) * 2**26 + (w[1] >> 6)) / 2**53 for w in words], dtype=torch.float64)
        ref = torch.erfinv(lo + u53 * (hi - lo)) * std * math.sqrt(2) + mean
        torch.testing.assert_close(x, ref, rtol=1e-12, atol=1e-12)


def test_trunc_normal_extreme_words_stay_inside_bounds():
    """The smallest / largest 53-bit uniforms map to the bounds; the clamp catches erfinv rounding."""
    words = [torch.tensor([0, M32]), torch.tensor([0, M32])]
    for mean, std, a, b in [(0.0, 1.0, -2.0, 2.0), (0.0, 1.0, -0.1, 0.3), (1.0, 3.0, -5.0, 0.2)]:
        x = rng._trunc_normal_from_words([w.clone() for w in words], mean, std, a, b)
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
        assert rng.stream_key(seed, stream) == ((s & M32) ^ (h >> 32), h & M32)
    # distinct seeds below 2**32 never collide for one stream; streams differ for one seed
    assert len({rng.stream_key(s, "w") for s in range(1000)}) == 1000
    assert len({rng.stream_key(0, f"layers.{i}.w") for i in range(1000)}) == 1000
    with pytest.raises(TypeError):
        rng.stream_key(1.0, "w")


# --------------------------------------------------------------------------------------
# Determinism and independence of seeds / streams / counters
# --------------------------------------------------------------------------------------

GENERATORS = {
    "uniform": lambda idx, seed, stream, counter: rng.uniform(idx, seed, stream, counter),
    "normal": lambda idx, seed, stream, counter: rng.normal(idx, seed, stream, counter, mean=0.1, std=0.02),
    "trunc_normal": lambda idx, seed, stream, counter: rng.trunc_normal(
        idx, seed, stream, counter, std=0.02, a=-0.04, b=0.03
    ),
    "mask": lambda idx, seed, stream, counter: rng.bernoulli_mask(idx, seed, stream, counter, p_keep=0.5),
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
    a = rng.normal(idx, SEED, "a", 0, dtype=torch.float64)
    others = [
        rng.normal(idx, SEED, "b", 0, dtype=torch.float64),
        rng.normal(idx, SEED, "a", 1, dtype=torch.float64),
        rng.normal(idx, SEED + 1, "a", 0, dtype=torch.float64),
        rng.normal(idx + 1, SEED, "a", 0, dtype=torch.float64),  # neighbouring elements
    ]
    for b in others:
        corr = torch.corrcoef(torch.stack([a, b]))[0, 1].item()
        assert abs(corr) < 6 / math.sqrt(n), corr


def test_dtype_is_a_single_rounding_of_the_float64_value():
    idx = torch.arange(10_000)
    for fn in (rng.uniform, rng.normal, rng.trunc_normal):
        ref = fn(idx, SEED, "w", dtype=torch.float64)
        for dt in (torch.float32, torch.bfloat16, torch.float16):
            assert torch.equal(fn(idx, SEED, "w", dtype=dt), ref.to(dt))


def test_chunking_and_threads_do_not_change_values(monkeypatch):
    idx = torch.arange(5 * 7 * 11).view(5, 7, 11)
    x = torch.empty(5, 7, 11)
    ref = {k: g(idx, SEED, "w", 2) for k, g in GENERATORS.items()}
    rng.trunc_normal_(x, std=0.02, a=-0.04, b=0.03, seed=SEED, stream="w", counter=2)
    assert torch.equal(x, ref["trunc_normal"])
    monkeypatch.setattr(rng, "_CPU_CHUNK", 13)
    for k, g in GENERATORS.items():
        assert torch.equal(g(idx, SEED, "w", 2), ref[k]), k
    y = torch.zeros(5, 7, 11)
    rng.trunc_normal_(y, std=0.02, a=-0.04, b=0.03, seed=SEED, stream="w", counter=2)
    assert torch.equal(y, ref["trunc_normal"])
    # a parameter that requires grad, filled by several worker threads
    p = torch.nn.Parameter(torch.zeros(5, 7, 11))
    rng.trunc_normal_(p, std=0.02, a=-0.04, b=0.03, seed=SEED, stream="w", counter=2)
    assert torch.equal(p.detach(), ref["trunc_normal"]) and p.requires_grad and p.grad_fn is None


def test_fill_of_plain_tensors():
    shape = (6, 9)
    idx = torch.arange(54).view(shape)
    x = torch.empty(shape, dtype=torch.float64)
    assert rng.normal_(x, 0.5, 2.0, seed=SEED, stream="w", counter=1) is x
    assert torch.equal(x, rng.normal(idx, SEED, "w", 1, mean=0.5, std=2.0, dtype=torch.float64))
    rng.uniform_(x, -1.0, 3.0, seed=SEED, stream="w")
    assert torch.equal(x, rng.uniform(idx, SEED, "w", low=-1.0, high=3.0, dtype=torch.float64))
    # non-contiguous view: values follow the view's logical (row-major) positions
    t = torch.empty(9, 6).t()
    rng.trunc_normal_(t, seed=SEED, stream="w")
    assert torch.equal(t, rng.trunc_normal(idx, SEED, "w"))
    # parameters that require grad, and meta tensors
    p = torch.nn.Parameter(torch.empty(shape))
    rng.normal_(p, std=0.02, seed=SEED, stream="w")
    assert torch.equal(p.detach(), rng.normal(idx, SEED, "w", std=0.02))
    rng.normal_(torch.empty(shape, device="meta"), seed=SEED, stream="w")
    with pytest.raises(TypeError):
        rng.normal_(torch.empty(shape, dtype=torch.int64), seed=SEED, stream="w")
    with pytest.raises(ValueError):
        rng.fill_(x, "laplace", SEED, "w")
    # bad parameters are rejected before anything is written
    before = x.clone()
    with pytest.raises(ValueError):
        rng.trunc_normal_(x, a=1.0, b=-1.0, seed=SEED, stream="w")
    with pytest.raises(ValueError):
        rng.normal_(x, std=-1.0, seed=SEED, stream="w")
    with pytest.raises(TypeError):
        rng.fill_(x, "normal", SEED, "w", sdt=0.02)
    with pytest.raises(ValueError):
        rng.normal_(x, seed=SEED, stream="w", counter=-1)
    assert torch.equal(x, before)


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
    u = rng.uniform(big_index, SEED, "stats", 5)
    assert u.dtype == torch.float32
    assert u.min() >= 0.0 and u.max() < 1.0
    u64 = u.double()
    assert abs(u64.mean().item() - 0.5) < 6 * math.sqrt(1 / 12 / N)
    var_se = math.sqrt((1 / 80 - 1 / 144) / N)  # (mu4 - sigma^4) / n
    assert abs(u64.var().item() - 1 / 12) < 6 * var_se
    assert ks_statistic(u, lambda x: x) < KS_BOUND


def test_normal_statistics(big_index):
    mean, std = 0.25, 3.0
    z = rng.normal(big_index, SEED, "stats", 5, mean=mean, std=std).double()
    assert abs(z.mean().item() - mean) < 6 * std / math.sqrt(N)
    assert abs(z.var().item() / std**2 - 1.0) < 6 * math.sqrt(2 / N)
    assert ks_statistic(z, lambda x: torch.special.ndtr((x - mean) / std)) < KS_BOUND
    assert torch.isfinite(z).all()


@pytest.mark.parametrize("mean,std,a,b", [(0.0, 1.0, -2.0, 2.0), (0.5, 2.0, -1.0, 3.0), (0.0, 0.02, -0.04, 0.01)])
def test_trunc_normal_statistics(big_index, mean, std, a, b):
    x = rng.trunc_normal(big_index, SEED, "stats", 5, mean=mean, std=std, a=a, b=b).double()
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
    for p in [0.9, 0.1, 0.5]:
        m = rng.bernoulli_mask(big_index, SEED, "drop", 2, p_keep=p)
        assert m.dtype == torch.bool
        assert abs(m.double().mean().item() - p) < 6 * math.sqrt(p * (1 - p) / N)
        assert torch.equal(m, rng.uniform(big_index, SEED, "drop", 2, dtype=torch.float64) < p)
    # exact at the boundary: keep iff u < p_keep, with p_keep equal to / just above a drawn u
    idx = big_index[:64]
    u = rng.uniform(idx, SEED, "drop", 2, dtype=torch.float64)
    for i in range(64):
        p = u[i].item()
        assert not rng.bernoulli_mask(idx[i : i + 1], SEED, "drop", 2, p_keep=p).item()
        assert rng.bernoulli_mask(idx[i : i + 1], SEED, "drop", 2, p_keep=p + 2**-30).item()
    assert rng.bernoulli_mask(big_index[:1000], SEED, "d", p_keep=1.0).all()
    assert not rng.bernoulli_mask(big_index[:1000], SEED, "d", p_keep=0.0).any()


# --------------------------------------------------------------------------------------
# Sharding: a shard built from global indices is bitwise the slice of the full tensor
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
    shape, offset = _compute_local_shape_and_global_offset(tuple(full.shape), tuple(mesh_shape), list(coord), placements)
    return full[tuple(slice(o, o + s) for o, s in zip(offset, shape))]


def full_values(shape):
    idx = torch.arange(math.prod(shape)).view(shape)
    return {
        "index": idx,
        "normal": rng.normal_(torch.empty(shape), 0.1, 0.02, seed=SEED, stream="w", counter=3),
        "trunc_normal": rng.trunc_normal_(
            torch.empty(shape, dtype=torch.bfloat16), 0.0, 1.0, -0.5, 1.5, seed=SEED, stream="w", counter=3
        ),
        "uniform": rng.uniform_(torch.empty(shape, dtype=torch.float64), -2.0, 2.0, seed=SEED, stream="w", counter=3),
        "mask": rng.bernoulli_mask(idx, SEED, "w", 3, p_keep=0.7),
    }


def local_values(shape, mesh_shape, coord, placements):
    gi = rng.global_indices(shape, mesh_shape, coord, placements)
    local_shape = tuple(gi.shape)
    layout = dict(global_shape=shape, mesh_shape=mesh_shape, mesh_coord=coord, placements=placements)
    return {
        "index": gi,
        "normal": rng.normal_(torch.empty(local_shape), 0.1, 0.02, seed=SEED, stream="w", counter=3, **layout),
        "trunc_normal": rng.trunc_normal_(
            torch.empty(local_shape, dtype=torch.bfloat16), 0.0, 1.0, -0.5, 1.5, seed=SEED, stream="w", counter=3,
            **layout,
        ),
        "uniform": rng.uniform_(
            torch.empty(local_shape, dtype=torch.float64), -2.0, 2.0, seed=SEED, stream="w", counter=3, **layout
        ),
        "mask": rng.bernoulli_mask(gi, SEED, "w", 3, p_keep=0.7),
    }


MESHES = [(2,), (3,), (2, 2), (2, 3)]
SHAPES = [(5, 7), (9, 10, 11), (33, 11, 13)]


def check_layout(shape, mesh_shape, placements, full):
    """Every rank's pieces equal torch's reference shards, and together cover the tensor."""
    only_shard = not any(isinstance(p, _StridedShard) for p in placements)
    n_replicas = math.prod(
        n for n, p in zip(mesh_shape, placements) if not isinstance(p, (Shard, _StridedShard))
    )
    covered = torch.zeros(math.prod(shape), dtype=torch.int64)
    rebuilt = {k: torch.zeros_like(v) for k, v in full.items()}
    for coord in itertools.product(*(range(n) for n in mesh_shape)):
        local = local_values(shape, mesh_shape, coord, placements)
        # Partial("sum") fills: coordinate 0 of each Partial mesh dim holds the value, others zeros
        holds_value = all(c == 0 for c, p in zip(coord, placements) if isinstance(p, Partial))
        for kind, full_t in full.items():
            expected = ref_split(full_t, mesh_shape, coord, placements)
            if only_shard:
                assert torch.equal(expected, ref_offset_slice(full_t, mesh_shape, coord, placements))
            got = local[kind]
            if kind in ("normal", "trunc_normal", "uniform") and not holds_value:
                assert torch.equal(got, torch.zeros_like(expected)), (kind, coord)
                continue
            assert got.shape == expected.shape and torch.equal(got, expected), (kind, coord, placements)
            rebuilt[kind].view(-1)[local["index"].reshape(-1)] = got.reshape(-1)
        covered.index_add_(0, local["index"].reshape(-1), torch.ones(local["index"].numel(), dtype=torch.int64))
    assert torch.equal(covered, torch.full_like(covered, n_replicas))
    for kind, full_t in full.items():
        assert torch.equal(rebuilt[kind], full_t), kind


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_shards_reassemble_to_unsharded_generation(shape):
    full = full_values(shape)
    options = [Replicate(), Partial()] + [Shard(d) for d in range(len(shape))]
    n_checked = 0
    for mesh_shape in MESHES:
        for placements in itertools.product(options, repeat=len(mesh_shape)):
            check_layout(shape, mesh_shape, list(placements), full)
            n_checked += 1
    assert n_checked == sum(len(options) ** len(m) for m in MESHES)


@pytest.mark.parametrize(
    "shape,mesh_shape,placements",
    [
        # FSDP2 over TP on dim 0: dp mesh dim gets _StridedShard(0, split_factor=tp)
        ((12, 5), (2, 3), [_StridedShard(0, split_factor=3), Shard(0)]),
        ((33, 11, 13), (2, 3), [_StridedShard(0, split_factor=3), Shard(0)]),
        ((7, 3), (3, 2), [_StridedShard(0, split_factor=2), Shard(0)]),  # uneven, with empty shards
        ((9, 10, 11), (3, 2), [_StridedShard(2, split_factor=2), Shard(2)]),
        ((9, 10, 11), (2, 2), [_StridedShard(1, split_factor=3), Partial()]),
        ((9, 10, 11), (3,), [_StridedShard(1, split_factor=2)]),
    ],
)
def test_strided_shard(shape, mesh_shape, placements):
    check_layout(shape, mesh_shape, placements, full_values(shape))


def test_strided_shard_is_right_to_left_sharding_when_even():
    """[_StridedShard(0, sf=tp), Shard(0)] on (dp, tp) = chunk by tp first, then by dp (FSDP2 over TP)."""
    full = torch.arange(12 * 5).view(12, 5)
    dp, tp = 2, 3
    for d, t in itertools.product(range(dp), range(tp)):
        gi = rng.global_indices((12, 5), (dp, tp), (d, t), [_StridedShard(0, split_factor=tp), Shard(0)])
        assert torch.equal(gi, full.chunk(tp)[t].chunk(dp)[d])


def test_negative_shard_dim_and_errors():
    a = rng.global_indices((4, 6), (2,), (1,), [Shard(-1)])
    assert torch.equal(a, rng.global_indices((4, 6), (2,), (1,), [Shard(1)]))
    with pytest.raises(ValueError):
        rng.global_indices((4, 6), (2,), (2,), [Shard(0)])  # coordinate out of range
    with pytest.raises(ValueError):
        rng.global_indices((4, 6), (2,), (0,), [Shard(2)])
    with pytest.raises(ValueError):  # local tensor of the wrong shape
        rng.normal_(torch.empty(4, 6), seed=0, stream="w", global_shape=(4, 6), mesh_shape=(2,), mesh_coord=(0,),
                    placements=[Shard(0)])


def test_partial_fill_rule():
    layout = dict(global_shape=(4, 6), mesh_shape=(2,), placements=[Partial("avg")])
    ref = rng.normal(torch.arange(24).view(4, 6), SEED, "w")
    for c in range(2):
        x = rng.normal_(torch.empty(4, 6), seed=SEED, stream="w", mesh_coord=(c,), **layout)
        assert torch.equal(x, ref)
    layout["placements"] = [Partial("sum")]
    x0 = rng.normal_(torch.empty(4, 6), seed=SEED, stream="w", mesh_coord=(0,), **layout)
    x1 = rng.normal_(torch.full((4, 6), 5.0), seed=SEED, stream="w", mesh_coord=(1,), **layout)
    assert torch.equal(x0 + x1, ref)


class _StubMesh:
    """Just what dtensor_global_indices reads from a DeviceMesh."""

    def __init__(self, shape, coord):
        self.shape, self._coord = tuple(shape), coord

    def get_coordinate(self):
        return self._coord


def test_dtensor_global_indices_with_mesh_triple():
    placements = [Shard(1), Shard(0)]
    for coord in itertools.product(range(2), range(3)):
        got = rng.dtensor_global_indices(_StubMesh((2, 3), coord), placements, (9, 10))
        assert torch.equal(got, rng.global_indices((9, 10), (2, 3), coord, placements))
    assert rng.dtensor_global_indices(_StubMesh((2, 3), None), placements, (9, 10)).numel() == 0
    with pytest.raises(ValueError):
        rng.dtensor_global_indices(_StubMesh((2,), (0,)))


def test_dtensor_fill_on_single_rank_mesh(tmp_path):
    """A real DTensor on a 1-rank gloo mesh goes through the DTensor branch and fills its local tensor."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import distribute_tensor

    if not dist.is_available():
        pytest.skip("torch.distributed not available")
    created = False
    if not dist.is_initialized():
        dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
        created = True
    try:
        if dist.get_world_size() != 1:
            pytest.skip("needs a 1-rank default group")
        mesh = init_device_mesh("cpu", (1,))
        d = distribute_tensor(torch.zeros(6, 4), mesh, [Shard(0)])
        rng.trunc_normal_(d, std=0.02, seed=SEED, stream="layers.0.w", counter=1)
        ref = rng.trunc_normal(torch.arange(24).view(6, 4), SEED, "layers.0.w", 1, std=0.02)
        assert torch.equal(d.to_local(), ref)
        assert torch.equal(rng.dtensor_global_indices(d), torch.arange(24).view(6, 4))
        with pytest.raises(ValueError):
            rng.normal_(d, seed=SEED, stream="w", placements=[Shard(0)])
    finally:
        if created:
            dist.destroy_process_group()
