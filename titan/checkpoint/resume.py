"""Resuming: picking the checkpoint (the recipe's path, or with resume = auto the newest complete one that passes
verification), checking the recipe against it (the model, and the keys that change the math or the tokens),
loading its tensors and the data loader's position, and setting aside the later checkpoints of a rewound run.
Checkpointer.resume and Checkpointer.load call these with what each uses."""

from __future__ import annotations

import datetime
import logging
import re
from collections.abc import Callable
from pathlib import Path

import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException  # a BaseException, not an Exception

from titan.checkpoint.format import MARKER, CheckpointReader, dcp_error, single_process_quiet
from titan.checkpoint.train_state import DATA_STATE
from titan.config import Checkpoint
from titan.config.resume_keys import BEFORE_RECORDED
from titan.errors import ConfigError
from titan.schema import Invalid, read_json

log = logging.getLogger("titan")
PARTS = ("model", "optimizer", "lr_scheduler", "data", "train_state")
STEP_DIR = re.compile(r"^step-(\d+)$")


def complete_checkpoints(folder: Path) -> dict[int, Path]:
    """step -> folder of every complete checkpoint under `folder`."""
    if not folder.is_dir():
        return {}
    found = {}
    for child in folder.iterdir():
        match = STEP_DIR.match(child.name)
        if match and (child / MARKER).is_file():
            found[int(match.group(1))] = child
    return dict(sorted(found.items()))


def checkpoints_at(path: Path, key: str = "checkpoint") -> list[Path]:
    """The complete checkpoint folder `path`, else every one in `path` (a checkpoints/ folder) or in
    `path/checkpoints` (a run folder), oldest first. `key` names what the user set, for the error."""
    path = Path(path)
    if (path / MARKER).is_file():
        return [path]
    for folder in (path, path / "checkpoints"):
        found = complete_checkpoints(folder)
        if found:
            return list(found.values())
    what = (
        "does not exist"
        if not path.exists()
        else f"is not a complete titan checkpoint (no {MARKER} marker), nor a folder of them"
    )
    raise ConfigError(f"{key}: {path} {what}")


def find_checkpoint(path: Path, key: str = "checkpoint") -> Path:
    """A complete checkpoint folder as given, else the newest in `path` (a checkpoints/ folder) or in
    `path/checkpoints` (a run folder)."""
    return checkpoints_at(path, key)[-1]


def find_resume_point(cfg: Checkpoint, folder: Path, verify: Callable[[Path], str | None]) -> Path | None:
    """The checkpoint to resume from: the recipe's path, or with resume = auto the newest complete one in `folder`
    that passes `verify` (None, or what is wrong with a checkpoint; a damaged one is skipped with a warning)."""
    resume = cfg.resume
    if resume == "never":
        return None
    if resume != "auto":
        path = find_checkpoint(Path(resume), "checkpoint.resume")
        problem = verify(path)
        if problem:
            raise ConfigError(f"checkpoint {problem}; resume from another checkpoint")
        return path
    found = complete_checkpoints(folder)
    if cfg.load_step >= 0:
        if cfg.load_step not in found:
            raise ConfigError(
                f"checkpoint.load_step {cfg.load_step}: no complete checkpoint of that step in "
                f"{folder} (found: {sorted(found) or 'none'})"
            )
        problem = verify(found[cfg.load_step])
        if problem:
            raise ConfigError(f"checkpoint {problem}; choose another checkpoint.load_step")
        return found[cfg.load_step]
    for step in sorted(found, reverse=True):
        problem = verify(found[step])
        if problem is None:
            return found[step]
        log.warning("skipping damaged checkpoint %s", problem)
    return None


def check_model(path: Path, saved: dict, current: dict) -> None:
    """ConfigError unless the checkpoint's model ({"name", "flavor", "shapes"}) is the recipe's."""
    if saved["name"] != current["name"] or saved["shapes"] != current["shapes"]:
        differing = sorted(
            k
            for k in set(saved["shapes"]) | set(current["shapes"])
            if saved["shapes"].get(k) != current["shapes"].get(k)
        )
        raise ConfigError(
            f"checkpoint {path} holds a {saved['name']} {saved['flavor']} model that does not match this recipe's "
            f"{current['name']} {current['flavor']} ({len(differing)} parameters differ, e.g. {differing[:3]}); "
            "use a matching recipe, or checkpoint.resume = never to start fresh"
        )


