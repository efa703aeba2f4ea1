"""Contracts of the algorithm core: producer checks before arithmetic, zero-variance groups,
registries and configuration errors that name the field."""

from __future__ import annotations

import pytest
import torch
from torch.overrides import TorchFunctionMode

from tests.dist_algo_invariance import ACTOR, REFERENCE, ROLLOUT, ragged_batch
from megarl.algo.advantages import AdvantageConfig, AdvantageInputs, check_finite
from megarl.algo.aggregation import GlobalNormaliser, aggregate_loss, global_normaliser
from megarl.algo.kl import KLConfig
from megarl.algo.objective import actor_loss
from megarl.algo.policy_loss import PolicyLossConfig
from megarl.algo.registry import get_advantage, get_policy_loss, register_advantage
from megarl.algo.reward_shaping import kl_shaped_token_rewards
from megarl.algo.rollout_correction import RolloutCorrectionConfig, rollout_correction
from megarl.experience.schema import LogProbProducer, LogProbs


class CountOps(TorchFunctionMode):
    """Records every torch function called on tensors while active (attribute reads excluded)."""

    def __init__(self):
        super().__init__()
        self.ops: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", str(func))
        if name not in ("__get__",):
            self.ops.append(name)
        return func(*args, **(kwargs or {}))


def _loss_args(b, old, ref=None, cfg=None):
    mask = b["response_mask"]
    cfg = cfg or PolicyLossConfig(kl=KLConfig(placement="loss", estimator="k3", beta=0.1))
    return dict(
        old_log_probs=old, advantages=b["advantages"], loss_mask=mask, cfg=cfg,
        normaliser=global_normaliser(mask, cfg.agg_mode), ref_log_probs=ref,
    )  # fmt: skip


def test_reference_log_probs_as_old_raise_before_any_arithmetic():
    b = ragged_batch(0)
    lp = b["log_probs"].clone().requires_grad_(True)
    args = _loss_args(b, old=LogProbs(b["ref_log_probs"], REFERENCE), ref=LogProbs(b["ref_log_probs"], REFERENCE))
    with CountOps() as rec, pytest.raises(ValueError, match=r"old_log_probs must be produced by role \('actor',\), got role 'reference'"):
        actor_loss(lp, **args)
    assert rec.ops == [], f"tensor ops ran before the producer check: {rec.ops}"
    assert lp.grad is None


@pytest.mark.parametrize(
    "old,ref,match",
    [
        (LogProbs(torch.zeros(7, 9, dtype=torch.float64), ROLLOUT), None, "old_log_probs must be produced by role"),
        (LogProbs(torch.zeros(7, 9, dtype=torch.float64), LogProbProducer("actor", "v7", "processed")), None, "probability space 'raw'"),
        (LogProbs(torch.zeros(7, 9, dtype=torch.float64), ACTOR), LogProbs(torch.zeros(7, 9, dtype=torch.float64), ACTOR), "ref_log_probs must be produced by role"),
        (torch.zeros(7, 9, dtype=torch.float64), None, "old_log_probs must be a LogProbs record"),
    ],
)
def test_wrong_producers_are_refused(old, ref, match):
    b = ragged_batch(0)
    args = _loss_args(b, old=old, ref=LogProbs(b["ref_log_probs"], REFERENCE) if ref is None else ref)
    with CountOps() as rec, pytest.raises((ValueError, TypeError), match=match):
        actor_loss(b["log_probs"], **args)
    assert rec.ops == []


def test_old_version_mismatch_and_missing_reference_are_refused():
    b = ragged_batch(0)
    with pytest.raises(ValueError, match="old_log_probs must come from version 'v8'"):
        actor_loss(b["log_probs"], old_version="v8", **_loss_args(b, LogProbs(b["old_log_probs"], ACTOR), LogProbs(b["ref_log_probs"], REFERENCE)))
    with pytest.raises(ValueError, match="ref_log_probs is required"):
        actor_loss(b["log_probs"], **_loss_args(b, LogProbs(b["old_log_probs"], ACTOR)))
    # rollout log-probs as old are accepted only when configured
    cfg = PolicyLossConfig(old_log_prob_roles=("rollout",))
    out = actor_loss(b["log_probs"], **_loss_args(b, LogProbs(b["rollout_log_probs"], ROLLOUT), cfg=cfg))
    assert torch.isfinite(out.loss)


def test_shaping_and_correction_check_producers():
    b = ragged_batch(1)
    with pytest.raises(ValueError, match="ref_log_probs must be produced by role"):
        kl_shaped_token_rewards(b["scores"], b["response_mask"], LogProbs(b["old_log_probs"], ACTOR), LogProbs(b["old_log_probs"], ACTOR), 0.1)
    with pytest.raises(ValueError, match="rollout_log_probs must come from version 'v7'"):
        rollout_correction(
            LogProbs(b["old_log_probs"], ACTOR), LogProbs(b["rollout_log_probs"], LogProbProducer("rollout", "v6")), b["response_mask"], RolloutCorrectionConfig()
        )


