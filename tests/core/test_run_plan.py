"""The run plan: what each rank computes, decided in one torch-free place."""

import pytest

from titan.config import Config
from titan.run_plan import MULTI_STAGE_SCHEDULES, run_plan, stages_per_rank


def test_the_multi_stage_schedules_are_torchs():
    from torch.distributed.pipelining.schedules import PipelineScheduleMulti, get_schedule_class

    names = ["GPipe", "1F1B", "Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV"]
    multi = {n.lower() for n in names if issubclass(get_schedule_class(n), PipelineScheduleMulti)}
    assert multi == MULTI_STAGE_SCHEDULES


@pytest.mark.parametrize("schedule,stages", [("1F1B", 1), ("Interleaved1F1B", 2), ("DualPipeV", 2)])
def test_a_pipeline_step_is_cut_into_the_schedules_micro_batches(schedule, stages):
    config = Config()
    config.parallel.pp, config.parallel.pp_schedule, config.parallel.dp_shard = 2, schedule, 2
    config.training.global_batch_size, config.training.local_batch_size, config.training.seq_len = 32, 8, 16
    plan = run_plan(config, 4)
    assert stages_per_rank(config.parallel) == stages
    assert plan.pipeline_microbatches == 2 * stages  # pp x stages per rank, by default
    assert plan.micro_batches == ((8, 8), (8, 8)) and plan.global_rows == 32 and plan.tokens_per_step == 512
    assert plan.rows(1) == range(16, 32)
    assert plan.largest_micro_batch == (8 // (2 * stages), 2 * stages)  # rows the model sees at once, and how many
