"""The one training loop: build the parts the recipe names, then step, clip, log until done."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import math
import os
import platform
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel

from titan import __version__, models
from titan.balance import data_shares
from titan.checkpoint.checkpointer import Checkpointer, complete_checkpoints, model_shapes
from titan.config import Config, Layout, math_values, to_toml
from titan.data import IGNORE, Batch, DocumentBatchLoader, Tokenizer, build_loaders, document_pieces
from titan.data.cost_fit import cached_cost_model, collective_seconds
from titan.data.document_batches import Placement
from titan.data.packing import CostModel, Target
from titan.errors import ConfigError, UserError
from titan.files import hold_run_folder, write_error
from titan.observe.metrics import MetricsLogger, format_line, peak_flops, peak_memory_bytes, setup_logging
from titan.observe.profiling import Profiler, StepClock
from titan.optim import (
    FiniteFlags,
    build_lr_scheduler,
    build_optimizer,
    clip_grad_norm_,
    ensure_adamw_state,
    skip_if_nonfinite,
)
from titan.parallel import pp
from titan.parallel.float8 import precompute_scales as precompute_float8_scales
from titan.parallel.mesh import build_mesh, init_distributed, new_gloo_group, on_rank_0
from titan.parallel.parallelize import build_model_parts, check_layout, split_layers, stage_batch
from titan.rng import dropout_step
from titan.rng.shards import full_tensor
from titan.run_plan import RunPlan, run_plan
from titan.train.replan import Replanner
from titan.train.stop import Preempted, StopVote
from titan.train.straggler import gather_times

log = logging.getLogger("titan")


def pick_device(name: str) -> torch.device:
    if name == "cuda" and not torch.cuda.is_available():
        raise ConfigError("training.device = 'cuda' but no CUDA GPU is visible; use 'auto' or 'cpu'")
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda":
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cpu")


def resolve_model(config: Config):
    """The registry spec and the model args (flavor + overrides) the recipe names, checked: a model that
    cannot be built is a recipe error, found before any work."""
    try:
        spec = models.get_model_spec(config.model.name)
        args = models.model_args(spec, config.model.flavor, config.model.overrides)
    except (KeyError, ValueError) as e:
        raise ConfigError(str(e).strip("'\"")) from None
    try:
        args.validate()
    except ValueError as e:
        raise ConfigError(f"model {config.model.flavor} with model.overrides {config.model.overrides}: {e}") from None
    seq_len = config.training.seq_len
    if seq_len > args.max_seq_len:
        raise ConfigError(
            f"training.seq_len {seq_len} exceeds the {config.model.flavor} model's max_seq_len {args.max_seq_len}; "
            "lower training.seq_len, or raise model.overrides.max_seq_len if the model is meant for longer sequences"
        )
    longest = max(seq_len, config.data.max_document_len if config.data.batching == "tokens" else 0)
    if longest > args.max_seq_len:
        raise ConfigError(
            f"data.max_document_len {longest} exceeds the {config.model.flavor} model's max_seq_len "
            f"{args.max_seq_len}; lower it (0 = training.seq_len)"
        )
    # The RoPE table only needs to cover the longest sequence trained on.
    return spec, dataclasses.replace(args, max_seq_len=longest)


def build_model(config: Config, device: torch.device) -> torch.nn.Module:
    """The plain single-device model, initialised from the seed: the reference every layout must equal."""
    spec, args = resolve_model(config)
    return build_model_parts(config, spec, args, Layout(), {}, device).parts[0]


class Trainer:
    def __init__(self, config: Config):
        self.config = config
        t = config.training
        self.device = pick_device(t.device)
        # Everything that can be wrong with the recipe is checked before joining the other processes.
        self.layout = Layout.from_config(config.parallel, int(os.environ.get("WORLD_SIZE", "1")))
        spec, self.model_args = resolve_model(config)
        self.spec = spec
        check_layout(config, spec, self.model_args, self.layout, self.device)
        self.rank, self.world_size = init_distributed(config.parallel.backend, self.device)
        setup_logging(self.rank)
        self.control_group = new_gloo_group()  # agreement on errors, checkpoint barriers and the stop vote
        self.run_dir = config.run_dir
        on_rank_0(self._claim_run_dir, self.control_group)
        torch.manual_seed(config.job.seed)
        if config.job.deterministic:
            os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
            torch.use_deterministic_algorithms(True)
        self.tokenizer = Tokenizer(config.tokenizer)
        if self.tokenizer.vocab_size > self.model_args.vocab_size:
            raise ConfigError(
                f"tokenizer has {self.tokenizer.vocab_size} tokens but the model's vocab_size is "
                f"{self.model_args.vocab_size}; "
                "use a matching tokenizer.path or set model.overrides.vocab_size"
            )
        self.mesh = build_mesh(self.layout, self.device)
        dp_rank = self.mesh["dp"].get_local_rank() if self.mesh else 0
        self.dp_rank = dp_rank
        # Each data-parallel rank's micro-batch sizes: its contiguous share of every global batch.
        self.run_plan = run_plan(config, self.world_size)
        self.pipeline_microbatches = self.run_plan.pipeline_microbatches
        sizes = self.run_plan.micro_batches[dp_rank]
        self.global_batch = self.run_plan.global_rows
        self.grad_accum, self.micro_batch_size = len(sizes), sizes[0]
        self.loader, self.validation_loader = build_loaders(
            config, self.global_batch, self.run_plan.rows(dp_rank), list(sizes), log_rows=config.data.batching == "rows"
        )
        self.documents = config.data.batching == "tokens"
        if self.documents:
            self.loader = self._document_loader()

        self.loss_parallel = self.layout.tp > 1 and config.parallel.loss_parallel
        self._build_model()
        self.tokens_per_step = self.global_batch * t.seq_len
        # Each rank's summed token loss times this is its share of the step's mean loss (1 / the step's
        # loss-bearing tokens, set per step); gradients are then summed over data-parallel ranks, so every
        # layout computes the gradient of the same global mean.
        self.loss_scale = 1.0
        # FSDP's MixedPrecisionPolicy casts parameters itself; autocast covers the layouts without FSDP.
        self.autocast = (
            torch.autocast(self.device.type, dtype=torch.bfloat16)
            if self.run_plan.precision.autocast
            else contextlib.nullcontext()
        )
        self.flops_per_token = spec.flops_per_token(self.model_args, t.seq_len)
        run_dtype = torch.bfloat16 if self.run_plan.precision.bf16 else torch.float32
        self.peak_flops, peak_is = peak_flops(self.device, config.metrics.peak_flops, run_dtype)
        (log.info if self.peak_flops else log.warning)("MFU: relative to %s", peak_is)
        self.step_times: list[float] = []  # host wall time of each step, data loading included
        self.profiler = Profiler(config.profiling, self.run_dir / "profiling", self.rank, self.device)
        self.clock = StepClock(config.profiling.step_breakdown, self.device)
        self.metrics = MetricsLogger(config, self.run_dir, enabled=self.rank == 0, extra_info=self.run_info())
        if self.rank == 0:
            (self.run_dir / "config.toml").write_text(to_toml(config))
            (self.run_dir / "run_info.json").write_text(json.dumps(self.run_info(), indent=2) + "\n")
        self.replanner = Replanner(config, self.layout, self._rank_devices(), self.device)
        self.checkpointer = Checkpointer(
            config.checkpoint,
            self.run_dir / "checkpoints",
            model_parts=self.model_parts,
            optimizer=self.optimizer,
            lr_scheduler=self.lr_scheduler,
            loader=self.loader,
            rank=self.rank,
            recipe=to_toml(config),
            model={
                "name": config.model.name,
                "flavor": config.model.flavor,
                "shapes": model_shapes(spec, self.model_args),
            },
            save_group=new_gloo_group(),
            control_group=self.control_group,
            replan=self.replanner,
            math_values=math_values(config, self.global_batch),
        )
        self.step = self.checkpointer.resume()
        # Tokens are counted from the checkpoint's count: an allowed change of seq_len or batch size applies
        # from the resumed step on.
        self.tokens_seen = self.checkpointer.resumed_state.get("tokens_seen", 0)
        self.skipped_in_a_row = 0  # steps skipped for a non-finite loss (training.on_nonfinite = "skip")
        # A re-planned run resumes with the plan in force when it stopped (the replanner dropped a plan measured
        # on another layout or other devices).
        if self.replanner.dp_weights:
            self.apply_plan(self.replanner.dp_weights)
        if self.replanner.pp_layers_per_stage not in ([], config.parallel.pp_layers_per_stage):
            self.resplit_pipeline(self.replanner.pp_layers_per_stage)
        if config.checkpoint.init_from_hf:
            if self.checkpointer.resumed_from is None:  # HF weights start a fresh run; a resumed run has its own
                from titan.checkpoint.hf import init_from_hf

                init_from_hf(
                    self.model_parts.named_parameters(),
                    spec,
                    self.model_args,
                    config.checkpoint.init_from_hf,
                    f"{config.model.name} {config.model.flavor}",
                )
            else:
                log.info("checkpoint.init_from_hf: not used, the run resumed from a checkpoint")
        self.stop = StopVote(self.control_group)
        if self.documents:
            batching = (
                f"documents up to {self.tokens_per_step} tokens/step, placed by {config.data.balance} in "
                f"micro-batches of at most {self.loader.target.capacities[0]} tokens"
            )
        else:
            batching = (
                f"{self.tokens_per_step} tokens/step ({self.global_batch} x {t.seq_len} seq; this rank "
                f"{' + '.join(map(str, self.run_plan.micro_batches[dp_rank]))} rows)"
            )
        log.info(
            "%s %s: %.2fM parameters on %s x %d (%s) | %s | %s",
            config.model.name,
            config.model.flavor,
            self.n_params() / 1e6,
            self.device.type,
            self.world_size,
            self.layout.name,
            batching,
            self.run_dir,
        )

    def _claim_run_dir(self) -> None:
        """Create the run folder and hold its lock for the run's life: one run per folder."""
        try:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            hold_run_folder(self.run_dir)
        except BlockingIOError as e:
            raise ConfigError(
                f"run folder {self.run_dir} is in use by another titan run ({e.args[0]}); wait for it to end, or "
                "set job.name or job.output_dir to another folder"
            ) from None
        except OSError as e:
            raise ConfigError(f"job.output_dir: {write_error(e)}; choose another job.output_dir") from None

    def _build_model(self) -> None:
        """The model parts for the recipe's layout and pipeline split, their optimizer, lr schedule and
        pipeline schedule; initialised from the seed."""
        config = self.config
        self.model_parts = build_model_parts(config, self.spec, self.model_args, self.layout, self.mesh, self.device)
        self.optimizer = build_optimizer(list(self.model_parts.parameters()), config.optimizer)
        self.lr_scheduler = build_lr_scheduler(self.optimizer, config.lr_scheduler, config.training.steps)
        self.schedule = None
        if self.layout.pp > 1:
            n_microbatches = self.pipeline_microbatches
            # What the stages exchange for one micro-batch, so that the schedule need not run one to find out.
            # Packed documents come as one row of as many tokens, but evaluation reads rows: with both, torch
            # finds the shapes of each itself.
            rows, seq = self.micro_batch_size // n_microbatches, config.training.seq_len
            if self.documents:
                rows, seq = 1, rows * seq
            n_stages = self.model_parts.n_stages
            io = [
                self.spec.pipeline_io(self.model_args, stage_batch(config, self.layout, rows, seq, stage, n_stages))
                if not (self.documents and config.validation.interval)
                else None
                for stage in self.model_parts.stage_ids
            ]
            self.schedule = pp.build_schedule(
                config.parallel,
                list(zip(self.model_parts.stage_ids, self.model_parts.parts)),
                io,
                self.model_parts.n_stages,
                n_microbatches,
                self.loss_fn,
                self.device,
                self.mesh["pp"].get_group(),
            )

    def resplit_pipeline(self, layers_per_stage: list[int]) -> str:
        """Continue on another pipeline layer split from the next step: the stages are rebuilt for the new
        split and each parameter's value and optimizer state go to its new rank. With plain tensors (pipeline
        parallelism alone) the moved layers are sent point to point; with FSDP or TP shards they pass through
        a DCP checkpoint of their own, which reshards by parameter name under any composition."""
        point_to_point = not any(isinstance(p, DTensor) for p in self.model_parts.parameters())
        scheduler_state = self.lr_scheduler.state_dict()
        if point_to_point:
            ensure_adamw_state(self.optimizer, list(self.model_parts.parameters()))  # a re-split before any step
            old = self._stage_state()
            steps = next(iter(self.optimizer.state.values()))["step"].clone()  # every parameter took every step
        else:
            folder = self.checkpointer.folder / f".resplit-step-{self.step}"
            self.checkpointer.save_tensors(folder)
        self.config.parallel.pp_layers_per_stage = self.replanner.pp_layers_per_stage = list(layers_per_stage)
        self._build_model()
        self.checkpointer.rebind(self.model_parts, self.optimizer, self.lr_scheduler)
        if point_to_point:
            ensure_adamw_state(self.optimizer, list(self.model_parts.parameters()))
            for state in self.optimizer.state.values():
                state["step"] = steps.clone()
            moved = pp.move_stage_state(old, self._stage_state(), self.mesh["pp"].get_group())
            how = f"{moved} tensors received point to point"
        else:
            self.checkpointer.load_tensors(folder)
            how = "state moved through DCP"
        self.checkpointer.restore_lr_scheduler(scheduler_state)
        log.info("step %d: pipeline re-split into layers per stage %s (%s)", self.step, layers_per_stage, how)
        return how

    def _stage_state(self) -> dict[str, dict[str, torch.Tensor]]:
        """This rank's parameters and their optimizer state, by name (the step count aside: it is the same for
        every parameter)."""
        return {
            name: {"param": p.data, **{k: v for k, v in self.optimizer.state[p].items() if k != "step"}}
            for name, p in self.model_parts.named_parameters()
        }

    def _document_loader(self) -> DocumentBatchLoader:
        """Whole documents up to global batch x seq_len tokens a step, shared out by data.balance. A micro-batch
        holds as many tokens as the rows recipe's: local_batch_size x seq_len, or under a pipeline one schedule
        micro-batch's rows."""
        config, layout = self.config, self.layout
        d, t, p = config.data, config.training, config.parallel
        if self.model_args.has_dropout:
            raise ConfigError(
                "data.batching = 'tokens' does not support dropout yet: titan keys its dropout masks by row and "
                "position, and packing places a document differently on every layout; set the model's "
                "attn_dropout and resid_dropout to 0 or use data.batching = 'rows'"
            )
        pipeline_rows = self.pipeline_microbatches
        rows = self.micro_batch_size // pipeline_rows if pipeline_rows else t.local_batch_size
        capacity = rows * t.seq_len
        max_len = d.max_document_len or t.seq_len
        if max_len > capacity:
            raise ConfigError(
                f"data.max_document_len {max_len}: a document piece that long fits no micro-batch, which holds "
                f"{capacity} tokens ({rows} x training.seq_len {t.seq_len}); lower data.max_document_len or raise "
                "training.local_batch_size"
            )
        target = Target((capacity,) * layout.dp, layout.pp, pipeline_rows or 1, padded=layout.pp > 1)
        sequence_parallel = layout.tp > 1 and p.sequence_parallel
        placement = Placement(capacity, pipeline_rows, layout.tp if sequence_parallel else 1)
        if d.cost_model:
            cost = CostModel(*d.cost_model)
        else:
            dtype = torch.bfloat16 if self.run_plan.precision.bf16 else torch.float32
            n_layers = math.ceil(self.model_args.n_layers / layout.pp)
            # Measured by rank 0 alone, so that every rank plans with the same costs.
            cost = on_rank_0(
                lambda: cached_cost_model(
                    self.spec, self.model_args, n_layers, max_len, capacity, self.device, dtype, config.job.seed
                ),
                self.control_group,
            )
            if layout.dp > 1:
                cost = dataclasses.replace(cost, c=cost.c + self._fsdp_seconds_per_micro_batch())
        loader = DocumentBatchLoader(
            document_pieces(config), self.global_batch * t.seq_len, d.balance, cost, target, placement, self.dp_rank
        )
        weights = config.parallel.dp_weights
        if weights:
            loader.speeds = list(weights)
        return loader

    def _fsdp_seconds_per_micro_batch(self) -> float:
        """FSDP's collectives per micro-batch, timed on the data-parallel group; the slowest rank's time, so
        that every rank plans with the same cost model."""
        with torch.device("meta"):
            n_params = sum(p.numel() for p in self.spec.build(self.model_args).parameters())
        dtype = torch.bfloat16 if self.run_plan.precision.bf16 else torch.float32
        share = n_params // (self.layout.pp * self.layout.tp)
        seconds = torch.tensor(collective_seconds(share, self.mesh["dp"].get_group(), self.device, dtype))
        dist.all_reduce(seconds, op=dist.ReduceOp.MAX, group=self.control_group)
        log.info("data.cost_model: c + %.3g s per micro-batch for FSDP's collectives (measured)", float(seconds))
        return float(seconds)

    def _rank_devices(self) -> list[str]:
        """Each rank's device, in rank order: its host and local rank (under torchrun, the node and its GPU)."""
        mine = f"{platform.node()}:{os.environ.get('LOCAL_RANK', '0')}"
        if self.control_group is None:
            return [mine]
        devices = [""] * self.world_size
        dist.all_gather_object(devices, mine, group=self.control_group)
        return devices

    def apply_plan(self, weights: list[float]) -> RunPlan:
        """Share the global batch's rows by `weights` from the next step on (every rank calls this with the
        same weights), as closely as micro-batches allow. Nothing moves: each rank reads other rows of the same
        global batches."""
        self.run_plan = plan = run_plan(self.config, self.world_size, weights)
        sizes = list(plan.micro_batches[self.dp_rank])
        for loader in (self.loader, self.validation_loader):
            if isinstance(loader, DocumentBatchLoader):
                loader.speeds = list(weights)  # the next step's documents are dispatched by these speeds
            elif loader is not None:
                loader.assign(plan.rows(self.dp_rank), sizes)
        self.replanner.dp_weights = list(weights)
        self.grad_accum, self.micro_batch_size = len(sizes), sizes[0]
        return plan

    def _check_stragglers(self) -> None:
        """Probe, and re-plan when the speeds call for it: the pipeline's layer split when there is one, else
        the data shares."""
        pipeline = self.layout.pp > 1
        index = self.mesh["pp" if pipeline else "dp"].get_local_rank()
        weights = self.replanner.measure(index, self.step, self.metrics)
        if weights is None:
            return
        if pipeline:
            p = self.config.parallel
            rank_of_stage = {
                stage: r
                for r in range(p.pp)
                for stage in pp.stage_ids(r, p.pp, self.model_parts.n_stages, p.pp_schedule)
            }
            speeds = [weights[rank_of_stage[stage]] for stage in range(self.model_parts.n_stages)]
            # The recipe's split rule with the measured speeds, so the stages' memory caps still hold.
            resplit = dataclasses.replace(p, pp_stage_speeds=speeds, pp_layers_per_stage=[])
            counts = [len(layers) for layers in split_layers(resplit, self.spec, self.model_args)]
            self.resplit_pipeline(counts)
            log.info("step %d: pipeline ranks' speeds %s", self.step, " ".join(f"{w:.2f}" for w in weights))
            self.metrics.log(
                self.step, {"replan": 1, **{f"pp_weight_{i}": w for i, w in enumerate(weights)},
                            **{f"pp_layers_{i}": c for i, c in enumerate(counts)}},
            )  # fmt: skip
            return
        rows = [sum(sizes) for sizes in self.apply_plan(weights).micro_batches]
        asked = data_shares(sum(rows), weights)
        slowest = lambda shares: max(r / w for r, w in zip(shares, weights))  # noqa: E731
        log.info(
            "step %d: data-parallel speeds %s: rows per rank now %s%s",
            self.step,
            " ".join(f"{w:.2f}" for w in weights),
            " ".join(map(str, rows)),
            ""
            if slowest(rows) <= slowest(asked) * (1 + 1e-9)
            else f" (the speeds ask for {' '.join(map(str, asked))}; micro-batches of at most "
            f"training.local_batch_size ({self.config.training.local_batch_size}) rows, as many on every rank, allow "
            "no closer plan)",
        )
        self.metrics.log(
            self.step, {"replan": 1, **{f"dp_weight_{i}": w for i, w in enumerate(weights)},
                        **{f"dp_rows_{i}": r for i, r in enumerate(rows)}},
        )  # fmt: skip

    def n_params(self) -> int:
        """Parameters of the whole model (not this rank's shard)."""
        local = sum(p.numel() for _, p in self.model_parts.named_parameters())
        if self.layout.pp == 1:
            return local
        total = torch.tensor(
            local if self.mesh["tp"].get_local_rank() == 0 and self.mesh["dp"].get_local_rank() == 0 else 0
        )
        dist.all_reduce(total)
        return int(total)

    def run_info(self) -> dict:
        return {
            "titan_version": __version__,
            "torch_version": torch.__version__,
            "python_version": platform.python_version(),
            "device": str(self.device) if self.device.type == "cpu" else torch.cuda.get_device_name(self.device),
            "world_size": self.world_size,
            "layout": dataclasses.asdict(self.layout),
            "hostname": platform.node(),
        }

    def loss_fn(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """This rank's share of the step's mean token loss (see loss_scale)."""
        return (
            F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), reduction="sum", ignore_index=IGNORE)
            * self.loss_scale
        )

    def train_step(self, micro_batches: list[Batch]) -> tuple[torch.Tensor, torch.Tensor]:
        """One optimizer step over the micro-batches; returns (global mean loss, grad norm) as tensors."""
        local, grad_norm = self.step_without_loss_reduction(micro_batches)
        return self.global_loss(local), grad_norm

    def step_without_loss_reduction(self, micro_batches: list[Batch]) -> tuple[torch.Tensor, torch.Tensor]:
        """One optimizer step; returns (this rank's share of the loss, grad norm). The training loop sums the
        shares over ranks only when it logs or saves: one collective per window rather than per step.

        A step whose gradient norm is NaN or inf leaves the weights and optimizer state as they were (the step
        still counts, so the data and the schedule move on). A non-finite loss makes non-finite gradients, and
        the norm is global (every shard, every stage), so all ranks take the same decision without the loss.
        The decision is made on the device: the host reads the norm only when the loop settles its steps."""
        local = self.forward_backward(micro_batches)
        with self.clock.phase("optimizer"):  # with the gradient-norm all-reduce
            params = list(self.model_parts.parameters())
            pp_group = self.mesh["pp"].get_group() if self.layout.pp > 1 else None
            grad_norm = clip_grad_norm_(params, self.config.training.max_grad_norm or float("inf"), pp_group)
            skip_if_nonfinite(self.optimizer, grad_norm)
            self.optimizer.step()
            precompute_float8_scales(self.config, self.layout, self.model_parts.parts)  # no-op unless fp8 AG
            self.optimizer.zero_grad(set_to_none=True)
            self.lr_scheduler.step()
            self.step += 1
        return local, grad_norm

    def forward_backward(self, micro_batches: list[Batch]) -> torch.Tensor:
        """Accumulate the step's gradients; returns this rank's share of the step's loss."""
        self.loss_scale = 1.0 / micro_batches[0].step_loss_tokens
        with dropout_step(self.step):
            return sum(
                (self._micro_batch_loss(b, train=True) for b in micro_batches), torch.zeros((), device=self.device)
            )

    @torch.no_grad()
    def evaluate(self) -> float:
        """Mean token loss over the validation batches (the same batches at every evaluation and on every layout)."""
        loader = self.validation_loader
        steps = [loader.batches_at(i * loader.global_batch) for i in range(self.config.validation.steps)]
        self.loss_scale = 1.0 / sum(batches[0].step_loss_tokens for batches in steps)
        self.model_parts.train(False)
        loss = sum(
            (self._micro_batch_loss(b, train=False) for batches in steps for b in batches),
            torch.zeros((), device=self.device),
        )
        self.model_parts.reshard()
        self.model_parts.train()
        return self.global_loss(loss).item()

    def _micro_batch_loss(self, batch: Batch, train: bool) -> torch.Tensor:
        """Forward (and backward, when training) one micro-batch; returns its scaled loss sum, detached."""
        batch = batch.to(self.device)
        # A fresh context per micro-batch: loss_parallel() is a generator-based context, usable once.
        with loss_parallel() if self.loss_parallel else contextlib.nullcontext():
            if self.schedule is not None:
                return self._pipeline_loss(batch, train)
            with self.clock.phase("forward"):
                with self.autocast:
                    logits = self.model_parts.parts[0](batch.inputs, batch.rows, batch.document_ids)
                loss = self.loss_fn(logits, batch.labels)
            if train:
                with self.clock.phase("backward"):
                    loss.backward()
        return full_tensor(loss).detach()

    def _pipeline_loss(self, batch: Batch, train: bool) -> torch.Tensor:
        losses: list[torch.Tensor] = []
        last = self.model_parts.has_last_stage
        args = ()
        if self.model_parts.has_first_stage:
            args = tuple(x for x in (batch.inputs, batch.rows, batch.document_ids) if x is not None)
        run = self.schedule.step if train else self.schedule.eval
        with self.clock.phase("forward_backward"), self.autocast:  # the schedule interleaves them
            run(*args, target=batch.labels if last else None, losses=losses if last else None, return_outputs=False)
        if not last:
            return torch.zeros((), device=self.device)
        return torch.stack([full_tensor(x).detach() for x in losses]).sum()

    def global_loss(self, local: torch.Tensor) -> torch.Tensor:
        """Sum the shares over data-parallel ranks, and take it from the last pipeline stage."""
        if not self.mesh:
            return local
        if self.layout.dp > 1:
            dist.all_reduce(local, group=self.mesh["dp"].get_group())
        if self.layout.pp > 1:
            dist.all_reduce(local, group=self.mesh["pp"].get_group())  # stages without the loss hold 0
        return local

    def train(self, until: int | None = None) -> list[float]:
        """Train to step `until` (default: training.steps, which the lr schedule spans); returns the loss of
        every step run (metrics.jsonl holds the logged ones).

        SIGTERM or SIGUSR1 (a SLURM preemption notice) saves a checkpoint at the next step boundary and
        raises Preempted.
        """
        total = until or self.config.training.steps
        losses: list[float] = []
        # The steps not yet settled: (step, this rank's loss share, gradient norm), all still on the device.
        pending: list[tuple[int, torch.Tensor, torch.Tensor]] = []

        # Each step's finiteness, read at most one step later: a NaN stops the run then, not at the next log.
        finite_flags = FiniteFlags(self.device)

        def settle() -> float:
            """Bring the pending steps to the host, in one collective and one device sync, and act on any
            non-finite one; returns the last step's global loss. Every rank settles at the same steps: before
            anything is logged or saved, so a skipped step is known and logged in order."""
            if pending:
                steps, shares, norms = zip(*pending)
                pending.clear()
                finite_flags.clear()
                step_losses = self.global_loss(torch.stack(shares)).tolist()
                for step, loss, norm in zip(steps, step_losses, torch.stack(norms).tolist()):
                    losses.append(loss)
                    self._check_finite(step, loss, norm)
            return losses[-1]

        if self.step >= total:
            log.info(
                "already at step %d of training.steps %d: nothing to train (to train on, raise training.steps and "
                "pass --checkpoint.allow_changes training.steps)",
                self.step,
                total,
            )
        self.model_parts.train()
        first_step, window_start, window_steps, window_tokens = self.step, time.perf_counter(), 0, 0
        with self.stop.on_signals(), self.profiler:
            while self.step < total:
                if finite_flags.nonfinite_due():
                    settle()  # stops the run, or logs the skipped step
                step_start = time.perf_counter()
                with self.clock.phase("data"):
                    batches = next(self.loader)
                lr = self.optimizer.param_groups[0]["lr"]
                compute_start = time.perf_counter()
                local_loss, grad_norm = self.step_without_loss_reduction(batches)
                compute_s = time.perf_counter() - compute_start
                pending.append((self.step, local_loss, grad_norm))
                finite_flags.add(grad_norm)
                # Tokens batching takes whole documents up to the budget: count the tokens it took.
                step_tokens = batches[0].step_loss_tokens if self.documents else self.tokens_per_step
                self.tokens_seen += step_tokens
                window_steps, window_tokens = window_steps + 1, window_tokens + step_tokens
                phases = self.clock.take()  # the step's own phases; logged with the step if it is logged
                logged = self.step % self.config.metrics.log_freq == 0 or self.step in (total, first_step + 1)
                checked = self.replanner.due(self.step)
                interval = self.config.validation.interval
                validated = bool(interval) and (self.step % interval == 0 or self.step == total)
                saving = self.checkpointer.due(self.step, final=self.step == total)
                if logged or checked or validated or saving:
                    loss = settle()
                if logged:
                    if self.device.type == "cuda":
                        torch.cuda.synchronize(self.device)
                    window_s = time.perf_counter() - window_start
                    self._log_step(loss, grad_norm, lr, window_s / window_steps, window_tokens / window_s, phases)
                    if self.documents:
                        self._log_packing(compute_s)
                    window_start, window_steps, window_tokens = time.perf_counter(), 0, 0
                if checked:
                    self._check_stragglers()
                if validated:
                    self._log_validation()
                    window_start, window_steps, window_tokens = time.perf_counter(), 0, 0  # evaluation is not steps
                # A skipped step's state is saved, but not as a finite one (see Checkpointer._prune).
                saved_loss = lambda: float("nan") if self.skipped_in_a_row else settle()  # noqa: E731
                if saving:
                    self._log_checkpoint(
                        self.checkpointer.save(self.step, self.tokens_seen, saved_loss(), wait=self.step == total)
                    )
                if self.stop.agreed(self.step, time.perf_counter() - step_start):
                    saved = "checkpointing is off (checkpoint.enable = false): nothing saved"
                    if self.config.checkpoint.enable:
                        settle()
                        self._log_checkpoint(
                            self.checkpointer.save(self.step, self.tokens_seen, saved_loss(), wait=True)
                        )
                        saved = f"checkpoint saved in {self.checkpointer.folder}: run the same command to resume"
                    raise Preempted(f"stopped by {self.stop.reason} at step {self.step}; {saved}")
                self.step_times.append(time.perf_counter() - step_start)
                profiler_start = time.perf_counter()
                if self.profiler.step():  # writing the trace is not step time
                    window_start, window_steps, window_tokens = time.perf_counter(), 0, 0
                else:  # nor is starting the profiler, which the next step's window would otherwise hold
                    window_start += time.perf_counter() - profiler_start
        if pending:
            settle()
        self.checkpointer.finish_pending()
        self.metrics.close()
        return losses

    def _log_step(self, loss, grad_norm, lr, step_time: float, tokens_per_s: float, phases: dict) -> None:
        total = self.config.training.steps
        metrics = {
            "loss": float(loss),
            "grad_norm": float(grad_norm),
            "lr": lr,
            "tokens_per_s": tokens_per_s,
            "tokens_per_s_per_device": tokens_per_s / self.world_size,
            "step_time_s": step_time,
            "peak_memory_gib": peak_memory_bytes(self.device) / 2**30,
            "tokens_seen": self.tokens_seen,
        }
        if self.peak_flops:
            metrics["mfu"] = tokens_per_s * self.flops_per_token / (self.peak_flops * self.world_size)
        metrics.update(phases)
        self.metrics.log(self.step, metrics)
        log.info(format_line(self.step, total, metrics, eta_s=step_time * (total - self.step)))

    def _log_packing(self, compute_s: float) -> None:
        """The step's plan against what it took: predicted seconds per data-parallel rank (the slowest, and
        slowest over mean), and each rank's measured time for the step's micro-batches (waits at collectives
        included, so under FSDP every rank reads about the slowest's time)."""
        plan = self.loader.last_assignment
        measured = gather_times(compute_s, self.dp_rank, self.layout.dp, self.device)
        mean = sum(measured) / len(measured)
        self.metrics.log(
            self.step,
            {
                "micro_batches": len(plan.micro_batches[0]),
                "predicted_step_s": plan.step_time,
                "predicted_imbalance": plan.imbalance,
                "measured_step_s": max(measured),
                "measured_imbalance": max(measured) / mean if mean > 0 else 1.0,
                "plan_ms": self.loader.assign_seconds * 1e3,
            },
        )

    def _log_validation(self) -> None:
        start = time.perf_counter()
        loss = self.evaluate()
        metrics = {
            "val_loss": loss,
            "val_perplexity": math.exp(min(loss, 50.0)),
            "val_time_s": time.perf_counter() - start,
        }
        self.metrics.log(self.step, metrics)
        log.info(
            "step %d validation: loss %.4f | perplexity %.2f | %.1fs",
            self.step,
            loss,
            metrics["val_perplexity"],
            metrics["val_time_s"],
        )

    def _check_finite(self, step: int, loss: float, grad_norm: float) -> None:
        """Stop at a NaN or inf gradient norm (nothing is saved after the last good step), or count the step as
        skipped. The norm is global, so every rank decides alike."""
        if math.isfinite(grad_norm):
            self.skipped_in_a_row = 0
            return
        t = self.config.training
        self.skipped_in_a_row += 1
        self.metrics.log(step, {"skipped_step": 1})
        what = f"step {step}: loss {loss}, gradient norm {grad_norm}"
        if t.on_nonfinite == "skip" and self.skipped_in_a_row < t.max_skipped_steps:
            log.warning("%s: update skipped (%d in a row)", what, self.skipped_in_a_row)
            return
        self.checkpointer.finish_pending()  # a save in flight holds an earlier state
        if t.on_nonfinite == "skip":
            what += f" ({self.skipped_in_a_row} steps in a row skipped, training.max_skipped_steps)"
        lr = f"--optimizer.lr {self.config.optimizer.lr / 2:.3g}"
        good = self.checkpointer.last_good()
        if good is None:
            raise NonFinite(f"{what}; no checkpoint was saved before: start again with a lower learning rate ({lr})")
        newest = max(complete_checkpoints(self.checkpointer.folder))
        good_step = int(good.name.removeprefix("step-"))
        rewind = f" --checkpoint.load_step {good_step}" if good_step != newest else ""
        raise NonFinite(
            f"{what}; nothing was saved from this step on. The last good checkpoint is {good}: resume from it with "
            f"a lower learning rate, adding {lr}{rewind} --checkpoint.allow_changes optimizer.lr to the command"
        )

    def _log_checkpoint(self, metrics: dict | None) -> None:
        if metrics:
            self.metrics.log(self.step, metrics)


class NonFinite(UserError):
    """The loss or gradient norm became NaN or inf: training stopped without saving (a recipe problem, most
    often a learning rate too high for the model)."""
