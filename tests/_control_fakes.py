"""Fakes shared by the phase-component unit tests (tests/test_control_*.py): versions, a state
machine driven to a phase, a tiny config, prompt records, a fake rollout engine meeting the
RolloutEngine protocol's generate() contract, a fake scorer, and a hand-built sealed batch.
Test helpers, not part of the ``megarl`` package; nothing here loads a model."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch

from megarl.control.interfaces import Sample
from megarl.control.state_machine import (
    ExportEvidence,
    IterationStateMachine,
    RolloutActivation,
    SealEvidence,
)
from megarl.data.prompts import PromptRecord
from megarl.experience.groups import candidate_of, candidate_sample_id
from megarl.experience.schema import (
    DerivedTensors,
    ExperienceBatch,
    ExperienceFacts,
    FinishReason,
    LogProbProducer,
    LogProbs,
    RewardRecord,
    RewardStatus,
    SamplingConfig,
)
from megarl.hashing import json_sha256
from megarl.rollout.protocol import GenerationResult, RolloutError, candidate_seed
from megarl.versions import PolicyVersion

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GRPO_RECIPE = os.path.join(ROOT, "configs", "grpo_arith_tiny.yaml")
SCORER = "fake-scorer/1"
EOS = 3


def H(s) -> str:
    return json_sha256({"x": s})


def version(step: int = 0, weights: str = "w0", run_id: str = "run", attempt: int = 0) -> PolicyVersion:
    return PolicyVersion(run_id, step, attempt, H(weights), H("tok"), H("cfg"))


def load_cfg(*overrides: str):
    """The tiny GRPO recipe with overrides (reads the YAML only, no model, no data file)."""
    from megarl.config import load_config

    return load_config(GRPO_RECIPE, list(overrides))


# ---- the state machine, driven to a phase ------------------------------------------------------


def sm_ready(v: PolicyVersion, groups: int = 1) -> IterationStateMachine:
    """ROLLOUT_READY(v)."""
    sm = IterationStateMachine(v)
    sm.begin_export()
    sm.begin_rollout_loading(ExportEvidence(v.weight_manifest_hash))
    sm.mark_rollout_ready([RolloutActivation(v.short_id, v.weight_manifest_hash, True, True)] * groups, groups)
    return sm


def sm_generating(v: PolicyVersion) -> IterationStateMachine:
    sm = sm_ready(v)
    sm.begin_generating([v.short_id])
    return sm


def sm_sealed(v: PolicyVersion, batch_size: int, groups: int) -> IterationStateMachine:
    sm = sm_generating(v)
    sm.seal_experience(SealEvidence(batch_size, batch_size, groups, groups, frozenset({v.short_id})))
    return sm


def phases(sm: IterationStateMachine) -> list:
    return [s.phase.value for s in sm.history]


# ---- prompts and rewards ------------------------------------------------------------------------


def prompt_records(n: int, **ground_truth) -> list:
    return [PromptRecord(prompt_id=f"q{i}", prompt_ids=(1, 10 + i, 2), text=f"question {i}", messages=None,
                         ground_truth={"answer": str(i), **ground_truth}) for i in range(n)]


@dataclass
class Dataset:
    records: list
    stats: dict = field(default_factory=dict)


def ok_record(total: float, **components) -> RewardRecord:
    return RewardRecord(total=float(total), components=components or {"acc": float(total)}, scorer_version=SCORER)


def failed_record(status: str = "error", error: str = "ValueError: scorer crashed") -> RewardRecord:
    return RewardRecord(total=None, scorer_version=SCORER, status=RewardStatus(status), error=error)


class FakeScorer:
    """A SampleScorer: ``rule(sample)`` returns a total (float) or a failed RewardRecord.
    Default rule: the candidate index (so every group of G > 1 has a reward spread)."""

    def __init__(self, rule=None):
        self.rule = rule or (lambda s: float(candidate_of(s.sample_id)))
        self.scored: list = []  # sample ids, in call order

    def score(self, samples):
        for s in samples:
            self.scored.append(s.sample_id)
            out = self.rule(s)
            s.record = out if isinstance(out, RewardRecord) else ok_record(out)


# ---- a rollout engine ---------------------------------------------------------------------------


def fake_response(seed: int) -> tuple:
    """The response a candidate's seed determines: 1-3 tokens, ending on EOS."""
    n = 1 + seed % 3
    return tuple(5 + (seed >> (4 * i)) % 7 for i in range(n - 1)) + (EOS,)


def fake_log_probs(response: tuple) -> torch.Tensor:
    return -0.1 * torch.arange(1, len(response) + 1, dtype=torch.float32)


