"""The model a recipe names, resolved and checked: its family's spec and its args, which travel together."""

from __future__ import annotations

import dataclasses
import logging

from titan import models
from titan.config import Config
from titan.errors import ConfigError
from titan.models import Args, ModelSpec

log = logging.getLogger("titan")


@dataclasses.dataclass(frozen=True)
class ResolvedModel:
    """The model of a recipe: the registry's spec of its family and its args (flavor and overrides applied)."""

    spec: ModelSpec
    args: Args


def resolve_model(config: Config) -> ResolvedModel:
    """The registry spec and the model args the recipe names, checked."""
    return ResolvedModel(models.get_model_spec(config.model.name), resolve_args(config))


def warn_of_an_impossible_export(config: Config, args: Args) -> None:
    """A run whose model its family's Hugging Face format cannot hold (a MoE with moving routing biases, shared
    experts...) trains all the same: said at start-up, not first at export."""
    if blockers := models.hf_export_blockers(config.model.name, args):
        log.warning(
            "this run's model will not export to Hugging Face (titan convert dcp-to-hf): %s", "; ".join(blockers)
        )


def resolve_args(config: Config) -> Args:
    """The model args (flavor + overrides) the recipe names, checked without importing torch: a model that cannot
    be built is a recipe error, found before any work."""
    try:
        args = models.model_args(config.model.name, config.model.flavor, config.model.overrides)
    except (KeyError, ValueError) as e:
        raise ConfigError(str(e.args[0])) from None  # a KeyError's str() would quote its message
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
    return dataclasses.replace(args, max_seq_len=longest)
