"""Every parallel layout trains exactly like one process: same global batches, same losses, same weights.

The reference is titan's own single-process run of the same recipe. Each layout reads its rows of the
recipe's global batches through its own loader, in real processes joined by gloo; the layouts of one world
size share one launch.
"""

import json
import os

import pytest
import torch
import torch.distributed as dist

from conftest import DEBUG_RECIPE, ROOT, tiny_overrides
from distributed import run_distributed
from helpers import (
    GLOBAL_BATCH,
    LATENT_ATTENTION,
    LOSS_RTOL,
    STEPS,
    assert_matches_one_process,
    full_weights,
    layout_overrides,
    with_local_batch,
)
from titan.config import load_config
from titan.rng.shards import full_tensor
from titan.run_plan import run_plan
from titan.tools.verify.recording import add_rounding_noise
from titan.train.trainer import Trainer

PP_SCHEDULES = ["GPipe", "1F1B", "Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV"]
V_SHAPED = ["ZBVZeroBubble", "DualPipeV"]
LAYOUTS_2 = {
    "fsdp2": {"parallel.dp_shard": "2"},
    "fsdp2_accumulate2": {"parallel.dp_shard": "2", "training.local_batch_size": "2"},
    "tp2_sp_lossparallel": {"parallel.tp": "2"},
    "tp2_plain": {"parallel.tp": "2", "parallel.sequence_parallel": "false", "parallel.loss_parallel": "false"},
    "tp2_accumulate2": {"parallel.tp": "2", "training.local_batch_size": "4"},
    "pp2_accumulate2": {"parallel.pp": "2", "training.local_batch_size": "4"},
    "pp2_stage_speeds_1_3": {"parallel.pp": "2", "parallel.pp_stage_speeds": "[1, 3]"},  # layers [1, 3]
    **{f"pp2_{s}": {"parallel.pp": "2", "parallel.pp_schedule": s} for s in PP_SCHEDULES if s not in V_SHAPED},
    # torch 2.13 cannot evaluate through a V-shaped schedule (titan refuses validation with them).
    **{f"pp2_{s}": {"parallel.pp": "2", "parallel.pp_schedule": s, "validation.interval": "0"} for s in V_SHAPED},
    "fsdp2_selective_ac": {"parallel.dp_shard": "2", "activation_checkpoint.mode": "selective"},
    "tp2_full_ac_every2": {
        "parallel.tp": "2",
        "activation_checkpoint.mode": "full",
        "activation_checkpoint.every": "2",
    },
    "fsdp2_compile": {"parallel.dp_shard": "2", "compile.enable": "true"},
    # Uneven shares: rank 1 reads 6 of the 8 rows, in micro-batches of 3 against rank 0's of 1.
    "fsdp2_weighted_1_3": {"parallel.dp_shard": "2", "parallel.dp_weights": "[1, 3]"},
}
LAYOUTS_4 = {
    "hsdp2x2": {"parallel.dp_replicate": "2", "parallel.dp_shard": "2"},
    "hsdp2x2_weighted": {
        "parallel.dp_replicate": "2",
        "parallel.dp_shard": "2",
        "parallel.dp_weights": "[1, 2, 3, 2]",
        "training.local_batch_size": "4",
    },
    "fsdp2_tp2": {"parallel.dp_shard": "2", "parallel.tp": "2"},
    "pp2_fsdp2": {"parallel.pp": "2", "parallel.dp_shard": "2"},
    "pp2_tp2": {"parallel.pp": "2", "parallel.tp": "2"},
    "pp2_fsdp2_interleaved": {"parallel.pp": "2", "parallel.dp_shard": "2", "parallel.pp_schedule": "Interleaved1F1B"},
}


def train_on(overrides: list[str], floor: bool = False):
    """Train STEPS steps on the recipe's own global batches (each rank reads its rows), then evaluate on the
    validation batches. Returns the losses (the validation loss last) and the full weights. `floor`: with
    rounding noise (add_rounding_noise)."""
    trainer = Trainer(load_config(DEBUG_RECIPE, overrides))
    if floor:
        add_rounding_noise(trainer.model_parts)
    losses = trainer.train(until=trainer.step + STEPS)
    validation = [trainer.evaluate()] if trainer.validation_loader else []
    return [*losses, *validation], full_weights(trainer)


def train_layouts(tmp, layouts: dict) -> dict:
    return {name: train_on(layout_overrides(tmp / name, layout)) for name, layout in layouts.items()}


