"""The recipe schema: typed dataclasses, loaded from TOML plus dotted CLI overrides, validated once.

Every user mistake raises `ConfigError` with a one-line message that names the key; the CLI prints it
and exits with status 2. Nothing else in titan parses recipe text.
"""

from __future__ import annotations

import dataclasses
import difflib
import logging
import math
import os
import re
import tomllib
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import tomli_w

from titan.errors import ConfigError
from titan.schema import Integer, Table, parse_toml

log = logging.getLogger("titan")


@dataclass(frozen=True)
class Job:
    name: str = "titan"  # the run's folder under output_dir, and its name in trackers
    output_dir: str = "outputs"  # the run writes to <output_dir>/<name>
    seed: int = 0  # initialisation, data order and dropout all follow from it
    deterministic: bool = False  # torch.use_deterministic_algorithms; bitwise-repeatable runs
    recipe: str = ""  # the recipe file the run came from (filled in by load_config); trackers group runs by it


@dataclass(frozen=True)
class Model:
    name: str = "llama3"  # the model family (titan/models registry)
    flavor: str = "debug"  # its size: debug, 1B, 3B, 8B, 70B, 405B
    # Any field of the model's args, e.g. {n_layers = 4, resid_dropout = 0.1}; checked when the model is built.
    overrides: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Tokenizer:
    path: str = "data/tokenizer.json"  # a HF tokenizers `tokenizer.json`
    bos_token: str = "<|begin_of_text|>"  # starts every document
    eos_token: str = "<|end_of_text|>"  # ends every document


@dataclass(frozen=True)
class DataSource:
    """One source of documents, prepared once into token shards (see titan/data/prepared.py)."""

    # A local file or folder (text, jsonl/json, parquet), a HF hub dataset name (in the HF cache when offline),
    # or a corpus titan fetches and caches itself ("titan:shakespeare").
    source: str = "data/stories.jsonl"
    format: Literal["auto", "text", "json", "parquet", "hub"] = "auto"  # auto: from the files' suffixes
    text_field: str = "text"  # the record field holding the document's text (json, parquet, hub)
    split: str = "train"  # the hub dataset's split
    subset: str = ""  # the hub dataset's configuration name, if it has several
    # The hub dataset's revision (branch, tag or commit; "" = its default branch), part of the prepared tokens' key:
    # pin a commit to read, and reuse, the same documents whatever the hub holds later.
    revision: str = ""
    weight: float = 1.0  # in a mixture: this source's share of the training samples, relative to the others


# A mixture's sources take turns in a pattern of samples, repeated (titan/data/loader.py's Blend), in which each
# source has its share to within one sample. A share under one sample in BLEND_PERIOD would get none, so the
# pattern doubles until every share has one: honoured rather than refused, as a longer pattern costs only memory
# (16 bytes a sample); validate refuses a share that even MAX_BLEND_PERIOD cannot hold.
BLEND_PERIOD, MAX_BLEND_PERIOD = 4096, 2**20


def blend_period(weights: list[float]) -> int:
    """Samples in one repeat of the blend pattern of sources with these weights."""
    period = BLEND_PERIOD
    while min(weights) / sum(weights) * period < 1:
        if period >= MAX_BLEND_PERIOD:
            raise ValueError(f"a mixture share of {min(weights) / sum(weights):.3g} is under 1/{MAX_BLEND_PERIOD}")
        period *= 2
    return period


@dataclass(frozen=True)
class Data:
    # One source (the keys mean what they mean in DataSource) ...
    source: str = "data/stories.jsonl"  # a local file or folder, a HF hub dataset, or "titan:shakespeare"
    format: Literal["auto", "text", "json", "parquet", "hub"] = "auto"
    text_field: str = "text"
    split: str = "train"
    subset: str = ""
    revision: str = ""
    # ... or a mixture: several [[data.sources]] blended by weight; the single-source keys are then unused.
    sources: list[DataSource] = field(default_factory=list)
    shuffle: bool = True  # shuffle documents every epoch, by (seed, epoch)
    # Tokens attend only within their own document and positions restart at each document.
    document_mask: bool = True
    # What a step trains on. "rows": global_batch_size windows of seq_len tokens cut from the document stream.
    # "tokens": whole documents (split at max_document_len) up to global_batch_size x seq_len tokens, which
    # ranks and micro-batches share out by `balance`: "cost" (predicted time, with cost_model) or "tokens".
    batching: Literal["rows", "tokens"] = "rows"
    balance: Literal["cost", "tokens"] = "cost"  # tokens batching: how documents are placed (see batching)
    max_document_len: int = 0  # tokens batching: longer documents are split into pieces; 0 = training.seq_len
    # tokens batching: [a, b, c], a micro-batch's seconds c + the sum over its documents of a·s² + b·s;
    # [] = measured at start-up (cached per model, layout and device).
    cost_model: list[float] = field(default_factory=list)
    cache_dir: str = ""  # prepared token shards; "" = $TITAN_CACHE/prepared (TITAN_CACHE defaults to ~/.cache/titan)
    prepare_workers: int = 0  # tokenizer processes for `titan data prepare`; 0 = min(8, CPU count)
    # `titan train` prepares a missing local source itself up to this size; larger ones need `titan data prepare`.
    auto_prepare_max_mb: float = 1024.0

    def source_list(self) -> list[DataSource]:
        """The sources to blend: [[data.sources]], or the single source these keys describe."""
        if self.sources:
            return self.sources
        return [DataSource(self.source, self.format, self.text_field, self.split, self.subset, self.revision, 1.0)]


