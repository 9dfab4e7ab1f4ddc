"""The run plan: what each rank computes, decided in one torch-free place."""

import subprocess
import sys

import pytest

from conftest import ROOT
from titan.config import Config, Layout, Parallel, Training
from titan.errors import ConfigError
from titan.models.llama import FLAVORS
from titan.parallel.checks import check_layout
from titan.run_plan import MULTI_STAGE_SCHEDULES, PP_SCHEDULES, Blocks, run_plan, stages_per_rank


def test_the_multi_stage_schedules_are_torchs():
    from torch.distributed.pipelining.schedules import PipelineScheduleMulti, get_schedule_class

    names = ["GPipe", "1F1B", "Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV"]
    multi = {n.lower() for n in names if issubclass(get_schedule_class(n), PipelineScheduleMulti)}
    assert multi == MULTI_STAGE_SCHEDULES


def test_the_layout_check_knows_torchs_schedules_and_refuses_a_name_in_its_words():
    """The pipeline schedules are checked without importing torch: by a table of torch's, kept equal to it here."""
    from torch.distributed.pipelining.schedules import PipelineScheduleMulti, get_schedule_class

    assert {name: issubclass(get_schedule_class(name), PipelineScheduleMulti) for name in PP_SCHEDULES} == PP_SCHEDULES
    with pytest.raises(ValueError) as torchs:
        get_schedule_class("Zigzag")
    with pytest.raises(ConfigError) as titans:
        check_layout(Config(parallel=Parallel(pp_schedule="Zigzag")), FLAVORS["debug"], Layout(), lambda: None)
    assert str(titans.value) == f"parallel.pp_schedule: {torchs.value}"


@pytest.mark.parametrize("schedule,stages", [("1F1B", 1), ("Interleaved1F1B", 2), ("DualPipeV", 2)])
def test_a_pipeline_step_is_cut_into_the_schedules_micro_batches(schedule, stages):
    config = Config(
        parallel=Parallel(pp=2, pp_schedule=schedule, dp_shard=2),
        training=Training(global_batch_size=32, local_batch_size=8, seq_len=16),
    )
    plan = run_plan(config, 4)
    assert stages_per_rank(config.parallel) == stages
    assert plan.pipeline_microbatches == 2 * stages  # pp x stages per rank, by default
    assert plan.micro_batches == ((8, 8), (8, 8)) and plan.global_rows == 32 and plan.tokens_per_step == 512
    assert plan.rows(1) == range(16, 32)
    assert plan.largest_micro_batch == (8 // (2 * stages), 2 * stages)  # rows the model sees at once, and how many


@pytest.mark.parametrize(
    "degrees",
    [{"pp": 2, "dp_shard": 2, "tp": 2}, {"dp_replicate": 2, "dp_shard": 2, "tp": 2}, {"pp": 2, "dp_replicate": 2,
     "dp_shard": 2}, {"dp_shard": 8}],
    ids=["pp2_fsdp2_tp2", "hsdp2x2_tp2", "pp2_hsdp2x2", "fsdp8"],
)  # fmt: skip
def test_each_ranks_plan_has_the_coordinates_the_device_mesh_gives_it(degrees):
    """RankPlan's coordinates, worked out without torch, are the mesh's, rank by rank (a fake process group of 8)."""
    import torch
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from titan.parallel.mesh import build_mesh

    config = Config(parallel=Parallel(**degrees), training=Training(global_batch_size=32, local_batch_size=2))
    plan = run_plan(config, 8, Blocks(8))
    covered = set()
    for rank in range(8):
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=8)
        try:
            mesh = build_mesh(plan.layout, torch.device("cpu"))
            me = plan.rank(rank)
            assert (me.pp_rank, me.dp_rank, me.tp_rank) == tuple(mesh[d].get_local_rank() for d in ("pp", "dp", "tp"))
        finally:
            dist.destroy_process_group()
        assert me.rows == plan.rows(me.dp_rank) and sum(me.micro_batches) == len(me.rows)
        covered.update((row, me.tp_rank, me.pp_rank) for row in me.rows)
    # Every row of the global batch is read once by each tensor- and pipeline-parallel position.
    assert len(covered) == 32 * plan.layout.tp * plan.layout.pp


def test_a_pipelines_stages_and_layers_are_in_the_plan():
    config = Config(
        parallel=Parallel(pp=2, pp_schedule="Interleaved1F1B"),
        training=Training(global_batch_size=8, local_batch_size=4),
    )
    plan = run_plan(config, 2, Blocks(8))
    assert plan.stage_layers == ((0, 1), (2, 3), (4, 5), (6, 7))
    assert [plan.rank(r).stage_ids for r in range(2)] == [(0, 2), (1, 3)]  # looped: rank r runs r, r + pp
    resplit = run_plan(config, 2, Blocks(8), layers_per_stage=[3, 1, 3, 1])
    assert resplit.stage_layers == ((0, 1, 2), (3,), (4, 5, 6), (7,)) and resplit.micro_batches == plan.micro_batches
    assert run_plan(config, 2).stage_layers == ()  # the batch alone: no model, no split


def test_the_run_plan_is_made_without_torch_at_64_data_parallel_ranks():
    """titan config show and the planners decide every rank's work before torch is imported."""
    code = """
import sys
sys.modules["torch"] = None  # importing torch now fails
from titan.config import load_config
from titan.run_plan import run_plan
overrides = ["--parallel.tp", "2", "--training.global_batch_size", "256", "--training.local_batch_size", "2"]
plan = run_plan(load_config("recipes/debug.toml", overrides, world_size=128), 128)
ranks = [plan.rank(r) for r in range(128)]
assert plan.layout.dp == 64 and sorted(row for r in ranks if r.tp_rank == 0 for row in r.rows) == list(range(256))
print(plan.tokens_per_step)
"""
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == [str(256 * 256)]
