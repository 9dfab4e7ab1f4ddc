"""The data plane: sources prepared once into token shards, one global batch per step, validation batches."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import numpy as np

from titan.config import Config, DataSource, Stage, ValidationSet, run_stages
from titan.data.order import Split, hold_out
from titan.data.tokenizer import Tokenizer
from titan.errors import ConfigError

if TYPE_CHECKING:
    from titan.data.document_batches import DocumentBatchLoader, DocumentPieces
    from titan.data.loader import IGNORE, Batch, GlobalBatchLoader, PackedSamples
    from titan.data.stages import StagedBlend

__all__ = [
    "IGNORE",
    "Batch",
    "DocumentBatchLoader",
    "GlobalBatchLoader",
    "Tokenizer",
    "build_loaders",
    "document_pieces",
    "open_prepared",
    "prepared_record",
    "validation_set_loaders",
    "validation_source",
    "whole_source",
]
log = logging.getLogger("titan")
# The loaders (and torch with them) load on first use, not with titan.data: a recipe's tokenizer and data paths are
# checked before torch's import.
_LAZY = {
    "IGNORE": "titan.data.loader",
    "Batch": "titan.data.loader",
    "GlobalBatchLoader": "titan.data.loader",
    "DocumentBatchLoader": "titan.data.document_batches",
}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def check_paths(config: Config) -> None:
    """The recipe's local tokenizer and data files exist (one line each when not), checked before torch is
    imported; `titan:` corpora are fetched, and hub datasets opened, when the run reads them."""
    from titan.data.dataset import open_documents
    from titan.data.tokenizer import tokenizer_file

    if config.tokenizer.path and not config.tokenizer.path.startswith("titan:"):
        tokenizer_file(config.tokenizer.path)
    own = [validation_source(config)] if config.validation.interval and config.validation.source else []
    for source in [*config.data.source_list(), *own, *map(set_source, config.validation.sets)]:
        if not source.source.startswith("titan:"):
            open_documents(source)


def open_prepared(config: Config, source: DataSource):
    """The source's prepared tokens (PreparedDocuments), preparing a small local source on first use."""
    from titan.data.prepared import PreparedDocuments, cache_root_for, ensure_prepared

    d = config.data
    path = ensure_prepared(source, config.tokenizer, cache_root_for(d), d.prepare_workers, d.auto_prepare_max_mb)
    return PreparedDocuments(path)


def validation_source(config: Config) -> DataSource | None:
    v = config.validation
    if not v.source:
        return None
    return DataSource(v.source, v.format, v.text_field, v.split, revision=v.revision, text_unit=v.text_unit)


def set_source(validation_set: ValidationSet) -> DataSource:
    s = validation_set
    return DataSource(s.source, s.format, s.text_field, s.split, revision=s.revision, text_unit=s.text_unit)


def validation_set_loaders(
    config: Config, global_batch: int, rows: range, micro_batches: list[int]
) -> dict[str, GlobalBatchLoader]:
    """Each of validation.sets' loader, by its name: its whole source in order, in global batches of `global_batch`
    rows of which this rank reads `rows` in micro-batches of `micro_batches` rows (as the default validation's)."""
    from titan.data.loader import Blend, GlobalBatchLoader

    loaders = {}
    for i, s in enumerate(config.validation.sets):
        samples = whole_source(config, set_source(s), f"validation.sets[{i}].source {s.source}")
        if config.validation.steps * global_batch > samples.samples_per_epoch:
            log.warning("validation set %s reads %d sequences per evaluation but holds %d: some repeat", s.name,
                        config.validation.steps * global_batch, samples.samples_per_epoch)  # fmt: skip
        loaders[s.name] = GlobalBatchLoader(
            [samples], Blend([1.0]), global_batch, rows, micro_batches, config.data.document_mask
        )
    return loaders


def split(config: Config, documents) -> tuple[Split, Split]:
    """(training, validation) documents of a training source (titan.data.order): validation holds out none when it
    reads a source of its own."""
    v = config.validation
    return hold_out(documents, v.fraction if not v.source else 0.0)


def prepared_record(config: Config) -> dict:
    """What a checkpoint records of the documents the run reads, checked on resume like the recipe's math keys
    (config.PREPARED_KEYS): each training source's prepared tokens, by their key (which hashes the source's
    contents and the tokenizer) and document count, so a source whose files changed or grew behind the same path
    differs; and, when validation runs, its held-out split: the fraction of each training source, or the prepared
    tokens of its own source."""
    record = {"data.prepared": [_prepared_identity(config, source) for source in config.data.source_list()]}
    v = config.validation
    if v.interval:
        own = validation_source(config)
        record["validation.prepared"] = {
            "fraction": 0.0 if own else v.fraction,
            "source": _prepared_identity(config, own) if own else None,
        }
    return record


def _prepared_identity(config: Config, source: DataSource) -> dict:
    documents = open_prepared(config, source)
    return {"source": source.source, "key": documents.fingerprint, "documents": documents.n_documents}


