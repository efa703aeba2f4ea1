"""Rollout-vs-training mismatch correction, and the off-policy correction of asynchronous RL.

The rollout engine samples from pi_rollout (its kernels, precision, possibly quantised weights,
and in asynchronous RL weights up to eta optimizer steps older than the trained ones); the actor
recomputes the old log-probs pi_old with the training engine on the trained version.  The two
differ, so the experience is off-policy for the trainer (Yao et al. 2025, "Your efficient RL
framework secretly brings you off-policy RL training"; verl's rollout correction).  With

    d_t = log pi_old(a_t) - log pi_rollout(a_t),    w_t = exp(d_t)     (the behaviour weight)

the corrections, computed once from sealed facts:

- token-level importance weights (``token_is_mode``), detached, multiplied into the policy loss:
      truncate (TIS, Yao et al. 2025):             w_t' = min(w_t, C)
      filter   (AReaL's ``behav_imp_weight_cap``): w_t' = w_t if w_t <= C else 0 (the token leaves)
      uncapped (decoupled PPO without a cap):      w_t' = w_t
  (``exp`` is evaluated at min(d_t, 20): a numerical guard, e^20 ~ 5e8, not a cap);
- sequence-level masking: drop sample i from the loss when its log-prob error exceeds a
  threshold, with the error
      max_abs:  max_t |d_t|
      mean:     |(1/|y_i|) sum_t d_t|      (log geometric-mean ratio)
      mean_abs: (1/|y_i|) sum_t |d_t|      (AReaL's ``action=mask`` at sequence level)

Decoupled PPO: :func:`async_correction_config`; the loss normaliser: :class:`RolloutCorrectionConfig`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megarl.algo.aggregation import masked_mean
from megarl.algo.kl import kl_k3
from megarl.experience.schema import LogProbs, expect_producer
from megarl.versions import behaviour_ids, outside_bound

SEQ_MASK_STATS = ("max_abs", "mean", "mean_abs")
TOKEN_IS_MODES = ("truncate", "filter", "uncapped")
NORMALISERS = ("after_mask", "before_mask")
_EXP_GUARD = 20.0  # exp(d) evaluated at min(d, 20): keeps a weight finite, never binds in practice


@dataclass(frozen=True)
class RolloutCorrectionConfig:
    """token_is_cap: C of the importance weights (None = no weights, unless ``token_is_mode`` is
    ``uncapped``); token_is_mode: truncate | filter | uncapped (module docstring);
    seq_mask_threshold: mask sequences whose error (``seq_mask_stat``) exceeds it (None = no
    masking); normaliser: after_mask | before_mask (whether the loss normaliser counts the
    rejected tokens, below).

    **The normaliser** (``normaliser``).  The loss is ``aggregate_loss(w' * PG, loss_mask, mode, N)``
    with N counted from ``DerivedTensors.loss_mask`` over the optimizer step
    (:func:`megarl.algo.aggregation.global_normaliser`, called by the learner).  ``after_mask`` (the
    synchronous mismatch correction) returns the reduced ``loss_mask``: N no longer counts the dropped
    tokens.  ``before_mask`` (AReaL: ``loss_mask_count`` is taken before masking) returns
    ``loss_mask`` unchanged and rejects a token through a 0 weight, so N still counts it and the
    surviving tokens' gradients are not inflated by the rejection.  A rejected token then leaves the
    policy-gradient term only: the reference-KL-in-loss and entropy terms and the critic's value loss
    still see it (as in AReaL, whose behaviour mask applies to the policy loss), and the learner's
    ratio / clip metrics count it.
    """

    token_is_cap: float | None = 2.0
    seq_mask_threshold: float | None = None
    seq_mask_stat: str = "max_abs"
    token_is_mode: str = "truncate"
    normaliser: str = "after_mask"

    def __post_init__(self) -> None:
        if self.token_is_cap is not None and not self.token_is_cap >= 1:
            raise ValueError(f"RolloutCorrectionConfig.token_is_cap must be >= 1 or None, got {self.token_is_cap}")
        if self.seq_mask_threshold is not None and not self.seq_mask_threshold > 0:
            raise ValueError(f"RolloutCorrectionConfig.seq_mask_threshold must be > 0 or None, got {self.seq_mask_threshold}")
        if self.seq_mask_stat not in SEQ_MASK_STATS:
            raise ValueError(f"RolloutCorrectionConfig.seq_mask_stat {self.seq_mask_stat!r} is not one of {SEQ_MASK_STATS}")
        if self.token_is_mode not in TOKEN_IS_MODES:
            raise ValueError(f"RolloutCorrectionConfig.token_is_mode {self.token_is_mode!r} is not one of {TOKEN_IS_MODES}")
        if self.token_is_mode == "filter" and self.token_is_cap is None:
            raise ValueError("RolloutCorrectionConfig.token_is_mode 'filter' needs token_is_cap (the weight above "
                             "which a token leaves the loss)")
        if self.token_is_mode == "uncapped" and self.token_is_cap is not None:
            raise ValueError(f"RolloutCorrectionConfig.token_is_mode 'uncapped' takes no token_is_cap, got "
                             f"{self.token_is_cap}")
        if self.normaliser not in NORMALISERS:
            raise ValueError(f"RolloutCorrectionConfig.normaliser {self.normaliser!r} is not one of {NORMALISERS}")

    @property
    def weighted(self) -> bool:
        """Whether tokens carry importance weights."""
        return self.token_is_cap is not None or self.token_is_mode == "uncapped"

    def as_dict(self) -> dict:
        """The settings, as the derived tensors' hyperparameters record them."""
        return {"token_is_cap": self.token_is_cap, "token_is_mode": self.token_is_mode,
                "seq_mask_threshold": self.seq_mask_threshold, "seq_mask_stat": self.seq_mask_stat,
                "normaliser": self.normaliser}


def async_correction_config(correction: str, is_cap: float | None, mask_threshold: float) -> RolloutCorrectionConfig:
    """``async_rl.correction`` as a correction config; the normaliser is always counted before
    masking (AReaL).

    **Decoupled PPO.**  Fu et al. 2025 ("AReaL: A Large-Scale Asynchronous
    Reinforcement Learning System for Language Reasoning") separate the behaviour policy (the
    rollout's stale weights, ``rollout_log_probs``) from the proximal policy the PPO ratio is clipped
    against (Hilton et al. 2022, "Batch size-invariance for policy optimization"): here the old
    log-probs recomputed by the actor on the trained version v before the update.  The policy loss
    stays ``PPO(pi_theta / pi_old)`` (:mod:`megarl.algo.policy_loss`) and each token is weighted by
    w_t'.  This function maps ``async_rl.correction`` onto this module:
    ``decoupled`` -> filter at ``is_cap`` (uncapped when null), ``tis`` -> truncate at ``is_cap``,
    ``mask`` -> drop a sample whose ``mean_abs`` error exceeds ``mask_threshold``.
    """
    if correction == "decoupled":
        return RolloutCorrectionConfig(token_is_cap=is_cap, token_is_mode="uncapped" if is_cap is None else "filter",
                                       normaliser="before_mask")
    if correction == "tis":
        if is_cap is None:
            raise ValueError("async_rl.correction=tis needs async_rl.is_cap (the truncation C)")
        return RolloutCorrectionConfig(token_is_cap=is_cap, token_is_mode="truncate", normaliser="before_mask")
    if correction == "mask":
        return RolloutCorrectionConfig(token_is_cap=None, seq_mask_threshold=mask_threshold, seq_mask_stat="mean_abs",
                                       normaliser="before_mask")
    raise ValueError(f"async_rl.correction {correction!r} is not one of ('decoupled', 'tis', 'mask')")


@dataclass(frozen=True)
class RolloutCorrection:
    """is_weights ``(bs, R)`` (1 where no correction; 0 off the mask and on rejected tokens),
    loss_mask ``(bs, R)``, seq_error ``(bs,)``, metrics."""

    is_weights: torch.Tensor | None
    loss_mask: torch.Tensor
    seq_error: torch.Tensor
    metrics: dict[str, float]


def check_behaviour_version(old_log_probs: LogProbs, rollout_log_probs: LogProbs, max_staleness: int = 0) -> None:
    """The rollout log-probs' producer version against the old (proximal) ones'.

    ``max_staleness`` 0: they must be the same version (the synchronous record).  eta > 0 (declared
    by the caller: an asynchronous batch within the staleness bound): every version the behaviour
    label names (:func:`megarl.versions.behaviour_ids`) must be within eta steps before the old
    version (:func:`megarl.versions.outside_bound`); never accepted silently otherwise.  The old
    log-probs are the actor's; an asynchronous batch's may be the rollout engine's, teacher-forced
    on the proximal version (role ``engine``, ``async_rl.proximal_log_probs=engine``)."""
    expect_producer(old_log_probs, field="old_log_probs", roles=("actor",) if max_staleness == 0 else ("actor", "engine"))
    if max_staleness == 0:
        expect_producer(rollout_log_probs, field="rollout_log_probs", roles=("rollout",),
                        version=old_log_probs.producer.version)
        return
    expect_producer(rollout_log_probs, field="rollout_log_probs", roles=("rollout",))
    label, prox = rollout_log_probs.producer.version, old_log_probs.producer.version
    bad = outside_bound(behaviour_ids(label), prox, max_staleness)
    if bad:
        raise ValueError(f"rollout_log_probs version {label!r}: {bad} outside the declared staleness bound "
                         f"max_staleness={max_staleness} before the old log-probs' version {prox!r}")


def rollout_correction(
    old_log_probs: LogProbs,
    rollout_log_probs: LogProbs,
    loss_mask: torch.Tensor,
    cfg: RolloutCorrectionConfig,
    *,
    max_staleness: int = 0,
) -> RolloutCorrection:
    """Importance weights and sequence masks from the actor-vs-rollout log-prob gap.

    Args:
        old_log_probs: actor-recomputed old log-probs (role ``actor``; with ``max_staleness`` > 0
            also the engine's, teacher-forced on the proximal version: role ``engine``), values ``(bs, R)``.
        rollout_log_probs: rollout-time log-probs (role ``rollout``), values ``(bs, R)``, the same
            policy version -- or, with ``max_staleness`` > 0, versions within that many steps
            before it (:func:`check_behaviour_version`).
        loss_mask: ``(bs, R)`` current loss mask (response mask, possibly already reduced).
        cfg: RolloutCorrectionConfig.
        max_staleness: the staleness bound the caller declares the batch is within (0: none).
    Returns:
        RolloutCorrection; formulas in the module docstring.
    """
    check_behaviour_version(old_log_probs, rollout_log_probs, max_staleness)
    keep = loss_mask != 0
    diff = torch.where(keep, old_log_probs.values - rollout_log_probs.values, 0.0).detach()
    n = keep.sum(dim=-1)
    err = _seq_error(diff, n, cfg.seq_mask_stat)
    metrics: dict[str, float] = {
        "mismatch_k1": float(masked_mean(diff, keep)),
        "mismatch_abs_max": float(diff.abs().max()) if diff.numel() else 0.0,
    }
    new_mask = keep
    if cfg.seq_mask_threshold is not None:
        drop = (err > cfg.seq_mask_threshold) & (n > 0)
        new_mask = keep & ~drop[:, None]
        metrics["masked_seq_frac"] = float(drop.sum()) / max(int((n > 0).sum()), 1)
    weights = None
    if cfg.weighted:
        raw = torch.exp(diff.clamp(max=_EXP_GUARD))
        w, over = _token_weights(raw, cfg)
        weights = torch.where(new_mask, w, 0.0)
        metrics["tis_clipfrac"] = float(masked_mean(over.to(raw.dtype), new_mask))
        metrics["tis_weight_mean"] = float(masked_mean(weights, new_mask))
    if cfg.normaliser == "before_mask":  # rejection through a 0 weight: the normaliser keeps counting it
        if weights is None:
            weights = new_mask.to(diff.dtype)
        return RolloutCorrection(is_weights=weights, loss_mask=loss_mask, seq_error=err, metrics=metrics)
    return RolloutCorrection(is_weights=weights, loss_mask=new_mask.to(loss_mask.dtype), seq_error=err, metrics=metrics)


def _token_weights(raw: torch.Tensor, cfg: RolloutCorrectionConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """The applied weights from the raw ``exp(d)`` by ``cfg.token_is_mode`` (module docstring),
    and where the cap changed a weight."""
    if cfg.token_is_mode == "uncapped":
        return raw, torch.zeros_like(raw, dtype=torch.bool)
    over = raw > cfg.token_is_cap
    if cfg.token_is_mode == "filter":  # AReaL: the token leaves the loss rather than count as C
        return torch.where(over, 0.0, raw), over
    return raw.clamp(max=cfg.token_is_cap), over


def _seq_error(diff: torch.Tensor, n: torch.Tensor, stat: str) -> torch.Tensor:
    """``(bs,)`` the per-sequence error of ``diff`` (0 off the mask) by ``stat``."""
    if stat == "max_abs":
        return diff.abs().max(dim=-1).values
    per_token = diff.abs() if stat == "mean_abs" else diff
    mean = per_token.sum(dim=-1) / n.clamp(min=1).to(diff.dtype)
    return mean.abs()


def offpolicy_metrics(old_log_probs: LogProbs, rollout_log_probs: LogProbs, policy_mask: torch.Tensor,
                      cfg: RolloutCorrectionConfig, corr: RolloutCorrection,
                      ages: torch.Tensor | None = None) -> dict[str, float]:
    """Behaviour-vs-proximal diagnostics over the policy tokens (keys without a prefix).

    With d_t = log pi_old - log pi_rollout, w_t = exp(d_t) the raw behaviour weight and N the
    number of policy tokens (``policy_mask``):

    - ``kl_k1`` = mean d_t (AReaL's ``behave_approx_kl``, with its sign: -KL(behaviour || proximal)
      in expectation under the behaviour policy);
    - ``kl_k3`` = mean (w_t - 1 - d_t) >= 0, the low-variance unbiased estimator of
      KL(behaviour || proximal) (Schulman 2020);
    - ``ess`` = (sum w_t)^2 / (N sum w_t^2), the effective sample size of the raw weights as a
      share of N (1.0 when every w_t = 1; Kong 1992);
    - ``capped_token_share``: the share of policy tokens with w_t > C (truncated by ``truncate``,
      out of the loss by ``filter``; 0 without a cap); ``masked_sample_share``: the share of
      samples with policy tokens whose sequence error exceeds the mask threshold (0 without one);
      ``weight_mean``: the mean weight applied to the loss tokens (``corr``);
    - ``kl_k3_age_<a>``: ``kl_k3`` over the policy tokens of age a (``ages`` ``(bs, R)`` from
      :func:`megarl.experience.staleness.token_ages`), when ages are given.
    """
    keep = policy_mask != 0
    n = int(keep.sum())
    if n == 0:
        return {}
    d = torch.where(keep, old_log_probs.values - rollout_log_probs.values, 0.0).double()
    w = torch.exp(d.clamp(max=_EXP_GUARD))
    # k3 of KL(behaviour || proximal): megarl.algo.kl.kl_k3 with the rollout as pi, the proximal as pi_ref
    k3 = torch.where(keep, kl_k3(rollout_log_probs.values.double(), old_log_probs.values.double()), 0.0)
    wk = w[keep]
    m = {"kl_k1": float(d[keep].mean()), "kl_k3": float(k3[keep].mean()),
         "ess": float(wk.sum() ** 2 / (n * (wk * wk).sum()))}
    capped = cfg.weighted and cfg.token_is_cap is not None
    m["capped_token_share"] = float((keep & (w > cfg.token_is_cap)).sum()) / n if capped else 0.0
    rows = keep.any(dim=1)
    if cfg.seq_mask_threshold is not None:
        dropped = rows & (_seq_error(d, keep.sum(dim=-1), cfg.seq_mask_stat) > cfg.seq_mask_threshold)
        m["masked_sample_share"] = float(dropped.sum()) / max(int(rows.sum()), 1)
    else:
        m["masked_sample_share"] = 0.0
    in_loss = (corr.loss_mask != 0) & keep
    applied = corr.is_weights if corr.is_weights is not None else corr.loss_mask
    m["weight_mean"] = float(applied.double()[in_loss].mean()) if bool(in_loss.any()) else 0.0
    if ages is not None:
        for age in sorted(set(ages[keep].tolist())):
            m[f"kl_k3_age_{age}"] = float(k3[keep & (ages == age)].mean())
    return m
