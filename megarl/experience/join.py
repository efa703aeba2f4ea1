"""Idempotent join of per-sample results from the roles (rollout, actor, reference, critic, reward).

Delivery between roles is at-least-once, so results are keyed by
``(run_id, iteration, sample_id, role, role_version)``:

- the first result for a key is accepted;
- a duplicate of an accepted key is ignored (counted ``duplicates``);
- a late result -- another run / iteration, a role version other than the one expected for
  this iteration, or an attempt older than the sample's current attempt -- is rejected
  (counted ``stale``).  It never overwrites a newer result.

When the control loop retries a sample (:meth:`ExperienceJoin.new_attempt`), the sample's
earlier results are discarded: a regenerated response invalidates its scores and log-probs.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from enum import Enum
from typing import Any, Iterable, Mapping


class JoinOutcome(str, Enum):
    ACCEPTED = "accepted"
    DUPLICATE = "duplicate"
    STALE = "stale"


@dataclass(frozen=True)
class JoinKey:
    run_id: str
    iteration: int
    sample_id: str
    role: str
    role_version: str


class ExperienceJoin:
    """Join results for one iteration of one run; ``expected_versions`` maps role -> version."""

    def __init__(self, run_id: str, iteration: int, expected_versions: Mapping[str, str]):
        self.run_id = run_id
        self.iteration = iteration
        self.expected_versions = dict(expected_versions)
        self._attempt: dict[str, int] = {}
        self._results: dict[str, dict[str, Any]] = {}
        self._keys: set[JoinKey] = set()
        self.counters: Counter[str] = Counter()

    def new_attempt(self, sample_id: str) -> int:
        """A retry of ``sample_id`` was issued: drop its results, bump and return its attempt."""
        a = self._attempt.get(sample_id, 0) + 1
        self._attempt[sample_id] = a
        for role in self._results.pop(sample_id, {}):
            self._keys.discard(JoinKey(self.run_id, self.iteration, sample_id, role, self.expected_versions[role]))
        self.counters["retries"] += 1
        return a

    def offer(
        self, *, run_id: str, iteration: int, sample_id: str, role: str, role_version: str, attempt: int, payload: Any
    ) -> JoinOutcome:
        """Offer one result; returns what happened to it (and counts it)."""
        if role not in self.expected_versions:
            raise ValueError(f"role {role!r} is not joined in this iteration; expected roles {sorted(self.expected_versions)}")
        current = self._attempt.get(sample_id, 0)
        if attempt > current:
            raise ValueError(f"sample {sample_id!r}: attempt {attempt} was never issued (current attempt {current})")
        if (
            run_id != self.run_id
            or iteration != self.iteration
            or role_version != self.expected_versions[role]
            or attempt < current
        ):
            self.counters["stale"] += 1
            return JoinOutcome.STALE
        key = JoinKey(run_id, iteration, sample_id, role, role_version)
        if key in self._keys:
            self.counters["duplicates"] += 1
            return JoinOutcome.DUPLICATE
        self._keys.add(key)
        self._results.setdefault(sample_id, {})[role] = payload
        self.counters["accepted"] += 1
        return JoinOutcome.ACCEPTED

    def results(self, sample_id: str) -> dict[str, Any]:
        """role -> payload accepted for ``sample_id`` (a copy)."""
        return dict(self._results.get(sample_id, {}))

    def complete(self, sample_ids: Iterable[str], roles: Iterable[str] | None = None) -> list[str]:
        """The ids among ``sample_ids`` that have a result for every role (default: all roles)."""
        need = set(self.expected_versions if roles is None else roles)
        return [s for s in sample_ids if need <= set(self._results.get(s, {}))]
