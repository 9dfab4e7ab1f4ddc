"""A run as its folder and its reports describe it: its JSON files, its recipe as dotted keys, durations as people
read them. The trackers and `titan compare` share these; torch is not imported, so that compare stays quick."""

from __future__ import annotations

import json
from pathlib import Path


def read_json(file: Path) -> dict:
    """The JSON object `file` holds; ValueError saying what is wrong when it holds anything else."""
    try:
        value = json.loads(file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{file} is not valid JSON: {e}") from None
    if not isinstance(value, dict):
        raise ValueError(f"{file} is not a JSON object")
    return value


def flatten(table: dict, prefix: str = "") -> dict:
    """{"a": {"b": 1, "c": {"d": 2}}} -> {"a.b": 1, "a.c.d": 2}"""
    flat = {}
    for key, value in table.items():
        if isinstance(value, dict) and value:
            flat.update(flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def duration(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    if seconds < 60:
        return f"{seconds:.1f}s"
    seconds = int(round(seconds))
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{seconds // 60 % 60:02d}m"
