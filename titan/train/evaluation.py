"""Evaluation between steps, on the run's own model as its layout holds it, every rank taking part: the validation
losses (validation's held-out split and each of validation.sets) every validation.interval steps, and lm-eval-harness
tasks (eval.tasks) every eval.interval steps.

A task runs in the run rather than on a spare device from the checkpoint just saved: no device sits idle in a run
that uses them all, and no checkpoint need be written for it. Every rank runs the same requests in the same order
through its share of the model, on every layout, and rank 0 logs the results, one process's: FSDP gathers each
layer as training's forward does, and RunModel gives every rank whole logits under TP, CP, EP and a pipeline. A
task that fails (an exception inside lm-eval, its data gone) is one line in the log, and training goes on; a task
lm-eval does not know is refused at start-up.
"""

from __future__ import annotations

import contextlib
import logging
import random
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from titan.config import Config, Eval
from titan.data import GlobalBatchLoader
from titan.errors import ConfigError
from titan.observe.run_report import RunReport
from titan.parallel.parallelize import ModelParts
from titan.train import harness
from titan.train.step import TrainStep

log = logging.getLogger("titan")


def validation_loss(stepper: TrainStep, loader: GlobalBatchLoader, steps: int) -> float:
    """Mean token loss over the loader's first `steps` global batches (the same batches at every evaluation and on
    every layout)."""
    return stepper.evaluate([loader.batches_at(i * loader.global_batch) for i in range(steps)]).item()


class RunModel:
    """The run's model as lm-eval's requests and decoding take it (harness.TitanLM, decoding.generate): token ids of
    whole rows in, their whole logits out on every rank, through the rank's share of the model. Under loss_parallel
    the head's logits are a DTensor sharded on the vocabulary, gathered here. Sequence parallelism cuts the sequence
    into the model's sequence_shards equal pieces, so a forward's tokens are padded after the last to a multiple of
    them (no earlier token attends to the padding) and its logits cut back; when decoding, the padding's cache slots
    are handed back to the tokens that follow. Under context parallelism the rows are this rank's whole
    (local=True): attention runs without the ring. Under a pipeline (`pipeline`: this rank's pipeline group) the
    stages run in order outside the schedule, each stage's output broadcast from the rank that holds it to the
    group: the next stage's input, and after the last the logits."""

    def __init__(self, parts: ModelParts, pipeline: dist.ProcessGroup | None = None):
        self.stages, self.n_stages = dict(zip(parts.stage_ids, parts.parts)), parts.n_stages
        self.args, self.shards, self.pipeline = parts.parts[0].args, parts.parts[0].sequence_shards, pipeline
        self.holder: dict[int, int] = {}  # under a pipeline: the pipeline rank that holds each stage
        if pipeline is not None:
            held = [None] * dist.get_world_size(pipeline)
            dist.all_gather_object(held, parts.stage_ids, group=pipeline)
            self.holder = {stage: rank for rank, ids in enumerate(held) for stage in ids}

    def parameters(self):
        for part in self.stages.values():
            yield from part.parameters()

    def kv_cache(self, batch: int, max_len: int, pad: torch.Tensor | None = None) -> dict:
        # Room for the last forward's padding.
        return {stage: part.kv_cache(batch, max_len + self.shards - 1, pad) for stage, part in self.stages.items()}

    def __call__(self, tokens: torch.Tensor, cache: dict | None = None) -> torch.Tensor:
        width, padding = tokens.shape[1], -tokens.shape[1] % self.shards
        x = F.pad(tokens, (0, padding))
        for stage in range(self.n_stages):
            if stage in self.stages:
                x = self.stages[stage](x, cache=None if cache is None else cache[stage], local=True)
                x = x[0] if isinstance(x, tuple) else x  # a stage before the last passes on its hidden states
                x = x.full_tensor() if isinstance(x, DTensor) else x
            if self.pipeline is not None:
                x = self._broadcast(x, self.holder[stage])
        for layers in (cache or {}).values():
            for layer in layers:
                layer.length -= padding
        return x[:, :width]

    def _broadcast(self, x: torch.Tensor, holder: int) -> torch.Tensor:
        """The pipeline rank `holder`'s x on every rank of the pipeline group (the others' x is ignored)."""
        mine = dist.get_rank(self.pipeline) == holder
        form = [(x.shape, x.dtype) if mine else None]
        dist.broadcast_object_list(form, group_src=holder, group=self.pipeline)
        x = x if mine else torch.empty(form[0][0], dtype=form[0][1], device=x.device)
        dist.broadcast(x, group_src=holder, group=self.pipeline)
        return x


