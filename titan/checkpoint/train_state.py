"""What a checkpoint holds besides tensors: train_state.json (the step, the lr schedule's position, the model's
parameter shapes, the recipe) written by a save and read back checked, and the schema of data.json."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from titan.config import LAYOUT_SPEC
from titan.errors import ConfigError
from titan.files import write_synced
from titan.schema import Anything, Flag, Integer, ListOf, MapOf, Number, Table, Text, optional, read_json


def model_shapes(spec, args) -> dict[str, list[int]]:
    """Every parameter's shape, by name, for the whole model (a tied head once): what train_state.json
    records, so every layout, and the HF import, describe a model alike."""
    with torch.device("meta"):
        model = spec.build(args)
    return {name: list(p.shape) for name, p in model.named_parameters()}


def model_buffers(model: nn.Module) -> dict[str, torch.Tensor]:
    """The state a model holds besides its parameters, by name: the buffers its state_dict saves (a MoE's routing
    biases; not Llama's RoPE table, which is computed from the args). Checkpoints hold them with the parameters."""
    params = {name for name, _ in model.named_parameters(remove_duplicate=False)}
    return {name: t for name, t in model.state_dict(keep_vars=True).items() if name not in params}


def buffer_shapes(spec, args) -> dict[str, list[int]]:
    """model_buffers' shapes, by name, for the whole model."""
    with torch.device("meta"):
        model = spec.build(args)
    return {name: list(t.shape) for name, t in model_buffers(model).items()}


def write_train_state(
    folder: Path, *, step: int, tokens_seen: int, lr_scheduler: dict, model: dict, recipe: str, **extra
) -> None:
    """train_state.json. model: {"name", "flavor", "shapes"}; recipe: the resolved recipe as TOML."""
    state = {
        "step": step,
        "tokens_seen": tokens_seen,
        "lr_scheduler": lr_scheduler,
        "model": model,
        "recipe": recipe,
        **extra,
    }
    write_synced(folder / "train_state.json", json.dumps(state, indent=1).encode())


# train_state.json and data.json as titan reads them back (titan/schema.py): anything else is a corrupt checkpoint.
_SCHEDULER = {
    "last_epoch": Integer(-1),
    "_step_count": Integer(),
    "_is_initial": Flag(),
    "_get_lr_called_within_step": Flag(),
    "base_lrs": ListOf(Number()),
    "_last_lr": ListOf(Number()),
}
_PLAN = {
    "dp_weights": ListOf(Number(0, above=True)),
    "pp_layers_per_stage": ListOf(Integer(1)),
    "measured_on": Table({"layout": LAYOUT_SPEC, "devices": ListOf(Text())}, required=frozenset({"layout", "devices"})),
    "recipe": MapOf(Anything()),
}
TRAIN_STATE = Table(
    {
        "step": Integer(),
        "tokens_seen": Integer(),
        "loss": optional(Number(finite=False)),  # None when the step's loss was not finite
        "lr_scheduler": Table(_SCHEDULER),
        "model": Table(
            {"name": Text(), "flavor": Text(), "shapes": MapOf(ListOf(Integer(), most=8))},
            required=frozenset({"name", "flavor", "shapes"}),
        ),
        "recipe": Text(),  # the resolved recipe as TOML; its sections are checked where read (config.saved_section)
        "math": MapOf(Anything()),
        "plan": Table(_PLAN),
    },
    required=frozenset({"step", "lr_scheduler", "model", "recipe"}),
)
DATA_STATE = Table(
    {key: Integer() for key in ("next_sample", "next_token", "next_piece")}
    | {key: Integer(1) for key in ("global_batch", "budget", "order")},
)


def read_train_state(path: Path) -> dict:
    """train_state.json, checked against TRAIN_STATE: ConfigError naming the field otherwise."""
    try:
        return read_json(path / "train_state.json", TRAIN_STATE)
    except OSError as e:
        raise ConfigError(f"checkpoint {path} is corrupt: cannot read train_state.json ({e.strerror})") from None
    except ValueError as e:
        raise ConfigError(f"checkpoint {path} is corrupt: {e}") from None
