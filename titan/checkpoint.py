"""Checkpoints of the whole training state: sharded (DCP), atomic, optionally async, reshardable on load.

Layout of one checkpoint, `<run>/checkpoints/step-N/`:
    *.distcp, .metadata     model weights and optimizer state, one shard file per rank (DCP)
    train_state.json        step, tokens seen, lr schedule, the model's parameter shapes, the resolved recipe
    data.json               the data loader's position: the next global sample (the same on every rank)
    COMPLETE                written last; a folder without it is never loaded

A checkpoint is written to `.tmp-step-N/` and renamed when complete, so a crash at any moment leaves the
previous checkpoints untouched. Nothing here unpickles: tensors come through DCP, the rest is JSON.
"""

from __future__ import annotations

import json
import logging
import pickle
import re
import shutil
import time
from concurrent.futures import Future
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException  # a BaseException, not an Exception
from torch.distributed.checkpoint.metadata import StorageMeta

from titan.config import Checkpoint, ConfigError
from titan.optim import ensure_adamw_state

log = logging.getLogger("titan")
MARKER = "COMPLETE"
PARTS = ("model", "optimizer", "lr_scheduler", "data", "train_state")
_STEP_DIR = re.compile(r"^step-(\d+)$")


class _MetadataUnpickler(pickle.Unpickler):
    """Admits only what DCP's .metadata holds: its metadata classes, torch sizes, dtypes and layouts, paths."""

    _SAFE = {
        ("torch", "Size"),
        ("torch.serialization", "_get_layout"),
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
        ("pathlib", "PosixPath"),
        ("pathlib", "PurePosixPath"),
        ("collections", "OrderedDict"),
    }

    def find_class(self, module: str, name: str):
        if (
            (module, name) in self._SAFE
            or module == "torch.distributed.checkpoint.metadata"
            or (module == "torch" and isinstance(getattr(torch, name, None), torch.dtype))
        ):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not part of a DCP checkpoint's metadata")


class TrustedReader(dcp.FileSystemReader):
    """DCP's file reader with a restricted unpickler for .metadata. DCP reads that file with plain pickle,
    so a checkpoint someone shares could run code on resume or conversion; titan admits only the classes
    DCP's metadata is made of and refuses the checkpoint otherwise. (The tensor files are read by DCP
    with torch.load(weights_only=True) already.)"""

    def read_metadata(self, *args, **kwargs):
        path = self._get_metadata_path(kwargs.get("rank"))
        try:
            with self.fs.create_stream(path, "rb") as f:
                metadata = _MetadataUnpickler(f).load()
        except pickle.UnpicklingError as e:
            raise ConfigError(f"checkpoint {self.path} is not trusted: its .metadata asks for {e}") from None
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


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


def find_checkpoint(path: Path, key: str = "checkpoint") -> Path:
    """A complete checkpoint folder as given, else the newest in `path` (a checkpoints/ folder) or in
    `path/checkpoints` (a run folder). `key` names what the user set, for the error."""
    path = Path(path)
    if (path / MARKER).is_file():
        return path
    for folder in (path, path / "checkpoints"):
        found = complete_checkpoints(folder)
        if found:
            return found[max(found)]
    what = (
        "does not exist"
        if not path.exists()
        else f"is not a complete titan checkpoint (no {MARKER} marker), nor a folder of them"
    )
    raise ConfigError(f"{key}: {path} {what}")


def model_shapes(spec, args) -> dict[str, list[int]]:
    """Every parameter's shape, by name, for the whole model (a tied head once): what train_state.json
    records, so every layout, and the HF import, describe a model alike."""
    with torch.device("meta"):
        model = spec.build(args)
    return {name: list(p.shape) for name, p in model.named_parameters()}


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
    (folder / "train_state.json").write_text(json.dumps(state, indent=1))


