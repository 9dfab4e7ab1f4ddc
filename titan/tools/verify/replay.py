"""`titan verify --replay STEP --checkpoint DIR`: train the steps from the newest checkpoint before STEP to STEP again,
twice, and compare them with what the run recorded (its per-step digests, replay.digests):

  same layout   the run's layout and world size, compared bitwise, rank by rank: at the first step where some
                rank's result differs, the ranks whose result differs first in the order the step computes (their
                loss share, their gradients as their backward left them, the gradient norm, their weights after
                the update) are named;
  other layout  one process, or the layout the overrides give, compared to titan verify's tolerance: the global
                loss and the gradient norm of each step with the run's, and the weights after STEP with the
                same-layout replay's (both replays save a checkpoint there).

A device that corrupted a result silently makes the first disagree; the second tells which of the run and the
replay the other devices side with."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

from titan.checkpoint.hf.exports import load_parameters, open_model_checkpoint
from titan.checkpoint.resume import STEP_DIR, checkpoints_at
from titan.checkpoint.train_state import read_train_state
from titan.config import Config, Layout, read_config, validate
from titan.errors import ConfigError
from titan.run_plan import run_plan
from titan.tools.verify.comparison import MIN_TOLERANCE, relative_difference
from titan.tools.verify.runs import launch, one_process, world_size_of
from titan.train.digests import DIGESTS, bitwise


def read_digests(folder: Path) -> list[dict]:
    """Each rank's {"world", "tp", "steps": {step: line, with "names"}} from <run>/digests/rank<r>.jsonl; a step
    written twice (a run resumed before it) is taken as last written."""
    files = sorted(folder.glob("rank*.jsonl"), key=lambda p: int(p.stem[4:]))
    ranks = []
    for path in files:
        rank, header = {"steps": {}}, {}
        for line in path.read_text().splitlines():
            entry = json.loads(line)
            if "names" in entry:
                header = entry
                rank |= {"world": entry["world"], "tp": entry["tp"]}
            else:
                rank["steps"][entry["step"]] = {**entry, "names": header["names"]}
        ranks.append(rank)
    return ranks


def _start(checkpoints: Path, step: int) -> tuple[Path, int]:
    """The newest complete checkpoint before `step`, and its step."""
    found = {int(STEP_DIR.match(p.name).group(1)): p for p in checkpoints_at(checkpoints, "--checkpoint")}
    before = [s for s in found if s < step]
    if not before:
        raise ConfigError(
            f"--replay {step}: no checkpoint in {checkpoints} before step {step} (steps {sorted(found)}); a replay "
            "starts from the checkpoint saved before the step: replay a later step"
        )
    return found[max(before)], max(before)


def _recorded(run_dir: Path, steps: range) -> list[dict]:
    """The run's digests, which must hold every replayed step on every rank."""
    ranks = read_digests(run_dir / DIGESTS)
    missing = [s for s in steps if not ranks or any(s not in r["steps"] for r in ranks)]
    if missing:
        raise ConfigError(
            f"--replay: the run in {run_dir} recorded no digests of step {missing[0]} in {run_dir / DIGESTS}, which a "
            "replay compares with; record them with replay.digests = true"
        )
    return ranks


def _replay_config(config: Config, name: str, folder: Path, start: Path) -> Config:
    """The recorded recipe resumed from `start` into <folder>/<name>, writing digests and, at the end, a checkpoint,
    with what would add work or change the state on the way turned off (validation, trackers, re-planning)."""
    return dataclasses.replace(
        config,
        job=dataclasses.replace(config.job, output_dir=str(folder), name=name),
        checkpoint=dataclasses.replace(config.checkpoint, enable=True, resume=str(start), keep_latest_k=0),
        replay=dataclasses.replace(config.replay, digests=True, spike_zscore=0.0),
        validation=dataclasses.replace(config.validation, interval=0),
        metrics=dataclasses.replace(config.metrics, tensorboard=False, wandb="disabled"),
        straggler=dataclasses.replace(config.straggler, enable=False),
        profiling=dataclasses.replace(config.profiling, enable=False),
    )


def global_losses(ranks: list[dict], steps: range) -> dict[int, tuple[float, float]]:
    """step -> (global loss, gradient norm) from the ranks' digests: the loss shares summed over the ranks (tensor-
    parallel ranks hold the same share each) and any rank's norm (all ranks compute the global one)."""
    tp = ranks[0]["tp"]
    return {s: (math.fsum(r["steps"][s]["loss"] for r in ranks) / tp, ranks[0]["steps"][s]["grad_norm"]) for s in steps}


def losses_within(recorded: list[dict], replayed: list[dict], steps: range, tolerance: float) -> tuple[list[str], bool]:
    """Report lines, and whether the other layout's loss and gradient norm are within `tolerance` of the run's at
    every step."""
    lines, ok = [], True
    want, got = global_losses(recorded, steps), global_losses(replayed, steps)
    for step in steps:
        (loss, norm), (loss_now, norm_now) = want[step], got[step]
        differences = [abs(a - b) / abs(a) if a else abs(b) for a, b in ((loss, loss_now), (norm, norm_now))]
        ok &= max(differences) <= tolerance
        lines.append(
            f"    step {step}: loss {loss_now:.8g} ({differences[0]:.3g} from the run's), gradient norm "
            f"{norm_now:.8g} ({differences[1]:.3g} from the run's){'' if max(differences) <= tolerance else ' BEYOND'}"
        )
    return lines, ok


