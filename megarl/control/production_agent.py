"""Agent production: the same groups, ids, regeneration and group rule as
:class:`~megarl.control.production.GroupRolloutProducer`, with every candidate a multi-turn
session (the producer's engine is a :class:`megarl.rollout.agent.AgentSessionEngine`: a
candidate's result is its whole trajectory) scored by its environment
(:class:`megarl.control.scoring.EpisodeScorer`).  :class:`AgentEpisodeMetrics` is the observer
that adds ``rollout/agent/*`` over every finished trajectory (environment errors, timeouts and
invalid steps of dropped groups included) and ``rollout/agent/accepted/*`` over the trained ones:
turns and tool calls per trajectory, the tool-call rate, the environment-token share, per-step
latency, finish reasons."""

from __future__ import annotations

from typing import List

from megarl.control.interfaces import ProducedRollout, Sample
from megarl.versions import PolicyVersion


class AgentEpisodeMetrics:
    """A :class:`~megarl.control.production.RolloutObserver` over the trajectories of an iteration."""

    def __init__(self):
        self._episodes: list = []

    def before(self, k: int, version: PolicyVersion) -> None:
        self._episodes = []

    def observe(self, samples: List[Sample]) -> None:
        self._episodes.extend(s.episode for s in samples)

    def after(self, k: int, out: ProducedRollout) -> None:
        from megarl.rollout.agent import agent_metrics

        # over every finished trajectory, failed ones too: a dropped group's environment errors count
        out.metrics.update(agent_metrics(self._episodes))
        out.metrics.update(agent_metrics([s.episode for s in out.samples], prefix="rollout/agent/accepted"))
