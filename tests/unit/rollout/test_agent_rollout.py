"""Multi-turn rollouts as token-in / token-out sessions (megarl/rollout/agent.py) on the real hf
engine serving the tiny model, with real environments and the tiny chat template.

The per-sample audit: every policy token is the engine's sampled id with its raw log-prob and
version, every environment token is what the template rendered, nothing decoded is ever encoded
again, and the next turn continues from the token ids; failing environments are statuses."""

from __future__ import annotations

import time

import pytest
import torch

from megarl.data.tokenizer import TokenizerContract
from megarl.envs.protocol import Message, StepOutcome
from megarl.envs.render import EnvTurnRenderer
from megarl.experience.schema import FinishReason
from megarl.rollout.agent import ENVIRONMENT, POLICY, AgentLimits, agent_metrics, audit, run_agent_rollouts
from megarl.rollout.hf_backend import HFRolloutEngine
from megarl.rollout.protocol import SamplingParams
from megarl.rollout.weight_stream import TensorManifest, hf_logical_tensors, iter_buckets
from megarl.versions import PolicyVersion
from tests._tolerance import NET_FP32_LOGPROB, max_abs_diff, within


class CountingEnv:
    """Answers every action with a tool message; ends the episode at the row's ``stop_after``-th
    step with reward component ``steps``."""

    def reset(self, row):
        self.row, self.n = row, 0
        return ()

    def step(self, action):
        self.n += 1
        if self.n >= self.row["stop_after"]:
            return StepOutcome((), {"steps": float(self.n)}, terminated=True, truncated=False)
        return StepOutcome((Message("tool", f"result {self.n}"),), {}, terminated=False, truncated=False)


class BrokenEnv(CountingEnv):
    def step(self, action):
        mode = self.row["mode"]
        if mode == "raise":
            raise RuntimeError("the tool crashed")
        if mode == "hang":
            time.sleep(5)
        if mode == "garbage":
            return {"observation": "not a StepOutcome"}
        return super().step(action)


@pytest.fixture(scope="module")
def setup(assets):
    from transformers import AutoModelForCausalLM

    contract = TokenizerContract.from_pretrained(assets["model"])
    src = AutoModelForCausalLM.from_pretrained(assets["model"], dtype=torch.float32)
    tensors = list(hf_logical_tensors(src))
    manifest = TensorManifest.from_named_tensors(tensors)
    version = PolicyVersion(run_id="agent", optimizer_step=3, update_attempt=0, weight_manifest_hash=manifest.global_hash,
                            tokenizer_hash=contract.hash, model_config_hash="sha256:" + "1" * 64)
    engine = HFRolloutEngine(assets["model"], dtype=torch.float32)
    engine.load_weights(version, iter_buckets(iter(tensors), 1 << 20), manifest)
    engine.activate(version)
    return contract, engine, version


def prompts(contract, n=3):
    return [(f"q{i}", tuple(contract.encode_prompt([{"role": "user", "content": f"what is {i} + {i + 1} ?"}])))
            for i in range(n)]


def run(setup, env, rows, *, n=2, max_turns=3, max_total=60, max_new=8, seed=1, timeout=2.0, n_prompts=3,
        decode=None):
    contract, engine, _ = setup
    renderer = EnvTurnRenderer(contract)
    tok = contract.tokenizer
    return run_agent_rollouts(engine, prompts(contract, n_prompts), rows, env, renderer,
                              SamplingParams(temperature=1.0, max_new_tokens=max_new, n=n, seed=seed),
                              AgentLimits(max_turns=max_turns, max_total_tokens=max_total),
                              decode=decode or (lambda ids: tok.decode(ids)), step_timeout_s=timeout, max_workers=4)


