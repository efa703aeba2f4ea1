"""The policy losses users compare across trainers (CISPO, GMPO, SAPO) and REINFORCE++ with a
group baseline: each against a hand computation written with Python scalars (the loss through
the real aggregation, its gradient by autograd over the scalar formula), each gradient against
its closed form, and the properties that make each one what it is (CISPO keeps a clipped token's
gradient that PPO drops; GMPO is moved less by one outlier token than the arithmetic mean; SAPO
is the plain policy gradient on-policy)."""

from __future__ import annotations

import math

import pytest
import torch

from megarl.algo.advantages import AdvantageConfig, AdvantageInputs
from megarl.algo.aggregation import AGG_MODES, global_normaliser
from megarl.algo.kl import KLConfig
from megarl.algo.objective import actor_loss
from megarl.algo.policy_loss import PolicyLossConfig
from megarl.algo.registry import get_advantage, get_policy_loss
from megarl.experience.schema import LogProbs
from tests._tolerance import formula_tol
from tests.dist_algo_invariance import ACTOR, REFERENCE, ragged_batch

#: float64 sums of <= ~100 terms of magnitude <= ~50 (ratios of log-ratios up to 1.8)
TOL = dict(atol=formula_tol(torch.float64, ops=1000, scale=1000.0), rtol=0)
CFG = dict(clip_low=0.2, clip_high=0.28, dual_clip=1.5, sapo_tau_pos=1.0, sapo_tau_neg=1.05)


