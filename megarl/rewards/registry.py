"""The reward registry: :func:`build_reward_function` turns the ``reward`` config section into a
:class:`~megarl.rewards.base.RewardFunction` -- a built-in rule (:data:`BUILTIN_REWARDS`), a weighted
composite, or a user plug-in (``pkg.mod:callable``).  Imported by the package and by the isolated
scorer's worker process (:mod:`megarl.rewards.isolation`), which builds its own copy from the spec.
"""

from __future__ import annotations

import inspect
from typing import Any, Mapping, Sequence

from megarl.dotted import Registry
from megarl.rewards.base import RewardConfigError, RewardFunction
from megarl.rewards.code_exec import CodeExec
from megarl.rewards.composite import WeightedComposite
from megarl.rewards.http import HttpReward
from megarl.rewards.plugin import UserFunction, load_user_function
from megarl.rewards.rules import Arithmetic, ExactNumericMatch, MathVerify, RegexFormat, RunningSum, RunningSumSteps

__all__ = ["REWARDS", "BUILTIN_REWARDS", "build_reward_function"]

#: the built-in reward functions by name (``composite`` is built from its components, below)
REWARDS = Registry("built-in reward")
REWARDS.add("exact_numeric", ExactNumericMatch)
REWARDS.add("math_verify", MathVerify)
REWARDS.add("regex", RegexFormat)
REWARDS.add("arithmetic", Arithmetic)
REWARDS.add("running_sum", RunningSum)  # the long-tail reasoning task's final answer
REWARDS.add("running_sum_steps", RunningSumSteps)  # ... and each worked step: process rewards
REWARDS.add("http", HttpReward)  # a remote reward service (megarl/rewards/http.py); scores in batches
REWARDS.add("code_exec", CodeExec)  # sandboxed code execution (megarl/rewards/code_exec.py); can hang: own limits
BUILTIN_REWARDS: tuple[str, ...] = (*REWARDS.names(), "composite")
_COMPONENT_KEYS = ("name", "fn", "weight", "kwargs", "components")


def _as_dict(value: Any, key: str) -> dict:
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise RewardConfigError(f"{key} must be a mapping, got {type(value).__name__}")
    out = dict(value)
    bad = [k for k in out if not isinstance(k, str)]
    if bad:
        raise RewardConfigError(f"{key}: keys must be strings, got {bad!r}")
    return out


def _construct(cls: Any, kwargs: dict, key: str) -> Any:
    try:
        return cls(**kwargs)
    except RewardConfigError as e:
        raise RewardConfigError(f"{key}.kwargs: {e}") from e
    except TypeError as e:
        raise RewardConfigError(f"{key}.kwargs: {e}") from e


def _build_user(spec: str, kwargs: dict, key: str) -> RewardFunction:
    try:
        obj = load_user_function(spec)
    except RewardConfigError as e:
        raise RewardConfigError(f"{key}.fn: {e}") from e
    attr = spec.split(":")[1].split(".")[-1]
    if inspect.isclass(obj):
        # a class is a factory: its kwargs go to the constructor, the instance scores
        inst = _construct(obj, kwargs, key)
        if not callable(inst):
            raise RewardConfigError(f"{key}.fn: {spec!r} instances are not callable (need __call__(sample))")
        return UserFunction(inst, str(getattr(inst, "name", "") or attr), getattr(inst, "version", None) or None)
    if kwargs:
        # a function takes its kwargs on every call: fn(sample, **kwargs); check they bind now
        try:
            inspect.signature(obj).bind(None, **kwargs)
        except TypeError as e:
            raise RewardConfigError(f"{key}.kwargs: {spec!r} does not accept {sorted(kwargs)}: {e}") from e
        except ValueError:  # no signature (builtins): let the call decide
            pass
        fn, bound = obj, dict(kwargs)
        version = getattr(obj, "version", None) or f"user/{attr}({spec},kwargs={bound!r})"
        return UserFunction(lambda sample: fn(sample, **bound), str(getattr(obj, "name", "") or attr), version,
                            declared_by=obj)
    return UserFunction(obj, str(getattr(obj, "name", "") or attr), getattr(obj, "version", None) or f"user/{attr}({spec})")


def build_reward_function(
    fn: str,
    kwargs: Mapping[str, Any] | None = None,
    components: Sequence[Mapping[str, Any]] | None = None,
    *,
    key: str = "reward",
) -> RewardFunction:
    """Build the reward function named by config.

    Args:
        fn: a builtin name (:data:`BUILTIN_REWARDS`) or ``"pkg.mod:callable"``.  A user class is
            instantiated with ``kwargs``; a user function is called as ``fn(sample, **kwargs)``;
            either may return a RewardRecord, a float or ``{"total", "components"}``.
        kwargs: constructor keyword arguments of the builtin / user class.
        components: only for ``composite``: a list of ``{name, fn, weight=1.0, kwargs={},
            components=[]}`` built recursively (a component may itself be a composite).
        key: the config path used in error messages.
    Raises:
        RewardConfigError naming the offending key (``reward.fn``, ``reward.components[1].kwargs``).
    """
    kw = _as_dict(kwargs, f"{key}.kwargs")
    comps = list(components or [])
    if not isinstance(fn, str) or not fn:
        raise RewardConfigError(f"{key}.fn must be a reward name or 'pkg.mod:callable', got {fn!r}")
    if fn != "composite" and comps:
        raise RewardConfigError(f"{key}.components is only used when {key}.fn is 'composite' (got fn {fn!r})")
    if fn in REWARDS:
        return _construct(REWARDS.get(fn), kw, key)
    if fn == "composite":
        if kw:
            raise RewardConfigError(f"{key}.kwargs: composite takes no kwargs (got {sorted(kw)}); configure {key}.components")
        if not comps:
            raise RewardConfigError(f"{key}.components must list at least one {{name, fn, weight, kwargs}} for a composite")
        parts = []
        for i, comp in enumerate(comps):
            ck = f"{key}.components[{i}]"
            c = _as_dict(comp, ck)
            unknown = sorted(set(c) - set(_COMPONENT_KEYS))
            if unknown:
                raise RewardConfigError(f"{ck}: unknown key(s) {unknown}; allowed: {list(_COMPONENT_KEYS)}")
            for required in ("name", "fn"):
                if not c.get(required):
                    raise RewardConfigError(f"{ck}.{required} is required")
            sub = build_reward_function(c["fn"], c.get("kwargs"), c.get("components"), key=ck)
            parts.append((c["name"], c.get("weight", 1.0), sub))
        try:
            return WeightedComposite(parts)
        except RewardConfigError as e:
            raise RewardConfigError(f"{key}.components: {e}") from e
    if ":" in fn:
        return _build_user(fn, kw, key)
    raise RewardConfigError(f"{key}.fn: unknown reward {fn!r}; builtins: {list(BUILTIN_REWARDS)} or 'pkg.mod:callable'")
