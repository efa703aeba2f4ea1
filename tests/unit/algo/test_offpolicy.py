"""The off-policy contract of asynchronous RL (issue 21, Build 2/3/6/7): sealing accepts samples
at most eta optimizer steps older than the trained version (never beyond, never from the future;
eta = 0 is the synchronous rule), the record names its behaviour policy honestly, the rollout
correction refuses a behaviour/proximal version gap nobody declared, and the required correction
(decoupled PPO, TIS, sequence masking) reaches the loss with the normaliser counted before
masking.  Expected values are computed by hand (Python loops over floats), never by the code
under test."""

from __future__ import annotations

import math

import pytest
import torch

from megarl.algo.aggregation import global_normaliser
from megarl.algo.kl import FixedKLController
from megarl.algo.objective import actor_loss
from megarl.algo.policy_loss import PolicyLossConfig
from megarl.algo.rollout_correction import (RolloutCorrectionConfig, async_correction_config, offpolicy_metrics,
                                            rollout_correction)
from megarl.control.batch import collate, collate_trajectories
from megarl.control.interfaces import ProducedRollout, RunProgress
from megarl.control.preparation import ExperiencePreparer, LogProbParity
from megarl.control.state_machine import CompletionConditionError, IterationStateMachine, Phase, SealEvidence
from megarl.experience.schema import LogProbProducer, LogProbs, SamplingConfig
from megarl.experience.seal import load_sealed
from megarl.observability.metrics import StageTimer
from megarl.runtime import data_parallel
from megarl.versions import VersionError, behaviour_ids, behaviour_label
from tests._control_fakes import load_cfg, make_samples, sm_generating, version
from tests._tolerance import formula_tol

V5, V4, V3, V2, V6 = version(5), version(4, "w4"), version(3, "w3"), version(2, "w2"), version(6, "w6")
OTHER5 = version(5, "w5-retried", attempt=1)  # another attempt's weights at the trained step


@pytest.fixture(autouse=True)
def one_replica(monkeypatch):
    monkeypatch.setattr(data_parallel, "dp_size", lambda: 1)
    monkeypatch.setattr(data_parallel, "dp_rank", lambda: 0)


#: an importance weight exp(old - rollout) (capped, filtered) computed in float32 from float32
#: log-probs of magnitude <= 4, against math.exp in float64: a subtraction, an exp (1 ulp), a
#: clamp and a product, on values <= e^1: twice the first-order rounding bound
#: (tests/_tolerance.py), ~2e-6; a wrong cap or a wrong sign is off by > 1e-2
WEIGHT_TOL = formula_tol(torch.float32, ops=4, scale=4.0)


def sum_tol(terms) -> float:
    """A float32 mean (or ratio of sums) of these per-token terms, against Python floats: the
    terms' own few operations plus the sum, on magnitudes summing to sum |terms| (ESS squares a
    sum of weights: counted as its square)."""
    terms = list(terms)
    return formula_tol(torch.float32, ops=len(terms) + 8, scale=sum(abs(t) for t in terms) ** 2 + 1.0)


def close(t: torch.Tensor, rows, tol=WEIGHT_TOL):
    torch.testing.assert_close(t.double(), torch.tensor(rows, dtype=torch.float64), rtol=0, atol=tol)


# ---- sealing: the bound -------------------------------------------------------------------------


def evidence(ids, eta=None):
    kw = {} if eta is None else {"max_staleness": eta}
    return SealEvidence(4, 4, 2, 2, frozenset(v.short_id if hasattr(v, "short_id") else v for v in ids), **kw)


def test_sealing_accepts_versions_within_the_bound():
    sm = sm_generating(V5)
    assert sm.seal_experience(evidence([V5, V4, V3], eta=2)).phase is Phase.EXPERIENCE_SEALED
    sm = sm_generating(V5)  # an asynchronous batch may hold no sample of v itself
    assert sm.seal_experience(evidence([V4], eta=1)).phase is Phase.EXPERIENCE_SEALED


