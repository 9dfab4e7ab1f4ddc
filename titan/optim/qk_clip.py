"""QK-clip (Kimi K2's MuonClip): after each optimizer step, every attention head whose largest pre-softmax logit of the
step exceeded optimizer.qk_clip_tau has its query and key weights scaled back so that the same inputs would give tau.

During the step's training forwards each attention module's `logit_max` slot (a HeadMax, installed here) takes the
largest logit q.k.scale of each of its heads over the positions it attends to (attention.head_max; the
context-parallel ring records its blocks itself). After the update the maxima are reduced (max) over every rank, so
each replica clips alike and a tensor-parallel rank learns the others' heads for the log; each module then says
which rows of which weights to scale by how much (its qk_clip_scales), applied to local shards through their
placements.

The clip is a function of the step's weights and batches: a checkpoint needs nothing more to resume it."""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.placement_types import _StridedShard

from titan.errors import ConfigError


class HeadMax:
    """One attention module's largest logit per head over the step's training forwards (its micro-batches; an
    activation-checkpointed forward records again, which a max does not mind). `index`: its row in the whole model's
    maxima; `offset`: its first head there (a tensor-parallel rank holds heads offset.. of the module's)."""

    def __init__(self, index: int, offset: int):
        self.index, self.offset = index, offset
        self.value: Tensor | None = None

    @torch.compiler.disable  # a compiled block calls it eagerly: it only keeps a tensor
    def add(self, per_head: Tensor) -> None:
        per_head = per_head.detach().float()
        self.value = per_head if self.value is None else torch.maximum(self.value, per_head)

    def take(self) -> Tensor | None:
        value, self.value = self.value, None
        return value


@dataclasses.dataclass(frozen=True)
class QKClip:
    """The clip of a run: tau, and the whole model's attention modules (by name, in model order: row i of the
    maxima and `qk_max/layer<i>` in the log) with their heads; the same on every rank and pipeline stage."""

    tau: float
    names: tuple[str, ...]
    heads: int

    @classmethod
    def of(cls, resolved, tau: float) -> QKClip:
        """The clip of the model `resolved` (a ResolvedModel) names, built here on the meta device. ConfigError for a
        model with no attention whose logits the clip can scale."""
        with torch.device("meta"):
            model = resolved.spec.build(resolved.args)
        modules = {name: m for name, m in model.named_modules() if hasattr(m, "qk_clip_scales")}
        for name, module in modules.items():
            if module.qk_clip_scales(torch.ones(module.n_heads)) is None:
                raise ConfigError(
                    f"optimizer.qk_clip_tau = {tau}: {name} normalises each head's queries and keys (qk_norm), which "
                    "undoes any scaling of its weights; set optimizer.qk_clip_tau = 0 for this model"
                )
        if not modules:
            raise ConfigError(f"optimizer.qk_clip_tau = {tau}: the model has no attention logits to clip; set it to 0")
        heads = {m.n_heads for m in modules.values()}
        assert len(heads) == 1, f"QK-clip takes one head count for all layers, got {sorted(heads)}"
        return cls(tau, tuple(modules), heads.pop())

    def install(self, parts: list[nn.Module]) -> None:
        """A HeadMax in the logit_max slot of each of this rank's attention modules."""
        for part in parts:
            for name, module in part.named_modules():
                if name in self.names:
                    module.logit_max = HeadMax(self.names.index(name), _first_head(module, self.heads))

    @torch.no_grad()
    def after_step(self, parts: list[nn.Module], applied: Tensor) -> dict[str, Tensor]:
        """Scale back each head whose step's largest logit exceeded tau (gamma = tau / max; the others by exactly
        1, bitwise as they were, without asking the host which), where the update was `applied` (a step skipped for
        a non-finite gradient norm leaves the weights as they were); returns `qk_max/layer<i>`, each layer's largest
        logit of the step."""
        modules = [m for part in parts for m in part.modules() if isinstance(getattr(m, "logit_max", None), HeadMax)]
        device = next(p for part in parts for p in part.parameters()).device  # where the collective runs
        maxima = torch.full((len(self.names), self.heads), float("-inf"), device=device)
        for module in modules:
            if (value := module.logit_max.take()) is not None:
                at = module.logit_max
                maxima[at.index, at.offset : at.offset + len(value)] = value
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(maxima, op=dist.ReduceOp.MAX)
        # A non-finite maximum (a non-finite forward, whose step is skipped) clips nothing: inf would zero the head.
        clipped = applied & maxima.isfinite() & (maxima > self.tau)
        gamma = torch.where(clipped, self.tau / maxima, torch.ones_like(maxima))
        for module in modules:
            weights = dict(module.named_parameters())
            for name, rows in module.qk_clip_scales(gamma[module.logit_max.index]).items():
                _scale_rows(weights[name], rows)
        return {f"qk_max/layer{i}": layer_max for i, layer_max in enumerate(maxima.amax(1))}


def _first_head(module: nn.Module, heads: int) -> int:
    """The module's first head on this rank: tensor parallelism splits the heads evenly over its mesh dim."""
    for p in module.parameters():
        if isinstance(p, DTensor) and "tp" in (p.device_mesh.mesh_dim_names or ()):
            tp = p.device_mesh["tp"]
            return tp.get_local_rank() * heads // tp.size()
    return 0


def _scale_rows(weight: Tensor, rows: Tensor) -> None:
    """weight[i] *= rows[i] for the whole weight's rows, on this rank's shard: the row scales are split as the
    weight's rows are (FSDP's and TP's dim-0 shards, _StridedShard included), so every layout scales each element
    by the factor one process does."""
    rows = rows.to(weight.dtype)[:, None]
    if not isinstance(weight, DTensor):
        weight.mul_(rows)
        return
    placements = [p if isinstance(p, (Shard, _StridedShard)) and p.dim == 0 else Replicate() for p in weight.placements]
    local = distribute_tensor(rows, weight.device_mesh, placements, src_data_rank=None).to_local()
    weight.to_local().mul_(local)
