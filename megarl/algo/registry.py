"""Name -> function registries for advantage estimators and policy losses.

Config selects an estimator or a policy loss by name (``algo.advantage: grpo``); the registry
is the one place that maps the name to the pure function.  Registering the same name twice is
an error, so two modules can never silently shadow each other.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, TypeVar

from megarl.dotted import Registry

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
    teacher: the teacher's log-probs of the sampled tokens (on-policy distillation, ``teacher.path``).
    """

    groups: bool = False
    critic: bool = False
    token_rewards: bool = False
    step_rewards: bool = False
    teacher: bool = False


#: advantage estimators, each with its :class:`EstimatorNeeds` (``meta["needs"]``)
ADVANTAGES = Registry("advantage estimator")
#: token-level policy losses
POLICY_LOSSES = Registry("policy loss")


def register_advantage(name: str, needs: EstimatorNeeds = EstimatorNeeds()) -> Callable[[F], F]:
    """Register an advantage estimator under ``name`` with what it reads
    (e.g. ``@register_advantage("grpo", EstimatorNeeds(groups=True))``)."""
    return ADVANTAGES.register(name, needs=needs)


def register_policy_loss(name: str) -> Callable[[F], F]:
    """Register a token-level policy loss under ``name`` (e.g. ``@register_policy_loss("vanilla")``)."""
    return POLICY_LOSSES.register(name)


def get_advantage(name: str) -> Callable:
    """The advantage estimator registered as ``name``; KeyError listing the known names otherwise."""
    return ADVANTAGES.get(name)


def advantage_needs(name: str) -> EstimatorNeeds:
    """What the estimator registered as ``name`` reads; KeyError listing the known names otherwise."""
    return ADVANTAGES.meta(name)["needs"]


def get_policy_loss(name: str) -> Callable:
    """The policy loss registered as ``name``; KeyError listing the known names otherwise."""
    return POLICY_LOSSES.get(name)


def advantage_names() -> list[str]:
    return sorted(ADVANTAGES.names())


def policy_loss_names() -> list[str]:
    return sorted(POLICY_LOSSES.names())
