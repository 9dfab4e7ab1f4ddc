"""The one training loop: build the parts the recipe and its run plan name, then step, clip, log until done."""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from titan.checkpoint.resume import complete_checkpoints
from titan.config import Config, run_stages, stage_at
from titan.data import DocumentBatchLoader
from titan.data.tokenizer import Tokenizer
from titan.launcher import Launch
from titan.observe.metrics import (
    ThroughputWindow,
    log_to_file,
    setup_logging,
)
from titan.observe.profiling import DeviceTimer, Profiler, StepClock
from titan.observe.run_report import RunReport
from titan.parallel.mesh import build_mesh, init_distributed, new_gloo_group, on_rank_0, rank_devices
from titan.run_plan import RunPlan
from titan.train.build import (
    build_checkpointer,
    build_data,
    build_step,
    claim_run_folder,
    init_from_hf,
    keep_tokenizer,
)
from titan.train.device import pick_device
from titan.train.digests import DIGESTS, StepDigests
from titan.train.evaluation import Evaluation, Tasks, validation_loss
from titan.train.preflight import check_run, check_tokenizer
from titan.train.recovery import Recovery
from titan.train.recovery.watchdog import Watchdog
from titan.train.replan import Replanner, resplit
from titan.train.step import StepHook, TrainStep, UnsettledSteps
from titan.train.stop import NonFiniteSteps, Preempted, StopVote
from titan.train.straggler import gather_times

log = logging.getLogger("titan")


@dataclass(frozen=True)
class Due:
    """What follows a step: logging it, a re-plan check, validation, benchmark tasks, a checkpoint."""

    log: bool
    replan: bool
    validate: bool
    tasks: bool
    save: bool

    @property
    def anything(self) -> bool:
        return self.log or self.replan or self.validate or self.tasks or self.save