@dataclass(frozen=True)
class Validation:
    interval: int = 0  # evaluate every N steps (and at the end); 0 disables validation
    steps: int = 4  # global batches per evaluation (the same batches every time)
    # Held-out documents: this fraction of every training source, chosen by a hash of the document's index
    # (the same split for every seed, and for a source that grows), or a separate source when `source` is set.
    fraction: float = 0.05
    source: str = ""  # a separate source of validation documents; "" = hold out `fraction` of the training ones
    format: Literal["auto", "text", "json", "parquet", "hub"] = "auto"
    text_field: str = "text"
    split: str = "validation"
    revision: str = ""


@dataclass(frozen=True)
class Training:
    local_batch_size: int = 8  # most sequences per micro-batch on each data-parallel rank (a memory cap)
    global_batch_size: int = (
        0  # sequences per optimizer step, whatever the layout; 0: local_batch_size x data-parallel size
    )
    seq_len: int = 256  # tokens per sequence (a row of the global batch)
    steps: int = 100  # optimizer steps to train; the lr schedule spans them
    max_grad_norm: float = 1.0  # 0 disables clipping
    mixed_precision: Literal["fp32", "bf16"] = "fp32"  # bf16: bf16 matmuls, fp32 weights and optimizer
    device: Literal["auto", "cpu", "cuda"] = "auto"  # auto: cuda when a GPU is visible
    # A step whose loss or gradient norm is NaN or inf: stop (nothing saved after the last good step), or
    # skip its update and go on, stopping after max_skipped_steps such steps in a row.
    on_nonfinite: Literal["stop", "skip"] = "stop"
    max_skipped_steps: int = 10  # on_nonfinite = "skip": stop after this many skipped steps in a row


@dataclass(frozen=True)
class Optimizer:
    name: Literal["adamw"] = "adamw"  # the optimizer
    lr: float = 3e-4  # the peak learning rate, reached after warmup
    beta1: float = 0.9  # AdamW's first-moment decay
    beta2: float = 0.95  # AdamW's second-moment decay
    eps: float = 1e-8  # added to the second moment's square root
    weight_decay: float = 0.1  # decoupled, on every parameter


@dataclass(frozen=True)
class LRScheduler:
    warmup_steps: int = 10  # linear warmup from 0 to optimizer.lr
    # After warmup: cosine/linear decay to min_lr_ratio*lr, constant, or warmup-stable-decay (wsd).
    decay: Literal["cosine", "linear", "constant", "wsd"] = "cosine"
    min_lr_ratio: float = 0.1  # the lr decays to this fraction of optimizer.lr
    wsd_decay_ratio: float = 0.2  # wsd: the last fraction of steps decays linearly


@dataclass(frozen=True)
class Metrics:
    log_freq: int = 10  # log every N steps (and the first and last)
    tensorboard: bool = True  # write TensorBoard event files into the run folder
    wandb: Literal["auto", "online", "offline", "disabled"] = "auto"  # auto: online with credentials, else off
    wandb_project: str = "titan"  # the wandb project runs go to
    # Runs of one comparison share a group ("" = the recipe's file name); tags add to the automatic ones
    # (recipe, model, layout). TensorBoard names its run folder after the group and layout too.
    wandb_group: str = ""
    wandb_tags: list[str] = field(default_factory=list)  # tags added to the automatic ones
    # Peak FLOP/s of one device for MFU; 0 picks the known GPU figure, or measures the CPU once.
    peak_flops: float = 0.0


