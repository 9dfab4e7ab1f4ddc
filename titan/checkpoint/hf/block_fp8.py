"""DeepSeek's FP8 block-quantized weights, dequantized as they are read: a weight stored as float8 (e4m3) comes with
`{name}_scale_inv`, one float32 scale per block of the weight (128 x 128 unless config.json's
`quantization_config.weight_block_size` says otherwise), and its value is the stored number times its block's scale.

A reader of part of a weight (a shard's rows, an expert) reads only the scales of the blocks that part touches.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

FP8_WEIGHTS = ("F8_E4M3",)  # the safetensors dtypes of block-quantized weights
SCALE_SUFFIX = "_scale_inv"
DEFAULT_BLOCK = (128, 128)


@dataclass(frozen=True)
class BlockScale:
    """The scales of one FP8 weight: their tensor's name in the files, and the block they each cover."""

    name: str
    size: tuple[int, int]  # of a block


def block_size(config: dict[str, Any]) -> tuple[int, int]:
    """The quantization block of config.json's `quantization_config` (DeepSeek's 128 x 128 when it names none)."""
    quantization = config.get("quantization_config") or {}
    block = quantization.get("weight_block_size", DEFAULT_BLOCK)
    if not (isinstance(block, list | tuple) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block)):
        raise ValueError(f"quantization_config.weight_block_size must be two positive integers, got {block!r}")
    return tuple(block)


def block_scales(config: dict[str, Any], shapes: dict[str, list[int]], dtypes: dict[str, str]) -> dict[str, BlockScale]:
    """{FP8 weight: its scales} for the tensors of an HF folder (their shapes and safetensors dtypes), checked: each
    FP8 weight is a matrix with a float32 scale per block. ValueError naming the first that is not."""
    scales = {}
    for name, dtype in dtypes.items():
        if dtype not in FP8_WEIGHTS:
            continue
        scale = name + SCALE_SUFFIX
        if scale not in shapes:
            raise ValueError(f"{name} is FP8 ({dtype}) but the files hold no {scale}: the scales it is read with")
        block = block_size(config)
        expected = [math.ceil(n / b) for n, b in zip(shapes[name], block)]
        if len(shapes[name]) != 2 or shapes[scale] != expected or dtypes[scale] != "F32":
            raise ValueError(
                f"{scale} is {dtypes[scale]} {shapes[scale]}, but {name} {shapes[name]} in blocks of {list(block)} "
                f"needs F32 {expected}"
            )
        scales[name] = BlockScale(scale, block)
    return scales


def dequantize(box: Tensor, starts: list[int], scale: BlockScale, read_scales) -> Tensor:
    """A box of an FP8 weight (rows and columns from `starts` on) in float32: each element times its block's scale.
    read_scales(slices) reads those of the scale tensor. ValueError for a scale that is not finite."""
    (r0, c0), (rows, cols), (b0, b1) = starts, box.shape, scale.size
    scales = read_scales((slice(r0 // b0, (r0 + rows - 1) // b0 + 1), slice(c0 // b1, (c0 + cols - 1) // b1 + 1)))
    if not torch.isfinite(scales).all():  # a weight multiplied by it would be NaN or inf, silently
        raise ValueError(f"{scale.name} holds a scale that is not a finite number")
    per_element = scales.repeat_interleave(b0, 0).repeat_interleave(b1, 1)
    return box.float() * per_element[r0 % b0 : r0 % b0 + rows, c0 % b1 : c0 % b1 + cols]
