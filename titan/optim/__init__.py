"""The optimizer (AdamW, or Muon: titan/optim/muon.py) over its parameter groups, and the learning-rate schedule: linear
warmup, then cosine, linear, constant or warmup-stable-decay."""

from __future__ import annotations

import dataclasses
import fnmatch
import json
import math
import re
from collections import deque

import torch
from torch import nn

from titan.config import LRScheduler, Optimizer
from titan.errors import ConfigError


@dataclasses.dataclass(frozen=True)
class Role:
    """What the optimizer does to one parameter."""

    muon: bool  # Muon orthogonalises its update (else AdamW steps it)
    decay: bool  # weight decay applies


def parameter_roles(model: nn.Module, cfg: Optimizer) -> dict[str, Role]:
    """Each parameter's role, by name: what its name and shape say, so that every layout, pipeline stage and traced
    block agrees. ConfigError for Muon on a parameter of more than 2 dims that is not a stack of experts."""
    experts = {
        f"{prefix}.{name}"
        for prefix, module in model.named_modules()
        if hasattr(module, "expert_parallel")  # titan/parallel/ep.py's mark of a stack of experts
        for name, _ in module.named_parameters(recurse=False)
    }
    roles = {}
    for name, p in model.named_parameters():
        muon = cfg.name == "muon" and p.ndim >= 2 and not _matches(name, cfg.adamw_for)
        if muon and p.ndim > 2 and name not in experts:
            raise ConfigError(
                f"optimizer.name = 'muon': {name} has shape {list(p.shape)}, not a matrix nor a stack of experts; "
                f"add it to optimizer.adamw_for, e.g. --optimizer.adamw_for '{json.dumps([*cfg.adamw_for, name])}'"
            )
        roles[name] = Role(muon=muon, decay=not _matches(name, cfg.no_decay))
    return roles


def model_roles(spec, args, cfg: Optimizer) -> dict[str, Role]:
    """parameter_roles of the whole model `spec` builds from `args` (on the meta device). ConfigError for a pattern
    the recipe added that names no parameter."""
    with torch.device("meta"):
        model = spec.build(args)
    names = [name for name, _ in model.named_parameters()]
    defaults = Optimizer()
    _check_patterns("no_decay", cfg.no_decay, defaults.no_decay, names)
    if cfg.name == "muon":
        _check_patterns("adamw_for", cfg.adamw_for, defaults.adamw_for, names)
    return parameter_roles(model, cfg)


def _matches(name: str, patterns: list[str]) -> bool:
    return any(fnmatch.fnmatchcase(name, pattern) for pattern in patterns)


def _check_patterns(key: str, patterns: list[str], defaults: list[str], names: list[str]) -> None:
    unmatched = [p for p in patterns if p not in defaults and not any(fnmatch.fnmatchcase(n, p) for n in names)]
    if unmatched:
        kinds = list(dict.fromkeys(re.sub(r"\.\d+\.", ".*.", n) for n in names))
        raise ConfigError(
            f"optimizer.{key}: {unmatched[0]!r} matches no parameter of the model; name one of its parameters by an "
            f"fnmatch pattern, e.g. one of {', '.join(kinds[:6])}, ... or remove it"
        )


def describe_roles(roles: dict[str, Role], shapes: dict[str, list[int]]) -> str:
    """The parameter groups, one line each: how many parameters and elements, and which (layers' indices as *)."""
    sizes = {name: math.prod(shape) for name, shape in shapes.items()}
    lines = []
    for role in sorted(set(roles.values()), key=lambda r: (not r.muon, not r.decay)):
        names = [name for name, r in roles.items() if r == role]
        kinds = ", ".join(dict.fromkeys(re.sub(r"\.\d+\.", ".*.", name) for name in names))
        what = ("Muon" if role.muon else "AdamW") + (", decayed" if role.decay else ", not decayed")
        lines.append(f"{what}: {len(names)} parameters, {sum(sizes[n] for n in names):,} elements: {kinds}")
    return "\n".join(lines)


