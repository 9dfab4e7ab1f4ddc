"""`titan plan` with expert parallelism, under fake tensors only: the all-to-all bytes counted on the fake process
group against the formula by hand, each rank's share of the experts, the routed tokens' activations at the stated
load imbalance, and `titan plan --ep`, which compares degrees."""

import json
import re

import pytest
import torch

from conftest import run_titan, scenarios_beyond, tiny_overrides
from expert_plan import MOE_RECIPE, all_to_all_by_hand
from titan.config import load_config
from titan.train.estimate.estimate import estimate_step
from titan.train.estimate.report import format_estimate
from titan.train.model import resolve_model

ROWS, SEQ = 2, 64  # a micro-batch; each rank runs two a step


def moe_overrides(tmp_path, world: int, **extra) -> list[str]:
    batch = {"training.local_batch_size": str(ROWS), "training.global_batch_size": str(2 * ROWS * world)}
    return tiny_overrides(tmp_path, **{"training.seq_len": str(SEQ), **batch, **extra})


@pytest.mark.parametrize(
    "world, ep, mode, imbalance",
    scenarios_beyond(
        [(2, 2, "full", None), (128, 8, "none", None)],
        [(2, 2, "full", None), (4, 2, "selective", "1"), (128, 8, "none", None)],
    ),  # fmt: skip
    ids=["ep2-full-imbalance-1.25", "ep2-efsdp2-selective-balanced", "ep8-efsdp16-at-128-ranks"],
)
def test_the_counted_all_to_all_bytes_are_the_formula(tmp_path, world, ep, mode, imbalance):
    """The dispatch the trace runs is the real one (titan/parallel/ep.py), with the split the plan assumes; what the
    fake process group counts equals the formula by hand, on balanced and imbalanced loads, with and without
    recomputation (a recomputing block dispatches and combines again); and the plan's own formula says as much.
    The experts' parameters are sharded over ep x efsdp, every rank holding n_experts / ep of them. A block
    recomputed in full keeps its output alone: the routed experts are an FSDP unit inside the block, whose
    all-gather frees the block's buffer and whose own stays after the block, and what a block keeps must not count
    FSDP's buffers (with efsdp 1 it came out negative)."""
    extra = {"parallel.ep": str(ep), "activation_checkpoint.mode": mode, "model.overrides.dense_layers": "0"}
    config = load_config(MOE_RECIPE, moe_overrides(tmp_path, world, **extra, **_imbalance(imbalance)), world_size=world)
    estimate = estimate_step(config, world)
    (rank,) = estimate.ranks
    args = resolve_model(config).args
    by_hand = all_to_all_by_hand(config, world, len(args.moe_layers) if mode != "none" else 0)
    assert rank.traffic[("all-to-all", "ep")] == by_hand
    assert rank.all_to_all_formula == by_hand
    efsdp = world // ep
    experts = len(args.moe_layers) * 3 * args.n_experts // ep * args.expert_hidden_dim * args.dim // efsdp
    assert rank.trace.expert_params == experts
    assert estimate.block_activations["full"] == ROWS * SEQ * args.dim * 4  # fp32


def _imbalance(value: str | None) -> dict[str, str]:
    return {"plan.moe_load_imbalance": value} if value else {}


def test_the_planned_flops_count_the_experts_grouped_matmuls_in_bf16(tmp_path):
    """In bf16 the trace runs torch's grouped matmul itself (fake tensors take it), which FlopCounterMode has no
    formula for: the plan counts it, forward and backward, so that the ranks' FLOPs together are the model's
    per-token formula times the step's tokens at a balanced load, as in fp32 (where the trace runs one matmul
    of the same shapes)."""
    world, extra = 2, {"parallel.ep": "2", "plan.moe_load_imbalance": "1"}
    flops = {}
    for precision in ("fp32", "bf16"):
        overrides = moe_overrides(tmp_path, world, **extra, **{"training.mixed_precision": precision})
        config = load_config(MOE_RECIPE, overrides, world_size=world)
        estimate = estimate_step(config, world)
        flops[precision] = world * estimate.ranks[0].flops
    model = resolve_model(config)
    by_formula = model.spec.flops_per_token(model.args, SEQ) * estimate.run.tokens_per_step
    # The traced attention backward counts a little more than the formula's (tests/tools/test_plan.py).
    assert flops["bf16"] == pytest.approx(by_formula, rel=0.02)
    assert flops["bf16"] == flops["fp32"]


