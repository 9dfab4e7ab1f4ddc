"""Token-choice top-k routing, the same on every layout, and its load balancing over the step's global batch.

Every decision is one process's: router logits and scores in fp32, ties between equal scores broken by expert
index, each token's experts kept in expert order (the combine sums in it). Balancing never depends on how the step's
tokens are split over ranks:
* DeepSeek-V3's bias: each expert's bias is added to the scores when choosing experts (not when weighting them) and
  moved, after each step, by bias_update_rate towards the mean load: up for an expert with fewer tokens than the
  mean, down for one with more. The loads are the step's tokens per expert summed over every micro-batch and rank
  (Routing.end_step), so every rank moves the same bias by the same amount. Checkpoints hold the biases.
* The sequence-level auxiliary loss, per row r: aux_loss_coef * sum_i f_ri P_ri, with f_ri = n_experts / (top_k T)
  x the row's tokens routed to expert i and P_ri = the mean over its T tokens of expert i's normalised score. A row
  weighs T / (the step's loss tokens) in the step, as the token loss's rows do, so the sum over the global batch is
  the same whichever ranks hold the rows. Where a row's tokens are split over ranks (context parallelism's ring,
  tensor parallelism's sequence shards), its counts are summed over them first, so f_ri is the whole row's. Its
  gradient reaches the router inside the backward (AddedLoss), so a pipeline stage needs nothing of the last
  stage's loss.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from titan.models.moe.args import MoEArgs


class AddedLoss(torch.autograd.Function):
    """Pass `x` through; in backward, give `loss` the gradient 1, as if it were added to the step's loss."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, loss: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, torch.ones((), device=grad.device)


def expert_counts(experts: torch.Tensor, n_experts: int) -> torch.Tensor:
    """Tokens per expert, (n_experts,): bincount's sum with its shape fixed, as titan plan's fake tensors need."""
    flat = experts.flatten()
    return torch.zeros(n_experts, dtype=torch.long, device=flat.device).scatter_add_(0, flat, torch.ones_like(flat))


# The all-reduce runs eagerly in a compiled block.
@torch.compiler.disable
def whole_rows(counts: torch.Tensor, groups: tuple) -> torch.Tensor:
    """Each row's counts (rows, n_experts) summed over the process groups that split its tokens."""
    for group in groups:
        dist.all_reduce(counts, group=group)
    return counts


def pair_order(experts: torch.Tensor) -> torch.Tensor:
    """The (token, expert) pairs of experts (tokens, top_k), flat, sorted by expert and within an expert by token
    (each expert's tokens in a row, as the grouped matmul takes them): the pair at each place."""
    return experts.flatten().argsort(stable=True)


def counting() -> bool:
    """Whether a forward is the step's own: not evaluation (no gradient), nor activation checkpointing's recomputation
    inside the backward, which would count the same tokens twice."""
    return torch.is_grad_enabled() and torch._C._current_graph_task_id() == -1


