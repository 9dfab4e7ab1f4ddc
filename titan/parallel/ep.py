"""Expert parallelism: a mixture of experts' routed experts split across the ep group, each rank holding
n_experts / ep of them, and every token sent to the ranks of its experts and back by all-to-all.

The experts' weights become DTensors sharded on dim 0 (the expert) over the ep mesh, so checkpoints hold the whole
(n_experts, ...) tensors and load on any layout; FSDP then shards each rank's experts over the ranks that hold the
same ones (titan/parallel/fsdp.py). The model keeps its own order: the MoE sorts its (token, expert) pairs by expert,
the dispatch sends each rank its experts' slice of that order, returns the results to the same places, and the MoE
combines each token's results in expert order as on one process. The grouped matmul computes each token's row
alone, so a token's result has the same bits whichever rank computes it (but in an expert of a handful of tokens,
for which the CPU's kernel takes another path).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch._subclasses.fake_tensor import is_fake
from torch.distributed._functional_collectives import all_to_all_single, wait_tensor
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor
from torch.profiler import record_function


def expert_modules(model: nn.Module) -> list[nn.Module]:
    """The modules with expert parallelism's slot: each stacks its experts' parameters along dim 0."""
    return [module for module in model.modules() if hasattr(module, "expert_parallel")]


def apply_expert_parallel(model: nn.Module, mesh: DeviceMesh) -> None:
    """Shard the (meta) model's experts over the ep mesh and install the dispatch in their slots."""
    dispatch = ExpertParallel(mesh)
    for module in expert_modules(model):
        for name, param in list(module.named_parameters(recurse=False)):
            # src_data_rank None: each rank takes its own chunk, no values sent (they are set after to_empty).
            sharded = distribute_tensor(param.detach(), mesh, [Shard(0)], src_data_rank=None)
            module.register_parameter(name, nn.Parameter(sharded))
        module.expert_parallel = dispatch


class ExpertParallel:
    """One ep group's dispatch: the expert modules call it with their computation, the tokens sorted by expert and
    their weights."""

    def __init__(self, mesh: DeviceMesh):
        self.group, self.size = mesh.get_group(), mesh.size()
        # titan plan's fake tensors hold no counts: there every rank sends its pairs evenly over the ep ranks, and
        # this rank, the most loaded, receives `planned_load` times the mean from each (plan.moe_load_imbalance).
        self.planned_load = 1.0

    # The token counts are read on the host: a compiled block calls the dispatch eagerly (a graph break).
    @torch.compiler.disable
    def __call__(self, compute, x: torch.Tensor, counts: torch.Tensor, *weights: DTensor) -> torch.Tensor:
        """compute(x, counts, *weights) of x (tokens, dim) sorted by expert, counts[e] of them for expert e of
        all (n_experts,), with each token's experts' shards of `weights` on their rank; the results in x's order."""
        local_experts = counts.numel() // self.size
        with record_function("moe.dispatch"):
            # received[r, e]: rank r's tokens for this rank's expert e.
            received = torch.empty_like(counts)
            dist.all_to_all_single(received, counts, group=self.group)
            received = received.view(self.size, local_experts)
            if is_fake(x):
                sent, got = self.planned_split(x.shape[0])
            else:
                sent, got = counts.view(self.size, local_experts).sum(1).tolist(), received.sum(1).tolist()
            tokens = self.all_to_all(x, got, sent)
        # From rank-major to expert-major: each local expert's tokens in a row, rank 0's first, as on one process
        # (data-parallel ranks read consecutive rows).
        segments = torch.arange(received.numel(), device=x.device)
        segment = torch.repeat_interleave(segments, received.flatten(), output_size=tokens.shape[0])
        order = ((segment % local_experts) * self.size + segment // local_experts).argsort(stable=True)
        out = compute(tokens[order], received.sum(0), *(w.to_local() for w in weights))
        out = torch.empty_like(out).index_copy(0, order, out)
        with record_function("moe.combine"):
            return self.all_to_all(out, sent, got)

    def planned_split(self, pairs: int) -> tuple[list[int], list[int]]:
        """(rows sent to each rank, rows received from each) of `pairs` (token, expert) pairs, as titan plan
        assumes them."""
        sent = [pairs // self.size + (r < pairs % self.size) for r in range(self.size)]
        return sent, [round(self.planned_load * pairs / self.size)] * self.size

    def all_to_all(self, x: torch.Tensor, receive: list[int], send: list[int]) -> torch.Tensor:
        """send[r] rows of x to rank r, in rank order, and receive[r] from it: autograd sends the gradients back."""
        return wait_tensor(all_to_all_single(x, receive, send, self.group))
