"""`titan verify`'s command: the reference, floor and layout recipes, each run in its own processes, and the report
of their comparison."""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path

import torch

from titan.config import Config, Layout, Parallel, read_config, to_toml, validate
from titan.errors import ConfigError
from titan.run_plan import run_plan
from titan.tools.verify.comparison import Records, compare, floor_of
from titan.tools.verify.processes import run_ranks
from titan.tools.verify.recording import RECORDS


def world_size_of(p) -> int:
    """The processes a layout takes, dp_shard = -1 counting as the fewest it can be: 1, or under expert
    parallelism, which takes its ranks from dp_shard x cp and runs under data parallelism, ep / cp and at least 2
    without replicas."""
    dp_shard = p.dp_shard
    if dp_shard == -1:
        dp_shard = 1 if p.ep == 1 else max(p.ep // p.cp, 1 if p.dp_replicate > 1 else 2)
    return p.dp_replicate * dp_shard * p.cp * p.tp * p.pp


def one_process(parallel: Parallel) -> Parallel:
    """The layout of one process."""
    return dataclasses.replace(
        parallel, dp_replicate=1, dp_shard=-1, cp=1, tp=1, pp=1, ep=1, dp_weights=[], pp_layers_per_stage=[]
    )


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
    single = one_process(config.parallel)
    local = config.training.local_batch_size
    runs = {
        "reference": dataclasses.replace(base, parallel=single),
        "floor": dataclasses.replace(
            base, parallel=single, training=dataclasses.replace(base.training, local_batch_size=max(1, local // 2))
        ),
        "layout": base,
    }
    return {name: dataclasses.replace(run, job=dataclasses.replace(run.job, name=name)) for name, run in runs.items()}


def launch(run: Config, processes: int, what: tuple[str, int], folder: Path) -> None:
    """Record one run in its own processes (processes.py): `what` is ("steps", N) from the start, ("floor", N) the
    same with rounding noise, or ("until", STEP) from its checkpoint (a replay); its log goes to <folder>/<name>.log."""
    recipe = folder / f"{run.job.name}.toml"
    recipe.write_text(to_toml(run))
    shutil.rmtree(run.run_dir, ignore_errors=True)
    log = folder / f"{run.job.name}.log"
    log.write_text("")
    if run_ranks(recipe, what, processes, log):
        lines = [line for line in log.read_text().splitlines() if line.strip()]
        errors = [line for line in lines if line.startswith("error:")] or lines[-1:]
        raise ConfigError(f"the {run.job.name} run failed ({errors[0] if errors else 'no output'}); see {log}")


def load_records(run_dir: Path) -> Records:
    files = sorted((run_dir / RECORDS).glob("rank*.pt"), key=lambda p: int(p.stem[4:]))
    return Records([torch.load(f, weights_only=True) for f in files])


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
        launch(run, processes if name == "layout" else 1, ("floor" if name == "floor" else "steps", steps), folder)
    ref = load_records(runs["reference"].run_dir)
    floor = floor_of(ref, load_records(runs["floor"].run_dir))
    lines, ok = compare(ref, floor, load_records(runs["layout"].run_dir), config.training.mixed_precision)
    head = (
        f"titan verify: layout {layout.name} ({processes} processes) against 1 process, {steps} steps of {recipe}"
        f"{' (reference and floor reused)' if reused else ''}; runs and logs in {folder}"
    )
    return "\n".join([head, *lines]), ok
