"""`titan compare`: runs side by side, from their output folders alone (offline; torch is not imported).

A run folder (`<job.output_dir>/<job.name>`) holds `config.toml` (the resolved recipe), `run_info.json` (versions,
world size, layout, device), `metrics.jsonl` (one record per logged step) and, from titan's trackers,
`tracking.json` (recipe, wandb group and tags, command line, SLURM job). From these, `compare` prints one
row per run and the config keys whose values differ, and `--plot` draws the curves.
"""

from __future__ import annotations

import json
import math
import statistics
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from titan.config import Layout
from titan.errors import UserError, import_extra
from titan.observe.runs import ENVIRONMENT, RUN_INFO, TRACKING, duration, flatten, read_metrics
from titan.schema import Integer, Table, Text, check, parse_toml, read_json

REQUIRED = ("config.toml", "metrics.jsonl", "run_info.json")
# config.toml as compare reads it (titan/schema.py); other keys are left alone.
CONFIG = Table({"job": Table({"name": Text()}), "training": Table({"steps": Integer()})})


class CompareError(UserError):
    """A run folder is missing or malformed; the message names the folder and what is wrong."""


@dataclass
class Run:
    path: Path
    config: dict  # dotted keys -> values, e.g. {"optimizer.lr": 0.003, "model.overrides.n_layers": 1}
    info: dict  # run_info.json
    records: list[dict]  # metrics.jsonl in file order: logged steps, and other events (e.g. checkpoint times)
    tracking: dict = field(default_factory=dict)  # tracking.json, if the run wrote one

    @property
    def curve(self) -> list[dict]:
        """The logged training steps in order, the latest of each (a resumed run may log a step again)."""
        by_step = {r["step"]: r for r in self.records if "loss" in r}
        return [by_step[s] for s in sorted(by_step)]

    @property
    def validation(self) -> list[dict]:
        """The validation records in step order, the latest of each."""
        return self.series("val_loss")

    def series(self, key: str) -> list[dict]:
        """The records that hold `key` in step order, the latest of each."""
        by_step = {r["step"]: r for r in self.records if key in r}
        return [by_step[s] for s in sorted(by_step)]

    def keys(self, prefix: str, suffix: str = "") -> list[str]:
        """The metric names that start with `prefix` and end with `suffix`, in the order the run first logged them:
        its validation sets' losses (val/, /loss), its tasks' scores (eval/)."""
        found = (k for r in self.records for k in r if k.startswith(prefix) and k.endswith(suffix))
        return list(dict.fromkeys(found))


def load_run(path: str | Path) -> Run:
    path = Path(path)
    if not path.exists():
        raise CompareError(f"{path}: no such run folder")
    if not path.is_dir():
        raise CompareError(f"{path}: not a folder (pass run folders: <job.output_dir>/<job.name>)")
    missing = [name for name in REQUIRED if not (path / name).is_file()]
    if missing:
        raise CompareError(f"{path}: not a titan run folder: missing {', '.join(missing)}")
    try:
        config = parse_toml((path / "config.toml").read_text())
    except ValueError as e:  # TOMLDecodeError, UnicodeDecodeError, nested too deep
        raise CompareError(f"{path / 'config.toml'} is not valid TOML: {e}") from None
    try:
        config = check(config, CONFIG, "config.toml")
        info = read_json(path / "run_info.json", RUN_INFO)
        tracking = read_json(path / "tracking.json", TRACKING) if (path / "tracking.json").is_file() else {}
    except ValueError as e:
        raise CompareError(f"{path}: {e}") from None
    try:
        records = read_metrics(path / "metrics.jsonl")
    except ValueError as e:
        raise CompareError(str(e)) from None
    return Run(path, flatten(config), info, records, tracking)


# ---------------------------------------------------------------------------------------------
# Summaries


