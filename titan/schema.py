"""Typed-field checks of the files titan reads back from folders anyone can edit: a checkpoint's JSON files and saved
recipe, a run folder's (`titan compare`), an HF folder's config and index.

Each file has a spec, built from the few kinds below; `read_json` and `parse_toml` check a file against its spec
before anything uses it, so a wrong type, a missing key, NaN, a huge number or a path out of the folder is one
line naming the file and the field (`Invalid`, a ValueError), never a traceback deep in the code that reads it.
Values quoted in messages are shortened: a crafted file never makes titan build a huge string. Keys a spec does
not name are left alone (a later titan may add some). Torch-free, so that `titan compare` stays quick.
"""

from __future__ import annotations

import json
import math
import re
import reprlib
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

LARGEST_INT = 2**62  # above any count titan keeps (steps, samples, tokens), below what int64 arithmetic overflows
MAX_DEPTH = 32  # tables and arrays inside each other: a recipe has 4, a crafted file thousands (Python's recursion)

_short = reprlib.Repr()  # how messages quote values: a crafted file's million-entry list as a few of them
_short.maxstring, _short.maxother, _short.maxlong, _short.maxlist, _short.maxdict = 80, 40, 24, 4, 4


class Invalid(ValueError):
    """A value that does not match its spec: `where` is its field (dotted keys, [i] for list items; "" for the
    whole file), `problem` what is wrong with it."""

    def __init__(self, where: str, problem: str):
        super().__init__(f"{where} {problem}" if where else problem)
        self.where, self.problem = where, problem


def _fail(where: str, spec, value: Any):
    raise Invalid(where, f"must be {spec.describe()}, got {_short.repr(value)}")


def _key(where: str, key: str) -> str:
    if re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", key):
        return f"{where}.{key}" if where else key
    return f"{where}[{_short.repr(key)}]"


def _bound(x: float) -> str:
    """A bound as people read it: 2^62 rather than 4611686018427387904."""
    if isinstance(x, int) and x >= 2**16 and x & (x - 1) == 0:
        return f"2^{x.bit_length() - 1}"
    return f"{x:g}"


@dataclass(frozen=True)
class Number:
    """A JSON number (never a bool) from `low` to `high` (`low` itself excluded when `above`); finite unless
    `finite` is False (then NaN and infinities pass too, whatever the bounds); an int when `integer`."""

    low: float = -math.inf
    high: float = math.inf
    above: bool = False
    finite: bool = True
    integer: bool = False

    def describe(self) -> str:
        kind = "an integer" if self.integer else "a finite number" if self.finite else "a number"
        low, high = _bound(self.low), _bound(self.high)
        if self.low > -math.inf and self.high < math.inf:
            return f"{kind} in {'(' if self.above else '['}{low}, {high}]"
        if self.low > -math.inf:
            return f"{kind} {'>' if self.above else '>='} {low}"
        return f"{kind} <= {high}" if self.high < math.inf else kind

    def check(self, value, where: str):
        ok = isinstance(value, int if self.integer else (int, float)) and not isinstance(value, bool)
        if ok and isinstance(value, float) and not math.isfinite(value):
            ok = not self.finite
        elif ok:
            ok = (self.low < value if self.above else self.low <= value) and value <= self.high
        if not ok:
            _fail(where, self, value)
        return value


@dataclass(frozen=True)
class Integer(Number):
    low: float = 0
    high: float = LARGEST_INT
    integer: bool = True


@dataclass(frozen=True)
class Text:
    """A string; with `pattern`, one that fully matches it (`what` says what it is, for the message)."""

    pattern: str = ""
    what: str = "a string"

    def describe(self) -> str:
        return self.what

    def check(self, value, where: str):
        if not isinstance(value, str) or (self.pattern and not re.fullmatch(self.pattern, value)):
            _fail(where, self, value)
        return value


# A file's name in its folder: no separator, not '.' or '..', so that a path made of it stays in the folder.
FILE_NAME = Text(r"(?!\.\.?$)[^/\\\x00]+", "a file name in its folder (no '/', no '..')")


@dataclass(frozen=True)
class Flag:
    def describe(self) -> str:
        return "true or false"

    def check(self, value, where: str):
        if not isinstance(value, bool):
            _fail(where, self, value)
        return value


