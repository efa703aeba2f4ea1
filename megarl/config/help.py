"""The config's keys in the schema's own words, for ``python -m megarl.train --help``.

The descriptions are read from the source of :mod:`megarl.config` itself: a field's ``#:``
comment lines above it, or its trailing ``# ...`` comment, and each section's class docstring
(parsed with :mod:`ast` and :mod:`tokenize`, never copied), so the help cannot drift from the
schema.  Imports neither torch nor omegaconf: ``--help`` answers at once.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import io
import json
import re
import textwrap
import tokenize
import typing
from dataclasses import dataclass
from typing import Any, Dict, Iterator, List, Tuple

from megarl.config import schema as schema_module


@dataclass(frozen=True)
class KeyDoc:
    """One leaf key: its dotted name, type, default and one-line description."""

    key: str
    type: Any  # the annotation, resolved
    default: Any
    doc: str


def _one_line(text: str, width: int = 110) -> str:
    """The first sentence of a comment block, on one line."""
    text = " ".join(text.split())
    m = re.search(r"(?<=[a-z0-9)\]`'\"])\.\s", text)
    if m:
        text = text[:m.start() + 1]
    return textwrap.shorten(text, width=width, placeholder=" ...")


@functools.lru_cache(maxsize=1)
def _field_comments() -> Dict[Tuple[str, str], str]:
    """``(class name, field name) -> comment`` for every dataclass field in megarl/config/schema.py."""
    with open(schema_module.__file__, encoding="utf-8") as f:
        source = f.read()
    comments: Dict[int, Tuple[str, bool]] = {}  # line -> (text, is the line a comment alone)
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            alone = not tok.line[:tok.start[1]].strip()
            comments[tok.start[0]] = (tok.string, alone)
    out: Dict[Tuple[str, str], str] = {}
    for node in ast.parse(source).body:
        if not isinstance(node, ast.ClassDef):
            continue
        for stmt in node.body:
            if not (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)):
                continue
            above, line = [], stmt.lineno - 1
            while line in comments and comments[line][1] and comments[line][0].startswith("#:"):
                above.insert(0, comments[line][0][2:].strip())
                line -= 1
            trailing = comments.get(stmt.end_lineno)
            if above:
                text = " ".join(above)
            else:
                text = trailing[0].lstrip("#").strip() if trailing and not trailing[1] else ""
            out[(node.name, stmt.target.id)] = text
    return out


def _dataclass_of(tp) -> Any:
    """The dataclass in ``tp`` (``Optional[CriticConfig]`` -> ``CriticConfig``), or None (a list of
    sections, ``reward.models``, is one key: its entries' keys are its comment's)."""
    if dataclasses.is_dataclass(tp):
        return tp
    if typing.get_origin(tp) is not typing.Union:
        return None
    for arg in typing.get_args(tp):
        if dataclasses.is_dataclass(arg):
            return arg
    return None


def _default(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return None


def section_doc(cls) -> str:
    """The first sentence of a section's docstring ("" for dataclass's generated signature)."""
    doc = cls.__doc__ or ""
    return "" if not doc or doc.startswith(cls.__name__ + "(") else _one_line(doc.strip())


def iter_keys(cls=schema_module.TrainConfig, prefix: str = "", default: Any = None) -> Iterator[KeyDoc]:
    """Every leaf key under ``cls`` (nested sections expanded; ``critic``, null by default, with
    :class:`~megarl.config.CriticConfig`'s keys)."""
    hints = typing.get_type_hints(cls)
    comments = _field_comments()
    instance = default if default is not None else cls()
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        sub = _dataclass_of(tp)
        key = prefix + f.name
        if sub is not None:
            value = getattr(instance, f.name, None)
            yield from iter_keys(sub, key + ".", value if value is not None else sub())
            continue
        yield KeyDoc(key, tp, getattr(instance, f.name, _default(f)), comments.get((cls.__name__, f.name), ""))


@functools.lru_cache(maxsize=1)
def schema_keys() -> List[str]:
    """Every dotted leaf key of the schema (for "did you mean" suggestions)."""
    return [k.key for k in iter_keys()]


def type_name(tp) -> str:
    """``int``, ``float|null``, ``list[int]``, ``dict``."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is typing.Union:
        names = [type_name(a) for a in args if a is not type(None)]
        return "|".join(names) + ("|null" if type(None) in args else "")
    if origin in (list, List):
        return f"list[{type_name(args[0])}]" if args else "list"
    if origin in (dict, Dict):
        return "dict"
    return getattr(tp, "__name__", str(tp))


def _show(v: Any) -> str:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, str):
        return v if v else "''"
    if isinstance(v, (dict, list)):
        return json.dumps(v, separators=(",", ":"))  # null / true, as YAML writes them
    return str(v)


def _line(k: KeyDoc, width: int) -> str:
    from megarl.config.ranges import RANGES

    rule = RANGES.get(k.key)
    doc = _one_line(k.doc) + (f" [{'each ' if rule.each else ''}{rule.describe()}]" if rule else "")
    return f"  {k.key:<{width}}{type_name(k.type):<11} {_show(k.default):<10} {doc.strip()}".rstrip()


def sections_help() -> str:
    """The help's key listing: one block per section of :class:`~megarl.config.TrainConfig`,
    one line per key: name, type, default, description and [allowed range]."""
    keys = list(iter_keys())
    width = max(len(k.key) for k in keys) + 2
    lines = ["config keys (set in the YAML recipe or as key=value overrides; type, default, meaning):"]
    hints = typing.get_type_hints(schema_module.TrainConfig)
    for f in dataclasses.fields(schema_module.TrainConfig):
        sub = _dataclass_of(hints[f.name])
        if sub is None:
            k = next(k for k in keys if k.key == f.name)
            lines += ["", _line(k, width)]
            continue
        head = section_doc(sub)
        optional = type(None) in typing.get_args(hints[f.name])
        lines += ["", f"{f.name}:" + (" (null unless set)" if optional else "") + (f"  {head}" if head else "")]
        for k in keys:
            if k.key.startswith(f.name + "."):
                lines.append(_line(k, width))
    return "\n".join(lines)
