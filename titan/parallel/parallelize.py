"""Build the model for a layout: split into pipeline stages, then per stage float8 conversion, TP, EP, activation
checkpointing, compile and FSDP (in that order: float8 swaps the plain linears before TP shards them, and
FSDP must wrap the TP and EP DTensors and the compiled blocks), then materialise and initialise the local shards
from the seed."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor.parallel import parallelize_module

from titan.config import Config, Layout
from titan.errors import ConfigError
from titan.models import ModelSpec, StageBatch
from titan.parallel import float8, pp
from titan.parallel.ac import apply_activation_checkpointing, block_choices
from titan.parallel.cp.ring import apply_context_parallel
from titan.parallel.ep import apply_expert_parallel
from titan.parallel.fsdp import apply_fsdp
from titan.run_plan import V_SHAPED, Blocks, RunPlan, stages_per_rank


@dataclass
class ModelParts:
    """The model as this rank holds it: one part, or the pipeline stages this rank runs."""

    parts: list[nn.Module]
    stage_ids: list[int]  # pipeline stage index of each part ([0] without PP)
    n_stages: int

    @property
    def has_first_stage(self) -> bool:
        return 0 in self.stage_ids

    @property
    def has_last_stage(self) -> bool:
        return self.n_stages - 1 in self.stage_ids

    def parameters(self):
        for part in self.parts:
            yield from part.parameters()

    def reshard(self) -> None:
        """Put FSDP's sharded parameters back. A forward without backward (evaluation) leaves the modules
        that skip resharding after forward (the last block, the root) holding unsharded parameters, which
        are other tensors than the ones the optimizer and checkpoints know."""
        for part in self.parts:
            for module in part.modules():
                if isinstance(module, FSDPModule):
                    module.reshard()

    def n_params(self, first_of_its_stages: bool) -> int:
        """Parameters of the whole model, not this rank's shard (a collective under a pipeline: every rank calls it,
        and the first rank of each pipeline rank's stages counts them)."""
        here = sum(p.numel() for _, p in self.named_parameters())  # DTensors count their global size
        if self.n_stages == 1:
            return here
        total = torch.tensor(here if first_of_its_stages else 0)
        torch.distributed.all_reduce(total)
        return int(total)

    def named_parameters(self):
        seen = set()
        for part in self.parts:
            for name, p in part.named_parameters():
                if name not in seen:
                    seen.add(name)
                    yield name, p

    def train(self, mode: bool = True):
        for part in self.parts:
            part.train(mode)


def check_layout(config: Config, spec: ModelSpec, args, layout: Layout, device: torch.device | None) -> None:
    """Every combination that cannot work with this model and device, refused with its reason before any work
    starts (run_plan then checks the batch and the layer split). device None: not on this machine, so what the
    layout asks of it is left to the run."""
    p = config.parallel
    pp.schedule_class(p.pp_schedule)  # a misspelt schedule is an error even while pp = 1
    try:
        stages = layout.pp * stages_per_rank(p) if layout.pp > 1 else 1
        spec.check_parallelism(args, layout.tp, stages, layout.ep, layout.cp)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    if layout.pp > 1:
        pp.check_stages(p, stages_per_rank(p))
        if p.fsdp_reshard_after_forward == "always" and p.pp_schedule.lower() in pp.ZERO_BUBBLE and layout.dp > 1:
            # Known on torch 2.13: the deferred weight-gradient pass then meets resharded parameters and the
            # gradients come out wrong without any error.
            raise ConfigError(
                f"parallel.fsdp_reshard_after_forward = 'always' with the zero-bubble schedule {p.pp_schedule} "
                "gives wrong "
                "gradients in torch 2.13; use 'default' or 'never'"
            )
        if config.validation.interval and p.pp_schedule.lower() in V_SHAPED:
            # torch 2.13: a V-shaped schedule's eval() still runs its backward actions and fails at the first
            # pair of adjacent stages on one rank ("can't steal_bwd_input").
            raise ConfigError(
                f"validation with the V-shaped schedule {p.pp_schedule} fails in torch 2.13 (its eval path runs "
                "backward actions); use another parallel.pp_schedule, or set validation.interval = 0"
            )
    if device is None:
        return
    if p.backend == "nccl" and device.type != "cuda" and layout.world_size > 1:
        raise ConfigError("parallel.backend = 'nccl' needs CUDA GPUs; use 'gloo' (or 'auto') on CPU")
    if config.compile.enable and layout.tp > 1 and p.sequence_parallel and device.type == "cpu":
        # torch 2.13: the backward of a compiled block with sequence-parallel DTensors fails on CPU.
        raise ConfigError(
            "compile.enable with parallel.tp > 1 and sequence_parallel fails on CPU in torch 2.13; "
            "set parallel.sequence_parallel = false or compile.enable = false"
        )
    float8.check_float8(config, layout, device, spec, args)


