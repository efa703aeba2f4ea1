"""Fault injection for drills and tests: every fault is inert unless its ``faults.*`` key is set.

Faults are injected at the real seams -- the rollout engine's results, the reward function's
calls, the actor's optimizer step, the checkpoint writer -- and the trainer then handles them
through the same code paths a real failure takes.  Nothing here fakes a recovery.  Each seam's
wrapper sits beside what it wraps (``megarl/rollout/faulty.py``, ``megarl/roles/faulty_actor.py``,
``megarl/rewards/faulty.py``, ``megarl/roles/faulty_reward_model.py``); this module holds what
they share: the decisions, the counts and the exception, and imports nothing above it.

Decisions are deterministic: whether fault ``kind`` fires for an event is
``sha256(seed | kind | key) < rate`` over the event's identity (sample id, candidate, attempt),
so a run with faults is reproducible, a retry (a new attempt) gets a fresh draw, and a test can
count exactly what was injected.  ``counts`` holds what this process injected; the trainer sums
them over ranks into the ``faults/injected/*`` metrics, next to what it observed.
"""

from __future__ import annotations

import hashlib
import threading
from collections import Counter
from typing import Any

from megarl.errors import MegarlError

__all__ = ["FaultInjector", "InjectedFault", "crash_now"]


class InjectedFault(MegarlError, RuntimeError):
    """An exception raised on purpose by ``faults.*`` (never by a real component)."""


class FaultInjector:
    """Keyed, seeded fault decisions for one run (see the module docstring)."""

    def __init__(self, cfg, seed: int, rank: int = 0, world: int = 1):
        self.cfg, self.seed, self.rank, self.world = cfg, int(seed), rank, world
        self.counts: Counter = Counter()
        self._lock = threading.Lock()
        self._fired: set = set()  # one-shot faults already injected
        #: the iteration the run is in; the driver advances it, the seams key iteration faults on it
        self.iteration: int | None = None

    @property
    def active(self) -> bool:
        c = self.cfg
        return bool(c.rollout_error_rate or c.duplicate_result_rate or c.reward_timeout_rate
                    or c.reward_model_error_at or c.reward_model_timeout_at
                    or c.fail_optimizer_step_at or c.crash_during_checkpoint_at is not None
                    or c.crash_during_update_at is not None or c.corrupt_weight_sync_at)

    def fires(self, kind: str, rate: float, *key: Any) -> bool:
        if rate <= 0.0:
            return False
        h = hashlib.sha256("|".join(map(str, (self.seed, kind) + key)).encode()).digest()
        return int.from_bytes(h[:8], "little") / 2.0**64 < rate

    def count(self, what: str, n: int = 1) -> None:
        with self._lock:
            self.counts[what] += n

    def optimizer_fault(self, iteration: int, step: int, last_step: int) -> str | None:
        """``"exception"`` or ``"nan"`` when an optimizer-step fault fires at this step on this
        rank, else None.

        ``faults.fail_optimizer_step_at`` lists iterations; the fault fires once per listed
        iteration (the retry of that update runs clean), on rank ``faults.fail_optimizer_step_rank``
        (-1: the last rank), at the iteration's last optimizer step -- after the earlier steps
        already changed the weights, so the rollback has a partial update to undo.  The trainer
        applies it: ``exception`` raises after the optimizer applied the step, before the LR
        schedule advanced; ``nan`` makes this rank's loss non-finite, so the gradients (summed
        over DP) and the grad norm are NaN on every rank and the step writes NaN weights.
        """
        c = self.cfg
        if iteration not in (c.fail_optimizer_step_at or ()) or step != last_step:
            return None
        target = self.world - 1 if c.fail_optimizer_step_rank == -1 else c.fail_optimizer_step_rank
        if self.rank != target or (iteration, "optimizer") in self._fired:
            return None
        self._fired.add((iteration, "optimizer"))
        self.count("optimizer_step_failures")
        return c.fail_optimizer_step_kind


def crash_now(what: str, iteration: int) -> None:
    """A hard process death (no cleanup, no atexit), as a kill or a node failure would be."""
    import os
    import sys

    print(f"faults: crashing {what} at iteration {iteration}", file=sys.stderr, flush=True)
    os._exit(17)

