"""Rollout-vs-training mismatch correction.

The rollout engine samples from pi_rollout (its kernels, precision, possibly quantised weights);
the actor recomputes the old log-probs pi_old with the training engine.  The two differ, so
the experience is slightly off-policy for the trainer (Yao et al. 2025, "Your efficient RL
framework secretly brings you off-policy RL training"; verl's rollout correction).  Two
corrections, computed once from sealed facts before the normaliser is counted:

- token-level truncated importance sampling (TIS):
      w_t = min(exp(log pi_old(a_t) - log pi_rollout(a_t)), C)      (detached weight on the loss)
- sequence-level masking: drop sample i from the loss when its log-prob error exceeds a
  threshold, with the error
      max_abs:  max_t |log pi_old(a_t) - log pi_rollout(a_t)|
      mean:     |(1/|y_i|) sum_t (log pi_old(a_t) - log pi_rollout(a_t))|   (log geometric-mean ratio)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megarl.algo.aggregation import masked_mean
from megarl.experience.schema import LogProbs, expect_producer

SEQ_MASK_STATS = ("max_abs", "mean")


@dataclass(frozen=True)
class RolloutCorrectionConfig:
    """token_is_cap: C of truncated IS (None = no weights); seq_mask_threshold: mask sequences
    whose error (``seq_mask_stat``) exceeds it (None = no masking)."""

    token_is_cap: float | None = 2.0
    seq_mask_threshold: float | None = None
    seq_mask_stat: str = "max_abs"

    def __post_init__(self) -> None:
        if self.token_is_cap is not None and not self.token_is_cap >= 1:
            raise ValueError(f"RolloutCorrectionConfig.token_is_cap must be >= 1 or None, got {self.token_is_cap}")
        if self.seq_mask_threshold is not None and not self.seq_mask_threshold > 0:
            raise ValueError(f"RolloutCorrectionConfig.seq_mask_threshold must be > 0 or None, got {self.seq_mask_threshold}")
        if self.seq_mask_stat not in SEQ_MASK_STATS:
            raise ValueError(f"RolloutCorrectionConfig.seq_mask_stat {self.seq_mask_stat!r} is not one of {SEQ_MASK_STATS}")


@dataclass(frozen=True)
class RolloutCorrection:
    """is_weights ``(bs, R)`` (1 where no correction; 0 off the mask), loss_mask ``(bs, R)``,
    seq_error ``(bs,)``, metrics."""

    is_weights: torch.Tensor | None
    loss_mask: torch.Tensor
    seq_error: torch.Tensor
    metrics: dict[str, float]


def rollout_correction(
    old_log_probs: LogProbs,
    rollout_log_probs: LogProbs,
    loss_mask: torch.Tensor,
    cfg: RolloutCorrectionConfig,
) -> RolloutCorrection:
    """Truncated IS weights and sequence masks from the actor-vs-rollout log-prob gap.

    Args:
        old_log_probs: actor-recomputed old log-probs (role ``actor``), values ``(bs, R)``.
        rollout_log_probs: rollout-time log-probs (role ``rollout``), values ``(bs, R)``, same
            policy version.
        loss_mask: ``(bs, R)`` current loss mask (response mask, possibly already reduced).
        cfg: RolloutCorrectionConfig.
    Returns:
        RolloutCorrection; formulas in the module docstring.
    """
    expect_producer(old_log_probs, field="old_log_probs", roles=("actor",))
    expect_producer(rollout_log_probs, field="rollout_log_probs", roles=("rollout",), version=old_log_probs.producer.version)
    keep = loss_mask != 0
    diff = torch.where(keep, old_log_probs.values - rollout_log_probs.values, 0.0).detach()
    n = keep.sum(dim=-1)
    if cfg.seq_mask_stat == "max_abs":
        err = diff.abs().max(dim=-1).values
    else:
        err = (diff.sum(dim=-1) / n.clamp(min=1).to(diff.dtype)).abs()
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
    if cfg.token_is_cap is not None:
        raw = torch.exp(diff.clamp(max=20.0))
        weights = torch.where(new_mask, raw.clamp(max=cfg.token_is_cap), 0.0)
        metrics["tis_clipfrac"] = float(masked_mean((raw > cfg.token_is_cap).to(raw.dtype), new_mask))
        metrics["tis_weight_mean"] = float(masked_mean(weights, new_mask))
    return RolloutCorrection(is_weights=weights, loss_mask=new_mask.to(loss_mask.dtype), seq_error=err, metrics=metrics)
