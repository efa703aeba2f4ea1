"""Reward functions: rule rewards, weighted composites, user plug-ins, and the runner.

:func:`~megarl.rewards.registry.build_reward_function` turns the ``reward`` config section into a
:class:`~megarl.rewards.base.RewardFunction`; :class:`~megarl.rewards.runner.RewardRunner` calls
it with timeouts and retries; :func:`~megarl.rewards.runner.apply_penalties` is the only place a
failed reward may become a number.
"""

from __future__ import annotations

from megarl.rewards.base import RewardConfigError, RewardFunction, RewardSample
from megarl.rewards.code_exec import CodeExec
from megarl.rewards.composite import WeightedComposite
from megarl.rewards.http import HttpReward
from megarl.rewards.plugin import UserFunction, load_user_function
from megarl.rewards.registry import BUILTIN_REWARDS, build_reward_function
from megarl.rewards.rules import Arithmetic, ExactNumericMatch, MathVerify, RegexFormat
from megarl.rewards.runner import PENALTY_KEYS, RewardRunner, apply_penalties

__all__ = [
    "BUILTIN_REWARDS",
    "build_reward_function",
    "RewardSample",
    "RewardFunction",
    "RewardConfigError",
    "ExactNumericMatch",
    "MathVerify",
    "RegexFormat",
    "Arithmetic",
    "HttpReward",
    "CodeExec",
    "WeightedComposite",
    "UserFunction",
    "load_user_function",
    "RewardRunner",
    "apply_penalties",
    "PENALTY_KEYS",
]
