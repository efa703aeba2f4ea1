"""Per-scorer metrics of a :class:`~megarl.rewards.runner.RewardRunner`, over a window.

:meth:`ScorerStats.window` returns ``reward/<name>/...`` floats for the calls since the last
window and starts a new one: ``calls_per_s`` (attempts per second of wall time spent inside
``score``), ``latency_p50_s`` / ``latency_p99_s`` (of the calls that answered), ``timeouts``,
``errors``, ``worker_restarts`` (process isolation: workers killed or dead and replaced), and
``circuit_open`` (1.0 / 0.0) when the reward function has a circuit breaker
(:class:`~megarl.rewards.base.CircuitBreaking`); a scorer that reports its own counters
(:class:`~megarl.rewards.base.RewardMetricsSource`) has them merged under ``reward/<name>/``.
"""

from __future__ import annotations

import math
import threading
from typing import Any, Dict

from megarl.rewards.base import RewardMetricsSource, circuit_state

__all__ = ["ScorerStats", "percentile"]


def percentile(values, q: float) -> float:
    """Nearest-rank percentile (q in [0, 100]) of a non-empty sequence."""
    xs = sorted(values)
    k = max(0, min(len(xs) - 1, math.ceil(q / 100.0 * len(xs)) - 1))
    return float(xs[k])


class ScorerStats:
    def __init__(self, name: str):
        self.name = str(name)
        self._lock = threading.Lock()
        self._latencies: list[float] = []
        self._busy_s = 0.0
        self._last: Dict[str, float] = {}

    def latency(self, seconds: float) -> None:
        with self._lock:
            self._latencies.append(float(seconds))

    def busy(self, seconds: float) -> None:
        with self._lock:
            self._busy_s += float(seconds)

    def window(self, counters, restarts: int, fn: Any = None) -> Dict[str, float]:
        now = {"calls": float(counters["calls"]), "timeouts": float(counters["timeout"]),
               "errors": float(counters["error"]), "worker_restarts": float(restarts)}
        with self._lock:
            lat, self._latencies = self._latencies, []
            busy, self._busy_s = self._busy_s, 0.0
            delta = {k: v - self._last.get(k, 0.0) for k, v in now.items()}
            self._last = now
        p = f"reward/{self.name}/"
        out = {p + "calls_per_s": delta["calls"] / busy if busy > 0 else 0.0,
               p + "timeouts": delta["timeouts"], p + "errors": delta["errors"],
               p + "worker_restarts": delta["worker_restarts"]}
        if lat:
            out[p + "latency_p50_s"] = percentile(lat, 50)
            out[p + "latency_p99_s"] = percentile(lat, 99)
        circuit = circuit_state(fn)
        if circuit is not None:
            out[p + "circuit_open"] = 1.0 if circuit else 0.0
        if isinstance(fn, RewardMetricsSource):
            for k, v in dict(fn.metrics()).items():
                out[p + str(k)] = float(v)
        return out
