"""Name -> function registries for advantage estimators and policy losses.

Config selects an estimator or a policy loss by name (``algo.advantage: grpo``); the registry
is the one place that maps the name to the pure function.  Registering the same name twice is
an error, so two modules can never silently shadow each other.
"""

from __future__ import annotations

from typing import Callable, TypeVar

F = TypeVar("F", bound=Callable)

_ADVANTAGES: dict[str, Callable] = {}
_POLICY_LOSSES: dict[str, Callable] = {}


def _register(table: dict[str, Callable], kind: str, name: str) -> Callable[[F], F]:
    if not isinstance(name, str) or not name:
        raise ValueError(f"{kind} name must be a non-empty string, got {name!r}")

    def deco(fn: F) -> F:
        if name in table and table[name] is not fn:
            raise ValueError(f"{kind} {name!r} is already registered to {table[name].__module__}.{table[name].__name__}")
        table[name] = fn
        return fn

    return deco


def _lookup(table: dict[str, Callable], kind: str, name: str) -> Callable:
    try:
        return table[name]
    except KeyError:
        raise KeyError(f"unknown {kind} {name!r}; registered: {sorted(table)}") from None


def register_advantage(name: str) -> Callable[[F], F]:
    """Register an advantage estimator under ``name`` (e.g. ``@register_advantage("grpo")``)."""
    return _register(_ADVANTAGES, "advantage estimator", name)


def register_policy_loss(name: str) -> Callable[[F], F]:
    """Register a token-level policy loss under ``name`` (e.g. ``@register_policy_loss("vanilla")``)."""
    return _register(_POLICY_LOSSES, "policy loss", name)


def get_advantage(name: str) -> Callable:
    """The advantage estimator registered as ``name``; KeyError listing the known names otherwise."""
    return _lookup(_ADVANTAGES, "advantage estimator", name)


def get_policy_loss(name: str) -> Callable:
    """The policy loss registered as ``name``; KeyError listing the known names otherwise."""
    return _lookup(_POLICY_LOSSES, "policy loss", name)


def advantage_names() -> list[str]:
    return sorted(_ADVANTAGES)


def policy_loss_names() -> list[str]:
    return sorted(_POLICY_LOSSES)
