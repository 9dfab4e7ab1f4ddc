"""Checkpoints of the whole training state: sharded (DCP), atomic, verified, optionally async, reshardable on load.

Layout of one checkpoint, `<run>/checkpoints/step-N/` (titan/checkpoint/format.py: why nothing in it is code):
    *.distcp, tensors.json  model weights and optimizer state, one shard file per rank (DCP), and their JSON index
    train_state.json        step, tokens seen, the step's loss, lr schedule, the model's parameter shapes, the
                            recipe's math-changing values with the prepared data's keys and document counts,
                            and the whole resolved recipe
    data.json               the data loader's position: the next global sample (the same on every rank)
    manifest.json           every other file's size and SHA-256
    COMPLETE                written last; a folder without it is never loaded
    NEXT_STEP_FINITE        added once the step after it ran finite: a checkpoint known to train on (last_good)

A checkpoint is written to `.tmp-step-N/`, fsynced and renamed when complete, so a crash at any moment leaves
the previous checkpoints untouched; a loaded checkpoint is first checked against its manifest.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import logging
import math
import re
import shutil
import time
import warnings
from concurrent.futures import Future
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException  # a BaseException, not an Exception

from titan.checkpoint.format import (
    MARKER,
    PROVEN,
    CheckpointReader,
    CheckpointWriter,
    dcp_error,
    seal,
    sha256_files,
    verify,
)
from titan.config import LAYOUT_SPEC, Checkpoint
from titan.errors import ConfigError, UserError
from titan.files import WRITE_ERRORS, fsync, write_error, write_synced
from titan.optim import ensure_adamw_state
from titan.schema import Anything, Flag, Integer, Invalid, ListOf, MapOf, Number, Table, Text, optional, read_json

log = logging.getLogger("titan")
PARTS = ("model", "optimizer", "lr_scheduler", "data", "train_state")
_STEP_DIR = re.compile(r"^step-(\d+)$")


@contextlib.contextmanager
def single_process_quiet():
    """DCP warns that it assumes a single process when torch.distributed is not initialised: that is the intent."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        yield


def complete_checkpoints(folder: Path) -> dict[int, Path]:
    """step -> folder of every complete checkpoint under `folder`."""
    if not folder.is_dir():
        return {}
    found = {}
    for child in folder.iterdir():
        match = _STEP_DIR.match(child.name)
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


def model_shapes(spec, args) -> dict[str, list[int]]:
    """Every parameter's shape, by name, for the whole model (a tied head once): what train_state.json
    records, so every layout, and the HF import, describe a model alike."""
    with torch.device("meta"):
        model = spec.build(args)
    return {name: list(p.shape) for name, p in model.named_parameters()}


# -- what a checkpoint holds besides tensors --------------------------------------------------------


def write_train_state(
    folder: Path, *, step: int, tokens_seen: int, lr_scheduler: dict, model: dict, recipe: str, **extra
) -> None:
    """train_state.json. model: {"name", "flavor", "shapes"}; recipe: the resolved recipe as TOML."""
    state = {
        "step": step,
        "tokens_seen": tokens_seen,
        "lr_scheduler": lr_scheduler,
        "model": model,
        "recipe": recipe,
        **extra,
    }
    write_synced(folder / "train_state.json", json.dumps(state, indent=1).encode())


