"""Activation checkpointing of transformer blocks: full (recompute everything) or selective (keep the
outputs of the listed ops, recompute the rest), applied in place so parameter names do not change."""

from __future__ import annotations

from functools import partial

from torch import nn
from torch.distributed._composable import checkpoint
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from titan.config import ActivationCheckpoint


def apply_activation_checkpointing(blocks: list[nn.Module], cfg: ActivationCheckpoint) -> None:
    if cfg.mode == "none":
        return
    context_fn = (
        partial(create_selective_checkpoint_contexts, partial(_policy, frozenset(cfg.save_ops)))
        if cfg.mode == "selective"
        else None
    )
    for i, block in enumerate(blocks):
        if i % cfg.every == 0:
            checkpoint(block, context_fn=context_fn)


def _policy(save_ops: frozenset[str], ctx, op, *args, **kwargs) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if str(op.overloadpacket) in save_ops else CheckpointPolicy.PREFER_RECOMPUTE
