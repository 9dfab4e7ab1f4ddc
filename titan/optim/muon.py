"""Muon: each weight matrix steps along its Nesterov momentum made orthogonal by a Newton-Schulz iteration, scaled to
AdamW's update size so that AdamW's lr and weight decay carry over; the parameters Muon should not touch (embeddings,
the output head, norms, biases, a router) step by AdamW in the same optimizer (docs/optimizers.md).

A matrix sharded over ranks (FSDP, TP, EP with FSDP) is orthogonalised whole, as on one process: its owner, one rank
of its mesh, gathers it, orthogonalises it and sends each rank its shard back; the owners take the matrices in turn,
so the work is spread over the ranks rather than repeated on each."""

from __future__ import annotations

import math

import torch
from torch.distributed.tensor import DTensor
from torch.optim.adamw import adamw

from titan.optim.muon_shards import orthogonalised_shards

# The quintic iteration's coefficients: they push every singular value into about [0.7, 1.2] in five steps, which
# trains as well as exactly 1 (Keller Jordan's tuning).
COEFFICIENTS = (3.4445, -4.7750, 2.0315)
STEPS = 5


def newton_schulz(g: torch.Tensor, steps: int = STEPS, dtype: torch.dtype | None = None) -> torch.Tensor:
    """An approximately orthogonal matrix close to U V^T of g = U S V^T, for each matrix of g (..., m, n): in
    `dtype`, by default bf16 on a GPU (its tensor cores' rate) and fp32 elsewhere; the result in g's dtype."""
    a, b, c = COEFFICIENTS
    x = g.to(dtype or (torch.bfloat16 if g.device.type == "cuda" else torch.float32))
    wide = x.size(-2) <= x.size(-1)
    if not wide:  # iterate on the smaller Gram matrix
        x = x.mT
    x = x / (torch.linalg.matrix_norm(x, keepdim=True) + 1e-7)  # singular values at most 1: the iteration converges
    for _ in range(steps):
        gram = x @ x.mT
        x = a * x + (b * gram + c * gram @ gram) @ x
    return (x if wide else x.mT).to(g.dtype)


def update_scale(shape: torch.Size) -> float:
    """The factor that gives an orthogonal (m, n) update the RMS of a typical AdamW update (Moonlight's 0.2)."""
    return 0.2 * math.sqrt(max(shape[-2], shape[-1]))


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


class Muon(torch.optim.Optimizer):
    """Muon for the groups marked "muon", AdamW (torch's fused kernel) for the others. Like fused AdamW it reads
    `found_inf`: where it is 1 the step leaves weights and state as they are, decided on the device."""

    def __init__(self, groups: list[dict], *, lr: float, betas: tuple[float, float], eps: float, momentum: float):
        super().__init__(groups, dict(lr=lr, betas=betas, eps=eps, momentum=momentum, weight_decay=0.0, muon=False))
        self.found_inf: torch.Tensor | None = None

    def ensure_state(self, params: list[torch.Tensor]) -> None:
        """The state each parameter has after its first step (zeros), where it has none yet: Muon's momentum, or
        AdamW's step and moments."""
        muon = {id(p) for group in self.param_groups if group["muon"] for p in group["params"]}
        for p in params:
            if p not in self.state:
                if id(p) in muon:
                    self.state[p] = {"momentum_buffer": torch.zeros_like(p)}
                else:  # as torch's AdamW makes it: the fused kernel reads the step on the device
                    self.state[p] = {
                        "step": torch.zeros((), device=_local(p).device),
                        "exp_avg": torch.zeros_like(p),
                        "exp_avg_sq": torch.zeros_like(p),
                    }

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if not params:
                continue
            self.ensure_state(params)
            if group["muon"]:
                self._muon_step(group, params)
            else:
                self._adamw_step(group, params)

    def _adamw_step(self, group: dict, params: list[torch.Tensor]) -> None:
        states = [self.state[p] for p in params]
        adamw(
            params,
            [p.grad for p in params],
            [s["exp_avg"] for s in states],
            [s["exp_avg_sq"] for s in states],
            [],
            [s["step"] for s in states],
            fused=True,
            found_inf=self.found_inf,
            amsgrad=False,
            beta1=group["betas"][0],
            beta2=group["betas"][1],
            lr=group["lr"],
            weight_decay=group["weight_decay"],
            eps=group["eps"],
            maximize=False,
        )

    def _muon_step(self, group: dict, params: list[torch.Tensor]) -> None:
        mu, lr, decay = group["momentum"], group["lr"], group["weight_decay"]
        momenta, nesterov = [], []
        for p in params:
            grad, momentum = _local(p.grad), _local(self.state[p]["momentum_buffer"])
            momenta.append(momentum * mu + grad)
            nesterov.append(grad + mu * momenta[-1])
        for p, momentum, orthogonal in zip(params, momenta, orthogonalised_shards(params, nesterov, newton_schulz)):
            weight = _local(p)
            updated = weight * (1 - lr * decay) - (lr * update_scale(p.shape)) * orthogonal
            self._keep_unless_nonfinite(_local(self.state[p]["momentum_buffer"]), momentum)
            self._keep_unless_nonfinite(weight, updated)

    def _keep_unless_nonfinite(self, tensor: torch.Tensor, new: torch.Tensor) -> None:
        """tensor = new, unless found_inf says the step's gradients were not finite (then new may hold NaN)."""
        if self.found_inf is None:
            tensor.copy_(new)
        else:
            tensor.copy_(torch.where(self.found_inf > 0, tensor, new))
