"""Name -> function registries for advantage estimators and policy losses.

Config selects an estimator or a policy loss by name (``algo.advantage: grpo``); the registry
is the one place that maps the name to the pure function.  Registering the same name twice is
an error, so two modules can never silently shadow each other.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, TypeVar

F = TypeVar("F", bound=Callable)


@dataclass(frozen=True)
class EstimatorNeeds:
    """What an advantage estimator reads, declared where it is registered, so that start-up
    validation and the trainer both ask the registry instead of matching names.

    groups: the samples of one prompt form a group whose members are baselines for each other
        (GRPO, Dr. GRPO, RLOO): G >= 2, whole groups per mini-batch, partial-group rules apply.
    critic: per-token values V(s_t) from a trained critic (GAE).
    token_rewards: per-token rewards (the outcome placed on the last action token, optionally
        KL-shaped), rather than one score per sample.
    step_rewards: process rewards, one per reasoning step, with the token where each step ends.
    """

    groups: bool = False
    critic: bool = False
    token_rewards: bool = False
    step_rewards: bool = False


_ADVANTAGES: dict[str, Callable] = {}
_ADVANTAGE_NEEDS: dict[str, EstimatorNeeds] = {}
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


def register_advantage(name: str, needs: EstimatorNeeds = EstimatorNeeds()) -> Callable[[F], F]:
    """Register an advantage estimator under ``name`` with what it reads
    (e.g. ``@register_advantage("grpo", EstimatorNeeds(groups=True))``)."""
    deco = _register(_ADVANTAGES, "advantage estimator", name)

    def with_needs(fn: F) -> F:
        deco(fn)
        _ADVANTAGE_NEEDS[name] = needs
        return fn

    return with_needs


def register_policy_loss(name: str) -> Callable[[F], F]:
    """Register a token-level policy loss under ``name`` (e.g. ``@register_policy_loss("vanilla")``)."""
    return _register(_POLICY_LOSSES, "policy loss", name)


def get_advantage(name: str) -> Callable:
    """The advantage estimator registered as ``name``; KeyError listing the known names otherwise."""
    return _lookup(_ADVANTAGES, "advantage estimator", name)


def advantage_needs(name: str) -> EstimatorNeeds:
    """What the estimator registered as ``name`` reads; KeyError listing the known names otherwise."""
    _lookup(_ADVANTAGES, "advantage estimator", name)
    return _ADVANTAGE_NEEDS[name]


def get_policy_loss(name: str) -> Callable:
    """The policy loss registered as ``name``; KeyError listing the known names otherwise."""
    return _lookup(_POLICY_LOSSES, "policy loss", name)


def advantage_names() -> list[str]:
    return sorted(_ADVANTAGES)


def policy_loss_names() -> list[str]:
    return sorted(_POLICY_LOSSES)