def test_trajectories_keep_sampled_tokens_and_render_environment_output_once(setup, monkeypatch):
    contract, engine, version = setup
    renderer = EnvTurnRenderer(contract)
    tok = contract.tokenizer
    decoded, encoded = [], []
    real_encode, real_decode = tok.encode, tok.decode

    def spy_encode(text, *a, **k):
        encoded.append(text)
        return real_encode(text, *a, **k)

    def spy_decode(ids, *a, **k):
        out = real_decode(ids, *a, **k)
        decoded.append(out)
        return out

    monkeypatch.setattr(tok, "encode", spy_encode)
    rows = [{"stop_after": 1}, {"stop_after": 2}, {"stop_after": 9}]
    trajs = run(setup, CountingEnv, rows, decode=spy_decode)
    assert len(trajs) == 6 and [t.request_id for t in trajs] == ["q0", "q0", "q1", "q1", "q2", "q2"]
    for t in trajs:
        assert audit(t) == [], audit(t)
        # the next turn was fed exactly the trajectory so far, as token ids
        for k, res in enumerate(t.generated):
            start = sum(len(g.response_ids) for g in t.generated[:k]) + sum(len(r) for r in t.rendered[:k])
            assert res.prompt_ids == t.prompt_ids + tuple(t.response_ids[:start])
        # environment tokens: loss mask 0 (source), no version; policy tokens: the engine's version
        assert {v for v, s in zip(t.token_versions, t.source) if s == POLICY} <= {version.short_id}
        assert all(v is None for v, s in zip(t.token_versions, t.source) if s == ENVIRONMENT)
        # each rendering is the renderer's output for that step's messages, computed once
        for k, ids in enumerate(t.rendered):
            assert ids == tuple(renderer.render([Message("tool", f"result {k + 1}")]))
    # zero re-tokenization: no decoded action text was ever encoded
    assert decoded and not (set(decoded) & set(encoded)), set(decoded) & set(encoded)
    by = {(t.request_id, t.candidate_index): t for t in trajs}
    # row 0 ends at its first step, row 1 at its second; row 2 never ends: max_turns, its third
    # tool result counted but never shown (nothing follows the last policy turn)
    for c in (0, 1):
        t0, t1, t2 = by[("q0", c)], by[("q1", c)], by[("q2", c)]
        assert t0.finish_reason is FinishReason.ENVIRONMENT and t0.turns == 1 and t0.rendered == []
        assert t0.reward_components == {"steps": 1.0}
        assert t1.finish_reason is FinishReason.ENVIRONMENT and t1.turns == 2 and len(t1.rendered) == 1
        assert t1.tool_calls == 1 and t1.reward_components == {"steps": 2.0}
        assert t2.finish_reason is FinishReason.MAX_TURNS and t2.turns == 3 and len(t2.rendered) == 2
        assert t2.tool_calls == 3 and t2.reward_components == {} and t2.source[-1] == POLICY
    m = agent_metrics(trajs)
    assert 0 < m["rollout/agent/env_token_share"] < 1 and m["rollout/agent/env_errors"] == 0


def test_trajectories_are_reproducible_and_independent_of_the_batch(setup):
    rows = [{"stop_after": 3}] * 3
    a = run(setup, CountingEnv, rows)
    b = run(setup, CountingEnv, rows[:1], n_prompts=1)
    assert [x.response_ids for x in a[:2]] == [x.response_ids for x in b]
    again = run(setup, CountingEnv, rows)
    assert [x.response_ids for x in a] == [x.response_ids for x in again]
    other = run(setup, CountingEnv, rows, seed=2)
    assert [x.response_ids for x in a] != [x.response_ids for x in other]


def test_token_budget_ends_a_trajectory_with_length(setup):
    trajs = run(setup, CountingEnv, [{"stop_after": 99}] * 3, max_turns=50, max_total=20)
    for t in trajs:
        assert len(t.response_ids) <= 20 and t.finish_reason is FinishReason.LENGTH and audit(t) == []


@pytest.mark.parametrize("mode,status", [("raise", "error"), ("hang", "timeout"), ("garbage", "invalid")])
def test_a_failing_environment_is_a_status_never_a_reward(setup, mode, status):
    rows = [{"stop_after": 5, "mode": "ok"}, {"stop_after": 5, "mode": mode}, {"stop_after": 5, "mode": "ok"}]
    t0 = time.perf_counter()
    trajs = run(setup, BrokenEnv, rows, timeout=0.5)
    assert time.perf_counter() - t0 < 30
    for t in trajs:
        if t.request_id == "q1":
            assert t.env_status == status and t.env_error and t.reward_components == {}, (t.env_status, t.env_error)
        else:
            assert t.env_status == "ok"
    key = {"error": "env_errors", "timeout": "env_timeouts", "invalid": "env_invalid"}[status]
    assert agent_metrics(trajs)[f"rollout/agent/{key}"] == 2.0  # both candidates of the row


