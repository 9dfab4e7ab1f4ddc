"""The recipe's schema: one frozen dataclass per section, and `Config` holding them all. A field's comment is its
description: `titan config keys`, the help of the commands that take overrides and docs/config.md read them from
this file and titan/config/optimizer.py (titan/config_keys.py)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

# The data sections live beside: what the run reads, holds out and evaluates on.
from titan.config.data_sections import (  # noqa: F401 (the schema's, re-exported)
    BLEND_PERIOD,
    MAX_BLEND_PERIOD,
    Data,
    DataSource,
    DataStage,
    Eval,
    Validation,
    ValidationSet,
    blend_period,
)
from titan.config.optimizer import LRScheduler, Optimizer


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
    # A HF tokenizers `tokenizer.json`, a model folder holding one, a hub model's in the local HF cache, or
    # "titan:shakespeare". Left "" only by a run that starts from weights: it takes theirs (checkpoint.init_from_hf,
    # or the checkpoint checkpoint.resume names).
    path: str = ""
    bos_token: str = "<|begin_of_text|>"  # starts every document; "" for none (Qwen's tokenizers have none)
    eos_token: str = "<|end_of_text|>"  # ends every document


@dataclass(frozen=True)
class Training:
    local_batch_size: int = 8  # most sequences per micro-batch on each data-parallel rank (a memory cap)
    # Sequences per optimizer step, whatever the layout; 0: local_batch_size x data-parallel size.
    global_batch_size: int = 0
    seq_len: int = 256  # tokens per sequence (a row of the global batch)
    steps: int = 100  # optimizer steps to train; the lr schedule spans them
    max_grad_norm: float = 1.0  # 0 disables clipping
    # bf16: bf16 matmuls, fp32 weights and optimizer; torch's names (float32, bfloat16) work too
    mixed_precision: Literal["fp32", "bf16"] = "fp32"
    device: Literal["auto", "cpu", "cuda"] = "auto"  # auto: cuda when a GPU is visible
    # A step whose loss or gradient norm is NaN or inf: stop (nothing saved after the last good step), or
    # skip its update and go on, stopping after max_skipped_steps such steps in a row.
    on_nonfinite: Literal["stop", "skip"] = "stop"
    max_skipped_steps: int = 10  # on_nonfinite = "skip": stop after this many skipped steps in a row


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
    # Expert-parallel degree of a mixture of experts: its routed experts split across this many ranks, taken from
    # dp_shard x cp rather than added to the world; each token goes to its experts' ranks and back by all-to-all
    # (docs/moe.md).
    ep: int = 1
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
class Replay:
    """What `titan verify --replay` compares a replayed step with, and the spikes that call for one
    (titan/train/digests.py, docs/verify.md)."""

    # Each rank writes a bitwise digest of its loss share, gradients, gradient norm and updated weights every step
    # into <run>/digests/ (one pass over the gradients and weights and one device-to-host copy per step).
    digests: bool = False
    # Log a step whose loss or gradient norm is this many standard deviations above the last spike_window steps',
    # with the replay that checks it, into <run>/spikes.jsonl; 0: off.
    spike_zscore: float = 0.0
    spike_window: int = 50  # steps the spike's mean and deviation are taken over
    # Replay a spiked step in the run, on its layout, from the in-memory snapshot before it (fault.snapshot_interval)
    # and compare its digests bitwise: the rank whose result differs is named, in the log and spikes.jsonl.
    on_spike: bool = False


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
    # Start from a HF checkpoint (config.json + *.safetensors: Llama, Qwen3, Qwen3-MoE for the moe family) when not
    # resuming: a folder, or a hub model in the local HF cache (titan download NAME --weights).
    init_from_hf: str = ""
    # With init_from_hf and a tokenizer.path that is not the HF model's own tokenizer: train its weights on the
    # recipe's token ids all the same (they then mean other text than the weights learned). Off: refused.
    allow_other_tokenizer: bool = False


@dataclass(frozen=True)
class Fault:
    """Failures as torchrun's elastic agent needs them (docs/fault-tolerance.md): a hang becomes an exit."""

    # A rank whose step phase (data, forward, backward, optimizer) or work between steps (checkpoint save, stop
    # vote, validation) lasts longer than this is hung: it names itself, its step and phase and the ranks it waits
    # for, in one line, and exits 1 so that the elastic agent restarts the workers. 0 disables the watchdog.
    step_timeout_s: float = 1800.0
    # A rank that has waited this long in one phase while the next rank's heartbeat has been silent as long (its
    # process or node lost) exits at once, naming it, rather than waiting out step_timeout_s or a collective's
    # timeout: recovery in seconds. 0: only step_timeout_s.
    peer_silence_s: float = 20.0
    # How long a collective of the default process group and titan's gloo groups (stop votes, checkpoint
    # barriers and saves) waits for the other ranks before it fails; also the time the ranks wait to join.
    collective_timeout_s: float = 600.0
    # Snapshot the whole training state every N steps into host shared memory (/dev/shm), which outlives the
    # workers: an elastic restart restores from it, losing no step, and from the disk checkpoint only when the
    # snapshot is gone or older. 0: off. auto: on under torchrun with restarts (--max-restarts > 0) where the node
    # has the shared memory, every N steps for the smallest N that keeps it within snapshot_overhead; else off.
    snapshot_interval: int | Literal["auto"] = "auto"
    # With snapshot_interval = auto: the most a snapshot may cost, as a fraction of the steps between two.
    snapshot_overhead: float = 0.03


@dataclass(frozen=True)
class PlanTarget:
    """The recipe's [plan] section: the accelerator `titan plan` plans a run for (titan/train/estimate/devices.py); a
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
    # Expert parallelism: the routed tokens the most loaded ep rank's experts receive, over the mean (1: balanced);
    # the plan traces that rank, its activations, expert matmuls and all-to-all.
    moe_load_imbalance: float = 1.25


@dataclass(frozen=True)
class Config:
    job: Job = field(default_factory=Job)
    model: Model = field(default_factory=Model)
    tokenizer: Tokenizer = field(default_factory=Tokenizer)
    data: Data = field(default_factory=Data)
    training: Training = field(default_factory=Training)
    validation: Validation = field(default_factory=Validation)
    eval: Eval = field(default_factory=Eval)
    optimizer: Optimizer = field(default_factory=Optimizer)
    lr_scheduler: LRScheduler = field(default_factory=LRScheduler)
    metrics: Metrics = field(default_factory=Metrics)
    parallel: Parallel = field(default_factory=Parallel)
    straggler: Straggler = field(default_factory=Straggler)
    replay: Replay = field(default_factory=Replay)
    activation_checkpoint: ActivationCheckpoint = field(default_factory=ActivationCheckpoint)
    compile: Compile = field(default_factory=Compile)
    profiling: Profiling = field(default_factory=Profiling)
    float8: Float8 = field(default_factory=Float8)
    checkpoint: Checkpoint = field(default_factory=Checkpoint)
    fault: Fault = field(default_factory=Fault)
    plan: PlanTarget = field(default_factory=PlanTarget)

    @property
    def run_dir(self) -> Path:
        return Path(self.job.output_dir) / self.job.name


def to_dict(config: Config) -> dict:
    return dataclasses.asdict(config)