def test_a_v_pipeline_of_dense_and_routed_layers_plans_each_rank_s_own_blocks(tmp_path):
    """DualPipeV on 3 ranks over 6 layers, the first two dense: rank 1 holds a dense and a routed layer, rank 2
    two routed ones. Both hold middle stages, and a plan that traced one for both counted 62% of DeepSeek-V3's
    671B: each rank's parameters are its own layers', and the ranks' sum the model's."""
    import math

    from titan.checkpoint.train_state import model_shapes

    extra = {"parallel.pp": "3", "parallel.pp_schedule": "DualPipeV", "training.local_batch_size": "6",
             "training.global_batch_size": "6", "model.overrides.n_layers": "6",
             "model.overrides.dense_layers": "2"}  # fmt: skip
    config = load_config(MOE_RECIPE, tiny_overrides(tmp_path, **{"training.seq_len": str(SEQ), **extra}), 3)
    estimate = estimate_step(config, 3)
    model = resolve_model(config)
    layers = estimate.run.stage_layers
    assert [[list(layers[s]) for s in estimate.run.stages(r)] for r in range(3)] == [[[0], [5]], [[1], [4]], [[2], [3]]]
    params = {name: math.prod(shape) for name, shape in model_shapes(model.spec, model.args).items()}
    for rank, held in zip(estimate.ranks, ([0, 5], [1, 4], [2, 3])):
        own = sum(n for name, n in params.items() if name.split(".")[:2] in [["layers", str(i)] for i in held])
        assert rank.trace.total_params - own == (params["tok_embeddings.weight"] + params["norm.weight"] +
                                                 params["output.weight"]) * (rank is estimate.ranks[0])  # fmt: skip
    assert estimate.params == sum(params.values())


def test_the_routed_tokens_activations_are_the_most_loaded_rank_s(tmp_path):
    """What one MoE layer's routed experts keep for backward per micro-batch, measured in the trace, by hand at the
    stated imbalance: the most loaded rank receives R = f T k rows, each keeping its four hidden states (w1's and
    w3's outputs, the SiLU, their product), two rows of dim and an int64 index, and the rank's own T k pairs come
    back combined (a row of dim each). The plan's line names the imbalance and its knob."""
    world, imbalance = 2, 1.5
    extra = {"parallel.ep": "2", "plan.moe_load_imbalance": str(imbalance), "activation_checkpoint.mode": "none"}
    config = load_config(MOE_RECIPE, moe_overrides(tmp_path, world, **extra), world_size=world)
    estimate = estimate_step(config, world)
    args = resolve_model(config).args
    pairs, element = ROWS * SEQ * args.top_k, 4  # fp32
    received = round(imbalance * pairs)
    per_row = 4 * args.expert_hidden_dim * element + 2 * args.dim * element + 8
    assert estimate.routed_activations == received * per_row + pairs * args.dim * element
    assert "1.5 x the mean load (plan.moe_load_imbalance)" in format_estimate(estimate)


