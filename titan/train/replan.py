"""The re-plan in force: data shares or a pipeline layer split that follow the ranks' measured speeds.

The Replanner holds what a straggler re-plan decided and the detector that decides it. It is saved with every
checkpoint (state_dict / load_state_dict, like the other stateful parts), together with the layout and the
devices it was measured on: a resume on another layout or other devices drops it and measures again. The trainer
applies a decision (its loaders read other rows, or its pipeline stages are rebuilt); the plan itself is always
made by run_plan (data shares) or the recipe's layer-split rule (pipeline stages)."""

from __future__ import annotations

import dataclasses
import logging

import torch

from titan.config import Config, Layout
from titan.observe.metrics import MetricsLogger
from titan.train.straggler import Probe, StragglerDetector, foreign_plan, gather_times

log = logging.getLogger("titan")


class Replanner:
    def __init__(self, config: Config, layout: Layout, devices: list[str], device: torch.device):
        """devices: each rank's device (host and local rank), in rank order."""
        self.config, self.layout, self.device = config, layout, device
        self.measured_on = {"layout": dataclasses.asdict(layout), "devices": devices}
        self.dp_weights: list[float] = []  # the data shares' weights in force; empty: the recipe's
        self.pp_layers_per_stage: list[int] = []  # the pipeline split in force; empty: the recipe's
        g = config.straggler
        self.detector: StragglerDetector | None = None
        if g.enable and (layout.dp > 1 or layout.pp > 1):
            # One weight per data-parallel rank, or, in a pipeline, per pipeline rank.
            self.detector = StragglerDetector(layout.pp if layout.pp > 1 else layout.dp, g.threshold, g.hysteresis,
                                              g.window)  # fmt: skip
            self.probe = Probe(device)
            self._follow_weights()

    def state_dict(self) -> dict:
        state = {"dp_weights": self.dp_weights, "pp_layers_per_stage": self.pp_layers_per_stage}
        state = {key: list(value) for key, value in state.items() if value}
        return {**state, "measured_on": self.measured_on} if state else {}

    def load_state_dict(self, state: dict) -> None:
        """The saved plan, if it was measured on this layout and these devices; else none, with one log line."""
        foreign = foreign_plan(state.get("measured_on"), self.measured_on) if state else None
        if foreign:
            log.info("the checkpoint's re-plan is dropped (%s): starting from the recipe's plan", foreign)
            state = {}
        self.dp_weights = list(state.get("dp_weights", []))
        self.pp_layers_per_stage = list(state.get("pp_layers_per_stage", []))
        if self.detector is not None:
            self._follow_weights()

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
