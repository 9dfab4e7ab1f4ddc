"""The cost model of cost-balanced packing, measured on this device: time a few forward and backward passes of
micro-batches with known document lengths and fit c + a·Σs² + b·Σs by least squares.

What is timed is one and two layers of the model at its full width on one device, scaled to a pipeline stage's share
of the layers (see measure); tensor parallelism divides the per-token terms by its degree (titan/train/build.py),
which leaves the assignment unchanged and only scales the predicted seconds. Results are cached per model shape,
stage depth, device, dtype and thread count.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import math
import time

import numpy as np
import torch

from titan.data.packing import CostModel
from titan.files import cache_root
from titan.observe.profiling import DeviceTimer
from titan.parallel.cp.ring import ring_hop
from titan.train.model import ResolvedModel

log = logging.getLogger("titan")


def micro_batches_to_time(max_len: int, capacity: int) -> list[list[int]]:
    """Document lengths of the timed micro-batches, for token counts doubling from 32 up to the capacity: one
    document of that many tokens (up to max_len), and documents of 32, 64 and max_len tokens. The same
    token count in documents of different lengths separates the quadratic term from the linear one."""
    short = min(64, max_len)
    batches, tokens = [], max(1, short // 2)
    while True:
        tokens = min(tokens, capacity)
        for length in (tokens, short, max(1, short // 2), max_len):
            if length <= max_len and tokens % length == 0 and [length] * (tokens // length) not in batches:
                batches.append([length] * (tokens // length))
        if tokens == capacity:
            return batches
        tokens *= 2


def time_micro_batch(model: torch.nn.Module, lengths: list[int], vocab: int, device: torch.device, repeats: int = 3):
    """Seconds of one forward and backward of a micro-batch of documents of these lengths: the fastest of a few
    runs, as interference only ever adds time."""
    tokens = torch.randint(0, vocab, (1, sum(lengths)), device=device, generator=torch.Generator(device).manual_seed(0))
    ids = torch.repeat_interleave(torch.arange(len(lengths), device=device), torch.tensor(lengths, device=device))[None]
    times = []
    timer = DeviceTimer(device)
    for _ in range(repeats + 1):  # the first warms up
        timer.start()
        model(tokens, None, ids).float().logsumexp(-1).sum().backward()
        timer.stop()
        times.append(timer.seconds())
        model.zero_grad(set_to_none=True)
    return min(times[1:])


def fit(samples: list[tuple[list[int], float]]) -> tuple[CostModel, float]:
    """Least-squares a, b, c (clipped at 0) of time = c + a·Σs² + b·Σs over (lengths, seconds); and R²."""
    x = np.array([[sum(s * s for s in lengths), sum(lengths), 1.0] for lengths, _ in samples], dtype=np.float64)
    y = np.array([seconds for _, seconds in samples])
    # Scale the columns: Σs² is a million times Σs, which would otherwise make the fit ill-conditioned.
    scale = np.abs(x).max(axis=0)
    coef = np.linalg.lstsq(x / scale, y, rcond=None)[0] / scale
    a, b, c = (max(0.0, float(v)) for v in coef)
    predicted = x @ np.array([a, b, c])
    total = float(((y - y.mean()) ** 2).sum())
    r2 = 1.0 - float(((y - predicted) ** 2).sum()) / total if total > 0 else 1.0
    return CostModel(a, b, c), r2


def measure(
    model: ResolvedModel,
    n_layers: int,
    max_len: int,
    capacity: int,
    device: torch.device,
    dtype: torch.dtype,
    seed: int,
):
    """Fit the cost model of a model of `n_layers` of these args on `device`; returns (model, R², samples).

    Only models of one and of two layers are timed (the embedding and head included), and each micro-batch's time
    is extrapolated linearly to the stage's depth: a stage too large for one device unsharded is measured all the
    same, and a layer's own cost is the difference, which the head's cost does not blur."""
    depths = sorted({1, min(2, n_layers)})
    times = {depth: _time_depth(model, depth, max_len, capacity, device, dtype, seed) for depth in depths}
    batches = micro_batches_to_time(max_len, capacity)
    one, two = times[depths[0]], times[depths[-1]]
    samples = [(lengths, one[i] + (n_layers - 1) * (two[i] - one[i])) for i, lengths in enumerate(batches)]
    cost, r2 = fit(samples)
    return cost, r2, samples


def _time_depth(model: ResolvedModel, n_layers: int, max_len: int, capacity: int, device, dtype, seed) -> list[float]:
    """The forward and backward seconds of each micro-batch to time, on a model of `n_layers` layers."""
    args = model.args
    stage_args = dataclasses.replace(args, n_layers=n_layers, max_seq_len=max(args.max_seq_len, max_len))
    with torch.device("meta"):
        stage = model.spec.build(stage_args)
    stage.to_empty(device=device)
    stage.init_weights(seed)
    stage.to(dtype)
    batches = micro_batches_to_time(max_len, capacity)
    return [time_micro_batch(stage, lengths, args.vocab_size, device) for lengths in batches]


def cached_cost_model(model: ResolvedModel, n_layers, max_len, capacity, device, dtype, seed) -> CostModel:
    """The measured cost model, from the cache when this shape was measured here before."""
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else f"cpu-{torch.get_num_threads()}threads"
    key = json.dumps(
        [dataclasses.asdict(model.args), n_layers, max_len, capacity, name, str(dtype), torch.__version__],
        sort_keys=True,
    )
    path = cache_root() / "costs" / f"{hashlib.sha256(key.encode()).hexdigest()[:16]}.json"
    if path.exists():
        cached = json.loads(path.read_text())
        log.info("data.cost_model: %s (measured before, %s)", _describe(cached), path)
        return CostModel(*cached["abc"])
    start = time.perf_counter()
    cost, r2, samples = measure(model, n_layers, max_len, capacity, device, dtype, seed)
    record = {"abc": [cost.a, cost.b, cost.c], "r2": r2, "samples": samples, "device": name}
    log.info("data.cost_model: %s, measured in %.1fs", _describe(record), time.perf_counter() - start)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(record))
    tmp.replace(path)
    return cost


def collective_seconds(n_params: int, group, device: torch.device, dtype: torch.dtype) -> float:
    """Seconds FSDP's collectives add to every micro-batch, which timing one process cannot see: an all-gather
    of the weights in forward, another in backward (they were resharded) and a reduce-scatter of the
    gradients, each taken as one all-gather of the stage's weights over the data-parallel group, timed here."""
    import torch.distributed as dist

    world = dist.get_world_size(group)
    shard = torch.zeros(math.ceil(n_params / world), dtype=dtype, device=device)
    full = torch.empty(shard.numel() * world, dtype=dtype, device=device)
    best, timer = math.inf, DeviceTimer(device)
    for _ in range(4):
        timer.start()
        dist.all_gather_into_tensor(full, shard, group=group)
        timer.stop()
        best = min(best, timer.seconds())
    return 3 * best


