"""Scorer on its own: a real RewardRunner over a fake reward function, a fake tokenizer, and
(for the neural reward model) a fake reward-model role.  Records are made on rank 0 and
broadcast; a failure stays a status unless reward.penalty names a number; failed samples are
quarantined on rank 0 with on_failure=quarantine; the runner's counters are carried over."""

from __future__ import annotations

import json
import threading
import time
from collections import Counter

import pytest
import torch

from megarl.config import RewardConfig, RewardModelConfig
from megarl.control import scoring
from megarl.control.scoring import Scorer
from megarl.experience.schema import RewardRecord, RewardStatus
from megarl.rewards.runner import RewardRunner
from tests._control_fakes import make_samples, prompt_records, version


class FakeTok:
    def decode(self, ids, skip_special_tokens=False):
        ids = [i for i in ids if not (skip_special_tokens and i == 3)]
        return " ".join(f"t{i}" for i in ids)


class LengthReward:
    """total = number of decoded response words; raises / says invalid for chosen samples."""

    name, version = "length", "length/1"

    def __init__(self, raise_for=(), invalid_for=(), hang_for=()):
        self.raise_for, self.invalid_for, self.hang_for = set(raise_for), set(invalid_for), set(hang_for)
        self.release = threading.Event()  # a hung call waits for it (the test sets it when done)
        self.seen = []

    def __call__(self, s):
        self.seen.append(s)
        if s.sample_id in self.raise_for:
            raise ValueError("bad answer format")
        if s.sample_id in self.invalid_for:
            return RewardRecord(total=None, scorer_version=self.version, status="invalid", error="unparseable")
        if s.sample_id in self.hang_for:
            self.release.wait(60.0)
        return RewardRecord(total=float(len(s.response_text.split())), components={"len": 1.0},
                            scorer_version=self.version)


def samples(n_groups=1, G=3):
    v = version(2)
    out = make_samples(v, [[0.0] * G] * n_groups)
    recs = prompt_records(n_groups)
    for s in out:
        s.record = None
        s.prompt = recs[int(s.prompt_id[1:])]
    return out


def scorer(reward_fn, tmp_path, *, rank0=True, runner=True, reward_model=None, max_new_tokens=6, shape_overlong=True,
           **reward_kw):
    if "model" in reward_kw:
        reward_kw["model"] = RewardModelConfig(**reward_kw["model"])
    cfg = RewardConfig(**reward_kw)
    run = RewardRunner(reward_fn, timeout_s=10.0, max_retries=1, backoff_s=0.0, max_workers=2) if runner else None
    models = () if reward_model is None else reward_model if isinstance(reward_model, (list, tuple)) else (reward_model,)
    return Scorer(cfg, FakeTok(), run, models, Counter(), str(tmp_path / "quarantine.jsonl"), rank0,
                  max_new_tokens=max_new_tokens, shape_overlong=shape_overlong)


def test_records_are_the_functions_and_it_sees_the_decoded_sample(tmp_path):
    fn = LengthReward()
    sc = scorer(fn, tmp_path)
    ss = samples()
    sc.score(ss)
    assert [s.record.total for s in ss] == [float(len([t for t in s.response_ids if t != 3])) for s in ss]
    assert all(s.record.status is RewardStatus.OK and s.record.scorer_version == "length/1" for s in ss)
    seen = {x.sample_id: x for x in fn.seen}
    s0 = ss[0]
    x = seen[s0.sample_id]
    assert (x.prompt_id, x.group_id, x.prompt_text) == (s0.prompt_id, s0.group_id, "question 0")
    assert x.response_text == FakeTok().decode(s0.response_ids, skip_special_tokens=True)
    assert x.response_ids == tuple(s0.response_ids) and x.finish_reason == "eos"
    assert dict(x.ground_truth) == {"answer": "0"}
    assert sc.counters["reward_failures"] == 0 and not (tmp_path / "quarantine.jsonl").exists()


