"""The derived tensors of a sealed batch: advantages, returns, the loss mask and the correction
weights, as a pure function of the sealed facts and the settings that produced them.

The trainer calls :func:`derive` with its configured :class:`DerivationSettings`; the settings
are recorded with the derived tensors (``DerivedTensors.hyperparameters``), and
:meth:`DerivationSettings.from_record` reads them back, so a saved batch can be derived again
offline (``tools/inspect_experience.py --rederive``): at the recorded settings the result is the
trainer's, bitwise; at others (another beta, gamma, lambda, normalisation) it is what that run
would have trained on.  Everything it reads is sealed: the scores, masks, log-probs, the
critic's values and, for a truncated sample, its bootstrap value V(s_T).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Dict, Mapping, Optional, Sequence

import torch

from megarl.algo.advantages import AdvantageConfig, AdvantageInputs, check_finite, masked_whiten
from megarl.algo.aggregation import masked_mean
from megarl.algo.distillation import distill_metrics, reverse_kl_per_token
from megarl.algo.registry import advantage_needs, get_advantage
from megarl.algo.reward_shaping import kl_shaped_token_rewards, place_outcome_rewards, place_step_rewards
from megarl.algo.rollout_correction import RolloutCorrectionConfig, offpolicy_metrics, rollout_correction
from megarl.experience.groups import group_index
from megarl.experience.schema import DerivedTensors, ExperienceFacts
from megarl.experience.staleness import token_ages
from megarl.versions import step_of_short_id

__all__ = ["DerivationSettings", "derive"]


@dataclass(frozen=True)
class DerivationSettings:
    """What the derived tensors depend on besides the facts.

    ``kl_placement``: ``reward`` (the KL to the reference, ``kl_beta`` times it, shapes the
    per-token rewards of a critic estimator) or ``loss``; ``whiten``: advantages whitened over
    the loss mask; ``correction``: the rollout/trainer mismatch correction (synchronous);
    ``offpolicy`` with ``max_staleness``: the behaviour-vs-proximal correction of an
    asynchronous batch (the two are exclusive); ``distill_coef``: the teacher's per-token reverse
    KL added to the advantage with this weight, after any whitening
    (:mod:`megarl.algo.distillation`); ``reward_placement`` (a token-reward estimator):
    ``last_token``, each score on its sample's last action, or ``recorded``, the parts each
    record says it is made of on the actions they follow (:func:`step_tensors`)."""

    estimator: str
    gamma: float = 1.0
    lam: float = 1.0
    zero_std_rule: str = "epsilon"
    std_eps: float = 1e-6
    kl_placement: str = "loss"
    kl_beta: float = 0.0
    whiten: bool = False
    correction: Optional[RolloutCorrectionConfig] = None
    offpolicy: Optional[RolloutCorrectionConfig] = None
    max_staleness: int = 0
    reward_placement: str = "last_token"
    distill_coef: float = 0.0

    def __post_init__(self) -> None:
        if self.offpolicy is not None and self.correction is not None:  # both would weight the same gap
            raise ValueError("algo.rollout_correction and async_rl.correction are both set: use one")

    @property
    def advantage_config(self) -> AdvantageConfig:
        return AdvantageConfig(gamma=self.gamma, lam=self.lam, zero_std_rule=self.zero_std_rule, std_eps=self.std_eps)

    def hyperparameters(self) -> Dict[str, Any]:
        """What the derived tensors record (and :meth:`from_record` reads back)."""
        out: Dict[str, Any] = {"gamma": self.gamma, "lam": self.lam, "zero_std_rule": self.zero_std_rule,
                               "std_eps": self.std_eps, "kl_beta": self.kl_beta, "whiten": self.whiten}
        if self.correction is not None:
            c = self.correction
            out["rollout_correction"] = {"token_is_cap": c.token_is_cap, "seq_mask_threshold": c.seq_mask_threshold,
                                         "seq_mask_stat": c.seq_mask_stat}
        if self.offpolicy is not None:
            out["offpolicy_correction"] = {"max_staleness": self.max_staleness, **self.offpolicy.as_dict()}
        out["kl_placement"] = self.kl_placement
        if self.reward_placement != "last_token":  # (recorded only when set: older records read as last_token)
            out["reward_placement"] = self.reward_placement
        if self.distill_coef:
            out["distill_coef"] = self.distill_coef
        return out

    @classmethod
    def from_record(cls, derived: DerivedTensors, **overrides) -> "DerivationSettings":
        """The settings a sealed batch's derived tensors record, with ``overrides`` applied (a
        record from before ``kl_placement`` was recorded: ``reward`` when it holds shaped rewards
        and its estimator reads a critic)."""
        hp = dict(derived.hyperparameters)
        placement = hp.get("kl_placement")
        if placement is None:
            critic = advantage_needs(derived.estimator).critic
            placement = "reward" if critic and derived.shaped_rewards is not None and hp.get("kl_beta") else "loss"
        off = dict(hp["offpolicy_correction"]) if hp.get("offpolicy_correction") else None
        eta = off.pop("max_staleness") if off else 0
        s = cls(estimator=derived.estimator, gamma=hp["gamma"], lam=hp["lam"], zero_std_rule=hp["zero_std_rule"],
                std_eps=hp["std_eps"], kl_placement=placement, kl_beta=hp["kl_beta"], whiten=bool(hp["whiten"]),
                correction=(RolloutCorrectionConfig(**hp["rollout_correction"]) if hp.get("rollout_correction")
                            else None),
                offpolicy=RolloutCorrectionConfig(**off) if off else None, max_staleness=eta,
                reward_placement=hp.get("reward_placement", "last_token"),
                distill_coef=hp.get("distill_coef", 0.0))
        return dataclasses.replace(s, **overrides)


def step_tensors(records, response_mask: torch.Tensor, dtype: torch.dtype = torch.float32) -> tuple:
    """The records' rewards as the parts each one says it is made of, on the actions they are
    received after: ``(bs, S)`` rewards and end token indices (-1 pads a row's missing parts).

    A record's parts are its process steps when it has them; else its ``applies_to`` spans (a
    turn's reward on the turn's last policy token) with what they leave of the total
    (:meth:`RewardRecord.outcome_remainder`) on the last action, added to a span that ends there;
    else its total on its last action token (a penalty standing for a failure, an outcome)."""
    mask = response_mask != 0
    rows = []
    for b, r in enumerate(records):
        last = int(torch.nonzero(mask[b]).max()) if mask[b].any() else 0
        if r.step_rewards is not None:
            rows.append((list(r.step_rewards), list(r.step_token_ends)))
        elif r.applies_to is not None:
            w, e = [x.value for x in r.applies_to], [x.last for x in r.applies_to]
            rest = r.outcome_remainder()
            if rest != 0.0 and e[-1] == last:
                w[-1] += rest
            elif rest != 0.0:
                w, e = w + [rest], e + [last]
            rows.append((w, e))
        else:
            rows.append(([float(r.total)], [last]))
    S = max(1, max(len(w) for w, _ in rows))
    rewards = torch.zeros((len(rows), S), dtype=dtype)
    ends = torch.full((len(rows), S), -1, dtype=torch.long)
    for b, (w, e) in enumerate(rows):
        rewards[b, :len(w)] = torch.tensor(w, dtype=dtype)
        ends[b, :len(e)] = torch.tensor(e, dtype=torch.long)
    return rewards, ends


def derive(facts: ExperienceFacts, s: DerivationSettings,
           real_sizes: Optional[Mapping[str, int]] = None) -> tuple[DerivedTensors, Dict[str, float]]:
    """The estimator's derived tensors over the sealed facts, and the ``prep/*`` metrics of
    the derivation (``real_sizes``: each group's recorded size, checked when given)."""
    needs = advantage_needs(s.estimator)
    mask = facts.response_mask
    token_rewards = None
    teacher = _teacher_log_probs(facts, s) if needs.teacher or s.distill_coef else None
    scores = None if needs.teacher else facts.scores()  # the teacher alone: no reward enters the advantage
    if needs.teacher:
        inputs = AdvantageInputs(response_mask=mask, old_log_probs=facts.old_log_probs.values, teacher_log_probs=teacher)
    elif needs.groups:
        gidx, _ = group_index(facts.group_id, real_sizes)
        inputs = AdvantageInputs(response_mask=mask, scores=scores, group_index=gidx)
        if needs.step_rewards:
            step_rewards, step_ends = step_tensors(facts.rewards, mask)
            inputs = dataclasses.replace(inputs, step_rewards=step_rewards, step_token_ends=step_ends)
    else:
        placed = None
        if s.reward_placement == "recorded":  # each record's parts on their own actions
            step_rewards, step_ends = step_tensors(facts.rewards, mask, dtype=scores.dtype)
            placed = place_step_rewards(step_rewards, step_ends, mask)
        if s.kl_placement == "reward":
            token_rewards, _ = kl_shaped_token_rewards(scores, mask, facts.old_log_probs, facts.ref_log_probs,
                                                       s.kl_beta, placed=placed)
        else:
            token_rewards = place_outcome_rewards(scores, mask) if placed is None else placed
        inputs = AdvantageInputs(response_mask=mask, token_rewards=token_rewards.float(),
                                 values=facts.values, terminated=facts.terminated(),
                                 bootstrap_values=facts.bootstrap_values)
    cfg = s.advantage_config
    res = get_advantage(s.estimator)(inputs, cfg)
    check_finite(res)
    adv = res.advantages
    if s.whiten:
        adv = masked_whiten(adv, res.loss_mask, cfg.whiten_eps)
    loss_mask, is_weights, m = res.loss_mask, None, {}
    if teacher is not None:  # the teacher's per-token reverse KL, alone or beside the estimator's advantage
        k = reverse_kl_per_token(facts.old_log_probs.values, teacher, mask)
        part = adv if needs.teacher else torch.where(loss_mask != 0, -s.distill_coef * k, 0.0).to(adv.dtype)
        adv = adv if needs.teacher else adv + part
        m.update({f"prep/distill/{key}": v for key, v in distill_metrics(k, part, adv, loss_mask).items()})
    if s.correction is not None:  # the rollout/trainer mismatch, from the sealed log-probs
        corr = rollout_correction(facts.old_log_probs, facts.rollout_log_probs, loss_mask, s.correction)
        loss_mask, is_weights = corr.loss_mask, corr.is_weights
        m.update({f"prep/rollout_correction/{k}": v for k, v in corr.metrics.items()})
    if s.offpolicy is not None:  # async_rl.correction: behaviour (rollout) vs proximal (old) policy
        loss_mask, is_weights, off_m = _offpolicy_correction(facts, loss_mask, s)
        m.update(off_m)
    keep = loss_mask != 0
    m.update({f"prep/adv/{k}": v for k, v in res.metrics.items()})
    m["prep/advantage_mean"] = float(masked_mean(adv, keep)) if keep.any() else 0.0
    m["prep/advantage_std"] = float(adv[keep].std()) if int(keep.sum()) > 1 else 0.0
    if needs.groups:
        m["prep/zero_variance_group_share"] = _zero_spread_share(facts.group_id, scores.tolist())
    derived = DerivedTensors(
        advantages=adv.float(), loss_mask=loss_mask, is_weights=is_weights,
        returns=None if res.returns is None else res.returns.float(),
        shaped_rewards=None if token_rewards is None else token_rewards.float(), estimator=s.estimator,
        hyperparameters=s.hyperparameters())
    return derived, m


def _teacher_log_probs(facts: ExperienceFacts, s: DerivationSettings) -> torch.Tensor:
    if facts.teacher_log_probs is None or facts.old_log_probs is None:
        missing = "teacher_log_probs (teacher.path)" if facts.teacher_log_probs is None else "old_log_probs"
        raise ValueError(f"estimator {s.estimator!r} with distill_coef={s.distill_coef} reads the sealed teacher and "
                         f"old log-probs; the batch has no {missing}")
    return facts.teacher_log_probs.values


def _zero_spread_share(group_id: Sequence[str], scores: Sequence[float]) -> float:
    spreads: Dict[str, set] = {}
    for g, t in zip(group_id, scores, strict=True):
        spreads.setdefault(g, set()).add(t)
    return sum(len(x) == 1 for x in spreads.values()) / len(spreads)


def _offpolicy_correction(facts: ExperienceFacts, loss_mask: torch.Tensor, s: DerivationSettings):
    """``async_rl.correction`` (:func:`megarl.algo.rollout_correction.async_correction_config`):
    decoupled PPO (Fu et al. 2025, AReaL) with the old log-probs recomputed by the actor on v as
    the proximal policy (Hilton et al. 2022) and the rollout's as the behaviour policy; weights
    (decoupled: filtered above ``is_cap``, tis: truncated at it, Yao et al. 2025) or a sequence
    mask (mask).  The normaliser is counted before masking: ``loss_mask`` comes back unchanged and
    a rejected token carries weight 0 (the learner counts N from ``loss_mask``).  Returns the loss
    mask, the weights and the ``prep/offpolicy/*`` metrics (per-age KL by token age)."""
    corr = rollout_correction(facts.old_log_probs, facts.rollout_log_probs, loss_mask, s.offpolicy,
                              max_staleness=s.max_staleness)
    ages = token_ages(facts, step_of_short_id(facts.old_log_probs.producer.version))
    m = offpolicy_metrics(facts.old_log_probs, facts.rollout_log_probs, facts.response_mask, s.offpolicy, corr, ages)
    return corr.loss_mask, corr.is_weights, {f"prep/offpolicy/{k}": x for k, x in m.items()}
