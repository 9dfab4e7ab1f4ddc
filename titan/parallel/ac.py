"""Activation checkpointing of transformer blocks, applied in place so parameter names do not change. Each block
runs one of four ways:

- keep: it keeps every tensor its backward needs;
- selective: it keeps the outputs of the recipe's save_ops and recomputes the rest in backward;
- full: it keeps only its inputs and recomputes the whole block in backward;
- offload: it keeps everything, in pinned host memory, and copies it back for backward.

Modes full and selective run every Nth block that way. Mode auto measures each way on one block of each kind the
model has (`measure_options`; a mixture of experts' dense and routed blocks, ModelSpec.block_kinds) and lets
titan/parallel/ac_choices.py choose per block, within activation_checkpoint.budget_gib.
"""

from __future__ import annotations

import copy
import logging
import statistics
from collections.abc import Sequence
from contextlib import nullcontext
from functools import partial
from time import perf_counter

import torch
from torch import nn
from torch.distributed._composable import checkpoint
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.checkpoint import SAC_IGNORED_OPS, CheckpointPolicy, create_selective_checkpoint_contexts
from torch.utils.checkpoint import checkpoint as torch_checkpoint

from titan.config import Config, Layout
from titan.errors import ConfigError
from titan.models import ModelSpec
from titan.parallel.ac_choices import GIB, Option, fastest_choices
from titan.parallel.mesh import on_rank_0
from titan.run_plan import RunPlan, precision

log = logging.getLogger("titan")

KEEP, SELECTIVE, FULL, OFFLOAD = "keep", "selective", "full", "offload"

# Selective checkpointing replays the block's ops in the same order in backward. Profiler marks save nothing, and an
# FSDP unit nested in the block (expert parallelism's experts) marks its root pre-forward only in the recomputation,
# which the replay would refuse: torch passes the ops of this set through.
SAC_IGNORED_OPS.update(
    {torch.ops.profiler._record_function_enter_new.default, torch.ops.profiler._record_function_exit._RecordFunction}
)


def block_choices(
    model: nn.Module,
    spec: ModelSpec,
    config: Config,
    plan: RunPlan,
    device: torch.device | None,
    layers: Sequence[int] | None = None,
) -> list[str]:
    """How each block of `model` (the model's `layers`; None: all of them) runs: the recipe's mode on every Nth
    block, or with mode = "auto" the fastest choices within the budget, each block choosing from its kind's ways.
    Call it before the blocks are wrapped: "auto" measures a plain copy of the first block of each kind. Under
    tensor parallelism that copy is the whole block, which keeps more than a rank's shard of it: the choices err
    on the safe side."""
    cfg = config.activation_checkpoint
    n_blocks = len(spec.blocks(model))
    if cfg.mode != "auto":
        return [cfg.mode if cfg.mode != "none" and i % cfg.every == 0 else KEEP for i in range(n_blocks)]
    if device is None:
        raise ValueError("activation_checkpoint.mode = 'auto' measures the blocks: parallelize needs the device")
    if not cfg.budget_gib:  # the trainer's pre-flight resolves it; a program building model parts itself must too
        raise ValueError(
            "activation_checkpoint.budget_gib = 0 stands for what the device leaves: resolve it with "
            "titan.train.preflight.check_run before building the model"
        )
    # The largest micro-batch of any rank (a pipeline's, under pipeline parallelism), so that the same choices fit
    # every rank; the budget is per micro-batch, of which a pipeline rank holds several at once.
    rows, micro_batches = plan.largest_micro_batch
    kinds = spec.block_kinds(model.args)
    layers = list(range(len(kinds)) if layers is None else layers)
    # Blocks after the layers (a mixture of experts' multi-token prediction) run the ways of the last layer's kind.
    layers += layers[-1:] * (n_blocks - len(layers))
    # Rank 0's measurement on every rank: all agree on the choices (and a budget too small fails alike everywhere).
    options = on_rank_0(lambda: _measure_kinds(model, spec, config, plan.layout, rows, device, layers), device=device)
    for kind, ways in options.items():
        log.info(
            "activation_checkpoint auto, one %sblock at %d x %d tokens keeps: %s",
            f"{kind} " * (len(options) > 1),  # a mixture of experts' dense and routed blocks
            rows,
            config.training.seq_len // plan.layout.cp,
            ", ".join(f"{o.name} {o.saved_bytes / 2**20:.4g} MiB +{o.added_seconds:.3g} s" for o in ways),
        )
    chosen = fastest_choices([options[kinds[layer]] for layer in layers], int(cfg.budget_gib * GIB))
    names = [o.name for o in next(iter(options.values()))]
    log.info(
        "activation_checkpoint auto: %s; the blocks keep %.4g of %.4g GiB, +%.3g s per step (predicted)",
        ", ".join(f"{chosen.choices.count(name)} {name}" for name in names if name in chosen.choices),
        chosen.saved_bytes / GIB,
        cfg.budget_gib,
        chosen.added_seconds * micro_batches * plan.schedule_runs,
    )
    return list(chosen.choices)