@dataclass(frozen=True)
class Parallel:
    dp_replicate: int = 1  # HSDP: replicas of the sharded model
    dp_shard: int = -1  # FSDP shards; -1: whatever the world size leaves after the other degrees
    tp: int = 1  # tensor-parallel degree (heads and FFN split across ranks)
    # Context-parallel degree: each sequence is split across this many ranks (2·cp chunks, rank i holding chunks i
    # and 2·cp-1-i, so causal attention costs every rank alike) and attention runs as a ring (docs/context-parallel.md).
    cp: int = 1
    pp: int = 1  # pipeline-parallel degree (layers split into stages)
    backend: Literal["auto", "gloo", "nccl"] = "auto"  # auto: nccl on CUDA, gloo on CPU
    # FSDP2
    fsdp_reshard_after_forward: Literal["default", "always", "never"] = "default"  # default: never with PP, else always
    fsdp_cpu_offload: bool = False  # keep sharded parameters, gradients and optimizer states in host memory
    # Tensor parallel
    sequence_parallel: bool = True  # shard norms and residuals along the sequence between TP regions
    loss_parallel: bool = True  # cross-entropy on vocabulary-sharded logits, never gathering them
    # Pipeline parallel
    pp_schedule: str = (
        "1F1B"  # GPipe, 1F1B, Interleaved1F1B, LoopedBFS, InterleavedZeroBubble, ZBVZeroBubble, DualPipeV
    )
    pp_microbatches: int = 0  # micro-batches per local batch; 0: the number of pipeline stages
    pp_stages_per_rank: int = 0  # virtual stages; 0: 2 for multi-stage schedules, else 1
    pp_layers_per_stage: list[int] = field(default_factory=list)  # e.g. [3, 5]; empty: as even as possible
    # Relative speed of each pipeline stage's devices, e.g. [1, 3]: layers are split to even out the stages'
    # times (titan/balance.py); used when pp_layers_per_stage is empty.
    pp_stage_speeds: list[float] = field(default_factory=list)
    # The GiB each stage may give its layers' weights, gradients and Adam moments (16 bytes per fp32 parameter):
    # the split by pp_stage_speeds (even speeds when that is empty) keeps within them; empty: no cap.
    pp_stage_memory_gib: list[float] = field(default_factory=list)
    # Relative speed of each data-parallel rank (HSDP: replica-major), e.g. [1, 3]: its share of the global
    # batch's rows; empty: even shares.
    dp_weights: list[float] = field(default_factory=list)


@dataclass(frozen=True)
class Straggler:
    """Re-plan the data shares when a data-parallel rank slows down (titan/train/straggler.py)."""

    enable: bool = False  # probe the ranks' speeds and re-plan when one slows down
    interval: int = 1  # time the probe every N steps
    threshold: float = 1.2  # a rank is a straggler when the fastest is this many times quicker
    hysteresis: float = 0.3  # re-plan only when some rank's weight would move by more than this
    window: int = 7  # each rank's speed is the median of its last N probes


@dataclass(frozen=True)
class ActivationCheckpoint:
    # Recompute activations in backward: all (full), all but save_ops' outputs (selective), or per block as measured
    # and planned to fit budget_gib (auto: keep, selective, full, or on a GPU offload to host memory).
    mode: Literal["none", "full", "selective", "auto"] = "none"
    every: int = 1  # full, selective: checkpoint every Nth transformer block
    # selective: outputs of these ops are saved, everything else is recomputed in backward.
    save_ops: list[str] = field(
        default_factory=lambda: [
            "aten.mm",
            "aten._scaled_dot_product_efficient_attention",
            "aten._scaled_dot_product_flash_attention",
        ]
    )
    # auto: GiB the blocks may keep for backward, per micro-batch and rank; 0: what the device's memory leaves
    # (less plan.headroom_fraction) after everything else the step holds, as `titan plan` works it out
    budget_gib: float = 0.0


@dataclass(frozen=True)
class Profiling:
    """Traces, memory snapshots and a per-step time breakdown, into <run>/profiling/ (titan/observe/profiling.py)."""

    enable: bool = False  # trace a window of steps with the torch profiler, one file per rank
    wait: int = 1  # steps run untraced before the window
    warmup: int = 1  # steps traced but dropped (the profiler's own start-up)
    active: int = 2  # steps traced and saved
    memory: bool = False  # record allocations too: a CUDA memory snapshot, or on CPU the trace's memory events
    step_breakdown: bool = False  # log each step's data, forward, backward and optimizer seconds to metrics


@dataclass(frozen=True)
class Compile:
    enable: bool = False  # torch.compile each transformer block
    # Inductor orders each compiled graph's kernels to lower its peak memory (titan plan --graph shows the gain).
    reorder_for_peak_memory: bool = True


@dataclass(frozen=True)
class Float8:
    """Float8 matmuls for the transformer blocks' linear layers, through torchao (see titan/parallel/float8.py)."""

    enable: bool = False  # needs a GPU of compute capability 8.9+ (Ada, Hopper, Blackwell), or the CPU
    # tensorwise: one scale per tensor (fastest; the only recipe with float8 FSDP all-gather and float8 TP).
    # rowwise: one scale per row; rowwise_with_gw_hp: rowwise, with the weight gradient in high precision.
    recipe: Literal["tensorwise", "rowwise", "rowwise_with_gw_hp"] = "tensorwise"
    # FSDP all-gathers the weights in float8 (tensorwise only); no effect without FSDP (data-parallel size 1).
    enable_fsdp_float8_all_gather: bool = False
    # With float8 all-gather: compute every weight's scale in one all-reduce after the optimizer step.
    precompute_dynamic_scale: bool = False
    # Linears in the transformer blocks whose in and out features are multiples of 16 are converted, except
    # those whose name contains one of these strings. The output head is never converted.
    skip: list[str] = field(default_factory=lambda: ["output"])


