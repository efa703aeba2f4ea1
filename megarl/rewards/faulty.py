"""Fault injection into a reward function (``faults.reward_timeout_rate``), for the fault
tests of the scoring path; the injector is :class:`megarl.runtime.faults.FaultInjector`."""

from __future__ import annotations

import threading
import time
from collections import Counter
from typing import Optional

from megarl.rewards.base import RewardMetricsSource, circuit_state, reward_identity

__all__ = ["FaultyRewardFunction"]


class FaultyRewardFunction:
    """A real reward function whose calls hang past the runner's timeout at
    ``faults.reward_timeout_rate`` (keyed on sample id and attempt), so the runner's own
    timeout, backoff and retry handle them; a hung call returns the real result afterwards
    (after ``hang_s``, far past the timeout), which the runner has abandoned."""

    def __init__(self, fn, injector, hang_s: float):
        self._fn, self._inj, self._hang_s = fn, injector, float(hang_s)
        self._attempts: Counter = Counter()
        self._lock = threading.Lock()
        self.name, self.version = reward_identity(fn)

    # the optional capabilities the runner's telemetry reads, forwarded when the function has them
    # (a batch scorer's ``score_batch`` is not: every call goes through ``__call__``, which hangs)
    def metrics(self) -> dict:
        return self._fn.metrics() if isinstance(self._fn, RewardMetricsSource) else {}

    def circuit_open(self) -> Optional[bool]:
        return circuit_state(self._fn)

    def __call__(self, sample):
        with self._lock:
            attempt = self._attempts[sample.sample_id]
            self._attempts[sample.sample_id] += 1
        if self._inj.fires("reward_timeout", self._inj.cfg.reward_timeout_rate, sample.sample_id, attempt):
            self._inj.count("reward_timeouts")
            time.sleep(self._hang_s)
        return self._fn(sample)