def test_sglang_sessions_continue_from_input_ids(tmp_path, monkeypatch):
    """The SGLang backend (against the fake built from a recorded release) takes each turn as
    ``input_ids`` -- the whole trajectory so far, never text -- so its prefix cache is reused."""
    import os

    from megarl.builtin.tiny_tokenizer import build_tiny_tokenizer
    from megarl.rollout.sglang_backend import SGLangRolloutEngine
    from megarl.builtin.hf_actor import HFActorStandIn, tiny_llama_config
    from tests.sglang_fake import FakeSGLang, load_description, recorded_versions

    environ = dict(os.environ)
    fake = FakeSGLang(load_description(recorded_versions()[-1])).install(monkeypatch)
    try:
        tok_dir = tmp_path / "tok"
        tok = build_tiny_tokenizer(tok_dir)
        contract = TokenizerContract.from_pretrained(str(tok_dir))
        config = tiny_llama_config(vocab_size=len(tok), eos_token_id=3)
        actor = HFActorStandIn.create(config, dtype=torch.bfloat16)
        model_dir = actor.export_config(tmp_path / "model")
        engine = SGLangRolloutEngine(model_dir, device="cpu", eos_token_ids=[3], verify_writes="never")  # a fake
        version, manifest = actor.commit(0)
        engine.load_weights(version, iter_buckets(actor.named_tensors(), 1 << 20), manifest)
        engine.activate(version)
        trajs = run_agent_rollouts(
            engine, prompts(contract, 2), [{"stop_after": 3}] * 2, CountingEnv, EnvTurnRenderer(contract),
            SamplingParams(temperature=1.0, max_new_tokens=4, n=2, seed=1), AgentLimits(max_turns=3, max_total_tokens=40),
            decode=lambda ids: " ".join(map(str, ids)), step_timeout_s=2.0, max_workers=2)
        fed = [p for name, args in fake.engine.calls if name == "generate" for p in args["input_ids"]]
        want = [list(res.prompt_ids) for t in trajs for res in t.generated]
        assert sorted(fed) == sorted(want) and all(isinstance(t, int) for p in fed for t in p)
        assert any(len(t.generated) >= 2 for t in trajs)  # some trajectory did continue
        for t in trajs:
            assert audit(t) == []
            for k in range(1, len(t.generated)):  # every later turn extends the previous input
                prev, cur = t.generated[k - 1], t.generated[k]
                assert cur.prompt_ids[:len(prev.prompt_ids) + len(prev.response_ids)] == prev.prompt_ids + prev.response_ids
    finally:
        os.environ.clear()
        os.environ.update(environ)


def test_sealed_record_of_an_agent_run_is_the_engines_output(setup):
    """The per-sample audit on the sealed experience: zero environment tokens with loss mask 1,
    zero sampled ids or log-probs that differ from the engine's raw outputs, every policy token
    labelled with the version that generated it."""
    from megarl.control.batch import collate_trajectories
    from megarl.experience.schema import ExperienceBatch, ExperienceFacts, LogProbProducer, LogProbs, RewardRecord, SamplingConfig
    from megarl.experience.seal import seal

    _, _, version = setup
    trajs = run(setup, CountingEnv, [{"stop_after": 2}, {"stop_after": 3}, {"stop_after": 9}])
    c = collate_trajectories([t.prompt_ids for t in trajs], [t.response_ids for t in trajs],
                             [t.log_probs_tensor() for t in trajs], [t.source for t in trajs],
                             [t.turn for t in trajs], [t.token_versions for t in trajs], pad_id=0)
    bs = len(trajs)
    facts = ExperienceFacts(
        run_id="agent", iteration=0, prompt_id=tuple(t.request_id for t in trajs),
        group_id=tuple(t.request_id for t in trajs), sample_id=tuple(f"{t.request_id}/c{t.candidate_index}" for t in trajs),
        prompt_ids=c.prompt_ids, response_ids=c.response_ids, attention_mask=c.attention_mask,
        response_mask=c.response_mask, finish_reason=tuple(t.finish_reason for t in trajs),
        policy_version=tuple(t.policy_version for t in trajs), sampling=SamplingConfig(max_new_tokens=8, n=2),
        request_id=tuple(t.request_id for t in trajs), seed=(None,) * bs,
        rewards=tuple(RewardRecord(total=t.reward_components.get("steps", 0.0), scorer_version="count") for t in trajs),
        rollout_log_probs=LogProbs(c.rollout_log_probs, LogProbProducer("rollout", version.short_id)),
        token_origins=c.token_origins)
    sealed = seal(ExperienceBatch(facts))
    f = sealed.facts
    origins = f.token_origins
    env = origins.environment_mask()
    assert int(env.sum()) > 0 and int((f.response_mask.bool() & env).sum()) == 0
    for b, t in enumerate(trajs):
        real = f.attention_mask[b, f.prompt_ids.shape[1]:].bool()
        resp = f.response_ids[b][real].tolist()
        pol = origins.policy_mask()[b][real]
        sampled = [i for g in t.generated for i in g.response_ids]
        assert [x for x, p in zip(resp, pol.tolist()) if p] == sampled  # ids exactly as generated
        lps = torch.cat([g.raw_log_probs.float() for g in t.generated])
        assert torch.equal(f.rollout_log_probs.values[b][real][pol], lps)
        assert set(origins.token_versions(b)) - {None} == {version.short_id}