@dataclass(frozen=True)
class Checkpoint:
    enable: bool = True  # save checkpoints into <run>/checkpoints
    interval: int = 500  # save every N steps (and at the end of training)
    keep_latest_k: int = 3  # 0 keeps every checkpoint
    # auto: resume from the newest complete checkpoint of this run, if any; never: start fresh;
    # anything else: the path of a checkpoint folder (or of a checkpoints/ folder: its newest step).
    resume: str = "auto"
    load_step: int = -1  # with resume = auto: this step instead of the newest
    load_only: list[str] = field(default_factory=list)  # e.g. ["model"]: weights only, a fresh optimizer and data
    async_save: bool = False  # overlap writing with training
    # On resume, the recipe keys that change the math or the tokens (see MATH_KEYS), and the prepared data
    # (data.prepared, validation.prepared), must equal the checkpoint's; list the ones meant to change, e.g.
    # ["optimizer.lr"] (or --checkpoint.allow_changes optimizer.lr,training.steps).
    allow_changes: list[str] = field(default_factory=list)
    verify: bool = True  # check every file against the checkpoint's SHA-256 manifest before loading
    # Start from a HF Llama checkpoint folder (config.json + *.safetensors) when not resuming.
    init_from_hf: str = ""


@dataclass(frozen=True)
class PlanTarget:
    """The recipe's [plan] section: the accelerator `titan plan` plans a run for (titan/tools/plan/devices.py); a
    figure set here replaces the device's own."""

    device: Literal["h100", "h200", "a100", "mi300x"] = "h100"  # the accelerator; its figures unless set below
    # Share of the device's memory left free at the peak: the CUDA context, NCCL buffers, allocator fragmentation.
    headroom_fraction: float = 0.1
    peak_flops: float = 0.0  # dense bf16 FLOP/s of one device; 0: the device's
    memory_gib: float = 0.0  # memory of one device, GiB; 0: the device's
    hbm_gbs: float = 0.0  # its memory bandwidth, GB/s; 0: the device's
    intra_node_gbs: float = 0.0  # one device's bandwidth to the others in its node, GB/s each way; 0: the device's
    inter_node_gbs: float = 0.0  # one device's bandwidth to other nodes, GB/s each way; 0: the device's
    gpus_per_node: int = 0  # devices per node; 0: the device's (8)
    host_gbs: float = 0.0  # one device's link to host memory (PCIe), GB/s each way; 0: the device's


@dataclass(frozen=True)
class Config:
    job: Job = field(default_factory=Job)
    model: Model = field(default_factory=Model)
    tokenizer: Tokenizer = field(default_factory=Tokenizer)
    data: Data = field(default_factory=Data)
    training: Training = field(default_factory=Training)
    validation: Validation = field(default_factory=Validation)
    optimizer: Optimizer = field(default_factory=Optimizer)
    lr_scheduler: LRScheduler = field(default_factory=LRScheduler)
    metrics: Metrics = field(default_factory=Metrics)
    parallel: Parallel = field(default_factory=Parallel)
    straggler: Straggler = field(default_factory=Straggler)
    activation_checkpoint: ActivationCheckpoint = field(default_factory=ActivationCheckpoint)
    compile: Compile = field(default_factory=Compile)
    profiling: Profiling = field(default_factory=Profiling)
    float8: Float8 = field(default_factory=Float8)
    checkpoint: Checkpoint = field(default_factory=Checkpoint)
    plan: PlanTarget = field(default_factory=PlanTarget)

    @property
    def run_dir(self) -> Path:
        return Path(self.job.output_dir) / self.job.name


# ---------------------------------------------------------------------------------------------
# Loading


def load_config(path: str | os.PathLike | None, overrides: list[str] = (), world_size: int | None = None) -> Config:
    """Read a recipe, apply `--section.key value` overrides, type-check and validate everything."""
    config = read_config(path, overrides)
    world_size = world_size if world_size is not None else int(os.environ.get("WORLD_SIZE", "1"))
    try:
        validate(config, world_size)
    except LayoutError:
        given = {k: v for k, v in parse_overrides(overrides) if k in [f"parallel.{d}" for d in DEGREES]}
        if not given:
            raise
        raise LayoutError(_conflict(given, path, config.parallel, world_size)) from None
    return config