def wall_time_s(records: list[dict]) -> float | None:
    """Seconds from the trainer's start to its last logged step, summed over restarts (resumed runs).

    Uses `elapsed_s` where the records have it (it restarts at 0 when a run resumes); otherwise the
    logged step times, which leave out start-up and anything between steps.
    """
    if all("elapsed_s" in r for r in records):
        total, last = 0.0, 0.0
        for r in records:
            if r["elapsed_s"] < last:  # a new segment: the run was restarted
                total += last
            last = r["elapsed_s"]
        return total + last
    timed = [r for r in records if "step_time_s" in r]
    if timed:
        total, previous = 0.0, 0
        for r in timed:
            if r["step"] > previous:
                total += r["step_time_s"] * (r["step"] - previous)
            previous = r["step"]
        return total
    return None


def summarize(run: Run) -> dict:
    curve = run.curve
    losses = [r["loss"] for r in curve if _finite(r["loss"])]

    def median(key):
        values = [r[key] for r in curve if _finite(r.get(key))]
        return statistics.median(values) if values else None

    peaks = [r["peak_memory_gib"] for r in curve if _finite(r.get("peak_memory_gib"))]
    steps = run.config.get("training.steps")
    return {
        "run": str(run.path),
        "job": run.config.get("job.name", run.path.name),
        "recipe": _recipe_name(run),
        "layout": Layout(**(run.info.get("layout") or {})).name,
        "world_size": run.info.get("world_size"),
        "last_step": curve[-1]["step"],
        "steps": steps,
        "final_loss": curve[-1]["loss"],
        "min_loss": min(losses) if losses else None,
        "val_loss": run.validation[-1]["val_loss"] if run.validation else None,
        "tokens_per_s": median("tokens_per_s"),
        "mfu": median("mfu"),
        "peak_memory_gib": max(peaks) if peaks else None,
        "wall_time_s": wall_time_s(run.records),
    }


def _recipe_name(run: Run) -> str:
    recipe = run.tracking.get("recipe")
    return Path(recipe).stem if recipe else "-"