class AbortingEngine:
    """The engine's own abort path for the turns of chosen candidates (what a deadline or a weight
    update does to a request in flight): an ``abort`` result with no tokens."""

    def __init__(self, engine, abort_prefixes):
        self.engine, self.abort_prefixes = engine, tuple(abort_prefixes)

    def generate(self, requests, sampling):
        from megarl.rollout.protocol import GenerationResult

        out = []
        for r in self.engine.generate(requests, sampling):
            if r.request_id.startswith(self.abort_prefixes):
                r = GenerationResult(request_id=r.request_id, candidate_index=r.candidate_index, prompt_ids=r.prompt_ids,
                                     response_ids=(), finish_reason=FinishReason.ABORT, raw_log_probs=torch.zeros(0),
                                     processed_log_probs=None, policy_version=r.policy_version, attempt=r.attempt)
            out.append(r)
        return out

    @property
    def active_version(self):
        return self.engine.active_version


def agent_engine(setup, engine=None, env=CountingEnv):
    from megarl.rollout.agent import AgentSessionEngine

    contract, base, _ = setup
    return AgentSessionEngine(engine or base, env_factory=env, renderer=EnvTurnRenderer(contract),
                              limits=AgentLimits(max_turns=3, max_total_tokens=60),
                              decode=lambda ids: contract.decode(ids, skip_special_tokens=True), step_timeout_s=2.0,
                              max_workers=4)


def test_the_agent_engine_answers_each_candidate_with_its_episode(setup):
    """An agent session behind the engine protocol: one result per candidate, carrying its whole
    trajectory; a regeneration of some candidates (a later attempt) reproduces exactly their
    trajectories and echoes the attempt; an aborted turn aborts the candidate (no tokens, the
    served version), and its regeneration equals an undisturbed run."""
    from megarl.rollout.protocol import GenerationRequest

    contract, _, version = setup
    sp = SamplingParams(temperature=1.0, max_new_tokens=8, n=2, seed=3)
    reqs = [GenerationRequest(rid, ids, task={"stop_after": k + 1}) for k, (rid, ids) in enumerate(prompts(contract))]
    full = agent_engine(setup).generate(reqs, sp)
    assert [(r.request_id, r.candidate_index) for r in full] == [(q.request_id, c) for q in reqs for c in (0, 1)]
    for r in full:
        t = r.episode
        assert audit(t) == [] and r.response_ids == tuple(t.response_ids) and r.prompt_ids == t.prompt_ids
        assert r.finish_reason is t.finish_reason is FinishReason.ENVIRONMENT and r.policy_version == version.short_id
        assert torch.equal(r.raw_log_probs, t.log_probs_tensor()) and r.seed == t.generated[0].seed
    assert [r.episode.turns for r in full] == [1, 1, 2, 2, 3, 3]
    again = agent_engine(setup).generate([GenerationRequest(reqs[2].request_id, reqs[2].prompt_ids, candidate_indices=(1,),
                                                            attempt=1, task=reqs[2].task)], sp)
    assert len(again) == 1 and again[0].attempt == 1 and again[0].candidate_index == 1
    # the same ids; log-probs to fp32 batch-composition noise: one engine, another batch of rows,
    # so the GEMMs see other shapes (tests/_tolerance.py)
    assert again[0].response_ids == full[5].response_ids
    err = max_abs_diff(again[0].raw_log_probs, full[5].raw_log_probs)
    assert within(err, NET_FP32_LOGPROB, "agent_rollout/regenerated_vs_batch"), err
    # the third turn of q2/c0 is aborted: that candidate only is answered abort, without tokens
    aborting = agent_engine(setup, AbortingEngine(setup[1], ["q2/c0/t2"])).generate(reqs, sp)
    by = {(r.request_id, r.candidate_index): r for r in aborting}
    ab = by[("q2", 0)]
    assert ab.finish_reason is FinishReason.ABORT and ab.response_ids == () and ab.policy_version == version.short_id
    for r in full:
        if (r.request_id, r.candidate_index) != ("q2", 0):
            assert by[(r.request_id, r.candidate_index)].response_ids == r.response_ids


