"""Loading a recipe: TOML and `--section.key value` overrides, typed into the schema's dataclasses (with a
did-you-mean for an unknown key), then validated; and the way back, a Config as TOML."""

from __future__ import annotations

import dataclasses
import difflib
import os
import re
import tomllib
import types
import typing
from pathlib import Path
from typing import Any, Literal

import tomli_w

from titan.config.checks import validate
from titan.config.layout import LayoutError, other_degrees
from titan.config.sections import Config, Parallel, to_dict
from titan.config.torchtitan import TORCHTITAN_KEYS, TORCHTITAN_WITHOUT
from titan.dtypes import TORCH_NAMES, parse_dtype
from titan.errors import ConfigError, Mistakes
from titan.launcher import Launch
from titan.schema import parse_toml


def load_config(
    path: str | os.PathLike | None,
    overrides: list[str] = (),
    world_size: int | None = None,
    mistakes: Mistakes | None = None,
) -> Config:
    """Read a recipe, apply `--section.key value` overrides, type-check and validate everything. Every mistake
    found is reported at once; given `mistakes`, they are added there instead, for the caller's later checks to
    add theirs, and the Config returned holds the defaults where the recipe was wrong."""
    found = Mistakes() if mistakes is None else mistakes
    config = read_config(path, overrides, found)
    world_size = world_size if world_size is not None else Launch.from_env().world
    validate(config, world_size, found)
    given = {k: v for k, v in parse_overrides(overrides) if k in [f"parallel.{d}" for d in DEGREES]}
    if given:  # degrees set on the command line: the error names them first
        found.found = [
            LayoutError(_conflict(given, path, config.parallel, world_size)) if isinstance(e, LayoutError) else e
            for e in found.found
        ]
    if mistakes is None:
        found.raise_any()
    return config


DEGREES = ("dp_replicate", "dp_shard", "cp", "tp", "pp")


def _conflict(given: dict[str, str], path, p: Parallel, world_size: int) -> str:
    """Degrees that cannot make the world size, some of them set on the command line: the message names those
    first, and where each other degree came from (the recipe, or the default), so the fix is plain."""
    in_recipe = tomllib.loads(Path(path).read_text(encoding="utf-8")).get("parallel", {}) if path else {}
    others = [
        f"parallel.{d} = {getattr(p, d)} ({path if d in in_recipe else 'the default'})"
        for d in DEGREES
        if f"parallel.{d}" not in given and (getattr(p, d) != 1 or d == "dp_shard")
    ]
    product = p.dp_replicate * p.cp * p.tp * p.pp
    degrees = f"{other_degrees(p)} = {product}"
    flags = " and ".join(f"--{k} {v}" for k, v in given.items())
    if p.dp_shard == -1:
        problem = f"{degrees} does not divide the world size {world_size}, so dp_shard = -1 (what they leave) cannot"
        fix = f"launch a multiple of {product} processes (torchrun --nproc-per-node), or change {flags}"
    else:
        problem = (
            f"{degrees} x dp_shard={p.dp_shard} is {product * p.dp_shard} processes, not the world size {world_size}"
        )
        fix = f"launch {product * p.dp_shard} processes, or change {flags}"
        if "parallel.dp_shard" not in given and world_size % product == 0:
            fix = f"add --parallel.dp_shard {world_size // product} (or -1: what the other degrees leave), or {fix}"
    verb = "do" if len(given) > 1 else "does"
    return (
        f"{flags} on the command line {verb} not fit with {', '.join(others) or 'the other degrees'}: {problem}; {fix}"
    )


def read_config(path: str | os.PathLike | None, overrides: list[str] = (), mistakes: Mistakes | None = None) -> Config:
    """A recipe with its overrides, type-checked but not yet validated against a world size: every wrongly named
    or typed key at once, or, given `mistakes`, added there, the key then at its default."""
    raw: dict[str, Any] = {}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"recipe file not found: {path} (pass an existing TOML file to --config)")
        try:
            raw = parse_toml(path.read_text(encoding="utf-8"))
        except UnicodeDecodeError as e:
            raise ConfigError(f"{path} is not UTF-8 text (byte {e.start}); save the recipe as UTF-8") from None
        except ValueError as e:  # TOMLDecodeError, or nested too deep
            raise ConfigError(f"{path} is not valid TOML: {e}") from None
        except OSError as e:
            raise ConfigError(f"cannot read the recipe {path}: {e.strerror}") from None
    for key, value in parse_overrides(overrides):
        _set_dotted(raw, key, value)
    if path is not None and not raw.get("job", {}).get("recipe"):
        raw.setdefault("job", {})["recipe"] = str(path)
    found = Mistakes() if mistakes is None else mistakes
    config = _build(Config, raw, "", found)
    if mistakes is None:
        found.raise_any()
    return config


