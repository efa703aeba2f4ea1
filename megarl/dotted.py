"""Plug-ins named by dotted path, ``"pkg.mod:attr"`` (``attr`` may be dotted), and the registry of
named implementations (:class:`Registry`).  Reward functions
(``reward.fn``) and environments (``rollout.agent.env``) load through :func:`import_dotted`, so
every way a path can be wrong is reported the same way, naming the key."""

from __future__ import annotations

import importlib
from typing import Any


def import_dotted(spec: str, label: str, error: type[Exception], expected: str = "a callable") -> Any:
    """The callable at ``spec`` (already checked to be ``"mod:attr"``).  An unimportable module, a
    module that raises at import, a missing attribute or a non-callable raise ``error`` with a
    message starting with ``label`` (e.g. ``"reward function 'pkg:fn'"``)."""
    mod_name, attr_path = spec.split(":")
    try:
        obj: Any = importlib.import_module(mod_name)
    except ImportError as e:
        raise error(f"{label}: cannot import module {mod_name!r}: {e}") from e
    except Exception as e:  # the user module itself crashed at import
        raise error(f"{label}: importing {mod_name!r} raised {type(e).__name__}: {e}") from e
    for part in attr_path.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise error(f"{label}: {mod_name!r} has no attribute {attr_path!r}") from None
    if not callable(obj):
        raise error(f"{label} is a {type(obj).__name__}, not {expected}")
    return obj


class Registry:
    """Names to implementations: the one idiom of every choice a config key makes by name (the
    advantage estimators and policy losses, the built-in rewards, the environments, the
    trackers, the rollout backends).

    An entry is registered with the :meth:`register` decorator where it is defined, or listed
    with :meth:`add` as the object itself or as a ``"pkg.mod:attr"`` path imported on first
    :meth:`get` (a backend's heavy dependencies load only when it is chosen).  A name is taken
    once; ``meta`` keeps what the entry declares about itself (an estimator's needs, a tracker's
    package).  Lookups of an unknown name raise KeyError listing the known ones; a caller that
    owns a config key checks ``name in registry`` first and names the key.
    """

    def __init__(self, kind: str):
        self.kind = kind
        self._entries: dict[str, Any] = {}
        self._meta: dict[str, dict] = {}

    def add(self, name: str, target: Any, **meta: Any) -> None:
        if not isinstance(name, str) or not name:
            raise ValueError(f"{self.kind} name must be a non-empty string, got {name!r}")
        if name in self._entries and self._entries[name] is not target:
            raise ValueError(f"{self.kind} {name!r} is already registered to {_describe(self._entries[name])}")
        self._entries[name] = target
        self._meta[name] = dict(meta)

    def register(self, name: str, **meta: Any):
        """Decorator: ``@REGISTRY.register("name", key=value)`` registers the decorated object."""

        def deco(obj):
            self.add(name, obj, **meta)
            return obj

        return deco

    def names(self) -> list[str]:
        """The registered names, in registration order."""
        return list(self._entries)

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def _check(self, name: str) -> None:
        if name not in self._entries:
            raise KeyError(f"unknown {self.kind} {name!r}; registered: {sorted(self._entries)}")

    def get(self, name: str) -> Any:
        """The implementation registered as ``name`` (a path is imported now, once)."""
        self._check(name)
        target = self._entries[name]
        if isinstance(target, str):
            target = import_dotted(target, f"{self.kind} {name!r} ({target})", ImportError, expected="an implementation")
            self._entries[name] = target
        return target

    def meta(self, name: str) -> dict:
        """What the entry ``name`` declared when it was registered."""
        self._check(name)
        return self._meta[name]


def _describe(target: Any) -> str:
    if isinstance(target, str):
        return target
    return f"{getattr(target, '__module__', '?')}.{getattr(target, '__qualname__', type(target).__qualname__)}"
