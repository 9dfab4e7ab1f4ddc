"""Checkpoints of the whole training state: sharded (DCP), atomic, optionally async, reshardable on load.

Layout of one checkpoint, `<run>/checkpoints/step-N/`:
    *.distcp, .metadata     model weights and optimizer state, one shard file per rank (DCP)
    train_state.json        step, tokens seen, lr schedule, the model's parameter shapes, the resolved recipe
    data/dp<R>.json         the data loader position of data-parallel rank R
    COMPLETE                written last; a folder without it is never loaded

A checkpoint is written to `.tmp-step-N/` and renamed when complete, so a crash at any moment leaves the
previous checkpoints untouched. Nothing here unpickles: tensors come through DCP, the rest is JSON.
"""

from __future__ import annotations

import json
import logging
import re
import shutil
import time
from concurrent.futures import Future
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException  # a BaseException, not an Exception

from titan.config import Checkpoint, ConfigError, to_toml

log = logging.getLogger("titan")
MARKER = "COMPLETE"
PARTS = ("model", "optimizer", "lr_scheduler", "data", "train_state")
_STEP_DIR = re.compile(r"^step-(\d+)$")


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


class Checkpointer:
    def __init__(self, cfg: Checkpoint, run_dir: Path, trainer):
        self.cfg, self.trainer = cfg, trainer
        self.folder = run_dir / "checkpoints"
        self.rank = trainer.rank
        # Gloo groups of their own: DCP's collectives, which run on a background thread during async saves,
        # must not interleave with training's (on gloo that aborts the job), nor with this class's own
        # barriers and stop votes on the main thread (that deadlocks).
        self.group = dist.new_group(backend="gloo") if dist.is_initialized() else None
        self.control_group = dist.new_group(backend="gloo") if dist.is_initialized() else None
        self._pending: tuple[Future, Path, Path] | None = None
        if self.rank == 0 and self.folder.is_dir():
            for stale in self.folder.glob(".tmp-step-*"):  # left by a crash during a save
                shutil.rmtree(stale, ignore_errors=True)

    # -- what is saved -------------------------------------------------------------------------

    def _tensor_state(self, parts: tuple[str, ...]) -> dict:
        """Model and optimizer tensors keyed by parameter name, so any layout can load them."""
        state = {}
        named = list(self.trainer.model_parts.named_parameters())
        if "model" in parts:
            state["model"] = {name: p for name, p in named}
        if "optimizer" in parts:
            optimizer = self.trainer.optimizer
            for _, p in named:  # AdamW creates its state lazily; loading needs it to exist
                if p not in optimizer.state:
                    optimizer.state[p] = {"step": torch.tensor(0.0), "exp_avg": torch.zeros_like(p), "exp_avg_sq": torch.zeros_like(p)}
            state["optimizer"] = {name: optimizer.state[p] for name, p in named}
        return state

    def _model_shapes(self) -> dict[str, list[int]]:
        """Shapes of the whole model, not of this rank's pipeline stages: every layout records the same."""
        with torch.device("meta"):
            model = self.trainer.spec.build(self.trainer.model_args)
        return {name: list(p.shape) for name, p in model.named_parameters()}

    # -- saving --------------------------------------------------------------------------------

    def maybe_save(self, step: int, final: bool = False) -> None:
        if self.cfg.enable and (final or step % self.cfg.interval == 0):
            self.save(step, wait=final)

    def save(self, step: int, wait: bool = False) -> None:
        self.finish_pending()  # one save in flight at a time
        final, tmp = self.folder / f"step-{step}", self.folder / f".tmp-step-{step}"
        if final.exists():
            return
        start = time.perf_counter()
        if self.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
            (tmp / "data").mkdir(parents=True)
        self._barrier()
        self._write_json(tmp, step)
        state = self._tensor_state(("model", "optimizer"))
        if self.cfg.async_save and not wait:
            future = dcp.async_save(state, checkpoint_id=str(tmp), process_group=self.group, no_dist=self.group is None)
            self._pending = (future, tmp, final)
        else:
            dcp.save(state, checkpoint_id=str(tmp), process_group=self.group, no_dist=self.group is None)
            self._pending = (None, tmp, final)
            self.finish_pending()
        blocked = time.perf_counter() - start
        self.trainer.metrics.log(step, {"checkpoint_blocked_s": blocked})
        log.info("checkpoint step %d: %s (training blocked %.2fs)", step, "writing in background" if self._pending else final, blocked)

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

    def _write_json(self, folder: Path, step: int) -> None:
        t = self.trainer
        if t.is_data_writer:
            (folder / "data" / f"dp{t.dp_rank}.json").write_text(json.dumps(t.loader.state_dict()))
        if self.rank == 0:
            scheduler = {k: v for k, v in t.lr_scheduler.state_dict().items() if k != "lr_lambdas"}
            train_state = {
                "step": step,
                "tokens_seen": step * t.tokens_per_step,
                "lr_scheduler": scheduler,
                "data_parallel_size": t.dims.dp,
                "model": {"name": t.config.model.name, "flavor": t.config.model.flavor, "shapes": self._model_shapes()},
                "recipe": to_toml(t.config),
            }
            (folder / "train_state.json").write_text(json.dumps(train_state, indent=1))

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
                        f"checkpoint.load_step {self.cfg.load_step}: no complete checkpoint of that step in {self.folder} "
                        f"(found: {sorted(found) or 'none'})"
                    )
                return found[self.cfg.load_step]
            return found[max(found)] if found else None
        path = Path(resume)
        if (path / MARKER).is_file():
            return path
        found = complete_checkpoints(path)
        if found:
            return found[max(found)]
        what = "does not exist" if not path.exists() else "is neither a complete checkpoint (no COMPLETE marker) nor a folder of them"
        raise ConfigError(f"checkpoint.resume: {path} {what}")

    def load(self, path: Path, parts: tuple[str, ...]) -> int:
        """Load `parts` of the checkpoint at `path` into the trainer; returns the step to continue from."""
        try:
            train_state = json.loads((path / "train_state.json").read_text())
        except (OSError, ValueError) as e:
            raise ConfigError(f"checkpoint {path} is corrupt: cannot read train_state.json ({e})") from None
        self._check_model(path, train_state["model"])
        tensors = self._tensor_state(tuple(p for p in parts if p in ("model", "optimizer")))
        if tensors:
            try:
                dcp.load(tensors, checkpoint_id=str(path), process_group=self.group, no_dist=self.group is None)
            except (Exception, CheckpointException) as e:  # assorted errors on truncated or foreign files
                raise ConfigError(f"checkpoint {path} is corrupt or incomplete: {str(e).strip().splitlines()[0][:300]}") from None
        t = self.trainer
        step = train_state["step"] if "train_state" in parts else 0
        if "lr_scheduler" in parts:
            # The schedule's lambdas are code, not state: LambdaLR expects one placeholder per group.
            t.lr_scheduler.load_state_dict({**train_state["lr_scheduler"], "lr_lambdas": [None] * len(t.optimizer.param_groups)})
            for group, lr in zip(t.optimizer.param_groups, t.lr_scheduler.get_last_lr()):
                group["lr"] = lr
        if "data" in parts:
            t.loader.load_state_dict(self._data_state(path, train_state["data_parallel_size"]))
        log.info("resumed from %s: %s; continuing at step %d", path, ", ".join(parts), step)
        return step

    def _check_model(self, path: Path, saved: dict) -> None:
        current = self._model_shapes()
        config = self.trainer.config.model
        if saved["name"] != config.name or saved["shapes"] != current:
            differing = sorted(k for k in set(saved["shapes"]) | set(current) if saved["shapes"].get(k) != current.get(k))
            raise ConfigError(
                f"checkpoint {path} holds a {saved['name']} {saved['flavor']} model that does not match this recipe's "
                f"{config.name} {config.flavor} ({len(differing)} parameters differ, e.g. {differing[:3]}); "
                "use a matching recipe, or checkpoint.resume = never to start fresh"
            )

    def _data_state(self, path: Path, saved_dp: int) -> dict:
        """This rank's loader position. When the data-parallel size changed, every rank continues from the
        furthest document any old rank had reached, dropping half-packed tokens: no document is read twice
        in the epoch, and at most (old data-parallel size - 1) documents are skipped."""
        t = self.trainer
        if saved_dp == t.dims.dp:
            return json.loads((path / "data" / f"dp{t.dp_rank}.json").read_text())
        states = [json.loads((path / "data" / f"dp{r}.json").read_text()) for r in range(saved_dp)]
        furthest = max(states, key=lambda s: (s["epoch"], s["next_doc"]))
        log.info("data-parallel size changed from %d to %d: all ranks continue at document %d of epoch %d",
                 saved_dp, t.dims.dp, furthest["next_doc"], furthest["epoch"])
        return {"epoch": furthest["epoch"], "next_doc": furthest["next_doc"], "buffer": []}

    def resume(self) -> int:
        """Load what the recipe asks for; returns the step to start from (0 for a fresh start)."""
        path = self.find_resume_point()
        if path is None:
            if self.cfg.resume == "auto":
                log.info("no checkpoint in %s: starting from step 0", self.folder)
            return 0
        return self.load(path, tuple(self.cfg.load_only) or PARTS)
