"""The applicable mask of a reward record (``RewardRecord.applies_to``): which response tokens each
part of a reward is for and the action it is received after.  The record's rules, the sealed
record's check against the response, the episode's turn spans, and the estimators that read it
(``algo.reward_placement=recorded`` for GAE / REINFORCE++, ``grpo_process``) against golden
tensors, with the default placement (the total on the last action) as the negative control."""

from __future__ import annotations

import math
import os

import pytest
import torch

from megarl.algo.derivation import DerivationSettings, derive, step_tensors
from megarl.algo.reward_shaping import kl_shaped_token_rewards, place_step_rewards
from megarl.commands.run_checks import check_run
from megarl.config import ConfigError, load_config
from megarl.experience.schema import LogProbProducer, LogProbs, RewardRecord, RewardStatus, ScoreSpan
from megarl.rollout.agent import Trajectory

from tests._dist import ROOT
from tests._agent_record import LOG_PROBS, RESPONSES, SOURCES, TURNS, VERSIONS, agent_facts, inspect_module, trajectories

# trajectory A of test_agent_record: [policy t0, env, env, policy t1, env, policy t2]
A_TURNS = [ScoreSpan(0, 0, 0.25, "turn 0"), ScoreSpan(3, 3, 0.5, "turn 1")]


def two_of_a(records, **over):
    c = trajectories(prompts=[[5]] * 2, responses=[RESPONSES[0]] * 2, raw_log_probs=[torch.tensor(LOG_PROBS[0])] * 2,
                     sources=[SOURCES[0]] * 2, turns=[TURNS[0]] * 2, token_versions=[VERSIONS[0]] * 2)
    return agent_facts(c, sample_id=("s0", "s1"), group_id=("g",) * 2, rewards=tuple(records),
                       finish_reason=("environment",) * 2, **over)


def test_record_rules_and_json():
    r = RewardRecord(total=1.75, components={"guess": 0.75, "correct": 1.0}, scorer_version="env:x",
                     applies_to=tuple(A_TURNS))
    assert RewardRecord.from_json(r.to_json()) == r
    assert r.outcome_remainder() == 1.0  # what the spans leave applies to the whole response
    plain = RewardRecord(total=1.0, scorer_version="v")
    assert "applies_to" not in plain.to_json() and plain.outcome_remainder() == 1.0  # records as before
    for bad, says in [(dict(applies_to=()), "non-empty"),
                      (dict(applies_to=(ScoreSpan(0, 3, 1.0), ScoreSpan(3, 5, 1.0))), "not overlap"),
                      (dict(applies_to=(ScoreSpan(3, 3, 1.0), ScoreSpan(0, 0, 1.0))), "in order"),
                      (dict(total=None, status=RewardStatus.ERROR, error="boom", applies_to=tuple(A_TURNS)),
                       "a failure applies to nothing")]:
        with pytest.raises(ValueError, match=says):
            RewardRecord(**{"total": 1.0, "scorer_version": "v", **bad})
    for first, last, value in [(2, 1, 0.0), (-1, 0, 0.0), (0, 0, math.nan)]:
        with pytest.raises(ValueError):
            ScoreSpan(first, last, value)


def test_sealed_record_refuses_a_part_not_received_after_an_action():
    two_of_a([RewardRecord(total=1.0, scorer_version="v", applies_to=tuple(A_TURNS))] * 2)
    for last in (1, 6):  # an environment token; past the response
        bad = RewardRecord(total=1.0, scorer_version="v", applies_to=(ScoreSpan(0, last, 1.0),))
        with pytest.raises(ValueError, match=rf"sample 's1': the part .* ends at response position {last}, which is not "
                                             r"an action token"):
            two_of_a([RewardRecord(total=1.0, scorer_version="v"), bad])


