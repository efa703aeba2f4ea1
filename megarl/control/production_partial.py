"""Partial rollouts: an iteration trains on the groups that completed, and the unfinished ones
carry over to the next iteration instead of holding the batch up (``async_rl.partial_rollouts``;
hybrid placement, where generation and training share the pool and take turns).

Each iteration keeps ``B + async_rl.extra_groups`` groups open and generates every unfinished
candidate ``async_rl.segment_tokens`` new tokens at a time on the version the engines serve.  It
stops after the first segment at which at least B groups are complete and every *due* group is
complete (admitted at step s0, due at s0 + max(eta, 1), eta = ``async_rl.max_staleness``), and
trains on B complete groups: due ones first, then oldest first (admission step, the segment it
completed in, admission order).  At eta >= 1 a carried candidate keeps its tokens, each with
the version that sampled it (a new prefill continues it: no older KV is attended to); at eta = 0
an unfinished group's tokens are dropped at the iteration's end and it starts again, where it is
due.  The staleness bound holds by construction and is checked independently (preparation's
per-token :func:`~megarl.experience.staleness.check_staleness`).  A group is never mixed with
another or normalised before all G of its candidates finished.

The rules, their reasons, checkpoints and metrics: docs/design.md, "Partial rollouts".
"""

from __future__ import annotations

import dataclasses
import time
from collections import Counter
from typing import Dict, List, Optional

import torch

from megarl.control.interfaces import ProducedRollout, Sample
from megarl.control.placement import generate_everywhere
from megarl.control.production import GroupRolloutProducer, rollout_metrics, training_sampling
from megarl.experience.groups import CandidateStatus, GroupBuffer, candidate_sample_id
from megarl.experience.schema import FinishReason, RewardStatus
from megarl.observability.metrics import StageTimer
from megarl.rollout.protocol import GenerationRequest, GenerationResult
from megarl.rollout.segmented import segment_seed
from megarl.runtime.data_parallel import all_ranks_agree
from megarl.versions import PolicyVersion

__all__ = ["PartialRolloutProducer"]


class _Candidate:
    """One candidate of an open group: its tokens so far, each with the version that sampled it."""

    def __init__(self):
        self.reset()
        self.attempt = 0

    def reset(self) -> None:
        self.ids: List[int] = []
        self.raw: List[torch.Tensor] = []
        self.versions: List[str] = []
        self.finish: Optional[FinishReason] = None
        self.done = False  # finished: an end of sequence, a stop, or the whole token budget spent
        self.seed: Optional[int] = None
        self.first: Optional[GenerationResult] = None

    def extend(self, r: GenerationResult, budget: int) -> None:
        if self.first is None:
            self.first, self.seed = r, r.seed
        self.ids.extend(r.response_ids)
        self.raw.append(r.raw_log_probs.float())
        self.versions.extend([r.policy_version] * len(r.response_ids))
        self.finish = r.finish_reason
        self.done = r.finish_reason is not FinishReason.LENGTH or len(self.ids) >= budget


class _Group:
    """An open group: its prompt, when it was admitted and its G candidates."""

    def __init__(self, group_id: str, record, index: int, admitted_step: int, order: int, G: int):
        self.group_id, self.record, self.index = group_id, record, index
        self.admitted_step, self.order = admitted_step, order
        self.candidates = [_Candidate() for _ in range(G)]
        self.completed_at: Optional[tuple] = None  # (iteration, segment) it completed in

    @property
    def complete(self) -> bool:
        return all(c.done for c in self.candidates)

    def tokens(self) -> int:
        return sum(len(c.ids) for c in self.candidates)