@pytest.mark.parametrize("ids, eta, bad", [
    ([V5, V4, V2], 2, V2),  # 3 steps old, bound 2
    ([V5, V6], 2, V6),  # from the future
    ([V5, OTHER5], 2, OTHER5),  # v's step, but not v's weights
    ([V5, "v4-not-an-id"], 2, "v4-not-an-id"),
])
def test_sealing_refuses_versions_beyond_the_bound_or_from_the_future_by_name(ids, eta, bad):
    sm = sm_generating(V5)
    bad_id = bad.short_id if hasattr(bad, "short_id") else bad
    with pytest.raises(CompletionConditionError, match=rf"\['{bad_id}'\] outside the staleness bound: steps \[3, 5\] "
                                                       rf"\(max_staleness=2\)"):
        sm.seal_experience(evidence(ids, eta))
    assert sm.state.phase is Phase.FAILED


def test_eta_0_is_the_synchronous_rule():
    assert SealEvidence(1, 1, 1, 1, frozenset({V5.short_id})).max_staleness == 0
    assert sm_generating(V5).seal_experience(evidence([V5])).phase is Phase.EXPERIENCE_SEALED
    for ids in ([V5, V4], [V4], []):
        sm = sm_generating(V5)
        with pytest.raises(CompletionConditionError, match=rf"expected only {V5.short_id}$"):
            sm.seal_experience(evidence(ids, eta=0))


def test_adopt_sealed_applies_the_same_bound():
    sm = IterationStateMachine(V5)
    assert sm.adopt_sealed(evidence([V5, V3], eta=2)).phase is Phase.EXPERIENCE_SEALED
    sm = IterationStateMachine(V5)
    with pytest.raises(CompletionConditionError, match=rf"\['{V3.short_id}'\] outside"):
        sm.adopt_sealed(evidence([V5, V3], eta=1))


# ---- the behaviour policy's label ---------------------------------------------------------------


def test_the_rollout_log_probs_name_every_behaviour_version_oldest_first():
    prompts, responses = [[1], [1, 2], [3]], [[7, 8], [7], [9]]
    lps = [torch.tensor([-0.1, -0.2]), torch.tensor([-0.3]), torch.tensor([-0.4])]
    c = collate(prompts, responses, lps, 0, version=V5.short_id,
                sample_versions=[V5.short_id, V3.short_id, V4.short_id])
    want = f"{V3.short_id}+{V4.short_id}+{V5.short_id}"
    assert c.behaviour_version == want and behaviour_ids(want) == (V3.short_id, V4.short_id, V5.short_id)
    # one version: the label is the short id itself (the synchronous record, unchanged)
    same = collate(prompts, responses, lps, 0, version=V5.short_id, sample_versions=[V5.short_id] * 3)
    assert same.behaviour_version == V5.short_id == behaviour_label([V5.short_id])
    assert collate(prompts, responses, lps, 0, version=V5.short_id).behaviour_version == V5.short_id
    with pytest.raises(VersionError):
        behaviour_label(["not-a-version", V5.short_id])


def test_a_trajectory_label_includes_its_earlier_turns_versions():
    c = collate_trajectories([[1, 2]], [[10, 20, 11]], [torch.tensor([-0.1, 0.0, -0.2])], [[1, 2, 1]], [[0, 0, 1]],
                             [[V4.short_id, None, V5.short_id]], 0, version=V5.short_id,
                             sample_versions=[V5.short_id])  # the sample's version is its last turn's
    assert c.behaviour_version == f"{V4.short_id}+{V5.short_id}"


def test_rollout_correction_refuses_a_version_gap_nobody_declared():
    mask = torch.ones(1, 2)
    old = LogProbs(torch.tensor([[-0.5, -0.6]]), LogProbProducer("actor", V5.short_id))
    stale = LogProbs(torch.tensor([[-0.4, -0.9]]), LogProbProducer("rollout", behaviour_label([V3.short_id, V5.short_id])))
    cfg = RolloutCorrectionConfig(token_is_cap=2.0)
    with pytest.raises(ValueError, match=rf"rollout_log_probs must come from version '{V5.short_id}'"):
        rollout_correction(old, stale, mask, cfg)  # max_staleness 0: the synchronous record only
    with pytest.raises(ValueError, match=rf"\['{V3.short_id}'\] outside the declared staleness bound max_staleness=1"):
        rollout_correction(old, stale, mask, cfg, max_staleness=1)
    out = rollout_correction(old, stale, mask, cfg, max_staleness=2)
    close(out.is_weights, [[math.exp(-0.1), math.exp(0.3)]])
    future = LogProbs(stale.values, LogProbProducer("rollout", V6.short_id))
    with pytest.raises(ValueError, match=rf"\['{V6.short_id}'\] outside"):
        rollout_correction(old, future, mask, cfg, max_staleness=2)