def stage_batch(plan: RunPlan, documents: bool, rows: int, seq_len: int, stage: int) -> StageBatch:
    """What pipeline stage `stage` exchanges for a micro-batch of rows x seq_len tokens. FSDP with bf16 casts a
    stage's inputs to bf16 (its mixed-precision policy) and the residual stream stays in it; autocast alone keeps
    the residual stream in fp32. Sequence parallel splits the sequence over the TP ranks."""
    return StageBatch(
        rows=rows,
        seq_len=seq_len,
        dtype=torch.bfloat16 if plan.precision.stream_bf16 else torch.float32,
        seq_shards=plan.sequence_shards,
        context_shards=plan.layout.cp,
        documents=documents,
        first=stage == 0,
        last=stage == plan.n_stages - 1,
    )


def model_blocks(spec: ModelSpec, args) -> Blocks:
    """The model's blocks for the layer split, with the memory one takes in training: its fp32 weights, gradients
    and two Adam moments (16 bytes per parameter)."""
    with torch.device("meta"):
        block = spec.blocks(spec.build(args))[0]
    return Blocks(args.n_layers, 16 * sum(p.numel() for p in block.parameters()) / 2**30)


def build_model_parts(
    config: Config, spec: ModelSpec, args, plan: RunPlan, rank: int, mesh: dict[str, DeviceMesh], device: torch.device
) -> ModelParts:
    """Global rank `rank`'s stages of the model (the whole model without a pipeline), parallelised and
    initialised from the seed."""
    with torch.device("meta"):
        model = spec.build(args, traceable=config.compile.enable)  # compiled blocks must not branch on the data
    ids = list(plan.rank(rank).stage_ids)
    if plan.layout.pp > 1:
        last = plan.n_stages - 1
        parts = [spec.pipeline_stage(model, list(plan.stage_layers[s]), s == 0, s == last) for s in ids]
    else:
        parts = [model]
    for part, s in zip(parts, ids):
        parallelize(part, spec, config, plan, mesh, device, plan.stage_layers[s])
        if plan.layout.cp > 1:
            apply_context_parallel(part, plan, rank, mesh["cp"], device)
        part.to_empty(device=device)
        part.init_weights(config.job.seed)
    return ModelParts(parts, ids, plan.n_stages)


def parallelize(
    model: nn.Module,
    spec: ModelSpec,
    config: Config,
    plan: RunPlan,
    mesh: dict[str, DeviceMesh],
    device: torch.device | None = None,  # where activation_checkpoint.mode = "auto" measures a block
    layers: Sequence[int] | None = None,  # the model's layers that `model` holds (None: all), for "auto"
) -> None:
    p, layout = config.parallel, plan.layout
    blocks = spec.blocks(model)
    float8.convert(model, blocks, config, layout)
    checkpointing = block_choices(model, spec, config, plan, device, layers)  # measures plain blocks: before TP
    if layout.tp > 1:
        styles = float8.tp_styles(blocks, config, mesh["tp"])  # None: torch's own TP styles
        parallelize_module(model, mesh["tp"], spec.tp_plan(model, p.sequence_parallel, p.loss_parallel, styles))
    if layout.ep > 1:
        apply_expert_parallel(model, mesh["ep"])
    if model.routing is not None:
        # A mixture of experts' balance loss counts each row whole over the ranks that split its tokens.
        model.routing.split_rows(*(mesh[d].get_group() if getattr(layout, d) > 1 else None for d in ("cp", "tp")))
    apply_activation_checkpointing(blocks, checkpointing, config.activation_checkpoint.save_ops)
    if config.compile.enable:
        import torch._inductor.config as inductor  # a process-wide setting: every compiled block follows the recipe

        inductor.reorder_for_peak_memory = config.compile.reorder_for_peak_memory
        for block in blocks:
            block.compile()
    if layout.dp > 1:
        reshard = {"always": True, "never": False, "default": layout.pp == 1}[p.fsdp_reshard_after_forward]
        param_dtype = torch.bfloat16 if plan.precision.fsdp_params else None
        apply_fsdp(model, blocks, mesh["fsdp"], param_dtype, reshard, p.fsdp_cpu_offload, mesh.get("efsdp"))