DEGREES = ("dp_replicate", "dp_shard", "cp", "tp", "pp")


def _conflict(given: dict[str, str], path, p: Parallel, world_size: int) -> str:
    """Degrees that cannot make the world size, some of them set on the command line: the message names those
    first, and where each other degree came from (the recipe, or the default), so the fix is plain."""
    in_recipe = tomllib.loads(Path(path).read_text(encoding="utf-8")).get("parallel", {}) if path else {}
    others = [
        f"parallel.{d} = {getattr(p, d)} ({path if d in in_recipe else 'the default'})"
        for d in DEGREES
        if f"parallel.{d}" not in given and (getattr(p, d) != 1 or d == "dp_shard")
    ]
    product = p.dp_replicate * p.cp * p.tp * p.pp
    degrees = f"{_other_degrees(p)} = {product}"
    flags = " and ".join(f"--{k} {v}" for k, v in given.items())
    if p.dp_shard == -1:
        problem = f"{degrees} does not divide the world size {world_size}, so dp_shard = -1 (what they leave) cannot"
        fix = f"launch a multiple of {product} processes (torchrun --nproc-per-node), or change {flags}"
    else:
        problem = (
            f"{degrees} x dp_shard={p.dp_shard} is {product * p.dp_shard} processes, not the world size {world_size}"
        )
        fix = f"launch {product * p.dp_shard} processes, or change {flags}"
        if "parallel.dp_shard" not in given and world_size % product == 0:
            fix = f"add --parallel.dp_shard {world_size // product} (or -1: what the other degrees leave), or {fix}"
    verb = "do" if len(given) > 1 else "does"
    return (
        f"{flags} on the command line {verb} not fit with {', '.join(others) or 'the other degrees'}: {problem}; {fix}"
    )


def _other_degrees(p: Parallel) -> str:
    """The degrees besides dp_shard, as messages name them (cp only where it is used)."""
    cp = f" x cp={p.cp}" if p.cp != 1 else ""
    return f"dp_replicate={p.dp_replicate}{cp} x tp={p.tp} x pp={p.pp}"


def read_config(path: str | os.PathLike | None, overrides: list[str] = ()) -> Config:
    """A recipe with its overrides, type-checked but not yet validated against a world size."""
    raw: dict[str, Any] = {}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"recipe file not found: {path} (pass an existing TOML file to --config)")
        try:
            raw = parse_toml(path.read_text(encoding="utf-8"))
        except UnicodeDecodeError as e:
            raise ConfigError(f"{path} is not UTF-8 text (byte {e.start}); save the recipe as UTF-8") from None
        except ValueError as e:  # TOMLDecodeError, or nested too deep
            raise ConfigError(f"{path} is not valid TOML: {e}") from None
        except OSError as e:
            raise ConfigError(f"cannot read the recipe {path}: {e.strerror}") from None
    for key, value in parse_overrides(overrides):
        _set_dotted(raw, key, value)
    if path is not None and not raw.get("job", {}).get("recipe"):
        raw.setdefault("job", {})["recipe"] = str(path)
    return _build(Config, raw, "")


def saved_section(recipe: str, name: str):
    """Section `name` (e.g. "model") of a recipe saved as TOML text in a checkpoint, typed as load_config types it,
    its defaults where absent; ValueError naming the key otherwise. A section at a time: what reads a checkpoint's
    model or tokenizer does not depend on the other sections' keys, which another titan may have named otherwise."""
    return _convert(typing.get_type_hints(Config)[name], parse_toml(recipe).get(name, {}), name)


def parse_overrides(args: list[str]) -> list[tuple[str, str]]:
    """`--a.b 1 --c.d=x --flag` -> [("a.b", "1"), ("c.d", "x"), ("flag", "true")]."""
    pairs, i = [], 0
    while i < len(args):
        arg = args[i]
        if not arg.startswith("--") or len(arg) == 2:
            raise ConfigError(f"unexpected argument {arg!r}: overrides look like --section.key value")
        key = arg[2:]
        if "=" in key:
            key, value = key.split("=", 1)
        elif i + 1 < len(args) and not args[i + 1].startswith("--"):
            value, i = args[i + 1], i + 1
        else:
            value = "true"
        pairs.append((key.replace("-", "_"), value))
        i += 1
    return pairs


def _set_dotted(raw: dict, key: str, value: str) -> None:
    parts = key.split(".")
    node = raw
    for part in parts[:-1]:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"cannot override {key}: {part} is a value, not a section")
        node = child
    node[parts[-1]] = _CliValue(value)


class _CliValue(str):
    """A value typed on the command line: converted to the field's type, unlike TOML values."""


