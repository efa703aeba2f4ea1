"""Golden tensors: every estimator, KL estimator, loss and aggregation mode against a reference
written here straight from the formulas, with plain Python loops over samples and tokens."""

from __future__ import annotations

import math
import statistics

import pytest
import torch

from tests.dist_algo_invariance import ACTOR, REFERENCE, ROLLOUT, ragged_batch
from megarl.algo.advantages import AdvantageConfig, AdvantageInputs
from megarl.algo.aggregation import AGG_MODES, aggregate_loss, global_normaliser
from megarl.algo.kl import AdaptiveKLController, KLConfig, kl_estimate
from megarl.algo.objective import actor_loss
from megarl.algo.policy_loss import PolicyLossConfig
from megarl.algo.registry import get_advantage
from megarl.algo.reward_shaping import kl_shaped_token_rewards, overlong_penalty
from megarl.algo.rollout_correction import RolloutCorrectionConfig, rollout_correction
from megarl.algo.value_loss import clipped_value_loss
from megarl.experience.schema import LogProbs
from tests._tolerance import formula_tol

# float64 tensor code against a reference written here with Python floats: both are the formula
# up to rounding.  Batches of <= 7 x 9 tokens, <= 1000 dependent operations per value, operand
# magnitudes summing to <= 1000: twice the first-order bound holds in any order, on any CPU
# (tests/_tolerance.py), ~2e-10.  A wrong formula (a missed Bessel correction, a token-mean
# taken as a seq-mean, a clip on the wrong side) moves these values by > 1e-3.
TOL = dict(atol=formula_tol(torch.float64, ops=1000, scale=1000.0), rtol=0)
SEEDS = [0, 1, 2]


def L(t):
    return t.tolist()


def actions(mask_row):
    return [t for t, m in enumerate(mask_row) if m]


# ---------------------------------------------------------------------------------------------
# reference implementations (loops, floats)


def ref_group_adv(scores, groups, mask, kind, eps, rule):
    bs, R = len(mask), len(mask[0])
    members = {}
    for i, g in enumerate(groups):
        members.setdefault(g, []).append(i)
    adv = [[0.0] * R for _ in range(bs)]
    keep = [[bool(m) for m in row] for row in mask]
    zero = 0
    for g, idx in members.items():
        rs = [scores[i] for i in idx]
        n = len(rs)
        mean = sum(rs) / n
        std = statistics.stdev(rs) if n > 1 else 0.0
        degenerate = n < 2 or std <= eps
        zero += degenerate
        for i in idx:
            if degenerate:
                a = 0.0
                if rule == "skip":
                    keep[i] = [False] * R
            elif kind == "grpo":
                a = (scores[i] - mean) / std
            elif kind == "dr_grpo":
                a = scores[i] - mean
            else:  # rloo
                a = scores[i] - (sum(rs) - scores[i]) / (n - 1)
            for t in range(R):
                adv[i][t] = a if keep[i][t] else 0.0
    return adv, keep, zero


def ref_gae(rewards, values, mask, terminated, boot, gamma, lam):
    bs, R = len(mask), len(mask[0])
    adv = [[0.0] * R for _ in range(bs)]
    ret = [[0.0] * R for _ in range(bs)]
    for b in range(bs):
        acts = actions(mask[b])
        T = len(acts)
        deltas = []
        for k, t in enumerate(acts):
            if k + 1 < T:
                nv = values[b][acts[k + 1]]
            else:
                nv = 0.0 if terminated[b] else boot[b]
            deltas.append(rewards[b][t] + gamma * nv - values[b][t])
        for k, t in enumerate(acts):
            adv[b][t] = sum((gamma * lam) ** (j - k) * deltas[j] for j in range(k, T))
            ret[b][t] = adv[b][t] + values[b][t]
    return adv, ret