def train_through_a_replan(tmp):
    """FSDP2 on even shares for 2 steps, then live on shares [1, 3] (what a straggler re-plan applies)."""
    trainer = Trainer(load_config(DEBUG_RECIPE, layout_overrides(tmp, {"parallel.dp_shard": "2"})))
    losses = trainer.train(until=trainer.step + 2)
    shares = run_plan(trainer.config, trainer.world_size, trainer.blocks, dp_weights=[1.0, 3.0])
    trainer.follow(shares)
    plan = [list(sizes) for sizes in shares.micro_batches]
    losses += trainer.train(until=trainer.step + STEPS - 2)
    return plan, [*losses, trainer.evaluate()], full_weights(trainer)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """One process's losses and weights, and its floor (the same run with rounding noise)."""
    tmp = tmp_path_factory.mktemp("single")
    one_process = {"training.local_batch_size": str(GLOBAL_BATCH)}
    return (*train_on(layout_overrides(tmp, one_process)), train_on(layout_overrides(tmp / "floor", one_process), True))


def check_matches(reference, per_rank: list[dict], layouts):
    ref_losses, ref_params, (floor_losses, floor_params) = reference
    for name in layouts:
        losses = per_rank[0][name][0]
        assert len(losses) in (STEPS, STEPS + 1), name  # the validation loss last, where the layout evaluates
        params = {}
        for rank_result in per_rank:  # pipeline ranks hold different layers
            params.update(rank_result[name][1])
        floor = floor_losses[: len(losses)], floor_params
        assert_matches_one_process(losses, ref_losses[: len(losses)], params, ref_params, floor=floor, name=name)


LAYOUTS_8 = {
    "pp2_fsdp2_tp2": {"parallel.pp": "2", "parallel.dp_shard": "2", "parallel.tp": "2"},
    "hsdp2x2_tp2": {"parallel.dp_replicate": "2", "parallel.dp_shard": "2", "parallel.tp": "2"},
}


# The smoke subset (pytest -m smoke): FSDP2 and TP2, in one launch of 2 processes.
SMOKE_2 = ["fsdp2", "tp2_sp_lossparallel"]
# The default run's 2-process launch: beside the smoke pair, accumulation, uneven shares, a single-stage and a
# V-shaped pipeline schedule and activation checkpointing (a multi-stage schedule runs at 4, uneven stages in
# test_a_slow_pipeline_rank_gets_fewer_layers); the other schedules and variants are scenarios, as are the
# 8-process layouts (their parts, pp x fsdp and tp x fsdp, run at 4).
DEFAULT_2 = [
    "fsdp2_accumulate2", "tp2_accumulate2", "pp2_1F1B", "pp2_ZBVZeroBubble", "fsdp2_selective_ac", "fsdp2_weighted_1_3",
]  # fmt: skip
DEFAULT_4 = ["hsdp2x2_weighted", "fsdp2_tp2", "pp2_fsdp2_interleaved"]


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize(
    "world,layouts",
    [
        pytest.param(2, {k: LAYOUTS_2[k] for k in SMOKE_2}, marks=pytest.mark.smoke, id="2_processes_smoke"),
        pytest.param(2, {k: LAYOUTS_2[k] for k in DEFAULT_2}, id="2_processes"),
        pytest.param(
            2,
            {k: v for k, v in LAYOUTS_2.items() if k not in SMOKE_2 + DEFAULT_2},
            id="2_processes_more",
            marks=pytest.mark.scenario,
        ),  # fmt: skip
        pytest.param(4, {k: LAYOUTS_4[k] for k in DEFAULT_4}, id="4_processes"),
        pytest.param(
            4,
            {k: v for k, v in LAYOUTS_4.items() if k not in DEFAULT_4},
            id="4_processes_more",
            marks=pytest.mark.scenario,
        ),  # fmt: skip
        pytest.param(8, LAYOUTS_8, id="8_processes", marks=pytest.mark.scenario),
    ],
)
def test_layouts_match_single_process(reference, tmp_path, world, layouts):
    layouts = with_local_batch(layouts, world)
    results = run_distributed(train_layouts, world, tmp_path, layouts)
    check_matches(reference, results, layouts)


