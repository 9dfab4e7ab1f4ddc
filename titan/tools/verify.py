"""`titan verify`: train a recipe's parallel layout beside its 1-process reference for a few steps and name
the first tensor where they part.

Three recorded runs, each a real trainer in its own processes (torchrun for the layout):
  reference  the recipe on one process;
  floor      the recipe on one process with half the micro-batch rows (twice the gradient accumulation): a
             known-good layout whose differences from the reference are reduction order alone;
  layout     the recipe's layout.
Each rank records, step by step, the tokens it read, every module's forward output (with the global-batch
rows it holds), the gradients the optimizer receives and the parameters and Adam moments after its update;
sharded tensors are gathered to full ones. The comparison walks the steps in the order things happen (data,
forward by module, backward from the last module, optimizer) and reports the first tensor whose difference
from the reference, relative to the reference's largest magnitude, exceeds the phase's tolerance: at least
MIN_TOLERANCE for the dtype, and ten times what the floor run showed in that phase. Tokens and initial
parameters must be bitwise equal.

A tensor-parallel rank holds a slice of some outputs (a sequence shard, a head or column shard): its record is
compared with the matching chunk of the reference, found from the one dim whose size is the reference's / tp.
A context-parallel rank's tokens and outputs hold its positions of each row (the run plan's sequence): they are
compared with the reference's at those positions.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import shutil
import subprocess
import sys
from collections import defaultdict
from functools import partial
from pathlib import Path

import torch

from titan.config import Config, Layout, load_config, read_config, to_toml, validate
from titan.errors import ConfigError, UserError
from titan.run_plan import run_plan

# The smallest tolerance per compute dtype, relative to a tensor's largest magnitude. fp32: the layouts' tests
# measure up to ~3e-7 after a few steps (sums in other orders); bf16 rounds to 2**-8 and FSDP's mixed precision
# casts at other places than autocast does.
MIN_TOLERANCE = {"fp32": 1e-5, "bf16": 3e-2}
FLOOR_MARGIN = 10.0
# A floor run this far from the reference is not reduction order: the 1-process run depends on its micro-batch
# split (a dropout mask keyed by a micro-batch's own rows differs by ~1 there), so no layout can be judged.
BROKEN_FLOOR = 100.0
PHASES = ("forward", "backward", "optimizer")
RECORDS = "records"


# ---------------------------------------------------------------------------------------------------------------
# Recording (inside each run's processes)
# ---------------------------------------------------------------------------------------------------------------


def _local(t: torch.Tensor) -> torch.Tensor:
    """This rank's values of a tensor (a DTensor's local shard), as a float32 copy on the host."""
    from torch.distributed.tensor import DTensor

    if isinstance(t, DTensor):
        t = t._local_tensor  # to_local() would go through autograd
    return t.detach().float().cpu().clone()


class Recorder:
    """Copies of what this rank computes, taken by hooks on the model parts and the optimizer. Nothing is
    gathered (one all-gather per tensor would cost more than the step): a sharded parameter, gradient or
    optimizer state is kept as a piece, its local values with their flat indices in the full tensor, and the
    comparison assembles the ranks' pieces."""

    def __init__(self, model_parts, optimizer, stages=()):
        self.step = 0
        self.rows = None
        self.inferring = False
        for stage in stages:
            # torch's pipeline stages run a forward on uninitialised tensors at their first step to learn the
            # shapes they exchange (private API; where it is absent there is nothing to skip).
            infer = getattr(stage, "_forward_metadata_inference", None)
            if infer is not None:
                stage._forward_metadata_inference = partial(self._inferring, infer)
        self.named = list(model_parts.named_parameters())
        self.indices = {name: _global_indices(p) for name, p in self.named}  # gradients and states share them
        self.placements = {name: getattr(p, "placements", None) for name, p in self.named}
        self.optimizer = optimizer
        self.tokens: list = []  # (step, rows, token ids)
        self.forward: list = []  # (step, module, rows, output)
        self.grads: dict = {}  # step -> {parameter: gradient}
        self.updated: dict = {}  # step -> {parameter/state: tensor} after the update
        self.init = {name: self._piece(name, p) for name, p in self.named}
        for part in model_parts.parts:
            part.register_forward_pre_hook(self._batch)
            for name, module in part.named_modules():
                if module is not part:
                    module.register_forward_hook(partial(self._output, name))
        optimizer.register_step_pre_hook(self._take_grads)
        optimizer.register_step_post_hook(self._take_update)

    def _inferring(self, infer, *args, **kwargs):
        self.inferring = True
        try:
            return infer(*args, **kwargs)
        finally:
            self.inferring = False

    def _batch(self, _module, args) -> None:
        if self.inferring:
            return
        # Stage inputs are (tokens or hidden states, rows, ...) positionally, as the trainer and schedules pass them.
        first = args[0]
        self.rows = args[1].cpu().clone() if len(args) > 1 else torch.arange(first.shape[0])
        if not first.is_floating_point():
            self.tokens.append((self.step, self.rows, first.cpu().clone()))

    def _output(self, name: str, _module, _args, output) -> None:
        # Activation checkpointing re-runs forwards inside backward: those are the same values, recorded once.
        if torch._C._current_graph_task_id() != -1 or self.inferring:
            return
        if isinstance(output, tuple):
            output = output[0] if output else None
        if isinstance(output, torch.Tensor) and output.is_floating_point():
            # A tensor-parallel shard stays local: the comparison finds its chunk of the reference.
            self.forward.append((self.step, name, self.rows, _local(output)))

    def _piece(self, name: str, t: torch.Tensor) -> tuple:
        from torch.distributed.tensor import DTensor, Replicate

        index = self.indices[name]
        if isinstance(t, DTensor) and t.placements != self.placements[name]:  # e.g. an embedding's gradient
            if any(p.is_partial() for p in t.placements):  # partial sums: add them up (all ranks get here)
                t = t.redistribute(placements=[Replicate() if p.is_partial() else p for p in t.placements])
            index = _global_indices(t)
        return _local(t).reshape(-1), index, tuple(t.shape)

    def _take_grads(self, _optimizer, _args, _kwargs) -> None:
        self.grads[self.step] = {name: self._piece(name, p.grad) for name, p in self.named if p.grad is not None}

    def _take_update(self, _optimizer, _args, _kwargs) -> None:
        after = {}
        for name, p in self.named:
            after[name] = self._piece(name, p)
            for key, value in self.optimizer.state.get(p, {}).items():
                if key != "step":
                    after[f"{name}:{key}"] = self._piece(name, value)
        self.updated[self.step] = after
        self.step += 1

    def save(self, path: Path, tp_rank: int, tp: int, positions: torch.Tensor | None) -> None:
        fields = ("tokens", "forward", "grads", "updated", "init")
        record = {"tp_rank": tp_rank, "tp": tp, "positions": positions, **{f: getattr(self, f) for f in fields}}
        torch.save(record, path)