def _describe(record: dict) -> str:
    a, b, c = record["abc"]
    crossover = b / a if a > 0 else math.inf  # where a document's attention costs as much as the rest of it
    return (
        f"a = {a:.3g} s/token², b = {b:.3g} s/token, c = {c:.3g} s/micro-batch (R² {record['r2']:.3f}; attention "
        f"equals the linear cost at {crossover:.0f} tokens)"
    )


def ring_bytes_per_token(kv_dim: int, n_layers: int, dtype_bytes: int) -> int:
    """Bytes one ring hop carries per token of the block it passes on (titan/parallel/cp/ring.py), over all layers:
    forward, the block's keys and values; backward, them again and their gradients (float32). The cost model's
    ring term r is these bytes over the cp link's bandwidth (ring_bytes_per_second): timing one process cannot see
    the link, so r is derived, not fitted."""
    return n_layers * kv_dim * (2 * dtype_bytes + 2 * dtype_bytes + 2 * 4)


def ring_bytes_per_second(group, device: torch.device, nbytes: int = 16 * 2**20) -> float:
    """The bandwidth of one ring hop on this cp group, timed: each rank sends `nbytes` to the next rank and
    receives as many from the previous one, as the ring does (the best of 4)."""
    send = torch.zeros(nbytes, dtype=torch.uint8, device=device)
    best, timer = math.inf, DeviceTimer(device)
    for _ in range(4):
        timer.start()
        for work in ring_hop(send, group)[1]:
            work.wait()
        timer.stop()
        best = min(best, timer.seconds())
    return nbytes / best
