"""The multi-turn experience record: per-token source / turn / policy version (TokenOrigins),
collated from agent trajectories, checked, sealed, hashed, saved and loaded; sealing refuses a
multi-turn record without it; the new finish reasons; and the algorithms over interleaved
trajectories (GAE over policy tokens only, outcome and per-turn rewards at policy tokens, GRPO
and the actor loss never touching environment tokens) -- all on golden tensors."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from megarl.algo.advantages import (AdvantageConfig, AdvantageInputs, discounted_gae, gae_advantage,
                                   grpo_outcome_advantage)
from megarl.algo.aggregation import global_normaliser
from megarl.algo.objective import actor_loss
from megarl.algo.policy_loss import PolicyLossConfig
from megarl.algo.reward_shaping import kl_shaped_token_rewards, place_outcome_rewards, turn_rewards
from megarl.control.batch import collate, collate_trajectories
from megarl.experience.origins import TokenOrigins, collate_origins
from megarl.experience.schema import (
    MULTI_TURN_FINISH_REASONS,
    DerivedTensors,
    ExperienceBatch,
    FinishReason,
    LogProbProducer,
    LogProbs,
)
from megarl.experience.seal import (CorruptExperienceError, SealedWriteError, load_sealed, save_sealed, seal,
                                   with_derived)
from tests._agent_record import (FINISH, LOG_PROBS, RESPONSES, SOURCES, TURNS, VERSIONS, agent_facts, inspect_module,
                                 trajectories)
from tests._tolerance import formula_tol

#: content hash of the sealed record of :func:`agent_facts` (pins the encoding of token_origins)
AGENT_HASH = "sha256:1a937f55717f48d3f94604a14f04f7a4fc79cad7db39efcf2f083a037612b62a"


# ---- finish reasons ---------------------------------------------------------------------------


def test_finish_reasons_of_agent_trajectories():
    assert [FinishReason(v) for v in ("environment", "env_truncated", "max_turns")] == \
        [FinishReason.ENVIRONMENT, FinishReason.ENV_TRUNCATED, FinishReason.MAX_TURNS]
    terminal = {f for f in FinishReason if f is not FinishReason.ABORT and f.terminated}
    assert terminal == {FinishReason.EOS, FinishReason.STOP, FinishReason.ENVIRONMENT}
    assert MULTI_TURN_FINISH_REASONS == {FinishReason.ENVIRONMENT, FinishReason.ENV_TRUNCATED,
                                         FinishReason.MAX_TURNS, FinishReason.TOOL}
    with pytest.raises(ValueError, match="abort"):
        FinishReason.ABORT.terminated


# ---- collation --------------------------------------------------------------------------------


def test_collate_trajectories_golden():
    c = trajectories()
    assert c.prompt_ids.tolist() == [[5, 6], [7, 8], [0, 9]]
    assert c.response_ids.tolist() == [[10, 20, 21, 11, 22, 12], [13, 23, 14, 15, 0, 0], [16, 17, 0, 0, 0, 0]]
    assert c.attention_mask.tolist() == [[1] * 8, [1] * 6 + [0, 0], [0, 1, 1, 1, 0, 0, 0, 0]]
    assert c.response_mask.tolist() == [[1, 0, 0, 1, 0, 1], [1, 0, 1, 1, 0, 0], [1, 1, 0, 0, 0, 0]]
    assert c.rollout_log_probs.tolist() == [[-0.5, 0, 0, -0.25, 0, -0.125], [-1, 0, -0.75, -2, 0, 0],
                                            [-0.5, -1.5, 0, 0, 0, 0]]
    o = c.token_origins
    assert (o.source.dtype, o.turn.dtype, o.version_index.dtype) == (torch.int8, torch.int16, torch.int16)
    assert o.source.tolist() == [[1, 2, 2, 1, 2, 1], [1, 2, 1, 1, 0, 0], [1, 1, 0, 0, 0, 0]]
    assert o.turn.tolist() == [[0, 0, 0, 1, 1, 2], [0, 0, 1, 1, -1, -1], [0, 0, -1, -1, -1, -1]]
    assert o.versions == ("v1", "v2")  # first appearance, row-major
    assert o.version_index.tolist() == [[0, -1, -1, 0, -1, 1], [1, -1, 1, 1, -1, -1], [1, 1, -1, -1, -1, -1]]
    assert o.num_turns().tolist() == [3, 2, 1] and o.last_policy_versions() == ("v2", "v2", "v2")
    assert o.token_versions(1) == ["v2", None, "v2", "v2", None, None]
    assert torch.equal(o.select(torch.tensor([2])).source, o.source[2:])


def test_single_turn_trajectories_collate_exactly_like_collate():
    """All-policy, one-turn trajectories give collate's tensors bit for bit (plus the origins)."""
    prompts, responses = [[3, 4], [5]], [[6, 7, 8], [9]]
    lps = [torch.tensor([-0.3, -0.2, -0.1]), torch.tensor([-0.7])]
    one = collate(prompts, responses, lps, pad_id=0)
    many = collate_trajectories(prompts, responses, lps, [[1] * 3, [1]], [[0] * 3, [0]],
                                [["v"] * 3, ["v"]], pad_id=0)
    for name in ("prompt_ids", "response_ids", "attention_mask", "response_mask", "rollout_log_probs"):
        a, b = getattr(one, name), getattr(many, name)
        assert a.dtype == b.dtype and torch.equal(a, b), name
    assert one.token_origins is None and many.token_origins.versions == ("v",)


