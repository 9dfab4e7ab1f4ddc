"""DeepSeek-V3's multi-token prediction (MTP): D modules after the main stack, module k (1..D) predicting, at each
position i, the token t_{i+k+1}:

    h^k_i = block_k(eh_proj_k(cat[enorm_k(Emb(t_{i+k})), hnorm_k(h^{k-1}_i)])),  logits^k_i = Head(norm_k(h^k_i))

with h^0 the main model's final normed hidden state (the output head's input), Emb and Head the main model's own
embedding and output head, and block_k a MoE block of its own with the main model's masks and RoPE positions. The
loss of depth k counts the positions whose target is in the row and in their own document; training adds the
mean over depths, times mtp_loss_weight, to the next-token loss.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from titan.models.decoder.model import TransformerBlock
from titan.models.moe.args import MoEArgs

IGNORE_INDEX = -100  # cross_entropy's default, which the data's labels use where a token carries no loss


class MTPModule(nn.Module):
    """One depth of the prediction: its two norms, the projection of their concatenation, its block, and the norm
    before the shared head. `loss` sums this depth's loss over the step's micro-batches, for the log."""

    def __init__(self, args: MoEArgs, block: TransformerBlock):
        super().__init__()
        self.enorm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.hnorm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.eh_proj = nn.Linear(2 * args.dim, args.dim, bias=False)
        self.block = block
        self.norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.register_buffer("loss", torch.zeros(()), persistent=False)  # a step ends before a save

    def forward(self, h: torch.Tensor, embedded: torch.Tensor, rope, rows, mask) -> torch.Tensor:
        """The previous depth's hidden states h (rows, seq, dim) and the embeddings of the tokens this depth looks
        ahead to -> this depth's hidden states."""
        return self.block(self.eh_proj(torch.cat([self.enorm(embedded), self.hnorm(h)], dim=-1)), rope, rows, mask)


def targets(labels: torch.Tensor, document_ids: torch.Tensor | None, depth: int) -> torch.Tensor:
    """Depth `depth`'s target at each position i: t_{i+depth+1}, the label at i + depth, where that label is in the
    row and in i's document; IGNORE_INDEX past the row, in another document, or where the label is ignored."""
    seq = labels.shape[1]
    elsewhere = torch.arange(seq, device=labels.device) >= seq - depth
    if document_ids is not None:
        elsewhere = elsewhere | (document_ids != document_ids.roll(-depth, dims=1))
    return labels.roll(-depth, dims=1).masked_fill(elsewhere, IGNORE_INDEX)


def summed_token_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The targets' cross-entropy summed, in fp32 whatever the logits' dtype, as the step's token loss."""
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), reduction="sum", ignore_index=IGNORE_INDEX)