def apply_activation_checkpointing(blocks: list[nn.Module], choices: list[str], save_ops: list[str]) -> None:
    for block, choice in zip(blocks, choices, strict=True):
        apply_choice(block, choice, save_ops)


def apply_choice(block: nn.Module, choice: str, save_ops: list[str]) -> None:
    if choice == FULL:
        checkpoint(block)
    elif choice == SELECTIVE:
        # torch.utils.checkpoint inside the block's forward rather than the composable checkpoint's hooks around it:
        # a compiled block then traces the policy into its graph, while the hooks' dispatch mode would see the
        # compiled kernels and keep buffers that they reuse (torch 2.13: "Tensor cached ... has been mutated").
        context = partial(create_selective_checkpoint_contexts, partial(_policy, frozenset(save_ops)))
        block.forward = partial(torch_checkpoint, block.forward, use_reentrant=False, context_fn=context)
    elif choice == OFFLOAD:
        _offload(block)


def _policy(save_ops: frozenset[str], ctx, op, *args, **kwargs) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if str(op.overloadpacket) in save_ops else CheckpointPolicy.PREFER_RECOMPUTE


def _offload(block: nn.Module) -> None:
    """The block's forward runs under save_on_cpu: what autograd saves goes to pinned host memory, and back for
    backward."""
    active = []

    def enter(module, args):
        active.append(torch.autograd.graph.save_on_cpu(pin_memory=True))
        active[-1].__enter__()

    def leave(module, args, output):
        active.pop().__exit__(None, None, None)

    block.register_forward_pre_hook(enter)
    block.register_forward_hook(leave, always_call=True)


# ---------------------------------------------------------------------------------------------
# Measuring the options


# Timing takes at least ROUNDS rounds and goes on until MEASURE_SECONDS have passed: a small block gets many rounds,
# as what a way adds to it is small against a busy machine's noise.
ROUNDS, MEASURE_SECONDS = 5, 2.0


def measured_layers(spec: ModelSpec, args, layers: Sequence[int]) -> dict[str, int]:
    """The block auto measures for each kind of block the model has (ModelSpec.block_kinds): the first of its kind
    among `layers`, those of the model part that rank 0 measures on (the first pipeline stage's), which must hold
    one of every kind: the choices of every rank come from them."""
    kinds, first = spec.block_kinds(args), {}
    for layer in layers:
        first.setdefault(kinds[layer], layer)
    for kind in dict.fromkeys(kinds):
        if kind not in first:
            raise ConfigError(
                f"activation_checkpoint.mode = 'auto' measures a block of each kind on rank 0, whose layers "
                f"{list(layers)} hold no {kind} block: give the first pipeline stage one "
                "(parallel.pp_layers_per_stage) or set activation_checkpoint.mode to none, full or selective"
            )
    return first


def _measure_kinds(model, spec, config, layout, rows, device, layers: Sequence[int]) -> dict[str, list[Option]]:
    """measure_options of each kind of block, on its measured_layers block."""
    first = measured_layers(spec, model.args, layers)
    return {kind: measure_options(model, spec, config, layout, rows, device, layer) for kind, layer in first.items()}


def measure_options(
    model: nn.Module, spec: ModelSpec, config: Config, layout: Layout, rows: int, device: torch.device, layer: int = 0
) -> list[Option]:
    """Each way to run a block, measured on a copy of the model's block `layer` at a micro-batch of `rows` x seq_len
    tokens: the bytes it keeps for backward (exact), and the seconds it adds to the block's forward and backward
    over keeping everything. That is all the way costs: the recomputation, checkpointing's own bookkeeping, and
    for offload the copies both ways. On a CPU host memory is device memory, so offload would save nothing: it is
    not offered there."""
    names = [KEEP, SELECTIVE, FULL] + ([OFFLOAD] if device.type != "cpu" else [])
    variants, forward, x = _ways_of_block(model, spec, config, layout, rows, device, names, layer)

    def forward_backward(variant: nn.Module) -> None:
        forward(variant).backward(grad)

    saved = {name: _kept_bytes(forward, variant, device) for name, variant in variants.items()}
    grad = torch.ones_like(x)
    added = _added_seconds(variants, forward_backward, device)
    return [Option(name, saved[name], added[name]) for name in names]


def kept_bytes(
    model: nn.Module, spec: ModelSpec, config: Config, layout: Layout, rows: int, device: torch.device, names
) -> dict[str, int]:
    """The bytes the model's first block keeps for backward run each of the ways `names`, at a micro-batch of
    `rows` x seq_len tokens (what measure_options measures, without the timing)."""
    variants, forward, _ = _ways_of_block(model, spec, config, layout, rows, device, names)
    return {name: _kept_bytes(forward, variant, device) for name, variant in variants.items()}


