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

    from megarl.data.tiny_tokenizer import build_tiny_tokenizer
    from megarl.rollout.sglang_backend import SGLangRolloutEngine
    from tests._standins import HFActorStandIn, tiny_llama_config
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
        engine = SGLangRolloutEngine(model_dir, device="cpu", eos_token_ids=[3])
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


def test_training_with_an_agent_is_refused_until_it_is_wired(tmp_path):
    """A configured agent is never silently ignored by megarl.train: one error line, exit 2,
    nothing built or written."""
    import subprocess
    import sys

    from tests._dist import subprocess_env

    env = subprocess_env()
    env["MEGARL_CACHE"] = str(tmp_path / "cache")
    p = subprocess.run([sys.executable, "-m", "megarl.train", "--config", "configs/grpo_arith_tiny.yaml",
                        "rollout.agent.env=calculator", f"trainer.run_dir={tmp_path / 'run'}"],
                       capture_output=True, text=True, env=env, timeout=120)
    assert p.returncode == 2 and "error: rollout.agent.env" in p.stderr, p.stderr
    assert not (tmp_path / "cache").exists() and not (tmp_path / "run").exists()
