"""Routed experts as one grouped matmul: the tokens arrive sorted by expert, and each expert's SwiGLU runs on its
contiguous slice, in one kernel for all experts rather than a Python loop over them."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch._subclasses.fake_tensor import is_fake
from torch.profiler import record_function


def _groupable(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether torch's grouped matmul takes these: it needs rows of 16-byte multiples, and takes bf16, or fp32 on
    the CPU (not under fake tensors, whose kernel is CUDA's)."""
    if not hasattr(torch, "_grouped_mm"):
        return False
    aligned = all(size * x.element_size() % 16 == 0 for size in w.shape[1:])
    cpu_float = x.device.type == "cpu" and not is_fake(x) and x.dtype == torch.float32
    return aligned and (x.dtype == torch.bfloat16 or cpu_float)


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose backward makes the gradient contiguous: the grouped matmul's backward refuses the expanded
    (stride 0) gradient that, e.g., a sum's backward hands it."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return grad.contiguous()


# Eager in a compiled block: torch 2.13 traces _grouped_mm only in bf16 (its fake kernel refuses fp32 even on the CPU,
# which runs it), and the loop's sizes are data.
@torch.compiler.disable
def grouped_mm(x: torch.Tensor, w: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """x (tokens, in), sorted by group, times each group's w (groups, out, in) transposed: (tokens, out). counts:
    each group's tokens (groups,). Each token's row is computed alone, so it does not depend on which other
    tokens share the call: the same bits on any expert-parallel layout."""
    if _groupable(x, w):
        offsets = counts.cumsum(0).to(torch.int32)
        return _ContiguousGrad.apply(torch._grouped_mm(x, w.transpose(-2, -1), offs=offsets))
    if is_fake(x):
        # titan plan's trace, where the split is not known: one matmul of the same shapes, FLOPs and memory.
        return x @ w[0].T
    pieces = x.split(counts.tolist())
    return torch.cat([piece @ weight.T for piece, weight in zip(pieces, w.unbind(0))])


def swiglu(x: torch.Tensor, counts: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, w3: torch.Tensor):
    """Each group's SwiGLU of x (tokens, dim) sorted by group, counts[g] of them for group g of the weights'."""
    with record_function("moe.experts"):
        hidden = F.silu(grouped_mm(x, w1, counts)) * grouped_mm(x, w3, counts)
        return grouped_mm(hidden, w2, counts)


class GroupedExperts(nn.Module):
    """n_experts SwiGLUs, their weights stacked (expert, out, in) as Hugging Face's per-expert linears hold them:
    expert parallelism shards dim 0."""

    def __init__(self, dim: int, hidden: int, n_experts: int):
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(n_experts, hidden, dim))
        self.w2 = nn.Parameter(torch.empty(n_experts, dim, hidden))
        self.w3 = nn.Parameter(torch.empty(n_experts, hidden, dim))
        # Expert parallelism's slot (titan/parallel/ep.py): set, it computes forward, on the ranks holding the
        # tokens' experts.
        self.expert_parallel = None

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """x: (tokens, dim) sorted by expert, counts[e] of them for expert e of this module's -> (tokens, dim)."""
        if self.expert_parallel is not None:
            return self.expert_parallel(swiglu, x, counts, self.w1, self.w2, self.w3)
        return swiglu(x, counts, self.w1, self.w2, self.w3)
