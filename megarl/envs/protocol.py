"""The environment contract of multi-turn (agent) rollouts, and loading one by name or path.

An :class:`Environment` is one episode's state.  ``reset(row)`` starts it on a dataset row and
returns the messages to show after the prompt (often none); ``step(action)`` takes the decoded
text of one policy turn and returns a :class:`StepOutcome`: the messages shown to the policy
next (``role="tool"`` for tool output), this step's reward components, and whether the
environment ended the episode (``terminated``: a real end, the return is complete) or cut it
short (``truncated``: the value of the next state is bootstrapped).  ``info`` carries counts the
metrics read (``{"tool_calls": 2}``) and never enters a reward.

Environments run on worker threads of :class:`megarl.envs.runner.EnvironmentPool`, one call at
a time per instance.  What an environment returns is checked there
(:func:`check_messages`, :func:`check_outcome`): wrong types or a non-finite reward part make the
step ``invalid``; an exception makes it ``error``, an overrun ``timeout`` -- a status with its
reason, never a reward (the same rule as :mod:`megarl.rewards.runner`).

:func:`load_environment` turns ``rollout.agent.env`` (a built-in name or ``"pkg.mod:Class"``)
and ``rollout.agent.env_args`` into a factory; errors name those keys.  An example user
environment: docs/multi-turn.md, "Writing an environment".

How the session maps an outcome: ``terminated`` -> finish reason ``environment``, ``truncated``
-> ``env_truncated``; a failed call (``error`` / ``timeout`` / ``invalid``) ends the trajectory
with that status and no reward.  An observation given with ``terminated`` / ``truncated`` is
kept in the outcome but never shown to the policy.
"""

from __future__ import annotations

import functools
import inspect
import math
import numbers
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Callable, Mapping, Protocol, runtime_checkable

from megarl.dotted import Registry, import_dotted
from megarl.errors import MegarlError

__all__ = ["Message", "StepOutcome", "Environment", "EnvStatus", "EnvStepResult", "EnvConfigError",
           "ENVIRONMENTS", "load_environment", "check_messages", "check_outcome"]


class EnvConfigError(MegarlError, ValueError):
    """``rollout.agent.env`` / ``env_args`` that cannot make an environment; the message names the key."""


@dataclass(frozen=True)
class Message:
    """One chat message: ``role`` ("user", "assistant", "system", "tool" for tool output) and text."""

    role: str
    content: str

    def __post_init__(self):
        if not isinstance(self.role, str) or not self.role:
            raise TypeError(f"Message.role must be a non-empty str, got {self.role!r}")
        if not isinstance(self.content, str):
            raise TypeError(f"Message.content must be a str, got {type(self.content).__name__}")

    def as_dict(self) -> dict:
        """``{"role", "content"}``: what chat templates take."""
        return {"role": self.role, "content": self.content}


@dataclass(frozen=True)
class StepOutcome:
    """What one ``Environment.step`` returns.

    ``observation``: the messages shown to the policy next (empty when the episode ended);
    ``reward_components``: this step's reward parts by name (finite floats; may be empty);
    ``terminated``: the environment ended the episode (finish reason ``environment``);
    ``truncated``: it cut the episode short (``env_truncated``: bootstrap, not terminal);
    ``info``: counts for metrics (``tool_calls``, ``tool_errors``), never a reward.
    """

    observation: tuple[Message, ...]
    reward_components: Mapping[str, float]
    terminated: bool
    truncated: bool
    info: Mapping[str, float] = field(default_factory=dict)

    @property
    def done(self) -> bool:
        return self.terminated or self.truncated


@runtime_checkable
class Environment(Protocol):
    """One episode.  ``reset(row)`` -> the extra messages after the prompt (often ``()``);
    ``step(action)`` with the decoded text of one policy turn -> :class:`StepOutcome`.
    May raise (the pool records status ``error``).  An optional ``close()`` is called when the
    pool drops the instance."""

    def reset(self, row: Mapping[str, Any]) -> tuple[Message, ...]: ...

    def step(self, action: str) -> StepOutcome: ...


class EnvStatus(str, Enum):
    OK = "ok"
    ERROR = "error"  # the environment (or its constructor) raised
    TIMEOUT = "timeout"  # no answer within rollout.agent.step_timeout_s: the instance is abandoned
    INVALID = "invalid"  # it answered with the wrong types or a non-finite reward part


@dataclass(frozen=True)
class EnvStepResult:
    """One reset / step as run by the pool: ``outcome`` is set iff ``status`` is ok (for a reset
    its ``observation`` holds reset's messages); ``error`` says why otherwise; ``latency_s`` is
    the call's wall time on its worker (up to the timeout for a timeout)."""

    status: EnvStatus
    outcome: StepOutcome | None
    error: str | None
    latency_s: float

    def __post_init__(self):
        if (self.status is EnvStatus.OK) != (self.outcome is not None):
            raise ValueError(f"EnvStepResult: outcome must be set iff status is ok (status {self.status.value})")


# ---- checking what an environment returned --------------------------------------------------


