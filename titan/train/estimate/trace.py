"""One pipeline rank's training step run under fake tensors on a fake process group of the real world size: its
memory, FLOPs, roofline time and collective traffic, with nothing allocated.

The rank's stages are built on the meta device and parallelised by titan's own build steps
(titan/parallel/parallelize.py: float8, TP, activation checkpointing, FSDP; context parallelism's ring, whose
point-to-point sends the fake process group takes as it takes collectives), materialised as fake tensors
(FakeTensorMode: shapes and dtypes, no data), and run as the trainer runs them: micro-batches forward and backward
(as a pipeline schedule does, with FSDP's gradients reduced once, after the last), then gradient clipping and
AdamW. counters.py measures.
"""

from __future__ import annotations

import dataclasses
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed.fsdp import FSDPModule
from torch.distributed.pipelining import PipelineStage
from torch.distributed.tensor import DTensor
from torch.multiprocessing.reductions import StorageWeakRef
from torch.testing._internal.distributed.fake_pg import FakeStore  # registers the "fake" backend

from titan.config import Config, Layout
from titan.optim import build_lr_scheduler, build_optimizer, ensure_optimizer_state
from titan.parallel.cp.ring import apply_context_parallel
from titan.parallel.ep import expert_modules
from titan.parallel.mesh import build_mesh
from titan.parallel.parallelize import parallelize, stage_batch
from titan.run_plan import RunPlan
from titan.train.estimate.counters import Cost, StepCounter, StepPeak, nbytes, total_bytes, unobserved_shape_propagation
from titan.train.estimate.devices import Device
from titan.train.model import ResolvedModel
from titan.train.step import StepRules, token_loss

CPU = torch.device("cpu")


@dataclass
class RankTrace:
    """Micro-batches through a rank's stages, each cut to the traced depth, and the optimizer step after them."""

    stage_ids: list[int]
    n_stages: int  # in the pipeline
    blocks: list[int]  # per stage
    params: int  # this rank's parameters: elements of its shards
    total_params: int  # the same parameters whole (DTensor global sizes)
    expert_params: int  # of `params`, the routed experts' (a mixture of experts)
    param_bytes: int
    optimizer_bytes: int
    groups: dict[str, tuple[int, ...]]  # the ranks of each mesh dimension's process group around this rank
    grad_bytes: int = 0
    forward: dict[int, Cost] = field(default_factory=dict)  # one micro-batch's, per stage
    backward: dict[int, Cost] = field(default_factory=dict)
    once: Cost = field(default_factory=Cost)  # what a step adds once: the first micro-batch's extra, the reduction
    optimizer: Cost = field(default_factory=Cost)
    held: dict[int, int] = field(default_factory=dict)  # activation bytes a stage's forward holds for its backward
    block_held: list[int] = field(default_factory=list)  # the same, per block of the deepest stage
    routed_held: list[int] = field(default_factory=list)  # the same, per routed experts' forward (dispatch included)
    first_peak: int = 0  # bytes at the peak of the first micro-batch, before any gradient
    peak: int = 0  # the same with the states of a steady step: the last micro-batch's
    optimizer_peak: int = 0
    largest: tuple[int, str] = (0, "")  # the largest tensor an op allocated, and the op
    boundary_bytes: int = 0  # a stage's output for one micro-batch: what a pipeline sends between stages


@dataclass(frozen=True)
class TraceContext:
    """What every trace of one estimate shares: the model, the run plan, the fake world's mesh, the rows of a
    micro-batch and the device the figures are for."""

    model: ResolvedModel
    plan: RunPlan
    mesh: dict
    rows: int
    device: Device


@contextmanager
def fake_world(layout: Layout):
    """This process as rank 0 of the layout's world, whose collectives move nothing: the device mesh."""
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=layout.world_size)
    try:
        yield build_mesh(layout, CPU)
    finally:
        dist.destroy_process_group()
        # DTensor caches each op's sharding by its inputs' specs, whose meshes compare equal across worlds: a later
        # world of the same shape in this process (a run after its plan) would take the cached specs, meshes of
        # this world's destroyed groups, and run its collectives on whatever groups now bear their names.
        DTensor._op_dispatcher.sharding_propagator.propagate_op_sharding.cache_clear()
        torch._C._clear_DTensor_sharding_propagator_cache()  # and its C++ dispatch's copy


