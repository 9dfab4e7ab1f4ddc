"""Checkpoints of the whole training state: sharded (DCP), atomic, verified, optionally async, reshardable on load.

Layout of one checkpoint, `<run>/checkpoints/step-N/` (titan/checkpoint/format/: why nothing in it is code):
    *.distcp, tensors.json  model weights and optimizer state, one shard file per rank (DCP), and their JSON index
    train_state.json        step, tokens seen, the step's loss, lr schedule, the model's parameter shapes, the
                            recipe's math-changing values with the prepared data's keys and document counts,
                            and the whole resolved recipe
    data.json               the data loader's position: the next global sample (the same on every rank)
    manifest.json           every other file's size and SHA-256
    COMPLETE                written last; a folder without it is never loaded
    NEXT_STEP_FINITE        added once the step after it ran healthy (finite, and no spike by replay.spike_zscore):
                            a checkpoint known to train on (last_good)

A checkpoint is written to `.tmp-step-N/`, fsynced and renamed when complete, so a crash at any moment leaves
the previous checkpoints untouched; a loaded checkpoint is first checked against its manifest. This module saves
and proves them (last_good); its storage (disk.py; snapshots/ for the in-memory ones) seals and prunes them;
resume.py resumes from one; train_state.py writes and reads train_state.json.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import shutil
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException  # a BaseException, not an Exception

from titan.checkpoint.disk import DiskStorage, Storage, last_good, prove
from titan.checkpoint.format import MARKER, CheckpointReader, CheckpointWriter, single_process_quiet, verify
from titan.checkpoint.resume import (
    PARTS,
    STEP_DIR,
    check_math,
    check_model,
    complete_checkpoints,
    find_resume_point,
    load_data_state,
    read_tensors,
    restore_lr_scheduler,
    set_aside_newer,
)
from titan.checkpoint.train_state import model_buffers, read_train_state, write_train_state
from titan.config import Checkpoint
from titan.errors import UserError
from titan.files import WRITE_ERRORS, write_error, write_synced
from titan.optim import ensure_optimizer_state

log = logging.getLogger("titan")


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
    """A checkpoint could not be written (full disk, read-only folder): the run stops, the saved ones are intact.
    `reason`: what the file system said."""

    def __init__(self, message: str, reason: str):
        super().__init__(message)
        self.reason = reason


@dataclass(frozen=True)
class RunRecord:
    """What a checkpoint records of the run besides its state, checked on resume: the whole model's {"name",
    "flavor", "shapes"}, the resolved recipe as TOML, and the recipe's math-changing values (config.math_values)
    with the record of the prepared data (titan.data.prepared_record)."""

    model: dict
    recipe: str
    math_values: dict = field(default_factory=dict)


class Checkpointer:
    """Saves and restores the training state it is given, plus what describes the run."""

    def __init__(
        self,
        cfg: Checkpoint,
        folder: Path,
        states: dict[str, Any],
        record: RunRecord,
        *,
        rank: int,
        save_group,
        control_group,
        storage: Storage | None = None,
    ):
        """states: the stateful parts by name: "model" (the ModelParts), "optimizer", "lr_scheduler", "data" (the
        loader: state_dict/load_state_dict), and optionally "plan" (the re-plan in force, saved in train_state.json).
        save_group carries DCP's collectives and control_group this class's barriers: separate gloo groups
        (None for one process), since an async save's collectives run on a background thread and must not
        interleave with the main thread's (on gloo that aborts the job or deadlocks). storage: where a save lands
        (default: a folder per checkpoint in `folder`, disk.DiskStorage)."""
        self.cfg, self.folder, self.states, self.record, self.rank = cfg, folder, states, record, rank
        self.save_group, self.control_group = save_group, control_group
        self.world = dist.get_world_size(control_group) if control_group is not None else 1
        self.storage = storage or DiskStorage(folder, cfg.keep_latest_k, rank, self.world, control_group)
        self.resumed_from: Path | None = None
        self.resumed_state: dict = {}  # the loaded train_state.json
        self._pending: tuple[Future | None, Path, Path] | None = None
        # The step of the checkpoint this run saved or resumed from whose next step has not run yet, and whether
        # that step ran healthy before the checkpoint's save was sealed (see step_ran).
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
                STEP_DIR.match(child.name) and not (child / MARKER).is_file()
            ):
                log.info("removing %s, left by an interrupted save", child)
                shutil.rmtree(child, ignore_errors=True)

    # -- what is saved -------------------------------------------------------------------------

    def tensor_state(self, parts: tuple[str, ...]) -> dict:
        """Model and optimizer tensors keyed by parameter name, so any layout can load them; the model's buffers
        that are state (a MoE's routing biases) with its parameters."""
        state = {}
        named, optimizer = list(self.states["model"].named_parameters()), self.states["optimizer"]
        if "model" in parts:
            state["model"] = {name: p for name, p in named}
            for part in self.states["model"].parts:
                state["model"].update(model_buffers(part))
        if "optimizer" in parts:
            missing = [name for name, p in named if p not in optimizer.state]
            if missing and len(missing) < len(named):
                # Some parameters are other tensors than those the optimizer stepped (e.g. FSDP left a module
                # unsharded): saving would write zeros for their state.
                raise RuntimeError(
                    f"parameters without optimizer state, e.g. {missing[:3]}; are FSDP modules resharded?"
                )
            ensure_optimizer_state(optimizer, [p for _, p in named])  # loading into it needs it to exist
            state["optimizer"] = {name: optimizer.state[p] for name, p in named}
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
                write_synced(tmp / "data.json", json.dumps(self.states["data"].state_dict()).encode())
                scheduler = {k: v for k, v in self.states["lr_scheduler"].state_dict().items() if k != "lr_lambdas"}
                write_train_state(
                    tmp,
                    step=step,
                    tokens_seen=tokens_seen,
                    loss=loss if math.isfinite(loss) else None,
                    lr_scheduler=scheduler,
                    model=self.record.model,
                    math=self.record.math_values,
                    recipe=self.record.recipe,
                    plan=self.states["plan"].state_dict() if "plan" in self.states else {},
                )
            state = self.tensor_state(("model", "optimizer"))
            no_dist = self.save_group is None
            background = self.cfg.async_save and not wait
            writer = CheckpointWriter(tmp, progress=None if background else f"{self.storage.kind} step {step}: saving")
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
        where = "writing in background" if self._pending else self.storage.where(final)
        log.info("%s step %d: %s (training blocked %.2fs)", self.storage.kind, step, where, blocked)
        return {"checkpoint_blocked_s": blocked}

    def _save_error(self, e: BaseException, step: int) -> BaseException:
        cause = _cause(e)
        if cause is None or cause.errno not in WRITE_ERRORS:
            return e
        good, reason = complete_checkpoints(self.folder), write_error(cause)
        return SaveError(
            f"checkpoint step {step}: {reason}; free space or set job.output_dir elsewhere "
            f"(the last complete checkpoint, {good[max(good)] if good else 'none'}, is intact)",
            reason,
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
            self.storage.seal(tmp, final, proven)
        except (OSError, CheckpointException) as e:
            raise self._save_error(e, int(final.name.removeprefix("step-"))) from None
        self._barrier()

    def step_ran(self, step: int, healthy: bool) -> None:
        """Step `step` ran, healthy or not (every rank calls this, in step order). Its loss and gradient norm were
        computed from the weights of checkpoint `step - 1`, if this run saved or resumed from one: healthy (finite,
        and no spike by the run's spike rule), they prove it good (last_good), whatever came of the update. A save
        still in flight is proven once sealed. (Step `step - 1`'s own loss says nothing of the weights its update
        produced.)"""
        if self._unproven != step - 1:
            return
        self._unproven = None
        if not healthy:
            return
        if self._pending is not None and self._pending[2].name == f"step-{step - 1}":
            self._prove_when_sealed = True
        elif self.rank == 0:
            prove(self.folder / f"step-{step - 1}")

    def last_good(self) -> Path | None:
        """The newest checkpoint known good (disk.last_good)."""
        return last_good(self.folder)

    def _barrier(self) -> None:
        if self.control_group is not None:
            dist.barrier(group=self.control_group)

    # -- loading -------------------------------------------------------------------------------

    def _verify(self, path: Path) -> str | None:
        if not self.cfg.verify:
            return None
        return verify(path, self.rank, self.world, self.control_group)

    def load(self, path: Path, parts: tuple[str, ...]) -> int:
        """Load `parts` of the checkpoint at `path`; returns the step to continue from."""
        train_state = read_train_state(path)
        check_model(path, train_state["model"], self.record.model)
        if "train_state" in parts:
            check_math(path, train_state, self.record.math_values, self.cfg.allow_changes)
        tensors = self.tensor_state(tuple(p for p in parts if p in ("model", "optimizer")))
        if tensors:
            read_tensors(path, tensors, self.save_group)
        step = train_state["step"] if "train_state" in parts else 0
        if "train_state" in parts:
            if "plan" in self.states:
                self.states["plan"].load_state_dict(train_state.get("plan", {}))
            self.resumed_state = train_state
        if "lr_scheduler" in parts:
            self.restore_lr_scheduler(train_state["lr_scheduler"])
        if "data" in parts:
            load_data_state(path, self.states["data"])
        log.info("resumed from %s: %s; continuing at step %d", path, ", ".join(parts), step)
        self.resumed_from = path
        if path.parent.resolve() == self.folder.resolve():
            if "train_state" in parts:
                self._unproven = step  # the step it resumes at proves it, as for a checkpoint this run saved
            if self.rank == 0:
                set_aside_newer(self.folder, step)
        return step

    def restore_lr_scheduler(self, state: dict) -> None:
        """The schedule's position from `state` (resume.restore_lr_scheduler)."""
        restore_lr_scheduler(self.states["optimizer"], self.states["lr_scheduler"], state)

    # -- moving the state to rebuilt parts (a pipeline re-split) -------------------------------

    def save_tensors(self, folder: Path) -> None:
        """The model and optimizer tensors into `folder`, for load_tensors after the parts are rebuilt."""
        state, group = self.tensor_state(("model", "optimizer")), self.save_group
        dcp.save(state, storage_writer=CheckpointWriter(folder), process_group=group, no_dist=group is None)

    def rebind(self, **states) -> None:
        """Save and restore these stateful parts from now on (rebuilt ones, by name), here and in every
        checkpointer made with `beside`."""
        self.states.update(states)

    def beside(self, cfg: Checkpoint, folder: Path, storage: Storage) -> Checkpointer:
        """A checkpointer of the same states (rebound with this one) and run record, saving into `storage`."""
        groups = {"save_group": self.save_group, "control_group": self.control_group}
        return Checkpointer(cfg, folder, self.states, self.record, rank=self.rank, **groups, storage=storage)

    def load_tensors(self, folder: Path) -> None:
        state, group = self.tensor_state(("model", "optimizer")), self.save_group
        reader = CheckpointReader(folder, sealed=False)
        dcp.load(state, storage_reader=reader, process_group=group, no_dist=group is None)
        self._barrier()  # every rank has read it
        if self.rank == 0:
            shutil.rmtree(folder, ignore_errors=True)

    def resume(self, restarted: bool = False) -> int:
        """Load what the recipe asks for; returns the step to start from (0 for a fresh start). restarted: an
        elastic restart of this run, which continues from its own newest checkpoint, whole, once it saved one,
        whatever checkpoint.resume, load_step and load_only chose for its first start."""
        cfg = self.cfg
        if restarted and complete_checkpoints(self.folder):
            cfg = dataclasses.replace(cfg, resume="auto", load_step=-1, load_only=[])
        path = find_resume_point(cfg, self.folder, self._verify)
        if path is None:
            if cfg.resume == "auto":
                log.info("no checkpoint in %s: starting from step 0", self.folder)
            return 0
        return self.load(path, tuple(cfg.load_only) or PARTS)