def test_prompt_text_falls_back_to_the_decoded_prompt(tmp_path):
    fn = LengthReward()
    ss = samples()
    ss[0].prompt = type(ss[0].prompt)(**{**ss[0].prompt.__dict__, "text": None})
    scorer(fn, tmp_path).score(ss[:1])
    assert fn.seen[0].prompt_text == FakeTok().decode(ss[0].prompt_ids, skip_special_tokens=True)


def test_failures_stay_statuses_are_quarantined_and_counted(tmp_path):
    ss = samples()
    err, inv = ss[1].sample_id, ss[2].sample_id
    sc = scorer(LengthReward(raise_for={err}, invalid_for={inv}), tmp_path, on_failure="quarantine")
    sc.score(ss)
    assert ss[0].record.status is RewardStatus.OK
    assert ss[1].record.status is RewardStatus.ERROR and ss[1].record.total is None  # never a silent 0
    assert "ValueError: bad answer format" in ss[1].record.error and "giving up" in ss[1].record.error
    assert ss[2].record.status is RewardStatus.INVALID and ss[2].record.total is None
    c = sc.counters
    assert (c["reward_failures"], c["reward_call_errors"], c["reward_call_retries"]) == (2, 2, 1)
    assert c["reward_call_timeouts"] == 0
    rows = [json.loads(line) for line in (tmp_path / "quarantine.jsonl").read_text().splitlines()]
    assert [r["sample_id"] for r in rows] == [err, inv]
    r = rows[1]
    assert (r["prompt_id"], r["policy_version"], r["response_ids"]) == (ss[2].prompt_id, ss[2].policy_version,
                                                                        list(ss[2].response_ids))
    assert r["response_text"] == FakeTok().decode(ss[2].response_ids)  # special tokens kept for the audit
    assert r["reward"]["status"] == "invalid" and r["reward"]["total"] is None
    sc.score(samples())  # the same failures again: appended, never rewritten; counters cumulative
    assert len((tmp_path / "quarantine.jsonl").read_text().splitlines()) == 4
    assert (sc.counters["reward_failures"], sc.counters["reward_call_errors"]) == (4, 4)


def test_drop_counts_failures_without_a_quarantine_file(tmp_path):
    ss = samples()
    sc = scorer(LengthReward(invalid_for={ss[0].sample_id}), tmp_path, on_failure="drop")
    sc.score(ss)
    assert sc.counters["reward_failures"] == 1 and not (tmp_path / "quarantine.jsonl").exists()


def test_a_penalty_is_applied_only_where_reward_penalty_names_a_number(tmp_path):
    ss = samples()
    err, inv = ss[1].sample_id, ss[2].sample_id
    sc = scorer(LengthReward(raise_for={err}, invalid_for={inv}), tmp_path, on_failure="quarantine",
                penalty={"error": -1.0, "timeout": None, "invalid": None})
    sc.score(ss)
    assert ss[1].record.status is RewardStatus.OK and ss[1].record.total == -1.0
    assert dict(ss[1].record.components) == {"penalty/error": -1.0} and ss[1].record.scorer_version == "length/1"
    assert ss[2].record.status is RewardStatus.INVALID and ss[2].record.total is None  # no number named for it
    assert sc.counters["reward_failures"] == 1
    rows = [json.loads(line) for line in (tmp_path / "quarantine.jsonl").read_text().splitlines()]
    assert [r["sample_id"] for r in rows] == [inv]  # a penalised sample is a score, not a failure