class Tasks:
    """eval.tasks on a model, checked at start-up: every task known to lm-eval, and an include_path task that
    names Python (!function) only with eval.allow_task_code. tokenizer: the run's; precision: the context the
    model's forwards run in; pipeline: this rank's pipeline group (None: no pipeline)."""

    def __init__(self, e: Eval, tokenizer, precision: Callable, pipeline: dist.ProcessGroup | None = None):
        self.e, self.tokenizer, self.precision, self.pipeline = e, tokenizer, precision, pipeline
        include = Path(e.include_path) if e.include_path else None
        code = harness.task_code(e.tasks, include)
        if code and not e.allow_task_code:
            more = f" and {len(code) - 1} more" if len(code) > 1 else ""
            raise ConfigError(f"eval.tasks: a task file is code, and these run Python: {code[0]}{more}; read it, "
                              "then set eval.allow_task_code = true to run it")  # fmt: skip
        harness.go_offline_for_local_tasks(e.tasks, include)  # before lm-eval imports HF datasets
        self.manager = harness.task_manager(e.tasks, include, ("eval.tasks", "eval.include_path"))

    def lm(self, parts: ModelParts):
        """lm-eval's model interface over this rank's parts of the model."""
        group = dist.group.WORLD if dist.is_initialized() else None  # every rank decodes rank 0's tokens
        model = RunModel(parts, self.pipeline)
        return harness.lm_class()(model, self.tokenizer, self.e.batch_size, self.precision, group)

    def run(self, parts: ModelParts, step: int) -> dict[str, float]:
        """Every task on the model, as metrics eval/<task>/<metric>; a task that fails is left out, with one line
        in the log."""
        e, metrics = self.e, {}
        limit, fewshot = e.limit or None, None if e.num_fewshot < 0 else e.num_fewshot
        lm = self.lm(parts)
        parts.train(False)
        try:
            with torch.no_grad(), _random_state_kept():  # lm-eval seeds the global generators
                for task in e.tasks:
                    try:
                        found = harness.run_tasks(lm, [task], self.manager, limit, fewshot, bootstrap_iters=0)
                        if found is not None:  # lm-eval returns the results on a node's first process alone
                            metrics |= task_metrics(found["results"])
                    except Exception as error:  # noqa: BLE001 (whatever lm-eval or a task's code raises)
                        first = str(error).strip().splitlines()[0] if str(error).strip() else ""
                        log.warning("step %d: eval task %s failed (%s: %s); training goes on", step, task,
                                    type(error).__name__, first)  # fmt: skip
        finally:
            parts.reshard()
            parts.train()
        return metrics


def task_metrics(results: dict[str, dict]) -> dict[str, float]:
    """lm-eval's results as eval/<task>/<metric>, e.g. eval/hellaswag/acc_norm, with a filter other than "none"
    after the metric (eval/gsm8k/exact_match/strict-match); standard errors and names are left out."""
    metrics = {}
    for task, values in results.items():
        for key, value in values.items():
            metric, comma, kept = key.partition(",")  # lm-eval's metrics are "metric,filter"; the rest is about them
            if not comma or "_stderr" in metric or isinstance(value, bool) or not isinstance(value, (int, float)):
                continue
            metrics[f"eval/{task}/{metric}" + (f"/{kept}" if kept not in ("", "none") else "")] = float(value)
    return metrics


@contextlib.contextmanager
def _random_state_kept():
    """Python's, numpy's and torch's global generators as they were before: what draws from them after the tasks
    draws as it would have without them."""
    states = random.getstate(), np.random.get_state()
    try:
        with torch.random.fork_rng(devices=range(torch.cuda.device_count()) if torch.cuda.is_initialized() else []):
            yield
    finally:
        random.setstate(states[0])
        np.random.set_state(states[1])


class Evaluation:
    """What the loop runs between steps at their intervals: the validation losses, into `report`, and the tasks."""

    def __init__(self, config: Config, validation: GlobalBatchLoader | None, sets: dict[str, GlobalBatchLoader],
                 tasks: Tasks | None, report: RunReport):  # fmt: skip
        self.steps, self.task_interval = config.validation.steps, config.eval.interval
        self.validation, self.sets, self.tasks, self.report = validation, sets, tasks, report

    def tasks_due(self, step: int, total: int) -> bool:
        return self.tasks is not None and (step % self.task_interval == 0 or step == total)

    def validate(self, step: int, stepper: TrainStep) -> None:
        """The held-out split's loss (val_loss), then each set's (val/<name>/loss)."""
        start = time.perf_counter()
        self.report.validation(step, validation_loss(stepper, self.validation, self.steps), time.perf_counter() - start)
        for name, loader in self.sets.items():
            start = time.perf_counter()
            loss = validation_loss(stepper, loader, self.steps)
            self.report.validation_set(step, name, loss, time.perf_counter() - start)

    def run_tasks(self, step: int, parts: ModelParts) -> None:
        start = time.perf_counter()
        metrics = self.tasks.run(parts, step)
        self.report.tasks(step, metrics, time.perf_counter() - start)