@pytest.mark.parametrize("mode", scenarios_beyond(["full"], ["full", "selective"]))
def test_the_routed_tokens_activations_show_whatever_the_checkpointing(tmp_path, mode):
    """debug_moe's first layer is dense, the others routed: the plan traces one block of each kind, so a recipe
    whose blocks recompute shows the routed tokens' activations as the recipe keeping everything does (held to the
    formula above)."""
    world, extra = 2, {"parallel.ep": "2", "plan.moe_load_imbalance": "1.5"}

    def planned(checkpointing: str):
        overrides = moe_overrides(tmp_path, world, **extra, **{"activation_checkpoint.mode": checkpointing})
        return estimate_step(load_config(MOE_RECIPE, overrides, world_size=world), world)

    kept, recomputing = planned("none"), planned(mode)
    assert recomputing.routed_activations == kept.routed_activations > 0
    assert "routed tokens" in format_estimate(recomputing)


@pytest.mark.slow
def test_titan_plan_compares_ep_degrees_and_picks_the_fastest_that_fits(tmp_path):
    """`titan plan --ep`: a line per degree on the same 4 devices (ep taken from dp_shard, which stays 4), with the
    ranks holding the same experts and the all-to-all per step; a degree the layout cannot take says why; the
    fastest that fits is named, and --json keeps each degree's figures."""
    figures = tmp_path / "plans.json"
    overrides = moe_overrides(tmp_path, 4, **{"activation_checkpoint.mode": "none"})
    result = run_titan(
        "plan", "--config", str(MOE_RECIPE), *overrides, "--world-size", "4", "--ep", "4,3,1", "--json", str(figures)
    )
    assert result.returncode == 0, result.stderr
    by_degree = json.loads(figures.read_text())["ep"]
    assert "error" in by_degree["3"]
    steps = {int(d): by_degree[d]["step_seconds"] for d in ("1", "4")}
    lines = {int(line.split()[0]): line for line in result.stdout.splitlines() if re.match(r"\s+\d+\s", line)}
    assert list(lines) == [1, 3, 4]
    assert "cannot: parallel.ep = 3 must divide dp_shard x cp = 4 x 1" in lines[3]
    assert lines[1].split()[1:3] == ["4", "0"] and lines[4].split()[1] == "1"  # efsdp; no all-to-all without ep
    best = min(steps, key=steps.get)
    assert f"fastest that fits on 4 x NVIDIA H100 SXM 80GB: ep {best} ({steps[best]:.3g} s a step)" in result.stdout


@pytest.mark.parametrize(
    "args, error",
    [
        (["--ep", "2,x"], "--ep 2,x: give expert-parallel degrees separated by commas, e.g. --ep 1,2,4,8"),
        (["--ep", "2", "--cp", "2"], "give --cp or --ep, not both"),
        (["--ep", "2", "--graph"], "give --ep or --graph, not both"),
    ],
    ids=["not_degrees", "ep_and_cp", "ep_and_graph"],
)
def test_wrong_ep_inputs_are_one_line_errors(args, error):
    result = run_titan("plan", "--config", str(MOE_RECIPE), *args)
    assert result.returncode == 2 and len(result.stderr.strip().splitlines()) == 1 and error in result.stderr


def test_under_tp_a_rank_dispatches_its_share_of_the_sequence(tmp_path):
    """Tensor parallelism gives each tp rank's MoE layers its share of the sequence, which it routes and dispatches
    alone: the all-to-all the trace counts is the formula's with T that share (the formula had the whole sequence,
    twice the counted bytes at tp 2)."""
    world, extra = 4, {"parallel.ep": "2", "parallel.tp": "2", "activation_checkpoint.mode": "none"}
    config = load_config(MOE_RECIPE, moe_overrides(tmp_path, world, **extra), world_size=world)
    (rank,) = estimate_step(config, world).ranks
    by_hand = all_to_all_by_hand(config, world, recomputing=0)
    assert rank.traffic[("all-to-all", "ep")] == by_hand
    assert rank.all_to_all_formula == by_hand


@pytest.mark.scenario
def test_the_deepseek_v3_recipe_fits_its_256_h100s(tmp_path):
    """recipes/deepseek_v3_671b.toml: the whole 671B and its prediction module planned on its layout, every rank
    fitting, at the step docs/moe.md states."""
    from conftest import ROOT

    result = run_titan("plan", "--config", str(ROOT / "recipes" / "deepseek_v3_671b.toml"))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "682.64B parameters, on 256 x NVIDIA H100" in result.stdout and "step 35.5 s" in result.stdout


