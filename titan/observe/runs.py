"""A run as its folder and its reports describe it: its JSON files, its recipe as dotted keys, durations as people
read them. The trackers and `titan compare` share these; torch is not imported, so that compare stays quick."""

from __future__ import annotations

import json
from pathlib import Path

from titan.config import LAYOUT_SPEC
from titan.schema import Integer, Number, Table, Text, check

ENVIRONMENT = ("titan_version", "torch_version", "python_version", "device")  # what run_info.json says ran the run
# run_info.json and tracking.json as titan reads them back (titan/schema.py); other keys are left alone.
RUN_INFO = Table({"world_size": Integer(1), "layout": LAYOUT_SPEC, **dict.fromkeys(ENVIRONMENT, Text())})
TRACKING = Table({"recipe": Text(), "wandb": Table({"id": Text()})})
# metrics.jsonl's records as titan reads them back (titan/schema.py); other keys are left alone.
RECORD = Table(
    {
        "step": Integer(),
        **dict.fromkeys(("loss", "val_loss", "grad_norm", "lr", "tokens_per_s", "mfu", "peak_memory_gib"),
                        Number(finite=False)),  # a loss may be NaN
        **dict.fromkeys(("tokens_seen", "elapsed_s", "step_time_s"), Number(0)),  # summed and interpolated
    },
    required=frozenset({"step"}),
)  # fmt: skip


def read_metrics(file: Path) -> list[dict]:
    """metrics.jsonl's records, checked (ValueError: which line is wrong, or no logged step)."""
    text = file.read_text(errors="replace")
    lines = text.splitlines()
    records = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except (ValueError, RecursionError):  # JSONDecodeError, an integer of too many digits, nested too deep
            if number == len(lines) and not text.endswith("\n"):
                break  # a run killed mid-write leaves a torn last line: everything before it is good
            raise ValueError(f"{file} line {number} is not valid JSON: {line[:60]!r}") from None
        records.append(check(record, RECORD, f"{file} line {number}"))
    if not any("loss" in r for r in records):
        raise ValueError(f"{file} has no logged steps (did the run reach its first step?)")
    return records


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