def test_episode_spans_are_each_answered_turns_policy_tokens():
    t = Trajectory("q", 0, (1,), response_ids=list(RESPONSES[0]), source=list(SOURCES[0]), turn=list(TURNS[0]),
                   turn_rewards=[{"guess": 0.5}, {}, {"correct": 1.0, "style": 0.25}])
    assert t.turn_spans() == [ScoreSpan(0, 0, 0.5, "turn 0"), ScoreSpan(3, 3, 0.0, "turn 1"),
                              ScoreSpan(5, 5, 1.25, "turn 2")]
    # a turn the environment never answered (max_turns, the budget) has no span: its tokens earn
    # only what reaches them from later rewards, like any return
    t.turn_rewards = t.turn_rewards[:2]
    assert [x.label for x in t.turn_spans()] == ["turn 0", "turn 1"]


def test_parts_on_their_actions_and_the_remainder_on_the_last():
    mask = two_of_a([RewardRecord(total=1.0, scorer_version="v")] * 2).response_mask
    records = [RewardRecord(total=1.75, scorer_version="v", applies_to=tuple(A_TURNS)),  # 1.0 left for the end
               RewardRecord(total=0.5, scorer_version="v", applies_to=(ScoreSpan(5, 5, 0.25),))]  # 0.25 left, same token
    w, e = step_tensors(records, mask, dtype=torch.float64)
    assert w.tolist() == [[0.25, 0.5, 1.0], [0.5, 0.0, 0.0]] and e.tolist() == [[0, 3, 5], [5, -1, -1]]
    placed = place_step_rewards(w, e, mask)
    assert placed.tolist() == [[0.25, 0, 0, 0.5, 0, 1.0], [0, 0, 0, 0, 0, 0.5]]
    assert placed.sum(1).tolist() == [1.75, 0.5]  # every part lands once: the totals are kept
    with pytest.raises(ValueError, match="not an action token"):
        place_step_rewards(w, torch.tensor([[0, 1, 5], [5, -1, -1]]), mask)


def _critic_facts(records):
    f = two_of_a(records)
    lp = LogProbs(torch.tensor([LOG_PROBS[0]] * 2), LogProbProducer("actor", "v2"))
    ref = LogProbs(torch.tensor([LOG_PROBS[0]] * 2) - 0.5 * f.response_mask, LogProbProducer("reference", "ref"))
    values = torch.tensor([[0.5, 99, 99, 0.25, 99, 0.75]] * 2, dtype=torch.float64)
    return two_of_a(records, old_log_probs=lp, ref_log_probs=ref, values=values, critic_version="c1",
                    bootstrap_values=torch.zeros(2, dtype=torch.float64))


def test_gae_reads_the_turn_rewards_under_recorded_placement():
    """gamma = lam = 1, values (0.5, 0.25, 0.75) on the policy tokens, terminal.
    recorded, rewards (0.25, 0.5, 1.0): A = (1.25, 1.25, 0.25) = returns - V, returns (1.75, 1.5, 1.0);
    last_token, reward 1.75 at the end: A = (1.25, 1.5, 1.0) -- the middle turn credited with the
    first turn's reward it came after."""
    records = [RewardRecord(total=1.75, scorer_version="v", applies_to=tuple(A_TURNS))] * 2
    f = _critic_facts(records)
    s = DerivationSettings(estimator="gae", reward_placement="recorded")
    d, _ = derive(f, s)
    assert d.shaped_rewards[0].tolist() == [0.25, 0, 0, 0.5, 0, 1.0]
    assert d.advantages[0].tolist() == [1.25, 0, 0, 1.25, 0, 0.25]
    assert d.returns[0].tolist() == [1.75, 0, 0, 1.5, 0, 1.0]
    assert d.hyperparameters["reward_placement"] == "recorded"
    assert DerivationSettings.from_record(d) == s  # a saved batch re-derives under the placement it trained on
    base, _ = derive(f, DerivationSettings(estimator="gae"))
    assert base.shaped_rewards[0].tolist() == [0, 0, 0, 0, 0, 1.75]
    assert base.advantages[0].tolist() == [1.25, 0, 0, 1.5, 0, 1.0]
    assert "reward_placement" not in base.hyperparameters  # the default records as it always did
    # KL in the reward: the same parts, shaped by -beta * k1 on every action (k1 = 0.5 here)
    kl, _ = derive(f, DerivationSettings(estimator="gae", reward_placement="recorded", kl_placement="reward", kl_beta=0.1))
    assert torch.allclose(kl.shaped_rewards[0], torch.tensor([0.2, 0, 0, 0.45, 0, 0.95]))
    shaped, _ = kl_shaped_token_rewards(f.scores(), f.response_mask, f.old_log_probs, f.ref_log_probs, 0.1,
                                        placed=d.shaped_rewards)
    assert torch.equal(shaped, kl.shaped_rewards)


