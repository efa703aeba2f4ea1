"""What the phase components hand each other, and the one interface a rollout producer meets.

The driver (:mod:`megarl.control.trainer`) passes these between the components; a component
never imports another component, only this module (``tests/unit/project/test_layering.py`` checks it).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Protocol

import torch

from megarl.experience.schema import FinishReason, RewardRecord, SampleRouting
from megarl.observability.metrics import StageTimer
from megarl.versions import PolicyVersion


@dataclass
class Sample:
    """One candidate on its way to the experience record: what the engine generated for it
    (ids, raw log-probs, finish reason, the version that generated it, for an MoE model asked for
    it the experts it was routed to, for an agent session its whole episode) and, once scored,
    its reward record."""

    prompt_id: str
    group_id: str
    sample_id: str
    request_id: str
    prompt_ids: tuple
    response_ids: tuple
    raw_log_probs: torch.Tensor
    finish_reason: FinishReason
    policy_version: str
    seed: Optional[int]
    record: Optional[RewardRecord] = None
    prompt: object = None  # the PromptRecord
    routed_experts: Optional[SampleRouting] = None  # MoE: the engine's routing (algo.routing_replay=rollout)
    #: an agent session's trajectory (``megarl.rollout.agent.Trajectory``: per-token sources, turns,
    #: versions; the environment's reward components and status); None for a single-turn sample
    episode: object = None
    #: a response generated across versions (an in-flight weight update mid-response): each
    #: response token's version; ``policy_version`` is then the last's.  None: all one version
    token_versions: Optional[tuple] = None
    #: seconds from its generate call's start to its completion, where the engine knows it
    latency_s: Optional[float] = None
    #: prompt tokens the engine served from its prefix cache, where it reports them
    cached_prompt_tokens: Optional[int] = None
    #: times the engine preempted it (KV exhausted, recomputed later), where it reports them
    preemptions: Optional[int] = None

    @property
    def spans_versions(self) -> bool:
        """Whether more than one version sampled its policy tokens (an in-flight weight update
        mid-response, or an agent session that took a newer version between turns)."""
        if self.token_versions is not None:
            return len(set(self.token_versions)) > 1
        if self.episode is not None:
            return len({v for v in self.episode.token_versions if v is not None}) > 1
        return False


@dataclass
class ProducedRollout:
    """Complete, scored groups of one iteration and their accounting.

    samples: the accepted candidates, group by group, every one scored with status ok (or a
        penalty number that ``reward.penalty`` named).
    real_sizes: group id -> the number of members the group was released with (G, or fewer
        under ``algo.partial_groups=allow_partial``); sealing checks every group is complete.
    sampling: the sampling parameters the samples were drawn with, as recorded in the experience.
    metrics: ``rollout/*`` and ``prep/reward*`` metrics of the production.
    max_staleness: the producer's declared bound (``megarl.experience.staleness``).
    """

    samples: List[Sample]
    real_sizes: Dict[str, int]
    sampling: dict = field(default_factory=dict)
    metrics: Dict[str, float] = field(default_factory=dict)
    #: the staleness bound the producer declares (optimizer steps; 0: every policy token generated
    #: by the version trained from); preparation refuses any policy token beyond it
    max_staleness: int = 0


class RolloutProducer(Protocol):
    """Produces the experience of one iteration on the version the engines serve.

    The group producer (:class:`megarl.control.production.GroupRolloutProducer`) is the
    implementation; agentic (multi-turn) and asynchronous (bounded-staleness) production are parts
    composed into it (:mod:`megarl.control.production_agent`, :mod:`megarl.control.production_ahead`);
    partial rollouts (:mod:`megarl.control.production_partial`) are a subclass of it.
    A producer must return only complete, scored groups generated on ``version`` (or, for a
    bounded-staleness producer, within its declared bound), and count everything it dropped.
    """

    def produce(self, k: int, version: PolicyVersion, timer: StageTimer) -> ProducedRollout: ...

    def in_flight(self) -> Optional[dict]:
        """What a checkpoint taken now records (``recorded``: restored by :meth:`restore`) or
        drops (generation submitted ahead, partial rollouts' tokens), or None."""
        ...

    def restore(self, recorded: list) -> None:
        """Take back the work a checkpoint recorded (``in_flight()["recorded"]``) before the first
        iteration of a resume."""
        ...


class SampleScorer(Protocol):
    """Scores samples in place (``Sample.record``); a failure is a status, never a number
    unless ``reward.penalty`` names one."""

    def score(self, samples: List[Sample]) -> None: ...


@dataclass
class RunProgress:
    """The run's facts that a resume must continue, shared by the components that change them:
    cumulative counters (``e2e/count/*``), whether the rollout/actor log-prob parity was
    checked, and the last held-out accuracy.  Saved in every checkpoint and restored on resume."""

    counters: Counter = field(default_factory=Counter)
    parity_checked: bool = False
    last_eval: Optional[float] = None  # None also when the last evaluation scored nothing
    #: (unscored, prompts) of the last evaluation, for the progress line; not checkpointed
    last_eval_unscored: Optional[tuple] = None
