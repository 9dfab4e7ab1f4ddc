"""The recipe's data sections (titan/config/sections.py holds the others and `Config`): the sources a run reads,
what it holds out for validation, and the benchmark tasks it runs. A field's comment is its description, as there."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Literal


@dataclass(frozen=True)
class DataSource:
    """One source of documents, prepared once into token shards (see titan/data/prepared/)."""

    # A local file or folder (text, jsonl/json, parquet), a HF hub dataset name (in the HF cache when offline),
    # or a corpus titan fetches and caches itself ("titan:shakespeare").
    source: str = ""
    format: Literal["auto", "text", "json", "parquet", "hub"] = "auto"  # auto: from the files' suffixes
    text_field: str = "text"  # the record field holding the document's text (json, parquet, hub)
    split: str = "train"  # the hub dataset's split, or a saved DatasetDict's (save_to_disk)
    subset: str = ""  # the hub dataset's configuration name, if it has several
    # The hub dataset's revision (branch, tag or commit; "" = its default branch), part of the prepared tokens' key:
    # pin a commit to read, and reuse, the same documents whatever the hub holds later.
    revision: str = ""
    weight: float = 1.0  # in a mixture: this source's share of the training samples, relative to the others
    # A .txt file's documents: the whole file (a book), its paragraphs (split at blank lines), or each line.
    text_unit: Literal["file", "paragraph", "line"] = "file"


@dataclass(frozen=True)
class DataStage:
    """One [[data.stages]] table: what the run reads from its start on, until the next stage's."""

    name: str = ""  # how logs and metrics name the stage; "" = stage<i>
    start_step: int = 0  # the stage's first step; the first stage starts at 0, each later one after the one before
    start_tokens: int = 0  # or: it starts at the first step that begins at or past this many tokens
    # Its mixture: [[data.stages.sources]] tables, as [[data.sources]]; a source an earlier stage read goes on there.
    sources: list[DataSource] = field(default_factory=list)
    decay: bool = False  # with lr_scheduler.decay = "wsd": the lr decays from this stage's first step


# A mixture's sources take turns in a pattern of samples, repeated (titan/data/stages.py's Blend), in which each
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
    source: str = ""  # a local file or folder, a HF hub dataset, or "titan:shakespeare"; a run needs one
    format: Literal["auto", "text", "json", "parquet", "hub"] = "auto"
    text_field: str = "text"
    text_unit: Literal["file", "paragraph", "line"] = "file"  # .txt: a document per file; or per "paragraph", or "line"
    split: str = "train"
    subset: str = ""
    revision: str = ""
    # ... or a mixture: several [[data.sources]] blended by weight; the single-source keys are then unused.
    sources: list[DataSource] = field(default_factory=list)
    # ... or stages: [[data.stages]], each from a step or token count on with a mixture of its own (an annealing
    # stage); data.source and [[data.sources]] are then left out.
    stages: list[DataStage] = field(default_factory=list)
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
        """The sources the run reads: [[data.sources]], every stage's (each once, weight 1, in order of first use),
        or the single source these keys describe."""
        if self.stages:
            return list(dict.fromkeys(replace(s, weight=1.0) for stage in self.stages for s in stage.sources))
        if self.sources:
            return self.sources
        return [
            DataSource(
                self.source, self.format, self.text_field, self.split, self.subset, self.revision, 1.0, self.text_unit
            )
        ]


@dataclass(frozen=True)
class ValidationSet:
    """A named source of held-out documents of its own, evaluated with validation's at validation.interval."""

    name: str = ""  # its curves: val/<name>/loss and val/<name>/perplexity
    source: str = ""  # a local file or folder, or a HF hub dataset, as validation.source
    format: Literal["auto", "text", "json", "parquet", "hub"] = "auto"
    text_field: str = "text"
    text_unit: Literal["file", "paragraph", "line"] = "file"
    split: str = "validation"
    revision: str = ""


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
    text_unit: Literal["file", "paragraph", "line"] = "file"  # as data.text_unit
    split: str = "validation"
    revision: str = ""
    # More held-out sources, each its own loss curve, in [[validation.sets]] tables: the same steps and batches as
    # the default one, which stays val_loss.
    sets: list[ValidationSet] = field(default_factory=list)


@dataclass(frozen=True)
class Eval:
    """lm-eval-harness tasks run in the run, on its own model, between steps (titan/train/evaluation.py)."""

    interval: int = 0  # run the tasks every N steps (and at the end); 0: none
    tasks: list[str] = field(default_factory=list)  # lm-eval task names, its own or include_path's
    include_path: str = ""  # a folder of your own task YAML files (docs/eval.md); "" for lm-eval's tasks only
    allow_task_code: bool = False  # run the Python an include_path task names (!function); read it first
    limit: float = 0.0  # documents per task (below 1: a fraction of them); 0: all
    num_fewshot: int = -1  # examples in each prompt; -1: the task's own
    batch_size: int = 8  # sequences per forward