def _batch(seed, spread=0.6):
    b = ragged_batch(seed)
    noise = torch.randn(b["log_probs"].shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    b["log_probs"] = b["old_log_probs"] + noise * spread
    return b


def _row_losses(name, lp, old, adv, mask, cfg):
    """Per-token losses written out with scalars: ``rows[i][t]`` (0-dim tensors of ``lp``)."""
    bs, R = mask.shape
    lo, hi = 1 - cfg.clip_low, 1 + cfg.clip_high
    rows = []
    for i in range(bs):
        acts = [t for t in range(R) if mask[i, t]]
        row = [torch.zeros((), dtype=torch.float64)] * R
        if name == "gmpo":
            a_seq = sum(float(adv[i, t]) for t in acts) / len(acts)
            sgn = (a_seq > 0) - (a_seq < 0)
            clipped = []
            for t in acts:
                lr = lp[i, t] - float(old[i, t])
                held = torch.clamp(lr, -cfg.clip_low, cfg.clip_high)
                clipped.append(sgn * torch.minimum(sgn * lr, sgn * held))
            seq_loss = -a_seq * torch.exp(sum(clipped) / len(acts))
            for t in acts:
                row[t] = seq_loss
        for t in acts if name != "gmpo" else ():
            r = torch.exp(lp[i, t] - float(old[i, t]))
            a = float(adv[i, t])
            if name == "cispo":
                row[t] = -torch.clamp(r, lo, hi).detach() * a * lp[i, t]
            elif name == "sapo":
                tau = cfg.sapo_tau_pos if a > 0 else cfg.sapo_tau_neg
                row[t] = -torch.sigmoid(tau * (r - 1)) * (4 / tau) * a
        rows.append(row)
    return rows


def _aggregate(rows, mask, mode, const):
    bs, R = mask.shape
    total = torch.zeros((), dtype=torch.float64)
    for i in range(bs):
        s = sum(rows[i][t] for t in range(R) if mask[i, t])
        total = total + (s / int(mask[i].sum()) if mode == "seq-mean-token-mean" else s)
    tokens, seqs = int(mask.sum()), int((mask.sum(1) > 0).sum())
    return total / (tokens if mode == "token-mean" else seqs * const if mode == "seq-mean-token-sum-norm" else seqs)


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("name", ["cispo", "gmpo", "sapo"])
@pytest.mark.parametrize("mode", AGG_MODES)
def test_loss_and_gradient_match_the_scalar_formula(seed, name, mode):
    """Through actor_loss (with a k3 KL in the loss and an entropy bonus): the loss and the
    gradient equal the formula written with scalars; nothing reaches a masked position."""
    b = _batch(seed)
    cfg = PolicyLossConfig(name=name, agg_mode=mode, entropy_coef=0.02,
                           kl=KLConfig(placement="loss", estimator="k3", beta=0.07), **CFG)
    const = 11.0 if mode == "seq-mean-token-sum-norm" else None
    mask = b["response_mask"]
    lp = b["log_probs"].clone().requires_grad_(True)
    out = actor_loss(lp, old_log_probs=LogProbs(b["old_log_probs"], ACTOR), advantages=b["advantages"], loss_mask=mask,
                     cfg=cfg, normaliser=global_normaliser(mask, mode, norm_constant=const),
                     ref_log_probs=LogProbs(b["ref_log_probs"], REFERENCE), entropy=b["entropy"])
    out.loss.backward()
    lp2 = b["log_probs"].clone().requires_grad_(True)
    rows = _row_losses(name, lp2, b["old_log_probs"], b["advantages"], mask, cfg)
    for i, t in mask.nonzero().tolist():
        d = float(b["ref_log_probs"][i, t]) - lp2[i, t]
        rows[i][t] = rows[i][t] + 0.07 * (torch.exp(d) - 1 - d) - 0.02 * float(b["entropy"][i, t])
    ref = _aggregate(rows, mask, mode, const)
    ref.backward()
    assert abs(out.loss.item() - ref.item()) <= TOL["atol"], (out.loss.item(), ref.item())
    torch.testing.assert_close(lp.grad, lp2.grad, **TOL)
    assert (lp.grad[mask == 0] == 0).all() and torch.isfinite(out.loss)


def _token_grad(name, b, cfg):
    """d(sum of token losses)/d log_probs."""
    lp = b["log_probs"].clone().requires_grad_(True)
    terms = get_policy_loss(name)(lp, b["old_log_probs"], b["advantages"], b["response_mask"], cfg)
    terms.token_loss.sum().backward()
    return lp.grad, terms


def test_gradients_have_their_closed_forms():
    b = _batch(3, spread=0.8)
    mask, adv = b["response_mask"] != 0, b["advantages"]
    r = torch.exp(b["log_probs"] - b["old_log_probs"])
    # CISPO: -clip(r) A on every token -- a token the clip holds keeps its gradient (scaled)
    cfg = PolicyLossConfig(name="cispo", **CFG)
    g, terms = _token_grad("cispo", b, cfg)
    want = torch.where(mask, -r.clamp(0.8, 1.28) * adv, 0.0)
    torch.testing.assert_close(g, want, **TOL)
    held = mask & ((r > 1.28) | (r < 0.8)) & (adv != 0)
    assert held.any() and (g[held] != 0).all()
    vanilla, _ = _token_grad("vanilla", b, PolicyLossConfig(name="vanilla", **CFG))
    assert (vanilla[held & (((adv > 0) & (r > 1.28)) | ((adv < 0) & (r < 0.8)))] == 0).all()  # PPO drops them
    assert terms.metrics["clipfrac_high"] > 0 and terms.metrics["clipfrac_low"] > 0
    # SAPO: -4 s (1 - s) r A, s = sigmoid(tau (r - 1))
    cfg = PolicyLossConfig(name="sapo", **CFG)
    g, terms = _token_grad("sapo", b, cfg)
    tau = torch.where(adv > 0, torch.tensor(1.0, dtype=torch.float64), torch.tensor(1.05, dtype=torch.float64))
    s = torch.sigmoid(tau * (r - 1))
    torch.testing.assert_close(g, torch.where(mask, -4 * s * (1 - s) * r * adv, 0.0), **TOL)
    # GMPO: sequence i's loss -A_i exp(mean l~) spread over its n_i tokens (sum = n_i L_i):
    # d/d lp_t = -A_i exp(mean l~) [t not held by the clip]  (n_i x (1 / n_i))
    cfg = PolicyLossConfig(name="gmpo", **CFG)
    g, _ = _token_grad("gmpo", b, cfg)
    lr = torch.where(mask, b["log_probs"] - b["old_log_probs"], 0.0)
    n = mask.sum(1).to(torch.float64)
    a_seq = torch.where(mask, adv, 0.0).sum(1) / n
    sgn = torch.sign(a_seq)[:, None]
    cl = sgn * torch.minimum(sgn * lr, sgn * lr.clamp(-0.2, 0.28))
    seq = torch.exp(torch.where(mask, cl, 0.0).sum(1) / n)
    free = mask & (cl == lr)
    torch.testing.assert_close(g, torch.where(free, (-a_seq * seq)[:, None].expand_as(lr), 0.0), **TOL)


def test_sapo_is_the_policy_gradient_on_policy():
    """At r = 1 the gate's derivative is 1: SAPO's gradient is -A grad log pi, like vanilla's."""
    b = _batch(4, spread=0.0)
    g_sapo, t = _token_grad("sapo", b, PolicyLossConfig(name="sapo"))
    g_van, _ = _token_grad("vanilla", b, PolicyLossConfig(name="vanilla"))
    torch.testing.assert_close(g_sapo, g_van, **TOL)
    assert t.metrics["gate_grad_mean"] == pytest.approx(1.0)


def test_gmpo_is_moved_less_by_one_outlier_token():
    """One token's ratio far above the rest: the geometric mean of a sequence's ratios moves by
    its n-th root, the arithmetic mean by 1/n of it (the paper's motivation), without a clip."""
    n = 8
    lr = torch.zeros(1, n, dtype=torch.float64)
    lr[0, 3] = 2.0
    old = torch.zeros(1, n, dtype=torch.float64)
    mask = torch.ones(1, n, dtype=torch.long)
    adv = torch.ones(1, n, dtype=torch.float64)
    cfg = PolicyLossConfig(name="gmpo", clip_low=0.99, clip_high=100.0)
    geo = -get_policy_loss("gmpo")(lr, old, adv, mask, cfg).token_loss[0, 0]
    arith = torch.exp(lr).mean()
    assert float(geo) == pytest.approx(math.exp(2.0 / n)) and float(geo) < float(arith)


def test_reinforce_plus_plus_baseline_matches_loops():
    """a_i = r_i - mean(r_g); A = (a - mean) / sqrt(var + eps) over every kept action token
    (token-weighted, Bessel), by hand; a zero-variance group under skip leaves the statistics."""
    b = ragged_batch(2, bs=9)
    mask = b["response_mask"]
    gi = b["group_index"]
    by_group = {0: [1.0, 0.0, 0.5], 1: [2.0, 2.0, 2.0], 2: [0.0, 1.0, 1.0]}  # group 1 all equal
    seen = {g: 0 for g in by_group}
    values = []
    for g in gi.tolist():
        values.append(by_group[g][seen[g]])
        seen[g] += 1
    scores = torch.tensor(values, dtype=torch.float32)
    for rule in ("epsilon", "skip"):
        cfg = AdvantageConfig(zero_std_rule=rule)
        out = get_advantage("reinforce_plus_plus_baseline")(
            AdvantageInputs(response_mask=mask, scores=scores, group_index=gi), cfg)
        groups = {}
        for i, g in enumerate(gi.tolist()):
            groups.setdefault(g, []).append(float(scores[i]))
        centred, kept = [], []
        for i, g in enumerate(gi.tolist()):
            vals = groups[g]
            mean = sum(vals) / len(vals)
            flat = max(vals) - min(vals) <= 1e-6
            a = 0.0 if flat else float(scores[i]) - mean
            keep_row = not (flat and rule == "skip")
            for t in range(mask.shape[1]):
                if mask[i, t] and keep_row:
                    centred.append((i, t, a))
        vals = [a for _, _, a in centred]
        mu = sum(vals) / len(vals)
        var = sum((v - mu) ** 2 for v in vals) / (len(vals) - 1)
        want = torch.zeros(mask.shape, dtype=torch.float64)
        for i, t, a in centred:
            want[i, t] = (a - mu) / math.sqrt(var + cfg.whiten_eps)
            kept.append((i, t))
        torch.testing.assert_close(out.advantages.double(), want, atol=formula_tol(torch.float32, 40, 10.0), rtol=0)
        assert sorted(map(tuple, out.loss_mask.nonzero().tolist())) == sorted(kept)
        assert out.metrics["zero_std_groups"] == 1