# train_state.json and data.json as titan reads them back (titan/schema.py): anything else is a corrupt checkpoint.
_SCHEDULER = {
    "last_epoch": Integer(-1),
    "_step_count": Integer(),
    "_is_initial": Flag(),
    "_get_lr_called_within_step": Flag(),
    "base_lrs": ListOf(Number()),
    "_last_lr": ListOf(Number()),
}
_PLAN = {
    "dp_weights": ListOf(Number(0, above=True)),
    "pp_layers_per_stage": ListOf(Integer(1)),
    "measured_on": Table({"layout": LAYOUT_SPEC, "devices": ListOf(Text())}, required=frozenset({"layout", "devices"})),
    "recipe": MapOf(Anything()),
}
TRAIN_STATE = Table(
    {
        "step": Integer(),
        "tokens_seen": Integer(),
        "loss": optional(Number(finite=False)),  # None when the step's loss was not finite
        "lr_scheduler": Table(_SCHEDULER),
        "model": Table(
            {"name": Text(), "flavor": Text(), "shapes": MapOf(ListOf(Integer(), most=8))},
            required=frozenset({"name", "flavor", "shapes"}),
        ),
        "recipe": Text(),  # the resolved recipe as TOML; its sections are checked where read (config.saved_section)
        "math": MapOf(Anything()),
        "plan": Table(_PLAN),
    },
    required=frozenset({"step", "lr_scheduler", "model", "recipe"}),
)
DATA_STATE = Table(
    {key: Integer() for key in ("next_sample", "next_token", "next_piece")}
    | {key: Integer(1) for key in ("global_batch", "budget", "order")},
)


def read_train_state(path: Path) -> dict:
    """train_state.json, checked against TRAIN_STATE: ConfigError naming the field otherwise."""
    try:
        return read_json(path / "train_state.json", TRAIN_STATE)
    except OSError as e:
        raise ConfigError(f"checkpoint {path} is corrupt: cannot read train_state.json ({e.strerror})") from None
    except ValueError as e:
        raise ConfigError(f"checkpoint {path} is corrupt: {e}") from None


def changed_keys(saved: dict, current: dict, allowed: list[str]) -> tuple[list[str], list[str]]:
    """(refused, allowed) descriptions of the math-changing keys whose values differ from the checkpoint's."""
    refused, accepted = [], []
    for key in current:
        if key in saved and saved[key] != current[key]:
            change = f"{key} {saved[key]!r} -> {current[key]!r}"
            ok = any(key == a or key.startswith(a + ".") for a in allowed)
            (accepted if ok else refused).append(change)
    return refused, accepted


def _cause(e: BaseException) -> OSError | None:
    """The OSError behind a failed save (DCP wraps each rank's error in a CheckpointException)."""
    seen = set()
    stack = [e]
    while stack:
        e = stack.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno is not None:
            return e
        failures = getattr(e, "failures", None)
        if isinstance(failures, dict):  # DCP's: {rank: (exception, its stack summary)}
            stack.extend(v[0] if isinstance(v, tuple) else v for v in failures.values())
        stack.extend([e.__cause__, e.__context__])
        stack.extend(a for a in getattr(e, "args", ()) if isinstance(a, BaseException))
    return None


class SaveError(UserError):
    """A checkpoint could not be written (full disk, read-only folder): the run stops, the saved ones are intact."""


