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
from titan.models.moe.mtp import MTPModule, summed_token_loss, targets
from titan.models.moe.routing import AddedLoss, Router, Routing, expert_counts, pair_order
from titan.rng.shards import full_tensor


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
        return out if balance_loss is None else AddedLoss.apply(out, balance_loss)


class MoETransformer(Decoder):
    """The decoder with MoE feed-forwards after the first `dense_layers` layers, and Qwen3's q/k norms; with
    mtp_layers, DeepSeek-V3's multi-token prediction modules after the stack (mtp.py), held by layer number as the
    layers are: mtp.<n_layers>, mtp.<n_layers + 1>, ..."""

    args: MoEArgs
    residual_outputs = (*Decoder.residual_outputs, "experts.w2")

    def __init__(self, args: MoEArgs, traceable: bool = False):
        self.routing = Routing(self, args.bias_update_rate)  # before the blocks, which share it
        super().__init__(args, traceable)
        depths = range(args.n_layers, args.n_layers + args.mtp_layers)
        self.mtp = nn.ModuleDict({str(layer): MTPModule(args, self.block(layer)) for layer in depths})
        self.name_dropout_streams()  # the prediction blocks' too

    def forward(self, tokens, rows=None, document_ids=None, cache=None, local: bool = False, labels=None):
        """The decoder's; the routing notes whether the rows are this rank's own (`local`), not split over a cp
        group. With labels (a training forward, without a cache) the multi-token prediction's loss is added to the
        objective inside the backward, where the gradient reaches the head's input, the logits unchanged.

        Pipeline stages of a model with multi-token prediction pass on, concatenated to the hidden states (last
        dimension, args.stage_width), the embeddings of the tokens each depth looks ahead to: the first stage holds
        the embedding and the last the modules, and the gradient flows back to the embedding with the states'."""
        self.routing.local = local
        depths = self.args.mtp_layers
        staged = self.tok_embeddings is None or self.output is None
        if not depths or cache is not None or (labels is None and not staged):
            return super().forward(tokens, rows, document_ids, cache, local)
        rows, rope, mask = self.attention_inputs(tokens, rows, document_ids, None, local)
        if self.tok_embeddings is None:
            h, ahead = tokens.split([self.args.dim, depths * self.args.dim], dim=-1)
        else:
            h, ahead = self.embed_with_lookahead(tokens, local)
        h = self.through_blocks(h, rows, rope, mask)
        if self.output is None:
            return (torch.cat([h, ahead], dim=-1), rows) + (() if document_ids is None else (document_ids,))
        h = self.norm(h)
        if labels is None:  # a pipeline's evaluation
            return self.output(h)
        # At the head's input rather than its output: FSDP warns of a model whose output is a view.
        loss = self.mtp_loss(h, ahead, labels, document_ids, rows, rope, mask, local)
        return self.output(AddedLoss.apply(h, loss))

    def embed_with_lookahead(self, tokens: torch.Tensor, local: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """The tokens' embeddings, and those of the tokens t_{i+k} each depth k looks ahead to from this rank's
        positions i, concatenated (last dimension). Past the row's end the row's first tokens stand in: their
        targets are ignored. Under context parallelism (rows the cp group shares) the shift crosses the ranks'
        positions, so it is taken on the whole rows. An embedding call per depth, each of the rows: titan verify
        compares a module's calls row by row."""
        ring = None if local else self.context_parallel
        whole = tokens if ring is None else ring.whole_rows(tokens)
        ahead = [whole.roll(-depth, dims=1) for depth in range(1, self.args.mtp_layers + 1)]
        if ring is not None:
            ahead = [shifted[:, ring.positions] for shifted in ahead]
        return self.tok_embeddings(tokens), torch.cat([self.tok_embeddings(shifted) for shifted in ahead], dim=-1)

    def mtp_loss(self, h, ahead, labels, document_ids, rows, rope, mask, local: bool) -> torch.Tensor:
        """The prediction modules' loss on the step loss's scale (the routing's), from the main model's final
        normed hidden states h and the lookahead embeddings: the mean over depths of each depth's summed token loss,
        times mtp_loss_weight. Each depth's unweighted loss is added to its module's `loss`."""
        ring = None if local else self.context_parallel
        if ring is not None:  # a target k ahead may be another rank's label: shift the whole rows, keep ours
            labels = ring.whole_rows(labels)
        losses = []
        for depth, (module, embedded) in enumerate(zip(self.mtp.values(), ahead.chunk(len(self.mtp), dim=-1)), 1):
            h = module(h, embedded, rope, rows, mask)
            target = targets(labels, document_ids, depth)
            if ring is not None:
                target = target[:, ring.positions]
            # A DTensor under loss parallelism, replicated: its local value is the whole loss.
            loss = full_tensor(summed_token_loss(self.output(module.norm(h)), target))
            losses.append(loss * self.routing.loss_scale.to(loss.device))
            module.loss += losses[-1].detach()
        return torch.stack(losses).mean() * self.args.mtp_loss_weight

    def step_losses(self) -> dict[str, torch.Tensor]:
        """The multi-token prediction's loss since the last call, the mean over depths, then zero again; zero on a
        pipeline stage without the modules, whose rank sums it with the others all the same."""
        if not self.args.mtp_layers:
            return {}
        if not self.mtp:
            return {"mtp_loss": torch.zeros((), device=self.rope.device)}
        loss = torch.stack([module.loss for module in self.mtp.values()]).mean()
        for module in self.mtp.values():
            module.loss.zero_()
        return {"mtp_loss": loss}

    def block(self, layer_id: int) -> TransformerBlock:
        args = self.args
        if layer_id in args.moe_layers:
            feed_forward = MoE(args, self.routing)
        else:
            feed_forward = FeedForward(args.dim, args.dense_hidden_dim)
        attention = LatentAttention(args) if args.kv_lora_rank else Attention(args, args.qk_norm)
        return TransformerBlock(layer_id, args, feed_forward, attention)

    def init_buffers(self, positions: int | None = None) -> None:
        """The RoPE table, and each router's step counts and each prediction module's step loss at zero; the
        routers' biases are state, left as loaded."""
        super().init_buffers(positions)
        for router in self.routing.routers().values():
            router.load.zero_()
            router.balance_loss.zero_()
        for module in self.mtp.values():
            module.loss.zero_()

    @torch.no_grad()
    def init_weights(self, seed: int) -> None:
        super().init_weights(seed)
        for router in self.routing.routers().values():
            router.expert_bias.zero_()