def _global_indices(p: torch.Tensor) -> torch.Tensor | None:
    """Flat indices of a DTensor's local elements in the full tensor; None for a whole tensor."""
    from torch.distributed.tensor import DTensor

    from titan.rng import dtensor_global_indices

    return dtensor_global_indices(p, device="cpu").reshape(-1) if isinstance(p, DTensor) else None


def record(config: Config, steps: int) -> None:
    """Train `steps` steps of the recipe, recording this rank into <run folder>/records/rank<r>.pt."""
    import torch.distributed as dist

    from titan.train.trainer import Trainer

    trainer = Trainer(config)
    schedule = trainer.stepper.schedule
    stages = getattr(schedule, "_stages", None) or [getattr(schedule, "_stage", None)] if schedule else []
    recorder = Recorder(trainer.model_parts, trainer.optimizer, [s for s in stages if s is not None])
    trainer.train(until=steps)
    folder = config.run_dir / RECORDS
    folder.mkdir(exist_ok=True)
    tp = trainer.layout.tp
    tp_rank = trainer.mesh["tp"].get_local_rank() if tp > 1 else 0
    recorder.save(folder / f"rank{trainer.rank}.pt", tp_rank, tp, trainer.stepper.sequence)
    if dist.is_initialized():
        dist.barrier(group=trainer.control_group)


# ---------------------------------------------------------------------------------------------------------------
# The runs
# ---------------------------------------------------------------------------------------------------------------


def world_size_of(p) -> int:
    """The processes a layout takes, dp_shard = -1 counting as 1."""
    return p.dp_replicate * max(p.dp_shard, 1) * p.cp * p.tp * p.pp