def trace_rank(
    config: Config,
    context: TraceContext,
    pp_rank: int,
    depth: int,
    micro_batches: int,
    deeper: int = 0,
    optimizer: bool = True,
    like: int | None = None,
) -> RankTrace:
    """Run `micro_batches` micro-batches of the context's rows (1, or 2 for a steady one after the first; 0: one
    forward only, for its activations) through the stages of pipeline rank `pp_rank`, each cut to its first
    `depth` blocks (its longest stage to `depth + deeper`), then the `optimizer` step, on the fake world's mesh.
    `like`: every block built as that layer is, in place of the stage's own (one block of a kind). The stages are
    parallelised as global rank 0 holds them: every rank of a stage holds alike shards (FSDP's first is the
    largest), and every cp rank as much of each row."""
    plan, mesh = context.plan, context.mesh
    layers, n_stages, ids = plan.stage_layers, plan.n_stages, list(plan.stages(pp_rank))
    longest = max(ids, key=lambda s: len(layers[s]))
    blocks = [min(len(layers[s]), depth + deeper * (s == longest)) for s in ids]
    built = {s: list(layers[s][:b]) if like is None else [like] * b for s, b in zip(ids, blocks)}
    stages = {s: _stage(context.model, built[s], s == 0, s == n_stages - 1) for s in ids}
    for part in stages.values():
        parallelize(part, context.model.spec, config, plan, mesh)
        if plan.layout.cp > 1:
            apply_context_parallel(part, plan, 0, mesh["cp"], CPU)
        for experts in expert_modules(part) if plan.layout.ep > 1 else ():
            experts.expert_parallel.planned_load = config.plan.moe_load_imbalance  # this rank: the most loaded
    device = context.device
    counter = StepCounter(device.peak_flops, device.hbm_gbs * 1e9, mesh_groups(mesh, plan.layout))
    with FakeTensorMode(allow_non_fake_inputs=True), unobserved_shape_propagation():
        step = _RankStep(config, context, stages, counter)
        step.trace = RankTrace(ids, n_stages, blocks, **step.sizes(), groups=counter.groups)
        step.micro_batches(micro_batches)
        if micro_batches and optimizer:
            step.optimizer_step()
        step.trace.largest = counter.largest
        return step.trace


def _stage(model: ResolvedModel, layer_ids: list[int], first: bool, last: bool) -> nn.Module:
    """A pipeline stage of blocks built as the layers `layer_ids` are, on the meta device, as a model of that many
    layers (each of its layer's kind: ModelSpec.layers_args): building only these is much quicker than cutting
    them from the whole model. Traceable: documents get one attention call with a mask, as the GPU's flex attention
    takes them (the CPU's call per document needs the data, which fake tensors do not have)."""
    with torch.device("meta"):
        whole = model.spec.build(model.spec.layers_args(model.args, layer_ids), traceable=True)
    return model.spec.pipeline_stage(whole, list(range(len(layer_ids))), first, last)


def mesh_groups(mesh, layout: Layout) -> dict[str, tuple[int, ...]]:
    """The ranks of each mesh dimension's process group around this rank, by the dimension's name; HSDP's 2-D
    FSDP mesh gives its dp_replicate and dp_shard groups. Without data parallelism there is no FSDP, though the mesh
    has its dimension (the cp ranks alone, under context parallelism)."""
    groups = {}
    for name, sub in mesh.items():
        if name == "fsdp" and layout.dp == 1:
            continue
        for dim in range(sub.ndim):
            key = name if sub.ndim == 1 else sub.mesh_dim_names[dim]
            groups[key] = tuple(sorted(dist.get_process_group_ranks(sub.get_group(dim))))
    return groups


