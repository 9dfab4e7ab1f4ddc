"""Which titan recipe model an HF checkpoint is: the flavor and overrides that build it, and a clear error
naming the first difference when a recipe's model is not the checkpoint's."""

from __future__ import annotations

import dataclasses
from typing import Any

from titan import models
from titan.checkpoint.train_state import model_shapes
from titan.config import toml_value
from titan.errors import ConfigError


def _same_model(spec: models.ModelSpec, a, b) -> bool:
    """Whether two args describe the same network: HF's description of them is equal."""
    try:
        return spec.hf.config_from_args(a) == spec.hf.config_from_args(b)
    except ValueError:  # an impossible combination
        return False


def recipe_model(spec: models.ModelSpec, args, flavor: str | None = None) -> tuple[str, dict[str, Any]]:
    """(flavor, overrides) that make a recipe build `args`: the given flavor, or the one needing fewest overrides.

    Overrides that do not change the network (e.g. RoPE scaling details while scaling is off, or another way
    to reach the same FFN size) are left out; `{}` means the flavor matches exactly.
    """
    candidates = [flavor] if flavor else list(spec.flavors)
    best: tuple[str, dict] | None = None
    for name in candidates:
        if name not in spec.flavors:
            raise ConfigError(f"unknown flavor {name!r} for {spec.name}; flavors: {', '.join(spec.flavors)}")
        base = spec.flavors[name]
        overrides = {
            f.name: getattr(args, f.name)
            for f in dataclasses.fields(args)
            if getattr(base, f.name) != getattr(args, f.name)
        }
        for key in list(overrides):
            trial = {k: v for k, v in overrides.items() if k != key}
            if _same_model(spec, dataclasses.replace(base, **trial), args):
                overrides = trial
        if best is None or len(overrides) < len(best[1]):
            best = (name, overrides)
    return best


def model_toml(name: str, flavor: str, overrides: dict[str, Any]) -> str:
    lines = ["[model]", f"name = {toml_value(name)}", f"flavor = {toml_value(flavor)}"]
    if overrides:
        lines.append(f"overrides = {toml_value(overrides)}")
    return "\n".join(lines)


def describe_match(spec: models.ModelSpec, args, flavor: str | None = None) -> tuple[str, str, dict]:
    """A sentence on how `args` relate to titan's flavors, with the (flavor, overrides) to use."""
    name, overrides = recipe_model(spec, args, flavor)
    if not overrides:
        return f"the model is exactly titan's {spec.name} flavor {name!r}", name, overrides
    chosen = "the requested" if flavor else "the closest"
    return (
        f"the model matches no titan flavor exactly; {chosen} is {name!r} with {len(overrides)} overrides",
        name,
        overrides,
    )


def check_model_matches(spec: models.ModelSpec, recipe_args, hf_args, source: str, recipe_name: str) -> None:
    """ConfigError naming the first parameter whose shape differs, else the first arg that changes the network.

    `hf_args` are the checkpoint's, whose tensors' shapes (in the file headers) the caller has checked against them.
    """
    hint = _Hint(spec, hf_args)
    mine, theirs = model_shapes(spec, recipe_args), model_shapes(spec, hf_args)
    for name, shape in mine.items():
        if name not in theirs:
            raise ConfigError(
                f"{source} has no parameter {name} (shape {shape} in this recipe's {recipe_name} model){hint}"
            )
        if theirs[name] != shape:
            raise ConfigError(
                f"{source} does not match this recipe's {recipe_name} model: {name} has shape "
                f"{theirs[name]} there but {shape} here{hint}"
            )
    extra = [name for name in theirs if name not in mine]
    if extra:
        raise ConfigError(f"{source} has parameter {extra[0]}, which this recipe's {recipe_name} model lacks{hint}")
    # Same shapes; what else changes the computation (RoPE, norm eps, head split, tying)?
    present = {k: getattr(recipe_args, k) for k in spec.hf.training_choices}
    theirs = dataclasses.replace(hf_args, **present)
    if not _same_model(spec, recipe_args, theirs):
        for f in dataclasses.fields(recipe_args):
            value = getattr(theirs, f.name)
            if value != getattr(recipe_args, f.name) and not _same_model(
                spec, dataclasses.replace(recipe_args, **{f.name: value}), recipe_args
            ):
                raise ConfigError(
                    f"{source} does not match this recipe's {recipe_name} model: {f.name} is {value!r} there "
                    f"but {getattr(recipe_args, f.name)!r} here{hint}"
                )
        raise ConfigError(f"{source} does not match this recipe's {recipe_name} model{hint}")


class _Hint:
    """'; set model.flavor = ... and model.overrides = {...}', worked out only when an error message needs it."""

    def __init__(self, spec: models.ModelSpec, hf_args):
        self.spec, self.hf_args = spec, hf_args

    def __str__(self) -> str:
        flavor, overrides = recipe_model(self.spec, self.hf_args)
        # Leave out the training choices: the recipe keeps its own sequence length and dropout.
        overrides = {k: v for k, v in overrides.items() if k not in self.spec.hf.training_choices}
        text = f"; to use it, set model.flavor = {toml_value(flavor)}"
        if overrides:
            text += f" and model.overrides = {toml_value(overrides)}"
        return text