@pytest.mark.parametrize("rule", ["epsilon", "skip"])
@pytest.mark.parametrize("kind", ["grpo", "dr_grpo", "rloo", "reinforce_plus_plus_baseline", "grpo_process"])
@pytest.mark.parametrize("value", [0.0, 0.1, 1.0, 1e6])
def test_all_equal_group_gives_no_nan_anywhere(rule, kind, value):
    b = ragged_batch(2, bs=9)
    mask = b["response_mask"]
    scores = torch.full((9,), value, dtype=torch.float32)  # every group has equal rewards
    gi = b["group_index"]
    inputs = AdvantageInputs(response_mask=mask, scores=scores, group_index=gi)
    if kind == "grpo_process":
        last = (b["attention_mask"][:, b["prompt_len"]:].sum(1) - 1)[:, None]
        inputs = AdvantageInputs(response_mask=mask, group_index=gi, step_rewards=scores[:, None].clone(), step_token_ends=last)
    out = get_advantage(kind)(inputs, AdvantageConfig(zero_std_rule=rule))
    check_finite(out)
    assert (out.advantages == 0).all()
    assert out.metrics["zero_std_groups"] == 3 == out.metrics["groups"]
    if rule == "skip":
        assert out.loss_mask.sum() == 0 and out.metrics["skipped_samples"] == 9
        with pytest.raises(ValueError, match="no loss tokens"):
            global_normaliser(out.loss_mask, "token-mean")
    else:
        assert torch.equal(out.loss_mask, mask) and out.metrics["skipped_samples"] == 0
        norm = global_normaliser(out.loss_mask, "token-mean")
        lp = b["log_probs"].float().requires_grad_(True)
        res = actor_loss(
            lp, old_log_probs=LogProbs(b["old_log_probs"].float(), ACTOR), advantages=out.advantages,
            loss_mask=out.loss_mask, cfg=PolicyLossConfig(), normaliser=norm,
        )  # fmt: skip
        res.loss.backward()
        assert res.loss.item() == 0.0 and torch.isfinite(lp.grad).all()


def test_skip_rule_drops_only_degenerate_groups_from_the_normaliser():
    b = ragged_batch(3, bs=9)
    scores = b["scores"].float().clone()
    scores[b["group_index"] == 0] = 1.0
    cfgs = {r: AdvantageConfig(zero_std_rule=r) for r in ("epsilon", "skip")}
    outs = {r: get_advantage("grpo")(AdvantageInputs(response_mask=b["response_mask"], scores=scores, group_index=b["group_index"]), c) for r, c in cfgs.items()}
    grp0 = b["group_index"] == 0
    assert outs["skip"].loss_mask[grp0].sum() == 0 and outs["epsilon"].loss_mask[grp0].sum() > 0
    assert torch.equal(outs["skip"].loss_mask[~grp0], outs["epsilon"].loss_mask[~grp0])
    assert outs["skip"].metrics["zero_std_groups"] == outs["epsilon"].metrics["zero_std_groups"] == 1
    n_skip = global_normaliser(outs["skip"].loss_mask, "token-mean").tokens
    assert n_skip == int(b["response_mask"][~grp0].sum())


def test_aggregation_ignores_nan_off_the_mask_and_refuses_a_wrong_normaliser():
    b = ragged_batch(4)
    mask = b["response_mask"]
    loss_mat = b["advantages"].clone().requires_grad_(True)
    poisoned = torch.where(mask != 0, loss_mat, torch.nan)
    norm = global_normaliser(mask, "token-mean")
    out = aggregate_loss(poisoned, mask, "token-mean", norm)
    out.backward()
    assert torch.isfinite(out) and torch.isfinite(loss_mat.grad).all()
    with pytest.raises(ValueError, match="counted for mode 'token-mean'"):
        aggregate_loss(poisoned, mask, "seq-mean-token-sum", norm)
    with pytest.raises(ValueError, match="norm_constant"):
        global_normaliser(mask, "seq-mean-token-sum-norm")
    with pytest.raises(ValueError, match="GlobalNormaliser.value must be > 0"):
        GlobalNormaliser(mode="token-mean", value=0.0, tokens=0, sequences=0)


def test_registry_and_config_errors_name_the_field():
    with pytest.raises(KeyError, match="unknown advantage estimator 'ppo2'"):
        get_advantage("ppo2")
    with pytest.raises(KeyError, match="unknown policy loss"):
        get_policy_loss("nope")
    with pytest.raises(ValueError, match="already registered"):
        register_advantage("grpo")(lambda inputs, cfg, **kw: None)
    with pytest.raises(ValueError, match="PolicyLossConfig.old_log_prob_roles"):
        PolicyLossConfig(old_log_prob_roles=("reference",))
    with pytest.raises(ValueError, match="PolicyLossConfig.dual_clip"):
        PolicyLossConfig(dual_clip=0.5)
    with pytest.raises(ValueError, match="KLConfig.estimator must be 'k1' when placement is 'reward'"):
        KLConfig(placement="reward", estimator="k3", beta=0.1)
    with pytest.raises(ValueError, match="AdvantageConfig.zero_std_rule"):
        AdvantageConfig(zero_std_rule="nan")
    with pytest.raises(ValueError, match="needs AdvantageInputs.scores"):
        get_advantage("grpo")(AdvantageInputs(response_mask=torch.ones(2, 3)), AdvantageConfig())


def test_token_rewards_on_padding_are_refused():
    b = ragged_batch(5)
    r = b["token_rewards"].clone()
    r[1, -1] = 1.0  # row 1 has a one-token response: the last column is padding
    with pytest.raises(ValueError, match="non-zero outside response_mask"):
        get_advantage("reinforce_plus_plus")(AdvantageInputs(response_mask=b["response_mask"], token_rewards=r), AdvantageConfig())