def _build(cls, raw: dict, prefix: str):
    if not isinstance(raw, dict):
        raise ConfigError(f"[{prefix.rstrip('.')}] must be a table of keys, got {raw!r}")
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    kwargs = {}
    for key, value in raw.items():
        if key not in hints:
            what = "section" if not prefix else "key"
            raise ConfigError(f"unknown {what} '{prefix}{key}'{_suggest(prefix, key, cls)}")
        kwargs[key] = _convert(hints[key], value, prefix + key)
    # Sections absent from the recipe take their defaults.
    for name in names:
        if name not in kwargs and dataclasses.is_dataclass(hints[name]):
            kwargs[name] = hints[name]()
    return cls(**kwargs)


# Keys users bring from other frameworks, and what titan calls them.
ELSEWHERE = {"job.config_file": "the recipe is --config, as in titan train --config recipe.toml"}


def _suggest(prefix: str, key: str, cls) -> str:
    if prefix + key in ELSEWHERE:
        return f" ({ELSEWHERE[prefix + key]})"
    here = [prefix + f.name for f in dataclasses.fields(cls)]
    everywhere = here + _all_keys()
    match = [k for k in _all_keys() if prefix and k.endswith("." + key)]  # the right key in the wrong section?
    if not match:
        match = difflib.get_close_matches(prefix + key, everywhere, n=1, cutoff=0.6)
    if not match:
        match = [k for k in _all_keys() if k.endswith("." + key)]
    return f" (did you mean {' or '.join(match)}?)" if match else f"; valid keys here: {', '.join(here)}"


def _all_keys() -> list[str]:
    hints = typing.get_type_hints(Config)
    return [f"{section}.{f.name}" for section in hints for f in dataclasses.fields(hints[section])]


def _type_name(tp) -> str:
    if typing.get_origin(tp) is Literal:
        return " | ".join(repr(a) for a in typing.get_args(tp))
    return getattr(tp, "__name__", str(tp))


def _convert(tp, value, key: str):
    if dataclasses.is_dataclass(tp):
        return _build(tp, value, key + ".")
    origin = typing.get_origin(tp)
    if isinstance(value, _CliValue) and tp is not str and origin is not Literal:
        value = _parse_cli_literal(value)
    elif isinstance(value, _CliValue):
        value = str(value)
    if origin is Literal:
        if value not in typing.get_args(tp):
            raise ConfigError(f"{key} must be one of {_type_name(tp)}, got {value!r}")
        return value
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{key} must be a table, got {value!r}")
        return {k: _parse_cli_literal(v) if isinstance(v, _CliValue) else v for k, v in value.items()}
    if origin is list:
        (item,) = typing.get_args(tp)
        if isinstance(value, str) and item is str:  # from the command line: a,b,c
            value = [v.strip() for v in value.split(",") if v.strip()]
        if not isinstance(value, list):
            raise ConfigError(f"{key} must be a list of {_type_name(item)}, got {value!r}")
        return [_convert(item, v, f"{key}[{i}]") for i, v in enumerate(value)]
    if origin in (typing.Union, types.UnionType):
        for option in typing.get_args(tp):
            try:
                return _convert(option, value, key)
            except ConfigError:
                pass
        raise ConfigError(f"{key} must be {_type_name(tp)}, got {value!r}")
    if tp is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if not isinstance(value, tp) or (tp is int and isinstance(value, bool)):
        raise ConfigError(f"{key} must be {_type_name(tp)}, got {value!r} ({type(value).__name__})")
    return value


def _parse_cli_literal(text: str):
    """Read a command-line value as a TOML literal (30, 1e-3, true, [1, 2]); anything else is a string."""
    try:
        return parse_toml(f"v = {text}")["v"]
    except ValueError:  # not TOML, or nested too deep
        return str(text)


# ---------------------------------------------------------------------------------------------
# Validation of values (types are already right)


def validate(config: Config, world_size: int) -> None:
    """Check the values of a recipe whose types are right, section by section; the first wrong one raises a
    ConfigError that names its key."""
    _validate_run(config)
    _validate_parallel(config.parallel)
    _validate_data(config)
    _validate_recovery(config)
    _validate_performance(config)
    _validate_context_parallel(config)
    _validate_layout(config, world_size)
    _require_finite(config)  # after the keys' own checks, whose messages say more