def saved_section(recipe: str, name: str):
    """Section `name` (e.g. "model") of a recipe saved as TOML text in a checkpoint, typed as load_config types it,
    its defaults where absent; ValueError naming the key otherwise. A section at a time: what reads a checkpoint's
    model or tokenizer does not depend on the other sections' keys, which another titan may have named otherwise."""
    return _convert(typing.get_type_hints(Config)[name], parse_toml(recipe).get(name, {}), name)


def parse_overrides(args: list[str]) -> list[tuple[str, str]]:
    """`--a.b 1 --c.d=x --flag` -> [("a.b", "1"), ("c.d", "x"), ("flag", "true")]."""
    pairs, i = [], 0
    while i < len(args):
        arg = args[i]
        if not arg.startswith("--") or len(arg) == 2:
            raise ConfigError(f"unexpected argument {arg!r}: overrides look like --section.key value")
        key = arg[2:]
        if "=" in key:
            key, value = key.split("=", 1)
        elif i + 1 < len(args) and not args[i + 1].startswith("--"):
            value, i = args[i + 1], i + 1
        else:
            value = "true"
        pairs.append((key.replace("-", "_"), value))
        i += 1
    return pairs


def _set_dotted(raw: dict, key: str, value: str) -> None:
    parts = key.split(".")
    node = raw
    for part in parts[:-1]:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"cannot override {key}: {part} is a value, not a section")
        node = child
    node[parts[-1]] = _CliValue(value)


class _CliValue(str):
    """A value typed on the command line: converted to the field's type, unlike TOML values."""


def _build(cls, raw: dict, prefix: str, mistakes: Mistakes | None = None):
    """Section `cls` from its table; a wrong key raises, or, given `mistakes`, is added there and left at its
    default, so that one pass finds every wrong key of the recipe."""
    if not isinstance(raw, dict):
        raise ConfigError(f"[{prefix.rstrip('.')}] must be a table of keys, got {raw!r}")
    found = Mistakes() if mistakes is None else mistakes
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    kwargs = {}
    for key, value in raw.items():
        if key not in hints:
            found.found += _unknown(prefix, key, value, cls)
        elif dataclasses.is_dataclass(hints[key]):
            with found.gather():
                kwargs[key] = _build(hints[key], value, prefix + key + ".", found)
        else:
            with found.gather():
                kwargs[key] = _convert(hints[key], value, prefix + key)
    if mistakes is None:
        found.raise_any()
    # Sections absent from the recipe (or wrong) take their defaults.
    for name in names:
        if name not in kwargs and dataclasses.is_dataclass(hints[name]):
            kwargs[name] = hints[name]()
    return cls(**kwargs)


# Keys users bring from other frameworks, and what titan calls them.
ELSEWHERE = {
    "job.config_file": "the recipe is --config, as in titan train --config recipe.toml",
    **{key: f"TorchTitan's name; titan's is {ours}" for key, ours in TORCHTITAN_KEYS.items()},
    **{key: f"TorchTitan's; {why}: remove it" for key, why in TORCHTITAN_WITHOUT.items()},
}


def _unknown(prefix: str, key: str, value, cls) -> list[ConfigError]:
    """The errors for an unknown key; another framework's section (TorchTitan's [parallelism]) gets one per key,
    each with titan's name for it."""
    if isinstance(value, dict) and any(f"{prefix}{key}.{k}" in ELSEWHERE for k in value):
        return [
            ConfigError(f"unknown key '{name}'{_suggest_elsewhere(name)}")
            for name in (f"{prefix}{key}.{k}" for k in value)
        ]
    what = "section" if not prefix else "key"
    return [ConfigError(f"unknown {what} '{prefix}{key}'{_suggest(prefix, key, cls)}")]


def _suggest_elsewhere(name: str) -> str:
    """What titan calls another framework's key, or the nearest of titan's keys."""
    if name in ELSEWHERE:
        return f" ({ELSEWHERE[name]})"
    match = difflib.get_close_matches(name, _all_keys(), n=1, cutoff=0.6)
    return f" (did you mean {match[0]}?)" if match else ""


