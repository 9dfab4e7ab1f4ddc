"""The optimizer's and the learning-rate schedule's sections of the recipe (a part of titan/config/sections.py)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal


@dataclass(frozen=True)
class Optimizer:
    name: Literal["adamw", "muon"] = "adamw"  # muon: orthogonalised momentum for weight matrices (docs/optimizers.md)
    lr: float = 3e-4  # the peak learning rate, reached after warmup
    beta1: float = 0.9  # AdamW's first-moment decay
    beta2: float = 0.95  # AdamW's second-moment decay
    eps: float = 1e-8  # added to the second moment's square root
    weight_decay: float = 0.1  # decoupled, on every parameter but no_decay's
    # Parameters not decayed, by name pattern (fnmatch): norms, biases, embeddings; one the recipe adds must match.
    no_decay: list[str] = field(default_factory=lambda: ["*norm*", "*bias*", "*embed*"])
    momentum: float = 0.95  # Muon's Nesterov momentum
    # Parameters Muon leaves to AdamW, by name pattern (1-D ones always): embeddings, output head, norms, router.
    adamw_for: list[str] = field(default_factory=lambda: ["*embed*", "output.*", "*norm*", "*bias*", "*router*"])
    # QK-clip (Kimi K2's MuonClip): after each step, scale back the query and key weights of every attention head whose
    # largest pre-softmax logit exceeded this (K2: 100); 0: off. With AdamW too (docs/optimizers.md).
    qk_clip_tau: float = 0.0


@dataclass(frozen=True)
class LRScheduler:
    warmup_steps: int = 10  # linear warmup from 0 to optimizer.lr
    # After warmup: cosine/linear decay to min_lr_ratio*lr, constant, or warmup-stable-decay (wsd).
    decay: Literal["cosine", "linear", "constant", "wsd"] = "cosine"
    min_lr_ratio: float = 0.1  # the lr decays to this fraction of optimizer.lr
    wsd_decay_ratio: float = 0.2  # wsd: the last fraction of steps decays linearly