def read_train_state(path: Path) -> dict:
    try:
        state = json.loads((path / "train_state.json").read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(f"checkpoint {path} is corrupt: cannot read train_state.json ({e})") from None
    if not isinstance(state, dict) or not {"step", "model", "recipe"} <= state.keys():
        raise ConfigError(f"checkpoint {path} is corrupt: train_state.json lacks the step, model or recipe")
    return state


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
        plan: dict | None = None,
    ):
        """model: {"name", "flavor", "shapes"} of the whole model; recipe: the resolved recipe as TOML;
        plan: the re-planned shares and splits in force (a dict the trainer updates), restored in place.
        save_group carries DCP's collectives and control_group this class's barriers: separate gloo groups
        (None for one process), since an async save's collectives run on a background thread and must not
        interleave with the main thread's (on gloo that aborts the job or deadlocks)."""
        self.cfg, self.folder = cfg, folder
        self.model_parts, self.optimizer, self.lr_scheduler, self.loader = model_parts, optimizer, lr_scheduler, loader
        self.model, self.recipe, self.rank = model, recipe, rank
        self.save_group, self.control_group = save_group, control_group
        self.plan = {} if plan is None else plan
        self.resumed_from: Path | None = None
        self._pending: tuple[Future, Path, Path] | None = None
        if self.rank == 0 and self.folder.is_dir():
            for stale in self.folder.glob(".tmp-step-*"):  # left by a crash during a save
                shutil.rmtree(stale, ignore_errors=True)

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

    def maybe_save(self, step: int, tokens_seen: int, final: bool = False) -> dict | None:
        if self.cfg.enable and (final or step % self.cfg.interval == 0):
            return self.save(step, tokens_seen, wait=final)
        return None

    def save(self, step: int, tokens_seen: int, wait: bool = False) -> dict | None:
        """Save (in the background with async_save, unless `wait`); returns the metrics to log, None if skipped."""
        self.finish_pending()  # one save in flight at a time
        final, tmp = self.folder / f"step-{step}", self.folder / f".tmp-step-{step}"
        if final.exists():
            return None
        start = time.perf_counter()
        if self.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        self._barrier()
        if self.rank == 0:
            (tmp / "data.json").write_text(json.dumps(self.loader.state_dict()))
            scheduler = {k: v for k, v in self.lr_scheduler.state_dict().items() if k != "lr_lambdas"}
            write_train_state(
                tmp,
                step=step,
                tokens_seen=tokens_seen,
                lr_scheduler=scheduler,
                model=self.model,
                recipe=self.recipe,
                plan=self.plan,
            )
        state = self._tensor_state(("model", "optimizer"))
        no_dist = self.save_group is None
        if self.cfg.async_save and not wait:
            self._pending = (
                dcp.async_save(state, checkpoint_id=str(tmp), process_group=self.save_group, no_dist=no_dist),
                tmp,
                final,
            )
        else:
            dcp.save(state, checkpoint_id=str(tmp), process_group=self.save_group, no_dist=no_dist)
            self._pending = (None, tmp, final)
            self.finish_pending()
        blocked = time.perf_counter() - start
        log.info(
            "checkpoint step %d: %s (training blocked %.2fs)",
            step,
            "writing in background" if self._pending else final,
            blocked,
        )
        return {"checkpoint_blocked_s": blocked}

    def finish_pending(self) -> None:
        """Wait for the save in flight, then make it visible and prune old ones."""
        if self._pending is None:
            return
        future, tmp, final = self._pending
        self._pending = None
        if future is not None:
            future.result()
        self._barrier()
        if self.rank == 0:
            (tmp / MARKER).write_text("")
            tmp.rename(final)  # atomic: the checkpoint appears complete or not at all
            if self.cfg.keep_latest_k:
                for old in list(complete_checkpoints(self.folder).values())[: -self.cfg.keep_latest_k]:
                    shutil.rmtree(old, ignore_errors=True)
        self._barrier()

    def _barrier(self) -> None:
        if self.control_group is not None:
            dist.barrier(group=self.control_group)

    # -- loading -------------------------------------------------------------------------------

    def find_resume_point(self) -> Path | None:
        resume = self.cfg.resume
        if resume == "never":
            return None
        if resume == "auto":
            found = complete_checkpoints(self.folder)
            if self.cfg.load_step >= 0:
                if self.cfg.load_step not in found:
                    raise ConfigError(
                        f"checkpoint.load_step {self.cfg.load_step}: no complete checkpoint of that step in "
                        f"{self.folder} "
                        f"(found: {sorted(found) or 'none'})"
                    )
                return found[self.cfg.load_step]
            return found[max(found)] if found else None
        return find_checkpoint(Path(resume), "checkpoint.resume")

    def load(self, path: Path, parts: tuple[str, ...]) -> int:
        """Load `parts` of the checkpoint at `path`; returns the step to continue from."""
        train_state = read_train_state(path)
        self._check_model(path, train_state["model"])
        tensors = self._tensor_state(tuple(p for p in parts if p in ("model", "optimizer")))
        if tensors:
            TrustedReader(str(path)).read_metadata()  # refuse an untrusted checkpoint with its own message
            try:
                dcp.load(
                    tensors,
                    storage_reader=TrustedReader(str(path)),
                    process_group=self.save_group,
                    no_dist=self.save_group is None,
                )
            except (Exception, CheckpointException) as e:  # assorted errors on truncated or foreign files
                raise ConfigError(
                    f"checkpoint {path} is corrupt or incomplete: {str(e).strip().splitlines()[0][:300]}"
                ) from None
        step = train_state["step"] if "train_state" in parts else 0
        if "train_state" in parts:
            self.plan.clear()
            self.plan.update(train_state.get("plan", {}))
        if "lr_scheduler" in parts:
            self.restore_lr_scheduler(train_state["lr_scheduler"])
        if "data" in parts:
            try:
                self.loader.load_state_dict(json.loads((path / "data.json").read_text()))
            except (OSError, ValueError, KeyError) as e:
                raise ConfigError(f"checkpoint {path} is corrupt: cannot read data.json ({e})") from None
        log.info("resumed from %s: %s; continuing at step %d", path, ", ".join(parts), step)
        self.resumed_from = path
        return step

    def restore_lr_scheduler(self, state: dict) -> None:
        # The schedule's lambdas are code, not state: LambdaLR expects one placeholder per group.
        groups = self.optimizer.param_groups
        state = {k: v for k, v in state.items() if k != "lr_lambdas"}
        self.lr_scheduler.load_state_dict({**state, "lr_lambdas": [None] * len(groups)})
        for group, lr in zip(groups, self.lr_scheduler.get_last_lr()):
            group["lr"] = lr

    # -- moving the state to rebuilt parts (a pipeline re-split) -------------------------------

    def save_tensors(self, folder: Path) -> None:
        """The model and optimizer tensors into `folder`, for load_tensors after the parts are rebuilt."""
        dcp.save(self._tensor_state(("model", "optimizer")), checkpoint_id=str(folder), process_group=self.save_group,
                 no_dist=self.save_group is None)  # fmt: skip

    def rebind(self, model_parts, optimizer, lr_scheduler) -> None:
        self.model_parts, self.optimizer, self.lr_scheduler = model_parts, optimizer, lr_scheduler

    def load_tensors(self, folder: Path) -> None:
        dcp.load(self._tensor_state(("model", "optimizer")), checkpoint_id=str(folder), process_group=self.save_group,
                 no_dist=self.save_group is None)  # fmt: skip
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