class _RankStep:
    """The rank's stages as fake tensors, with AdamW in the state of a steady step (its moments exist), and the
    parts of a training step, run as the trainer runs them."""

    def __init__(self, config: Config, context: TraceContext, stages: dict, counter: StepCounter):
        plan, mesh = context.plan, context.mesh
        self.config, self.spec, self.plan, self.layout = config, context.model.spec, plan, plan.layout
        self.mesh, self.stages, self.counter = mesh, stages, counter
        for part in stages.values():
            part.to_empty(device=CPU)  # values do not matter: no init_weights
        self.params = [p for part in stages.values() for p in part.parameters()]
        self.optimizer = build_optimizer(list(stages.values()), config.optimizer)
        ensure_optimizer_state(self.optimizer, self.params)
        self.lr_scheduler = build_lr_scheduler(self.optimizer, config.lr_scheduler, config.training.steps)
        self.rules = StepRules.of(plan, config, mesh)
        if self.rules.qk_clip is not None:  # its logits' recomputation counted with the forwards
            self.rules.qk_clip.install(list(stages.values()))
        self.shards = {StorageWeakRef(_local(p).untyped_storage()) for p in self.params}
        self.inputs = _inputs(config, context)
        self.trace: RankTrace

    def sizes(self) -> dict[str, int]:
        states = [v for state in self.optimizer.state.values() for v in state.values() if v.ndim]
        return {
            "params": sum(_local(p).numel() for p in self.params),
            "total_params": sum(p.numel() for p in self.params),
            "expert_params": sum(
                _local(p).numel() for part in self.stages.values() for e in expert_modules(part) for p in e.parameters()
            ),
            "param_bytes": sum(nbytes(_local(p)) for p in self.params),
            "optimizer_bytes": sum(nbytes(_local(v)) for v in states),
        }

    def micro_batches(self, count: int) -> None:
        """`count` micro-batches forward and backward (0: one forward), then FSDP's gradient reduction under a
        pipeline. The last micro-batch is the one measured: after the first, it finds the gradients and FSDP's
        gathered weights of the earlier ones (the steady state of gradient accumulation and pipelines)."""
        trace = self.trace
        self.tracker = StepPeak()
        self.tracker.track_external(*self.stages.values(), self.optimizer)
        self._starts: list[list[int]] = []
        self._record_held(max((self.spec.blocks(part) for part in self.stages.values()), key=len), trace.block_held)
        self._record_held([e for part in self.stages.values() for e in expert_modules(part)], trace.routed_held)
        first = Cost()
        with self.tracker, self.counter, self.rules.loss_context():
            for micro_batch in range(max(count, 1)):
                outputs = self._forward()
                if count:
                    self._backward(outputs)
                if micro_batch == 0:
                    trace.first_peak = total_bytes(self.tracker, "peak")
                    for cost in (*trace.forward.values(), *trace.backward.values()):
                        first.add(cost)
            trace.once.add(first)  # the first micro-batch's costs beyond a steady one's
            for cost in (*trace.forward.values(), *trace.backward.values()):
                trace.once.add(cost, -1)
            if count and self.layout.pp > 1 and self.layout.dp > 1:
                self._reduce_gradients()
        trace.peak = total_bytes(self.tracker, "peak")
        trace.boundary_bytes = nbytes(self.inputs["hidden"])
        trace.grad_bytes = sum(nbytes(_local(p.grad)) for p in self.params if p.grad is not None)

    def _forward(self) -> dict[int, torch.Tensor]:
        """The stages' forwards in pipeline order, the last one's loss included: what each backward starts from."""
        inputs = self.inputs
        self.trace.block_held.clear()
        self.trace.routed_held.clear()
        outputs, last = {}, self.trace.n_stages - 1
        for stage, part in self.stages.items():
            before = self._activations()
            self.trace.forward[stage] = Cost()
            with self.counter.phase(self.trace.forward[stage]), self.rules.precision("cpu"):
                x = inputs["tokens"] if stage == 0 else inputs["hidden"].clone()
                x.requires_grad_(x.is_floating_point())
                labels = inputs["tokens"] if stage == last else None  # as the trainer's (a multi-token prediction's)
                out = part(x, inputs["rows"], inputs["document_ids"], labels=labels)
                outputs[stage] = token_loss(out, inputs["tokens"]) if stage == last else out[0]
            self.trace.held[stage] = self._activations() - before
        return outputs

    def _backward(self, outputs: dict[int, torch.Tensor]) -> None:
        """The stages' backwards in reverse order; under a pipeline, FSDP set as its schedule sets it for every
        backward but the last (no reduction, no resharding: gradients accumulate unsharded)."""
        for starts in self._starts:  # checkpointing's recomputation runs the modules again: not to be recorded
            starts.clear()
        for stage in reversed(list(outputs)):
            part = self.stages[stage]
            if self.layout.pp > 1 and self.layout.dp > 1:
                part.set_is_last_backward(False)
                part.set_reshard_after_backward(False)
                part.set_requires_gradient_sync(False)
            self.trace.backward[stage] = Cost()
            with self.counter.phase(self.trace.backward[stage]):
                out = outputs.pop(stage)
                out.backward(None if out.ndim == 0 else torch.ones_like(out))  # a later stage's gradient

    def _reduce_gradients(self) -> None:
        """The pipeline schedule's REDUCE_GRAD action: FSDP reduces the accumulated gradients, once a step."""
        group = self.mesh["pp"].get_group()
        with self.counter.phase(self.trace.once):
            for stage, part in self.stages.items():
                PipelineStage(part, stage, self.trace.n_stages, CPU, group=group).perform_reduce_grad(1)

    def optimizer_step(self) -> None:
        """The trainer's step after the backwards (StepRules.update): gradients summed where FSDP did not, clipping
        by the global gradient norm, AdamW, float8's scales, the lr."""
        trace = self.trace
        tracker = StepPeak()  # FSDP's unsharded gradients are gone: the parameters hold all there is
        tracker.track_external(*self.stages.values(), self.optimizer)
        with tracker, self.counter:
            self.rules.update(list(self.stages.values()), self.optimizer, self.lr_scheduler, _Into(self.counter, trace))
        trace.optimizer_peak = total_bytes(tracker, "peak")

    def _activations(self) -> int:
        """Memory held less the weights FSDP holds gathered (once per stage, however many micro-batches are in
        flight): the storages of the parameters the modules hold now, beyond their shards."""
        now = [p for part in self.stages.values() for p in part.parameters()]
        storages = {StorageWeakRef(s): s for p in now if (s := _local(p).untyped_storage())}
        gathered = sum(s.nbytes() for ref, s in storages.items() if ref not in self.shards)
        return total_bytes(self.tracker) - gathered

    def _record_held(self, modules: list[nn.Module], held: list[int]) -> None:
        """What each of `modules` holds for backward, from its forward's start to its end, appended to `held`."""
        starts: list[int] = []
        self._starts.append(starts)
        for module in modules:
            module.register_forward_pre_hook(lambda *_: starts.append(self._module_activations()))
            module.register_forward_hook(lambda *_: starts and held.append(self._module_activations() - starts.pop()))

    def _module_activations(self) -> int:
        """Activations, less FSDP's last all-gather buffer, which it frees at the next unit's all-gather: in a block
        holding a unit of its own (a mixture of experts' routed experts), that frees the block's buffer within the
        block's forward, and the experts' stays after it."""
        contexts = {id(c): c for p in self.stages.values() if isinstance(p, FSDPModule) for c in [_comm_context(p)]}
        states = [state for c in contexts.values() if (state := getattr(c, "all_gather_state", None)) is not None]
        return self._activations() - sum(nbytes(state.all_gather_result.all_gather_output) for state in states)