def require(ok: bool, message: str) -> None:
    """Raise a ConfigError with `message` unless `ok`."""
    if not ok:
        raise ConfigError(message)


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
    s = config.lr_scheduler
    require(s.warmup_steps >= 0, f"lr_scheduler.warmup_steps must be >= 0, got {s.warmup_steps}")
    if s.warmup_steps > t.steps:
        log.warning(
            "lr_scheduler.warmup_steps (%d) is longer than the run (training.steps %d): the learning rate warms up "
            "over the whole run and never reaches optimizer.lr",
            s.warmup_steps,
            t.steps,
        )
    require(0 <= s.min_lr_ratio <= 1, f"lr_scheduler.min_lr_ratio must be in [0, 1], got {s.min_lr_ratio}")
    require(0 < s.wsd_decay_ratio <= 1, f"lr_scheduler.wsd_decay_ratio must be in (0, 1], got {s.wsd_decay_ratio}")
    require(config.metrics.log_freq > 0, f"metrics.log_freq must be positive, got {config.metrics.log_freq}")
    f = config.profiling
    require(
        f.wait >= 0 and f.warmup >= 0 and f.active >= 1,
        f"profiling.wait and warmup must be >= 0 and active >= 1, got {f.wait}, {f.warmup}, {f.active}",
    )
    require(config.metrics.peak_flops >= 0, f"metrics.peak_flops must be >= 0, got {config.metrics.peak_flops}")


def _validate_parallel(p: Parallel) -> None:
    """The parallel degrees and the pipeline's stage hints, whatever the world size."""
    for name in ("dp_replicate", "cp", "tp", "pp"):
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


def _validate_data(config: Config) -> None:
    """The tokenizer, the data sources and their batching, and the held-out validation share."""
    require(config.tokenizer.path != "", "tokenizer.path must name a tokenizer.json file")
    d, v = config.data, config.validation
    require(d.source != "", "data.source must name a local file, folder or hub dataset")
    if d.batching == "tokens":
        require(
            d.document_mask,
            "data.batching = 'tokens' packs whole documents and needs data.document_mask = true",
        )
        require(
            not d.sources,
            "data.batching = 'tokens' reads one source; blend the sources into one, or use data.batching = 'rows'",
        )
        require(d.max_document_len >= 0, f"data.max_document_len must be >= 0 (0 = seq_len), got {d.max_document_len}")
        require(
            len(d.cost_model) in (0, 3) and all(0 <= x < math.inf for x in d.cost_model),
            f"data.cost_model must be [] (measure it) or three finite numbers >= 0 [a, b, c], got {d.cost_model}",
        )
        require(
            d.balance != "cost" or not d.cost_model or d.cost_model[0] > 0 or d.cost_model[1] > 0,
            f"data.cost_model {d.cost_model} prices every document at 0 s (a·s² + b·s with a = b = 0), so "
            "data.balance = 'cost' sends them all to rank 0; set a or b > 0 (e.g. [2e-6, 1e-4, 1e-3]), or [] to "
            "measure them",
        )
        require(
            not config.compile.enable,
            "compile.enable with data.batching = 'tokens' is not supported: every micro-batch has another length, "
            "and per-document attention would recompile each block; use one or the other",
        )
    for i, source in enumerate(d.sources):
        require(source.source != "", f"data.sources[{i}].source must name a local file, folder or hub dataset")
        require(
            0 < source.weight < math.inf,
            f"data.sources[{i}].weight must be > 0 and finite (a share of the mixture), got {source.weight}",
        )
    if d.sources:
        weights = [s.weight for s in d.sources]
        try:
            blend_period(weights)
        except ValueError:
            i = weights.index(min(weights))
            # The smallest weight that works, 1% up so that rounding it to 3 digits cannot take it below.
            smallest = (sum(weights) - weights[i]) / (MAX_BLEND_PERIOD - 1) * 1.01
            raise ConfigError(
                f"data.sources[{i}].weight = {weights[i]} is {weights[i] / sum(weights):.3g} of the mixture, under one "
                f"sample in {MAX_BLEND_PERIOD} (the longest blend pattern), so it would get none; raise it to at "
                f"least {smallest:.3g}, or drop the source"
            ) from None
    require(
        d.prepare_workers >= 0,
        f"data.prepare_workers must be >= 0 (0 = one per CPU, at most 8), got {d.prepare_workers}",
    )
    require(v.interval >= 0, f"validation.interval must be >= 0 (0 disables validation), got {v.interval}")
    require(v.steps > 0, f"validation.steps must be positive, got {v.steps}")
    require(
        0 <= v.fraction < 1,
        f"validation.fraction must be in [0, 1) (the share of documents held out), got {v.fraction}",
    )
    for i, source in enumerate(d.source_list()):
        key = f"data.sources[{i}].source" if d.sources else "data.source"
        require(
            not _same_documents(v, source),
            f"validation.source {v.source!r} reads the documents that {key} {source.source!r} trains on, so "
            "validation would measure memorisation; name a source of held-out documents, or leave validation.source "
            "empty to hold out validation.fraction of the training documents",
        )


