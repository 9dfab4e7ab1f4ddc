"""`titan plan` with context parallelism: a rank's share of each row, planned against a real cp rank's block and
ring on this CPU; its FLOPs against the chunk pairs by hand; and `titan plan --cp`, which compares degrees."""

import copy
import json
import re

import pytest
import torch
import torch.distributed as dist

from conftest import DEBUG_RECIPE, run_titan, tiny_overrides
from distributed import run_distributed
from titan.config import load_config
from titan.models import model_blocks
from titan.parallel import ac
from titan.parallel.cp.ring import apply_context_parallel
from titan.parallel.mesh import build_mesh
from titan.parallel.parallelize import build_model_parts
from titan.run_plan import run_plan
from titan.train.estimate.estimate import estimate_step
from titan.train.model import resolve_model
from titan.train.step import token_loss

CPU = torch.device("cpu")
ROWS, SEQ = 2, 128  # a micro-batch of the tiny model; each cp rank computes 2 x 64 tokens of it
WAYS = {"none": ac.KEEP, "selective": ac.SELECTIVE, "full": ac.FULL}  # the plan's modes: the trainer's ways


def cp_overrides(tmp_path, cp: int, **extra) -> list[str]:
    batch = {"training.local_batch_size": str(ROWS), "training.global_batch_size": str(ROWS)}
    return tiny_overrides(tmp_path, **{"training.seq_len": str(SEQ), "parallel.cp": str(cp), **batch, **extra})


def real_cp_rank(overrides: list[str]) -> tuple[dict[str, int], int]:
    """On a cp rank of a real 2-process gloo run: (the bytes one block keeps for backward with the real ring, each
    way, every allocation of its forward still live; the bytes the ring sends in one micro-batch's forward and
    backward through the whole model, counted at torch.distributed.batch_isend_irecv)."""
    config = load_config(DEBUG_RECIPE, overrides, world_size=2)
    resolved = resolve_model(config)
    spec, args = resolved.spec, resolved.args
    plan = run_plan(config, 2, model_blocks(args))
    rank, mesh = dist.get_rank(), build_mesh(plan.layout, CPU)
    tokens = torch.randint(0, args.vocab_size, (ROWS, SEQ), generator=torch.Generator().manual_seed(0))
    rows = torch.arange(ROWS)

    # The first block, its input made by the model's own forward on this rank's tokens, as ac.measure_options does.
    with torch.device("meta"):
        stage = spec.pipeline_stage(spec.build(args), [0], True, False)
    stage.to_empty(device=CPU)
    stage.init_weights(config.job.seed)
    ring = apply_context_parallel(stage, plan, rank, mesh["cp"], CPU)
    local = tokens[:, ring.positions]
    block = spec.blocks(stage)[0]
    inputs = []
    hook = block.register_forward_pre_hook(lambda module, a, kw: inputs.append((a, kw)), with_kwargs=True)
    with torch.no_grad():
        stage(local, rows, None)
    hook.remove()
    (x, *block_args), kwargs = inputs[0]
    # Selective recomputation keeps the CPU's flash attention wherever a GPU's would be kept, as planned.
    save_ops = [*config.activation_checkpoint.save_ops, "aten._scaled_dot_product_flash_attention_for_cpu"]
    kept = {}
    for mode, way in WAYS.items():
        # A copy of the block run that way, sharing its parameters and the ring (and the ring's process group).
        memo = {id(p): p for p in block.parameters()} | {id(ring): ring}
        variant = copy.deepcopy(block, memo=memo)
        ac.apply_choice(variant, way, save_ops)
        with ac.Allocations(CPU) as allocations:
            out = variant(x.detach().clone().requires_grad_(), *block_args, **kwargs)
        kept[mode] = allocations.live_bytes(besides=out)
        del out

    (model,) = build_model_parts(config, spec, args, plan, rank, mesh, CPU).parts
    sent = []
    exchange = dist.batch_isend_irecv

    def counted(ops):
        sent.extend(op.tensor.numel() * op.tensor.element_size() for op in ops if op.op is dist.isend)
        return exchange(ops)

    dist.batch_isend_irecv = counted
    try:
        token_loss(model(local, rows, None), tokens[:, ring.positions]).backward()
    finally:
        dist.batch_isend_irecv = exchange
    return kept, sum(sent)


@pytest.fixture(scope="module")
def measured_cp2(tmp_path_factory):
    overrides = cp_overrides(tmp_path_factory.mktemp("cp2"), 2, **{"data.document_mask": "false"})
    return overrides, run_distributed(real_cp_rank, 2, overrides)


@pytest.mark.distributed
def test_a_cp_rank_s_block_keeps_what_the_plan_says(measured_cp2):
    """What decides whether a long-context recipe fits: the bytes a block keeps on a cp rank, its share of each row
    (queries, keys, values, output and log-sum-exp of its tokens, the ring's save), planned under fake tensors on a
    fake process group against the real ring's block on this CPU. Measured: equal to the byte in every mode."""
    overrides, ranks = measured_cp2
    planned = estimate_step(load_config(DEBUG_RECIPE, overrides, world_size=2), 2).block_activations
    for kept, _ in ranks:  # the two ranks' chunks differ, not their sizes
        assert kept == {mode: planned[mode] for mode in WAYS}
    kept = ranks[0][0]
    assert kept["full"] < kept["selective"] < kept["none"]


