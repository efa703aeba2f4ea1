"""ExperiencePreparer on its own: fake actor and reference roles (their log-probs are known
tensors), a fake engine time slice, a real state machine and the real collate / seal /
advantage code.  The data-parallel helpers run at DP=1 (``dp_size``/``dp_rank`` stubbed: no
megatron parallel state is needed for one replica)."""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch

from megarl.algo.kl import FixedKLController
from megarl.control.batch import collate
from megarl.control.interfaces import ProducedRollout, RunProgress
from megarl.control.preparation import ExperiencePreparer, LogProbParity, RolloutParityError
from megarl.control.state_machine import CompletionConditionError, Phase
from megarl.experience.schema import SamplingConfig
from megarl.experience.seal import load_sealed
from megarl.experience.staleness import StalenessError
from megarl.observability.metrics import StageTimer
from megarl.runtime import data_parallel
from tests._control_fakes import load_cfg, make_samples, phases, sm_generating, version
from tests._tolerance import formula_tol

#: GRPO advantages of groups of <= 3 rewards in {0, 1}, computed in float32 (a mean, a Bessel
#: std, a division) against Python floats: <= 12 dependent operations on magnitudes summing to
#: <= 6: twice the first-order rounding bound (tests/_tolerance.py), ~8.6e-6; a missed Bessel
#: correction alone moves them by > 0.1
ADV_TOL = formula_tol(torch.float32, ops=12, scale=6.0)

REWARDS = [[1.0, 0.0, 0.0], [1.0, 1.0, 0.0], [1.0, 1.0, 1.0]]


@pytest.fixture(autouse=True)
def one_replica(monkeypatch):
    monkeypatch.setattr(data_parallel, "dp_size", lambda: 1)
    monkeypatch.setattr(data_parallel, "dp_rank", lambda: 0)


class FakeLogProbRole:
    """log_probs(...) -> the rollout's log-probs plus ``shift`` on every response token."""

    def __init__(self, truth, mask, shift, version="ref-0"):
        self.truth, self.mask, self.shift, self.version = truth, mask, shift, version
        self.calls = Counter()
        self.routings = []  # the MoE routing each call was given (None: the router's own)

    def log_probs(self, prompt_ids, response_ids, attention_mask, mbs, pack=False, routing=None, micro_batch_tokens=0):
        self.calls["log_probs"] += 1
        self.routings.append(routing)
        assert prompt_ids.shape[0] == self.truth.shape[0] and mbs == 0 and pack is False and micro_batch_tokens == 0
        return self.truth + self.shift * self.mask

    def batch_log_probs(self, prompt_ids, response_ids, attention_mask, mbs, pack=False, micro_batch_tokens=0):
        """A frozen role's whole-batch forward (one process: the batch is this rank's rows)."""
        return self.log_probs(prompt_ids, response_ids, attention_mask, mbs, pack=pack,
                              micro_batch_tokens=micro_batch_tokens)

    def onload(self):
        self.calls["onload"] += 1


class TimeSlice:
    def __init__(self):
        self.released = 0

    def release(self):
        self.released += 1


def setup(cfg, *, actor_shift=2e-4, rewards=REWARDS, v=None, progress=None, save_dir=None, samples=None,
          real_sizes=None):
    v = v or version(5)
    samples = samples or make_samples(v, rewards, k=7)
    c = collate([s.prompt_ids for s in samples], [s.response_ids for s in samples],
                [s.raw_log_probs for s in samples], 0)
    actor = FakeLogProbRole(c.rollout_log_probs, c.response_mask, actor_shift, version=v.short_id)
    ref = FakeLogProbRole(c.rollout_log_probs, c.response_mask, -0.1)
    sm = sm_generating(v)
    real_sizes = real_sizes or {g: sum(1 for s in samples if s.group_id == g) for g in dict.fromkeys(
        s.group_id for s in samples)}
    produced = ProducedRollout(samples, real_sizes, sampling=SamplingConfig(n=3, max_new_tokens=6))
    prep = ExperiencePreparer(cfg.algo, cfg.async_rl, LogProbParity.of(cfg.rollout), actor=actor, reference=ref,
                              critic=None, time_slice=TimeSlice(), sm=sm,
                              kl_ctl=FixedKLController(0.001), progress=progress or RunProgress(), pad_id=0,
                              run_id="run", save_dir=save_dir)
    return prep, produced, sm, v, c


