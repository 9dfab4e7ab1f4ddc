"""Benchmark tasks of lm-eval-harness (the [eval] extra) on titan's model directly: `titan eval --tasks` on a
checkpoint's, and the run's own between steps (titan/train/evaluation.py).

TitanLM is lm-eval's model interface over titan's model and tokenizer. Every text is scored as training framed
documents: BOS, then the text. A context and its continuation are tokenized together and split where the
context's own tokens end (lm-eval's TemplateLM does this); the log-likelihood is the sum of log p(token | what
precedes it) over the continuation's tokens, from one forward of the whole sequence. Generation is `titan
generate`'s decoding with a KV cache, cut at the task's stop strings.

A task whose YAML (under --include-path) reads a local file through one of HF datasets' packaged builders
(dataset_path: json, csv, parquet, text or arrow) needs no network: titan sets HF's offline switches before datasets
is imported, so nothing is looked up on the hub.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from titan.errors import ConfigError, import_extra
from titan.models.decoding import Sampling, generate

LOCAL_BUILDERS = ("json", "csv", "parquet", "text", "arrow")  # HF datasets' builders of local files


def task_yamls(include_path: Path) -> dict[str, str]:
    """{task name: its dataset_path} of the task YAML files under include_path (their top-level keys, read as
    text: lm-eval's YAML holds tags such as !function that a plain YAML reader refuses)."""
    found = {}
    for file in sorted(include_path.rglob("*.y*ml")):
        text = file.read_text(encoding="utf-8", errors="replace")
        task = re.search(r"^task:\s*['\"]?([^'\"\s#]+)", text, re.MULTILINE)
        dataset = re.search(r"^dataset_path:\s*['\"]?([^'\"\s#]+)", text, re.MULTILINE)
        if task:
            found[task[1]] = dataset[1] if dataset else ""
    return found


class _Function(str):
    """A `!function module.name` tag's target: Python that lm-eval imports and calls."""


def _load_task_yaml(path: Path):
    """A task YAML as lm-eval reads it, except that a `!function` tag is recorded, never imported."""
    import yaml

    class Loader(yaml.SafeLoader):
        pass

    Loader.add_constructor("!function", lambda loader, node: _Function(loader.construct_scalar(node)))
    try:
        return yaml.load(path.read_text(encoding="utf-8", errors="replace"), Loader=Loader)  # noqa: S506
    except yaml.YAMLError as e:
        raise ConfigError(f"--include-path: {path} is not YAML lm-eval reads: {str(e).splitlines()[0]}") from None


def task_code(tasks: list[str], include_path: Path | None) -> list[str]:
    """The Python that the requested tasks of include_path would run: each `!function` of their YAML files, of the
    files those include and of the tasks a requested group lists, e.g. 'tasks/capitals.yaml: process_docs:
    !function helpers.process_docs (tasks/helpers.py)'. lm-eval imports a `!function`'s module from beside the
    YAML or, failing that, from anywhere Python finds it (`!function os.system` resolves). Tasks lm-eval ships
    run its own installed code, and are not listed."""
    if include_path is None or not include_path.is_dir():
        return []
    defined: dict[str, Path] = {}
    parsed = {file: _load_task_yaml(file) for file in sorted(include_path.rglob("*.y*ml"))}
    for file, config in parsed.items():
        for key in ("task", "group") if isinstance(config, dict) else ():
            if isinstance(config.get(key), str):
                defined.setdefault(config[key], file)
    found, seen, todo = [], set(), [defined[t] for t in tasks if t in defined]
    while todo:
        file = todo.pop()
        if file in seen or not file.is_file():
            continue
        seen.add(file)
        config = parsed[file] if file in parsed else _load_task_yaml(file)  # an include may lie outside the folder
        for where, target in _functions(config, ""):
            module = file.parent / f"{target.rsplit('.', 1)[0].replace('.', '/')}.py"
            beside = f" ({module})" if module.is_file() else ""
            found.append(f"{file}: {where}: !function {target}{beside}")
        if isinstance(config, dict):
            if isinstance(config.get("include"), str):
                todo.append(file.parent / config["include"])
            members = config.get("task") if isinstance(config.get("task"), list) else []
            todo += [defined[m] for m in members if isinstance(m, str) and m in defined]
    return found


def _functions(value, where: str):
    """(key path, target) of every `!function` in a task's parsed YAML."""
    if isinstance(value, _Function):
        yield where, str(value)
    elif isinstance(value, dict):
        for key, item in value.items():
            yield from _functions(item, f"{where}.{key}" if where else str(key))
    elif isinstance(value, list):
        for i, item in enumerate(value):
            yield from _functions(item, f"{where}[{i}]")


def go_offline_for_local_tasks(tasks: list[str], include_path: Path | None) -> bool:
    """Set HF's offline switches (unless already set) when every task is one of include_path's reading a local
    file; call before HF datasets is imported, which reads them once. Returns whether it did."""
    if include_path is None:
        return False
    local = task_yamls(include_path)
    if not all(local.get(task, "") in LOCAL_BUILDERS for task in tasks):
        return False
    for switch in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE"):
        os.environ.setdefault(switch, "1")
    return True


def _template_lm():
    return import_extra("lm_eval.api.model", "eval", "titan eval --tasks (lm-eval-harness)").TemplateLM


def lm_class():
    """TitanLM, a subclass of lm-eval's TemplateLM: built on first use, as lm_eval is an optional package."""
    template = _template_lm()

    class TitanLM(template):
        def __init__(
            self,
            model: nn.Module,
            tokenizer,
            batch_size: int = 8,
            precision: Callable = contextlib.nullcontext,
            group: dist.ProcessGroup | None = None,
        ):
            """model: in eval mode (no dropout), or the run's as evaluation.RunModel takes it; precision: the context
            its forwards run in (the run's autocast); group: the ranks that run the same requests together, which
            all decode rank 0's tokens (None: one process)."""
            super().__init__()
            self.model, self.precision, self.group = model, precision, group
            self.titan_tokenizer = tokenizer
            self.batch_size = batch_size
            self.max_length = self.model.args.max_seq_len
            self._device = next(self.model.parameters()).device

        @property
        def eot_token_id(self) -> int:
            return self.titan_tokenizer.eos_id

        @property
        def prefix_token_id(self) -> int:
            # What an empty context is: a document just begun (after EOS, for a tokenizer without BOS).
            tokenizer = self.titan_tokenizer
            return tokenizer.eos_id if tokenizer.bos_id is None else tokenizer.bos_id

        def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:
            ids = self.titan_tokenizer.encode(string)[:-1]  # BOS + text: a document still going on
            return ids if add_special_tokens is not False else ids[len(self.titan_tokenizer.starts) :]

        def tok_decode(self, ids: list[int]) -> str:
            return self.titan_tokenizer.decode(ids)

        def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs) -> list[tuple[float, bool]]:
            return loglikelihoods(self, requests)

        def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
            from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

            scores = []
            for (text,) in (request.args for request in requests):
                tokens = self.tok_encode(text, add_special_tokens=False)
                windows = get_rolling_token_windows(tokens, self.prefix_token_id, self.max_length, 1)
                pieces = [(None, *make_disjoint_window(window)) for window in windows]
                scores.append(sum(logprob for logprob, _ in self._loglikelihood_tokens(pieces)))
            return scores

        def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
            return generations(self, [request.args for request in requests])

    return TitanLM