def test_a_timeout_is_a_status_and_counted(tmp_path):
    """The hung call never returns while it is scored (it waits for the test), so its timeout is
    certain; the healthy one returns in microseconds, and its limit of 1 s is a margin of
    orders of magnitude on a loaded machine."""
    ss = samples(G=2)
    fn = LengthReward(hang_for={ss[0].sample_id})
    cfg = RewardConfig(timeout_s=1.0)
    run = RewardRunner(fn, timeout_s=1.0, max_retries=0, backoff_s=0.0, max_workers=2)
    sc = Scorer(cfg, FakeTok(), run, (), Counter(), str(tmp_path / "q.jsonl"), True, max_new_tokens=6)
    try:
        t0 = time.monotonic()
        sc.score(ss)
        waited = time.monotonic() - t0
    finally:
        fn.release.set()
    assert ss[0].record.status is RewardStatus.TIMEOUT and ss[0].record.total is None
    assert "timeout_s=1.0" in ss[0].record.error and waited >= 1.0  # declared at the limit, not before
    assert ss[1].record.status is RewardStatus.OK
    assert (sc.counters["reward_call_timeouts"], sc.counters["reward_failures"]) == (1, 1)


def test_rank0_records_are_broadcast_to_ranks_without_a_runner(tmp_path, monkeypatch):
    """The other ranks run no scorer: they take rank 0's records and counters from the broadcast,
    and only rank 0 writes the quarantine file."""
    sent = []

    def rank0_broadcast(obj, src=0):
        sent.append(json.loads(json.dumps(obj)))  # what travels must be plain JSON-able data
        return obj

    ss0 = samples()
    err = ss0[1].sample_id
    monkeypatch.setattr(scoring, "broadcast_object", rank0_broadcast)
    r0 = scorer(LengthReward(raise_for={err}), tmp_path, on_failure="quarantine")
    r0.score(ss0)
    (payload,) = sent
    monkeypatch.setattr(scoring, "broadcast_object", lambda obj, src=0: payload if obj is None else pytest.fail())
    ss1 = samples()
    r1 = Scorer(RewardConfig(on_failure="quarantine"), FakeTok(), None, (), Counter(),
                str(tmp_path / "rank1.jsonl"), rank0=False, max_new_tokens=6)
    r1.score(ss1)
    assert [s.record for s in ss1] == [s.record for s in ss0]
    assert r1.counters == r0.counters and r1.counters["reward_call_errors"] == 2
    assert not (tmp_path / "rank1.jsonl").exists() and (tmp_path / "quarantine.jsonl").exists()


class FakeRewardModel:
    version = "rm/7"

    def __init__(self, scores):
        self.scores, self.encoded, self.truths = scores, [], []

    def encode(self, messages, prompt_text, response_text, ground_truth=None):
        self.encoded.append((messages, prompt_text, response_text))
        self.truths.append(ground_truth)  # a reference-guided model fills its user turn from it
        return [ord(c) for c in f"{prompt_text} || {response_text}"]  # its own "token ids"

    def score(self, texts):
        assert len(texts) == len(self.scores)
        return torch.tensor(self.scores)


def test_the_reward_model_adds_its_weighted_score_to_ok_records_only(tmp_path):
    ss = samples()
    rm = FakeRewardModel([0.5, 2.0, -1.0])
    sc = scorer(LengthReward(invalid_for={ss[2].sample_id}), tmp_path, reward_model=rm,
                model={"path": "/rm", "weight": 0.25})
    sc.score(ss)
    base0 = float(len([t for t in ss[0].response_ids if t != 3]))
    assert ss[0].record.total == pytest.approx(base0 + 0.25 * 0.5)
    assert dict(ss[0].record.components) == {"len": 1.0, "reward_model": 0.5}
    assert ss[0].record.scorer_version == "length/1+rm/7"
    # what it read is kept: the digest of its own rendering, which the rendering reproduces
    from megarl.roles.reward_model import input_digest
    assert dict(ss[0].record.inputs) == {"reward_model": input_digest(rm.encode(None, *rm.encoded[0][1:]))}
    assert "inputs" in ss[0].record.to_json() and ss[0].record.from_json(ss[0].record.to_json()) == ss[0].record
    assert ss[2].record.status is RewardStatus.INVALID  # the RM never papers over a rule failure
    assert rm.encoded[0][1:] == ("question 0", FakeTok().decode(ss[0].response_ids, skip_special_tokens=True))
    assert dict(rm.truths[0]) == {"answer": "0"}  # the sample's row reaches the model (its reference)