def build_optimizer(parts: list[nn.Module], cfg: Optimizer) -> torch.optim.Optimizer:
    """The optimizer of the parameters of this rank's model parts, grouped by their roles."""
    from torch.distributed.tensor import DTensor

    from titan.optim.muon import Muon

    # The fused kernel takes DTensors or plain tensors, not both: tensor parallelism without FSDP leaves some
    # parameters plain (a mixture of experts' router and routed experts, whole on every tp rank) beside its DTensors.
    grouped: dict[tuple[bool, bool, bool], list[torch.Tensor]] = {}
    seen = set()  # a parameter two parts share (a tied head in one stage) is stepped once
    for part in parts:
        named = dict(part.named_parameters())
        for name, role in parameter_roles(part, cfg).items():
            p = named[name]
            if p.requires_grad and id(p) not in seen:
                seen.add(id(p))
                grouped.setdefault((role.muon, role.decay, isinstance(p, DTensor)), []).append(p)
    groups = [
        {"params": params, "weight_decay": cfg.weight_decay if decay else 0.0}
        | ({"muon": muon} if cfg.name == "muon" else {})
        for (muon, decay, _), params in grouped.items()
    ]
    betas = (cfg.beta1, cfg.beta2)
    if cfg.name == "muon":
        return Muon(groups, lr=cfg.lr, betas=betas, eps=cfg.eps, momentum=cfg.momentum)
    # fused: one kernel per parameter group on CPU and GPU (about 7x the CPU's default per-tensor loop), and the
    # only implementation that reads found_inf, which skips a non-finite step on the device without a host sync.
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=betas, eps=cfg.eps, fused=True)


def skip_if_nonfinite(optimizer: torch.optim.Optimizer, grad_norm: torch.Tensor) -> None:
    """Make the next optimizer.step() leave weights, moments and step counts as they are if grad_norm is NaN or
    inf, decided on the device (GradScaler's mechanism: the fused kernel returns early when found_inf is 1)."""
    optimizer.found_inf = (~torch.isfinite(grad_norm)).float()


class FiniteFlags:
    """Whether each step's gradient norm was finite, copied to the host without blocking the step, and read
    `lag` steps later: 0 on a CPU (its flag is ready when the step returns), 1 on a GPU (by the time the next
    step has been queued the one before it has run, so reading its flag rarely waits). The norm is global, so
    every rank reads the same flags at the same steps and acts on them together."""

    def __init__(self, device: torch.device):
        self.lag = 1 if device.type == "cuda" else 0
        self.unread: deque[tuple[torch.Tensor, torch.cuda.Event | None]] = deque()

    def add(self, grad_norm: torch.Tensor) -> None:
        finite = torch.isfinite(grad_norm)
        if grad_norm.device.type != "cuda":
            self.unread.append((finite, None))
            return
        host = torch.empty((), dtype=torch.bool, pin_memory=True)
        host.copy_(finite, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        self.unread.append((host, event))

    def nonfinite_due(self) -> bool:
        """Whether a step at least `lag` steps old had a non-finite norm (its flag is read once)."""
        found = False
        while len(self.unread) > self.lag:
            finite, event = self.unread.popleft()
            if event is not None:
                event.synchronize()
            found |= not bool(finite)
        return found

    def clear(self) -> None:
        """Forget the unread flags: the loop brought their steps to the host and checked them itself."""
        self.unread.clear()


def ensure_optimizer_state(optimizer: torch.optim.Optimizer, params: list[torch.Tensor]) -> None:
    """Give each parameter the state its optimizer creates at its first step (zeros), where it has none yet, so
    that a checkpoint or a pipeline re-split can fill it in place."""
    from titan.optim.muon import Muon

    if isinstance(optimizer, Muon):
        optimizer.ensure_state(params)
        return
    for p in params:
        if p not in optimizer.state:
            optimizer.state[p] = {
                "step": torch.zeros((), device=p.device),  # the fused kernel reads it on the device
                "exp_avg": torch.zeros_like(p),
                "exp_avg_sq": torch.zeros_like(p),
            }


def lr_factor(step: int, total_steps: int, cfg: LRScheduler, decay_start: int | None = None) -> float:
    """Multiplier of the peak lr for optimizer step `step` (0-based). A warmup longer than the run (a short smoke run
    of a long recipe) lasts the whole run. wsd decays from `decay_start` (a data stage's first step) where given,
    else over the last wsd_decay_ratio of the steps; never before the warmup ends."""
    warmup = min(cfg.warmup_steps, total_steps)
    if step < warmup:
        return (step + 1) / (warmup + 1)
    floor = cfg.min_lr_ratio
    if cfg.decay == "constant":
        return 1.0
    if cfg.decay == "wsd":
        if decay_start is None:
            decay_start = total_steps - max(1, round(cfg.wsd_decay_ratio * total_steps))
        decay_start = max(warmup, decay_start)
        if step < decay_start:
            return 1.0
        progress = (step - decay_start + 1) / max(1, total_steps - decay_start)
        return 1.0 - (1.0 - floor) * min(progress, 1.0)
    progress = min(1.0, (step - warmup + 1) / max(1, total_steps - warmup))
    if cfg.decay == "linear":
        return 1.0 - (1.0 - floor) * progress
    return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))