def ref_rpp(rewards, mask, gamma, eps):
    bs, R = len(mask), len(mask[0])
    G = [[0.0] * R for _ in range(bs)]
    flat = []
    for b in range(bs):
        acts = actions(mask[b])
        for k, t in enumerate(acts):
            G[b][t] = sum(gamma ** (j - k) * rewards[b][acts[j]] for j in range(k, len(acts)))
            flat.append(G[b][t])
    mu = sum(flat) / len(flat)
    var = sum((x - mu) ** 2 for x in flat) / (len(flat) - 1)
    adv = [[(G[b][t] - mu) / math.sqrt(var + eps) if mask[b][t] else 0.0 for t in range(R)] for b in range(bs)]
    return adv, G


def ref_agg(loss, mask, mode, all_masks=None, const=None):
    """mode formula over the rows given; the normaliser counted over all_masks (default: mask)."""
    all_masks = all_masks if all_masks is not None else mask
    tokens = sum(sum(1 for m in row if m) for row in all_masks)
    seqs = sum(1 for row in all_masks if any(row))
    total = 0.0
    for row_l, row_m in zip(loss, mask):
        n = sum(1 for m in row_m if m)
        s = sum(l for l, m in zip(row_l, row_m) if m)
        if mode == "seq-mean-token-mean":
            total += s / n if n else 0.0
        else:
            total += s
    if mode == "token-mean":
        return total / tokens
    if mode == "seq-mean-token-sum-norm":
        return total / (seqs * const)
    return total / seqs


def ref_k(lp, lr, est):
    d = lp - lr
    return {"k1": d, "k2": 0.5 * d * d, "k3": math.exp(-d) - 1 + d}[est]


# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("kind", ["grpo", "dr_grpo", "rloo"])
@pytest.mark.parametrize("rule", ["epsilon", "skip"])
def test_group_estimators_match_loops(seed, kind, rule):
    b = ragged_batch(seed, bs=10)
    scores = b["scores"].clone()
    scores[b["group_index"] == 1] = 0.25  # one zero-variance group
    gi = b["group_index"].clone()
    gi[-1] = int(gi.max()) + 1  # a group of one
    cfg = AdvantageConfig(zero_std_rule=rule)
    out = get_advantage(kind)(AdvantageInputs(response_mask=b["response_mask"], scores=scores, group_index=gi), cfg)
    adv, keep, zero = ref_group_adv(L(scores), L(gi), L(b["response_mask"]), kind, cfg.std_eps, rule)
    torch.testing.assert_close(out.advantages, torch.tensor(adv, dtype=out.advantages.dtype), **TOL)
    assert L(out.loss_mask.bool()) == keep
    assert out.metrics["zero_std_groups"] == zero >= 2


@pytest.mark.parametrize("seed", SEEDS)
def test_grpo_process_matches_loops(seed):
    b = ragged_batch(seed, bs=9, holes=True)
    g = torch.Generator().manual_seed(seed)
    mask = b["response_mask"]
    bs, R = mask.shape
    S = 3
    ends = torch.full((bs, S), -1, dtype=torch.int64)
    step_r = torch.zeros(bs, S, dtype=torch.float64)
    for i in range(bs):
        acts = actions(L(mask[i]))
        k = min(len(acts), 1 + int(torch.randint(0, S, (1,), generator=g)))
        chosen = sorted(torch.randperm(len(acts), generator=g)[:k].tolist())
        for j, c in enumerate(chosen):
            ends[i, j] = acts[c]
            step_r[i, j] = float(torch.randn(1, generator=g, dtype=torch.float64))
    out = get_advantage("grpo_process")(
        AdvantageInputs(response_mask=mask, group_index=b["group_index"], step_rewards=step_r, step_token_ends=ends),
        AdvantageConfig(),
    )
    # reference: pool every step reward of the group, normalise, sum over steps ending at or after t
    ref = [[0.0] * R for _ in range(bs)]
    for grp in set(L(b["group_index"])):
        idx = [i for i in range(bs) if int(b["group_index"][i]) == grp]
        pool = [float(step_r[i, j]) for i in idx for j in range(S) if ends[i, j] >= 0]
        mean, std = sum(pool) / len(pool), statistics.stdev(pool)
        for i in idx:
            for t in range(R):
                if mask[i, t]:
                    ref[i][t] = sum((float(step_r[i, j]) - mean) / std for j in range(S) if ends[i, j] >= t)
    torch.testing.assert_close(out.advantages, torch.tensor(ref, dtype=torch.float64), **TOL)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("gamma,lam", [(1.0, 1.0), (0.99, 0.95), (0.9, 0.0)])