def test_collate_trajectories_refuses_inconsistent_tokens():
    lp = [torch.tensor(x) for x in LOG_PROBS]
    bad_lp = [lp[0].clone(), lp[1], lp[2]]
    bad_lp[0][2] = -0.5
    with pytest.raises(ValueError, match=r"row 0, response position 2: rollout log-prob -0.5 on an environment token"):
        trajectories(raw_log_probs=bad_lp)
    with pytest.raises(ValueError, match="row 1 has 4 response tokens but 3 sources"):
        trajectories(sources=[SOURCES[0], SOURCES[1][:3], SOURCES[2]])
    with pytest.raises(ValueError, match="row 2 has 2 sources, 1 turns"):
        trajectories(turns=[TURNS[0], TURNS[1], [0]])
    with pytest.raises(ValueError, match="row 1, response position 2: a policy token needs a policy version"):
        trajectories(token_versions=[VERSIONS[0], ["v2", None, None, "v2"], VERSIONS[2]])
    with pytest.raises(ValueError, match="row 0, response position 1: an environment token has a policy version"):
        trajectories(token_versions=[["v1", "v1", None, "v1", None, "v2"], VERSIONS[1], VERSIONS[2]])
    with pytest.raises(ValueError, match="row 2, response position 1: source 3"):
        trajectories(sources=[SOURCES[0], SOURCES[1], [1, 3]])


# ---- the record's rules ------------------------------------------------------------------------


def _origins(source, turn, vidx, versions=("v1", "v2")):
    return TokenOrigins(torch.tensor(source, dtype=torch.int8), torch.tensor(turn, dtype=torch.int16),
                        torch.tensor(vidx, dtype=torch.int16), versions)


def test_token_origins_rules_name_row_and_position():
    ok = ([[1, 2, 1, 0]], [[0, 0, 1, -1]], [[0, -1, 1, -1]])
    _origins(*ok)
    cases = [
        (([[1, 0, 1, 0]], [[0, -1, 1, -1]], [[0, -1, 1, -1]]), "row 0, response position 1: padding"),
        (([[1, 2, 1, 0]], [[0, 0, 1, 0]], [[0, -1, 1, -1]]), "position 3: turn must be -1 on padding"),
        (([[2, 1, 1, 0]], [[0, 1, 1, -1]], [[-1, 0, 1, -1]]), "position 0: a trajectory starts with a policy token"),
        (([[1, 2, 1, 0]], [[0, 0, 0, -1]], [[0, -1, 1, -1]]), "position 2: turn must rise by exactly 1"),
        (([[1, 2, 1, 0]], [[0, 0, 2, -1]], [[0, -1, 1, -1]]), "position 2: turn must rise by exactly 1"),
        (([[1, 2, 1, 0]], [[0, 1, 2, -1]], [[0, -1, 1, -1]]), "position 1: turn may change only"),
        (([[1, 1, 1, 0]], [[0, 0, 1, -1]], [[0, 0, 0, -1]]), "position 2: turn may change only"),
        (([[1, 2, 1, 0]], [[0, 0, 1, -1]], [[0, 0, 1, -1]]), "position 1: version_index must be -1"),
        (([[1, 2, 1, 0]], [[0, 0, 1, -1]], [[0, -1, 2, -1]]), "position 2: version_index must index versions"),
        (([[1, 2, 4, 0]], [[0, 0, 1, -1]], [[0, -1, 1, -1]]), "position 2: source must be 0"),
    ]
    for args, msg in cases:
        with pytest.raises(ValueError, match=msg):
            _origins(*args)
    with pytest.raises(ValueError, match="must be torch.int16"):
        TokenOrigins(torch.tensor(ok[0], dtype=torch.int8), torch.tensor(ok[1]), torch.tensor(ok[2], dtype=torch.int16),
                     ("v1", "v2"))
    with pytest.raises(ValueError, match="distinct non-empty"):
        _origins(*ok, versions=("v1", "v1"))


