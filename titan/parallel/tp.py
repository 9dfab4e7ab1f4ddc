"""What tensor parallelism asks of the step beyond a model's plan. A module with a true `tp_gradient_shares`
attribute (the model contract's convention, set by the family's plan) computes on its tp rank's own tokens or heads
with its parameters whole on every tp rank, as a mixture of experts' router and routed experts do on the rank's share
of the sequence, and a q or k norm on the rank's heads: each rank's gradients are its share, which the step sums
over tp. The ranks then hold the same
gradients, which the gradient norm counts once (a tensor sharded over no tp dim is not summed over it)."""

from __future__ import annotations

import torch
from torch import nn


def gradient_shares(parts: list[nn.Module]) -> list[torch.Tensor]:
    """The parameters of `parts` whose gradients each tp rank holds its tokens' share of."""
    marked = (m for part in parts for m in part.modules() if getattr(m, "tp_gradient_shares", False))
    return [p for m in marked for p in m.parameters()]