# Per way of checkpointing: its settings, and the routed blocks that recompute their all-to-all, by hand.
MTP_CHECKPOINTING = {
    "none": ({}, 0),
    # Every second block of five: layer 2 and the module's block (the fifth, after the 4 layers; layer 0 is dense).
    "full": ({"activation_checkpoint.every": "2"}, 2),
    # At this budget auto plans the layers full, full, full, keep; the module's block is traced, and counted, full.
    "auto": ({"activation_checkpoint.budget_gib": "0.005"}, 3),
}


@pytest.mark.parametrize("mode", scenarios_beyond(["auto"], list(MTP_CHECKPOINTING)))
def test_the_plan_counts_the_multi_token_prediction(tmp_path, mode):
    """With mtp_layers = 1 the trace runs the module as the trainer does (given the labels): the model's parameters
    exactly, the ranks' FLOPs the per-token formula (its block, projection and second pass of the head) without
    recomputation, and its block's all-to-all by the formula and by hand. Under auto, the ways of one block of each
    kind are those of the plan without the module (whose block runs alike in every way's trace of one block)."""
    settings, recomputing = MTP_CHECKPOINTING[mode]
    world, extra = 2, {"parallel.ep": "2", "plan.moe_load_imbalance": "1", "activation_checkpoint.mode": mode}

    def planned(mtp_layers: int):
        overrides = {**extra, **settings, "model.overrides.mtp_layers": str(mtp_layers)}
        config = load_config(MOE_RECIPE, moe_overrides(tmp_path, world, **overrides), world_size=world)
        return config, estimate_step(config, world)

    config, estimate = planned(1)
    model = resolve_model(config)
    with torch.device("meta"):
        assert estimate.params == sum(p.numel() for p in model.spec.build(model.args).parameters())
    (rank,) = estimate.ranks
    assert rank.traffic[("all-to-all", "ep")] == rank.all_to_all_formula
    assert rank.all_to_all_formula == all_to_all_by_hand(config, world, recomputing)
    if mode == "none":
        by_formula = model.spec.flops_per_token(model.args, SEQ) * estimate.run.tokens_per_step
        assert world * rank.flops == pytest.approx(by_formula, rel=0.02)
    if mode == "auto":
        assert rank.checkpointing.choices == ("full", "full", "full", "keep")
        alone = planned(0)[1].kind_options
        for kind, options in estimate.kind_options.items():  # the seconds: differences of sums, rounded otherwise
            assert [(o.name, o.saved_bytes) for o in options] == [(o.name, o.saved_bytes) for o in alone[kind]]
            assert [o.added_seconds for o in options] == pytest.approx([o.added_seconds for o in alone[kind]])


def test_a_pipeline_plans_the_lookahead_embeddings_sent_with_the_hidden_states(tmp_path):
    """Under PP2 with mtp_layers = 1 a stage sends, per micro-batch, its hidden states and the embeddings of the
    tokens one ahead, fp32: rows x seq x 2 dim x 4 bytes, by hand, which the plan counts as the pipeline's sends."""
    sent = {}
    for mtp_layers in (0, 1):
        overrides = {"parallel.pp": "2", "model.overrides.mtp_layers": str(mtp_layers)}
        config = load_config(MOE_RECIPE, moe_overrides(tmp_path, 2, **overrides), world_size=2)
        rank = estimate_step(config, 2).ranks[0]
        sent[mtp_layers] = rank.traffic[("send", "pp")]
        rows = ROWS // (config.parallel.pp_microbatches or 2)  # 0: as many as the stages
        assert rank.trace.boundary_bytes == rows * SEQ * (1 + mtp_layers) * resolve_model(config).args.dim * 4
    assert sent[1] == 2 * sent[0] > 0