@torch.no_grad()
def loglikelihoods(lm, requests) -> list[tuple[float, bool]]:
    """(sum of log p(continuation token | all before it), whether each was the likeliest) per request (key,
    context ids, continuation ids), in batches of lm.batch_size, longest first; rows right-padded, which a causal
    model's earlier positions never see."""
    results: list[tuple[float, bool] | None] = [None] * len(requests)
    order = sorted(range(len(requests)), key=lambda i: -len(requests[i][1]) - len(requests[i][2]))
    for chunk in _batched(order, lm.batch_size):
        rows = [(requests[i][1] + requests[i][2])[-(lm.max_length + 1) :] for i in chunk]
        width = max(map(len, rows)) - 1
        inputs = torch.tensor([row[:-1] + [0] * (width - len(row) + 1) for row in rows], device=lm.device)
        with lm.precision():
            logprobs = lm.model(inputs).float().log_softmax(-1)
        for i, row, scores in zip(chunk, rows, logprobs):
            n = len(requests[i][2])
            targets = torch.tensor(row[-n:], device=lm.device)
            scores = scores[len(row) - 1 - n : len(row) - 1]  # the positions that predict the continuation
            results[i] = (scores.gather(-1, targets[:, None]).sum().item(), bool((scores.argmax(-1) == targets).all()))
            if requests[i][0] is not None:
                lm.cache_hook.add_partial("loglikelihood", requests[i][0], results[i])
    return results