def _ways_of_block(model, spec, config, layout, rows, device, names, layer: int = 0):
    """({way: a copy of block `layer` run that way}, its forward on the block's training inputs, those inputs)."""
    block, x, args, kwargs, precision = _block(model, spec, config, layout, rows, device, layer)
    # Copies of the block that share its parameters (deepcopy's memo maps each to itself), one per way.
    params = {id(p): p for p in block.parameters()}
    variants = {name: copy.deepcopy(block, memo=dict(params)) for name in names}
    for name, variant in variants.items():
        apply_choice(variant, name, config.activation_checkpoint.save_ops)

    def forward(variant: nn.Module) -> torch.Tensor:
        # The clone stands for the previous block's output: it stays in memory only if this block keeps it.
        with precision:
            return variant(x.clone(), *args, **kwargs)

    return variants, forward, x


def _block(
    model: nn.Module, spec: ModelSpec, config: Config, layout: Layout, rows: int, device: torch.device, layer: int
):
    """A plain copy of the model's block `layer` on the device, initialised, and the inputs the model gives it for
    a micro-batch of `rows` x seq_len tokens: (block, hidden states, the other positional and keyword arguments,
    the precision context to run it in). The model's own forward makes the inputs, so the attention mask,
    positions and dtype are those of training. Each row is one document, the most attention can cost: with shorter
    documents a block recomputes faster than measured.

    Under context parallelism a rank's share of each row, seq_len / cp tokens, with plain attention over them: its
    block keeps what a ring's keeps (queries, keys, values, output and log-sum-exp of its tokens), while its
    recomputation leaves out the ring's other pairs and sends (measured faster than the ring's)."""
    stage = spec.pipeline_stage(model, [layer], True, False)  # the embedding and that block
    stage.to_empty(device=device)
    stage.init_weights(config.job.seed)
    rule = precision(config, layout)
    if rule.fsdp_params:  # bf16 weights, so bf16 hidden states
        for p in stage.parameters():
            p.data = p.data.to(torch.bfloat16)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16) if rule.autocast else nullcontext()
    seq = config.training.seq_len // layout.cp
    tokens = torch.zeros(rows, seq, dtype=torch.long, device=device)
    document_ids = tokens if config.data.document_mask else None
    block = spec.blocks(stage)[0]
    inputs = []
    hook = block.register_forward_pre_hook(lambda module, args, kwargs: inputs.append((args, kwargs)), with_kwargs=True)
    with torch.no_grad(), autocast:
        stage(tokens, torch.arange(rows, device=device), document_ids)
    hook.remove()
    (x, *args), kwargs = inputs[0]
    return block, x.detach().requires_grad_(), args, kwargs, autocast


def _added_seconds(variants: dict[str, nn.Module], run, device: torch.device) -> dict[str, float]:
    """Seconds each variant's `run` takes over keep's. The variants take turns, round after round, and a variant's
    figure is the median over the rounds of its time minus keep's in the same round, so a slow spell of a busy
    machine hits both sides of a difference alike."""
    for variant in variants.values():  # warm-up: the allocator's first requests, lazy initialisation
        run(variant)
    added = {name: [] for name in variants}
    start = perf_counter()
    while len(added[KEEP]) < ROUNDS or perf_counter() - start < MEASURE_SECONDS:
        seconds = {name: _seconds(run, variant, device) for name, variant in variants.items()}
        for name in variants:
            added[name].append(seconds[name] - seconds[KEEP])
    # Noise can make a way look faster than keeping everything; it adds no time then.
    return {name: max(0.0, statistics.median(differences)) for name, differences in added.items()}


def _kept_bytes(forward, block: nn.Module, device: torch.device) -> int:
    """Device bytes that a forward of the block leaves allocated, its output aside: what it keeps for backward."""
    with Allocations(device) as allocations:
        out = forward(block)
    return allocations.live_bytes(besides=out)


class Allocations(TorchDispatchMode):
    """The device memory that ops allocate while active, held by weak reference, so that what is still live
    afterwards shows what autograd and checkpointing keep. torch.autograd.graph.saved_tensors_hooks cannot count
    this: checkpointing installs its own hooks, which hide its block's saved tensors from any outer hook, and
    selective checkpointing stores the outputs it keeps outside the hooks altogether."""

    def __init__(self, device: torch.device):
        super().__init__()
        self.device, self.sizes = device, {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        # A view or an in-place result shares an input's storage: only new storages are allocations.
        inputs = {t.untyped_storage()._cdata for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.device == self.device:
                storage = t.untyped_storage()
                if storage._cdata not in inputs:
                    self.sizes.setdefault(StorageWeakRef(storage), storage.nbytes())
        return out

    def live_bytes(self, besides) -> int:
        """Bytes of the allocations still live, except the storages of the tensors in `besides`."""
        skip = {StorageWeakRef(t.untyped_storage()) for t in tree_leaves(besides) if isinstance(t, torch.Tensor)}
        return sum(n for ref, n in self.sizes.items() if ref not in skip and not ref.expired())


def _seconds(work, block: nn.Module, device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = perf_counter()
    work(block)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return perf_counter() - start