# ---- the corrections on a hand-built batch -------------------------------------------------------

MASK = [[1, 1, 1], [1, 1, 0], [1, 0, 0]]
ROLLOUT = [[-1.0, -0.5, -2.0], [-0.2, -1.2, 0.0], [-0.7, 0.0, 0.0]]
DELTA = [[0.1, -0.3, 0.9], [0.0, 0.4, 0.0], [-1.0, 0.0, 0.0]]  # old - rollout; exp(0.9) = 2.46 > the cap 2


def hand_batch(delta=DELTA):
    mask = torch.tensor(MASK)
    rollout = torch.tensor(ROLLOUT, dtype=torch.float64)
    old = (rollout + torch.tensor(delta, dtype=torch.float64)) * mask
    return (LogProbs(old, LogProbProducer("actor", V5.short_id)),
            LogProbs(rollout, LogProbProducer("rollout", behaviour_label([V4.short_id, V5.short_id]))), mask)


def hand_weights(correction, delta=DELTA, cap=2.0, tau=0.5):
    """The weight of every token, by the definitions (0 off the mask)."""
    out = []
    for row, m in zip(delta, MASK):
        acts = [d for d, k in zip(row, m) if k]
        drop = correction == "mask" and sum(abs(d) for d in acts) / len(acts) > tau
        ws = []
        for d, k in zip(row, m):
            w = math.exp(d)
            if not k or drop:
                ws.append(0.0)
            elif correction == "decoupled":
                ws.append(0.0 if w > cap else w)  # AReaL: a token above the cap leaves the loss
            elif correction == "decoupled_uncapped":
                ws.append(w)
            elif correction == "tis":
                ws.append(min(w, cap))
            else:  # mask: kept samples are not reweighted
                ws.append(1.0)
        out.append(ws)
    return out


def hand_metrics(delta=DELTA):
    ds = [d for row, m in zip(delta, MASK) for d, k in zip(row, m) if k]
    ws = [math.exp(d) for d in ds]
    return {"kl_k1": sum(ds) / len(ds), "kl_k3": sum(w - 1 - d for w, d in zip(ws, ds)) / len(ds),
            "ess": sum(ws) ** 2 / (len(ws) * sum(w * w for w in ws))}


def cfg_of(correction):
    if correction == "decoupled_uncapped":
        return async_correction_config("decoupled", None, 0.5)
    return async_correction_config(correction, 2.0, 0.5)


@pytest.mark.parametrize("correction, capped, masked", [
    ("decoupled", 1 / 6, 0.0), ("decoupled_uncapped", 0.0, 0.0), ("tis", 1 / 6, 0.0), ("mask", 0.0, 1 / 3)])
def test_each_correction_gives_the_hand_computed_weights_and_metrics(correction, capped, masked):
    old, rollout, mask = hand_batch()
    cfg = cfg_of(correction)
    out = rollout_correction(old, rollout, mask, cfg, max_staleness=1)
    close(out.is_weights, hand_weights(correction), tol=formula_tol(torch.float64, ops=4, scale=4.0))  # float64 in
    assert torch.equal(out.loss_mask, mask)  # the normaliser is counted before masking: the mask is unchanged
    ages = torch.tensor([[0, 0, 0], [1, 1, -1], [1, -1, -1]])
    m = offpolicy_metrics(old, rollout, mask, cfg, out, ages)
    want = hand_metrics()
    applied = [w for row, mr in zip(hand_weights(correction), MASK) for w, k in zip(row, mr) if k]
    k3 = {a: [math.exp(d) - 1 - d for row, ar in zip(DELTA, ages.tolist()) for d, x in zip(row, ar) if x == a]
          for a in (0, 1)}
    assert m == pytest.approx({**want, "capped_token_share": capped, "masked_sample_share": masked,
                               "weight_mean": sum(applied) / 6, "kl_k3_age_0": sum(k3[0]) / 3,
                               "kl_k3_age_1": sum(k3[1]) / 3}, abs=1e-12)
    # golden numbers written to 6 decimals: the literal itself is within 5e-7 of the value
    assert m["kl_k3"] == pytest.approx(0.177549, abs=5e-7) and m["ess"] == pytest.approx(0.765326, abs=5e-7)