class PartialRolloutProducer(GroupRolloutProducer):
    """The :class:`~megarl.control.production.GroupRolloutProducer` whose iteration trains on the
    groups that completed while the others carry over (the module docstring states the rules;
    the proximal policy is the actor's, the behaviour policy the rollout's per-token log-probs).
    Scoring, the group buffer's partial-group rule and the produced rollout are the synchronous
    producer's."""

    def __init__(self, trainer, rollout, algo, *, async_rl, **kw):
        super().__init__(trainer, rollout, algo, **kw)
        an = async_rl
        self._max_staleness = an.max_staleness
        self.extra, self.segment_tokens = an.extra_groups, an.segment_tokens
        self.open: List[_Group] = []
        self._admitted = 0  # admission order, over the run (ties broken by it)
        self._restored: Optional[list] = None

    @property
    def max_staleness(self) -> int:
        return self._max_staleness

    # ---- checkpoints ------------------------------------------------------------------------

    def in_flight(self) -> Optional[dict]:
        """What a checkpoint records (eta 0: the open groups, no tokens, so a resume is exact) or
        drops (eta >= 1: the carried tokens, counted; the prompts go back to the sampler and are
        served first after a resume)."""
        if not self.open:
            return None
        if self._max_staleness == 0:
            return {"groups": len(self.open), "recorded": [
                {"index": g.index, "group_id": g.group_id, "admitted_step": g.admitted_step, "order": g.order}
                for g in self.open]}
        return {"groups": len(self.open), "partial_tokens": sum(g.tokens() for g in self.open),
                "prompt_indices": [g.index for g in self.open]}

    def restore(self, recorded: Optional[list]) -> None:
        """The open groups a checkpoint recorded (eta 0), re-opened before the first iteration."""
        self._restored = list(recorded or [])

    # ---- production -------------------------------------------------------------------------

    def _refill(self, k: int, step: int) -> None:
        """Re-open recorded groups (a resume), then draw prompts until B + extra groups are open."""
        G = self.rollout.n
        if self._restored is not None:
            for r in self._restored:
                self.open.append(_Group(r["group_id"], self.train_data.records[r["index"]], r["index"],
                                        r["admitted_step"], r["order"], G))
                self._admitted = max(self._admitted, r["order"] + 1)
            self._restored = None
        want = self.trainer.prompts_per_iteration + self.extra - len(self.open)
        if want > 0:
            for j, i in enumerate(self.sampler.next_indices(want)):
                self.open.append(_Group(f"{self.run_id}/it{k}/r0/p{j:03d}", self.train_data.records[i], i, step,
                                        self._admitted, G))
                self._admitted += 1

    def _due(self, g: _Group, step: int) -> bool:
        return step >= g.admitted_step + max(self._max_staleness, 1)

    def _segment_requests(self, budget: int) -> Dict[int, List[tuple]]:
        """This segment's requests by their token allowance: a group not started is one request
        for its G candidates; a started candidate continues from ``prompt + its tokens``; an
        aborted one starts again (a new attempt)."""
        G = self.rollout.n
        by_left: Dict[int, List[tuple]] = {}
        for g in self.open:
            fresh = [i for i, c in enumerate(g.candidates) if not c.ids and not c.done]
            if fresh:
                attempt = max(g.candidates[i].attempt for i in fresh)
                q = GenerationRequest(g.group_id, tuple(g.record.prompt_ids),
                                      candidate_indices=None if len(fresh) == G else tuple(fresh),
                                      attempt=attempt, task=g.record.task())
                by_left.setdefault(min(self.segment_tokens, budget), []).append((q, g))
            for i, c in enumerate(g.candidates):
                if c.ids and not c.done:
                    q = GenerationRequest(f"{g.group_id}#c{i}", tuple(g.record.prompt_ids) + tuple(c.ids),
                                          candidate_indices=(i,), attempt=c.attempt, task=g.record.task())
                    by_left.setdefault(min(self.segment_tokens, budget - len(c.ids)), []).append((q, g))
        return by_left

    def _generate_segment(self, k: int, segment: int, timer: StageTimer, timing: dict,
                          m: Counter) -> None:
        budget = self.rollout.max_new_tokens
        base = training_sampling(self.rollout, self.trainer.seed, k, 0)
        for left, items in sorted(self._segment_requests(budget).items()):
            requests = [q for q, _ in items]
            owner = {q.request_id: g for q, g in items}
            sampling = dataclasses.replace(base, max_new_tokens=left, seed=segment_seed(base.seed, segment))
            errors: list = []
            t0 = time.perf_counter()
            with timer.stage("generate", requests=len(requests), segment=segment):
                results = generate_everywhere(self.engine, self.placement, requests, sampling, errors)
            timing["generate"] += time.perf_counter() - t0
            m["rollout/engine_errors"] += len(errors)
            self.counters["engine_errors"] += len(errors)
            if errors:
                self.last_engine_error = f"inference group {errors[-1][0]}: {errors[-1][1]}"
            answered = set()
            for r in results:
                g = owner.get(r.request_id)
                if g is None or (r.request_id, r.candidate_index) in answered:
                    self.counters["results_ignored"] += 1  # not this call's, or a duplicate
                    continue
                answered.add((r.request_id, r.candidate_index))
                c = g.candidates[r.candidate_index]
                if r.attempt != c.attempt or c.done:
                    self.counters["results_ignored"] += 1
                    continue
                if r.finish_reason is FinishReason.ABORT:  # generated again from its prompt
                    m["rollout/aborted"] += 1
                    c.reset()
                    c.attempt += 1
                    continue
                c.extend(r, budget)
                if g.completed_at is None and g.complete:
                    g.completed_at = (k, segment)
            for q, g in items:  # an unanswered candidate (its engine failed) starts again, a new attempt
                for i in q.candidates(self.rollout.n):
                    if (q.request_id, i) not in answered and not g.candidates[i].done:
                        m["rollout/candidates_lost"] += 1
                        self.counters["candidates_lost"] += 1
                        g.candidates[i].reset()
                        g.candidates[i].attempt += 1
        self.sm.check_deadline(agree=all_ranks_agree)

    def _produce(self, k: int, version: PolicyVersion, timer: StageTimer) -> ProducedRollout:
        B = self.trainer.prompts_per_iteration
        v, step = version.short_id, version.optimizer_step
        self.sm.begin_generating([v] * self.placement.num_groups)
        self._refill(k, step)
        m: Counter = Counter()
        timing = {"generate": 0.0, "reward": 0.0}
        carried = [g for g in self.open if any(c.ids for c in g.candidates) or g.admitted_step < step]
        m["rollout/partial_groups_carried_in"] = len(carried)
        m["rollout/partial_tokens_carried_in"] = sum(g.tokens() for g in carried)
        segment = 0
        while True:
            done = [g for g in self.open if g.complete]
            due_open = [g for g in self.open if self._due(g, step) and not g.complete]
            if (len(done) >= B and not due_open) or len(done) == len(self.open):
                break
            self._generate_segment(k, segment, timer, timing, m)
            segment += 1
        m["rollout/segments"] = segment
        done.sort(key=lambda g: (not self._due(g, step), g.admitted_step, g.completed_at or (k, segment), g.order))
        chosen = done[:B]
        accepted, real_sizes = self._release(chosen, timer, timing, m)
        chosen_ids = {g.group_id for g in chosen}
        self.open = [g for g in self.open if g.group_id not in chosen_ids]
        m["rollout/partial_groups_open"] = len(self.open)
        m["rollout/partial_tokens_open"] = sum(g.tokens() for g in self.open)
        if self._max_staleness == 0:  # no token outlives its version: the open groups start again
            m["rollout/partial_tokens_dropped"] = sum(g.tokens() for g in self.open)
            self.counters["partial_tokens_dropped"] += m["rollout/partial_tokens_dropped"]
            for g in self.open:
                for c in g.candidates:
                    c.reset()
                g.completed_at = None
        if not accepted:
            self.sm.fail(f"iteration {k}: no complete group survived rollout and scoring")
            raise RuntimeError(f"iteration {k}: every group was dropped (see {self.quarantine_path} and the counters)")
        m["rollout/groups_accepted"] = len(real_sizes)
        m["rollout/group_size_mean"] = sum(real_sizes.values()) / len(real_sizes)
        m["rollout/generate_s"] = timing["generate"]
        m["prep/reward_s"] = timing["reward"]
        lens = [len(s.response_ids) for s in accepted]
        m["rollout/mixed_version_share"] = sum(s.spans_versions for s in accepted) / len(accepted)
        m["rollout/len_mean_over_max"] = sum(lens) / len(lens) / max(lens)
        return ProducedRollout(accepted, real_sizes,
                               sampling=self.sampling_record(k),
                               metrics=rollout_metrics(accepted, dict(m), timing["generate"], self.checks),
                               max_staleness=self._max_staleness)

    def _release(self, chosen: List[_Group], timer: StageTimer, timing: dict, m: Counter):
        """Score the chosen groups' candidates and pass them through the group buffer (whole
        groups; a failed score is final for its candidate, and the partial-group rule decides)."""
        buffer = GroupBuffer(self._group_policy())
        samples: List[Sample] = []
        for g in chosen:
            buffer.open_group(g.group_id, g.record.prompt_id, "partial",
                              [candidate_sample_id(g.group_id, i) for i in range(len(g.candidates))])
            for i, c in enumerate(g.candidates):
                mixed = len(set(c.versions)) > 1
                samples.append(Sample(
                    prompt_id=g.record.prompt_id, group_id=g.group_id, sample_id=candidate_sample_id(g.group_id, i),
                    request_id=g.group_id, prompt_ids=tuple(g.record.prompt_ids), response_ids=tuple(c.ids),
                    raw_log_probs=torch.cat(c.raw) if c.raw else torch.zeros(0),
                    finish_reason=c.finish,
                    policy_version=c.versions[-1], seed=c.seed, prompt=g.record,
                    token_versions=tuple(c.versions) if mixed else None))
        m["rollout/samples"] += len(samples)
        t0 = time.perf_counter()
        with timer.stage("reward", samples=len(samples)):
            self.scorer.score(samples)
        timing["reward"] += time.perf_counter() - t0
        self._observe(samples)
        for s in samples:
            ok = s.record.status is RewardStatus.OK
            if not ok:
                m[f"prep/reward_{s.record.status.value}"] += 1
            buffer.report(group_id=s.group_id, prompt_id=s.prompt_id, sample_id=s.sample_id,
                          policy_version="partial", attempt=0,
                          status=CandidateStatus.OK if ok else CandidateStatus.FATAL, payload=s,
                          reason="" if ok else s.record.error)
        accepted: List[Sample] = []
        real_sizes: Dict[str, int] = {}
        self._accept(buffer.pop_released(), len(chosen), accepted, real_sizes, m)
        self._count_groups(buffer.counters, m)
        return accepted, real_sizes
