"""The re-plan in force: data shares or a pipeline layer split that follow the ranks' measured speeds.

The Replanner holds what a straggler re-plan decided and the detector that decides it. It is saved with every
checkpoint (state_dict / load_state_dict, like the other stateful parts), together with the layout and the
devices it was measured on: a resume on another layout or other devices drops it and measures again. A decision
is a new RunPlan, made by run_plan like the first; the trainer follows it (its loaders read other rows, or its
pipeline stages are rebuilt and `resplit` moves their state)."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from pathlib import Path

import torch
from torch.distributed.tensor import DTensor

from titan.balance import data_shares
from titan.checkpoint.train_state import model_buffers
from titan.config import Config
from titan.observe.metrics import MetricsLogger
from titan.optim import ensure_optimizer_state
from titan.parallel import pp
from titan.run_plan import Blocks, RunPlan, run_plan, stage_ids, stage_layers
from titan.train.step import TrainStep
from titan.train.straggler import Probe, StragglerDetector, foreign_plan, gather_times

log = logging.getLogger("titan")
# The recipe's keys that set the shares a re-plan replaces: a resume with others drops the saved re-plan.
RECIPE_SHARES = ("dp_weights", "pp_layers_per_stage", "pp_stage_speeds", "pp_stage_memory_gib")


class Replanner:
    def __init__(self, config: Config, plan: RunPlan, blocks: Blocks, devices: list[str], device: torch.device):
        """plan: the recipe's; devices: each rank's device (host and local rank), in rank order."""
        layout = plan.layout
        self.config, self.layout, self.blocks, self.device = config, layout, blocks, device
        self.measured_on = {"layout": dataclasses.asdict(layout), "devices": devices}
        self.recipe = {f"parallel.{key}": getattr(config.parallel, key) for key in RECIPE_SHARES}
        self.dp_weights: list[float] = []  # the data shares' weights in force; empty: the recipe's
        self.pp_layers_per_stage: list[int] = []  # the pipeline split in force; empty: the recipe's
        g = config.straggler
        self.detector: StragglerDetector | None = None
        if g.enable and (layout.dp > 1 or layout.pp > 1):
            # One weight per data-parallel rank, or, in a pipeline, per pipeline rank.
            ranks = layout.pp if layout.pp > 1 else layout.dp
            self.detector = StragglerDetector(ranks, g.threshold, g.hysteresis, g.window)
            self.probe = Probe(device)
            self._follow_weights()

    def state_dict(self) -> dict:
        state = {"dp_weights": self.dp_weights, "pp_layers_per_stage": self.pp_layers_per_stage}
        state = {key: list(value) for key, value in state.items() if value}
        return {**state, "measured_on": self.measured_on, "recipe": self.recipe} if state else {}

    def load_state_dict(self, state: dict) -> None:
        """The saved plan, if re-planning is on, the recipe sets the shares it set when the plan was made, and the
        plan was measured on this layout and these devices; else none, with one log line."""
        dropped = self._dropped_because(state) if state else None
        if dropped:
            log.info("the checkpoint's re-plan is dropped (%s): starting from the recipe's plan", dropped)
            state = {}
        self.dp_weights = list(state.get("dp_weights", []))
        self.pp_layers_per_stage = list(state.get("pp_layers_per_stage", []))
        if self.detector is not None:
            self._follow_weights()

    def _dropped_because(self, state: dict) -> str | None:
        """Why the saved re-plan does not hold for this run, or None when it does."""
        if not self.config.straggler.enable:
            return "straggler.enable = false"
        if "recipe" not in state:
            return "it does not say which shares the recipe set"  # saved by an older titan
        changed = [key for key, value in self.recipe.items() if state["recipe"].get(key) != value]
        if changed:
            return f"the recipe sets other {', '.join(changed)} than the run that re-planned"
        return foreign_plan(state.get("measured_on"), self.measured_on)

    def _follow_weights(self) -> None:
        """The detector starts from the data shares' weights in force (speeds relative to the fastest)."""
        if self.layout.pp == 1:
            weights = self.dp_weights or self.config.parallel.dp_weights or [1.0] * self.layout.dp
            self.detector.weights = [w / max(weights) for w in weights]

    def due(self, step: int) -> bool:
        return self.detector is not None and step % self.config.straggler.interval == 0

    def measure(self, index: int, step: int, metrics: MetricsLogger) -> list[float] | None:
        """Probe this rank (in group `index`: its pipeline or data-parallel rank), gather every group's time, and
        return the new weights when the plan must change (the same on every rank), else None."""
        times = gather_times(self.probe.seconds(), index, len(self.detector.weights), self.device)
        metrics.log(step, {"probe_s_min": min(times), "probe_s_max": max(times)})
        return self.detector.update(times)

    def plan(self) -> RunPlan:
        """The plan in force: the recipe's with the re-plan's data shares and pipeline split."""
        return run_plan(
            self.config,
            self.layout.world_size,
            self.blocks,
            dp_weights=self.dp_weights or None,
            layers_per_stage=self.pp_layers_per_stage or None,
        )

    def follow(self, weights: list[float], step: int, metrics: MetricsLogger) -> RunPlan:
        """The plan for the measured `weights` (of the pipeline ranks under a pipeline, else of the data-parallel
        ranks), which becomes the one in force, logged."""
        if self.layout.pp > 1:
            p, before = self.config.parallel, self.plan()
            ranks = {s: r for r in range(p.pp) for s in stage_ids(r, p.pp, before.n_stages, before.schedule)}
            speeds = [weights[ranks[stage]] for stage in range(before.n_stages)]
            # The recipe's split rule with the measured speeds, so the stages' memory caps still hold.
            by_speed = dataclasses.replace(p, pp_stage_speeds=speeds, pp_layers_per_stage=[])
            self.pp_layers_per_stage = [len(ids) for ids in stage_layers(self.blocks.count, by_speed, self.blocks.gib)]
            log.info("step %d: pipeline ranks' speeds %s", step, " ".join(f"{w:.2f}" for w in weights))
            metrics.log(
                step, {"replan": 1, **{f"pp_weight_{i}": w for i, w in enumerate(weights)},
                       **{f"pp_layers_{i}": c for i, c in enumerate(self.pp_layers_per_stage)}},
            )  # fmt: skip
            return self.plan()
        self.dp_weights = list(weights)
        plan = self.plan()
        rows = [sum(sizes) for sizes in plan.micro_batches]
        asked = data_shares(sum(rows), weights)
        slowest = lambda shares: max(r / w for r, w in zip(shares, weights))  # noqa: E731
        log.info(
            "step %d: data-parallel speeds %s: rows per rank now %s%s",
            step,
            " ".join(f"{w:.2f}" for w in weights),
            " ".join(map(str, rows)),
            ""
            if slowest(rows) <= slowest(asked) * (1 + 1e-9)
            else f" (the speeds ask for {' '.join(map(str, asked))}; micro-batches of at most "
            f"training.local_batch_size ({self.config.training.local_batch_size}) rows, as many on every rank, allow "
            "no closer plan)",
        )
        metrics.log(
            step, {"replan": 1, **{f"dp_weight_{i}": w for i, w in enumerate(weights)},
                   **{f"dp_rows_{i}": r for i, r in enumerate(rows)}},
        )  # fmt: skip
        return plan


