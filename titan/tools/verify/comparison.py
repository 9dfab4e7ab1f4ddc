"""The comparison of a run's records with the reference's: differences tensor by tensor, in the order the step
computes them, against each step and phase's tolerance (MIN_TOLERANCE, and FLOOR_MARGIN times the floor run's)."""

from __future__ import annotations

import dataclasses
import math
from collections import defaultdict

import torch

from titan.errors import ConfigError

# The smallest tolerance per compute dtype, relative to a tensor's largest magnitude. fp32: the layouts' tests
# measure up to ~3e-7 after a few steps (sums in other orders); bf16 rounds to 2**-8 and FSDP's mixed precision
# casts at other places than autocast does.
MIN_TOLERANCE = {"fp32": 1e-5, "bf16": 3e-2}
FLOOR_MARGIN = 10.0
# A floor run this far from the reference in the forward or backward is not rounding: the 1-process run depends on
# its micro-batch split (a dropout mask keyed by a micro-batch's own rows differs by ~1 there), so no layout can be
# judged.
BROKEN_FLOOR = 100.0
PHASES = ("forward", "backward", "optimizer")


@dataclasses.dataclass
class Difference:
    step: int  # -1: before training (data and initial parameters)
    phase: str
    tensor: str  # a module's output, a parameter's gradient, or a parameter or its optimizer state
    rank: int  # the rank whose forward output differs; -1 for tensors assembled from every rank's shards
    relative: float  # max |layout - reference| / max |reference|
    absolute: float

    @property
    def on_rank(self) -> str:
        return f" on rank {self.rank}" if self.rank >= 0 else ""


def relative_difference(got: torch.Tensor, want: torch.Tensor) -> tuple[float, float]:
    absolute = float((got - want).abs().max()) if got.numel() else 0.0
    scale = float(want.abs().max()) if want.numel() else 0.0
    return (absolute / scale if scale else absolute), absolute


def _matching_chunk(want: torch.Tensor, got: torch.Tensor, tp: int, tp_rank: int) -> torch.Tensor | None:
    """The part of the reference `want` that a tensor-parallel rank's `got` holds (its chunk along the one dim
    whose size differs, split as DTensor splits), or None if no dim tells."""
    if got.shape == want.shape:
        return want
    dims = [d for d in range(want.dim()) if got.dim() == want.dim() and got.shape[d] != want.shape[d]]
    chunks = want.chunk(tp, dims[0]) if len(dims) == 1 else ()
    return chunks[tp_rank] if tp_rank < len(chunks) and chunks[tp_rank].shape == got.shape else None


def _at_positions(want: torch.Tensor, got: torch.Tensor, positions: torch.Tensor | None) -> torch.Tensor:
    """The reference at a context-parallel rank's positions of each row (dim 1), where `got` holds only those."""
    if positions is None or want.dim() < 2 or got.dim() < 2 or got.shape[1] == want.shape[1]:
        return want
    return want[:, positions]


def assemble(pieces: list[tuple], name: str) -> torch.Tensor:
    """The full tensor from the ranks' pieces: (values, flat indices or None for the whole tensor, shape)."""
    values, index, shape = pieces[0]
    if index is None:
        return values.view(shape)
    full, covered = torch.empty(math.prod(shape)), torch.zeros(math.prod(shape), dtype=torch.bool)
    for values, index, _ in pieces:
        full[index], covered[index] = values, True
    if not covered.all():
        raise ConfigError(f"{name}: the ranks' shards cover {int(covered.sum())} of its {covered.numel()} elements")
    return full.view(shape)


def _assembled(ranks: list[dict], field: str) -> dict[int, dict[str, torch.Tensor]]:
    pieces: dict = defaultdict(lambda: defaultdict(list))
    for r in ranks:
        for step, tensors in r[field].items():
            for name, piece in tensors.items():
                pieces[step][name].append(piece)
    return {step: {name: assemble(p, name) for name, p in by_name.items()} for step, by_name in pieces.items()}


class Records:
    """One run's records from all its ranks: forward outputs as each rank holds them and by global row,
    parameters, gradients and optimizer states as full tensors."""

    def __init__(self, ranks: list[dict]):
        self.ranks = ranks
        self.forward: dict = defaultdict(dict)
        self.order: list[str] = []  # modules in the order their forwards first ran
        for rank in ranks:
            for step, module, rows, output in rank["forward"]:
                if module not in self.order:
                    self.order.append(module)
                for i, row in enumerate(rows.tolist()):
                    self.forward[step, module][row] = output[i]
        self.tokens = {
            (step, row): t for r in ranks for step, rows, ts in r["tokens"] for row, t in zip(rows.tolist(), ts)
        }
        self.grads = _assembled(ranks, "grads")
        self.updated = _assembled(ranks, "updated")
        self.init = _assembled([{"init": {-1: r["init"]}} for r in ranks], "init")[-1]
        self.steps = len(self.updated)

    def rows(self, step: int, module: str, rows: torch.Tensor) -> torch.Tensor:
        by_row = self.forward[step, module]
        return torch.stack([by_row[r] for r in rows.tolist()])

    def module_rank(self, tensor: str) -> int:
        """Where a parameter's module stands in the forward order (a parameter name's module is its prefix)."""
        module = tensor.split(":")[0].rsplit(".", 1)[0]
        return self.order.index(module) if module in self.order else len(self.order)