def cfg_(*over):
    return load_cfg("rollout.n=3", "trainer.prompts_per_iteration=3", "algo.forward_micro_batch_size=0", *over)


def grpo_by_hand(rewards):
    out = []
    for g in rewards:
        mean = sum(g) / len(g)
        std = math.sqrt(sum((x - mean) ** 2 for x in g) / (len(g) - 1))
        out += [0.0 if std <= 1e-6 else (x - mean) / std for x in g]
    return out


def test_sealed_batch_records_v_and_grpo_advantages_equal_the_hand_computation(tmp_path):
    prep, produced, sm, v, c = setup(cfg_("rollout.reuse_rollout_log_probs=false"), save_dir=str(tmp_path))
    batch, m = prep.prepare(7, v, produced, StageTimer(7, v.short_id))
    f = batch.facts
    assert batch.sealed and f.iteration == 7 and f.run_id == "run"
    assert set(f.policy_version) == {v.short_id} and f.batch_size == 9
    assert f.sample_id == tuple(s.sample_id for s in produced.samples)
    assert phases(sm)[-2:] == ["GENERATING", "EXPERIENCE_SEALED"] and sm.state.version == v
    # old log-probs: the actor's, on v, before any update; reference: its own producer
    assert (f.old_log_probs.producer.role, f.old_log_probs.producer.version) == ("actor", v.short_id)
    # bitwise: the fake actor returns exactly this expression, and sealing copies it
    assert torch.equal(f.old_log_probs.values, c.rollout_log_probs + 2e-4 * c.response_mask)
    assert (f.ref_log_probs.producer.role, f.ref_log_probs.producer.version) == ("reference", "ref-0")
    assert (f.rollout_log_probs.producer.role, f.rollout_log_probs.producer.version) == ("rollout", v.short_id)
    assert prep.actor.calls["log_probs"] == 1 and prep.actor.calls["onload"] == 1 and prep.time_slice.released == 1
    # GRPO: (r - mean_g) / std_g (Bessel), 0 for the zero-variance group, on every action token
    want = torch.tensor(grpo_by_hand(REWARDS), dtype=torch.float32)[:, None] * c.response_mask
    assert torch.allclose(batch.derived.advantages, want, rtol=0, atol=ADV_TOL)
    assert torch.equal(batch.derived.loss_mask, c.response_mask)
    assert batch.derived.estimator == "grpo" and batch.derived.returns is None
    assert dict(batch.derived.hyperparameters) == {"gamma": 1.0, "lam": 1.0, "zero_std_rule": "epsilon",
                                                   "std_eps": 1e-6, "kl_beta": 0.001, "whiten": False,
                                                   "kl_placement": "loss"}
    assert m["prep/zero_variance_group_share"] == pytest.approx(1 / 3) and m["prep/adv/zero_std_groups"] == 1
    # measured errors and KL: golden from the fakes' shifts
    assert m["prep/rollout_actor_logprob_max_abs_err"] == pytest.approx(2e-4, rel=1e-3)
    assert m["prep/old_ref_logprob_max_abs_diff"] == pytest.approx(0.1002, rel=1e-4)
    d = -0.1002
    assert m["update/kl_ref"] == pytest.approx(math.expm1(d) - d, rel=1e-3)
    assert m["update/kl_ref_k1"] == pytest.approx(0.1002, rel=1e-3)
    # trainer.save_experience: the sealed batch on disk is this batch
    again = load_sealed(tmp_path / "iter_000007")
    assert again.content_hash == batch.content_hash