class _Into:
    """StepRules.update's phases, counted into the trace's optimizer cost whatever their name."""

    def __init__(self, counter: StepCounter, trace: RankTrace):
        self.counter, self.trace = counter, trace

    def phase(self, _name: str):
        return self.counter.phase(self.trace.optimizer)


def _inputs(config: Config, context: TraceContext) -> dict[str, torch.Tensor | None]:
    """A micro-batch as the trainer hands it to the first stage (tokens, row ids, document ids: one document per
    row), and the hidden states the other stages receive. Under context parallelism the tokens are this rank's
    share of each row, the document ids the whole rows'."""
    t, plan, rows = config.training, context.plan, context.rows
    spec, args = context.model.spec, context.model.args
    tokens = torch.randint(0, args.vocab_size, (rows, t.seq_len // plan.layout.cp))
    later_stage = stage_batch(plan, config.data.document_mask, rows, t.seq_len, stage=1)
    hidden = spec.pipeline_io(args, later_stage).inputs[0]
    return {
        "tokens": tokens,
        "rows": torch.arange(rows),
        "document_ids": torch.zeros_like(tokens) if config.data.document_mask else None,
        "hidden": torch.empty(hidden.shape, dtype=hidden.dtype),
    }


def _comm_context(part: FSDPModule):
    """The FSDP root's communication state, which every unit under it shares."""
    return part._get_fsdp_state()._comm_ctx


def _local(t):
    return t._local_tensor if isinstance(t, DTensor) else t  # not to_local(), an autograd op: slow here


def with_checkpointing(config: Config, mode: str, every: int = 1) -> Config:
    """The recipe with another activation checkpointing mode (every block, or every Nth)."""
    checkpointing = dataclasses.replace(config.activation_checkpoint, mode=mode, every=every)
    return dataclasses.replace(config, activation_checkpoint=checkpointing)