def check_messages(value: Any, what: str) -> tuple[Message, ...]:
    """``value`` as a tuple of :class:`Message` (plain ``{"role", "content"}`` mappings are
    accepted); a ``ValueError`` naming ``what`` and the position otherwise."""
    if isinstance(value, (str, bytes, Mapping)) or not isinstance(value, (tuple, list)):
        raise ValueError(f"{what} must be a tuple of Message, got {type(value).__name__} {value!r:.80}")
    out = []
    for i, m in enumerate(value):
        if isinstance(m, Message):
            out.append(m)
        elif isinstance(m, Mapping) and set(m) == {"role", "content"} \
                and isinstance(m["role"], str) and m["role"] and isinstance(m["content"], str):
            out.append(Message(m["role"], m["content"]))
        else:
            raise ValueError(f"{what}[{i}] must be a Message (role and content str), got {m!r:.80}")
    return tuple(out)


def _is_bool(x: Any) -> bool:
    return isinstance(x, bool) or type(x).__name__ == "bool_"  # numpy.bool_ without importing numpy


def check_outcome(value: Any) -> StepOutcome:
    """A step's return value as a checked :class:`StepOutcome` (a 4-tuple ``(observation,
    reward_components, terminated, truncated)`` is accepted too); ``ValueError`` saying what is
    wrong otherwise: that step is ``invalid``."""
    if isinstance(value, tuple) and not isinstance(value, StepOutcome) and len(value) == 4:
        value = StepOutcome(*value)
    if not isinstance(value, StepOutcome):
        raise ValueError(f"step returned {type(value).__name__} {value!r:.80}; expected a StepOutcome "
                         "(or a tuple (observation, reward_components, terminated, truncated))")
    obs = check_messages(value.observation, "observation")
    comps = value.reward_components
    if not isinstance(comps, Mapping):
        raise ValueError(f"reward_components must be a mapping, got {type(comps).__name__}")
    clean = {}
    for k, v in comps.items():
        if not isinstance(k, str) or not isinstance(v, numbers.Real) or not math.isfinite(float(v)):
            raise ValueError(f"reward_components[{k!r}] = {v!r}; expected str keys and finite numbers")
        clean[k] = float(v)
    for name in ("terminated", "truncated"):
        if not _is_bool(getattr(value, name)):
            raise ValueError(f"{name} must be a bool, got {getattr(value, name)!r}")
    info = value.info
    if not isinstance(info, Mapping) or not all(
            isinstance(k, str) and isinstance(v, numbers.Real) and math.isfinite(float(v)) for k, v in info.items()):
        raise ValueError(f"info must map str to finite numbers, got {info!r:.80}")
    return StepOutcome(obs, clean, bool(value.terminated), bool(value.truncated),
                       {k: float(v) for k, v in info.items()})


# ---- loading ----------------------------------------------------------------------------------

#: built-in environments by name: their classes, imported on use
ENVIRONMENTS = Registry("built-in environment")
ENVIRONMENTS.add("calculator", "megarl.envs.calculator:CalculatorEnv")
ENVIRONMENTS.add("two_turn", "megarl.envs.two_turn:TwoTurnEnv")


def _import(spec: str) -> Any:
    key = "rollout.agent.env"
    if spec.count(":") != 1 or not all(spec.split(":")):
        raise EnvConfigError(f"{key}: {spec!r} is neither a built-in environment ({', '.join(ENVIRONMENTS.names())}) "
                             "nor a path like 'pkg.mod:Class'")
    return import_dotted(spec, f"{key}: {spec!r}", EnvConfigError, expected="a class or factory")


def load_environment(spec: str, **kwargs) -> Callable[[], Environment]:
    """A factory making one fresh environment per call: ``spec`` is a built-in name
    (:data:`ENVIRONMENTS`) or ``"pkg.mod:Class"`` (any callable returning an environment),
    ``kwargs`` its keyword arguments (``rollout.agent.env_args``), checked against its signature
    here, so a misspelt argument fails at start-up naming it, not on the first rollout."""
    if not isinstance(spec, str) or not spec:
        raise EnvConfigError(f"rollout.agent.env: expected a built-in name ({', '.join(ENVIRONMENTS.names())}) "
                             f"or 'pkg.mod:Class', got {spec!r}")
    target = ENVIRONMENTS.get(spec) if spec in ENVIRONMENTS else _import(spec)
    try:
        sig = inspect.signature(target)
    except (TypeError, ValueError):  # some builtins / C types have none: checked on first use
        sig = None
    if sig is not None:
        try:
            sig.bind(**kwargs)
        except TypeError as e:
            raise EnvConfigError(f"rollout.agent.env_args: {spec!r} does not accept {sorted(kwargs)}: {e}") from None
    check = getattr(target, "check_args", None)
    if callable(check):  # built-ins validate their values too (digit ranges, weights)
        try:
            check(**kwargs)
        except (TypeError, ValueError) as e:
            raise EnvConfigError(f"rollout.agent.env_args: {e}") from None
    factory = functools.partial(target, **kwargs)
    factory.spec = spec  # type: ignore[attr-defined]  -- names the env in metrics
    return factory