def test_rollout_log_probs_are_reused_only_after_a_measured_parity_check():
    progress = RunProgress()
    cfg = cfg_("rollout.reuse_rollout_log_probs=true", "rollout.log_prob_parity_every=2",
               "rollout.log_prob_parity_tol=1e-3")
    prep, produced, _, v, c = setup(cfg, progress=progress)
    b1, m1 = prep.prepare(1, v, produced, StageTimer())
    assert prep.actor.calls["log_probs"] == 1 and progress.parity_checked  # checked: the actor's are used
    assert b1.facts.old_log_probs.producer.role == "actor" and "prep/rollout_actor_logprob_max_abs_err" in m1
    prep2, produced2, _, _, _ = setup(cfg, progress=progress, v=v)
    b2, m2 = prep2.prepare(3, v, produced2, StageTimer())
    assert prep2.actor.calls["log_probs"] == 0  # reused: no actor forward at all
    assert (b2.facts.old_log_probs.producer.role, b2.facts.old_log_probs.producer.version) == ("rollout", v.short_id)
    assert torch.equal(b2.facts.old_log_probs.values, c.rollout_log_probs)
    assert "prep/rollout_actor_logprob_max_abs_err" not in m2
    prep4, produced4, _, _, _ = setup(cfg, progress=progress, v=v)
    prep4.prepare(4, v, produced4, StageTimer())  # k % log_prob_parity_every == 0: measured again
    assert prep4.actor.calls["log_probs"] == 1


def test_a_parity_failure_raises_and_fails_the_state_machine():
    progress = RunProgress()
    cfg = cfg_("rollout.reuse_rollout_log_probs=true", "rollout.log_prob_parity_tol=1e-3")
    prep, produced, sm, v, _ = setup(cfg, actor_shift=0.01, progress=progress)
    with pytest.raises(RolloutParityError) as e:
        prep.prepare(0, v, produced, StageTimer())
    assert "1.000e-02" in str(e.value) and "rollout.log_prob_parity_tol=0.001" in str(e.value)
    assert sm.state.phase is Phase.FAILED and "parity" in sm.state.reason
    assert not progress.parity_checked


def test_an_incomplete_group_is_refused_at_the_seal():
    v = version(5)
    samples = make_samples(v, REWARDS, k=7)
    del samples[4]  # a member of group p001 went missing after its group was released
    real = {"run/it7/r0/p000": 3, "run/it7/r0/p001": 3, "run/it7/r0/p002": 3}
    prep, produced, sm, _, _ = setup(cfg_("rollout.reuse_rollout_log_probs=false"), v=v, samples=samples,
                                     real_sizes=real)
    with pytest.raises(CompletionConditionError, match="8 of 9 samples written"):
        prep.prepare(7, v, produced, StageTimer())
    assert sm.state.phase is Phase.FAILED


def test_a_partial_group_released_with_its_real_size_is_sealed():
    v = version(5)
    samples = make_samples(v, REWARDS, k=7)
    del samples[4]
    real = {"run/it7/r0/p000": 3, "run/it7/r0/p001": 2, "run/it7/r0/p002": 3}
    prep, produced, sm, _, c = setup(cfg_("rollout.reuse_rollout_log_probs=false"), v=v, samples=samples,
                                     real_sizes=real)
    batch, _ = prep.prepare(7, v, produced, StageTimer())
    assert sm.state.phase is Phase.EXPERIENCE_SEALED and batch.facts.batch_size == 8
    want = torch.tensor(grpo_by_hand([[1.0, 0.0, 0.0], [1.0, 0.0], [1.0, 1.0, 1.0]]), dtype=torch.float32)
    assert torch.allclose(batch.derived.advantages, want[:, None] * c.response_mask, rtol=0, atol=ADV_TOL)


def test_a_sample_of_another_version_is_never_sealed():
    v, other = version(5), version(4, "w4")
    versions = [v.short_id] * 8 + [other.short_id]
    samples = make_samples(v, REWARDS, k=7, versions=versions)
    prep, produced, sm, _, _ = setup(cfg_("rollout.reuse_rollout_log_probs=false"), v=v, samples=samples)
    # the record labels its behaviour policy honestly (both versions); the synchronous bound 0 refuses it
    with pytest.raises(StalenessError, match=rf"sample '.*/c02'.*{other.short_id} is 1 steps old, above the bound 0"):
        prep.prepare(7, v, produced, StageTimer())
    assert sm.state.phase is Phase.FAILED


