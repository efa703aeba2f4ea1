"""The reward-function contract: what a scorer sees and what it must return.

A reward function maps one :class:`RewardSample` to one
:class:`~megarl.experience.schema.RewardRecord`.  A failure is a *status* (``error``,
``timeout``, ``invalid``) with ``total=None``, never a silent 0: a crashed scorer must not look
like a wrong answer to the advantage estimator.  Only
:func:`megarl.rewards.runner.apply_penalties` may turn a failure into a number, and only when
the user configured a penalty for it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Optional, Protocol, Sequence, runtime_checkable

from megarl.errors import MegarlError
from megarl.experience.schema import RewardRecord

__all__ = ["RewardSample", "RewardFunction", "RewardConfigError", "BatchRewardFunction", "RewardMetricsSource",
           "CircuitBreaking", "FieldDeclaring", "AnswerExtracting", "WarmingUp", "circuit_state",
           "reward_identity"]


class RewardConfigError(MegarlError, ValueError):
    """A reward configuration the user can fix (unknown reward, bad kwarg, bad regex, bad plug-in
    path); the message names the config key or value."""


@dataclass(frozen=True)
class RewardSample:
    """Everything a scorer may look at for one response.

    ``ground_truth`` is the dataset row minus its prompt (e.g. ``{"answer": "42"}``);
    ``messages`` are the chat messages when the prompt was a chat, so a reward model with its
    own chat template can re-render the conversation instead of re-parsing ``prompt_text``.
    ``response_char_ends`` is filled only for a scorer that declares ``places_steps``.
    """

    sample_id: str
    prompt_id: str
    group_id: str
    prompt_text: str
    response_text: str
    prompt_ids: tuple[int, ...]
    response_ids: tuple[int, ...]
    finish_reason: str
    ground_truth: Mapping[str, Any]
    messages: tuple[Mapping[str, str], ...] | None = None
    #: for a scorer that places step rewards (``places_steps = True``): where each response
    #: token's text ends in ``response_text`` (its character offset), the step-to-token map's input
    response_char_ends: tuple[int, ...] | None = None


@runtime_checkable
class RewardFunction(Protocol):
    """A scorer: ``name`` identifies it in components / logs, ``version`` goes into every
    record's ``scorer_version`` so that scores from different scorer configurations are never
    silently mixed.  Calls may run concurrently on worker threads, so ``__call__`` must be
    thread-safe; it may raise (the runner turns that into status ``error``)."""

    name: str
    version: str

    def __call__(self, sample: RewardSample) -> RewardRecord: ...


# ---- optional capabilities: each its own protocol, asked with isinstance --------------------


@runtime_checkable
class BatchRewardFunction(Protocol):
    """Scores a whole list in one call and enforces its own timeouts, retries and concurrency
    (the HTTP service); the runner then makes one call per ``score``."""

    def score_batch(self, samples: Sequence[RewardSample]) -> list[RewardRecord]: ...


@runtime_checkable
class RewardMetricsSource(Protocol):
    """Reports its own counters, merged under ``reward/<name>/`` (the runner's telemetry)."""

    def metrics(self) -> dict[str, float]: ...


@runtime_checkable
class CircuitBreaking(Protocol):
    """Has a circuit breaker: ``circuit_open`` is True while it fails fast, a bool or a
    no-argument method returning one (None: it has none after all, e.g. a wrapper around a
    function without one); see :func:`circuit_state`."""

    circuit_open: Any


def circuit_state(fn) -> Optional[bool]:
    """Whether ``fn``'s circuit breaker is open; None when it has none."""
    if not isinstance(fn, CircuitBreaking):
        return None
    state = fn.circuit_open
    return state() if callable(state) else state


@runtime_checkable
class FieldDeclaring(Protocol):
    """Declares the ground-truth fields it reads: a tuple of names (or of alternatives), or a
    no-argument method returning one; None declares nothing (:mod:`megarl.rewards.declarations`)."""

    required_fields: Any


@runtime_checkable
class AnswerExtracting(Protocol):
    """Parses the answer it compares out of a response text (None: no answer found)."""

    def extract_answer(self, text: str) -> Optional[str]: ...


@runtime_checkable
class WarmingUp(Protocol):
    """Pays its lazy first-call costs (parsers, imports) in ``warmup``, before a worker reports
    ready, so that they never count against a call's timeout."""

    def warmup(self) -> None: ...


def reward_identity(fn) -> tuple[str, str]:
    """``(name, version)`` of a scorer: what a :class:`RewardFunction` declares; a bare callable
    (which the runner accepts, failing each call that returns no record) is named by its
    qualified name and versioned ``unversioned/<name>``."""
    if isinstance(fn, RewardFunction):
        label = str(fn.name or type(fn).__qualname__)
        return label, str(fn.version or f"unversioned/{label}")
    label = getattr(fn, "__qualname__", None) or type(fn).__qualname__
    return label, f"unversioned/{label}"


def check_number(owner: str, name: str, value, *, allow_none: bool = False, positive: bool = False,
                 integer: bool = False):
    """``value`` if it is a finite number >= 0 (> 0 with ``positive``; an integer with
    ``integer``; None with ``allow_none``), else RewardConfigError naming ``owner`` and ``name``."""
    import math
    import numbers

    if value is None and allow_none:
        return None
    kind = numbers.Integral if integer else numbers.Real
    if isinstance(value, bool) or not isinstance(value, kind) or not math.isfinite(value) or value < 0 or (
        positive and value == 0
    ):
        want = ("an integer" if integer else "a finite number") + (" > 0" if positive else " >= 0")
        raise RewardConfigError(f"{owner} {name} must be {want}{' or None' if allow_none else ''}, got {value!r}")
    return value