def test_decoupled_with_behaviour_equal_to_proximal_is_plain_ppo():
    old, _, mask = hand_batch()
    same = LogProbs(old.values.clone(), LogProbProducer("rollout", V5.short_id))
    out = rollout_correction(old, same, mask, async_correction_config("decoupled", 2.0, 0.5))
    assert torch.equal(out.is_weights, mask.to(torch.float64)) and torch.equal(out.loss_mask, mask)
    m = offpolicy_metrics(old, same, mask, async_correction_config("decoupled", 2.0, 0.5), out)
    assert m == {"kl_k1": 0.0, "kl_k3": 0.0, "ess": 1.0, "capped_token_share": 0.0, "masked_sample_share": 0.0,
                 "weight_mean": 1.0}
    adv = torch.tensor([[1.0, 1.0, 1.0], [-0.5, -0.5, 0.0], [2.0, 0.0, 0.0]], dtype=torch.float64)
    cfg, norm = PolicyLossConfig(), global_normaliser(mask, "token-mean")
    grads = []
    for w in (out.is_weights, None):
        lp = (old.values + 0.3 * torch.tensor(DELTA, dtype=torch.float64)).requires_grad_(True)
        loss = actor_loss(lp, old_log_probs=old, advantages=adv, loss_mask=mask, cfg=cfg, normaliser=norm,
                          is_weights=w, old_version=V5.short_id).loss
        loss.backward()
        grads.append((loss.detach(), lp.grad))
    assert torch.equal(grads[0][0], grads[1][0]) and torch.equal(grads[0][1], grads[1][1])


def test_masking_keeps_the_normaliser_and_zeroes_the_rejected_samples_loss():
    """AReaL's loss_mask_count before masking: N counts sample 2's token, its loss is 0, and the
    kept tokens are divided by all 6 tokens (not by the 5 that survive)."""
    old, rollout, mask = hand_batch()
    out = rollout_correction(old, rollout, mask, async_correction_config("mask", None, 0.5), max_staleness=1)
    norm = global_normaliser(out.loss_mask, "token-mean")
    assert norm.value == 6.0
    adv = torch.tensor([[1.0, 1.0, 1.0], [-0.5, -0.5, 0.0], [2.0, 0.0, 0.0]], dtype=torch.float64)
    shift = 0.05  # ratio e^0.05 inside the clip: PG_t = -A_t r
    lp = (old.values + shift * mask).requires_grad_(True)
    loss = actor_loss(lp, old_log_probs=old, advantages=adv, loss_mask=out.loss_mask, cfg=PolicyLossConfig(),
                      normaliser=norm, is_weights=out.is_weights, old_version=V5.short_id).loss
    want = sum(-a * math.exp(shift) for row, ar, m in zip(MASK[:2], adv.tolist()[:2], MASK) for a, k in zip(ar, row) if k) / 6
    assert float(loss) == pytest.approx(want, abs=1e-9)
    loss.backward()
    assert lp.grad[2].tolist() == [0.0, 0.0, 0.0]  # the rejected sample carries no gradient


def test_the_sync_mismatch_correction_still_shrinks_the_mask():
    """algo.rollout_correction (normaliser after masking), unchanged: its dropped sample leaves
    loss_mask, so N no longer counts it."""
    old, rollout, mask = hand_batch()
    same_version = LogProbs(rollout.values, LogProbProducer("rollout", V5.short_id))
    out = rollout_correction(old, same_version, mask, RolloutCorrectionConfig(token_is_cap=None, seq_mask_threshold=0.5,
                                                                               seq_mask_stat="mean_abs"))
    assert out.is_weights is None and out.loss_mask.tolist() == [[1, 1, 1], [1, 1, 0], [0, 0, 0]]


# ---- the correction in preparation and in the loss -----------------------------------------------

SAMPLE_VERSIONS = [V5, V4, V3, V5, V5, V4, V3, V5, V5]
SAMPLE_DELTA = [0.0, 0.2, 0.8, -0.1, 0.0, 0.3, 1.0, -0.5, 0.1]  # old - rollout per sample; exp(0.8) > 2


class Actor:
    """log_probs(...) -> the rollout's log-probs plus a per-sample delta on every response token."""

    def __init__(self, rollout, mask, delta, version_id):
        self.values = rollout + torch.tensor(delta, dtype=torch.float32)[:, None] * mask
        self.version = version_id

    def log_probs(self, prompt_ids, response_ids, attention_mask, mbs, pack=False, routing=None, micro_batch_tokens=0):
        return self.values.clone()

    def batch_log_probs(self, prompt_ids, response_ids, attention_mask, mbs, pack=False, micro_batch_tokens=0):
        return self.values.clone()  # the reference's whole-batch forward (one process)

    def onload(self):
        pass