def test_grpo_process_credits_turns_the_outcome_cannot_tell_apart():
    """Two trajectories of one group, both total 1.0: one earned it in turn 0, the other in turn 2.
    Outcome GRPO sees a zero-variance group (advantage 0).  Over the turns, the pooled rewards
    (1, 0 | 0, 1) normalise to +-sqrt(3)/2 and each token sums the turns at or after it."""
    records = [RewardRecord(total=1.0, scorer_version="v", applies_to=(ScoreSpan(0, 0, 1.0), ScoreSpan(5, 5, 0.0))),
               RewardRecord(total=1.0, scorer_version="v", applies_to=(ScoreSpan(0, 0, 0.0), ScoreSpan(5, 5, 1.0)))]
    f = two_of_a(records)
    h = math.sqrt(3) / 2
    d, _ = derive(f, DerivationSettings(estimator="grpo_process"))
    want = torch.tensor([[0.0, 0, 0, -h, 0, -h], [0.0, 0, 0, h, 0, h]])
    assert torch.allclose(d.advantages, want, atol=1e-6), d.advantages
    outcome, _ = derive(f, DerivationSettings(estimator="grpo"))
    assert not outcome.advantages.any()


GRPO = os.path.join(ROOT, "configs", "grpo_two_turn_tiny.yaml")


def test_config_placement_is_for_token_reward_estimators():
    with pytest.raises(ConfigError, match=r"^algo\.reward_placement: recorded places rewards for a token-reward "
                                          r"estimator .* algo\.advantage='grpo' reads one score per sample"):
        check_run(load_config(GRPO, ["algo.reward_placement=recorded"]), 1)
    with pytest.raises(ConfigError, match=r"^algo\.reward_placement: 'turn' is not one of"):
        check_run(load_config(GRPO, ["algo.reward_placement=turn"]), 1)
    # an environment's per-turn rewards are grpo_process's steps
    assert check_run(load_config(GRPO, ["algo.advantage=grpo_process"]), 1) == 1
    ppo = ["algo.name=ppo", "algo.advantage=gae", "algo.reward_placement=recorded", "critic={}"]
    assert check_run(load_config(GRPO, ppo), 1) == 1


def test_inspect_prints_each_part_and_the_remainder(tmp_path):
    from megarl.experience.schema import DerivedTensors, ExperienceBatch
    from megarl.experience.seal import save_sealed, seal, with_derived

    f = two_of_a([RewardRecord(total=1.75, scorer_version="v", applies_to=tuple(A_TURNS)),
                  RewardRecord(total=1.0, scorer_version="v")])
    derived = DerivedTensors(advantages=torch.zeros(2, 6), loss_mask=f.response_mask, estimator="grpo")
    save_sealed(with_derived(seal(ExperienceBatch(f)), derived), tmp_path / "x")
    tool = inspect_module()
    batch = tool.load_batch(str(tmp_path / "x"))
    assert batch.facts.rewards[0].applies_to == tuple(A_TURNS)  # saved and loaded with the record
    lines = tool.describe(batch, 0, str(tmp_path / "x"))
    assert [x for x in lines if x.startswith("  applies to")] == [
        "  applies to      turn 0: 0.25 for response tokens 0..0, received after 0",
        "  applies to      turn 1: 0.5 for response tokens 3..3, received after 3",
        "  applies to      the whole response: 1, received after its last action"]
    assert not [x for x in tool.describe(batch, 1, str(tmp_path / "x")) if x.startswith("  applies to")]