def test_gae_terminated_and_truncated_match_loops(seed, gamma, lam):
    b = ragged_batch(seed, bs=8, holes=True)
    out = get_advantage("gae")(
        AdvantageInputs(
            response_mask=b["response_mask"],
            token_rewards=b["token_rewards"],
            values=b["values"],
            terminated=b["terminated"],
            bootstrap_values=b["bootstrap_values"],
        ),
        AdvantageConfig(gamma=gamma, lam=lam),
    )
    adv, ret = ref_gae(L(b["token_rewards"]), L(b["values"]), L(b["response_mask"]), L(b["terminated"]), L(b["bootstrap_values"]), gamma, lam)
    torch.testing.assert_close(out.advantages, torch.tensor(adv, dtype=torch.float64), **TOL)
    torch.testing.assert_close(out.returns, torch.tensor(ret, dtype=torch.float64), **TOL)


def test_gae_truncation_bootstraps_and_termination_does_not():
    mask = torch.tensor([[1, 1, 0], [1, 1, 0]])
    z = torch.zeros(2, 3, dtype=torch.float64)
    base = dict(response_mask=mask, token_rewards=z, values=z, bootstrap_values=torch.tensor([5.0, 5.0], dtype=torch.float64))
    out = get_advantage("gae")(AdvantageInputs(terminated=torch.tensor([True, False]), **base), AdvantageConfig(gamma=0.5, lam=1.0))
    assert out.advantages[0].tolist() == [0.0, 0.0, 0.0]
    assert out.advantages[1].tolist() == [1.25, 2.5, 0.0]  # 0.5^2 * 5, 0.5 * 5; padding untouched
    with pytest.raises(ValueError, match="bootstrap_values"):
        get_advantage("gae")(
            AdvantageInputs(response_mask=mask, token_rewards=z, values=z, terminated=torch.tensor([True, False])), AdvantageConfig()
        )


@pytest.mark.parametrize("seed", SEEDS)
def test_reinforce_plus_plus_with_kl_shaping_matches_loops(seed):
    b = ragged_batch(seed, bs=8)
    mask = b["response_mask"]
    beta, gamma = 0.1, 0.95
    rewards, k1 = kl_shaped_token_rewards(
        b["scores"], mask, LogProbs(b["old_log_probs"], ACTOR), LogProbs(b["ref_log_probs"], REFERENCE), beta
    )
    # reference shaping: -beta * (old - ref) on every action, + score on the last action
    bs, R = mask.shape
    ref_r = [[0.0] * R for _ in range(bs)]
    for i in range(bs):
        acts = actions(L(mask[i]))
        for t in acts:
            ref_r[i][t] = -beta * (float(b["old_log_probs"][i, t]) - float(b["ref_log_probs"][i, t]))
        ref_r[i][acts[-1]] += float(b["scores"][i])
    torch.testing.assert_close(rewards, torch.tensor(ref_r, dtype=torch.float64), **TOL)
    out = get_advantage("reinforce_plus_plus")(AdvantageInputs(response_mask=mask, token_rewards=rewards), AdvantageConfig(gamma=gamma))
    adv, G = ref_rpp(ref_r, L(mask), gamma, 1e-8)
    torch.testing.assert_close(out.returns, torch.tensor(G, dtype=torch.float64), **TOL)
    torch.testing.assert_close(out.advantages, torch.tensor(adv, dtype=torch.float64), **TOL)