def weights_within(other: Path, whose: str, theirs: Path, step: int, tolerance: float) -> tuple[str, bool]:
    """A report line, and whether the weights in checkpoint `other` are within `tolerance` of those in `theirs`."""
    mine, reference = (load_parameters(p, open_model_checkpoint(p).saved) for p in (other, theirs))
    differences = {n: relative_difference(t.float(), reference[n].float()) for n, t in mine.items()}
    name = max(differences, key=lambda n: differences[n][0])
    relative, absolute = differences[name]
    line = (
        f"    weights after step {step}: largest difference from {whose} {relative:.3g} of its largest magnitude "
        f"({absolute:.3g} absolute) at {name}{'' if relative <= tolerance else ' BEYOND'}"
    )
    return line, relative <= tolerance


def _layouts(start: Path, overrides: list[str], folder: Path) -> tuple[Config, Config]:
    """The run's recipe as its checkpoint saved it, and the other layout's (one process, or the overrides), both
    with the run's global batch in rows (a recipe's 0, local x data-parallel size, would change with the layout)."""
    state = read_train_state(start)
    recipe = folder / "recorded.toml"
    recipe.write_text(state["recipe"])
    base = read_config(recipe)
    other = (
        read_config(recipe, overrides) if overrides else dataclasses.replace(base, parallel=one_process(base.parallel))
    )
    rows = state["math"]["training.global_batch"]
    # The saved recipe names its tokenizer by absolute path; the resume check holds the path as the run gave it.
    tokenizer = dataclasses.replace(base.tokenizer, path=state["math"]["tokenizer.path"])
    return tuple(
        dataclasses.replace(c, training=dataclasses.replace(c.training, global_batch_size=rows), tokenizer=tokenizer)
        for c in (base, other)
    )


def replay(step: int, checkpoints: Path, overrides: list[str], folder: Path | None) -> tuple[str, bool]:
    """Replay step `step` of the run whose checkpoints are in `checkpoints` on its layout and on another; returns
    (report, whether both agree with the run)."""
    start, first = _start(checkpoints, step)
    run_dir, steps = start.parent.parent, range(first + 1, step + 1)
    recorded = _recorded(run_dir, steps)
    folder = Path(folder or run_dir / "replay" / f"step-{step}")
    folder.mkdir(parents=True, exist_ok=True)
    base, other = _layouts(start, overrides, folder)
    processes = world_size_of(other.parallel)
    validate(other, processes)
    layout = Layout.from_config(other.parallel, processes)
    run_plan(other, processes)
    world = recorded[0]["world"]
    runs = {
        "same": _replay_config(base, "same-layout", folder, start),
        "other": _replay_config(other, f"layout-{layout.name}", folder, start),
    }
    for name, n in (("same", world), ("other", processes)):
        launch(runs[name], n, ("until", step), folder)
    same, other_digests = (read_digests(runs[name].run_dir / DIGESTS) for name in ("same", "other"))
    same_lines, culprit = bitwise(recorded, same, steps)
    tolerance = MIN_TOLERANCE[base.training.mixed_precision]
    other_lines, close = losses_within(recorded, other_digests, steps, tolerance)
    saved = {name: run.run_dir / "checkpoints" / f"step-{step}" for name, run in runs.items()}
    line, agrees = weights_within(saved["other"], "the same-layout replay's", saved["same"], step, tolerance)
    other_lines.append(line)
    if (run_saved := start.parent / f"step-{step}").is_dir():  # the run's own outcome, where it saved one
        line, matches = weights_within(saved["other"], "the run's", run_saved, step, tolerance)
        other_lines.append(line)
        close &= matches
    which = f"step {steps[0]}" if len(steps) == 1 else f"steps {steps[0]} to {step}"
    lines = [
        f"titan verify --replay {step}: {which} of the run in {run_dir}, from its checkpoint {start.name}; runs and "
        f"logs in {folder}",
        f"  the run's layout ({world} processes), bitwise against the run's digests:",
        *same_lines,
        f"  layout {layout.name} ({processes} process{'es' if processes > 1 else ''}), within {tolerance:g} of the "
        "run's loss and gradient norm and of the same-layout replay's weights:",
        *other_lines,
    ]
    if culprit:
        at, ranks = culprit
        named = "; ".join(f"rank {rank}: {what}" for rank, what in ranks)
        lines.append(
            f"NOT reproduced: step {at} differs from the run first on rank{'s' if len(ranks) > 1 else ''} "
            f"{', '.join(str(r) for r, _ in ranks)} ({named}): silent data corruption on that device, or a "
            f"computation that is not deterministic; layout {layout.name} {'agrees' if agrees else 'disagrees'} "
            f"with the replay{'' if close else ' and departs from the run'}"
        )
    elif not (close and agrees):
        lines.append(f"NOT reproduced: layout {layout.name} departs from the run beyond tolerance (BEYOND above)")
    else:
        lines.append(f"reproduced: the run's layout bitwise, layout {layout.name} within tolerance")
    return "\n".join(lines), culprit is None and close and agrees