def resplit(old: TrainStep, build: Callable[[], TrainStep], checkpointer, scratch: Path) -> tuple[TrainStep, str]:
    """The step `build` makes for a new pipeline split, holding each parameter's value and optimizer state from
    `old`, and how they moved. With plain tensors (pipeline parallelism alone) the moved layers are sent point to
    point; with FSDP or TP shards they pass through a DCP checkpoint in `scratch`, which reshards by parameter name
    under any composition."""
    point_to_point = not any(isinstance(p, DTensor) for p in old.parts.parameters())
    scheduler_state = old.lr_scheduler.state_dict()
    if point_to_point:
        ensure_optimizer_state(old.optimizer, list(old.parts.parameters()))  # a re-split before any step
        before = _stage_state(old)
        # Every AdamW parameter took every step (Muon's keep no count).
        steps = next(state["step"] for state in old.optimizer.state.values() if "step" in state).clone()
    else:
        checkpointer.save_tensors(scratch)
    new = build()
    checkpointer.rebind(model=new.parts, optimizer=new.optimizer, lr_scheduler=new.lr_scheduler)
    if point_to_point:
        ensure_optimizer_state(new.optimizer, list(new.parts.parameters()))
        for state in new.optimizer.state.values():
            if "step" in state:
                state["step"] = steps.clone()
        moved = pp.move_stage_state(before, _stage_state(new), new.rules.pp_group)
        how = f"{moved} tensors received point to point"
    else:
        checkpointer.load_tensors(scratch)
        how = "state moved through DCP"
    checkpointer.restore_lr_scheduler(scheduler_state)
    return new, how


def _stage_state(step: TrainStep) -> dict[str, dict[str, torch.Tensor]]:
    """This rank's parameters and their optimizer state (the step count aside: it is the same for every parameter),
    and the buffers that are state (a MoE's routing biases), by name."""
    state = {
        name: {"param": p.data, **{k: v for k, v in step.optimizer.state[p].items() if k != "step"}}
        for name, p in step.parts.named_parameters()
    }
    for part in step.parts.parts:
        state.update({name: {"buffer": buffer} for name, buffer in model_buffers(part).items()})
    return state
