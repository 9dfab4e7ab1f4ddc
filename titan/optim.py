"""AdamW and the learning-rate schedule: linear warmup, then cosine, linear, constant or warmup-stable-decay."""

from __future__ import annotations

import math

import torch
from torch import nn

from titan.config import LRScheduler, Optimizer


def build_optimizer(model: nn.Module, cfg: Optimizer) -> torch.optim.Optimizer:
    # Norm gains (1-D) are not decayed: decay would pull them towards zero instead of regularising.
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.ndim >= 2], "weight_decay": cfg.weight_decay},
        {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps)


def lr_factor(step: int, total_steps: int, cfg: LRScheduler) -> float:
    """Multiplier of the peak lr for optimizer step `step` (0-based)."""
    if step < cfg.warmup_steps:
        return (step + 1) / (cfg.warmup_steps + 1)
    floor = cfg.min_lr_ratio
    if cfg.decay == "constant":
        return 1.0
    if cfg.decay == "wsd":
        decay_steps = max(1, round(cfg.wsd_decay_ratio * total_steps))
        decay_start = max(cfg.warmup_steps, total_steps - decay_steps)
        if step < decay_start:
            return 1.0
        progress = (step - decay_start + 1) / max(1, total_steps - decay_start)
        return 1.0 - (1.0 - floor) * min(progress, 1.0)
    progress = min(1.0, (step - cfg.warmup_steps + 1) / max(1, total_steps - cfg.warmup_steps))
    if cfg.decay == "linear":
        return 1.0 - (1.0 - floor) * progress
    return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))


def build_lr_scheduler(optimizer: torch.optim.Optimizer, cfg: LRScheduler, total_steps: int):
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_factor(step, total_steps, cfg))
