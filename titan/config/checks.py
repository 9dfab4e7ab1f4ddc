"""The checks of a recipe's values (its types are already right), section by section: each section's first wrong
value is a ConfigError that names its key, and a recipe's are reported together."""

from __future__ import annotations

import dataclasses
import logging
import math

from titan.config.data_checks import validate_data, validate_evaluation
from titan.config.layout import Layout
from titan.config.resume_keys import MATH_KEYS, PREPARED_KEYS
from titan.config.sections import Config, Parallel
from titan.config.stages import Stage, decay_start
from titan.errors import ConfigError, Mistakes, require
from titan.hub import model_folder

log = logging.getLogger("titan")


def validate(config: Config, world_size: int, mistakes: Mistakes | None = None) -> None:
    """Check the values of a recipe whose types are right, section by section: each section's first wrong value
    is a ConfigError that names its key, all raised at once, or, given `mistakes`, added there."""
    found = Mistakes() if mistakes is None else mistakes
    before = len(found.found)
    for check in (_validate_run, validate_data, validate_evaluation, _validate_recovery, _validate_performance):
        with found.gather():
            check(config)
    with found.gather():
        _validate_parallel(config.parallel)
        # What the degrees make, once each is valid.
        _validate_context_parallel(config)
        _validate_layout(config, world_size)
    if len(found.found) == before:  # after the keys' own checks, whose messages say more
        with found.gather():
            _require_finite(config)
    if mistakes is None:
        found.raise_any()


def _validate_run(config: Config) -> None:
    """The job, the step's sizes, the optimizer and its lr schedule, metrics and profiling."""
    t = config.training
    require(
        config.job.name.strip() != "" and "/" not in config.job.name,
        f"job.name must be a non-empty folder name, got {config.job.name!r}",
    )
    require(t.steps > 0, f"training.steps must be positive, got {t.steps}")
    require(t.seq_len > 0, f"training.seq_len must be positive, got {t.seq_len}")
    require(t.local_batch_size > 0, f"training.local_batch_size must be positive, got {t.local_batch_size}")
    require(
        t.global_batch_size >= 0,
        f"training.global_batch_size must be positive (or 0 for local x data-parallel), got {t.global_batch_size}",
    )
    require(t.max_grad_norm >= 0, f"training.max_grad_norm must be >= 0 (0 disables clipping), got {t.max_grad_norm}")
    o = config.optimizer
    require(o.lr > 0, f"optimizer.lr must be positive, got {o.lr}")
    require(
        0 <= o.beta1 < 1 and 0 <= o.beta2 < 1, f"optimizer.beta1 and beta2 must be in [0, 1), got {o.beta1}, {o.beta2}"
    )
    require(o.eps > 0 and o.weight_decay >= 0, "optimizer.eps must be > 0 and optimizer.weight_decay >= 0")
    require(not o.qk_clip_tau < 0, f"optimizer.qk_clip_tau must be >= 0 (0: off), got {o.qk_clip_tau}")
    s = config.lr_scheduler
    require(s.warmup_steps >= 0, f"lr_scheduler.warmup_steps must be >= 0, got {s.warmup_steps}")
    require(0 <= s.min_lr_ratio <= 1, f"lr_scheduler.min_lr_ratio must be in [0, 1], got {s.min_lr_ratio}")
    require(0 < s.wsd_decay_ratio <= 1, f"lr_scheduler.wsd_decay_ratio must be in (0, 1], got {s.wsd_decay_ratio}")
    require(config.metrics.log_freq > 0, f"metrics.log_freq must be positive, got {config.metrics.log_freq}")
    f = config.profiling
    require(
        f.wait >= 0 and f.warmup >= 0 and f.active >= 1,
        f"profiling.wait and warmup must be >= 0 and active >= 1, got {f.wait}, {f.warmup}, {f.active}",
    )
    require(config.metrics.peak_flops >= 0, f"metrics.peak_flops must be >= 0, got {config.metrics.peak_flops}")


NO_TOKENIZER = "the recipe names no tokenizer: set tokenizer.path (a tokenizer.json, a model folder or a hub name)"
NO_DATA = (
    "the recipe names no data: set data.source (a .jsonl, .parquet or .txt file or folder, a hub dataset or "
    "titan:shakespeare), [[data.sources]] or [[data.stages]]"
)


