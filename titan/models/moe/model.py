"""The mixture-of-experts transformer: the decoder's blocks (titan/models/decoder/) with q/k norms, a dense SwiGLU
in the first `dense_layers` layers and in every later layer a MoE feed-forward: the router picks each token's top_k
routed experts, the experts run as one grouped matmul on the tokens sorted by expert, and each token's results are
summed in expert order with their weights, plus the shared experts' output.

Dropless: every token reaches its top_k experts, however unevenly they are loaded. A capacity factor would drop a
token or not depending on which other tokens share its rank, so the math would depend on the layout.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.profiler import record_function

from titan.models.decoder.attention import Attention
from titan.models.decoder.latent_attention import LatentAttention
from titan.models.decoder.model import Decoder, FeedForward, TransformerBlock
from titan.models.moe.args import MoEArgs
from titan.models.moe.experts import GroupedExperts
from titan.models.moe.routing import BalanceLoss, Router, Routing, expert_counts, pair_order


class MoE(nn.Module):
    def __init__(self, args: MoEArgs, routing: Routing):
        super().__init__()
        self.n_experts, self.top_k, self.aux_loss_coef = args.n_experts, args.top_k, args.aux_loss_coef
        self.routing = routing  # the step's loss scale, for the balance loss
        self.router = Router(args)
        self.experts = GroupedExperts(args.dim, args.expert_hidden_dim, args.n_experts)
        hidden = args.n_shared_experts * args.expert_hidden_dim
        self.shared = FeedForward(args.dim, hidden) if hidden else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x (rows, seq, dim) -> (rows, seq, dim)."""
        rows, seq, dim = x.shape
        tokens = x.reshape(-1, dim)
        with record_function("moe.router"):  # profiler marks: scripts/bench.py --compare moe sums them
            scores, experts, weights = self.router(tokens)
            balance_loss = self.router.account(scores, experts, rows, self.aux_loss_coef, self.routing)
            order = pair_order(experts)
            counts = expert_counts(experts, self.n_experts)
        routed = self.experts(tokens[order // self.top_k], counts)
        per_pair = torch.empty_like(routed).index_copy_(0, order, routed).view(-1, self.top_k, dim)
        out = (per_pair * weights.to(per_pair.dtype).unsqueeze(-1)).sum(dim=1).view(rows, seq, dim)  # in expert order
        if self.shared is not None:
            out = out + self.shared(x)  # (rows, seq, dim): tensor parallelism splits it as a dense feed-forward
        return out if balance_loss is None else BalanceLoss.apply(out, balance_loss)


class MoETransformer(Decoder):
    """The decoder with MoE feed-forwards after the first `dense_layers` layers, and Qwen3's q/k norms."""

    args: MoEArgs
    residual_outputs = (*Decoder.residual_outputs, "experts.w2")

    def __init__(self, args: MoEArgs, traceable: bool = False):
        self.routing = Routing(self, args.bias_update_rate)  # before the blocks, which share it
        super().__init__(args, traceable)

    def forward(self, tokens, rows=None, document_ids=None, cache=None, local: bool = False, labels=None):
        """The decoder's; the routing notes whether the rows are this rank's own (`local`), not split over a cp
        group."""
        self.routing.local = local
        return super().forward(tokens, rows, document_ids, cache, local)

    def block(self, layer_id: int) -> TransformerBlock:
        args = self.args
        if layer_id in args.moe_layers:
            feed_forward = MoE(args, self.routing)
        else:
            feed_forward = FeedForward(args.dim, args.dense_hidden_dim)
        attention = LatentAttention(args) if args.kv_lora_rank else Attention(args, args.qk_norm)
        return TransformerBlock(layer_id, args, feed_forward, attention)

    def init_buffers(self, positions: int | None = None) -> None:
        """The RoPE table, and each router's step counts at zero; the routers' biases are state, left as loaded."""
        super().init_buffers(positions)
        for router in self.routing.routers().values():
            router.load.zero_()
            router.balance_loss.zero_()

    @torch.no_grad()
    def init_weights(self, seed: int) -> None:
        super().init_weights(seed)
        for router in self.routing.routers().values():
            router.expert_bias.zero_()