def _suggest(prefix: str, key: str, cls) -> str:
    if prefix + key in ELSEWHERE:
        return f" ({ELSEWHERE[prefix + key]})"
    here = [prefix + f.name for f in dataclasses.fields(cls)]
    everywhere = here + _all_keys()
    match = [k for k in _all_keys() if prefix and k.endswith("." + key)]  # the right key in the wrong section?
    if not match:
        match = difflib.get_close_matches(prefix + key, everywhere, n=1, cutoff=0.6)
    if not match:
        match = [k for k in _all_keys() if k.endswith("." + key)]
    return f" (did you mean {' or '.join(match)}?)" if match else f"; valid keys here: {', '.join(here)}"


def _all_keys() -> list[str]:
    hints = typing.get_type_hints(Config)
    return [f"{section}.{f.name}" for section in hints for f in dataclasses.fields(hints[section])]


def _type_name(tp) -> str:
    if typing.get_origin(tp) is Literal:
        return " | ".join(repr(a) for a in typing.get_args(tp))
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        return " | ".join(map(_type_name, typing.get_args(tp)))
    return getattr(tp, "__name__", str(tp))


def _convert(tp, value, key: str):  # noqa: C901 (one branch per type a recipe key can have)
    if dataclasses.is_dataclass(tp):
        return _build(tp, value, key + ".")
    origin = typing.get_origin(tp)
    if isinstance(value, _CliValue) and tp is not str and origin is not Literal:
        value = _parse_cli_literal(value)
    elif isinstance(value, _CliValue):
        value = str(value)
    if origin is Literal:
        if set(typing.get_args(tp)) <= TORCH_NAMES.keys():  # a dtype: torch's name for it is taken too
            return parse_dtype(value, typing.get_args(tp), key)
        if value not in typing.get_args(tp):
            same = [a for a in typing.get_args(tp) if str(a).lower() == str(value).lower()]  # AdamW for adamw
            raise ConfigError(
                f"{key} must be one of {_type_name(tp)}, got {value!r}" + (f": write {same[0]!r}" if same else "")
            )
        return value
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{key} must be a table, got {value!r}")
        return {k: _parse_cli_literal(v) if isinstance(v, _CliValue) else v for k, v in value.items()}
    if origin is list:
        (item,) = typing.get_args(tp)
        if isinstance(value, str) and item is str:  # from the command line: a,b,c
            value = [v.strip() for v in value.split(",") if v.strip()]
        if not isinstance(value, list):
            raise ConfigError(f"{key} must be a list of {_type_name(item)}, got {value!r}")
        return [_convert(item, v, f"{key}[{i}]") for i, v in enumerate(value)]
    if origin in (typing.Union, types.UnionType):
        for option in typing.get_args(tp):
            try:
                return _convert(option, value, key)
            except ConfigError:
                pass
        raise ConfigError(f"{key} must be {_type_name(tp)}, got {value!r}")
    if tp is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if not isinstance(value, tp) or (tp is int and isinstance(value, bool)):
        raise ConfigError(f"{key} must be {_type_name(tp)}, got {value!r} ({type(value).__name__})")
    return value


def _parse_cli_literal(text: str):
    """Read a command-line value as a TOML literal (30, 1e-3, true, [1, 2]); anything else is a string."""
    try:
        return parse_toml(f"v = {text}")["v"]
    except ValueError:  # not TOML, or nested too deep
        return str(text)


def to_toml(config: Config) -> str:
    """The resolved recipe as TOML, loadable again by load_config to the same Config (tests/core/test_config.py)."""
    return tomli_w.dumps(to_dict(config))


def toml_value(value) -> str:
    """One value as TOML on a single line, for the `key = value` hints of messages and `titan config keys`
    (tomli-w spreads arrays over lines and writes tables as [sections], so only scalars go to it)."""
    if isinstance(value, dict):
        return "{ " + ", ".join(f"{_toml_key(k)} = {toml_value(v)}" for k, v in value.items()) + " }" if value else "{}"
    if isinstance(value, list):
        return "[" + ", ".join(map(toml_value, value)) + "]"
    return tomli_w.dumps({"v": value}).removeprefix("v = ").removesuffix("\n")


def _toml_key(key: str) -> str:
    return key if re.fullmatch(r"[A-Za-z0-9_-]+", key) else toml_value(key)