def build_lr_scheduler(
    optimizer: torch.optim.Optimizer, cfg: LRScheduler, total_steps: int, decay_start: int | None = None
):
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_factor(step, total_steps, cfg, decay_start))


@torch.no_grad()
def clip_grad_norm_(params: list[torch.Tensor], max_norm: float, pp_group=None) -> torch.Tensor:
    """Clip by the norm of all gradients of the whole model, however they are sharded; returns the norm (fp64).

    The norm must not depend on the layout, or two layouts that agree on the loss would log different norms and,
    where clipping is active, take different steps. fp32 accumulation over a large tensor is off by about 1e-5
    relative, by an amount that depends on how the tensor is split; so each shard's sum of squares is taken in
    fp64, and the shards' sums are added in fp64, where the order of the additions no longer shows.

    torch's clip_grad_norm_ cannot mix DTensor gradients on different meshes (FSDP-only norm weights next to
    FSDP x TP matrices) or plain tensors with DTensors, nor see other pipeline stages. So: one sum of squares per
    group of equally placed gradients, summed over the mesh dims they are sharded on, combined, summed over
    pipeline stages.
    """
    from torch.distributed.tensor import DTensor, Replicate

    groups: dict[object, list[torch.Tensor]] = {}
    for p in params:
        if p.grad is not None:
            g = p.grad
            groups.setdefault((g.device_mesh, g.placements) if isinstance(g, DTensor) else g.device, []).append(g)
    squares = [_sum_of_squares(grads) for grads in groups.values()]
    total = torch.stack(squares).sum() if squares else torch.zeros((), dtype=torch.float64)
    if pp_group is not None:
        torch.distributed.all_reduce(total, group=pp_group)
    total = total.sqrt()
    if max_norm == float("inf"):
        return total
    coef = (max_norm / (total + 1e-6)).clamp(max=1.0)
    for grads in groups.values():
        scale = coef.to(grads[0].dtype)
        if isinstance(grads[0], DTensor):
            mesh = grads[0].device_mesh
            torch._foreach_mul_(grads, DTensor.from_local(scale, mesh, [Replicate()] * mesh.ndim))
        else:
            torch._foreach_mul_(grads, scale)
    return total


def _sum_of_squares(grads: list[torch.Tensor]) -> torch.Tensor:
    """The fp64 sum of squares of equally placed gradients, whole: a DTensor's local sums are added over the mesh
    dims it is sharded on (a replicated dim holds copies, which are not added)."""
    from torch.distributed.tensor import DTensor, Partial, Replicate

    if not isinstance(grads[0], DTensor):
        return torch.stack(torch._foreach_norm(grads, 2, dtype=torch.float64)).square().sum()
    placements = grads[0].placements
    if any(p.is_partial() for p in placements):  # not seen after FSDP or TP, but a pending sum must be done first
        whole = [Replicate() if p.is_partial() else p for p in placements]
        grads = [g.redistribute(placements=whole) for g in grads]
        placements = grads[0].placements
    local = [g.to_local() for g in grads]
    norms = torch._foreach_norm(local, 2, dtype=torch.float64)
    local_sum = torch.stack(norms).square().sum()
    # Every placement but Replicate splits the tensor here (Shard, and FSDP x TP's _StridedShard, which torch does
    # not count as is_shard()).
    summed = [Replicate() if p.is_replicate() else Partial() for p in placements]
    return DTensor.from_local(local_sum, grads[0].device_mesh, summed).full_tensor()