def generations(lm, requests: list[tuple[str, dict]]) -> list[str]:
    """The continuation of each (context, lm-eval's generation arguments): greedy unless do_sample, at most
    max_gen_toks tokens, cut before the first of its `until` strings."""
    texts: list[str | None] = [None] * len(requests)
    groups: dict[str, list[int]] = {}
    for i, (_, kwargs) in enumerate(requests):  # one batch decodes with one set of arguments
        groups.setdefault(repr(sorted(kwargs.items())), []).append(i)
    for indices in groups.values():
        kwargs = dict(requests[indices[0]][1])
        until = kwargs.get("until") or []
        until = [until] if isinstance(until, str) else list(until)
        new_tokens = min(int(kwargs.get("max_gen_toks", 256)), lm.max_length - 1)
        sampled = kwargs.get("do_sample", False) and kwargs.get("temperature", 1.0) > 0
        sampling = Sampling(
            float(kwargs.get("temperature", 1.0)) if sampled else 0.0,
            int(kwargs.get("top_k") or 0),
            float(kwargs.get("top_p") or 1.0),
        )
        room = lm.max_length - new_tokens + 1  # prompt tokens kept (the last ones), beside the new ones
        for chunk in _batched(indices, lm.batch_size):
            prompts = [lm.tok_encode(requests[i][0])[-room:] for i in chunk]
            with lm.precision():
                rows = generate(lm.model, prompts, new_tokens, sampling, lm.eot_token_id, lm.group).tokens
            for i, row in zip(chunk, rows):
                text = lm.tok_decode(row[:-1] if row[-1] == lm.eot_token_id else row)
                for stop in until:
                    text = text.split(stop)[0]
                texts[i] = text
    return texts


def _batched(items: list[int], size: int) -> list[list[int]]:
    return [items[i : i + size] for i in range(0, len(items), size)]


def task_manager(tasks: list[str], include_path: Path | None, keys: tuple[str, str] = ("--tasks", "--include-path")):
    """lm-eval's TaskManager over its own tasks and include_path's, once every task is known to it: a ConfigError
    naming `keys` (the options or recipe keys of the tasks and the folder) otherwise. Indexing lm-eval's own
    thousands of task files takes seconds, so they are left out when include_path defines every task."""
    import_extra("lm_eval", "eval", f"{keys[0]} (lm-eval-harness)")
    from lm_eval.tasks import TaskManager

    if include_path is not None and not include_path.is_dir():
        raise ConfigError(f"{keys[1]} {include_path}: no such folder; give a folder of task YAML files")
    logging.getLogger("lm_eval").setLevel(logging.WARNING)  # its per-task INFO lines; warnings still show
    local = include_path is not None and set(tasks) <= set(task_yamls(include_path))
    manager = TaskManager(include_path=str(include_path) if include_path else None, include_defaults=not local)
    unknown = [task for task in tasks if task not in manager.all_tasks]
    if unknown:
        where = f" nor in {include_path}" if include_path else f" (a task file of your own: {keys[1]} FOLDER)"
        raise ConfigError(f"{keys[0]}: {', '.join(unknown)} is no lm-eval task{where}; `lm_eval ls tasks` lists them")
    return manager


def run_tasks(lm, tasks: list[str], manager, limit: float | None, num_fewshot: int | None, bootstrap_iters=100000):
    """lm-eval's results of `tasks` (names `manager` knows) on the model; bootstrap_iters: the resamples its
    standard errors take (0: none, which saves seconds per task)."""
    lm_eval = import_extra("lm_eval", "eval", "titan eval --tasks (lm-eval-harness)")
    import_extra("datasets", "eval", "titan eval --tasks").disable_progress_bars()  # a bar per split it builds
    # Without a network, the hub client retries each file five times, a warning each, before the error below says
    # it once.
    logging.getLogger("huggingface_hub").setLevel(logging.ERROR)
    try:
        return lm_eval.simple_evaluate(
            model=lm,
            tasks=tasks,
            task_manager=manager,
            limit=limit,
            num_fewshot=num_fewshot,
            log_samples=False,
            bootstrap_iters=bootstrap_iters,
        )
    except ConnectionError as e:  # datasets' and the hub client's, offline mode's included
        raise ConfigError(
            f"--tasks {','.join(tasks)}: could not fetch a task's dataset: {str(e).splitlines()[0]}. Run it once "
            "where the Hugging Face hub is reachable (the datasets cache keeps it), or give a task file over local "
            "data (--include-path)"
        ) from None