class TimeSlice:
    def release(self):
        pass


def prepare(correction=None, eta=2, delta=SAMPLE_DELTA, versions=SAMPLE_VERSIONS, is_cap="2.0", save_dir=None):
    over = ["rollout.n=3", "trainer.prompts_per_iteration=3", "algo.forward_micro_batch_size=0",
            "rollout.reuse_rollout_log_probs=false"]
    if correction is not None:
        over += ["placement.mode=split", f"async_rl.max_staleness={eta}", f"async_rl.correction={correction}",
                 f"async_rl.is_cap={is_cap}"]
    cfg = load_cfg(*over)
    samples = make_samples(V5, [[1.0, 0.0, 0.0], [1.0, 1.0, 0.0], [0.0, 1.0, 1.0]], k=7,
                           versions=[v.short_id for v in versions])
    c = collate([s.prompt_ids for s in samples], [s.response_ids for s in samples],
                [s.raw_log_probs for s in samples], 0)
    actor = Actor(c.rollout_log_probs, c.response_mask, delta, V5.short_id)
    ref = Actor(c.rollout_log_probs, c.response_mask, [-0.1] * 9, "ref-0")
    sm = sm_generating(V5)
    real = {g: 3 for g in dict.fromkeys(s.group_id for s in samples)}
    produced = ProducedRollout(samples, real, sampling=SamplingConfig(n=3, max_new_tokens=6),
                               max_staleness=eta if correction is not None else 0)
    prep = ExperiencePreparer(cfg.algo, cfg.async_rl, LogProbParity.of(cfg.rollout), actor=actor, reference=ref,
                              critic=None, time_slice=TimeSlice(), sm=sm,
                              kl_ctl=FixedKLController(0.001), progress=RunProgress(), pad_id=0, run_id="run",
                              save_dir=save_dir)
    batch, m = prep.prepare(7, V5, produced, StageTimer(7, V5.short_id))
    return batch, m, c, sm


def test_decoupled_correction_reaches_the_sealed_batch_and_the_loss(tmp_path):
    batch, m, c, sm = prepare("decoupled", save_dir=str(tmp_path))
    f, d = batch.facts, batch.derived
    assert sm.state.phase is Phase.EXPERIENCE_SEALED and sm.state.version == V5
    assert f.rollout_log_probs.producer.version == f"{V3.short_id}+{V4.short_id}+{V5.short_id}"
    assert (f.old_log_probs.producer.role, f.old_log_probs.producer.version) == ("actor", V5.short_id)
    again = load_sealed(tmp_path / "iter_000007")  # the record round-trips with its behaviour label
    assert again.content_hash == batch.content_hash
    assert again.facts.rollout_log_probs.producer == f.rollout_log_probs.producer
    assert torch.equal(again.derived.is_weights, batch.derived.is_weights)
    mask = c.response_mask
    rows = [[0.0 if math.exp(x) > 2.0 else math.exp(x)] * mask.shape[1] for x in SAMPLE_DELTA]
    want_w = torch.tensor(rows) * mask
    close(d.is_weights, want_w.tolist())
    assert torch.equal(d.loss_mask, mask)  # the normaliser counts the filtered tokens too
    assert dict(d.hyperparameters)["offpolicy_correction"] == {
        "max_staleness": 2, "token_is_cap": 2.0, "token_is_mode": "filter", "seq_mask_threshold": None,
        "seq_mask_stat": "max_abs", "normaliser": "before_mask"}
    # metrics by hand: per token d = the sample's delta, age = 5 - its version's step
    toks = [(x, 5 - int(v.optimizer_step)) for x, v, n in zip(SAMPLE_DELTA, SAMPLE_VERSIONS, mask.sum(1).tolist())
            for _ in range(int(n))]
    ws = [math.exp(x) for x, _ in toks]
    k3 = lambda sel: sum(math.exp(x) - 1 - x for x, a in toks if sel(a)) / sum(1 for _, a in toks if sel(a))
    n = len(toks)
    assert {k: v for k, v in m.items() if k.startswith("prep/offpolicy/")} == pytest.approx({
        "prep/offpolicy/kl_k1": sum(x for x, _ in toks) / n, "prep/offpolicy/kl_k3": k3(lambda a: True),
        "prep/offpolicy/ess": sum(ws) ** 2 / (n * sum(w * w for w in ws)),
        "prep/offpolicy/capped_token_share": sum(w > 2.0 for w in ws) / n, "prep/offpolicy/masked_sample_share": 0.0,
        "prep/offpolicy/weight_mean": sum(0.0 if w > 2 else w for w in ws) / n,
        **{f"prep/offpolicy/kl_k3_age_{a}": k3(lambda x, a=a: x == a) for a in (0, 1, 2)}}, abs=sum_tol(ws))
    assert m["prep/staleness/samples_age_2"] == pytest.approx(2 / 9)
    # the loss: token-mean over every policy token (N before filtering), each PG term weighted
    norm = global_normaliser(d.loss_mask, "token-mean")
    assert norm.value == float(mask.sum())
    shift = 0.05
    lp = f.old_log_probs.values + shift * mask
    loss = actor_loss(lp, old_log_probs=f.old_log_probs, advantages=d.advantages, loss_mask=d.loss_mask,
                      cfg=PolicyLossConfig(), normaliser=norm, is_weights=d.is_weights, old_version=V5.short_id).loss
    want = sum(-a * math.exp(shift) * w for arow, wrow, mrow in zip(d.advantages.tolist(), want_w.tolist(), mask.tolist())
               for a, w, k in zip(arow, wrow, mrow) if k) / norm.value
    terms = [a * math.exp(shift) * w for arow, wrow, mrow in zip(d.advantages.tolist(), want_w.tolist(), mask.tolist())
             for a, w, k in zip(arow, wrow, mrow) if k]
    tol = formula_tol(torch.float32, ops=len(terms) + 4, scale=sum(abs(t) for t in terms) / norm.value)
    assert float(loss) == pytest.approx(want, abs=tol) and abs(want) > 100 * tol