def build_loaders(
    config: Config, global_batch: int, rows: range, micro_batches: list[int]
) -> tuple[GlobalBatchLoader | None, GlobalBatchLoader | None]:
    """The training loader of rows (None under data.batching = "tokens", which trains on document_pieces) and, when
    validation is on, the validation loader: global batches of `global_batch` rows, of which this rank reads `rows`
    in micro-batches of `micro_batches` rows."""
    from titan.data.loader import Blend, GlobalBatchLoader, PackedSamples, check_enough_tokens
    from titan.data.stages import StagedBlend

    d, v, t = config.data, config.validation, config.training
    sources = d.source_list()
    stages = run_stages(config, global_batch)
    train_rows = d.batching == "rows"
    train, held = [], []
    for stream, source in enumerate(sources):
        documents = open_prepared(config, source)
        training, validation = split(config, documents)
        holds_out = len(validation.blocks) > 0
        if train_rows:
            samples = PackedSamples(documents, training, t.seq_len, config.job.seed, d.shuffle, stream)
            what = f"data source {source.source}" + (
                f" after holding out validation.fraction = {v.fraction}" if holds_out else ""
            )
            check_enough_tokens(samples, what)
            train.append(samples)
        if holds_out:
            weight = _validation_weight(stages, stream) if d.stages else source.weight
            held.append((weight, PackedSamples(documents, validation, t.seq_len, 0, False, stream)))
    loader = None
    if train_rows:
        blend = StagedBlend(stages, len(sources), global_batch)
        _log_mixture(stages, train, blend, global_batch)
        loader = GlobalBatchLoader(train, blend, global_batch, rows, micro_batches, d.document_mask)
    if not v.interval:
        return loader, None
    if v.source:
        held = [(1.0, whole_source(config, validation_source(config), f"validation.source {v.source}"))]
    elif not held:
        raise ConfigError(
            f"validation.fraction = {v.fraction} holds out no document; raise it, set validation.source, "
            "or set validation.interval = 0"
        )
    else:
        for _, samples in held:
            check_enough_tokens(samples, f"the validation split (validation.fraction = {v.fraction})")
    weights, held = zip(*held)
    available = sum(s.samples_per_epoch for s in held)
    if v.steps * global_batch > available:
        log.warning(
            "validation reads %d sequences per evaluation but its split holds %d: some repeat",
            v.steps * global_batch,
            available,
        )
    return loader, GlobalBatchLoader(
        list(held), Blend(list(weights)), global_batch, rows, micro_batches, d.document_mask
    )


def whole_source(config: Config, source: DataSource, what: str) -> PackedSamples:
    """Every document of a source of its own (validation's, or what `titan eval` scores) in the order it holds them,
    cut into windows of training.seq_len + 1 tokens; `what` names it in the error for too few tokens."""
    from titan.data.loader import PackedSamples, check_enough_tokens

    documents = open_prepared(config, source)
    every_block = np.arange(len(documents.block_offsets) - 1)
    samples = PackedSamples(documents, every_block, config.training.seq_len, 0, False)
    check_enough_tokens(samples, what)
    return samples


def document_pieces(config: Config) -> DocumentPieces:
    """The training documents (validation's held out) as pieces for data.batching = "tokens"."""
    from titan.data.document_batches import DocumentPieces

    d = config.data
    source = d.source_list()[0]
    documents = open_prepared(config, source)
    max_len = d.max_document_len or config.training.seq_len
    pieces = DocumentPieces(documents, split(config, documents)[0], max_len, config.job.seed, d.shuffle)
    if pieces.tokens_per_epoch == 0:
        raise ConfigError(f"data source {source.source} has no document of two or more tokens to train on")
    log.info(
        "data %s: %d documents, %d tokens to predict per epoch, in pieces of at most %d",
        source.source, pieces.order.documents_per_epoch, pieces.tokens_per_epoch, pieces.max_len,
    )  # fmt: skip
    return pieces


def _validation_weight(stages: list[Stage], stream: int) -> float:
    """Validation's weight for a source of a run in stages: the sum of its shares of the stages' mixtures."""
    return sum(
        source.weight / sum(s.weight for s in stage.sources)
        for stage in stages
        for source, its_stream in zip(stage.sources, stage.streams)
        if its_stream == stream
    )


def _log_mixture(stages: list[Stage], train: list[PackedSamples], blend: StagedBlend, global_batch: int) -> None:
    """Each stage's sources: their sequences per epoch, weights, realised shares and the epochs the stage reads."""
    for stage, stage_blend in zip(stages, blend.blends):
        samples = (stage.end_step - stage.first_step) * global_batch
        total_weight = sum(s.weight for s in stage.sources)
        what = "this run" if len(stages) == 1 else f"stage {stage.index} {stage.name!r}"
        for source, stream, count in zip(stage.sources, stage.streams, stage_blend.counts(samples)):
            log.info(
                "data %s: %d sequences per epoch; weight %.3f, realised %.3f of the %d sequences of %s (%.2f epochs)",
                source.source,
                train[stream].samples_per_epoch,
                source.weight / total_weight,
                count / max(samples, 1),
                samples,
                what,
                count / train[stream].samples_per_epoch,
            )