def _validate_recovery(config: Config) -> None:
    """Skipped steps and checkpoints."""
    t = config.training
    require(t.max_skipped_steps >= 1, f"training.max_skipped_steps must be >= 1, got {t.max_skipped_steps}")
    c = config.checkpoint
    require(c.interval > 0, f"checkpoint.interval must be positive, got {c.interval}")
    require(c.keep_latest_k >= 0, f"checkpoint.keep_latest_k must be >= 0 (0 keeps all), got {c.keep_latest_k}")
    require(c.resume != "", "checkpoint.resume must be 'auto', 'never' or a checkpoint path")
    parts = {"model", "optimizer", "lr_scheduler", "data", "train_state"}
    require(set(c.load_only) <= parts, f"checkpoint.load_only entries must be among {sorted(parts)}, got {c.load_only}")


def _validate_performance(config: Config) -> None:
    """float8, the plan's device, activation checkpointing and the straggler probe."""
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


def _same_documents(v: Validation, source: DataSource) -> bool:
    """Whether validation.source names a training source's documents: the same local file or folder (or titan
    corpus), whatever the split, or the same split and revision of the same hub dataset."""
    if not v.source:
        return False
    mine, theirs = Path(v.source).expanduser(), Path(source.source).expanduser()
    if mine.exists() and theirs.exists():
        return mine.resolve() == theirs.resolve()
    if v.source.startswith("titan:"):  # a local file titan fetches: one split
        return v.source == source.source
    return (v.source, v.split, v.revision, "") == (source.source, source.split, source.revision, source.subset)


def degrees_world_size(p: Parallel) -> int:
    """The world the recipe's parallel degrees make by themselves; dp_shard = -1 (whatever is left) counts as 1."""
    return p.dp_replicate * abs(p.dp_shard) * p.cp * p.tp * p.pp


class LayoutError(ConfigError):
    """The parallel degrees cannot make the world size."""


@dataclass(frozen=True)
class Layout:
    """How the world is split: the one description of a parallel layout, used by the trainer, the mesh,
    the metrics and `titan compare` (this module is torch-free, so reports never import torch)."""

    dp_replicate: int = 1  # HSDP replicas
    dp_shard: int = 1  # FSDP shards
    tp: int = 1
    pp: int = 1
    cp: int = 1  # context parallel: ranks sharing each sequence

    @classmethod
    def from_config(cls, p: Parallel, world_size: int) -> Layout:
        """The recipe's degrees with dp_shard = -1 resolved; they must multiply to the world size."""
        others = p.dp_replicate * p.cp * p.tp * p.pp
        degrees = _other_degrees(p)
        dp_shard = p.dp_shard if p.dp_shard != -1 else world_size // others
        if p.dp_shard == -1 and (dp_shard < 1 or others * dp_shard != world_size):
            raise LayoutError(
                f"parallel.dp_shard = -1 takes what {degrees} = {others} leaves of the world size {world_size}, and "
                f"{others} does not divide it; launch a multiple of {others} processes (torchrun --nproc-per-node) "
                "or lower the degrees"
            )
        if dp_shard < 1 or others * dp_shard != world_size:
            raise LayoutError(
                f"parallel degrees {degrees} x dp_shard={p.dp_shard} do not multiply to the world size "
                f"{world_size}; set parallel.dp_shard = -1 or change the degrees"
            )
        return cls(p.dp_replicate, dp_shard, p.tp, p.pp, p.cp)

    @property
    def dp(self) -> int:
        """Data-parallel ranks: replicas x shards."""
        return self.dp_replicate * self.dp_shard

    @property
    def world_size(self) -> int:
        return self.dp * self.cp * self.tp * self.pp

    @property
    def name(self) -> str:
        """The degrees other than 1, e.g. 'dp_shard2-tp2'; 'single' when there are none."""
        return "-".join(f"{k}{v}" for k, v in dataclasses.asdict(self).items() if v != 1) or "single"


# A layout as files record it (run_info.json, a saved re-plan): degrees of Layout, an absent one 1.
LAYOUT_SPEC = Table({f.name: Integer(1) for f in dataclasses.fields(Layout)}, closed=True)


def to_dict(config: Config) -> dict:
    return dataclasses.asdict(config)


def to_toml(config: Config) -> str:
    """The resolved recipe as TOML, loadable again by load_config to the same Config (tests/core/test_config.py)."""
    return tomli_w.dumps(to_dict(config))


def toml_value(value) -> str:
    """One value as TOML on a single line, for the `key = value` hints of messages and `titan config keys`
    (tomli-w spreads arrays over lines and writes tables as [sections], so only scalars go to it)."""
    if isinstance(value, dict):
        return "{ " + ", ".join(f"{_toml_key(k)} = {toml_value(v)}" for k, v in value.items()) + " }" if value else "{}"
    if isinstance(value, list):
        return "[" + ", ".join(map(toml_value, value)) + "]"
    return tomli_w.dumps({"v": value}).removeprefix("v = ").removesuffix("\n")


def _toml_key(key: str) -> str:
    return key if re.fullmatch(r"[A-Za-z0-9_-]+", key) else toml_value(key)