@pytest.mark.parametrize("est", ["k1", "k2", "k3"])
def test_kl_estimators_match_formulas(est):
    b = ragged_batch(3)
    got = kl_estimate(b["log_probs"], b["ref_log_probs"], est)
    ref = [[ref_k(p, r, est) for p, r in zip(rp, rr)] for rp, rr in zip(L(b["log_probs"]), L(b["ref_log_probs"]))]
    torch.testing.assert_close(got, torch.tensor(ref, dtype=torch.float64), **TOL)
    if est != "k1":
        assert (got >= 0).all()


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("mode", AGG_MODES)
def test_aggregation_modes_match_loops(seed, mode):
    b = ragged_batch(seed)
    loss = b["advantages"]
    const = 13.0 if mode == "seq-mean-token-sum-norm" else None
    norm = global_normaliser(b["response_mask"], mode, norm_constant=const)
    got = aggregate_loss(loss, b["response_mask"], mode, norm)
    assert abs(float(got) - ref_agg(L(loss), L(b["response_mask"]), mode, const=const)) <= TOL["atol"]


# ---------------------------------------------------------------------------------------------
# policy losses: loss value and gradient against a per-token reference built from scalars


def ref_token_pg(lp, old, a, cfg, seq_log_ratio=None):
    """One token of the clipped surrogate; lp a 0-dim tensor (for the gradient)."""
    lo, hi = 1 - cfg.clip_low, 1 + cfg.clip_high
    if seq_log_ratio is None:
        r = torch.exp(lp - old)
    else:  # GSPO-token: value s_i, gradient s_i * d lp
        r = torch.exp(seq_log_ratio.detach() + lp - lp.detach())
    rc = torch.clamp(r, lo, hi)
    loss = torch.maximum(-a * r, -a * rc)
    if seq_log_ratio is None and cfg.dual_clip is not None and a < 0:
        loss = torch.minimum(loss, torch.tensor(-a * cfg.dual_clip, dtype=lp.dtype))
    return loss


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("name", ["vanilla", "gspo"])
@pytest.mark.parametrize("mode", AGG_MODES)
def test_actor_loss_and_gradient_match_loops(seed, name, mode):
    b = ragged_batch(seed)
    b["log_probs"] = b["old_log_probs"] + torch.randn(b["log_probs"].shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64) * 0.6
    cfg = PolicyLossConfig(
        name=name, agg_mode=mode, clip_low=0.2, clip_high=0.28, dual_clip=1.5, entropy_coef=0.02,
        kl=KLConfig(placement="loss", estimator="k3", beta=0.07),
    )  # fmt: skip
    const = 11.0 if mode == "seq-mean-token-sum-norm" else None
    mask = b["response_mask"]
    norm = global_normaliser(mask, mode, norm_constant=const)
    lp = b["log_probs"].clone().requires_grad_(True)
    out = actor_loss(
        lp, old_log_probs=LogProbs(b["old_log_probs"], ACTOR), advantages=b["advantages"], loss_mask=mask, cfg=cfg,
        normaliser=norm, ref_log_probs=LogProbs(b["ref_log_probs"], REFERENCE), entropy=b["entropy"],
    )  # fmt: skip
    out.loss.backward()

    lp2 = b["log_probs"].clone().requires_grad_(True)
    bs, R = mask.shape
    rows = []
    for i in range(bs):
        acts = actions(L(mask[i]))
        seq = None
        if name == "gspo":
            seq = sum(lp2[i, t] - float(b["old_log_probs"][i, t]) for t in acts) / len(acts)
        row = []
        for t in range(R):
            if not mask[i, t]:
                row.append(torch.zeros((), dtype=torch.float64))
                continue
            pg = ref_token_pg(lp2[i, t], float(b["old_log_probs"][i, t]), float(b["advantages"][i, t]), cfg, seq)
            d = float(b["ref_log_probs"][i, t]) - lp2[i, t]
            k3 = torch.exp(d) - 1 - d
            row.append(pg + 0.07 * k3 - 0.02 * float(b["entropy"][i, t]))
        rows.append(row)
    # aggregation written out with scalars
    tokens = int(mask.sum())
    seqs = int((mask.sum(1) > 0).sum())
    total = torch.zeros((), dtype=torch.float64)
    for i in range(bs):
        s = sum(rows[i][t] for t in range(R) if mask[i, t])
        total = total + (s / int(mask[i].sum()) if mode == "seq-mean-token-mean" else s)
    ref_loss = total / (tokens if mode == "token-mean" else seqs * const if mode == "seq-mean-token-sum-norm" else seqs)
    ref_loss.backward()
    assert abs(out.loss.item() - ref_loss.item()) <= TOL["atol"]
    torch.testing.assert_close(lp.grad, lp2.grad, **TOL)
    assert (lp.grad[mask == 0] == 0).all()