def test_preparation_seals_the_samples_routing(tmp_path, monkeypatch):
    """algo.routing_replay=rollout: each sample's routing lands in the sealed, saved record with
    the version it was generated on; a sample without routing stops the iteration."""
    from megarl.experience.schema import RoutingProducer, SampleRouting, routing_token_mask

    monkeypatch.setattr(data_parallel, "dp_size", lambda: 1)
    monkeypatch.setattr(data_parallel, "dp_rank", lambda: 0)
    v = version(5)
    samples = make_samples(v, REWARDS, k=7)
    for i, s in enumerate(samples):
        g = torch.Generator().manual_seed(i)
        rows = len(s.prompt_ids) + len(s.response_ids) - 1
        s.routed_experts = SampleRouting(torch.rand(rows, 2, 8, generator=g).argsort(-1)[..., :2].to(torch.uint8),
                                         8, (0, 3), "hf")
    prep, produced, sm, v, c = setup(cfg_("algo.routing_replay=rollout"), samples=samples, v=v,
                                     save_dir=str(tmp_path))
    batch, m = prep.prepare(7, v, produced, StageTimer())
    r = batch.facts.routed_experts
    assert r.producer == RoutingProducer("rollout", "hf", v.short_id) and r.moe_layers == (0, 3)
    mask = routing_token_mask(batch.facts.attention_mask)
    assert torch.equal(r.experts[0][mask[0]], samples[0].routed_experts.experts)
    assert m["prep/routing/load_max_over_mean"] >= 1.0
    # the old log-probs replay the sealed routing; the reference routes by itself
    (given,) = prep.actor.routings
    assert given.replay and given.moe_layers == (0, 3) and torch.equal(given.experts, r.experts)
    assert given.real_rows.all() and given.stats is not None and "prep/routing/mismatch_tokens" in m
    assert prep.reference.routings == [None]
    back = load_sealed(tmp_path / "iter_000007")
    assert back.content_hash == batch.content_hash and torch.equal(back.facts.routed_experts.experts, r.experts)

    samples[1].routed_experts = None
    prep, produced, sm, v, c = setup(cfg_("algo.routing_replay=rollout"), samples=samples, v=v)
    with pytest.raises(RuntimeError, match="no routed experts for 1 sample"):
        prep.prepare(7, v, produced, StageTimer())


def test_process_rewards_reach_the_estimator_from_the_sealed_records(tmp_path):
    """algo.advantage=grpo_process: each record's step rewards, placed on their tokens, are what
    the estimator reads (its advantages over the sealed records' step tensors, bitwise), and the
    sealed batch keeps them.  Negative control: the outcome GRPO over the same records differs."""
    from megarl.algo.advantages import AdvantageConfig, AdvantageInputs, grpo_process_advantage
    from megarl.algo.derivation import step_tensors
    from megarl.experience.groups import group_index
    from megarl.experience.schema import RewardRecord

    v = version(5)
    samples = make_samples(v, REWARDS, k=7)
    for i, s in enumerate(samples):  # one step per response token, right on even tokens of odd samples
        n = len(s.response_ids)
        steps = tuple(float((t + i) % 2) for t in range(n))
        s.record = RewardRecord(total=steps[-1], scorer_version="steps/1", step_rewards=steps,
                                step_token_ends=tuple(range(n)))
    prep, produced, sm, v, c = setup(cfg_("algo.advantage=grpo_process"), samples=samples, v=v)
    batch, m = prep.prepare(7, v, produced, StageTimer())
    f = batch.facts
    assert [r.step_rewards for r in f.rewards] == [s.record.step_rewards for s in samples]
    rewards, ends = step_tensors(f.rewards, f.response_mask)
    want = grpo_process_advantage(AdvantageInputs(response_mask=f.response_mask, group_index=group_index(f.group_id)[0],
                                                  step_rewards=rewards, step_token_ends=ends),
                                  AdvantageConfig())
    assert torch.equal(batch.derived.advantages, want.advantages), (batch.derived.advantages, want.advantages)
    assert batch.derived.estimator == "grpo_process" and m["prep/adv/groups"] == 3
    prep, produced, sm, v, c = setup(cfg_(), samples=samples, v=v)
    outcome, _ = prep.prepare(7, v, produced, StageTimer())
    assert not torch.equal(outcome.derived.advantages, batch.derived.advantages)


def test_the_configured_reward_placement_reaches_the_derivation():
    """algo.reward_placement is one of the settings the derived tensors are computed and recorded
    under (tests/unit/experience/test_reward_placement.py: what each placement computes)."""
    for placement in ("last_token", "recorded"):
        prep = setup(cfg_(f"algo.reward_placement={placement}"))[0]
        assert prep.derivation_settings().reward_placement == placement