def check_math(path: Path, train_state: dict, math_values: dict, allow_changes: list[str]) -> None:
    """ConfigError if the run's math-changing values (config.math_values and the prepared data's record)
    differ from those the checkpoint saved, but for the keys `allow_changes` names: those are logged."""
    saved = train_state.get("math")
    if not saved:
        return  # saved by a titan that did not record them
    if "data.prepared" in math_values and "data.prepared" not in saved:  # saved before titan recorded it
        unchecked = [key for key in math_values if key not in saved]
        log.warning(
            "checkpoint %s was saved by an older titan that did not record %s: not checked on this resume",
            path,
            ", ".join(unchecked),
        )
    refused, accepted = changed_keys(BEFORE_RECORDED | saved, math_values, allow_changes)
    if refused:
        keys = ",".join(change.split(" ")[0] for change in refused)
        raise ConfigError(
            f"the recipe or its data differ from checkpoint {path} in what changes the training math or the "
            f"tokens: {'; '.join(refused)}; restore them, or pass --checkpoint.allow_changes {keys} to resume "
            "with the new values"
        )
    for change in accepted:
        log.warning("resuming with a changed recipe (checkpoint.allow_changes): %s", change)


def read_tensors(path: Path, tensors: dict, group) -> None:
    """Fill `tensors` (parts of the state, keyed by parameter name) from the checkpoint at `path`, whatever layout
    saved it; `group` carries DCP's collectives (None for one process)."""
    CheckpointReader(path).read_metadata()  # a refused index gets its own message, not DCP's wrapping
    try:
        with single_process_quiet():
            dcp.load(
                tensors,
                storage_reader=CheckpointReader(path, progress=f"loading checkpoint {path.name}"),
                process_group=group,
                no_dist=group is None,
            )
    except (Exception, CheckpointException) as e:  # assorted errors on truncated or foreign files
        raise ConfigError(f"checkpoint {path} is corrupt or incomplete: {dcp_error(e)}") from None


def load_data_state(path: Path, loader) -> None:
    """The data loader's position from the checkpoint's data.json."""
    try:
        loader.load_state_dict(read_json(path / "data.json", DATA_STATE))
    except Invalid as e:
        raise ConfigError(f"checkpoint {path} is corrupt: {e}") from None
    except (OSError, ValueError, KeyError) as e:
        raise ConfigError(f"checkpoint {path} is corrupt: cannot read data.json ({e})") from None


def restore_lr_scheduler(optimizer, scheduler, state: dict) -> None:
    """The schedule's position from `state`; its shape (base lr, warmup, length) stays the recipe's, so a
    changed lr or step count applies from the resumed step on."""
    # The schedule's lambdas are code, not state: LambdaLR expects one placeholder per group.
    groups = optimizer.param_groups
    # Only the keys the scheduler has: LambdaLR sets every key it is given as an attribute of itself.
    own = scheduler.state_dict().keys() - {"lr_lambdas", "base_lrs", "_last_lr"}
    state = {k: v for k, v in state.items() if k in own}
    scheduler.load_state_dict({**state, "base_lrs": scheduler.base_lrs, "lr_lambdas": [None] * len(groups)})
    lrs = [base * fn(scheduler.last_epoch) for base, fn in zip(scheduler.base_lrs, scheduler.lr_lambdas)]
    for group, lr in zip(groups, lrs):
        group["lr"] = lr
    scheduler._last_lr = lrs


def set_aside_newer(folder: Path, step: int) -> None:
    """A run resumed at `step` with later checkpoints in its folder (checkpoint.load_step, or the later ones
    failed verification) goes on from there: the later ones belong to an abandoned future, so they move to
    checkpoints/rewound/ (kept for inspection, never resumed from by `auto`, never overwritten)."""
    newer = [p for s, p in complete_checkpoints(folder).items() if s > step]
    if not newer:
        return
    aside = folder / "rewound" / datetime.datetime.now().strftime(f"from-step-{step}-%Y%m%d-%H%M%S")
    aside.mkdir(parents=True, exist_ok=True)
    for path in newer:
        path.rename(aside / path.name)
    log.warning(
        "rewound to step %d: the later checkpoints %s (damaged, or chosen against by checkpoint.load_step) moved to %s",
        step,
        [p.name for p in newer],
        aside,
    )


def changed_keys(saved: dict, current: dict, allowed: list[str]) -> tuple[list[str], list[str]]:
    """(refused, allowed) descriptions of the math-changing keys whose values differ from the checkpoint's."""
    refused, accepted = [], []
    for key in current:
        if key in saved and saved[key] != current[key]:
            change = f"{key} {saved[key]!r} -> {current[key]!r}"
            ok = any(key == a or key.startswith(a + ".") for a in allowed)
            (accepted if ok else refused).append(change)
    return refused, accepted