class Checkpointer:
    """Saves and restores the training state it is given: the model parts, the optimizer, the lr schedule
    and the data loader (anything with state_dict/load_state_dict), plus what describes the run."""

    def __init__(
        self,
        cfg: Checkpoint,
        folder: Path,
        *,
        model_parts,
        optimizer,
        lr_scheduler,
        loader,
        model: dict,
        recipe: str,
        rank: int,
        save_group,
        control_group,
        replan=None,
        math_values: dict | None = None,
    ):
        """model: {"name", "flavor", "shapes"} of the whole model; recipe: the resolved recipe as TOML;
        replan: the re-plan in force (state_dict/load_state_dict), saved in train_state.json as `plan`;
        math_values: the recipe's math-changing values (config.math_values) and the record of the prepared data
        (titan.data.prepared_record), compared on resume.
        save_group carries DCP's collectives and control_group this class's barriers: separate gloo groups
        (None for one process), since an async save's collectives run on a background thread and must not
        interleave with the main thread's (on gloo that aborts the job or deadlocks)."""
        self.cfg, self.folder = cfg, folder
        self.model_parts, self.optimizer, self.lr_scheduler, self.loader = model_parts, optimizer, lr_scheduler, loader
        self.model, self.recipe, self.rank = model, recipe, rank
        self.save_group, self.control_group = save_group, control_group
        self.world = dist.get_world_size(control_group) if control_group is not None else 1
        self.replan = replan
        self.math_values = math_values or {}
        self.resumed_from: Path | None = None
        self.resumed_state: dict = {}  # the loaded train_state.json
        self._pending: tuple[Future | None, Path, Path] | None = None
        # The step of the checkpoint this run saved or resumed from whose next step has not run yet, and whether
        # that step ran finite before the checkpoint's save was sealed (see step_ran).
        self._unproven: int | None = None
        self._prove_when_sealed = False
        if self.rank == 0:
            self._tidy()
        self._barrier()

    def _tidy(self) -> None:
        """Clear what interrupted saves left (the caller owns the run folder): temporary and incomplete
        folders go; a checkpoint that was being replaced comes back if its replacement never landed."""
        if not self.folder.is_dir():
            return
        for child in sorted(self.folder.iterdir()):
            if child.name.startswith(".replaced-"):
                final = self.folder / child.name.removeprefix(".replaced-")
                if (final / MARKER).is_file():
                    shutil.rmtree(child, ignore_errors=True)
                else:
                    shutil.rmtree(final, ignore_errors=True)
                    child.rename(final)
            elif child.name.startswith((".tmp-step-", ".resplit-step-", ".pruned-")) or (
                _STEP_DIR.match(child.name) and not (child / MARKER).is_file()
            ):
                log.info("removing %s, left by an interrupted save", child)
                shutil.rmtree(child, ignore_errors=True)

    # -- what is saved -------------------------------------------------------------------------

    def _tensor_state(self, parts: tuple[str, ...]) -> dict:
        """Model and optimizer tensors keyed by parameter name, so any layout can load them."""
        state = {}
        named = list(self.model_parts.named_parameters())
        if "model" in parts:
            state["model"] = {name: p for name, p in named}
        if "optimizer" in parts:
            missing = [name for name, p in named if p not in self.optimizer.state]
            if missing and len(missing) < len(named):
                # Some parameters are other tensors than those the optimizer stepped (e.g. FSDP left a module
                # unsharded): saving would write zeros for their state.
                raise RuntimeError(
                    f"parameters without optimizer state, e.g. {missing[:3]}; are FSDP modules resharded?"
                )
            ensure_adamw_state(self.optimizer, [p for _, p in named])  # loading into it needs it to exist
            state["optimizer"] = {name: self.optimizer.state[p] for name, p in named}
        return state

    # -- saving --------------------------------------------------------------------------------

    def due(self, step: int, final: bool = False) -> bool:
        """Whether a checkpoint is to be saved at this step."""
        return self.cfg.enable and (final or step % self.cfg.interval == 0)

    def save(self, step: int, tokens_seen: int, loss: float, wait: bool = False) -> dict:
        """Save (in the background with async_save, unless `wait`); returns the metrics to log. An existing
        checkpoint of the same step is replaced once the new one is complete."""
        self.finish_pending()  # one save in flight at a time
        self._unproven, self._prove_when_sealed = step, False
        final, tmp = self.folder / f"step-{step}", self.folder / f".tmp-step-{step}"
        start = time.perf_counter()
        try:
            if self.rank == 0:
                shutil.rmtree(tmp, ignore_errors=True)
                tmp.mkdir(parents=True)
            self._barrier()
            if self.rank == 0:
                write_synced(tmp / "data.json", json.dumps(self.loader.state_dict()).encode())
                scheduler = {k: v for k, v in self.lr_scheduler.state_dict().items() if k != "lr_lambdas"}
                write_train_state(
                    tmp,
                    step=step,
                    tokens_seen=tokens_seen,
                    loss=loss if math.isfinite(loss) else None,
                    lr_scheduler=scheduler,
                    model=self.model,
                    math=self.math_values,
                    recipe=self.recipe,
                    plan=self.replan.state_dict() if self.replan else {},
                )
            state = self._tensor_state(("model", "optimizer"))
            no_dist = self.save_group is None
            background = self.cfg.async_save and not wait
            writer = CheckpointWriter(tmp, progress=None if background else f"checkpoint step {step}: saving")
            if background:
                future = dcp.async_save(state, storage_writer=writer, process_group=self.save_group, no_dist=no_dist)
                self._pending = (future, tmp, final)
            else:
                with single_process_quiet():
                    dcp.save(state, storage_writer=writer, process_group=self.save_group, no_dist=no_dist)
                self._pending = (None, tmp, final)
                self.finish_pending()
        except (OSError, CheckpointException) as e:
            raise self._save_error(e, step) from None
        blocked = time.perf_counter() - start
        log.info(
            "checkpoint step %d: %s (training blocked %.2fs)",
            step,
            "writing in background" if self._pending else final,
            blocked,
        )
        return {"checkpoint_blocked_s": blocked}

    def _save_error(self, e: BaseException, step: int) -> BaseException:
        cause = _cause(e)
        if cause is None or cause.errno not in WRITE_ERRORS:
            return e
        good = complete_checkpoints(self.folder)
        return SaveError(
            f"checkpoint step {step}: {write_error(cause)}; free space or set job.output_dir elsewhere "
            f"(the last complete checkpoint, {good[max(good)] if good else 'none'}, is intact)"
        )

    def finish_pending(self) -> None:
        """Wait for the save in flight, then seal it (manifest, COMPLETE, fsync), make it visible and prune."""
        if self._pending is None:
            return
        future, tmp, final = self._pending
        self._pending = None
        proven, self._prove_when_sealed = self._prove_when_sealed, False
        try:
            if future is not None:
                future.result()
            self._barrier()
            self._seal(tmp, final, proven)
        except (OSError, CheckpointException) as e:
            raise self._save_error(e, int(final.name.removeprefix("step-"))) from None
        self._barrier()

    def _seal(self, tmp: Path, final: Path, proven: bool) -> None:
        # Every rank hashes its share of the files (a shared file system, as the rename below needs already).
        names = sorted(p.name for p in tmp.iterdir() if p.is_file())
        mine = sha256_files(tmp, names[self.rank :: self.world])
        if self.control_group is not None:
            shares: list = [None] * self.world
            dist.all_gather_object(shares, mine, group=self.control_group)
            mine = {name: entry for share in shares for name, entry in share.items()}
        if self.rank != 0:
            return
        seal(tmp, mine)
        replaced = final.with_name(".replaced-" + final.name)
        if final.exists():  # a rewound run saving a step again: the old one goes once the new one is in place
            final.rename(replaced)
        tmp.rename(final)  # atomic: the checkpoint appears complete or not at all
        fsync(self.folder)
        shutil.rmtree(replaced, ignore_errors=True)
        if proven:
            self._prove(final)
        self._prune()

    def step_ran(self, step: int, finite: bool) -> None:
        """Step `step` ran, finite or not (every rank calls this, in step order). Its loss and gradient norm were
        computed from the weights of checkpoint `step - 1`, if this run saved or resumed from one: finite, they
        prove it good (last_good), whatever came of the update. A save still in flight is proven once sealed.
        (Step `step - 1`'s own loss says nothing of the weights its update produced.)"""
        if self._unproven != step - 1:
            return
        self._unproven = None
        if not finite:
            return
        if self._pending is not None and self._pending[2].name == f"step-{step - 1}":
            self._prove_when_sealed = True
        elif self.rank == 0:
            self._prove(self.folder / f"step-{step - 1}")

    def _prove(self, path: Path) -> None:
        # An empty file outside the manifest: created or not, the checkpoint stays whole and verifiable.
        write_synced(path / PROVEN, b"")
        fsync(path)

    def last_good(self) -> Path | None:
        """The newest complete checkpoint whose next step ran finite: resuming from it does not meet the same NaN.
        (The final step's checkpoint, whose next step never ran, is not one until a later run proves it.)"""
        for path in reversed(complete_checkpoints(self.folder).values()):
            if (path / PROVEN).is_file():
                return path
        return None

    def _prune(self) -> None:
        """Keep the newest keep_latest_k checkpoints, and always the last good one."""
        if not self.cfg.keep_latest_k:
            return
        found = list(complete_checkpoints(self.folder).values())
        keep = {*found[-self.cfg.keep_latest_k :], self.last_good()}
        for old in found:
            if old not in keep:
                doomed = old.with_name(".pruned-" + old.name)  # renamed first: never a half-deleted "complete" one
                old.rename(doomed)
                shutil.rmtree(doomed, ignore_errors=True)

    def _barrier(self) -> None:
        if self.control_group is not None:
            dist.barrier(group=self.control_group)

    # -- loading -------------------------------------------------------------------------------

    def _verify(self, path: Path) -> str | None:
        if not self.cfg.verify:
            return None
        return verify(path, self.rank, self.world, self.control_group)

    def find_resume_point(self) -> Path | None:
        """The checkpoint to resume from: the recipe's path, or with resume = auto the newest complete one that
        passes verification (a damaged one is skipped with a warning)."""
        resume = self.cfg.resume
        if resume == "never":
            return None
        if resume != "auto":
            path = find_checkpoint(Path(resume), "checkpoint.resume")
            problem = self._verify(path)
            if problem:
                raise ConfigError(f"checkpoint {problem}; resume from another checkpoint")
            return path
        found = complete_checkpoints(self.folder)
        if self.cfg.load_step >= 0:
            if self.cfg.load_step not in found:
                raise ConfigError(
                    f"checkpoint.load_step {self.cfg.load_step}: no complete checkpoint of that step in "
                    f"{self.folder} (found: {sorted(found) or 'none'})"
                )
            problem = self._verify(found[self.cfg.load_step])
            if problem:
                raise ConfigError(f"checkpoint {problem}; choose another checkpoint.load_step")
            return found[self.cfg.load_step]
        for step in sorted(found, reverse=True):
            problem = self._verify(found[step])
            if problem is None:
                return found[step]
            log.warning("skipping damaged checkpoint %s", problem)
        return None

    def load(self, path: Path, parts: tuple[str, ...]) -> int:
        """Load `parts` of the checkpoint at `path`; returns the step to continue from."""
        train_state = read_train_state(path)
        self._check_model(path, train_state["model"])
        if "train_state" in parts:
            self._check_math(path, train_state)
        tensors = self._tensor_state(tuple(p for p in parts if p in ("model", "optimizer")))
        if tensors:
            CheckpointReader(path).read_metadata()  # a refused index gets its own message, not DCP's wrapping
            try:
                with single_process_quiet():
                    dcp.load(
                        tensors,
                        storage_reader=CheckpointReader(path, progress=f"loading checkpoint {path.name}"),
                        process_group=self.save_group,
                        no_dist=self.save_group is None,
                    )
            except (Exception, CheckpointException) as e:  # assorted errors on truncated or foreign files
                raise ConfigError(f"checkpoint {path} is corrupt or incomplete: {dcp_error(e)}") from None
        step = train_state["step"] if "train_state" in parts else 0
        if "train_state" in parts:
            if self.replan:
                self.replan.load_state_dict(train_state.get("plan", {}))
            self.resumed_state = train_state
        if "lr_scheduler" in parts:
            self.restore_lr_scheduler(train_state["lr_scheduler"])
        if "data" in parts:
            try:
                self.loader.load_state_dict(read_json(path / "data.json", DATA_STATE))
            except Invalid as e:
                raise ConfigError(f"checkpoint {path} is corrupt: {e}") from None
            except (OSError, ValueError, KeyError) as e:
                raise ConfigError(f"checkpoint {path} is corrupt: cannot read data.json ({e})") from None
        log.info("resumed from %s: %s; continuing at step %d", path, ", ".join(parts), step)
        self.resumed_from = path
        if path.parent.resolve() == self.folder.resolve():
            if "train_state" in parts:
                self._unproven = step  # the step it resumes at proves it, as for a checkpoint this run saved
            if self.rank == 0:
                self._set_aside_newer(step)
        return step

    def _set_aside_newer(self, step: int) -> None:
        """A run resumed at `step` with later checkpoints in its folder (checkpoint.load_step, or the later ones
        failed verification) goes on from there: the later ones belong to an abandoned future, so they move to
        checkpoints/rewound/ (kept for inspection, never resumed from by `auto`, never overwritten)."""
        newer = [p for s, p in complete_checkpoints(self.folder).items() if s > step]
        if not newer:
            return
        aside = self.folder / "rewound" / datetime.datetime.now().strftime(f"from-step-{step}-%Y%m%d-%H%M%S")
        aside.mkdir(parents=True, exist_ok=True)
        for path in newer:
            path.rename(aside / path.name)
        log.warning(
            "rewound to step %d: the later checkpoints %s (damaged, or chosen against by checkpoint.load_step) "
            "moved to %s",
            step,
            [p.name for p in newer],
            aside,
        )

    def _check_math(self, path: Path, train_state: dict) -> None:
        saved = train_state.get("math")
        if not saved:
            return  # saved by a titan that did not record them
        if "data.prepared" in self.math_values and "data.prepared" not in saved:  # saved before titan recorded it
            unchecked = [key for key in self.math_values if key not in saved]
            log.warning(
                "checkpoint %s was saved by an older titan that did not record %s: not checked on this resume",
                path,
                ", ".join(unchecked),
            )
        refused, accepted = changed_keys(saved, self.math_values, self.cfg.allow_changes)
        if refused:
            keys = ",".join(change.split(" ")[0] for change in refused)
            raise ConfigError(
                f"the recipe or its data differ from checkpoint {path} in what changes the training math or the "
                f"tokens: {'; '.join(refused)}; restore them, or pass --checkpoint.allow_changes {keys} to resume "
                "with the new values"
            )
        for change in accepted:
            log.warning("resuming with a changed recipe (checkpoint.allow_changes): %s", change)

    def restore_lr_scheduler(self, state: dict) -> None:
        """The schedule's position from `state`; its shape (base lr, warmup, length) stays the recipe's, so a
        changed lr or step count applies from the resumed step on."""
        # The schedule's lambdas are code, not state: LambdaLR expects one placeholder per group.
        groups, scheduler = self.optimizer.param_groups, self.lr_scheduler
        # Only the keys the scheduler has: LambdaLR sets every key it is given as an attribute of itself.
        own = scheduler.state_dict().keys() - {"lr_lambdas", "base_lrs", "_last_lr"}
        state = {k: v for k, v in state.items() if k in own}
        scheduler.load_state_dict({**state, "base_lrs": scheduler.base_lrs, "lr_lambdas": [None] * len(groups)})
        lrs = [base * fn(scheduler.last_epoch) for base, fn in zip(scheduler.base_lrs, scheduler.lr_lambdas)]
        for group, lr in zip(groups, lrs):
            group["lr"] = lr
        scheduler._last_lr = lrs

    # -- moving the state to rebuilt parts (a pipeline re-split) -------------------------------

    def save_tensors(self, folder: Path) -> None:
        """The model and optimizer tensors into `folder`, for load_tensors after the parts are rebuilt."""
        dcp.save(self._tensor_state(("model", "optimizer")), storage_writer=CheckpointWriter(folder),
                 process_group=self.save_group, no_dist=self.save_group is None)  # fmt: skip

    def rebind(self, model_parts, optimizer, lr_scheduler) -> None:
        self.model_parts, self.optimizer, self.lr_scheduler = model_parts, optimizer, lr_scheduler

    def load_tensors(self, folder: Path) -> None:
        dcp.load(self._tensor_state(("model", "optimizer")), storage_reader=CheckpointReader(folder, sealed=False),
                 process_group=self.save_group, no_dist=self.save_group is None)  # fmt: skip
        self._barrier()  # every rank has read it
        if self.rank == 0:
            shutil.rmtree(folder, ignore_errors=True)

    def _check_model(self, path: Path, saved: dict) -> None:
        current = self.model
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

    def resume(self) -> int:
        """Load what the recipe asks for; returns the step to start from (0 for a fresh start)."""
        path = self.find_resume_point()
        if path is None:
            if self.cfg.resume == "auto":
                log.info("no checkpoint in %s: starting from step 0", self.folder)
            return 0
        return self.load(path, tuple(self.cfg.load_only) or PARTS)
