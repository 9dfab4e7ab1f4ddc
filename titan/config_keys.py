"""Every recipe key with its type, default and description, read from titan/config/sections.py itself: a field's
description is its trailing comment, or else the comment lines just above it. `titan config keys`, the help of
every command that takes overrides and docs/config.md print them; a test keeps every key described, so the
listings cannot fall behind the schema."""

from __future__ import annotations

import dataclasses
import inspect
import io
import itertools
import re
import textwrap
import tokenize
import typing
from dataclasses import dataclass

from titan.config import load, sections


@dataclass
class Key:
    name: str  # section.key; a [[data.sources]] table's keys are data.sources[].key, a stage's data.stages[].key
    type: str
    default: str
    description: str

    @property
    def section(self) -> str:
        """The recipe table the key sits in, as TOML writes it: [training], [[data.sources]] or
        [[data.stages.sources]]."""
        table = self.name.rsplit(".", 1)[0]
        return f"[[{table[:-2].replace('[]', '')}]]" if table.endswith("[]") else f"[{table}]"


def recipe_keys() -> list[Key]:
    keys = []
    for section, cls in typing.get_type_hints(sections.Config).items():
        keys += _keys(section, cls)
        if cls is sections.Data:  # the tables of a mixture, and of stages
            keys += _keys("data.sources[]", sections.DataSource)
            keys += _keys("data.stages[]", sections.DataStage)
            keys += _keys("data.stages[].sources[]", sections.DataSource)
        if cls is sections.Validation:  # the named sets
            keys += _keys("validation.sets[]", sections.ValidationSet)
    return keys


def keys_text(keys: list[Key], width: int, flag: str = "") -> str:
    """The keys section by section: a key's name (after `flag`, e.g. "--"), type and default on one line, its
    meaning wrapped under it. [[data.sources]] keys go in recipe tables, not on the command line: no flag."""
    lines = []
    for section, group in itertools.groupby(keys, key=lambda k: k.section):
        lines += ["", section]
        for key in group:
            name = key.name if section.startswith("[[") else flag + key.name
            lines.append(f"  {name}  {key.type} = {key.default}")
            lines += textwrap.wrap(key.description, width, initial_indent=" " * 6, subsequent_indent=" " * 6)
    return "\n".join(lines[1:]) + "\n"


def keys_markdown(keys: list[Key]) -> str:
    """docs/config.md: a table of the keys per section."""
    out = [
        "# Recipe keys",
        "",
        "Every key a recipe can set, with its type, default and meaning, generated from `titan/config/sections.py` by",
        "`titan config keys --markdown > docs/config.md` (see [contributing](contributing.md)); do not edit it by",
        "hand. On the command line a key overrides the recipe as `--section.key value`. Recipes and overrides are",
        "explained in [recipes and config](recipes-and-config.md).",
    ]
    # A pipe would end the table cell (in code too); in text, <name> would read as an HTML tag, a lone * as emphasis.
    code = lambda s: "`" + s.replace("|", "\\|") + "`"
    plain = lambda s: s.replace("|", "\\|").replace("<", "&lt;").replace("*", "\\*")
    for section, group in itertools.groupby(keys, key=lambda k: k.section):
        out += ["", f"## {section}", "", "| key | type | default | meaning |", "|---|---|---|---|"]
        for k in group:
            out.append(f"| {code(k.name)} | {code(k.type)} | {code(k.default)} | {plain(k.description)} |")
    return "\n".join(out) + "\n"


def _keys(prefix: str, cls) -> list[Key]:
    hints, comments = typing.get_type_hints(cls), field_comments(cls)
    if cls in (sections.Data, sections.Validation, sections.ValidationSet):  # source keys mean what DataSource's do
        comments = {**field_comments(sections.DataSource), **{k: v for k, v in comments.items() if v}}
    default_of = sections.to_dict(cls()) if cls is not sections.DataSource else dataclasses.asdict(cls(source=""))
    return [
        Key(
            f"{prefix}.{f.name}",
            _type_name(hints[f.name]),
            load.toml_value(default_of[f.name]),
            comments.get(f.name, ""),
        )
        for f in dataclasses.fields(cls)
    ]


def _type_name(tp) -> str:
    """config's name for a type, with a list's or dict's item types spelled out."""
    if typing.get_origin(tp) in (list, dict):
        return re.sub(r"titan\.config\.\w+\.", "", str(tp).replace("typing.", ""))  # list[DataSource]
    return load._type_name(tp)


def field_comments(cls) -> dict[str, str]:
    """Each field's comment: on the field's own lines, or the block of comment lines just above it."""
    source = inspect.getsource(cls)
    comments: dict[int, str] = {}  # line -> comment text
    code_lines: set[int] = set()
    fields: dict[str, tuple[int, int]] = {}  # name -> (first line, last line) of its statement
    statement: list[tokenize.TokenInfo] = []
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.COMMENT:
            comments[token.start[0]] = token.string.lstrip("#").strip()
            continue
        if token.type in (tokenize.NL, tokenize.INDENT, tokenize.DEDENT, tokenize.ENCODING):
            continue
        if token.type != tokenize.NEWLINE:
            statement.append(token)
            code_lines.add(token.start[0])
            continue
        first = statement[0] if statement else None
        # A field: `name: type ...` one level into the class body.
        if first and first.type == tokenize.NAME and first.start[1] == 4 and len(statement) > 1:
            if statement[1].string == ":":
                fields[first.string] = (first.start[0], token.start[0])
        statement = []
    described = {}
    for name, (start, stop) in fields.items():
        own = [comments[line] for line in range(start, stop + 1) if line in comments]
        above, line = [], start - 1
        while line in comments and line not in code_lines:
            above.insert(0, comments[line])
            line -= 1
        described[name] = " ".join(own or above)
    return described
