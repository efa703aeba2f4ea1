"""Fault injection into the neural reward model's forward (``faults.reward_model_error_at``,
``faults.reward_model_timeout_at``), the seam the other roles' drills have: at the listed
iterations its ``score`` raises on every rank, or returns its real scores only after
``reward.model.timeout_s`` has passed, so the scorer's own handling is what a test exercises."""

from __future__ import annotations

import time

from megarl.runtime.faults import InjectedFault

__all__ = ["FaultyRewardModel"]


class FaultyRewardModel:
    """Wraps a :class:`megarl.roles.reward_model.RewardModel`; everything but ``score`` is the
    model's own."""

    def __init__(self, model, injector, timeout_s):
        self._model, self._inj = model, injector
        self._hold_s = None if timeout_s is None else 2.0 * float(timeout_s) + 0.5  # far past the limit

    def __getattr__(self, name):
        return getattr(self._model, name)

    def score(self, inputs):
        it, cfg = self._inj.iteration, self._inj.cfg
        if it in cfg.reward_model_error_at:
            self._inj.count("reward_model_errors")
            raise InjectedFault(f"faults.reward_model_error_at: the reward model's forward of iteration {it}")
        if it in cfg.reward_model_timeout_at:
            self._inj.count("reward_model_timeouts")
            scores = self._model.score(inputs)
            time.sleep(self._hold_s)
            return scores
        return self._model.score(inputs)
