"""GRPO groups: a buffer that releases a group only under this completion policy.

1. a group is released when all G candidates have succeeded;
2. a retryable failure is re-requested for the *same* policy version (a RetryRequest);
3. after ``max_retries`` a candidate fails for good; the group is then dropped, or -- only if
   ``partial_rule == "allow_partial"`` -- released with the candidates that succeeded, if at
   least ``min_partial_size`` did;
4. a group never takes a sample from another prompt or version; the real size is recorded.

The buffer is per-process bookkeeping (the control loop owns it); group statistics are computed
only over released groups, via :func:`group_index`.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from enum import Enum
from typing import Any, Mapping, Sequence

import torch


class CandidateStatus(str, Enum):
    OK = "ok"
    RETRYABLE = "retryable"  # rollout abort, scorer timeout, transient worker loss
    FATAL = "fatal"  # will not succeed on retry (e.g. scorer says invalid)


PARTIAL_RULES = ("drop", "allow_partial")


def candidate_sample_id(request_id: str, candidate: int) -> str:
    """The id of candidate ``candidate`` of request (group) ``request_id``: ``<request_id>/cNN``."""
    return f"{request_id}/c{candidate:02d}"


def candidate_of(sample_id: str) -> int:
    """The candidate index in a :func:`candidate_sample_id`."""
    return int(sample_id.rsplit("/c", 1)[1])


class GroupContractError(ValueError):
    """A sample offered to the wrong group (other prompt, unknown candidate)."""


@dataclass(frozen=True)
class GroupPolicy:
    group_size: int
    max_retries: int = 2
    partial_rule: str = "drop"
    min_partial_size: int | None = None

    def __post_init__(self) -> None:
        if self.group_size < 1:
            raise ValueError(f"GroupPolicy.group_size must be >= 1, got {self.group_size}")
        if self.max_retries < 0:
            raise ValueError(f"GroupPolicy.max_retries must be >= 0, got {self.max_retries}")
        if self.partial_rule not in PARTIAL_RULES:
            raise ValueError(f"GroupPolicy.partial_rule {self.partial_rule!r} is not one of {PARTIAL_RULES}")
        if self.partial_rule == "allow_partial":
            if self.min_partial_size is None or not 1 <= self.min_partial_size <= self.group_size:
                raise ValueError(
                    f"GroupPolicy.min_partial_size must be in [1, group_size={self.group_size}] with allow_partial, "
                    f"got {self.min_partial_size}"
                )
        elif self.min_partial_size is not None:
            raise ValueError("GroupPolicy.min_partial_size is only meaningful with partial_rule='allow_partial'")


@dataclass(frozen=True)
class RetryRequest:
    group_id: str
    prompt_id: str
    sample_id: str
    policy_version: str
    attempt: int
    reason: str


@dataclass(frozen=True)
class CompleteGroup:
    group_id: str
    prompt_id: str
    policy_version: str
    samples: tuple[tuple[str, Any], ...]  # (sample_id, payload) in candidate order
    expected_size: int
    real_size: int

    @property
    def partial(self) -> bool:
        return self.real_size < self.expected_size


@dataclass
class _Slot:
    attempt: int = 0
    state: str = "pending"  # pending | ok | failed
    payload: Any = None


@dataclass
class _Group:
    prompt_id: str
    policy_version: str
    slots: dict[str, _Slot]


class GroupBuffer:
    """Collects candidates by ``group_id`` and releases groups under a :class:`GroupPolicy`.

    ``counters`` counts: opened, released, released_partial, dropped, retries, duplicates,
    stale (a result from an older attempt), wrong_version (a result from another policy version).
    """

    def __init__(self, policy: GroupPolicy):
        self.policy = policy
        self._groups: dict[str, _Group] = {}
        self._released: list[CompleteGroup] = []
        self._closed: set[str] = set()
        self.counters: Counter[str] = Counter()

    def open_group(self, group_id: str, prompt_id: str, policy_version: str, sample_ids: Sequence[str]) -> None:
        """Register the G candidates of ``group_id`` (one prompt, one policy version)."""
        if group_id in self._groups or group_id in self._closed:
            raise GroupContractError(f"group {group_id!r} is already open or closed")
        if len(sample_ids) != self.policy.group_size or len(set(sample_ids)) != len(sample_ids):
            raise GroupContractError(
                f"group {group_id!r} needs {self.policy.group_size} distinct sample ids, got {list(sample_ids)}"
            )
        self._groups[group_id] = _Group(prompt_id, policy_version, {s: _Slot() for s in sample_ids})
        self.counters["opened"] += 1

    def report(
        self,
        *,
        group_id: str,
        prompt_id: str,
        sample_id: str,
        policy_version: str,
        attempt: int,
        status: CandidateStatus | str,
        payload: Any = None,
        reason: str = "",
    ) -> RetryRequest | None:
        """Record one candidate outcome; return a RetryRequest when it must be re-requested.

        A report from a finished group, an older attempt, or another policy version is counted
        and ignored (a late result); a sample of another prompt or an unknown candidate raises.
        """
        status = CandidateStatus(status)
        if group_id in self._closed:
            self.counters["stale"] += 1
            return None
        g = self._groups.get(group_id)
        if g is None:
            raise GroupContractError(f"group {group_id!r} was never opened")
        if prompt_id != g.prompt_id:
            raise GroupContractError(
                f"sample {sample_id!r} of prompt {prompt_id!r} offered to group {group_id!r} of prompt {g.prompt_id!r}"
            )
        slot = g.slots.get(sample_id)
        if slot is None:
            raise GroupContractError(f"sample {sample_id!r} is not a candidate of group {group_id!r}")
        if policy_version != g.policy_version:
            self.counters["wrong_version"] += 1
            return None
        if attempt < slot.attempt:
            self.counters["stale"] += 1
            return None
        if attempt > slot.attempt:
            raise GroupContractError(f"sample {sample_id!r}: attempt {attempt} was never requested (current {slot.attempt})")
        if slot.state != "pending":
            self.counters["duplicates"] += 1
            return None
        retry = None
        if status is CandidateStatus.OK:
            slot.state, slot.payload = "ok", payload
        elif status is CandidateStatus.RETRYABLE and slot.attempt < self.policy.max_retries:
            slot.attempt += 1
            self.counters["retries"] += 1
            retry = RetryRequest(group_id, g.prompt_id, sample_id, g.policy_version, slot.attempt, reason)
        else:
            slot.state = "failed"
            self.counters["failed_candidates"] += 1
        self._maybe_finish(group_id, g)
        return retry

    def _maybe_finish(self, group_id: str, g: _Group) -> None:
        if any(s.state == "pending" for s in g.slots.values()):
            return
        ok = tuple((sid, s.payload) for sid, s in g.slots.items() if s.state == "ok")
        del self._groups[group_id]
        self._closed.add(group_id)
        full = len(ok) == self.policy.group_size
        if full or (self.policy.partial_rule == "allow_partial" and len(ok) >= self.policy.min_partial_size):
            self._released.append(CompleteGroup(group_id, g.prompt_id, g.policy_version, ok, self.policy.group_size, len(ok)))
            self.counters["released" if full else "released_partial"] += 1
        else:
            self.counters["dropped"] += 1

    def pop_released(self) -> list[CompleteGroup]:
        """Released groups since the last call, in completion order."""
        out, self._released = self._released, []
        return out

    def knows(self, group_id: str) -> bool:
        """Whether ``group_id`` was opened here (it may be closed by now)."""
        return group_id in self._groups or group_id in self._closed


def group_index(group_ids: Sequence[str], real_sizes: Mapping[str, int] | None = None) -> tuple[torch.Tensor, tuple[str, ...]]:
    """Map per-sample ``group_id`` strings to a ``(bs,)`` int64 index (first-appearance order).

    If ``real_sizes`` (group_id -> the recorded real group size) is given, every group must be
    present with exactly that many samples: statistics over a group fragment are refused.
    """
    order: dict[str, int] = {}
    idx = [order.setdefault(g, len(order)) for g in group_ids]
    if real_sizes is not None:
        counts = Counter(group_ids)
        for g, n in counts.items():
            if g not in real_sizes:
                raise ValueError(f"group {g!r} has no recorded real size; was it released by the GroupBuffer?")
            if n != real_sizes[g]:
                raise ValueError(f"group {g!r} has {n} samples in the batch, its recorded real size is {real_sizes[g]}")
    return torch.tensor(idx, dtype=torch.int64), tuple(order)