@pytest.mark.distributed
def test_the_planned_ring_traffic_is_what_the_real_ring_sends(measured_cp2):
    """Each rank's sends in one micro-batch (the plan's step: one micro-batch, no recomputation), planned against the
    bytes the real ring hands to batch_isend_irecv, and both against the count by hand: per layer, the keys and
    values go (cp - 1) hops forward and again backward, and their fp32 gradients cp hops."""
    overrides, ranks = measured_cp2
    config = load_config(DEBUG_RECIPE, overrides, world_size=2)
    (rank,) = estimate_step(config, 2).ranks
    args = resolve_model(config).args
    cp = 2
    kv = 2 * ROWS * args.n_kv_heads * (SEQ // cp) * args.head_dim * 4  # keys and values of a rank, fp32
    by_hand = args.n_layers * ((cp - 1) * kv * 2 + cp * kv)
    assert rank.traffic[("send/recv", "cp")] == by_hand
    assert [sent for _, sent in ranks] == [by_hand, by_hand]


def test_a_cp_rank_s_flops_are_its_chunk_pairs(tmp_path):
    """The trace counts what the ring computes: per layer, 2·cp + 1 chunk pairs of (seq / 2·cp)² (the pairs whose
    keys all come after their queries skipped), two of them diagonal and causal, counted at their triangle (c + 1) /
    2c as a flash kernel computes it, and 1/cp of every matmul of the weights. From the one-process plan, whose
    attention is one causal (seq)² call per layer: 14·rows·heads·seq²·head_dim FLOPs forward and backward (torch's
    formulas: 2 matmuls forward, 5 backward) times its triangle (seq + 1) / 2·seq."""
    cp = 2
    single = estimate_step(load_config(DEBUG_RECIPE, cp_overrides(tmp_path, 1), world_size=1), 1).ranks[0].flops
    ring = estimate_step(load_config(DEBUG_RECIPE, cp_overrides(tmp_path, cp), world_size=cp), cp).ranks[0].flops
    args = resolve_model(load_config(DEBUG_RECIPE, cp_overrides(tmp_path, 1), world_size=1)).args
    per_square = args.n_layers * 14 * ROWS * args.n_heads * args.head_dim  # times a (queries x keys) square
    weights = single - per_square * SEQ**2 * (SEQ + 1) / (2 * SEQ)
    chunk = SEQ // (2 * cp)
    pairs = 2 * (chunk + 1) / (2 * chunk) + (2 * cp + 1 - 2)  # two causal diagonal pairs, the others whole
    assert ring == pytest.approx(weights / cp + per_square * chunk**2 * pairs, rel=1e-12)


@pytest.mark.scenario  # titan plan --ep compares degrees by the same code (test_plan_ep.py)
@pytest.mark.slow
def test_titan_plan_compares_cp_degrees_and_picks_the_fastest_that_fits(tmp_path):
    """`titan plan --cp`: a line per degree on the same 8 devices (dp_shard takes what each leaves); a degree the
    recipe cannot be cut into says why; on a device between the cp 2 and cp 4 peaks (a rank's micro-batch: 1 row
    of 128 tokens, or 2 of 1 x 64) only cp 4 fits, and it is chosen, though cp 2 is faster."""
    extra = {"training.global_batch_size": "4", "training.local_batch_size": "1", "training.seq_len": "256"}
    peaks, steps = {}, {}
    for cp in (2, 4):
        config = load_config(DEBUG_RECIPE, tiny_overrides(tmp_path, **extra, **{"parallel.cp": str(cp)}), world_size=8)
        estimate = estimate_step(config, 8)
        peaks[cp], steps[cp] = estimate.ranks[0].peak, estimate.step_seconds
    assert peaks[4] < peaks[2] and steps[2] < steps[4]
    memory_gib = (peaks[2] + peaks[4]) / 2 / 2**30 / (1 - config.plan.headroom_fraction)
    args = ["--world-size", "8", "--cp", "4,1,2,3", "--plan.memory_gib", str(memory_gib)]
    figures = tmp_path / "plans.json"
    result = run_titan(
        "plan", "--config", str(DEBUG_RECIPE), *tiny_overrides(tmp_path, **extra), *args, "--json", str(figures)
    )
    assert result.returncode == 0, result.stderr
    by_degree = json.loads(figures.read_text())["cp"]
    assert by_degree["4"]["step_seconds"] == pytest.approx(steps[4]) and "error" in by_degree["1"]
    lines = {int(line.split()[0]): line for line in result.stdout.splitlines() if re.match(r"\s+\d+\s", line)}
    assert list(lines) == [1, 2, 3, 4]
    assert "cannot: training.global_batch_size (4) over 8 data-parallel ranks" in lines[1]
    assert "cannot: training.seq_len 256 must divide into 2 x parallel.cp = 6" in lines[3]
    assert "short" in lines[2] and "fits" in lines[4] and f"{steps[4]:.3g}s" in lines[4]
    assert f"fastest that fits on 8 x NVIDIA H100 SXM 80GB: cp 4 ({steps[4]:.3g} s a step)" in result.stdout
    too_small = run_titan("plan", "--config", str(DEBUG_RECIPE), *tiny_overrides(tmp_path, **extra), *args[:-1], "0.01")
    assert too_small.returncode == 1 and "no degree fits" in too_small.stdout


@pytest.mark.parametrize(
    "args, error",
    [
        (["--cp", "2,x"], "--cp 2,x: give context-parallel degrees separated by commas, e.g. --cp 1,2,4,8"),
        (["--cp", "2", "--graph"], "give --cp or --graph, not both"),
        (["--parallel.cp", "2", "--world-size", "2", "--graph"], "give --parallel.cp 1 --training.seq_len 128"),
    ],
    ids=["not_degrees", "cp_and_graph", "graph_of_a_cp_recipe"],
)
def test_wrong_cp_inputs_are_one_line_errors(args, error):
    result = run_titan("plan", "--config", str(DEBUG_RECIPE), *args)
    assert result.returncode == 2 and len(result.stderr.strip().splitlines()) == 1 and error in result.stderr