def phase_differences(ref: Records, run: Records, step: int, phase: str) -> list[Difference]:
    """Every recorded tensor's difference in one phase of one step, in the order they were computed."""
    found = []
    if phase == "forward":
        for rank, r in enumerate(run.ranks):
            for s, module, rows, output in r["forward"]:
                if s != step or (step, module) not in ref.forward:
                    continue
                want = _at_positions(ref.rows(step, module, rows), output, r.get("positions"))
                want = _matching_chunk(want, output, r["tp"], r["tp_rank"])
                if want is None:
                    raise ConfigError(f"{module}: output of shape {list(output.shape)} matches no reference slice")
                found.append(Difference(step, phase, module, rank, *relative_difference(output, want)))
        return sorted(found, key=lambda d: ref.order.index(d.tensor))
    wanted, got = (ref.grads, run.grads) if phase == "backward" else (ref.updated, run.updated)
    for name, tensor in got.get(step, {}).items():
        found.append(Difference(step, phase, name, -1, *relative_difference(tensor, wanted[step][name])))
    backward_order = phase == "backward"  # gradients arrive from the last module to the first
    return sorted(found, key=lambda d: ref.module_rank(d.tensor), reverse=backward_order)


def exact_differences(ref: Records, run: Records) -> list[Difference]:
    """The tokens each rank read and the initial parameters, which must be bitwise the reference's."""
    found = []
    for rank, r in enumerate(run.ranks):
        for step, rows, tokens in r["tokens"]:
            for row, got in zip(rows.tolist(), tokens):
                want = ref.tokens[step, row]
                if not torch.equal(got, want if r.get("positions") is None else want[r["positions"]]):
                    found.append(Difference(step, "data", f"tokens of global row {row}", rank, 1.0, 1.0))
    for name, got in run.init.items():
        if not torch.equal(got, ref.init[name]):
            found.append(Difference(-1, "init", name, -1, *relative_difference(got, ref.init[name])))
    return found


def largest(differences: list[Difference]) -> Difference | None:
    return max(differences, key=lambda d: d.relative, default=None)


def floor_of(ref: Records, floor: Records) -> dict[tuple[int, str], float]:
    """The largest relative difference per step and phase between the reference and the known-good floor run."""
    floors = {}
    for step in range(ref.steps):
        for phase in PHASES:
            d = largest(phase_differences(ref, floor, step, phase))
            floors[step, phase] = d.relative if d else 0.0
    return floors


def compare(ref: Records, floor: dict[tuple[int, str], float], run: Records, precision: str) -> tuple[list[str], bool]:
    """The report lines and whether the layout is equivalent: stops at the first tensor beyond tolerance."""
    # The optimizer's floor is left out: Adam divides a near-zero gradient's rounding by eps (up to lr per step).
    unstable = [
        (s, p) for (s, p), f in floor.items() if p != "optimizer" and f > BROKEN_FLOOR * MIN_TOLERANCE[precision]
    ]
    if unstable:
        step, phase = unstable[0]
        return [
            f"NOT equivalent: one process with twice the gradient accumulation already differs from one process by "
            f"{floor[step, phase]:.3g} at step {step}, {phase} (rounding gives below "
            f"{BROKEN_FLOOR * MIN_TOLERANCE[precision]:g}): the reference "
            "itself depends on how the batch is split into micro-batches, so no layout can match it"
        ], False
    tolerance = {key: max(MIN_TOLERANCE[precision], FLOOR_MARGIN * f) for key, f in floor.items()}
    exact = exact_differences(ref, run)
    if exact:
        d = exact[0]
        when = "initial parameters" if d.phase == "init" else f"step {d.step} data"
        return [
            f"NOT equivalent: {when} differ first at {d.tensor}{d.on_rank}, which must be bitwise equal "
            f"(largest difference {d.absolute:.3g})"
        ], False
    n_init = len(ref.init)
    lines = [
        f"  data and initial parameters: the same tokens on every rank in every step; {n_init} parameters "
        "bitwise equal",
        f"  {'step':>4}  {'phase':<9}  {'largest difference':>18}  {'tolerance':>9}  {'floor':>9}  where",
    ]
    for step in range(ref.steps):
        for phase in PHASES:
            differences = phase_differences(ref, run, step, phase)
            beyond = next((d for d in differences if d.relative > tolerance[step, phase]), None)
            worst = beyond or largest(differences)
            where = f"{worst.tensor}{worst.on_rank}" if worst and worst.relative else "-"
            relative, limit, rounding = worst.relative if worst else 0.0, tolerance[step, phase], floor[step, phase]
            lines.append(f"  {step:>4}  {phase:<9}  {relative:>18.3g}  {limit:>9.3g}  {rounding:>9.3g}  {where}")
            if beyond:
                what = {"forward": "output of", "backward": "gradient of", "optimizer": "after the update:"}[phase]
                lines.append(
                    f"NOT equivalent: the first difference beyond tolerance is at step {step}, {phase}, {what} "
                    f"{beyond.tensor}{beyond.on_rank}: {beyond.relative:.3g} of its largest magnitude "
                    f"({beyond.absolute:.3g} absolute), tolerance {tolerance[step, phase]:.3g}, while rounding "
                    f"alone gives {floor[step, phase]:.3g}"
                )
                return lines, False
    lines.append(
        "equivalent: every tensor within tolerance (largest relative difference from the 1-process run; floor: "
        "the same for 1 process with twice the gradient accumulation and every module's fp32 output moved by one ulp)"
    )
    return lines, True
