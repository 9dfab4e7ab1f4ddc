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

from titan.config import Config
from titan.models import ModelSpec, StageBatch
from titan.parallel import float8
from titan.parallel.ac import apply_activation_checkpointing, block_choices
from titan.parallel.cp.ring import apply_context_parallel
from titan.parallel.ep import apply_expert_parallel
from titan.parallel.fsdp import apply_fsdp
from titan.run_plan import RunPlan


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
    device: torch.device | None = None,  # where it runs (None: a plan's trace), and "auto" checkpointing measures
    layers: Sequence[int] | None = None,  # the model's layers that `model` holds (None: all), for "auto"
) -> None:
    p, layout = config.parallel, plan.layout
    blocks = spec.blocks(model)
    float8.convert(model, blocks, config, layout, device)
    checkpointing = block_choices(model, spec, config, plan, device, layers)  # measures plain blocks: before TP
    if layout.tp > 1:
        styles = float8.tp_styles(blocks, config, mesh["tp"])  # None: torch's own TP styles
        parallelize_module(model, mesh["tp"], spec.tp_plan(model, p.sequence_parallel, p.loss_parallel, styles))
        model.sequence_shards = plan.sequence_shards
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