@dataclass(frozen=True)
class Anything:
    def describe(self) -> str:
        return "anything"

    def check(self, value, where: str):
        return value


@dataclass(frozen=True)
class Either:
    """One of `options`, or null when `null`."""

    options: tuple = ()
    null: bool = False

    def describe(self) -> str:
        return " or ".join([o.describe() for o in self.options] + ["null"] * self.null)

    def check(self, value, where: str):
        if value is None and self.null:
            return value
        for option in self.options:
            try:
                return option.check(value, where)
            except Invalid as e:
                if e.where != where:  # the value is of this option's kind, one of its fields is wrong: say which
                    raise
        _fail(where, self, value)


def optional(spec) -> Either:
    """`spec`, or null."""
    return Either((spec,), null=True)


@dataclass(frozen=True)
class ListOf:
    item: Any
    most: int = LARGEST_INT  # entries

    def describe(self) -> str:
        return "a list" + (f" of at most {self.most} entries" if self.most < LARGEST_INT else "")

    def check(self, value, where: str):
        if not isinstance(value, list) or len(value) > self.most:
            _fail(where, self, value)
        return [self.item.check(v, f"{where}[{i}]") for i, v in enumerate(value)]


@dataclass(frozen=True)
class MapOf:
    """An object of any keys, each value an `item`; not empty when `filled`."""

    item: Any
    filled: bool = False

    def describe(self) -> str:
        return "a non-empty object" if self.filled else "an object"

    def check(self, value, where: str):
        if not isinstance(value, dict) or (self.filled and not value):
            _fail(where, self, value)
        return {k: self.item.check(v, _key(where, k)) for k, v in value.items()}


@dataclass(frozen=True)
class Table:
    """An object with these `fields` ({key: spec}), of which the `required` ones must be there; other keys are kept
    unchecked, unless `closed`."""

    fields: dict
    required: frozenset = frozenset()
    closed: bool = False

    def describe(self) -> str:
        return "an object"

    def check(self, value, where: str):
        if not isinstance(value, dict):
            _fail(where, self, value)
        missing = [k for k in self.required if k not in value]
        if missing:
            raise Invalid(where, f"has no {', '.join(map(repr, missing))}")
        unknown = [k for k in value if k not in self.fields]
        if self.closed and unknown:
            raise Invalid(where, f"has {_short.repr(unknown[0])}, which is none of {', '.join(self.fields)}")
        return {k: self.fields[k].check(v, _key(where, k)) if k in self.fields else v for k, v in value.items()}


def check(value, spec, name: str):
    """`value` as `spec` takes it; Invalid prefixed with `name` (what holds the value, e.g. a file's name)."""
    try:
        return spec.check(value, "")
    except Invalid as e:
        raise Invalid(f"{name}: {e.where}" if e.where else name, e.problem) from None


def read_json(file: Path, spec) -> Any:
    """The JSON in `file`, checked against `spec`: ValueError naming the file (and the field) otherwise. NaN and
    Infinity, which Python's json reads, are refused wherever a spec asks for a finite number."""
    try:
        value = json.loads(Path(file).read_bytes())
    except RecursionError:
        raise Invalid(file.name, "is not JSON titan reads: nested deeper than Python's recursion limit") from None
    except ValueError as e:  # JSONDecodeError, an integer of too many digits, bytes that are not UTF-8
        raise Invalid(file.name, f"is not valid JSON: {e}") from None
    return check(value, spec, file.name)


def parse_toml(text: str) -> dict:
    """TOML text as a dict; ValueError (TOMLDecodeError or Invalid) when it is not TOML, or nests tables and
    arrays more than MAX_DEPTH deep (which would exhaust the recursion of the parser or of anything walking it)."""
    try:
        value = tomllib.loads(text)
    except RecursionError:
        raise Invalid("", f"nests tables or arrays more than {MAX_DEPTH} deep") from None
    stack = [(value, 1)]
    while stack:
        node, depth = stack.pop()
        if depth > MAX_DEPTH:
            raise Invalid("", f"nests tables or arrays more than {MAX_DEPTH} deep")
        children = node.values() if isinstance(node, dict) else node
        stack.extend((child, depth + 1) for child in children if isinstance(child, (dict, list)))
    return value