# Latent attention (DeepSeek's MLA) on the debug MoE's first two layers, dense and routed: heads split over tp with
# the latents whole on each rank, and the ring with values narrower than keys.
MOE_RECIPE = ROOT / "recipes" / "debug_moe.toml"
MLA = {**LATENT_ATTENTION, "model.overrides.n_layers": "2", "training.seq_len": "32", "checkpoint.enable": "false"}
MLA_LAYOUTS = {
    "tp2_sp_lossparallel": {"parallel.tp": "2"},
    "tp2_plain": {"parallel.tp": "2", "parallel.sequence_parallel": "false", "parallel.loss_parallel": "false"},
    "cp2": {"parallel.cp": "2"},
}


def train_latent_attention(tmp, layouts: dict, floor: bool = False) -> dict:
    """Per layout: the losses of STEPS steps of the MoE with latent attention, and its full weights after them.
    `floor`: with rounding noise (add_rounding_noise)."""
    results = {}
    for name, layout in layouts.items():
        values = {**MLA, "training.global_batch_size": str(GLOBAL_BATCH), **layout}
        trainer = Trainer(load_config(MOE_RECIPE, tiny_overrides(tmp / name, **values)))
        if floor:
            add_rounding_noise(trainer.model_parts)
        results[name] = trainer.train(until=STEPS), full_weights(trainer)
    return results


@pytest.mark.distributed
@pytest.mark.slow
def test_latent_attention_under_tp_and_cp_matches_single_process(tmp_path):
    """Measured: losses within 1.4e-7 relative, weights within 2.1e-5 (one of the output head's 0.5M elements, where
    Adam divides rounding by a near-zero gradient; rounding alone moved it by 1.1e-5 in the floor run). Without
    the step's sum over tp of the latents' gradients (each rank's heads' share) the losses move by 4e-5 from the
    second step."""
    single = {"single": {"training.local_batch_size": "8"}}
    reference = train_latent_attention(tmp_path / "single", single)["single"]
    reference += (train_latent_attention(tmp_path / "floor", single, floor=True)["single"],)
    ranks = run_distributed(train_latent_attention, 2, tmp_path, with_local_batch(MLA_LAYOUTS, 2))
    check_matches(reference, ranks, MLA_LAYOUTS)


def train_with_a_slow_rank(tmp, layout: dict, steps: int = STEPS):
    """Straggler detection on, where rank 1's probe takes 3x as long as rank 0's."""
    overrides = {**layout, "straggler.enable": "true", "straggler.window": "2", "metrics.log_freq": "1"}
    trainer = Trainer(load_config(DEBUG_RECIPE, layout_overrides(tmp, overrides)))
    slowdown = 3.0 if trainer.rank == 1 else 1.0
    trainer.replanner.probe.seconds = lambda: 0.01 * slowdown
    losses = trainer.train(until=steps)
    records = [json.loads(line) for line in (trainer.run_dir / "metrics.jsonl").read_text().splitlines()]
    return losses, records, trainer.loader.rows


@pytest.mark.distributed
@pytest.mark.slow
def test_a_slow_rank_is_detected_and_given_fewer_rows_with_the_same_losses(reference, tmp_path):
    (losses, records, rows0), (_, _, rows1) = run_distributed(
        train_with_a_slow_rank, 2, tmp_path, {"parallel.dp_shard": "2"}
    )
    replans = [r for r in records if r.get("replan")]
    assert [r["step"] for r in replans] == [2]  # as soon as each rank's window of 2 probes is full, and once
    assert replans[0]["dp_rows_0"] == 6 and replans[0]["dp_rows_1"] == 2
    assert (rows0, rows1) == (range(0, 6), range(6, 8))
    assert_matches_one_process(losses, reference[0][:STEPS])
    saved = json.loads((tmp_path / "debug" / "checkpoints" / f"step-{STEPS}" / "train_state.json").read_text())
    assert saved["plan"]["dp_weights"] == pytest.approx([1.0, 1 / 3])  # a resumed run starts from the plan in force


def train_through_a_pipeline_resplit(tmp, layout: dict):
    """A pipeline on layers [2, 2] for 3 steps, then [3, 1]: layer 2 moves from pipeline rank 1 to rank 0."""
    trainer = Trainer(load_config(DEBUG_RECIPE, layout_overrides(tmp, layout)))
    losses = trainer.train(until=trainer.step + 3)

    def moved_state():
        named = dict(trainer.model_parts.named_parameters())
        return {
            (name, key): full_tensor(value).clone()
            for name, p in named.items()
            if name.startswith("layers.2.")
            for key, value in trainer.optimizer.state[p].items()
        }

    before = moved_state()
    how = trainer.follow(run_plan(trainer.config, trainer.world_size, trainer.blocks, layers_per_stage=[3, 1]))
    after = moved_state()
    losses += trainer.train(until=trainer.step + STEPS - 3)
    return trainer.mesh["pp"].get_local_rank(), before, after, how, [*losses, trainer.evaluate()], full_weights(trainer)