def test_episodes_are_scored_by_their_environment_and_failures_stay_statuses(setup, tmp_path):
    """EpisodeScorer: the reward is the sum of the environment's components; an environment that
    raised, hung or returned garbage is that status with its reason (counted, quarantined),
    never a number -- unless reward.penalty names one."""
    import json
    from collections import Counter

    from megarl.config import TrainConfig
    from megarl.control.interfaces import Sample
    from megarl.control.scoring import EpisodeScorer
    from megarl.experience.schema import RewardStatus
    from megarl.rollout.protocol import GenerationRequest

    contract = setup[0]
    modes = ["ok", "raise", "garbage"]
    reqs = [GenerationRequest(rid, ids, task={"stop_after": 2, "mode": m})
            for (rid, ids), m in zip(prompts(contract), modes)]
    results = agent_engine(setup, env=BrokenEnv).generate(reqs, SamplingParams(temperature=1.0, max_new_tokens=8,
                                                                              n=2, seed=3))

    def samples():
        return [Sample(prompt_id=r.request_id, group_id=r.request_id, sample_id=f"{r.request_id}/c{r.candidate_index}",
                       request_id=r.request_id, prompt_ids=r.prompt_ids, response_ids=r.response_ids,
                       raw_log_probs=r.raw_log_probs, finish_reason=r.finish_reason, policy_version=r.policy_version,
                       seed=r.seed, episode=r.episode) for r in results]

    cfg = TrainConfig().reward
    cfg.on_failure = "quarantine"
    counters: Counter = Counter()
    quarantine = tmp_path / "q.jsonl"
    ss = samples()
    EpisodeScorer(cfg, contract, counters, str(quarantine), True, env_name="broken").score(ss)
    got = [(s.record.status.value, s.record.total) for s in ss]
    assert got == [("ok", 2.0)] * 2 + [("error", None)] * 2 + [("invalid", None)] * 2, got
    assert ss[0].record.components == {"steps": 2.0} and ss[0].record.scorer_version == "env:broken"
    assert "the tool crashed" in ss[2].record.error and ss[2].finish_reason is FinishReason.ENV_TRUNCATED
    assert counters["reward_failures"] == 4 and counters["env_error"] == 2 and counters["env_invalid"] == 2
    lines = [json.loads(x) for x in quarantine.read_text().splitlines()]
    assert [x["reward"]["status"] for x in lines] == ["error", "error", "invalid", "invalid"]
    cfg.penalty = {"error": -1.0}
    ss = samples()
    EpisodeScorer(cfg, contract, Counter(), str(quarantine), True, env_name="broken").score(ss)
    assert [s.record.total for s in ss[2:4]] == [-1.0, -1.0] and ss[4].record.status is RewardStatus.INVALID


def test_agent_training_refuses_what_would_score_the_trajectory_as_one_response():
    """With rollout.agent.env the environment scores each episode: a reward function, a reward
    model, the overlong punishment or routing replay named next to it is one error naming the key."""
    from megarl.commands.run_checks import check_run
    from megarl.config import ConfigError, load_config

    base = ["rollout.agent.env=calculator"]
    cases = [([], "reward.fn"), (["reward.fn=null", "reward.overlong_buffer=2"], "reward.overlong_buffer"),
             (["reward.fn=null", "algo.routing_replay=rollout"], "algo.routing_replay")]
    for extra, key in cases:
        cfg = load_config("configs/grpo_arith_tiny.yaml", base + extra)
        with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
            check_run(cfg, 1)
    check_run(load_config("configs/grpo_arith_tiny.yaml", base + ["reward.fn=null"]), 1)


def test_sample_logs_show_the_environment_output_between_marks(setup):
    from megarl.observability.sample_log import _trajectory_text

    contract = setup[0]
    enc = lambda text: contract.tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
    call, result, answer = enc("[ 1 2 + 3 4 ]"), enc("4 6"), enc("4 6")
    ids = torch.tensor(call + result + answer + [0, 0])
    source = torch.tensor([1] * len(call) + [2] * len(result) + [1] * len(answer) + [0, 0])
    assert _trajectory_text(contract, ids, source) == "[ 1 2 + 3 4 ] << 4 6 >> 4 6"
