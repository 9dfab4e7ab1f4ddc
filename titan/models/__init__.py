"""The model registry: a name maps to everything titan needs to train that family.

Adding a family means adding a package under titan/models/ and one entry here; the trainer is untouched.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torch import nn


@dataclass(frozen=True, kw_only=True)
class HFAdapter:
    """Conversion between the family's args and weights and a Hugging Face checkpoint (config.json + safetensors).

    Pure functions; titan/checkpoint/hf.py reads and writes the files. Weights are mapped tensor by tensor, so a reader
    can fetch only the part of an HF tensor that one shard needs: titan row r of a parameter is row rows[r] of
    its HF tensor (rows None: the same rows).
    """

    args_from_config: Callable[[dict], Any]  # config.json dict -> model args; ValueError names an unsupported field
    config_from_args: Callable[..., dict]  # (args, dtype="float32") -> config.json dict
    sources: Callable[[Any], dict]  # args -> {titan parameter name: (HF tensor name, rows or None)}
    check_names: Callable[[Any, Any], dict]  # (HF tensor names, args) -> {tied copy: HF tensor it must equal}
    to_hf_tensor: Callable[[Any, Any], Any]  # (titan tensor, its rows) -> the tensor as HF stores it


@dataclass(frozen=True, kw_only=True)
class ModelSpec:
    name: str
    flavors: dict[str, Any]  # flavor name -> model args dataclass
    build: Callable[[Any], nn.Module]  # args -> model (call under torch.device("meta"))
    flops_per_token: Callable[[Any, int], float]  # (args, seq_len) -> training FLOPs per token
    # Parallelism, applied from outside by titan/parallel:
    check_parallelism: Callable[[Any, int, int], None]  # (args, tp, pipeline stages); ValueError if impossible
    tp_plan: Callable[..., dict]  # (model, sequence_parallel, loss_parallel, styles=None) -> {fqn: style}
    blocks: Callable[[nn.Module], list[nn.Module]]  # units for checkpointing, compile and FSDP
    pipeline_stage: Callable[[nn.Module, list[int], bool, bool], nn.Module]  # (model, layer ids, first, last)
    # (args, rows, seq_len, hidden dtype, sequence shards, document ids?, first, last) -> (inputs, outputs) on meta
    pipeline_io: Callable[..., tuple]
    hf: HFAdapter | None = None  # Hugging Face import and export, if the family has them


def _llama3() -> ModelSpec:
    from titan.models import llama
    from titan.models.llama import hf, parallelize

    return ModelSpec(
        name="llama3",
        flavors=llama.FLAVORS,
        build=llama.Transformer,
        flops_per_token=llama.flops_per_token,
        check_parallelism=parallelize.check_parallelism,
        tp_plan=parallelize.tp_plan,
        blocks=parallelize.blocks,
        pipeline_stage=parallelize.pipeline_stage,
        pipeline_io=parallelize.pipeline_io,
        hf=HFAdapter(
            args_from_config=hf.args_from_hf_config,
            config_from_args=hf.hf_config_from_args,
            sources=hf.hf_sources,
            check_names=hf.check_hf_names,
            to_hf_tensor=hf.to_hf_tensor,
        ),
    )


_REGISTRY: dict[str, Callable[[], ModelSpec]] = {"llama3": _llama3}


def get_model_spec(name: str) -> ModelSpec:
    if name not in _REGISTRY:
        raise KeyError(f"unknown model.name {name!r}; known models: {', '.join(sorted(_REGISTRY))}")
    return _REGISTRY[name]()


def model_args(spec: ModelSpec, flavor: str, overrides: dict[str, Any]) -> Any:
    """The flavor's args with the recipe's overrides; unknown names and wrong types raise ValueError."""
    if flavor not in spec.flavors:
        raise ValueError(f"unknown model.flavor {flavor!r} for {spec.name}; flavors: {', '.join(spec.flavors)}")
    args = spec.flavors[flavor]
    fields = {f.name: f for f in dataclasses.fields(args)}
    for key, value in overrides.items():
        if key not in fields:
            raise ValueError(f"unknown model.overrides.{key}; fields of {spec.name} args: {', '.join(fields)}")
        current = getattr(args, key)
        if (
            current is not None
            and not isinstance(value, type(current))
            and not (isinstance(current, float) and isinstance(value, int))
        ):
            raise ValueError(f"model.overrides.{key} must be {type(current).__name__}, got {value!r}")
    return dataclasses.replace(args, **overrides)
