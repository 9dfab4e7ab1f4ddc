"""A run as its folder and its reports describe it: its JSON files, its recipe as dotted keys, durations as people
read them. The trackers and `titan compare` share these; torch is not imported, so that compare stays quick."""

from __future__ import annotations

from titan.config import LAYOUT_SPEC
from titan.schema import Integer, Table, Text

ENVIRONMENT = ("titan_version", "torch_version", "python_version", "device")  # what run_info.json says ran the run
# run_info.json and tracking.json as titan reads them back (titan/schema.py); other keys are left alone.
RUN_INFO = Table({"world_size": Integer(1), "layout": LAYOUT_SPEC, **dict.fromkeys(ENVIRONMENT, Text())})
TRACKING = Table({"recipe": Text(), "wandb": Table({"id": Text()})})


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