@pytest.mark.parametrize("correction", ["tis", "mask"])
def test_tis_and_mask_in_preparation(correction):
    batch, m, c, _ = prepare(correction)
    mask = c.response_mask
    if correction == "tis":
        rows = [min(math.exp(x), 2.0) for x in SAMPLE_DELTA]
    else:  # every token of a sample has |d| = its delta: mean |d| > 0.5 drops it
        rows = [0.0 if abs(x) > 0.5 else 1.0 for x in SAMPLE_DELTA]
    want = torch.tensor(rows)[:, None] * mask
    close(batch.derived.is_weights, want.tolist())
    assert torch.equal(batch.derived.loss_mask, mask)
    dropped = sum(abs(x) > 0.5 for x in SAMPLE_DELTA) / 9
    assert m["prep/offpolicy/masked_sample_share"] == pytest.approx(dropped if correction == "mask" else 0.0)


def test_eta_0_without_a_correction_adds_nothing():
    batch, m, c, sm = prepare(None, versions=[V5] * 9)
    assert not [k for k in m if k.startswith("prep/offpolicy")]
    assert batch.derived.is_weights is None and "offpolicy_correction" not in batch.derived.hyperparameters
    assert batch.facts.rollout_log_probs.producer.version == V5.short_id


def test_a_sample_beyond_the_bound_is_never_sealed_even_with_a_correction():
    from megarl.experience.staleness import StalenessError

    with pytest.raises(StalenessError, match=rf"{V2.short_id} is 3 steps old, above the bound 2"):
        prepare("decoupled", versions=[V5] * 8 + [V2])


def test_the_record_refuses_a_proximal_policy_older_than_a_sample_or_a_dishonest_label():
    import dataclasses

    f = prepare("decoupled")[0].facts
    older = LogProbs(f.old_log_probs.values, LogProbProducer("actor", V4.short_id))  # a v5 sample postdates it
    with pytest.raises(ValueError, match=rf"old_log_probs version '{V4.short_id}' must be the behaviour"):
        dataclasses.replace(f, old_log_probs=older)
    only_v5 = LogProbs(f.rollout_log_probs.values, LogProbProducer("rollout", V5.short_id))  # hides v3 and v4
    with pytest.raises(ValueError, match=rf"rollout_log_probs version '{V5.short_id}' != sample policy_version"):
        dataclasses.replace(f, rollout_log_probs=only_v5)
