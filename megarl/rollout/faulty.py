"""Fault injection into a rollout engine's results (``faults.rollout_error_rate``,
``faults.duplicate_result_rate``), for the fault drills and tests of the generation path; the
injector is :class:`megarl.runtime.faults.FaultInjector`."""

from __future__ import annotations

from typing import Sequence

from megarl.rollout.protocol import EngineWrapper
from megarl.runtime.faults import FaultInjector

__all__ = ["FaultyRolloutEngine"]


class FaultyRolloutEngine(EngineWrapper):
    """A real rollout engine whose results are lost, delivered late, or duplicated.

    * ``faults.rollout_error_rate``: a candidate's result is lost (the controller sees it
      missing and must regenerate it by sample id); the lost result itself is delivered late,
      appended to the *next* ``generate`` call's results, where it must be ignored;
    * ``faults.duplicate_result_rate``: a result is delivered twice in the same call.

    Everything else (load, activate, sleep, wake, the generation itself; submit and collect of a
    split placement's engine, whose results are not faulted) is the real engine's
    (:class:`~megarl.rollout.protocol.EngineWrapper`).
    """

    def __init__(self, engine, injector: FaultInjector):
        super().__init__(engine)
        self._engine, self._inj = engine, injector
        self._late: list = []

    def generate(self, requests: Sequence, sampling) -> list:
        late, self._late = self._late, []
        results = self._engine.generate(requests, sampling)
        c, out = self._inj.cfg, []
        for r in results:
            key = (r.request_id, r.candidate_index, r.attempt)
            if self._inj.fires("rollout_error", c.rollout_error_rate, *key):
                self._inj.count("rollout_errors")
                self._late.append(r)
                continue
            out.append(r)
            if self._inj.fires("duplicate_result", c.duplicate_result_rate, *key):
                self._inj.count("duplicate_results")
                out.append(r)
        self._inj.count("late_results", len(late))
        return out + late
