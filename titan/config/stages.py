"""The data a run reads, step by step: the length of a mixture's blend pattern, and the steps of each
[[data.stages]] table, resolved from its start step or token count and the run's global batch. Torch-free: the
pre-flight checks the stages and `titan config show` prints them before torch is imported."""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass, replace

from titan.config.data_sections import BLEND_PERIOD, MAX_BLEND_PERIOD, blend_period  # noqa: F401 (re-exported)
from titan.config.sections import Config, DataSource, DataStage
from titan.errors import ConfigError, require


@dataclass(frozen=True)
class Stage:
    """A stage as the run trains it: its steps [first_step, end_step) and its mixture."""

    index: int
    name: str
    first_step: int
    end_step: int
    sources: list[DataSource]
    streams: list[int]  # each source's index among the run's (data.source_list()): one shuffled order each
    decay: bool  # the wsd schedule's decay starts at first_step


def run_stages(config: Config, global_rows: int) -> list[Stage]:
    """The run's stages in order: [[data.stages]], or one stage of data.source or [[data.sources]] over the whole
    run. A stage that starts where or before the one before it is refused; one that starts past the run's end is
    kept (a short run of a long recipe), with no step."""
    d, t = config.data, config.training
    tables = d.stages or [DataStage(sources=d.source_list())]
    tokens_per_step = global_rows * t.seq_len
    firsts = [table.start_step or -(-table.start_tokens // tokens_per_step) for table in tables]
    for i in range(1, len(tables)):
        require(
            firsts[i] > firsts[i - 1],
            f"data.stages[{i}] starts at step {firsts[i]}{_as_tokens(tables[i], tokens_per_step)}, not after "
            f"data.stages[{i - 1}] (step {firsts[i - 1]}); give the stages in the order they train, each starting "
            "later than the one before",
        )
    ends = [*firsts[1:], max(firsts[-1], t.steps)]
    every = d.source_list()
    return [
        Stage(
            i,
            table.name or f"stage{i}",
            min(first, t.steps),
            min(end, t.steps),
            table.sources,
            # A plain mixture reads each table as its own stream, a repeated one too, as before stages.
            [every.index(replace(s, weight=1.0)) for s in table.sources]
            if d.stages
            else list(range(len(table.sources))),
            table.decay,
        )
        for i, (table, first, end) in enumerate(zip(tables, firsts, ends))
    ]


def stage_at(stages: list[Stage], step: int) -> Stage:
    """The stage that trains 0-based step `step`."""
    return stages[bisect.bisect_right([stage.first_step for stage in stages], step) - 1]


def _as_tokens(table: DataStage, tokens_per_step: int) -> str:
    return f" (start_tokens {table.start_tokens} at {tokens_per_step} tokens a step)" if table.start_tokens else ""


def decay_start(stages: list[Stage]) -> int | None:
    """The step the stage with decay = true starts at (where the wsd schedule decays from), else None."""
    return next((stage.first_step for stage in stages if stage.decay), None)


def describe_stages(stages: list[Stage], tokens_per_step: int) -> list[str]:
    """One line per stage: its steps (numbered from 1, as the log numbers them), the tokens trained before its
    first step and after its last, and its mixture, as `titan config show` prints them."""
    lines = []
    for s in stages:
        total = sum(source.weight for source in s.sources)
        mixture = ", ".join(f"{source.source} {source.weight / total:.3g}" for source in s.sources)
        steps = s.end_step - s.first_step
        when = (
            f"steps {s.first_step + 1}-{s.end_step} ({steps} steps), tokens {s.first_step * tokens_per_step:,}-"
            f"{s.end_step * tokens_per_step:,}"
            if steps
            else "no step: it starts after the run's last"
        )
        decays = "; the lr decays from its first step (wsd)" if s.decay else ""
        lines.append(f"data stage {s.index} {s.name!r}: {when}: {mixture}{decays}")
    return lines


def check_stages(config: Config) -> None:
    """What [[data.stages]] asks, before the run's global batch is known (run_stages checks their order)."""
    d = config.data
    if not d.stages:
        return
    require(
        not d.source and not d.sources,
        "data.stages names each stage's sources: leave data.source and [[data.sources]] out (move them into "
        "[[data.stages.sources]] of the first stage)",
    )
    require(
        d.batching == "rows",
        "data.stages with data.batching = 'tokens' is not supported: its steps hold varying tokens and its position "
        "is a document, not a sample; use data.batching = 'rows'",
    )
    decaying = [i for i, stage in enumerate(d.stages) if stage.decay]
    require(
        not decaying or config.lr_scheduler.decay == "wsd",
        f"data.stages[{decaying[0] if decaying else 0}].decay = true starts the warmup-stable-decay schedule's "
        f"decay, but lr_scheduler.decay is {config.lr_scheduler.decay!r}; set lr_scheduler.decay = 'wsd'",
    )
    require(
        len(decaying) <= 1,
        f"data.stages {decaying} all set decay = true; the lr decays once, from one stage's start",
    )
    for i, stage in enumerate(d.stages):
        key = f"data.stages[{i}]"
        require(stage.start_step >= 0 and stage.start_tokens >= 0, f"{key}.start_step and start_tokens must be >= 0")
        require(
            not (stage.start_step and stage.start_tokens),
            f"{key} sets both start_step ({stage.start_step}) and start_tokens ({stage.start_tokens}); set one",
        )
        require(
            i > 0 or not (stage.start_step or stage.start_tokens),
            f"{key} starts at {stage.start_step or stage.start_tokens} {'steps' if stage.start_step else 'tokens'}; "
            "the first stage starts the run: leave its start_step and start_tokens out",
        )
        require(bool(stage.sources), f"{key} has no sources; add [[data.stages.sources]] tables under it")
        named = [replace(source, weight=1.0) for source in stage.sources]
        for j, source in enumerate(named):
            require(
                source not in named[:j],
                f"{key}.sources[{j}] repeats {source.source!r} of {key}.sources[{named.index(source)}]; give the "
                "source one table, with the weights summed",
            )
        check_mixture(stage.sources, f"{key}.sources")


def check_mixture(sources: list[DataSource], key: str) -> None:
    """Each source of a mixture (`key`: data.sources, or a stage's) named, with a weight > 0 that the blend
    pattern can honour."""
    for i, source in enumerate(sources):
        require(source.source != "", f"{key}[{i}].source must name a local file, folder or hub dataset")
        require(
            0 < source.weight < math.inf,
            f"{key}[{i}].weight must be > 0 and finite (a share of the mixture), got {source.weight}",
        )
    weights = [s.weight for s in sources]
    try:
        blend_period(weights)
    except ValueError:
        i = weights.index(min(weights))
        # The smallest weight that works, 1% up so that rounding it to 3 digits cannot take it below.
        smallest = (sum(weights) - weights[i]) / (MAX_BLEND_PERIOD - 1) * 1.01
        raise ConfigError(
            f"{key}[{i}].weight = {weights[i]} is {weights[i] / sum(weights):.3g} of the mixture, under one "
            f"sample in {MAX_BLEND_PERIOD} (the longest blend pattern), so it would get none; raise it to at "
            f"least {smallest:.3g}, or drop the source"
        ) from None