def require_inputs(config: Config) -> None:
    """What a run reads besides its recipe, named there: a tokenizer (or weights that bring their own:
    checkpoint.init_from_hf's, a checkpoint.resume path's), data, and checkpoint.init_from_hf's model, found. The
    commands that train, show or prepare a run check it; `titan plan` reads none of them."""
    c, found = config.checkpoint, Mistakes()
    if c.init_from_hf:
        with found.gather():
            model_folder(c.init_from_hf, "checkpoint.init_from_hf")
    brings_tokenizer = c.init_from_hf or c.resume not in ("auto", "never")
    with found.gather():
        require(config.tokenizer.path != "" or bool(brings_tokenizer), NO_TOKENIZER)
    with found.gather():
        require(config.data.source != "" or bool(config.data.sources) or bool(config.data.stages), NO_DATA)
    found.raise_any()


def warn_of_a_wasted_schedule(config: Config, stages: list[Stage]) -> None:
    """What trains all the same but wastes the lr schedule, said by the commands that train or show the run (not by
    those that only read the recipe): a run shorter than its warmup (a smoke run of a long recipe), whose lr never
    reaches its peak, and a decay stage (of the run's `stages`) that starts inside the warmup, whose decay waits for
    the warmup's end."""
    steps, warmup = config.training.steps, config.lr_scheduler.warmup_steps
    if warmup > steps:
        log.warning(
            "lr_scheduler.warmup_steps (%d) is longer than the run (training.steps %d): the learning rate warms up "
            "over the whole run and never reaches optimizer.lr",
            warmup,
            steps,
        )
    start = decay_start(stages)
    if start is not None and start < min(warmup, steps):
        stage = next(s for s in stages if s.decay)
        log.warning(
            "data.stages[%d] %r starts the lr decay at step %d, inside the warmup (lr_scheduler.warmup_steps %d): "
            "the decay begins only when the warmup ends, and the lr never holds at optimizer.lr; start the stage "
            "later or shorten the warmup",
            stage.index, stage.name, start + 1, warmup,
        )  # fmt: skip


def _validate_parallel(p: Parallel) -> None:
    """The parallel degrees and the pipeline's stage hints, whatever the world size."""
    for name in ("dp_replicate", "cp", "tp", "pp", "ep"):
        require(getattr(p, name) >= 1, f"parallel.{name} must be >= 1, got {getattr(p, name)}")
    require(
        all(0 < x < math.inf for x in p.pp_stage_speeds),
        f"parallel.pp_stage_speeds must all be > 0 and finite (relative speeds), got {p.pp_stage_speeds}",
    )
    require(
        all(x > 0 for x in p.pp_stage_memory_gib),
        f"parallel.pp_stage_memory_gib must all be GiB > 0, got {p.pp_stage_memory_gib}",
    )
    require(
        not (p.pp_stage_memory_gib and p.pp_layers_per_stage),
        "parallel.pp_stage_memory_gib caps the layer split titan chooses, but parallel.pp_layers_per_stage sets it; "
        "leave one of them empty",
    )
    require(
        p.dp_shard >= 1 or p.dp_shard == -1,
        f"parallel.dp_shard must be >= 1 or -1 (use what is left), got {p.dp_shard}",
    )


def _validate_recovery(config: Config) -> None:
    """Skipped steps and checkpoints."""
    t = config.training
    require(t.max_skipped_steps >= 1, f"training.max_skipped_steps must be >= 1, got {t.max_skipped_steps}")
    c = config.checkpoint
    require(c.interval > 0, f"checkpoint.interval must be positive, got {c.interval}")
    checked = MATH_KEYS + PREPARED_KEYS
    unknown = [k for k in c.allow_changes if not any(k == m or m.startswith(k + ".") for m in checked)]
    require(
        not unknown,
        f"checkpoint.allow_changes: {', '.join(unknown)} not checked on resume; the keys that are: "
        f"{', '.join(checked)}",
    )
    require(c.keep_latest_k >= 0, f"checkpoint.keep_latest_k must be >= 0 (0 keeps all), got {c.keep_latest_k}")
    require(c.resume != "", "checkpoint.resume must be 'auto', 'never' or a checkpoint path")
    parts = {"model", "optimizer", "lr_scheduler", "data", "train_state"}
    require(set(c.load_only) <= parts, f"checkpoint.load_only entries must be among {sorted(parts)}, got {c.load_only}")
    f = config.fault
    require(
        0 <= f.step_timeout_s < float("inf"),
        f"fault.step_timeout_s must be seconds >= 0 (0: off), got {f.step_timeout_s}",
    )
    require(
        0 <= f.peer_silence_s < float("inf"),
        f"fault.peer_silence_s must be seconds >= 0 (0: off), got {f.peer_silence_s}",
    )
    require(
        0 < f.collective_timeout_s < float("inf"),
        f"fault.collective_timeout_s must be seconds > 0, got {f.collective_timeout_s}",
    )
    require(
        f.snapshot_interval == "auto" or f.snapshot_interval >= 0,
        f"fault.snapshot_interval must be steps >= 0 (0: off) or 'auto', got {f.snapshot_interval}",
    )
    require(
        0 < f.snapshot_overhead < float("inf"),
        f"fault.snapshot_overhead must be a fraction of the step time > 0 (0.03: 3%), got {f.snapshot_overhead}",
    )