def first_pipeline_step(tmp, layout: dict) -> tuple[int, int, float]:
    """One step, with the stages checking every tensor they send and receive against the shapes and dtypes
    given to them (torch's pipeline stages do at debug level DETAIL); returns (forwards the stages ran,
    forwards the schedule needs, the step's loss)."""
    dist.set_debug_level(dist.DebugLevel.DETAIL)
    trainer = Trainer(load_config(DEBUG_RECIPE, layout_overrides(tmp, layout)))
    forwards = []
    for part in trainer.model_parts.parts:
        part.register_forward_pre_hook(lambda *_: forwards.append(1))
    step = trainer.stepper  # the step alone: the loop would also evaluate and save at its last step
    loss = step.global_loss(step(next(trainer.loader), trainer.step)[0]).item()
    needed = len(trainer.model_parts.parts) * trainer.run_plan.pipeline_microbatches
    return len(forwards), needed, loss


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize(
    "layout,data",
    [({"parallel.pp": "2", "parallel.tp": "2"}, {}),
     ({"parallel.pp": "2", "parallel.tp": "2"}, {"data.document_mask": "false"}),
     ({"parallel.pp": "2", "parallel.tp": "2"}, {"data.batching": "tokens", "validation.interval": "0"}),
     ({"parallel.pp": "2", "parallel.dp_shard": "2"}, {"training.mixed_precision": "bf16"})],
    ids=["pp2_tp2_sequence_parallel", "pp2_tp2_without_document_ids", "pp2_tp2_packed_documents", "pp2_fsdp2_bf16"],
)  # fmt: skip
def test_pipeline_stages_know_their_shapes_without_a_shape_inference_pass(tmp_path, layout, data):
    """The stages are given what they exchange (hidden states sharded by sequence parallel, bf16 under FSDP's
    bf16, the rows and document ids passed along, packed documents as one long row when nothing is evaluated:
    see the next test), so the first step runs each micro-batch's forward once:
    torch would otherwise run an extra forward and backward per stage to find the shapes. In fp32 the step's
    loss is one process's."""
    (spread,) = with_local_batch({"spread": {**layout, **data}}, 4).values()
    single = layout_overrides(tmp_path / "single", {"training.local_batch_size": str(GLOBAL_BATCH), **data})
    trainer = Trainer(load_config(DEBUG_RECIPE, single))
    (expected,) = trainer.train(until=1)
    for forwards, needed, loss in run_distributed(first_pipeline_step, 4, tmp_path, spread):
        assert forwards == needed
        if "training.mixed_precision" not in data:
            assert loss == pytest.approx(expected, rel=LOSS_RTOL, abs=0)


def packed_steps_then_validation(tmp, layout: dict) -> tuple[list[float], float]:
    trainer = Trainer(load_config(DEBUG_RECIPE, layout_overrides(tmp, layout)))
    return trainer.train(until=trainer.step + 2), trainer.evaluate()


