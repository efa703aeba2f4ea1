"""The allowed range of every numeric config key, checked.

Each int / float key of :mod:`megarl.config.schema` declares its range beside its type
(``setting(..., range=...)``); :data:`RANGES` collects them by dotted key, in schema order.
:func:`megarl.config.validate` checks each one here (``_validate_ranges``) before the checks
that combine keys, so a value out of range is refused naming its key instead of surfacing later
as a division by zero or a silently odd run (``eval.every=-1`` evaluating every iteration).
``tests/e2e/test_cli.py`` enumerates every int / float field of the schema and fails when one
declares no range, so a new numeric key cannot be added without saying what it accepts.

Every value must also be finite (``nan`` / ``inf`` are refused everywhere; ``null`` is the way
to say "no limit" where a key allows it).
"""

from __future__ import annotations

import dataclasses
import typing

from megarl.config.schema import (  # noqa: F401  (Range and its shorthands, for this module's users)
    COUNT, COUNT0, ITERATIONS, POS, RATE, SEED, Range, TrainConfig,
)


def _declared(cls, prefix: str = "") -> typing.Iterator[tuple[str, dataclasses.Field]]:
    """``(dotted key, field)`` of every leaf field under the section dataclass ``cls``
    (``critic``, null by default, with :class:`~megarl.config.CriticConfig`'s keys)."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        # a section, or an Optional one (critic); a list of sections (reward.models) is checked per
        # entry where it is read (validation._validate_reward_models)
        optional = typing.get_origin(tp) is typing.Union
        sub = tp if dataclasses.is_dataclass(tp) else next(
            (a for a in typing.get_args(tp) if dataclasses.is_dataclass(a)), None) if optional else None
        if sub is not None:
            yield from _declared(sub, f"{prefix}{f.name}.")
        else:
            yield prefix + f.name, f


#: dotted key -> its :class:`Range`, as the schema declares them
RANGES = {key: f.metadata["range"] for key, f in _declared(TrainConfig) if "range" in f.metadata}


def lookup(cfg, dotted: str):
    """The value at ``dotted`` in a :class:`~megarl.config.TrainConfig`; ``(False, None)`` when
    a section on the way is absent (``critic`` is null for GRPO) or the key is unknown."""
    node = cfg
    for part in dotted.split("."):
        if node is None or not hasattr(node, part):
            return False, None
        node = getattr(node, part)
    return True, node


def declared_ranges(schema) -> dict:
    """dotted key -> :class:`Range` of another schema than the trainer's (``megarl.train_rm``'s)."""
    return {key: f.metadata["range"] for key, f in _declared(schema) if "range" in f.metadata}


def declared_choices(schema) -> dict:
    """dotted key -> the choices a key of ``schema`` declares."""
    return {key: f.metadata["choices"] for key, f in _declared(schema) if "choices" in f.metadata}


def range_errors(cfg, ranges=None):
    """``(key, message)`` for every value out of its range, in schema order (``ranges``: another
    schema's, :func:`declared_ranges`)."""
    for key, rule in (RANGES if ranges is None else ranges).items():
        found, v = lookup(cfg, key)
        if not found:
            continue
        items = list(enumerate(v)) if rule.each and v is not None else [(None, v)]
        for i, item in items:
            if not rule.ok(item):
                name = key if i is None else f"{key}[{i}]"
                yield name, f"must be {rule.describe()}, got {item!r}"