def test_reward_model_alone(tmp_path):
    ss = samples(G=2)
    sc = scorer(None, tmp_path, runner=False, reward_model=FakeRewardModel([1.5, -0.5]), fn=None,
                model={"path": "/rm", "weight": 2.0})
    sc.score(ss)
    assert [s.record.total for s in ss] == [3.0, -1.0]
    assert all(s.record.scorer_version == "rm/7" for s in ss)


def test_dapo_overlong_shaping_lowers_ok_scores_only_and_not_in_evaluation(tmp_path):
    """reward.overlong_buffer L_cache=2 with L_max=max_new_tokens=4: lengths 1, 2 are not
    shaped, length 3 gets (4 - 2 - 3) / 2 = -0.5 as component "overlong"; a failure stays one."""
    ss = samples(G=3)
    assert [len(s.response_ids) for s in ss] == [1, 2, 3]
    sc = scorer(LengthReward(invalid_for={ss[0].sample_id}), tmp_path, max_new_tokens=4, overlong_buffer=2)
    sc.score(ss)
    assert ss[0].record.status is RewardStatus.INVALID and "overlong" not in ss[0].record.components
    base = [float(len([t for t in s.response_ids if t != 3])) for s in ss]
    assert ss[1].record.total == base[1] and ss[1].record.components["overlong"] == 0.0
    assert ss[2].record.total == pytest.approx(base[2] - 0.5) and ss[2].record.components["overlong"] == -0.5
    ev = samples(G=3)
    scorer(LengthReward(), tmp_path, max_new_tokens=4, overlong_buffer=2, shape_overlong=False).score(ev)
    assert [s.record.total for s in ev] == [float(len([t for t in s.response_ids if t != 3])) for s in ev]
    assert all("overlong" not in s.record.components for s in ev)


class FailingRewardModel(FakeRewardModel):
    version = "rm/broken"

    def score(self, texts):
        raise RuntimeError("out of memory")


def test_several_reward_models_are_each_a_named_weighted_component(tmp_path):
    """reward.model and reward.models: each model reads its own rendering, its score is the
    component of its name, the total adds each with its weight; one that fails makes the batch's
    records its status, naming the model -- the others' scores do not stand in for it."""
    ss = samples(G=2)
    first, second = FakeRewardModel([1.0, -1.0]), FakeRewardModel([0.5, 0.25])
    sc = scorer(None, tmp_path, runner=False, reward_model=[first, second], fn=None,
                model={"path": "/rm", "weight": 2.0}, models=[RewardModelConfig(name="style", path="/rm2", weight=-4.0)])
    sc.score(ss)
    assert [dict(s.record.components) for s in ss] == [{"reward_model": 1.0, "style": 0.5},
                                                       {"reward_model": -1.0, "style": 0.25}]
    assert [s.record.total for s in ss] == [2.0 * 1.0 - 4.0 * 0.5, 2.0 * -1.0 - 4.0 * 0.25]
    assert ss[0].record.scorer_version == "rm/7+rm/7" and len(first.encoded) == len(second.encoded) == 2
    ss = samples(G=2)
    sc = scorer(None, tmp_path, runner=False, reward_model=[FakeRewardModel([1.0, -1.0]), FailingRewardModel([0, 0])],
                fn=None, model={"path": "/rm"}, models=[RewardModelConfig(name="style", path="/rm2")])
    sc.score(ss)
    assert all(s.record.status is RewardStatus.ERROR and s.record.total is None for s in ss)
    assert "reward model 'style' (reward.models[0])'s forward failed on rank 0: RuntimeError: out of memory" \
        in ss[0].record.error
    assert sc.counters["reward_model_errors"] == 1
    with pytest.raises(ValueError, match=r"1 reward model role\(s\) for 2 configured"):
        scorer(None, tmp_path, runner=False, reward_model=[first], fn=None, model={"path": "/rm"},
               models=[RewardModelConfig(name="style", path="/rm2")])