@pytest.mark.distributed
@pytest.mark.slow
def test_a_pipeline_trains_packed_documents_and_evaluates_rows(tmp_path):
    """Training micro-batches of packed documents are one long row; evaluation reads rows of seq_len: the pipeline
    runs both shapes, with one process's losses."""
    packed = {"data.batching": "tokens", "validation.interval": "2"}
    expected = packed_steps_then_validation(
        tmp_path / "single", {"training.local_batch_size": str(GLOBAL_BATCH), **packed}
    )
    layout = {"parallel.pp": "2", "training.local_batch_size": str(GLOBAL_BATCH), **packed}
    for losses, validation in run_distributed(packed_steps_then_validation, 2, tmp_path, layout):
        assert losses == pytest.approx(expected[0], rel=LOSS_RTOL, abs=0)
        assert validation == pytest.approx(expected[1], rel=LOSS_RTOL, abs=0)


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize(
    "world,layout,how",
    [(2, {"parallel.pp": "2"}, "27 tensors received point to point"),
     (4, {"parallel.pp": "2", "parallel.dp_shard": "2"}, "state moved through DCP")],
    ids=["pp2_point_to_point", "pp2_fsdp2_through_dcp"],
)  # fmt: skip
def test_a_live_pipeline_resplit_moves_layers_with_their_optimizer_state(reference, tmp_path, world, layout, how):
    ranks = run_distributed(train_through_a_pipeline_resplit, world, tmp_path, layout)
    first = [r for r in ranks if r[0] == 0]
    second = [r for r in ranks if r[0] == 1]
    assert first[0][3] == how
    for _, before, after, _, _, _ in first:
        assert not before and len(after) == 9 * 3  # 9 parameters, each with step, exp_avg and exp_avg_sq
    for (_, before, _, _, _, _), (_, _, after, _, _, _) in zip(second, first):
        for key, value in before.items():  # from pipeline rank 1 to rank 0, bitwise
            assert torch.equal(after[key], value), key
    check_matches(reference, [{"resplit": (r[4], r[5])} for r in ranks], ["resplit"])


def snapshot_after_a_resplit(tmp, layout: dict):
    """Snapshots on, a step on layers [2, 2], a re-split to [3, 1] and a step on it; then a snapshot, loaded back
    into weights moved off: returns (the weights when it was taken, those it restores)."""
    os.environ["TITAN_SNAPSHOT_DIR"] = str(tmp)
    trainer = Trainer(load_config(DEBUG_RECIPE, layout_overrides(tmp, {**layout, "fault.snapshot_interval": "1"})))
    trainer.train(until=1)
    trainer.follow(run_plan(trainer.config, trainer.world_size, trainer.blocks, layers_per_stage=[3, 1]))
    trainer.train(until=2)
    trainer.recovery.snapshots.take(2, trainer.tokens_seen, 0.0)
    taken = full_weights(trainer)
    folder, _ = trainer.recovery.snapshots.gather(trainer.checkpointer, after=0)
    with torch.no_grad():
        for p in trainer.model_parts.parameters():
            p.add_(1.0)
    trainer.checkpointer.load(folder, ("model",))
    return taken, full_weights(trainer)


@pytest.mark.distributed
@pytest.mark.slow
def test_a_snapshot_after_a_pipeline_resplit_holds_the_rebuilt_stages(tmp_path):
    """A re-split rebuilds the stages; the in-memory snapshots then save the rebuilt ones, as the checkpoints do,
    not the parts the run no longer trains: a snapshot restores each rank's weights as they were, bitwise."""
    for taken, restored in run_distributed(snapshot_after_a_resplit, 2, tmp_path, {"parallel.pp": "2"}):
        assert taken.keys() == restored.keys()
        for name, value in taken.items():
            assert torch.equal(restored[name], value), name


@pytest.mark.distributed
@pytest.mark.slow
def test_a_slow_pipeline_rank_gets_fewer_layers_with_the_same_losses(reference, tmp_path):
    (losses, records, _), _ = run_distributed(train_with_a_slow_rank, 2, tmp_path, {"parallel.pp": "2"})
    replans = [r for r in records if r.get("replan")]
    assert [(r["step"], r["pp_layers_0"], r["pp_layers_1"]) for r in replans] == [(2, 3, 1)]
    assert_matches_one_process(losses, reference[0][:STEPS])
    saved = json.loads((tmp_path / "debug" / "checkpoints" / f"step-{STEPS}" / "train_state.json").read_text())
    assert saved["plan"]["pp_layers_per_stage"] == [3, 1]
    # Resumed, the run rebuilds the split in force and goes on with the single-process losses.
    (more, _, _), _ = run_distributed(train_with_a_slow_rank, 2, tmp_path, {"parallel.pp": "2"}, STEPS + 2)
    assert len(more) == 2


@pytest.mark.distributed
@pytest.mark.slow
def test_a_live_replan_of_the_data_shares_keeps_the_single_process_losses(reference, tmp_path):
    (plan, losses, weights), _ = run_distributed(train_through_a_replan, 2, tmp_path)
    assert plan == [[1, 1], [3, 3]]  # from one micro-batch of 4 rows per rank to uneven ones
    check_matches(reference, [{"replan": (losses, weights)}], ["replan"])


def read_jsonl(path):
    """The step records (checkpoint timings are records of their own)."""
    return [r for r in map(json.loads, path.read_text().splitlines()) if "loss" in r]
