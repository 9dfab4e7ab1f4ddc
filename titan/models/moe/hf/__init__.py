"""The moe family's Hugging Face conversion (its HFAdapter): two formats, picked on import by config.json's
model_type and on export by the model's attention: Qwen3-MoE's (qwen3_moe.py) for grouped-query attention,
DeepSeek-V3's (deepseek_v3.py) for latent attention."""

from __future__ import annotations

from types import ModuleType
from typing import Any

import torch
from torch import Tensor

from titan.models.decoder import hf as decoder
from titan.models.moe import hf_format
from titan.models.moe.args import MoEArgs
from titan.models.moe.hf import deepseek_v3, qwen3_moe

MODEL_TYPES = (qwen3_moe.MODEL_TYPE, *deepseek_v3.MODEL_TYPES)  # config.json's, which pick this family
# Fields that are training choices: the decoder's, and the MoE's load balancing.
TRAINING_CHOICES = (*decoder.TRAINING_CHOICES, "bias_update_rate", "aux_loss_coef", "mtp_loss_weight")
_FORMATS = {"qwen3_moe": qwen3_moe, "deepseek_v3": deepseek_v3}


def _format(args: MoEArgs) -> ModuleType:
    return _FORMATS[hf_format(args)]


def args_from_hf_config(hf: dict[str, Any]) -> MoEArgs:
    """`MoEArgs` for an HF config.json dict of either format, by its model_type."""
    if hf.get("model_type") in deepseek_v3.MODEL_TYPES:
        return deepseek_v3.args_from_hf_config(hf)
    return qwen3_moe.args_from_hf_config(hf)


def hf_config_from_args(args: MoEArgs, dtype: torch.dtype | str = "float32") -> dict[str, Any]:
    return _format(args).hf_config_from_args(args, dtype)


def hf_sources(args: MoEArgs) -> dict[str, decoder.Source]:
    return _format(args).hf_sources(args)


def check_hf_names(names, args: MoEArgs) -> dict[str, str]:
    return _format(args).check_hf_names(names, args)


def held_args(args: MoEArgs, names) -> tuple[MoEArgs, str | None]:
    """The args of the model the files hold (DeepSeek-V3's multi-token prediction layers may be absent)."""
    return deepseek_v3.held_args(args, names) if hf_format(args) == "deepseek_v3" else (args, None)


def export_copies(args: MoEArgs) -> dict[str, str]:
    """{HF tensor: the HF tensor it copies} that an export writes besides (DeepSeek-V3's MTP layers' own copies of
    the embedding and the head)."""
    return deepseek_v3.export_copies(args) if hf_format(args) == "deepseek_v3" else {}


def check_hf_buffers(args: MoEArgs, buffers: dict[str, Tensor]) -> None:
    """The routing biases: DeepSeek-V3's files hold them; Qwen3-MoE's format requires them at zero."""
    if hf_format(args) == "qwen3_moe":
        qwen3_moe.check_hf_buffers(args, buffers)


to_hf_tensor = decoder.to_hf_tensor  # a titan tensor as HF stores it, given its rows