def test_facts_tie_the_origins_to_the_record():
    facts = agent_facts()
    assert facts.multi_turn().tolist() == [True, True, False]
    assert facts.terminated().tolist() == [True, False, True]
    c = trajectories()
    o = c.token_origins
    rm = c.response_mask.clone()
    rm[0, 1] = 1  # an environment token in the response mask ...
    with pytest.raises(ValueError, match=r"sample 'r/it1/p0/c00', response position 1: response_mask must be 1"):
        agent_facts(response_mask=rm)
    lp = c.rollout_log_probs.clone()
    lp[1, 1] = -0.1  # ... a rollout log-prob on one
    with pytest.raises(ValueError, match=r"sample 'r/it1/p0/c01', response position 1: rollout_log_probs must be 0"):
        agent_facts(rollout_log_probs=LogProbs(lp, LogProbProducer("rollout", "v2")))
    # a row whose last policy token is v1 while the sample says v2
    vi = o.version_index.clone()
    vi[0, 5] = 0
    with pytest.raises(ValueError, match="sample 'r/it1/p0/c00': policy_version 'v2' must be the version of its last"):
        agent_facts(token_origins=dataclasses.replace(o, version_index=vi))
    short = collate_origins(SOURCES[:2] + [[1]], TURNS[:2] + [[0]], VERSIONS[:2] + [["v2"]], 6)
    with pytest.raises(ValueError, match=r"sample 'r/it1/p0/c02', response position 1: response_mask must be 1"):
        agent_facts(token_origins=short)
    beyond = collate_origins(SOURCES[:2] + [[1, 1, 2]], TURNS[:2] + [[0, 0, 0]], VERSIONS[:2] + [["v2", "v2", None]], 6)
    with pytest.raises(ValueError, match=r"sample 'r/it1/p0/c02', response position 2: padding \(source 0\) must be "
                                         r"exactly where attention_mask is 0"):
        agent_facts(token_origins=beyond)
    with pytest.raises(ValueError, match=r"shape \(bs, response_len\) = \(3, 6\)"):
        agent_facts(token_origins=o.select(torch.tensor([0, 1])))
    with pytest.raises(TypeError, match="TokenOrigins record"):
        agent_facts(token_origins=o.source)


# ---- sealing ------------------------------------------------------------------------------------


def test_sealing_refuses_a_multi_turn_record_without_origins():
    with pytest.raises(ValueError, match=r"sample 'r/it1/p0/c00' is a multi-turn trajectory \(response position 1 is a "
                                         r"real token outside response_mask.*no token_origins"):
        seal(ExperienceBatch(agent_facts(token_origins=None)))
    # no environment token, but a finish reason only an agent has
    single = collate([[5]], [[6, 7]], [torch.tensor([-0.1, -0.2])], pad_id=0)
    for reason in sorted(MULTI_TURN_FINISH_REASONS, key=lambda f: f.value):
        f = agent_facts(single, finish_reason=(reason,), token_origins=None)
        with pytest.raises(ValueError, match=f"finish_reason '{reason.value}'.*no token_origins"):
            seal(ExperienceBatch(f))
    seal(ExperienceBatch(agent_facts(single, finish_reason=(FinishReason.EOS,), token_origins=None)))