def _validate_performance(config: Config) -> None:
    """float8, the plan's device, activation checkpointing, the straggler probe and the replay's spike watch."""
    f8 = config.float8
    require(
        not f8.enable_fsdp_float8_all_gather or f8.recipe == "tensorwise",
        f"float8.enable_fsdp_float8_all_gather needs float8.recipe = 'tensorwise' (torchao all-gathers float8 weights "
        f"with one scale per tensor), got {f8.recipe!r}",
    )
    require(
        not f8.precompute_dynamic_scale or f8.enable_fsdp_float8_all_gather,
        "float8.precompute_dynamic_scale only serves float8.enable_fsdp_float8_all_gather; enable that too, or turn "
        "it off",
    )
    require(
        all(s.strip() for s in f8.skip),
        f"float8.skip entries must be non-empty module-name substrings, got {f8.skip!r}",
    )
    target = config.plan
    require(
        0 <= target.headroom_fraction < 1, f"plan.headroom_fraction must be in [0, 1), got {target.headroom_fraction}"
    )
    for name in ("peak_flops", "memory_gib", "hbm_gbs", "intra_node_gbs", "inter_node_gbs", "gpus_per_node"):
        require(getattr(target, name) >= 0, f"plan.{name} must be >= 0 (0: the device's), got {getattr(target, name)}")
    require(
        1 <= target.moe_load_imbalance < float("inf"),
        f"plan.moe_load_imbalance must be >= 1 (the most loaded expert-parallel rank's routed tokens over the mean; "
        f"1: balanced), got {target.moe_load_imbalance}",
    )
    a = config.activation_checkpoint
    require(a.every >= 1, f"activation_checkpoint.every must be >= 1, got {a.every}")
    require(
        0 <= a.budget_gib < float("inf"),
        f"activation_checkpoint.budget_gib must be GiB >= 0 (0: what the device leaves), got {a.budget_gib}",
    )
    if a.mode == "auto":
        require(
            not config.compile.enable,
            "activation_checkpoint.mode = 'auto' measures eager blocks, which compiled ones do not match; set "
            "compile.enable = false, or use mode 'full' or 'selective'",
        )
    g = config.straggler
    require(g.threshold >= 1, f"straggler.threshold must be >= 1 (times the fastest rank's time), got {g.threshold}")
    require(g.hysteresis > 0, f"straggler.hysteresis must be > 0, got {g.hysteresis}")
    require(g.interval >= 1 and g.window >= 1, "straggler.interval and straggler.window must be >= 1")
    r = config.replay
    require(r.spike_zscore >= 0, f"replay.spike_zscore must be >= 0 (0: off), got {r.spike_zscore}")
    # A deviation needs a few steps to mean anything.
    require(r.spike_window >= 3, f"replay.spike_window must be >= 3 steps, got {r.spike_window}")
    needs = {
        "replay.digests = true": r.digests,  # what the replay is compared with
        "replay.spike_zscore > 0": r.spike_zscore > 0,  # what flags a step
        "fault.snapshot_interval > 0": bool(config.fault.snapshot_interval),  # the state it starts from
        "straggler.enable = false": not g.enable,  # a re-plan after the snapshot would change the step's shares
    }
    missing = [need for need, met in needs.items() if not met]
    require(
        not r.on_spike or not missing,
        f"replay.on_spike replays a spiked step in the run from the in-memory snapshot before it and compares it "
        f"with its digests: it needs {', '.join(missing)}; set {'them' if len(missing) > 1 else 'it'}, or "
        "replay.on_spike = false",
    )


