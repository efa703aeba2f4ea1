"""Scoring: a reward record for every generated sample.

Rule functions (and plug-ins) run once, on rank 0, under the :class:`RewardRunner`, which turns
exceptions, timeouts and invalid values into statuses; the records are broadcast.  The neural
reward models (``reward.model``, then ``reward.models``) are collective forwards on every rank, each
on its own rendering of the sample, each score its own component added with its weight.  A
failed score stays a status (the sample and, under GRPO, its group are dropped or quarantined)
unless ``reward.penalty.<status>`` names a number for it.
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections import Counter
from typing import List

from megarl.control.interfaces import Sample
from megarl.experience.schema import RewardRecord, RewardStatus
from megarl.roles.process_reward_model import add_process_scores
from megarl.roles.reward_model import add_component, input_digest
from megarl.observability.profiling import span
from megarl.runtime.data_parallel import broadcast_object, gather_objects


class Scorer:
    """Args: ``reward_cfg`` the ``reward`` section; ``runner`` the rule-function runner (rank 0
    only, else None); ``reward_models`` the neural reward model roles, one per entry of
    ``reward_cfg.neural_models()`` in its order (empty: none); ``tok`` the policy
    tokenizer contract (decodes responses for the scorers); ``counters`` the run's counters;
    ``max_new_tokens`` the response budget (L_max of ``reward.overlong_buffer``);
    ``shape_overlong`` false for evaluation, which scores answers, not training signals."""

    def __init__(self, reward_cfg, tok, runner, reward_models, counters: Counter, quarantine_path: str, rank0: bool,
                 max_new_tokens: int, shape_overlong: bool = True, judges=()):
        self.cfg, self.tok, self.runner = reward_cfg, tok, runner
        entries = reward_cfg.neural_models()
        if len(entries) != len(reward_models):
            raise ValueError(f"{len(reward_models)} reward model role(s) for {len(entries)} configured: "
                             f"{[k for k, _ in entries]}")
        #: ``(key, settings, role)`` of each neural reward model, in scoring order
        self.reward_models = [(k, m, role) for (k, m), role in zip(entries, reward_models)]
        if len(reward_cfg.judges) != len(judges):
            raise ValueError(f"{len(judges)} judge role(s) for {len(reward_cfg.judges)} configured")
        #: ``(key, settings, judge)`` of each generative judge (the judge on rank 0, None elsewhere)
        self.judges = [(f"reward.judges[{i}]", j, role) for i, (j, role) in enumerate(zip(reward_cfg.judges, judges))]
        self.max_new_tokens = max_new_tokens  # L_max of the overlong punishment
        self.overlong_buffer = reward_cfg.overlong_buffer if shape_overlong else None
        self.counters, self.quarantine_path, self.rank0 = counters, quarantine_path, rank0

    def score(self, samples: List[Sample]) -> None:
        """Rewards for ``samples``, in place (``Sample.record``)."""
        from megarl.rewards.base import RewardSample
        from megarl.algo.reward_shaping import with_overlong_component

        rs = [RewardSample(sample_id=s.sample_id, prompt_id=s.prompt_id, group_id=s.group_id,
                           prompt_text=(s.prompt.text if s.prompt.text is not None
                                        else self.tok.decode(s.prompt_ids, skip_special_tokens=True)),
                           response_text=self.tok.decode(s.response_ids, skip_special_tokens=True),
                           prompt_ids=tuple(s.prompt_ids), response_ids=tuple(s.response_ids),
                           finish_reason=s.finish_reason.value, ground_truth=dict(s.prompt.ground_truth),
                           messages=s.prompt.messages) for s in samples]
        process_models = any(m.kind == "process" for _, m, _ in self.reward_models)  # every rank maps their steps
        if process_models or (self.rank0 and self.runner is not None and getattr(self.runner.fn, "places_steps", False)):
            rs = [dataclasses.replace(r, response_char_ends=self._char_ends(r.response_ids)) for r in rs]
        records = None
        if self.rank0 and self.runner is not None:
            rc = self.runner.counters
            before = (rc["timeout"], rc["error"], rc["retries"])
            records = [r.to_json() for r in self.runner.score(rs)]  # JSON travels, mappingproxy does not
            after = (rc["timeout"], rc["error"], rc["retries"])
            records = (records, [n - b for n, b in zip(after, before, strict=True)])
        with span("reward_broadcast"):  # rank 0's records to every rank
            records = broadcast_object(records)
        if records is not None:
            records, (timeouts, errors, retries) = records
            self.counters["reward_call_timeouts"] += timeouts
            self.counters["reward_call_errors"] += errors
            self.counters["reward_call_retries"] += retries
        records = None if records is None else [RewardRecord.from_json(r) for r in records]
        for key, settings, role in self.reward_models:
            if settings.kind == "process":  # a score per step (megarl/roles/process_reward_model.py)
                records = add_process_scores(rs, records, key, settings, role, self.counters)
            else:
                records = self._add_reward_model(rs, records, key, settings, role)
        for key, settings, judge in self.judges:
            records = add_judge_verdicts(rs, records, key, settings, judge, self.counters)
        if self.overlong_buffer is not None:  # DAPO soft overlong punishment, on ok scores only
            records = [with_overlong_component(rec, len(s.response_ids), self.max_new_tokens, self.overlong_buffer)
                       for rec, s in zip(records, samples, strict=True)]
        record_scores(samples, records, self.cfg, self.tok, self.counters, self.quarantine_path, self.rank0)

    def _char_ends(self, ids) -> tuple:
        """Where each response token's text ends in the decoded response (the scorer's view):
        the length of the decoded prefix through it."""
        return tuple(len(self.tok.decode(list(ids[:t + 1]), skip_special_tokens=True)) for t in range(len(ids)))

    def _add_reward_model(self, rs, records, key: str, settings, rm):
        """One reward model's score (collective) added to each ok record as the component of its
        name, or alone.  A forward that raised (on any rank) or took longer than its
        ``timeout_s`` (on the slowest rank) makes every sample of the batch status error /
        timeout, naming why: a failed scorer is never a score.  (A rank that fails inside a
        collective leaves its peers blocked there: that is the lost-rank path,
        megarl/runtime/liveness.py.)"""
        texts = [rm.encode(x.messages, x.prompt_text, x.response_text, x.ground_truth) for x in rs]
        t0 = time.monotonic()
        try:
            scores, error = rm.score(texts), None
        except Exception as e:  # noqa: BLE001 -- a status for every sample, below
            scores, error = None, f"{type(e).__name__}: {e}"
        outcomes = gather_objects((error, time.monotonic() - t0))
        failed = [(rank, err) for rank, (err, _) in enumerate(outcomes) if err is not None]
        took, limit = max(s for _, s in outcomes), settings.timeout_s
        which = "the reward model" if key == "reward.model" else f"reward model {settings.name!r} ({key})"
        status = None
        if failed:
            status, why = RewardStatus.ERROR, f"{which}'s forward failed on rank {failed[0][0]}: {failed[0][1]}"
            self.counters["reward_model_errors"] += 1
        elif limit is not None and took > limit:
            status, why = RewardStatus.TIMEOUT, (f"{which}'s forward took {took:.1f}s, past "
                                                 f"{key}.timeout_s={limit:g}")
            self.counters["reward_model_timeouts"] += 1
        w = settings.weight
        merged = []
        for i, _ in enumerate(rs):
            base = records[i] if records is not None else None
            if base is not None and base.status is not RewardStatus.OK:
                merged.append(base)
                continue
            inputs = {**(base.inputs if base is not None else {}), settings.name: input_digest(texts[i])}
            if status is not None:
                merged.append(RewardRecord(total=None, scorer_version=rm.version, status=status, error=why,
                                           inputs=inputs))
                continue
            merged.append(add_component(base, settings.name, float(scores[i]), w, rm.version, inputs))
        return merged


def add_judge_verdicts(rs, records, key: str, settings, judge, counters: Counter):
    """A generative judge's verdicts (computed on rank 0, broadcast) added to each ok record as the
    component of its name, or alone.  No verdict (unparseable, truncated) is status ``invalid``
    with the judge's text quoted; a judge that raised makes every sample status ``error``."""
    payload = None
    if judge is not None:
        texts = []
        try:
            texts = [judge.render(x.messages, x.prompt_text, x.response_text, x.ground_truth) for x in rs]
            # request ids from the samples' own: a sampled verdict draws the same on a resume
            verdicts = judge.judge(texts, [f"{settings.name}/{x.sample_id}" for x in rs])
            payload = ([(v.score, v.error) for v in verdicts], None, judge.version, [input_digest(t) for t in texts])
        except Exception as e:  # noqa: BLE001 -- a status for every sample, below
            digests = [input_digest(t) for t in texts] if len(texts) == len(rs) else [None] * len(rs)
            payload = (None, f"judge {settings.name!r} ({key}) failed: {type(e).__name__}: {e}", judge.version, digests)
    with span("judge_broadcast"):
        verdicts, failure, version, digests = broadcast_object(payload)
    merged = []
    for i, _ in enumerate(rs):
        base = records[i] if records is not None else None
        if base is not None and base.status is not RewardStatus.OK:
            merged.append(base)
            continue
        inputs = {**(base.inputs if base is not None else {}), **({settings.name: digests[i]} if digests[i] else {})}
        score, error = (None, failure) if verdicts is None else verdicts[i]
        if score is None:
            status = RewardStatus.ERROR if verdicts is None else RewardStatus.INVALID
            counters[f"judge_{status.value}"] += 1
            merged.append(RewardRecord(total=None, scorer_version=version, status=status, error=error, inputs=inputs))
            continue
        merged.append(add_component(base, settings.name, float(score), settings.weight, version, inputs))
    return merged