def _finite(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def differing_keys(runs: list[Run]) -> dict[str, list]:
    """Dotted config keys whose values are not the same in every run (a key a run lacks counts as None)."""
    keys = sorted(set().union(*(run.config for run in runs)))
    missing = object()
    diff = {}
    for key in keys:
        values = [run.config.get(key, missing) for run in runs]
        if any(v != values[0] or type(v) is not type(values[0]) for v in values[1:]):
            diff[key] = [None if v is missing else v for v in values]
    return diff


# ---------------------------------------------------------------------------------------------
# Output


def run_labels(runs: list[Run]) -> list[str]:
    """Folder names where they tell the runs apart, else the paths as given."""
    names = [run.path.name for run in runs]
    return names if len(set(names)) == len(names) else [str(run.path) for run in runs]


def format_report(runs: list[Run]) -> str:
    labels = run_labels(runs)
    header = [
        "run",
        "recipe",
        "job",
        "layout",
        "steps",
        "final loss",
        "min loss",
        "val loss",
        "tokens/s",
        "MFU",
        "peak mem",
        "wall time",
    ]
    rows = []
    for label, run in zip(labels, runs):
        s = summarize(run)
        rows.append(
            [
                label,
                s["recipe"],
                s["job"],
                f"{s['layout']} ({s['world_size']} proc)" if s["world_size"] else s["layout"],
                f"{s['last_step']}/{s['steps']}" if s["steps"] else str(s["last_step"]),
                _num(s["final_loss"], "{:.4f}"),
                _num(s["min_loss"], "{:.4f}"),
                _num(s["val_loss"], "{:.4f}"),
                _num(s["tokens_per_s"], "{:,.0f}"),
                _num(s["mfu"] and 100 * s["mfu"], "{:.2f}%"),
                _num(s["peak_memory_gib"], "{:.2f} GiB"),
                duration(s["wall_time_s"]),
            ]
        )
    lines = _table(header, rows)
    if len(runs) > 1:
        diff = differing_keys(runs)
        lines.append("")
        if diff:
            lines.append("config keys that differ:")
            lines += _table(["key", *labels], [[key, *(_value(v) for v in values)] for key, values in diff.items()])
        else:
            lines.append("config: identical in every run")
        env = _differing_info(runs)
        if env:
            lines.append("")
            lines.append("environment that differs:")
            lines += _table(["key", *labels], [[key, *(_value(v) for v in values)] for key, values in env.items()])
    return "\n".join(lines) + "\n"


def _differing_info(runs: list[Run]) -> dict[str, list]:
    diff = {}
    for key in ENVIRONMENT:
        values = [run.info.get(key) for run in runs]
        if any(v != values[0] for v in values[1:]):
            diff[key] = values
    return diff


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    widths = [max(len(str(row[i])) for row in [header, *rows]) for i in range(len(header))]
    return ["  ".join(str(cell).ljust(width) for cell, width in zip(row, widths)).rstrip() for row in [header, *rows]]


def _num(value, fmt: str) -> str:
    return fmt.format(value) if _finite(value) else "-"


def _value(value) -> str:
    if value is None:
        return "(unset)"
    # default=str: TOML's dates, which JSON has not
    return json.dumps(value, default=str) if isinstance(value, (str, list, dict, bool)) else str(value)


PLOT_FORMATS = ("png", "svg", "pdf")
X_AXES = {"steps": "step", "tokens": "tokens seen"}


def plot(runs: list[Run], out: str | Path, x: str = "steps") -> Path:
    """Draw the runs' curves (see `figure`) into `out`, as its suffix says: PNG, SVG or PDF."""
    out = Path(out)
    fmt = plot_format(out)
    try:
        figure(runs, x).savefig(out, format=fmt, dpi=100)
    except OSError as e:
        raise CompareError(f"cannot write the plot to {out}: {e.strerror or e}") from None
    return out


def plot_format(out: Path) -> str:
    """The format `out` names by its suffix, once its folder is known to exist: CompareError otherwise."""
    fmt = out.suffix.lower().lstrip(".")
    if fmt not in PLOT_FORMATS:
        raise CompareError(f"--plot {out}: name a .png, .svg or .pdf file (the format follows the suffix)")
    if not out.parent.is_dir():
        raise CompareError(f"cannot write the plot to {out}: folder {out.parent} does not exist")
    return fmt


def figure(runs: list[Run], x: str = "steps"):
    """One panel per metric, one colour per run, against steps or tokens seen (`x`): loss (validation dashed),
    learning rate, grad norm, tokens/s, and MFU, the validation sets' losses and the eval tasks' scores when a run
    logged them. A run that did not log a metric is left
    out of its panel."""
    import_extra("matplotlib", "plot", "titan compare --plot")
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import FuncFormatter, PercentFormatter

    panels = _panels(runs)
    titles = {"loss": "loss", "lr": "learning rate", "grad_norm": "grad norm", "tokens_per_s": "tokens/s",
              "mfu": "MFU", "expert_load": "expert load / mean (worst layer: most, least dotted)",
              "val/": "validation sets: loss", "eval/": "eval tasks"}  # fmt: skip
    columns = 2 if len(panels) == 4 else 3
    rows = math.ceil(len(panels) / columns)
    fig = Figure(figsize=(5 * columns, 3.6 * rows), layout="constrained")
    FigureCanvasAgg(fig)
    grid = list(fig.subplots(rows, columns).flat)
    axes, spare = dict(zip(panels, grid)), grid[len(panels) :]
    readable = FuncFormatter(lambda value, _: short_number(value))
    for i, (label, run) in enumerate(zip(run_labels(runs), runs)):
        curve, colour = run.curve, f"C{i}"
        at = _x_of(curve, x)
        style = {"color": colour, "marker": "o" if len(curve) <= 30 else None, "markersize": 3, "linewidth": 1.5}
        for key, ax in axes.items():
            if key in ("expert_load", "val/", "eval/"):
                continue
            points = [(at(r["step"]), r[key]) for r in curve if _finite(r.get(key)) and at(r["step"]) is not None]
            if points:
                ax.plot(*zip(*points), label=label, **style)
        loads = [(at(r["step"]), *expert_load(r)) for r in curve if expert_load(r) and at(r["step"]) is not None]
        if loads:
            steps, most, least = zip(*loads)
            axes["expert_load"].plot(steps, most, label=label, **style)
            axes["expert_load"].plot(steps, least, **{**style, "linestyle": ":"})
        for panel in ("val/", "eval/"):
            if panel in axes:
                _named_curves(axes[panel], panel, run, label, at, style)
        validation = [(at(r["step"]), r["val_loss"]) for r in run.validation if at(r["step"]) is not None]
        if validation:
            axes["loss"].plot(*zip(*validation), color=colour, linestyle="--", marker="s", markersize=3,
                              label=f"{label} (validation)")  # fmt: skip
    for key in ("val/", "eval/"):  # these panels name their curves themselves
        if key in axes:
            axes[key].legend(fontsize="small")
    for key, ax in axes.items():
        ax.set(title=titles[key], xlabel=X_AXES[x])
        ax.xaxis.set_major_formatter(readable)
        ax.grid(alpha=0.3)
    axes["tokens_per_s"].yaxis.set_major_formatter(readable)
    if "mfu" in axes:
        axes["mfu"].yaxis.set_major_formatter(PercentFormatter(xmax=1))
    if spare:  # the runs' legend in the grid's first empty slot, else over the loss panel
        spare[0].axis("off")
        spare[0].legend(*axes["loss"].get_legend_handles_labels(), loc="center", title="runs")
    else:
        axes["loss"].legend(fontsize="small")
    for ax in spare[1:]:
        ax.remove()
    return fig


def _panels(runs: list[Run]) -> list[str]:
    """The panels the runs have something for: MFU, expert loads, validation sets and tasks only when logged."""
    logged = {
        "mfu": any("mfu" in r for run in runs for r in run.curve),
        "expert_load": any(expert_load(r) for run in runs for r in run.curve),
        "val/": any(run.keys("val/", "/loss") for run in runs),
        "eval/": any(run.keys("eval/") for run in runs),
    }
    return ["loss", "lr", "grad_norm", "tokens_per_s", *(panel for panel, found in logged.items() if found)]


def _named_curves(ax, panel: str, run: Run, label: str, at, style: dict) -> None:
    """The run's validation sets' losses ("val/") or its tasks' scores ("eval/") in its colour, a marker each."""
    keys = run.keys("val/", "/loss") if panel == "val/" else run.keys("eval/")
    for j, key in enumerate(keys):
        points = [(at(r["step"]), r[key]) for r in run.series(key) if at(r["step"]) is not None]
        name = key.removeprefix(panel).removesuffix("/loss")
        if points:
            ax.plot(*zip(*points), label=f"{label}: {name}",
                    **{**style, "marker": "os^Dv*"[j % 6], "linestyle": ("-", "--", ":", "-.")[j % 4]})  # fmt: skip


def expert_load(record: dict) -> tuple[float, float] | None:
    """A mixture of experts' logged step: its most loaded expert's tokens over the mean in its worst layer, and its
    least loaded one's in its worst layer; None for a dense model's."""
    most = [v for k, v in record.items() if k.startswith("moe/load_max/") and _finite(v)]
    least = [v for k, v in record.items() if k.startswith("moe/load_min/") and _finite(v)]
    return (max(most), min(least)) if most and least else None


def _x_of(curve: list[dict], x: str):
    """step -> its x value: the step itself, or the tokens seen by then (interpolated between logged steps, as
    validation records carry no count of their own); None where a run logged no token counts."""
    if x == "steps":
        return lambda step: step
    known = [(r["step"], r["tokens_seen"]) for r in curve if _finite(r.get("tokens_seen"))]
    if not known:
        return lambda step: None
    steps, tokens = zip(*known)
    return lambda step: float(np.interp(step, steps, tokens))


def short_number(value: float) -> str:
    """A tick label people read: 950, 12k, 1.2M, 1.25M, 3B (at most two decimals, no trailing zeros)."""
    for scale, suffix in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "k")):
        if abs(value) >= scale:
            return f"{value / scale:.2f}".rstrip("0").rstrip(".") + suffix
    return f"{value:.4g}"
