"""What `titan plan` works out of a step (StepEstimate) and of each pipeline rank's share of it (RankEstimate)."""

from __future__ import annotations

from dataclasses import dataclass, field

from titan.config import Config, Layout
from titan.parallel.ac_choices import GIB, BlockChoices, Option
from titan.run_plan import RunPlan
from titan.train.estimate.devices import Device
from titan.train.estimate.trace import RankTrace


@dataclass
class RankEstimate:
    """One pipeline rank's step at its real depth (every rank of that pipeline rank alike)."""

    pp_rank: int
    stage_ids: list[int]
    layers: list[list[int]]  # per stage
    trace: RankTrace  # grown to the stages' real depths
    in_flight: int  # most micro-batches whose activations the rank holds at once
    activations: int  # bytes they hold then
    peak: int
    peak_by_mode: dict[str, int]  # the peak under each activation checkpointing mode
    flops: float  # per step, recomputation included
    traffic: dict[tuple[str, str], float]  # bytes per step, by (collective, mesh dimension)
    seconds: float = 0.0  # the rank's forwards, backwards and optimizer step, without waiting
    checkpointing: BlockChoices | None = None  # activation_checkpoint.mode = "auto": each of its blocks' way, in order
    # ... within this many bytes per micro-batch (activation_checkpoint.budget_gib, or with 0 what the device leaves)
    budget: int = 0
    all_to_all_formula: int = 0  # expert parallelism's all-to-all bytes per step by the formula (experts.py)


@dataclass
class StepEstimate:
    config: Config
    device: Device
    run: RunPlan  # what each rank computes
    layout: Layout
    rows: int  # sequences per micro-batch
    microbatches: int  # per rank and schedule run (the pipeline's, under a pipeline)
    runs: int  # schedule runs per step: gradient accumulation under a pipeline, else 1
    params: int = 0  # the whole model's
    # Each layer's kind of block (ModelSpec.block_kinds), and one block's figures per kind, the first layer's first:
    # a mixture of experts' routed blocks keep more than its dense ones.
    kinds: list[str] = field(default_factory=list)
    kind_activations: dict[str, dict[str, int]] = field(default_factory=dict)  # one block, one micro-batch, per mode
    kind_options: dict[str, list[Option]] = field(default_factory=dict)  # mode = "auto": what the planner chose from
    # compile.enable: bytes less that a compiled block keeping everything keeps than an eager one, per rank
    compiled_saving: int = 0
    # A mixture of experts: what one MoE layer's routed experts keep for backward per micro-batch, without
    # checkpointing (under expert parallelism, on the most loaded rank)
    routed_activations: int = 0
    ranks: list[RankEstimate] = field(default_factory=list)
    order: list | None = None  # under a pipeline, each pipeline rank's schedule actions
    step_seconds: float = 0.0
    mfu: float = 0.0

    @property
    def block_activations(self) -> dict[str, int]:
        """The first block's activations per mode (every block's, in a model of one kind of block)."""
        return self.kind_activations[self.kinds[0]]

    @property
    def block_options(self) -> list[Option]:
        return self.kind_options.get(self.kinds[0], [])

    @property
    def usable_bytes(self) -> float:
        return self.device.memory_gib * (1 - self.config.plan.headroom_fraction) * GIB