def _validate_context_parallel(config: Config) -> None:
    """What parallel.cp > 1 asks of the sequence length and the batching."""
    t, p, d = config.training, config.parallel, config.data
    if p.cp > 1:
        require(
            t.seq_len % (2 * p.cp) == 0,
            f"training.seq_len {t.seq_len} must divide into 2 x parallel.cp = {2 * p.cp} equal chunks (each rank "
            f"holds two, one from each end, to even out causal attention); use a multiple of {2 * p.cp}",
        )
        if d.batching == "tokens":
            require(
                (d.max_document_len or t.seq_len) <= t.seq_len,
                f"data.max_document_len {d.max_document_len} is longer than training.seq_len {t.seq_len}: with "
                "parallel.cp > 1 a document runs whole, at most in one ring row of seq_len tokens; lower "
                "max_document_len or raise seq_len",
            )
            require(
                t.local_batch_size == 1,
                f"training.local_batch_size {t.local_batch_size} with parallel.cp > 1 and data.batching = 'tokens': "
                "a micro-batch is one row of training.seq_len tokens per cp group (a ring, or a row of seq_len / cp "
                "for each rank); set local_batch_size = 1 (raise seq_len for larger micro-batches)",
            )
        # What context parallelism does not compose with yet, and why (docs/context-parallel.md).
        unsupported = {
            "data.batching = 'tokens' and parallel.pp > 1": (
                d.batching == "tokens" and p.pp > 1,
                "a pipeline's fixed micro-batch shapes do not switch between ring and local micro-batches",
            ),
        }
        for what, (used, why) in unsupported.items():
            require(
                not used, f"parallel.cp > 1 with {what} is not supported yet: {why}; set parallel.cp = 1 or drop it"
            )


def _validate_layout(config: Config, world_size: int) -> None:
    """What depends on the world size: the data-parallel weights and the straggler re-plan."""
    p, g = config.parallel, config.straggler
    # The parallel layout and the batch arithmetic both depend on the world size.
    dp = Layout.from_config(p, world_size).dp
    require(
        not g.enable or p.pp == 1 or dp == 1,
        "straggler.enable re-plans the data shares, or with parallel.pp > 1 the layer split; with both data and "
        "pipeline parallelism it is not supported yet: turn it off, or use one of them",
    )
    if p.dp_weights:
        require(
            len(p.dp_weights) == dp,
            f"parallel.dp_weights has {len(p.dp_weights)} entries but there are {dp} data-parallel ranks; "
            "give one weight per rank",
        )
        require(
            all(0 < w < math.inf for w in p.dp_weights),
            f"parallel.dp_weights must all be > 0 and finite (relative speeds), got {p.dp_weights}",
        )


# The float keys for which infinity means something: no limit (on the size titan prepares itself; on a stage's GiB).
MAY_BE_INFINITE = ("data.auto_prepare_max_mb", "parallel.pp_stage_memory_gib")


def _require_finite(config: Config) -> None:
    """Every float of the recipe finite (its lists and model.overrides included), but infinity where it means no
    limit: NaN and infinity pass a range check as `not x < 0`, and a key checked as `x > 0` lets infinity by.
    After the keys' own checks, whose messages say more."""
    for key, value in _floats(config, ""):
        if not (math.isfinite(value) or (value == math.inf and key.split("[")[0] in MAY_BE_INFINITE)):
            raise ConfigError(f"{key} must be a finite number, got {value}")


def _floats(value, key: str):
    """(dotted key, value) of every float in `value`: a dataclass, a table, a list or a number."""
    if dataclasses.is_dataclass(value):
        for f in dataclasses.fields(value):
            yield from _floats(getattr(value, f.name), f"{key}.{f.name}" if key else f.name)
    elif isinstance(value, dict):
        for name, item in value.items():
            yield from _floats(item, f"{key}.{name}")
    elif isinstance(value, list):
        for i, item in enumerate(value):
            yield from _floats(item, f"{key}[{i}]")
    elif isinstance(value, float):
        yield key, value