class Router(nn.Module):
    def __init__(self, args: MoEArgs):
        super().__init__()
        self.top_k, self.score_func, self.norm_topk = args.top_k, args.score_func, args.norm_topk
        self.route_scale, self.n_group, self.topk_group = args.route_scale, args.n_group, args.topk_group
        n_experts = args.n_experts
        self.gate = nn.Linear(args.dim, n_experts, bias=False)
        self.register_buffer("expert_bias", torch.zeros(n_experts))  # persistent: checkpoints hold it
        # This step's training tokens per expert, and its balance loss (not saved: a step ends before a save).
        self.register_buffer("load", torch.zeros(n_experts, dtype=torch.long), persistent=False)
        self.register_buffer("balance_loss", torch.zeros(()), persistent=False)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x (tokens, dim) -> (scores (tokens, n_experts) fp32, experts (tokens, top_k) in ascending order, their
        weights (tokens, top_k) fp32)."""
        logits = F.linear(x.float(), self.gate.weight.float())
        scores = logits.softmax(dim=-1) if self.score_func == "softmax" else logits.sigmoid()
        choice = scores + self.expert_bias.float()
        if self.n_group > 1:
            choice = self._within_best_groups(choice)
        # A stable descending sort keeps equal scores in expert order: ties go to the lower index on any layout,
        # where topk's choice among equals is the kernel's.
        chosen = torch.sort(choice, dim=-1, descending=True, stable=True).indices
        experts = chosen[:, : self.top_k].sort(dim=-1).values
        weights = scores.gather(-1, experts)
        if self.norm_topk:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return scores, experts, weights * self.route_scale

    def _within_best_groups(self, choice: torch.Tensor) -> torch.Tensor:
        """DeepSeek-V3's group-limited choice: the experts in n_group groups of consecutive indices, each group
        scored by the sum of its two best (biased) scores; outside the topk_group best groups (ties to the lower
        group), every score is -inf."""
        tokens, n_experts = choice.shape
        grouped = choice.view(tokens, self.n_group, n_experts // self.n_group)
        group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)
        best = torch.sort(group_scores, dim=-1, descending=True, stable=True).indices[:, : self.topk_group]
        kept = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best, True)
        return grouped.masked_fill(~kept.unsqueeze(-1), float("-inf")).view(tokens, n_experts)

    def account(self, scores: torch.Tensor, experts: torch.Tensor, rows: int, coef: float, routing: Routing):
        """Count this forward's tokens per expert for the step's bias update, and return its balance loss (None
        without one) on the step loss's scale (`routing`'s): scores and experts of `rows` rows, in row order, each
        row's tokens split over `routing.row_groups()`. Activation checkpointing's recomputation computes the loss
        again, as its backward needs the same graph, but counts nothing."""
        if not torch.is_grad_enabled():
            return None
        n_experts, first = scores.shape[-1], counting()
        if first:
            self.load += expert_counts(experts, n_experts)
        if not coef:
            return None
        per_row = torch.zeros(rows, n_experts, device=experts.device).scatter_add_(
            1, experts.view(rows, -1), torch.ones_like(experts, dtype=torch.float32).view(rows, -1)
        )
        per_row = whole_rows(per_row, routing.row_groups())
        tokens = per_row.sum(dim=-1, keepdim=True) / self.top_k  # the whole row's T
        frequency = per_row * (n_experts / self.top_k) / tokens  # f_ri: no gradient flows through the choice
        normalised = scores if self.score_func == "softmax" else scores / scores.sum(dim=-1, keepdim=True)
        # sum_r sum_t sum_i f_ri s_ti = sum_r T sum_i f_ri P_ri: each row's loss weighted by its tokens (a rank's
        # share: the sum over this rank's tokens t of the row).
        weighted = (frequency.unsqueeze(1) * normalised.view(rows, -1, n_experts)).sum()
        loss = weighted * (coef * routing.loss_scale.to(weighted.device))
        if first:
            self.balance_loss += loss.detach()
        return loss


class Routing:
    """What the step does with a model's routers: it sets the loss scale (the step loss's, 1 / its loss tokens, which
    the multi-token prediction's loss takes too) before each micro-batch and calls `end_step` after the optimizer."""

    def __init__(self, model: nn.Module, bias_update_rate: float):
        self.model, self.bias_update_rate = model, bias_update_rate
        # A tensor, not a float: a compiled block then reads its value rather than recompiling for each new one.
        self.loss_scale = torch.ones((), device="cpu")  # models are built on the meta device
        # The process groups that split a row's tokens (split_rows), and whether this forward's rows are the rank's
        # own, whole on its context-parallel group (a local micro-batch).
        self.cp_group = self.tp_group = None
        self.local = False

    def split_rows(self, cp_group, tp_group) -> None:
        """Context parallelism's group (None: none), whose ring splits each row's tokens, and tensor parallelism's
        (None: none), over whose ranks the MoE layers split each row's positions."""
        self.cp_group, self.tp_group = cp_group, tp_group

    def row_groups(self) -> tuple:
        """The groups that split this forward's rows: the cp group (but for a rank's own rows) and the tp group."""
        ring = None if self.local else self.cp_group
        return tuple(group for group in (ring, self.tp_group) if group is not None)

    def set_loss_scale(self, scale: float) -> None:
        self.loss_scale.fill_(scale)

    def routers(self) -> dict[str, Router]:
        """This part's routers by layer (a pipeline stage holds some layers)."""
        return {name.split(".")[1]: module for name, module in self.model.named_modules() if isinstance(module, Router)}

    @torch.no_grad()
    def end_step(
        self, groups: tuple, finite: torch.Tensor, stages: tuple[Routing, ...] = ()
    ) -> dict[str, torch.Tensor]:
        """Sum the step's expert loads and balance losses over `groups` (the ranks that split the step's tokens, and
        a pipeline's ranks, which hold the other layers), move the biases unless the step was skipped (`finite`
        false: its update was not applied), reset the counts; `stages`: the routing of this rank's other pipeline
        stages, accounted in the same collectives. Returns the step's routing metrics for every MoE layer of the
        model, on the device: per layer the most and the least loaded expert's tokens over the mean, and the balance
        loss summed over layers."""
        routers = {layer: router for routing in (self, *stages) for layer, router in routing.routers().items()}
        args, device = self.model.args, self.model.rope.device  # every stage holds the RoPE table
        layers = [str(layer) for layer in args.moe_layers]
        # Every MoE layer's row, zero where another stage holds it: the sum over the pipeline fills them in.
        loads = torch.zeros(len(layers), args.n_experts, dtype=torch.long, device=device)
        losses = torch.zeros(len(layers), device=device)
        for i, layer in enumerate(layers):
            if layer in routers:
                loads[i], losses[i] = routers[layer].load, routers[layer].balance_loss
        for group in groups:
            dist.all_reduce(loads, group=group)
            dist.all_reduce(losses, group=group)
        metrics = {"moe/balance_loss": losses.sum()}
        for layer, load in zip(layers, loads.double()):
            mean = load.mean()
            if layer in routers:
                router = routers[layer]
                router.expert_bias += (self.bias_update_rate * torch.sign(mean - load) * finite).to(
                    router.expert_bias.dtype
                )
                router.load.zero_()
                router.balance_loss.zero_()
            metrics[f"moe/load_max/{layer}"] = load.max() / mean
            metrics[f"moe/load_min/{layer}"] = load.min() / mean
        return metrics
