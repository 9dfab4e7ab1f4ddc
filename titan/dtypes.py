"""The names of a dtype that recipes and commands take: titan's (fp32, bf16, fp16) and torch's (float32, bfloat16,
float16) name the same dtype everywhere (training.mixed_precision, generate's and convert's --dtype). No torch
import: recipes are checked before torch loads."""

from __future__ import annotations

from collections.abc import Iterable

from titan.errors import ConfigError

TORCH_NAMES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}  # titan's name: torch's
TITAN_NAMES = {torch: titan for titan, torch in TORCH_NAMES.items()}


def parse_dtype(value, choices: Iterable[str], where: str = "--dtype") -> str:
    """`value` in either spelling, as titan's name, which must be one of `choices` (titan's names)."""
    choices = tuple(choices)
    name = TITAN_NAMES.get(value, value) if isinstance(value, str) else value
    if name not in choices:
        aliases = ", ".join(f"'{c}' is '{TORCH_NAMES[c]}'" for c in choices)
        raise ConfigError(
            f"{where} must be one of {', '.join(choices)}, got {value!r} (torch's names work too: {aliases})"
        )
    return name