def record_scores(samples: List[Sample], records, reward_cfg, tok, counters: Counter, quarantine_path: str,
                  rank0: bool) -> None:
    """The records onto the samples, failures turned into ``reward.penalty`` numbers where it
    names one; what stays failed is counted and, under ``reward.on_failure=quarantine``, written
    to the quarantine file (rank 0)."""
    from megarl.rewards.runner import apply_penalties

    records = apply_penalties(records, reward_cfg.penalty)
    for s, r in zip(samples, records, strict=True):
        s.record = r
    failed = [s for s in samples if s.record.status is not RewardStatus.OK]
    if failed and rank0 and reward_cfg.on_failure == "quarantine":
        with open(quarantine_path, "a") as f:
            for s in failed:
                f.write(json.dumps({"sample_id": s.sample_id, "prompt_id": s.prompt_id,
                                    "policy_version": s.policy_version,
                                    "response_text": tok.decode(s.response_ids),
                                    "response_ids": list(s.response_ids),
                                    "reward": s.record.to_json()}) + "\n")
    counters["reward_failures"] += len(failed)


class EpisodeScorer:
    """Scores agent trajectories by their environment: the reward is the sum of the reward
    components the environment returned over the episode's steps (``Sample.episode``), and its
    applicable mask (``applies_to``) says which turn each step's reward was for.

    An environment that failed (``error`` / ``timeout`` / ``invalid``) makes the sample's record
    that status with the environment's reason -- never a number, unless ``reward.penalty``
    names one -- and the group rule applies as for a failed reward function.  An episode that
    ended without the environment rewarding anything (the token budget, ``max_turns``) scores
    0.0: that is the environment's outcome, not a failure.  Every rank scores the same gathered
    trajectories, so nothing is broadcast."""

    def __init__(self, reward_cfg, tok, counters: Counter, quarantine_path: str, rank0: bool, env_name: str):
        self.cfg, self.tok, self.counters, self.quarantine_path, self.rank0 = reward_cfg, tok, counters, quarantine_path, rank0
        self.version = f"env:{env_name}"

    def score(self, samples: List[Sample]) -> None:
        records = []
        for s in samples:
            t = s.episode
            if t is None:
                raise ValueError(f"{s.sample_id}: the agent's scorer got a sample without its episode")
            if t.env_status != "ok":
                records.append(RewardRecord(total=None, scorer_version=self.version, status=RewardStatus(t.env_status),
                                            error=f"environment: {t.env_error or t.env_status}"))
                self.counters[f"env_{t.env_status}"] += 1
                continue
            comps = dict(t.reward_components)
            if len(s.response_ids) != len(t.response_ids):
                raise ValueError(f"{s.sample_id}: {len(s.response_ids)} response tokens, its episode has "
                                 f"{len(t.response_ids)}: the turns' reward spans would point elsewhere")
            spans = t.turn_spans()
            records.append(RewardRecord(total=float(sum(comps.values())), components=comps,
                                        scorer_version=self.version, applies_to=tuple(spans) if spans else None))
        record_scores(samples, records, self.cfg, self.tok, self.counters, self.quarantine_path, self.rank0)
