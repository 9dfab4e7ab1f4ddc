"""The model registry: a name maps to everything titan needs to train that family (its ModelSpec, the contract in
titan/models/contract.py).

Adding a family means adding a package under titan/models/ and one entry here; the trainer is untouched.
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib
from collections.abc import Callable
from typing import Any

from titan.models.contract import (
    Args,
    ClippedAttention,
    HFAdapter,
    Model,
    ModelSpec,
    RoutedExperts,
    StageBatch,
    StageIO,
)
from titan.run_plan import Blocks

__all__ = [
    "Args", "ClippedAttention", "HFAdapter", "Model", "ModelSpec", "RoutedExperts", "StageBatch", "StageIO",
    "get_model_spec", "model_args", "model_blocks"
]  # fmt: skip


def _on_decoder(name: str, family, build, hf, **own) -> ModelSpec:
    """A family on the shared decoder (titan/models/decoder/): its flavors, model, FLOPs and Hugging Face conversion
    (its hf module's names), and the decoder's parallelism, but for the parts of its own in `own`."""
    from titan.models.decoder import parallelize

    adapter = HFAdapter(
        args_from_config=hf.args_from_hf_config,
        config_from_args=hf.hf_config_from_args,
        sources=hf.hf_sources,
        check_names=hf.check_hf_names,
        to_hf_tensor=hf.to_hf_tensor,
        training_choices=hf.TRAINING_CHOICES,
        check_buffers=getattr(hf, "check_hf_buffers", None),
        held_args=getattr(hf, "held_args", None),
        export_copies=getattr(hf, "export_copies", None),
        model_types=hf.MODEL_TYPES,
    )
    parts = dict(
        name=name,
        flavors=family.FLAVORS,
        build=build,
        flops_per_token=family.flops_per_token,
        kv_width=family.kv_width,
        tp_plan=parallelize.tp_plan,
        blocks=parallelize.blocks,
        pipeline_stage=parallelize.pipeline_stage,
        pipeline_io=parallelize.pipeline_io,
        block_inputs=parallelize.block_inputs,
        hf=adapter,
    )
    return ModelSpec(**{**parts, **own})


def _llama3() -> ModelSpec:
    from titan.models import llama
    from titan.models.llama import hf

    return _on_decoder("llama3", llama, llama.Transformer, hf)


def _moe() -> ModelSpec:
    from titan.models import moe
    from titan.models.moe import hf, parallelize

    return _on_decoder(
        "moe",
        moe,
        moe.MoETransformer,
        hf,
        tp_plan=parallelize.tp_plan,
        blocks=parallelize.blocks,
        pipeline_stage=parallelize.pipeline_stage,
        routed_experts=moe.routed_experts,
        layers_args=moe.layers_args,
    )


def _qwen3() -> ModelSpec:
    from titan.models import qwen3
    from titan.models.qwen3 import hf

    return _on_decoder("qwen3", qwen3, qwen3.Qwen3, hf)


# name -> its package, whose FLAVORS import without torch (a recipe's model is checked before torch loads), and
# its ModelSpec.
_REGISTRY: dict[str, tuple[str, Callable[[], ModelSpec]]] = {
    "llama3": ("titan.models.llama", _llama3),
    "moe": ("titan.models.moe", _moe),
    "qwen3": ("titan.models.qwen3", _qwen3),
}


def family_of_hf(model_type: str) -> str:
    """The family whose Hugging Face conversion reads config.json's `model_type`."""
    for name in _REGISTRY:
        hf = get_model_spec(name).hf
        if hf is not None and model_type in hf.model_types:
            return name
    known = ", ".join(f"{t} ({n})" for n in _REGISTRY if get_model_spec(n).hf for t in get_model_spec(n).hf.model_types)
    raise KeyError(f"no titan model family reads HF model_type {model_type!r}; titan reads {known}")


def _family(name: str) -> tuple[str, Callable[[], ModelSpec]]:
    if name not in _REGISTRY:
        raise KeyError(f"unknown model.name {name!r}; known models: {', '.join(sorted(_REGISTRY))}")
    return _REGISTRY[name]


def get_model_spec(name: str) -> ModelSpec:
    return _family(name)[1]()


def family_flavors(name: str) -> dict[str, Args]:
    """A family's flavors by name, without importing torch."""
    return importlib.import_module(_family(name)[0]).FLAVORS


def model_args(name: str, flavor: str, overrides: dict[str, Any]) -> Args:
    """Family `name`'s flavor with the recipe's overrides; unknown names and wrong types raise ValueError (an
    unknown family KeyError)."""
    flavors = family_flavors(name)
    if flavor not in flavors:
        lower = {f.lower(): f for f in flavors}  # TorchTitan's 8B is titan's 8B, its debugmodel titan's debug
        near = difflib.get_close_matches(flavor.lower(), lower, n=1, cutoff=0.6)
        hint = f" (did you mean {lower[near[0]]}?)" if near else ""
        raise ValueError(f"unknown model.flavor {flavor!r} for {name}{hint}; flavors: {', '.join(flavors)}")
    args = flavors[flavor]
    fields = {f.name: f for f in dataclasses.fields(args)}
    for key, value in overrides.items():
        if key not in fields:
            raise ValueError(f"unknown model.overrides.{key}; {_override_hint(name, key, fields)}")
        current = getattr(args, key)
        if (
            current is not None
            and not isinstance(value, type(current))
            and not (isinstance(current, float) and isinstance(value, int))
        ):
            raise ValueError(f"model.overrides.{key} must be {type(current).__name__}, got {value!r}")
    return dataclasses.replace(args, **overrides)


def _override_hint(family: str, key: str, fields) -> str:
    """What an unknown override may have meant: a close field of this family, or another family that has it."""
    close = difflib.get_close_matches(key, fields, n=1)
    if close:
        return f"did you mean {close[0]}?"
    owners = [
        name
        for name in _REGISTRY
        if name != family and key in {f.name for f in dataclasses.fields(next(iter(family_flavors(name).values())))}
    ]
    if owners:
        return f"{key} belongs to the {owners[0]} family, not to {family}: set model.name = {owners[0]!r}"
    return f"fields of {family} args: {', '.join(fields)}"


def hf_export_blockers(name: str, args: Args) -> list[str]:
    """What a run of family `name` with these args trains that its Hugging Face format cannot hold (the family
    module's `training_blockers`; none where it has none), found without importing torch."""
    blockers = getattr(importlib.import_module(_family(name)[0]), "training_blockers", None)
    return blockers(args) if blockers else []


def model_blocks(args: Args) -> Blocks:
    """The model's blocks for the layer split, with the memory each takes in training: its fp32 weights, gradients
    and two Adam moments (16 bytes per parameter), counted from the args without building the model."""
    return Blocks(args.n_layers, tuple(16 * args.block_params(layer) / 2**30 for layer in range(args.n_layers)))
