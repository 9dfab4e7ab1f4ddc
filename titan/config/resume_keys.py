"""The recipe keys a resume checks against the checkpoint's."""

from __future__ import annotations

from typing import Any

from titan.config.sections import Config, to_dict

# The recipe keys that change what a resumed run computes, or which tokens it trains or validates on: a resume
# checks them against the checkpoint's. training.global_batch is the global batch in rows, whatever
# global_batch_size and the layout say.
MATH_KEYS = (
    "job.seed",
    "model.name",
    "model.flavor",
    "model.overrides",
    "tokenizer.path",
    "tokenizer.bos_token",
    "tokenizer.eos_token",
    "data.source",
    "data.sources",
    "data.stages",
    "data.format",
    "data.text_field",
    "data.text_unit",
    "data.split",
    "data.subset",
    "data.revision",
    "data.shuffle",
    "data.document_mask",
    "data.batching",
    "data.max_document_len",
    "training.seq_len",
    "training.global_batch",
    "training.steps",
    "training.max_grad_norm",
    "training.mixed_precision",
    "validation.fraction",
    "validation.source",
    "validation.format",
    "validation.text_field",
    "validation.text_unit",
    "validation.split",
    "validation.revision",
    "validation.steps",
    "optimizer.name",
    "optimizer.lr",
    "optimizer.beta1",
    "optimizer.beta2",
    "optimizer.eps",
    "optimizer.weight_decay",
    "optimizer.no_decay",
    "optimizer.momentum",
    "optimizer.adamw_for",
    "optimizer.qk_clip_tau",
    "lr_scheduler.warmup_steps",
    "lr_scheduler.decay",
    "lr_scheduler.min_lr_ratio",
    "lr_scheduler.wsd_decay_ratio",
    "float8.enable",
    "float8.recipe",
    "float8.skip",
)
# What a checkpoint records of the data the run read (titan.data.prepared_record), checked on resume like
# MATH_KEYS: each source's prepared tokens (a source whose files changed or grew behind the same path, or another
# tokenizer, has others) and validation's held-out split.
PREPARED_KEYS = ("data.prepared", "validation.prepared")
# What a checkpoint saved before a key was recorded did, as that key's value, which a resume compares as if saved:
# AdamW decayed every matrix, embeddings included, and no 1-D parameter (titan's models' are norms and biases); no
# attention head was clipped.
BEFORE_RECORDED = {"optimizer.no_decay": ["*norm*", "*bias*"], "optimizer.qk_clip_tau": 0.0}


def math_values(config: Config, global_batch: int) -> dict[str, Any]:
    """The MATH_KEYS' values of a run, as JSON-ready values."""
    values = to_dict(config)
    values["training"]["global_batch"] = global_batch
    values["data"]["sources"] = values["data"]["sources"] if config.data.sources else []
    if config.lr_scheduler.decay == "constant":
        values["training"]["steps"] = None  # the only schedule whose lr does not depend on the run's length
    if config.optimizer.name != "muon":  # AdamW reads neither
        values["optimizer"]["momentum"] = values["optimizer"]["adamw_for"] = None
    out = {}
    for key in MATH_KEYS:
        section, name = key.split(".")
        out[key] = values[section][name]
    return out
