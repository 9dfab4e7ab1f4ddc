"""The recipe's data checks: its sources and their batching, validation's held-out split and named sets, and the
in-run evaluation's tasks (titan/config/checks.py runs them with the other sections')."""

from __future__ import annotations

import math
import re
from pathlib import Path

from titan.config.sections import Config, DataSource, Validation, ValidationSet
from titan.config.stages import check_mixture, check_stages
from titan.errors import require


def validate_data(config: Config) -> None:
    """The tokenizer, the data sources and their batching, and the held-out validation share."""
    d, v = config.data, config.validation
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
    if d.sources:
        check_mixture(d.sources, "data.sources")
    check_stages(config)
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
            not same_documents(v, source),
            f"validation.source {v.source!r} reads the documents that {key} {source.source!r} trains on, so "
            "validation would measure memorisation; name a source of held-out documents, or leave validation.source "
            "empty to hold out validation.fraction of the training documents",
        )


def validate_evaluation(config: Config) -> None:
    """The validation sets and the in-run benchmark tasks; which tasks exist is asked of lm-eval at start-up
    (titan/train/evaluation.py)."""
    v, e = config.validation, config.eval
    names = [s.name for s in v.sets]
    for i, s in enumerate(v.sets):
        require(
            re.fullmatch(r"[A-Za-z0-9_.-]+", s.name) is not None,
            f"validation.sets[{i}].name {s.name!r} must be letters, digits, '_', '.' or '-': it names the curve "
            "val/<name>/loss",
        )
        require(names.count(s.name) == 1, f"validation.sets: two sets are named {s.name!r}; give each its own name")
        require(s.source != "", f"validation.sets[{i}].source must name a local file, folder or hub dataset")
        for j, source in enumerate(config.data.source_list()):
            require(
                not same_documents(s, source),
                f"validation.sets[{i}].source {s.source!r} reads the documents data source {j} trains on, so its loss "
                "would measure memorisation; name a source of held-out documents",
            )
    require(
        not v.sets or v.interval > 0,
        "validation.sets are evaluated at validation.interval, which is 0; set validation.interval (e.g. 50)",
    )
    require(e.interval >= 0, f"eval.interval must be >= 0 (0: no tasks in the run), got {e.interval}")
    require(
        bool(e.tasks) == (e.interval > 0),
        "eval.tasks and eval.interval go together: name lm-eval tasks (eval.tasks = ['hellaswag']) and how often "
        f"to run them (eval.interval = 50), or neither; got tasks {e.tasks} every {e.interval} steps",
    )
    require(e.batch_size > 0, f"eval.batch_size must be positive, got {e.batch_size}")
    require(e.limit >= 0, f"eval.limit must be >= 0 (0: every document), got {e.limit}")
    require(
        not e.include_path or Path(e.include_path).is_dir(),
        f"eval.include_path {e.include_path!r}: no such folder; give a folder of lm-eval task YAML files",
    )


def same_documents(v: Validation | ValidationSet, source: DataSource) -> bool:
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