def run_configs(config: Config, folder: Path) -> dict[str, Config]:
    """The reference, floor and layout recipes: the user's, recording into `folder` (the lr schedule stays the
    recipe's, over its training.steps), with what
    would change the numbers or the files between runs turned off (checkpoints, validation, trackers,
    re-planning) and compile off (hooks cannot see inside compiled blocks)."""
    base = dataclasses.replace(
        config,
        job=dataclasses.replace(config.job, output_dir=str(folder)),
        checkpoint=dataclasses.replace(config.checkpoint, enable=False),
        validation=dataclasses.replace(config.validation, interval=0),
        metrics=dataclasses.replace(config.metrics, log_freq=1, tensorboard=False, wandb="disabled"),
        straggler=dataclasses.replace(config.straggler, enable=False),
        compile=dataclasses.replace(config.compile, enable=False),
        profiling=dataclasses.replace(config.profiling, enable=False),
    )
    single = dataclasses.replace(
        config.parallel, dp_replicate=1, dp_shard=-1, cp=1, tp=1, pp=1, dp_weights=[], pp_layers_per_stage=[]
    )
    local = config.training.local_batch_size
    runs = {
        "reference": dataclasses.replace(base, parallel=single),
        "floor": dataclasses.replace(
            base, parallel=single, training=dataclasses.replace(base.training, local_batch_size=max(1, local // 2))
        ),
        "layout": base,
    }
    return {name: dataclasses.replace(run, job=dataclasses.replace(run.job, name=name)) for name, run in runs.items()}


def launch(run: Config, processes: int, steps: int, folder: Path) -> None:
    """Record one run in its own processes (torchrun for several); its log goes to <folder>/<name>.log."""
    recipe = folder / f"{run.job.name}.toml"
    recipe.write_text(to_toml(run))
    shutil.rmtree(run.run_dir, ignore_errors=True)
    entry = ["-m", "titan.tools.verify", "--config", str(recipe), "--steps", str(steps)]
    if processes > 1:
        entry = ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={processes}", *entry]
    env = {**os.environ, "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // processes))}
    log = folder / f"{run.job.name}.log"
    with log.open("w") as out:
        done = subprocess.run([sys.executable, *entry], stdout=out, stderr=subprocess.STDOUT, env=env)
    if done.returncode:
        lines = [line for line in log.read_text().splitlines() if line.strip()]
        errors = [line for line in lines if line.startswith("error:")] or lines[-1:]
        raise ConfigError(f"the {run.job.name} run failed ({errors[0] if errors else 'no output'}); see {log}")


def load_records(run_dir: Path) -> Records:
    files = sorted((run_dir / RECORDS).glob("rank*.pt"), key=lambda p: int(p.stem[4:]))
    return Records([torch.load(f, weights_only=True) for f in files])


# ---------------------------------------------------------------------------------------------------------------
# Comparing
# ---------------------------------------------------------------------------------------------------------------


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


def _difference(got: torch.Tensor, want: torch.Tensor) -> tuple[float, float]:
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
                found.append(Difference(step, phase, module, rank, *_difference(output, want)))
        return sorted(found, key=lambda d: ref.order.index(d.tensor))
    wanted, got = (ref.grads, run.grads) if phase == "backward" else (ref.updated, run.updated)
    for name, tensor in got.get(step, {}).items():
        found.append(Difference(step, phase, name, -1, *_difference(tensor, wanted[step][name])))
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
            found.append(Difference(-1, "init", name, -1, *_difference(got, ref.init[name])))
    return found


def largest(differences: list[Difference]) -> Difference | None:
    return max(differences, key=lambda d: d.relative, default=None)


def floor_of(ref: Records, floor: Records) -> dict[str, float]:
    """The largest relative difference per phase between the reference and the known-good floor run."""
    worst = dict.fromkeys(PHASES, 0.0)
    for step in range(ref.steps):
        for phase in PHASES:
            d = largest(phase_differences(ref, floor, step, phase))
            worst[phase] = max(worst[phase], d.relative if d else 0.0)
    return worst


def compare(ref: Records, floor: dict[str, float], run: Records, precision: str) -> tuple[list[str], bool]:
    """The report lines and whether the layout is equivalent: stops at the first tensor beyond tolerance."""
    unstable = [p for p in PHASES if floor[p] > BROKEN_FLOOR * MIN_TOLERANCE[precision]]
    if unstable:
        return [
            f"NOT equivalent: one process with twice the gradient accumulation already differs from one process by "
            f"{floor[unstable[0]]:.3g} in {unstable[0]} (reduction order gives below "
            f"{BROKEN_FLOOR * MIN_TOLERANCE[precision]:g}): the reference "
            "itself depends on how the batch is split into micro-batches, so no layout can match it"
        ], False
    tolerance = {p: max(MIN_TOLERANCE[precision], FLOOR_MARGIN * floor[p]) for p in PHASES}
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
            beyond = next((d for d in differences if d.relative > tolerance[phase]), None)
            worst = beyond or largest(differences)
            where = f"{worst.tensor}{worst.on_rank}" if worst and worst.relative else "-"
            relative = worst.relative if worst else 0.0
            lines.append(
                f"  {step:>4}  {phase:<9}  {relative:>18.3g}  {tolerance[phase]:>9.3g}  {floor[phase]:>9.3g}  {where}"
            )
            if beyond:
                what = {"forward": "output of", "backward": "gradient of", "optimizer": "after the update:"}[phase]
                lines.append(
                    f"NOT equivalent: the first difference beyond tolerance is at step {step}, {phase}, {what} "
                    f"{beyond.tensor}{beyond.on_rank}: {beyond.relative:.3g} of its largest magnitude "
                    f"({beyond.absolute:.3g} absolute), tolerance {tolerance[phase]:.3g}, while reduction order "
                    f"alone gives {floor[phase]:.3g}"
                )
                return lines, False
    lines.append(
        "equivalent: every tensor within tolerance (largest relative difference from the 1-process run; floor: "
        "the same differences between 1 process with and without twice the gradient accumulation)"
    )
    return lines, True


# ---------------------------------------------------------------------------------------------------------------
# titan verify
# ---------------------------------------------------------------------------------------------------------------


def verify(
    recipe: Path, overrides: list[str], steps: int, folder: Path | None, reuse_reference: bool
) -> tuple[str, bool]:
    """Record the three runs and compare; returns (report, equivalent)."""
    config = read_config(recipe, overrides)
    processes = world_size_of(config.parallel)
    validate(config, processes)
    run_plan(config, processes)
    layout = Layout.from_config(config.parallel, processes)
    if processes == 1:
        raise ConfigError(
            "the recipe's layout is one process: nothing to verify; name a layout, e.g. --parallel.dp_shard 2 or "
            "--parallel.tp 2"
        )
    if config.data.batching == "tokens":
        raise ConfigError(
            "titan verify compares rows of one global batch, but data.batching = 'tokens' places documents "
            "differently on every layout; verify with data.batching = 'rows'"
        )
    if steps < 1:
        raise ConfigError(f"--steps must be at least 1, got {steps}")
    folder = Path(folder or Path(config.job.output_dir) / "verify" / config.job.name)
    folder.mkdir(parents=True, exist_ok=True)
    runs = run_configs(config, folder)
    runs["layout"] = dataclasses.replace(
        runs["layout"], job=dataclasses.replace(runs["layout"].job, name=f"layout-{layout.name}")
    )
    reused = reuse_reference and all(
        (folder / f"{name}.toml").is_file()
        and (folder / f"{name}.toml").read_text() == to_toml(runs[name])
        and (runs[name].run_dir / RECORDS / "rank0.pt").is_file()
        for name in ("reference", "floor")
    )
    for name, run in runs.items():
        if name != "layout" and reused:
            continue
        launch(run, processes if name == "layout" else 1, steps, folder)
    ref = load_records(runs["reference"].run_dir)
    floor = floor_of(ref, load_records(runs["floor"].run_dir))
    lines, ok = compare(ref, floor, load_records(runs["layout"].run_dir), config.training.mixed_precision)
    head = (
        f"titan verify: layout {layout.name} ({processes} processes) against 1 process, {steps} steps of {recipe}"
        f"{' (reference and floor reused)' if reused else ''}; runs and logs in {folder}"
    )
    return "\n".join([head, *lines]), ok


def main() -> None:
    """The recording entry point each run's processes start with (titan verify launches them)."""
    parser = argparse.ArgumentParser(prog="python -m titan.tools.verify")
    parser.add_argument("--config", required=True)
    parser.add_argument("--steps", type=int, required=True)
    args = parser.parse_args()
    try:
        record(load_config(args.config), args.steps)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    finally:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":
    main()