def test_vanilla_metrics_clip_fractions_match_loops():
    b = ragged_batch(5)
    mask = b["response_mask"]
    lp = b["old_log_probs"] + torch.linspace(-1.5, 1.5, mask.numel(), dtype=torch.float64).reshape(mask.shape)
    cfg = PolicyLossConfig(clip_low=0.2, clip_high=0.28, dual_clip=2.0)
    norm = global_normaliser(mask, "token-mean")
    out = actor_loss(lp, old_log_probs=LogProbs(b["old_log_probs"], ACTOR), advantages=b["advantages"], loss_mask=mask, cfg=cfg, normaliser=norm)
    hi = lo = dual = n = 0
    ratios = []
    kl = 0.0
    for i in range(mask.shape[0]):
        for t in actions(L(mask[i])):
            r = math.exp(float(lp[i, t]) - float(b["old_log_probs"][i, t]))
            a = float(b["advantages"][i, t])
            ratios.append(r)
            hi += a > 0 and r > 1.28
            lo += a < 0 and r < 0.8
            dual += a < 0 and r > 2.0
            kl += r - 1 - math.log(r)
            n += 1
    m = out.metrics
    assert m["clipfrac_high"] == pytest.approx(hi / n) and hi > 0
    assert m["clipfrac_low"] == pytest.approx(lo / n) and lo > 0
    assert m["dual_clipfrac"] == pytest.approx(dual / n) and dual > 0
    assert m["ratio_min"] == pytest.approx(min(ratios)) and m["ratio_max"] == pytest.approx(max(ratios))
    assert m["ratio_mean"] == pytest.approx(sum(ratios) / n)
    assert m["approx_kl"] == pytest.approx(kl / n)


@pytest.mark.parametrize("stat", ["max_abs", "mean"])
def test_rollout_correction_matches_loops(stat):
    b = ragged_batch(4, bs=9)
    mask = b["response_mask"]
    rollout = b["rollout_log_probs"].clone()
    rollout[3] -= 0.9  # a sample with a large mismatch
    cfg = RolloutCorrectionConfig(token_is_cap=1.05, seq_mask_threshold=0.5, seq_mask_stat=stat)
    out = rollout_correction(LogProbs(b["old_log_probs"], ACTOR), LogProbs(rollout, ROLLOUT), mask, cfg)
    bs, R = mask.shape
    w = [[0.0] * R for _ in range(bs)]
    keep = [[False] * R for _ in range(bs)]
    for i in range(bs):
        acts = actions(L(mask[i]))
        diffs = [float(b["old_log_probs"][i, t]) - float(rollout[i, t]) for t in acts]
        err = max(abs(d) for d in diffs) if stat == "max_abs" else abs(sum(diffs) / len(diffs))
        if err > 0.5:
            continue
        for t, d in zip(acts, diffs):
            keep[i][t] = True
            w[i][t] = min(math.exp(d), 1.05)
    assert L(out.loss_mask.bool()) == keep
    assert not any(keep[3])
    torch.testing.assert_close(out.is_weights, torch.tensor(w, dtype=torch.float64), **TOL)


