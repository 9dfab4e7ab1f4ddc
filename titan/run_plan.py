"""What each rank computes in a step, decided in one place: `run_plan(config, world_size)`.

The global batch is the contract: its rows are shared out among the data-parallel ranks by their speeds
(parallel.dp_weights, or a straggler re-plan's measured ones) as closely as a runnable plan allows
(balance.plan_shares), each rank reads its share at most training.local_batch_size rows at a time, and every
rank runs the same number of micro-batches (FSDP's collectives run once per micro-batch on every rank). Under a
pipeline each micro-batch is cut again into the schedule's micro-batches. The trainer, the loaders, activation
checkpointing, the pipeline and `titan plan` read the plan; a re-plan makes a new one through this function.
Torch-free, so `titan config show` and the planners import it without torch.
"""

from __future__ import annotations

from dataclasses import dataclass

from titan.balance import micro_batch_sizes, plan_shares
from titan.config import Config, Layout, Parallel
from titan.errors import ConfigError

# torch's schedules that run several stages per rank (PipelineScheduleMulti; tests/core/test_run_plan.py checks it).
MULTI_STAGE_SCHEDULES = {"interleaved1f1b", "loopedbfs", "interleavedzerobubble", "zbvzerobubble", "dualpipev"}


def stages_per_rank(p: Parallel) -> int:
    if p.pp_stages_per_rank:
        return p.pp_stages_per_rank
    return 2 if p.pp_schedule.lower() in MULTI_STAGE_SCHEDULES else 1


def pipeline_microbatches(p: Parallel) -> int:
    """The schedule's micro-batches per micro-batch of the data-parallel plan; 0 without a pipeline."""
    if p.pp == 1:
        return 0
    n = p.pp_microbatches or p.pp * stages_per_rank(p)
    if n < p.pp:
        raise ConfigError(f"parallel.pp_microbatches ({n}) must be at least parallel.pp ({p.pp}) to fill the pipeline")
    return n


@dataclass(frozen=True)
class Precision:
    """How a layout runs training.mixed_precision = "bf16" (the rule every part follows): with FSDP (dp > 1), its
    mixed-precision policy gathers the parameters in bf16, so every activation, the residual stream and what
    pipeline stages exchange included, is bf16; without FSDP, autocast runs the matmuls in bf16 on fp32
    parameters and the residual stream stays fp32. Gradients are always reduced, and weights kept, in fp32."""

    bf16: bool  # the matmuls run in bf16
    fsdp_params: bool  # FSDP gathers the parameters in bf16 (its param_dtype)
    autocast: bool  # autocast runs the matmuls in bf16

    @property
    def stream_bf16(self) -> bool:
        """The hidden states between blocks and stages are bf16."""
        return self.fsdp_params


def precision(config: Config, layout: Layout) -> Precision:
    bf16 = config.training.mixed_precision == "bf16"
    return Precision(bf16, bf16 and layout.dp > 1, bf16 and layout.dp == 1)  # FSDP is applied when dp > 1


@dataclass(frozen=True)
class RunPlan:
    """The step of every data-parallel rank (a pipeline or tensor-parallel group reads the same rows)."""

    layout: Layout
    seq_len: int
    micro_batches: tuple[tuple[int, ...], ...]  # rows of each micro-batch, per data-parallel rank in rank order
    pipeline_microbatches: int  # the schedule's micro-batches per micro-batch; 0 without a pipeline
    precision: Precision

    @property
    def global_rows(self) -> int:
        return sum(map(sum, self.micro_batches))

    @property
    def tokens_per_step(self) -> int:
        return self.global_rows * self.seq_len

    def rows(self, dp_rank: int) -> range:
        """The rows of every global batch that data-parallel rank `dp_rank` reads: a contiguous share."""
        start = sum(map(sum, self.micro_batches[:dp_rank]))
        return range(start, start + sum(self.micro_batches[dp_rank]))

    @property
    def largest_micro_batch(self) -> tuple[int, int]:
        """(rows, count) of the largest micro-batch any rank runs and how many a rank runs per step, counted as
        the model sees them: a pipeline's own micro-batches under a pipeline."""
        rows, count = max(map(max, self.micro_batches)), len(self.micro_batches[0])
        if self.pipeline_microbatches:
            return rows // self.pipeline_microbatches, self.pipeline_microbatches
        return rows, count


def run_plan(config: Config, world_size: int, weights: list[float] | None = None) -> RunPlan:
    """The plan of `config` on `world_size` ranks, the data shares following `weights` (default:
    parallel.dp_weights, else even); ConfigError, naming the keys, when the batch cannot be cut so."""
    t, p = config.training, config.parallel
    layout = Layout.from_config(p, world_size)
    pipeline = pipeline_microbatches(p)
    rows = t.global_batch_size or t.local_batch_size * layout.dp
    weights = weights or p.dp_weights or [1.0] * layout.dp
    try:
        shares = plan_shares(rows, weights, t.local_batch_size, pipeline)
        sizes = micro_batch_sizes(shares, t.local_batch_size, pipeline)
    except ValueError as e:
        if pipeline:
            raise ConfigError(
                f"parallel.pp_microbatches ({pipeline}) with training.local_batch_size ({t.local_batch_size}): "
                f"{e}; make training.global_batch_size a multiple of pp_microbatches x data-parallel size"
            ) from None
        raise ConfigError(
            f"training.global_batch_size ({t.global_batch_size or 'local x dp'}) over {layout.dp} data-parallel "
            f"ranks{' weighted ' + str(p.dp_weights) if p.dp_weights else ''}: {e}; raise global_batch_size or "
            "local_batch_size"
        ) from None
    return RunPlan(layout, t.seq_len, tuple(map(tuple, sizes)), pipeline, precision(config, layout))