class Trainer:
    def __init__(self, config: Config, hook: StepHook | None = None, stop: Callable[..., StopVote] = StopVote):
        """hook: where tests and tools look into each step; stop: makes the stop vote from the control group."""
        started = time.perf_counter()  # the run's wall time, in its summary
        self.device, device_reason = pick_device(config.training.device)
        launch = Launch.from_env()
        setup_logging(launch.rank)  # the pre-flight logs the activation budget it resolves
        # Everything that can be wrong with the recipe and its tokenizer is checked before joining the other processes.
        checked = check_run(config, launch.world, lambda: self.device)
        self.config = config = checked.config  # the recipe as the run runs it
        t = config.training
        self.model, self.layout = checked.model, checked.layout
        self.run_plan, self.blocks = checked.plan, checked.blocks  # the plan's blocks: a re-plan splits them
        check_tokenizer(config, self.model.args)
        waits = config.fault.collective_timeout_s  # joining and every collective of the groups titan makes
        self.rank, self.world_size = init_distributed(config.parallel.backend, self.device, waits)
        self.rank_plan = self.run_plan.rank(self.rank)
        self.stages = run_stages(config, self.run_plan.global_rows) if config.data.stages else []
        # A run on the CPU that meant a GPU is the costliest surprise: say first where it runs and why.
        cpu_fallback = t.device == "auto" and self.device.type == "cpu" and torch.version.cuda is not None
        (log.warning if cpu_fallback else log.info)("device: %s, %s", self.device, device_reason)
        self.control_group = new_gloo_group(waits)  # agreement on errors, checkpoint barriers and the stop vote
        self.run_dir = config.run_dir
        on_rank_0(lambda: claim_run_folder(self.run_dir), self.control_group)
        self.config = config = on_rank_0(lambda: keep_tokenizer(config), self.control_group)
        if self.rank == 0:  # from here on: the folder is this run's
            log_to_file(self.run_dir / "console.log")
        torch.manual_seed(config.job.seed)
        if config.job.deterministic:
            os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
            torch.use_deterministic_algorithms(True)
        self.mesh = build_mesh(self.layout, self.device)
        self.loader, self.validation_loader, self.validation_sets = build_data(
            config, self.run_plan, self.rank_plan, self.model, self.mesh, self.device, self.control_group
        )
        self.clock = StepClock(config.profiling.step_breakdown, self.device)
        self.watchdog = Watchdog.of_run(config.fault, self.rank, self.world_size, self.run_dir)
        self.clock.on_phase = self.watchdog.enter  # the step's phases, as the watchdog names a hang's
        self.hook = hook or StepHook()
        if config.replay.digests:  # what `titan verify --replay` compares a replayed step with
            digests = self.run_dir / DIGESTS
            self.hook = StepDigests(self.hook, digests, self.rank, self.world_size, self.layout.tp, self.device)
        self.stepper = self._build_step(self.run_plan)
        flops_per_token = self.model.spec.flops_per_token(self.model.args, t.seq_len)
        bf16 = self.run_plan.precision.bf16
        self.report = RunReport.of_run(config, self.device, self.rank, self.world_size, self.layout, flops_per_token,
                                       bf16, started)  # fmt: skip
        self.metrics = self.report.metrics
        tasks = None
        if config.eval.tasks:  # a task lm-eval does not know is refused here, before any step
            precision = functools.partial(self.stepper.rules.precision, self.device.type)  # the step's autocast
            pipeline = self.mesh["pp"].get_group() if self.layout.pp > 1 else None
            tasks = Tasks(config.eval, Tokenizer(config.tokenizer), precision, pipeline)
        self.evaluation = Evaluation(config, self.validation_loader, self.validation_sets, tasks, self.report)
        self.step_times: list[float] = []  # host wall time of each step, data loading included
        self.profiler = Profiler(config.profiling, self.run_dir / "profiling", self.rank, self.device)
        self.replanner = Replanner(config, self.run_plan, self.blocks, rank_devices(self.control_group), self.device)
        # What a checkpoint saves and restores, by name.
        states = {"model": self.model_parts, "optimizer": self.optimizer, "lr_scheduler": self.lr_scheduler}
        states |= {"data": self.loader, "plan": self.replanner}
        self.checkpointer = build_checkpointer(config, self.model, self.run_plan, states, self.rank, self.control_group)
        self.recovery = Recovery(config, launch, self.checkpointer, self.metrics, self.watchdog, self.clock, self.hook)
        self.step = self.recovery.resume(self.layout.name)
        # Tokens are counted from the checkpoint's count: an allowed change of seq_len or batch size applies
        # from the resumed step on.
        self.tokens_seen = self.checkpointer.resumed_state.get("tokens_seen", 0)
        self.nonfinite = NonFiniteSteps(config, self.checkpointer, self.metrics)
        # A re-planned run resumes on the plan in force when it stopped (the replanner dropped a plan measured
        # on another layout or other devices).
        self.follow(self.replanner.plan())
        if config.checkpoint.init_from_hf:
            init_from_hf(config, self.model, self.model_parts, self.checkpointer.resumed_from is not None)
        self.stop = stop(self.control_group)
        params = self.model_parts.n_params(self.rank_plan.first_of_its_stages)
        self.report.start(params, self.layout.name, self.loader.describe(self.run_plan, self.rank_plan))

    # The step's parts, as the checkpointer and the tests see them; a pipeline re-split replaces them.
    model_parts = property(lambda self: self.stepper.parts)
    optimizer = property(lambda self: self.stepper.optimizer)
    lr_scheduler = property(lambda self: self.stepper.lr_scheduler)

    def _build_step(self, plan: RunPlan) -> TrainStep:
        return build_step(self.config, self.model, plan, self.rank, self.mesh, self.device, self.clock, self.hook)

    def follow(self, plan: RunPlan) -> str:
        """Train on `plan` from the next step on (every rank calls this with the same plan). The data shares
        change without moving anything (each rank reads other rows of the same global batches); a new pipeline
        split rebuilds the stages and moves each parameter's value and optimizer state to its new rank. Returns
        how the state moved ("" if none did)."""
        how = ""
        if plan == self.run_plan:
            return how
        if plan.stage_layers != self.run_plan.stage_layers:
            scratch = self.checkpointer.folder / f".resplit-step-{self.step}"
            self.stepper, how = resplit(self.stepper, lambda: self._build_step(plan), self.checkpointer, scratch)
            counts = [len(layers) for layers in plan.stage_layers]
            log.info("step %d: pipeline re-split into layers per stage %s (%s)", self.step, counts, how)
        self.run_plan, self.rank_plan = plan, plan.rank(self.rank)
        for loader in filter(None, (self.loader, self.validation_loader, *self.validation_sets.values())):
            loader.follow(plan, self.rank_plan)
        return how

    def train(self, until: int | None = None) -> list[float]:
        """Train to step `until` (default: training.steps, which the lr schedule spans), saving and logging there
        as at the end; returns the loss of every step run (metrics.jsonl holds the logged ones).

        SIGTERM, SIGUSR1 (a SLURM preemption notice) or Ctrl-C saves a checkpoint at the next step boundary and
        raises Preempted; a second Ctrl-C raises KeyboardInterrupt at once. A run that ends frees its snapshots.
        """
        try:
            return self._train(until)
        except BaseException as e:
            self.recovery.ended(e)  # the snapshots stay where torchrun restarts the workers to continue from them
            raise

    def _train(self, until: int | None) -> list[float]:
        total = until or self.config.training.steps
        if self.step >= total:
            log.info("already at step %d of training.steps %d: nothing to train (to train on, raise training.steps "
                     "and pass --checkpoint.allow_changes training.steps)", self.step, total)  # fmt: skip
        unsettled = UnsettledSteps(self.stepper.global_loss, self._settled, self.device)
        self.stepper.parts.train()
        first_step, window = self.step, ThroughputWindow()
        begun = (first_step, self.tokens_seen, time.perf_counter())  # what this call trains, for the summary
        compute = DeviceTimer(self.device)  # the step's forward, backward and update, for the packing log
        self.watchdog.start()
        with self.stop.on_signals(), self.profiler, contextlib.closing(self.watchdog):
            while self.step < total:
                self.watchdog.enter("logging", self.step + 1)  # a deferred non-finite check settles the loss
                unsettled.settle_if_nonfinite()  # stops the run, or logs the skipped step
                step_start = time.perf_counter()
                if self.stages:
                    self.report.stage(stage_at(self.stages, self.step), self.step, first_step, self.tokens_seen)
                with self.clock.phase("data"):
                    batches = next(self.loader)
                lr = self.optimizer.param_groups[0]["lr"]
                compute.start()
                local_loss, grad_norm = self.stepper(batches, self.step)
                compute.stop()
                self.step += 1
                unsettled.add(self.step, local_loss, grad_norm)
                step_tokens = self.loader.step_tokens(batches)
                self.tokens_seen += step_tokens
                window.add(step_tokens)
                phases = self.clock.take()  # the step's own phases; logged with the step if it is logged
                self.watchdog.enter("logging")
                due = self._due(total, first_step)
                if due.anything:
                    loss = unsettled.settle()
                if due.log:
                    figures = {"loss": loss, "grad_norm": grad_norm, "lr": lr, **phases, **self.stepper.step_metrics()}
                    if self.stages:  # the stage of the step just trained, 0-based self.step - 1
                        figures["stage"] = stage_at(self.stages, self.step - 1).index
                    self.report.step(self.step, figures, window, self.tokens_seen)
                    if isinstance(self.loader, DocumentBatchLoader):
                        self._log_packing(compute.seconds())
                    window.restart()
                if due.replan:
                    self.watchdog.enter("re-plan")
                    self._replan()
                if due.validate:
                    self.watchdog.enter("validation")
                    self.evaluation.validate(self.step, self.stepper)
                    window.restart()  # evaluation is not steps
                if due.tasks:
                    self.watchdog.enter("eval tasks")
                    self.evaluation.run_tasks(self.step, self.model_parts)
                    window.restart()
                # A skipped step's state is saved without a loss (the step had none).
                saved_loss = lambda: float("nan") if self.nonfinite.skipped_in_a_row else unsettled.settle()  # noqa: E731
                if due.save:  # its blocking time is not step time: the ETA counts it apart
                    window.exclude(self._save(saved_loss(), wait=self.step == total))
                # Nor is a snapshot's, or replaying a spiked step (which steps again on the loader's next batch).
                run_again = lambda step: self.stepper(next(self.loader), step - 1)  # noqa: E731
                window.exclude(self.recovery.after_step(self.step, self.tokens_seen, saved_loss, due.save, run_again))
                self.watchdog.enter("stop vote")
                # A stop asked for at the last step is the end anyway: its save is the final one, and exit 0.
                if self.step < total and self.stop.agreed(self.step, time.perf_counter() - step_start):
                    saved = "checkpointing is off (checkpoint.enable = false): nothing saved"
                    if self.config.checkpoint.enable:
                        self._save(saved_loss(), wait=True)
                        saved = f"checkpoint saved in {self.checkpointer.folder}: run the same command to resume"
                    self._summary(begun, unsettled.settle())
                    raise Preempted(f"stopped by {self.stop.reason} at step {self.step}; {saved}", self.stop.reason)
                self.step_times.append(time.perf_counter() - step_start)
                profiler_start = time.perf_counter()
                if self.profiler.step():  # writing the trace is not step time
                    window.restart()
                else:  # nor is starting the profiler, which the next step's window would otherwise hold
                    window.exclude(time.perf_counter() - profiler_start)
        self._finish(begun, unsettled)
        return unsettled.losses

    def _finish(self, begun: tuple[int, int, float], unsettled: UnsettledSteps) -> None:
        """After train()'s loop: its steps settled and saves written; at the run's end, its snapshots freed (shared
        memory outlives the run), its metrics closed and its summary logged."""
        unsettled.settle()
        self.checkpointer.finish_pending()
        if self.step >= self.config.training.steps:
            self.recovery.ended()
            self.metrics.close()
            self._summary(begun, unsettled.settle())

    def _settled(self, step: int, loss: float, grad_norm: float) -> None:
        """A step's global loss and gradient norm, once on the host."""
        spiked = self.recovery.spikes.check(step, loss, grad_norm)
        self.nonfinite.check(step, loss, grad_norm, spiked)

    def _due(self, total: int, first_step: int) -> Due:
        """What the step just taken is followed by."""
        step, interval = self.step, self.config.validation.interval
        save = self.checkpointer.due(step, final=step == total)
        return Due(
            log=step % self.config.metrics.log_freq == 0 or step in (total, first_step + 1),
            replan=self.replanner.due(step),
            validate=bool(interval) and (step % interval == 0 or step == total),
            tasks=self.evaluation.tasks_due(step, total),
            save=save,
        )

    @torch.no_grad()
    def evaluate(self) -> float:
        """Mean token loss over the validation batches (the same batches at every evaluation and on every layout)."""
        return validation_loss(self.stepper, self.validation_loader, self.config.validation.steps)

    def _replan(self) -> None:
        """Probe, and follow a new plan when the speeds call for it: the pipeline's layer split when there is one,
        else the data shares."""
        index = self.rank_plan.pp_rank if self.layout.pp > 1 else self.rank_plan.dp_rank
        weights = self.replanner.measure(index, self.step, self.metrics)
        if weights is not None:
            self.follow(self.replanner.follow(weights, self.step, self.metrics))

    def _save(self, loss: float, wait: bool) -> float:
        """Save a checkpoint; returns the seconds training was blocked."""
        self.watchdog.enter("checkpoint save")
        metrics = self.checkpointer.save(self.step, self.tokens_seen, loss, wait=wait)
        self.metrics.log(self.step, metrics)
        self.report.remaining.record("checkpoint", metrics["checkpoint_blocked_s"])
        return metrics["checkpoint_blocked_s"]

    def _log_packing(self, compute_s: float) -> None:
        """The step's placement of documents against the time each data-parallel rank took for it."""
        measured = gather_times(compute_s, self.rank_plan.dp_rank, self.layout.dp, self.device)
        self.metrics.log(self.step, self.loader.packing_metrics(measured))

    def _summary(self, begun: tuple[int, int, float], loss: float) -> None:
        saved = complete_checkpoints(self.checkpointer.folder)
        self.report.summary(begun, self.step, self.tokens_seen, loss, saved[max(saved)] if saved else None)