def test_actor_loss_applies_is_weights_per_token():
    b = ragged_batch(6)
    mask = b["response_mask"]
    w = torch.rand(mask.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    cfg = PolicyLossConfig(dual_clip=None)
    norm = global_normaliser(mask, "token-mean")
    lp = b["log_probs"].clone().requires_grad_(True)
    out = actor_loss(lp, old_log_probs=LogProbs(b["old_log_probs"], ACTOR), advantages=b["advantages"], loss_mask=mask, cfg=cfg, normaliser=norm, is_weights=w)
    total = 0.0
    for i in range(mask.shape[0]):
        for t in actions(L(mask[i])):
            r = math.exp(float(b["log_probs"][i, t]) - float(b["old_log_probs"][i, t]))
            a = float(b["advantages"][i, t])
            total += float(w[i, t]) * max(-a * r, -a * min(max(r, 0.8), 1.2))
    assert out.loss.item() == pytest.approx(total / int(mask.sum()), abs=TOL["atol"])


@pytest.mark.parametrize("clip", [None, 0.2])
@pytest.mark.parametrize("mode", AGG_MODES)
def test_clipped_value_loss_matches_loops(clip, mode):
    b = ragged_batch(7)
    mask = b["response_mask"]
    old_v = b["values"]
    v = (old_v + torch.randn(old_v.shape, generator=torch.Generator().manual_seed(2), dtype=torch.float64) * 0.4).requires_grad_(True)
    returns = old_v + 0.5
    const = 9.0 if mode == "seq-mean-token-sum-norm" else None
    norm = global_normaliser(mask, mode, norm_constant=const)
    out = clipped_value_loss(v, old_v, returns, mask, clip, mode, norm)
    token = [[0.0] * mask.shape[1] for _ in range(mask.shape[0])]
    sq = 0.0
    for i in range(mask.shape[0]):
        for t in actions(L(mask[i])):
            vv, vo, g = float(v.detach()[i, t]), float(old_v[i, t]), float(returns[i, t])
            l1 = (vv - g) ** 2
            l2 = l1 if clip is None else (vo + min(max(vv - vo, -clip), clip) - g) ** 2
            token[i][t] = 0.5 * max(l1, l2)
            sq += l1
    assert out.loss.item() == pytest.approx(ref_agg(token, L(mask), mode, const=const), abs=TOL["atol"])
    assert out.metrics["value_mse"] == pytest.approx(sq / int(mask.sum()))


def test_overlong_penalty_matches_dapo_piecewise():
    lengths = list(range(0, 25))
    got = overlong_penalty(torch.tensor(lengths), max_response_length=20, overlong_buffer=8)
    for n, g in zip(lengths, got.tolist()):
        want = 0.0 if n <= 12 else ((12 - n) / 8 if n <= 20 else -1.0)
        assert g == pytest.approx(want)


def test_adaptive_kl_controller_follows_ziegler_update():
    c = AdaptiveKLController(init_beta=0.1, target_kl=0.05, horizon=1000)
    beta = 0.1
    for kl, n in [(0.2, 64), (0.05, 64), (0.0, 128), (0.051, 10)]:
        e = min(max(kl / 0.05 - 1, -0.2), 0.2)
        beta *= 1 + e * n / 1000
        assert c.update(kl, n) == pytest.approx(beta)


def test_overlong_penalty_is_a_reward_component_and_never_scores_a_failure():
    from megarl.algo.reward_shaping import with_overlong_component
    from megarl.experience.schema import RewardRecord

    ok = RewardRecord(total=1.0, components={"correctness": 1.0}, scorer_version="rm-1")
    shaped = with_overlong_component(ok, response_length=18, max_response_length=20, overlong_buffer=8)
    assert shaped.components == {"correctness": 1.0, "overlong": -0.75} and shaped.total == pytest.approx(0.25)
    with pytest.raises(ValueError, match="already has an 'overlong' component"):
        with_overlong_component(shaped, 18, 20, 8)
    failed = RewardRecord(total=None, scorer_version="rm-1", status="timeout", error="sandbox timeout")
    assert with_overlong_component(failed, 30, 20, 8) is failed