class FakeRolloutEngine:
    """Answers every requested candidate on the version it serves, like the hf backend: the
    candidate's seed is ``candidate_seed(sampling.seed, request_id, c)`` (greedy: the prompt
    decides), the response a function of it, the request's attempt echoed.

    Faults, keyed by ``(sample_id, attempt)`` (sample id ``<request_id>/cCC``):
    ``lose`` -- the result is withheld and delivered late, with the next call's results
    (as :class:`megarl.rollout.faulty.FaultyRolloutEngine` does); ``duplicate`` -- delivered twice;
    ``abort`` -- finish reason ABORT.  ``fail_calls``: call numbers (0-based) that raise a
    RolloutError.  ``extra_late``: results appended to the first call's output.
    ``on_call(i, engine)``: a hook run at the start of call i."""

    log_prob_spaces = frozenset({"raw"})
    dtype = None
    device = torch.device("cpu")

    def __init__(self, version_id: str, *, lose=(), duplicate=(), abort=(), fail_calls=(), extra_late=(),
                 on_call=None):
        self.version_id = version_id
        self.lose, self.duplicate, self.abort = set(lose), set(duplicate), set(abort)
        self.fail_calls, self.on_call = set(fail_calls), on_call
        self.calls: list = []  # (requests, sampling) per call
        self._late = list(extra_late)

    def staging_target(self, name):
        return None

    def result(self, request_id, c, prompt_ids, sampling, attempt=0, version_id=None):
        seed = None if sampling.greedy else candidate_seed(sampling.seed, request_id, c)
        resp = fake_response(seed if seed is not None else sum(prompt_ids))
        finish = FinishReason.ABORT if (candidate_sample_id(request_id, c), attempt) in self.abort else FinishReason.EOS
        return GenerationResult(request_id, c, tuple(prompt_ids), resp, finish, fake_log_probs(resp), None,
                                version_id or self.version_id, seed=seed, attempt=attempt)

    def generate(self, requests, sampling):
        i = len(self.calls)
        self.calls.append((list(requests), sampling))
        if self.on_call is not None:
            self.on_call(i, self)
        late, self._late = self._late, []
        if i in self.fail_calls:
            self._late = late
            raise RolloutError("worker died")
        out = []
        for q in requests:
            for c in q.candidates(sampling.n):
                r = self.result(q.request_id, c, q.prompt_ids, sampling, q.attempt)
                key = (candidate_sample_id(q.request_id, c), q.attempt)
                if key in self.lose:
                    self._late.append(r)
                    continue
                out.append(r)
                if key in self.duplicate:
                    out.append(r)
        return out + late


# ---- samples and a sealed batch, built by hand ------------------------------------------------


def make_samples(v: PolicyVersion, rewards_by_group, *, run_id="run", k=0, versions=None) -> list:
    """One Sample per reward, group j holding ``rewards_by_group[j]``; responses of 1-3 tokens."""
    samples, i = [], 0
    for j, rewards in enumerate(rewards_by_group):
        gid = f"{run_id}/it{k}/r0/p{j:03d}"
        for c, total in enumerate(rewards):
            resp = tuple(range(5, 5 + 1 + (i % 3)))
            samples.append(Sample(prompt_id=f"q{j}", group_id=gid, sample_id=candidate_sample_id(gid, c), request_id=gid,
                                  prompt_ids=(1,) * (1 + j % 2) + (10 + j, 2), response_ids=resp,
                                  raw_log_probs=-0.05 * torch.arange(1, len(resp) + 1, dtype=torch.float32) - 0.01 * i,
                                  finish_reason=FinishReason.EOS,
                                  policy_version=(versions[i] if versions else v.short_id), seed=1000 + i,
                                  record=total if isinstance(total, RewardRecord) else ok_record(total),
                                  prompt=None))
            i += 1
    return samples


def sealed_batch(v: PolicyVersion, rewards_by_group, *, run_id="run", k=0, ref_shift=0.02,
                 advantages=None) -> ExperienceBatch:
    """A sealed GRPO batch with derived tensors (advantages: the reward by default)."""
    from megarl.control.batch import collate
    from megarl.experience.seal import seal, with_derived

    s = make_samples(v, rewards_by_group, run_id=run_id, k=k)
    c = collate([x.prompt_ids for x in s], [x.response_ids for x in s], [x.raw_log_probs for x in s], pad_id=0)
    facts = ExperienceFacts(
        run_id=run_id, iteration=k, prompt_id=tuple(x.prompt_id for x in s), group_id=tuple(x.group_id for x in s),
        sample_id=tuple(x.sample_id for x in s), prompt_ids=c.prompt_ids, response_ids=c.response_ids,
        attention_mask=c.attention_mask, response_mask=c.response_mask,
        finish_reason=tuple(x.finish_reason for x in s), policy_version=tuple(x.policy_version for x in s),
        sampling=SamplingConfig(n=len(rewards_by_group[0]), max_new_tokens=6),
        request_id=tuple(x.request_id for x in s), seed=tuple(x.seed for x in s),
        rewards=tuple(x.record for x in s),
        rollout_log_probs=LogProbs(c.rollout_log_probs, LogProbProducer("rollout", v.short_id)),
        old_log_probs=LogProbs(c.rollout_log_probs.clone(), LogProbProducer("actor", v.short_id)),
        ref_log_probs=LogProbs((c.rollout_log_probs + ref_shift) * c.response_mask,
                               LogProbProducer("reference", "ref-0")))
    adv = advantages if advantages is not None else (facts.scores().float()[:, None] * c.response_mask)
    derived = DerivedTensors(advantages=adv.float(), loss_mask=c.response_mask.clone(), estimator="grpo",
                             hyperparameters={"note": "hand-built"})
    return with_derived(seal(ExperienceBatch(facts)), derived)