def test_origins_are_sealed_hashed_saved_and_loaded(tmp_path):
    facts = agent_facts()
    b = seal(ExperienceBatch(facts))
    assert b.content_hash == AGENT_HASH
    with pytest.raises(SealedWriteError):
        b.facts.token_origins.turn[0, 0] = 1
    with pytest.raises(SealedWriteError):
        b.facts.token_origins.source.add_(1)
    # every part of the origins is in the hash: the tensors and the version names
    relabelled = dataclasses.replace(facts.token_origins, versions=("v0", "v2"))
    assert seal(ExperienceBatch(dataclasses.replace(facts, token_origins=relabelled))).content_hash != AGENT_HASH
    vi = facts.token_origins.version_index.clone()
    vi[0, 0] = 1  # turn 0 of sample A on v2 instead of v1: still a valid record
    other = dataclasses.replace(facts, token_origins=dataclasses.replace(facts.token_origins, version_index=vi))
    assert seal(ExperienceBatch(other)).content_hash != AGENT_HASH

    derived = DerivedTensors(advantages=torch.zeros(3, 6), loss_mask=facts.response_mask, estimator="grpo")
    full = with_derived(b, derived)
    save_sealed(full, tmp_path / "x")
    manifest = json.loads((tmp_path / "x" / "manifest.json").read_text())
    assert manifest["metadata"]["token_origins"] == {"versions": ["v1", "v2"]}
    assert {k: v["dtype"] for k, v in manifest["tensors"].items() if "token_origins" in k} == {
        "facts.token_origins.source": "torch.int8", "facts.token_origins.turn": "torch.int16",
        "facts.token_origins.version_index": "torch.int16"}
    back = load_sealed(tmp_path / "x")
    assert back.content_hash == full.content_hash
    for name in ("source", "turn", "version_index"):
        assert torch.equal(getattr(back.facts.token_origins, name), getattr(facts.token_origins, name))
    assert back.facts.token_origins.versions == ("v1", "v2")
    assert back.facts.finish_reason == FINISH
    # origins metadata without the tensors (or the reverse) is refused
    manifest["metadata"].pop("token_origins")
    (tmp_path / "x" / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(CorruptExperienceError, match="token_origins"):
        load_sealed(tmp_path / "x")


# ---- the algorithms over interleaved trajectories ----------------------------------------------


def _compact(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Each row's masked entries, left-justified, zero-padded to the widest row."""
    rows = [x[b][mask[b] != 0] for b in range(x.shape[0])]
    out = torch.zeros(x.shape[0], max(r.numel() for r in rows), dtype=x.dtype)
    for b, r in enumerate(rows):
        out[b, : r.numel()] = r
    return out


def test_gae_skips_environment_tokens_and_bootstraps_at_truncation():
    """One trajectory [policy, env, env, policy, env, policy] under four finish reasons.

    Over the policy tokens (values 0.5, 0.25, 0.75; outcome 1 on the last), gamma = lam = 0.5:
      terminal (environment):  delta = (-0.375, 0.125, 0.25)        A = (-0.328125, 0.1875, 0.25)
      truncated, V_boot = 2:   delta = (-0.375, 0.125, 1.25)        A = (-0.265625, 0.4375, 1.25)
    The environment tokens' values (99) are never read."""
    reasons = (FinishReason.ENVIRONMENT, FinishReason.ENV_TRUNCATED, FinishReason.MAX_TURNS, FinishReason.LENGTH)
    c = trajectories(prompts=[[5]] * 4, responses=[RESPONSES[0]] * 4, raw_log_probs=[torch.tensor(LOG_PROBS[0])] * 4,
                     sources=[SOURCES[0]] * 4, turns=[TURNS[0]] * 4, token_versions=[VERSIONS[0]] * 4)
    f = agent_facts(c, sample_id=tuple(f"s{i}" for i in range(4)), finish_reason=reasons)
    assert f.terminated().tolist() == [True, False, False, False]
    mask = f.response_mask
    scores = torch.ones(4, dtype=torch.float64)
    rewards = place_outcome_rewards(scores, mask)
    assert rewards[0].tolist() == [0, 0, 0, 0, 0, 1]  # the outcome sits on the last policy token
    values = torch.tensor([[0.5, 99, 99, 0.25, 99, 0.75]] * 4, dtype=torch.float64)
    boot = torch.full((4,), 2.0, dtype=torch.float64)
    res = gae_advantage(AdvantageInputs(response_mask=mask, token_rewards=rewards, values=values,
                                        terminated=f.terminated(), bootstrap_values=boot),
                        AdvantageConfig(gamma=0.5, lam=0.5))
    terminal = [-0.328125, 0.0, 0.0, 0.1875, 0.0, 0.25]
    truncated = [-0.265625, 0.0, 0.0, 0.4375, 0.0, 1.25]
    assert res.advantages.tolist() == [terminal, truncated, truncated, truncated]
    assert res.returns[0].tolist() == [0.171875, 0, 0, 0.4375, 0, 1.0]
    assert torch.equal(res.loss_mask, mask)
    # equal, bit for bit, to GAE over the compacted policy-only sequences
    adv_c, ret_c = discounted_gae(_compact(rewards, mask), _compact(values, mask), torch.ones(4, 3),
                                  f.terminated(), boot, 0.5, 0.5)
    assert torch.equal(_compact(res.advantages, mask), adv_c) and torch.equal(_compact(res.returns, mask), ret_c)
    # treating the environment tokens as zero-reward steps (in the mask) would discount across
    # them and change every earlier advantage
    steps, _ = discounted_gae(rewards, torch.tensor([[0.5, 0.25, 0.25, 0.25, 0.75, 0.75]] * 4, dtype=torch.float64),
                              torch.ones(4, 6), f.terminated(), boot, 0.5, 0.5)
    assert steps[0, 0] != res.advantages[0, 0] and steps[1, 3] != res.advantages[1, 3]


def test_gae_interleaved_equals_compacted_on_random_trajectories():
    g = torch.Generator().manual_seed(3)
    bs, R = 16, 24
    mask = torch.zeros(bs, R, dtype=torch.long)
    for b in range(bs):  # policy runs separated by environment runs, right padding
        n = int(torch.randint(1, R + 1, (1,), generator=g))
        row = (torch.rand(n, generator=g) < 0.6).long()
        row[0] = row[-1] = 1
        mask[b, :n] = row
    rewards = torch.where(mask != 0, torch.randn(bs, R, generator=g, dtype=torch.float64), 0.0)
    values = torch.randn(bs, R, generator=g, dtype=torch.float64)
    term = torch.rand(bs, generator=g) < 0.5
    boot = torch.randn(bs, generator=g, dtype=torch.float64)
    adv, ret = discounted_gae(rewards, values, mask, term, boot, 0.9, 0.8)
    cm = _compact(mask, mask)
    adv_c, ret_c = discounted_gae(_compact(rewards, mask), _compact(values, mask), cm, term, boot, 0.9, 0.8)
    assert torch.equal(_compact(adv, mask), adv_c) and torch.equal(_compact(ret, mask), ret_c)
    assert not adv[mask == 0].any() and not ret[mask == 0].any()


def test_turn_rewards_sit_on_the_last_policy_token_of_each_turn():
    o = trajectories().token_origins
    r = torch.tensor([[0.5, -1.0, 2.0], [0.25, 1.0, 0.0], [3.0, 0.0, 0.0]], dtype=torch.float64)
    got = turn_rewards(r, o)
    assert got.tolist() == [[0.5, 0, 0, -1.0, 0, 2.0], [0.25, 0, 0, 1.0, 0, 0], [0, 3.0, 0, 0, 0, 0]]
    outcome = place_outcome_rewards(torch.tensor([1.0, 1.0, 1.0], dtype=torch.float64), o.policy_mask().long())
    assert (got + outcome).tolist()[0] == [0.5, 0, 0, -1.0, 0, 3.0]  # the last turn shares the outcome's token
    with pytest.raises(ValueError, match="row 1 has 2 turns but a non-zero reward for turn 2"):
        turn_rewards(torch.tensor([[0.5, -1.0, 2.0], [0.25, 1.0, 4.0], [3.0, 0.0, 0.0]]), o)
    with pytest.raises(ValueError, match="row 0 has 3 turns, rewards only 2 columns"):
        turn_rewards(torch.zeros(3, 2), o)
    with pytest.raises(ValueError, match="non-finite"):
        turn_rewards(torch.tensor([[float("nan"), 0, 0]] * 3), o)


def test_grpo_and_the_actor_loss_never_touch_environment_tokens():
    """A group of the three trajectories (scores 1, 0, 0.5: mean 0.5, std 0.5 -> A = 1, -1, 0)."""
    f = agent_facts()
    mask = f.response_mask
    res = grpo_outcome_advantage(AdvantageInputs(response_mask=mask, scores=torch.tensor([1.0, 0.0, 0.5]),
                                                 group_index=torch.zeros(3, dtype=torch.long)), AdvantageConfig())
    assert res.advantages.tolist() == [[1, 0, 0, 1, 0, 1], [-1, 0, -1, -1, 0, 0], [0, 0, 0, 0, 0, 0]]
    assert torch.equal(res.loss_mask, mask) and not res.loss_mask[f.token_origins.environment_mask()].any()
    # KL in the reward: -beta * k1 on policy tokens only, the outcome on the last one
    g = torch.Generator().manual_seed(1)
    old_lp, ref_lp = -torch.rand(3, 6, generator=g), -torch.rand(3, 6, generator=g)
    shaped, k1 = kl_shaped_token_rewards(torch.tensor([1.0, 0.0, 0.5]), mask,
                                         LogProbs(old_lp, LogProbProducer("actor", "v2")),
                                         LogProbs(ref_lp, LogProbProducer("reference", "ref")), 0.1)
    env = f.token_origins.environment_mask()
    assert not shaped[env].any() and not k1[env].any()
    assert torch.allclose(shaped[0], torch.where(mask[0] != 0, -0.1 * (old_lp[0] - ref_lp[0]), 0.0)
                          + torch.tensor([0, 0, 0, 0, 0, 1.0]))

    g = torch.Generator().manual_seed(0)
    old = -torch.rand(3, 6, generator=g, dtype=torch.float64)
    cur = old + 0.1 * torch.randn(3, 6, generator=g, dtype=torch.float64)
    cur[f.token_origins.environment_mask()] = 50.0  # what the actor scores env tokens never matters
    for name, mode in (("vanilla", "token-mean"), ("gspo", "seq-mean-token-mean")):
        cfg = PolicyLossConfig(name=name, agg_mode=mode)
        lp = cur.clone().requires_grad_(True)
        out = actor_loss(lp, old_log_probs=LogProbs(old, LogProbProducer("actor", "v2")), advantages=res.advantages,
                         loss_mask=res.loss_mask, cfg=cfg, normaliser=global_normaliser(res.loss_mask, mode))
        out.loss.backward()
        assert not lp.grad[f.token_origins.environment_mask()].any(), name  # exactly 0 on env tokens
        cm = _compact(mask, mask)
        lpc = _compact(cur, mask).requires_grad_(True)
        ref = actor_loss(lpc, old_log_probs=LogProbs(_compact(old, mask), LogProbProducer("actor", "v2")),
                         advantages=_compact(res.advantages, mask), loss_mask=cm, cfg=cfg,
                         normaliser=global_normaliser(cm, mode))
        ref.loss.backward()
        # float64, the same terms summed padded or compacted (another order): <= 18 tokens of
        # |term| <= ~2, twice the first-order bound (tests/_tolerance.py), ~1e-14
        tol = formula_tol(torch.float64, ops=24, scale=40.0)
        assert torch.allclose(out.loss, ref.loss, rtol=0, atol=tol), name
        assert torch.allclose(_compact(lp.grad, mask), lpc.grad, rtol=0, atol=tol), name


# ---- inspection ---------------------------------------------------------------------------------


def test_inspect_shows_each_turn_with_source_mask_and_version(tmp_path):
    facts = agent_facts()
    adv = torch.zeros(3, 6)
    derived = DerivedTensors(advantages=adv, loss_mask=facts.response_mask, estimator="grpo")
    save_sealed(with_derived(seal(ExperienceBatch(facts)), derived), tmp_path / "x")
    tool = inspect_module()
    batch = tool.load_batch(str(tmp_path / "x"))
    lines = tool.describe(batch, 0, str(tmp_path / "x"))
    start = lines.index(next(line for line in lines if line.startswith("turns:")))
    assert lines[start: start + 8] == [
        "turns: 3 policy turns; 3 policy tokens, 3 environment tokens (loss mask 0); versions in this batch: v1, v2",
        "  turn  source       positions  tokens  response_mask  loss_mask  version  ids",
        "  ----  -----------  ---------  ------  -------------  ---------  -------  --------",
        "     0  policy            0..0       1            1/1        1/1  v1       [10]",
        "     0  environment       1..2       2            0/2        0/2  -        [20, 21]",
        "     1  policy            3..3       1            1/1        1/1  v1       [11]",
        "     1  environment       4..4       1            0/1        0/1  -        [22]",
        "     2  policy            5..5       1            1/1        1/1  v2       [12]",
    ]
    single = tool.describe(batch, 2, str(tmp_path / "x"))
    assert "     0  policy       0..1       2            2/2        2/2  v2       [16, 17]" in single
