"""What each rank computes in a step, decided in one place: `run_plan(config, world_size)`.

The global batch is the contract: its rows are shared out among the data-parallel ranks by their speeds
(parallel.dp_weights, or a straggler re-plan's measured ones) as closely as a runnable plan allows
(balance.plan_shares), each rank reads its share at most training.local_batch_size rows at a time, and every
rank runs the same number of micro-batches (FSDP's collectives run once per micro-batch on every rank). Under a
pipeline each micro-batch is cut again into the schedule's micro-batches. The trainer, the loaders, activation
checkpointing, the pipeline and `titan plan` read the plan; a re-plan makes a new one through this function.
Torch-free, so `titan config show` and the planners import it without torch.

A plan answers for every rank (RunPlan.rank): its coordinates on the mesh, the global rows it reads, its
micro-batches, its pipeline stages and their layers, the precision rule and how tensor parallelism shards the
sequence.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from titan.balance import layer_split, micro_batch_sizes, plan_shares
from titan.config import Config, Layout, Parallel
from titan.errors import ConfigError

# torch.distributed.pipelining's schedules as its get_schedule_class names them (in its order: its error lists
# them), and whether each is a PipelineScheduleMulti, which may run several stages per rank
# (tests/core/test_run_plan.py checks both against torch).
PP_SCHEDULES = {
    "1F1B": False,
    "Interleaved1F1B": True,
    "GPipe": False,
    "LoopedBFS": True,
    "InterleavedZeroBubble": True,
    "PipelineScheduleSingle": False,
    "PipelineScheduleMulti": True,
    "ZBVZeroBubble": True,
    "DualPipeV": True,
}
# The named schedules that run two stages per rank unless told otherwise (the base class aside).
MULTI_STAGE_SCHEDULES = {n.lower() for n, several in PP_SCHEDULES.items() if several and n != "PipelineScheduleMulti"}
# Schedules whose stages sit on the ranks in a V (rank r holds stages r and 2*pp-1-r).
V_SHAPED = {"zbvzerobubble", "dualpipev"}


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
class Blocks:
    """The model's blocks as the layer split sees them: how many, and the memory each takes in training (fp32
    weights, gradients and two Adam moments: 16 bytes per parameter; a MoE's routed blocks outweigh its dense
    ones), by layer (empty: not counted)."""

    count: int
    gib: tuple[float, ...] = ()


def stage_layers(n_layers: int, p: Parallel, layer_gib: Sequence[float] = (), counts: list[int] | None = None):
    """Layer ids of every stage, for `n_layers` layers of `layer_gib` each (by layer; empty: none): `counts` (a
    re-split's) or the recipe's
    explicit counts, a split by stage speeds and memory caps, or an even split (earlier stages take the remainder,
    since the last stage also carries the output head)."""
    n_stages = p.pp * stages_per_rank(p)
    if p.pp_schedule.lower() in V_SHAPED and stages_per_rank(p) != 2:
        raise ConfigError(f"parallel.pp_schedule {p.pp_schedule} needs parallel.pp_stages_per_rank = 2")
    counts = list(counts or p.pp_layers_per_stage)
    if not counts and n_stages > n_layers:
        raise ConfigError(
            f"parallel.pp = {p.pp} with {stages_per_rank(p)} stages per rank needs {n_stages} layers; the "
            f"model has {n_layers}"
        )
    if not counts and (p.pp_stage_speeds or p.pp_stage_memory_gib):
        speeds = p.pp_stage_speeds or [1.0] * n_stages  # memory caps alone bound a split of even speeds
        if len(speeds) != n_stages or min(speeds) <= 0:
            raise ConfigError(
                f"parallel.pp_stage_speeds {speeds} must list {n_stages} positive speeds (pp x stages per rank)"
            )
        caps = p.pp_stage_memory_gib or None
        if caps is not None and len(caps) != n_stages:
            raise ConfigError(f"parallel.pp_stage_memory_gib {caps} must list {n_stages} caps, one per stage")
        try:
            counts = layer_split([1.0] * n_layers, speeds, list(layer_gib) or None, caps)
        except ValueError:
            raise ConfigError(
                f"parallel.pp_stage_memory_gib {caps}: no split of the {n_layers} layers ({_gib_each(layer_gib)} GiB "
                "of weights, gradients and Adam moments each) fits; raise the caps or use more stages"
            ) from None
    if counts:
        if len(counts) != n_stages or sum(counts) != n_layers or min(counts) < 0:
            raise ConfigError(
                f"parallel.pp_layers_per_stage {counts} must list {n_stages} non-negative counts (pp x stages per "
                f"rank) summing to the model's {n_layers} layers"
            )
    else:
        counts = [n_layers // n_stages + (1 if s < n_layers % n_stages else 0) for s in range(n_stages)]
    starts = [sum(counts[:s]) for s in range(n_stages)]
    return [list(range(start, start + count)) for start, count in zip(starts, counts)]


def _gib_each(layer_gib: Sequence[float]) -> str:
    low, high = min(layer_gib, default=0.0), max(layer_gib, default=0.0)
    return f"{high:.3g}" if low == high else f"{low:.3g} to {high:.3g}"


def stage_ids(pp_rank: int, pp: int, n_stages: int, schedule: str) -> list[int]:
    """The pipeline stages pipeline rank `pp_rank` runs."""
    if pp == 1:
        return [0]
    if schedule.lower() in V_SHAPED:
        return [pp_rank, 2 * pp - 1 - pp_rank]
    return list(range(pp_rank, n_stages, pp))  # looped: rank r holds stages r, r + pp, ...


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
class RankPlan:
    """What one rank computes in every step."""

    rank: int
    pp_rank: int
    dp_rank: int  # in the flattened data-parallel group (dp_replicate x dp_shard)
    tp_rank: int
    rows: range  # the rows of every global batch it reads (its data-parallel rank's contiguous share)
    micro_batches: tuple[int, ...]  # rows of each micro-batch
    stage_ids: tuple[int, ...]  # the pipeline stages it runs ((0,) without a pipeline)
    cp_rank: int = 0  # in its context-parallel group
    # The positions of each row it computes: the whole row, or under context parallelism its two chunks.
    sequence: tuple[range, ...] = ()

    @property
    def first_of_its_stages(self) -> bool:
        """Whether it is the first of the ranks that hold its pipeline stages (alike or as shards)."""
        return self.dp_rank == 0 and self.tp_rank == 0 and self.cp_rank == 0


@dataclass(frozen=True)
class RunPlan:
    """The step of every rank (a pipeline, tensor- or context-parallel group reads the same rows)."""

    layout: Layout
    seq_len: int
    micro_batches: tuple[tuple[int, ...], ...]  # rows of each micro-batch, per data-parallel rank in rank order
    dp_weights: tuple[float, ...]  # the data-parallel ranks' relative speeds the shares follow
    pipeline_microbatches: int  # the schedule's micro-batches per micro-batch; 0 without a pipeline
    precision: Precision
    # Layer ids of each pipeline stage; empty when the plan was made without the model's blocks (a check of the
    # batch alone, before torch is imported).
    stage_layers: tuple[tuple[int, ...], ...]
    schedule: str  # parallel.pp_schedule, lower case
    sequence_shards: int  # sequence parallelism cuts the sequence between blocks into this many pieces
    # Tokens a rank's micro-batch holds under data.batching = "tokens" (0 with rows): under context parallelism a
    # rank's own (local) row, and a ring row, which the cp group shares, cp times as many.
    document_capacity: int

    @property
    def global_rows(self) -> int:
        return sum(map(sum, self.micro_batches))

    @property
    def tokens_per_step(self) -> int:
        return self.global_rows * self.seq_len

    @property
    def n_stages(self) -> int:
        return len(self.stage_layers)

    def rows(self, dp_rank: int) -> range:
        """The rows of every global batch that data-parallel rank `dp_rank` reads: a contiguous share."""
        start = sum(map(sum, self.micro_batches[:dp_rank]))
        return range(start, start + sum(self.micro_batches[dp_rank]))

    def stages(self, pp_rank: int) -> tuple[int, ...]:
        """The pipeline stages pipeline rank `pp_rank` runs."""
        return tuple(stage_ids(pp_rank, self.layout.pp, self.n_stages, self.schedule))

    def sequence(self, cp_rank: int) -> tuple[range, ...]:
        """The positions of each row that context-parallel rank `cp_rank` computes: of the row's 2·cp equal chunks,
        chunks cp_rank and 2·cp-1-cp_rank, so that under a causal mask every rank attends to as many keys (the whole
        row without context parallelism)."""
        cp = self.layout.cp
        if cp == 1:
            return (range(self.seq_len),)
        size = self.seq_len // (2 * cp)
        return tuple(range(c * size, (c + 1) * size) for c in (cp_rank, 2 * cp - 1 - cp_rank))

    def rank(self, rank: int) -> RankPlan:
        """Rank `rank`'s work; its coordinates follow the device mesh (pp, dp_replicate, dp_shard, cp, tp), tp
        innermost."""
        layout = self.layout
        tp_rank, cp_rank = rank % layout.tp, rank // layout.tp % layout.cp
        dp_rank, pp_rank = rank // (layout.tp * layout.cp) % layout.dp, rank // (layout.tp * layout.cp * layout.dp)
        return RankPlan(
            rank,
            pp_rank,
            dp_rank,
            tp_rank,
            self.rows(dp_rank),
            self.micro_batches[dp_rank],
            self.stages(pp_rank),
            cp_rank,
            self.sequence(cp_rank),
        )

    @property
    def schedule_runs(self) -> int:
        """How often a step runs the pipeline schedule: once per micro-batch of the data-parallel plan (gradient
        accumulation under a pipeline); 1 without a pipeline, where largest_micro_batch counts every micro-batch."""
        return len(self.micro_batches[0]) if self.pipeline_microbatches else 1

    @property
    def largest_micro_batch(self) -> tuple[int, int]:
        """(rows, count) of the largest micro-batch any rank runs and how many a rank runs per schedule run, counted
        as the model sees them: a pipeline's own micro-batches under a pipeline. A step runs count x schedule_runs
        of them."""
        rows, count = max(map(max, self.micro_batches)), len(self.micro_batches[0])
        if self.pipeline_microbatches:
            return rows // self.pipeline_microbatches, self.pipeline_microbatches
        return rows, count


def run_plan(
    config: Config,
    world_size: int,
    blocks: Blocks | None = None,
    *,
    dp_weights: list[float] | None = None,
    layers_per_stage: list[int] | None = None,
) -> RunPlan:
    """The plan of `config` on `world_size` ranks for a model of `blocks` (None: the batch alone), the data shares
    following `dp_weights` (default: parallel.dp_weights, else even) and the pipeline's layers
    `layers_per_stage` (default: the recipe's rule). A re-plan calls it again with the measured values.
    ConfigError, naming the keys, when the recipe cannot be cut so."""
    t, p = config.training, config.parallel
    layout = Layout.from_config(p, world_size)
    pipeline = pipeline_microbatches(p)
    rows = t.global_batch_size or t.local_batch_size * layout.dp
    weights = dp_weights or p.dp_weights or [1.0] * layout.dp
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
    capacity = 0
    if config.data.batching == "tokens":
        # As many tokens as the rows recipe's micro-batch: local_batch_size x seq_len, or under a pipeline one
        # schedule micro-batch's rows; the same on every rank, so that every rank places documents alike.
        rows_each = max(s[0] for s in sizes) // pipeline if pipeline else t.local_batch_size
        capacity = rows_each * t.seq_len
        longest = config.data.max_document_len or t.seq_len
        if longest > capacity:
            raise ConfigError(
                f"data.max_document_len {longest}: a document piece that long fits no micro-batch, which holds "
                f"{capacity} tokens ({rows_each} x training.seq_len {t.seq_len}); lower data.max_document_len or "
                "raise training.local_batch_size"
            )
        capacity //= layout.cp
    layers: list[list[int]] = []
    if blocks is not None and layout.pp > 1:
        layers = stage_layers(blocks.count, p, blocks.gib, layers_per_stage)
    elif blocks is not None:
        layers = [list(range(blocks.count))]
    return RunPlan(
        layout,
        t.seq_len,
        tuple(map(tuple, sizes)),
        tuple(weights),
        pipeline,
        precision(config, layout),
        tuple(map(tuple, layers)),
        p.pp_schedule.lower(),
        layout.tp if layout.tp > 1 and p.sequence_parallel else 1,
        capacity,
    )
