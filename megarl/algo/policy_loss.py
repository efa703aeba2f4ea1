"""Token-level policy losses, registered by name.

Signature: ``fn(log_probs, old_log_probs, advantages, loss_mask, cfg) -> PolicyLossTerms`` with
all tensors ``(bs, response_len)``: ``log_probs`` of the current policy (requires grad),
``old_log_probs`` of the behaviour policy (the unwrapped, producer-checked values -- the
checks live in :func:`megarl.algo.objective.actor_loss`).  The returned ``token_loss`` is
aggregated by :func:`megarl.algo.aggregation.aggregate_loss`, never here.  Masked-out
positions are selected away before any exponential, so garbage there cannot produce inf/NaN.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from megarl.algo.aggregation import check_agg_mode, masked_mean
from megarl.algo.kl import KLConfig
from megarl.algo.registry import get_policy_loss, register_policy_loss
from megarl.experience.schema import LOG_PROB_ROLES, LOG_PROB_SPACES


@dataclass(frozen=True)
class PolicyLossConfig:
    """Actor loss hyperparameters.

    name: a registered policy loss (``vanilla``, ``gspo``).
    clip_low / clip_high: ratio clipped to [1 - clip_low, 1 + clip_high] (DAPO clip-higher:
        clip_high > clip_low, Yu et al. 2025).
    dual_clip: c > 1 bounds the loss of negative-advantage tokens by -c * A (Ye et al. 2020,
        dual-clip PPO); None disables.
    log_ratio_clamp: |log ratio| is clamped to this before exp (numerical guard).
    agg_mode: loss aggregation mode.
    entropy_coef: entropy bonus coefficient (loss -= coef * entropy).
    kl: the reference-KL placement; ``loss`` adds beta * estimator to the token loss.
    old_log_prob_roles / log_prob_space: the producer contract of ``old_log_probs``.
    """

    name: str = "vanilla"
    clip_low: float = 0.2
    clip_high: float = 0.2
    dual_clip: float | None = 3.0
    log_ratio_clamp: float = 20.0
    agg_mode: str = "token-mean"
    entropy_coef: float = 0.0
    kl: KLConfig = field(default_factory=KLConfig)
    old_log_prob_roles: tuple[str, ...] = ("actor",)
    log_prob_space: str = "raw"

    def __post_init__(self) -> None:
        get_policy_loss(self.name)
        check_agg_mode(self.agg_mode)
        if not (0 <= self.clip_low < 1):
            raise ValueError(f"PolicyLossConfig.clip_low must be in [0, 1), got {self.clip_low}")
        if not (self.clip_high >= 0):
            raise ValueError(f"PolicyLossConfig.clip_high must be >= 0, got {self.clip_high}")
        if self.dual_clip is not None and not self.dual_clip > 1:
            raise ValueError(f"PolicyLossConfig.dual_clip must be > 1 or None, got {self.dual_clip}")
        if not self.log_ratio_clamp > 0:
            raise ValueError(f"PolicyLossConfig.log_ratio_clamp must be > 0, got {self.log_ratio_clamp}")
        if not (self.entropy_coef >= 0 and math.isfinite(self.entropy_coef)):
            raise ValueError(f"PolicyLossConfig.entropy_coef must be finite and >= 0, got {self.entropy_coef}")
        roles = tuple(self.old_log_prob_roles)
        object.__setattr__(self, "old_log_prob_roles", roles)
        if not roles or any(r not in ("actor", "rollout", "engine") for r in roles):
            raise ValueError(
                f"PolicyLossConfig.old_log_prob_roles must be a non-empty subset of ('actor', 'rollout', 'engine'), "
                f"got {roles}; "
                f"known roles {LOG_PROB_ROLES} ('reference' is never an old policy)"
            )
        if self.log_prob_space not in LOG_PROB_SPACES:
            raise ValueError(f"PolicyLossConfig.log_prob_space {self.log_prob_space!r} is not one of {LOG_PROB_SPACES}")


@dataclass
class PolicyLossTerms:
    """token_loss ``(bs, R)`` (differentiable) and detached local metrics (floats)."""

    token_loss: torch.Tensor
    metrics: dict[str, float]


def _clipped_surrogate(
    ratio: torch.Tensor, log_ratio: torch.Tensor, advantages: torch.Tensor, keep: torch.Tensor, cfg: PolicyLossConfig, dual: bool
) -> PolicyLossTerms:
    lo, hi = 1.0 - cfg.clip_low, 1.0 + cfg.clip_high
    pg1 = -advantages * ratio
    pg2 = -advantages * ratio.clamp(lo, hi)
    loss = torch.maximum(pg1, pg2)
    if dual and cfg.dual_clip is not None:
        pg3 = -advantages * cfg.dual_clip
        loss = torch.where(advantages < 0, torch.minimum(loss, pg3), loss)
    loss = torch.where(keep, loss, torch.zeros((), dtype=loss.dtype))
    with torch.no_grad():
        r = ratio.detach()
        lr = log_ratio.detach()
        n = int(keep.sum())
        metrics = {
            "ratio_mean": float(masked_mean(r, keep)),
            "ratio_min": float(torch.where(keep, r, torch.inf).min()) if n else 1.0,
            "ratio_max": float(torch.where(keep, r, -torch.inf).max()) if n else 1.0,
            "clipfrac_high": float(masked_mean(((advantages > 0) & (r > hi)).to(r.dtype), keep)),
            "clipfrac_low": float(masked_mean(((advantages < 0) & (r < lo)).to(r.dtype), keep)),
            "dual_clipfrac": (
                float(masked_mean(((advantages < 0) & (r > cfg.dual_clip)).to(r.dtype), keep))
                if dual and cfg.dual_clip is not None
                else 0.0
            ),
            # KL(old || current) estimated on old samples: k1 = -log r, k3 = r - 1 - log r
            "ppo_kl_k1": float(masked_mean(-lr, keep)),
            "approx_kl": float(masked_mean(torch.expm1(lr) - lr, keep)),
            "tokens": float(n),
        }
    return PolicyLossTerms(token_loss=loss, metrics=metrics)


@register_policy_loss("vanilla")
def vanilla_policy_loss(
    log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    cfg: PolicyLossConfig,
) -> PolicyLossTerms:
    """PPO clipped surrogate (Schulman et al. 2017) with DAPO clip-higher and dual-clip.

        r_t  = exp(log pi(a_t) - log pi_old(a_t))
        L_t  = max(-A_t r_t, -A_t clip(r_t, 1 - eps_low, 1 + eps_high))         (Yu et al. 2025)
        L_t  = min(L_t, -c A_t)   if A_t < 0 and dual_clip = c                (Ye et al. 2020)

    Args: log_probs, old_log_probs, advantages, loss_mask -- all ``(bs, response_len)``.
    Returns: token_loss ``(bs, response_len)`` (0 off the mask) and metrics: ratio mean/min/max,
    clipfrac_high / clipfrac_low (tokens whose gradient the clip removed), dual_clipfrac,
    ppo_kl_k1 and approx_kl (k3) to the old policy.
    """
    keep = loss_mask != 0
    log_ratio = torch.where(keep, log_probs - old_log_probs, 0.0).clamp(-cfg.log_ratio_clamp, cfg.log_ratio_clamp)
    return _clipped_surrogate(torch.exp(log_ratio), log_ratio, advantages, keep, cfg, dual=True)


@register_policy_loss("gspo")
def gspo_policy_loss(
    log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    cfg: PolicyLossConfig,
) -> PolicyLossTerms:
    """GSPO, sequence-level importance ratio (Zheng et al. 2025, token-level form GSPO-token).

        log s_i   = (1 / |y_i|) sum_t (log pi(a_t) - log pi_old(a_t))
        s_{i,t}   = sg[s_i] * pi(a_t) / sg[pi(a_t)]       (value s_i, gradient s_i * grad log pi(a_t))
        L_{i,t}   = max(-A_{i,t} s_{i,t}, -A_{i,t} clip(s_{i,t}, 1 - eps_low, 1 + eps_high))

    With ``seq-mean-token-mean`` aggregation this is the paper's objective.  No dual clip.
    Shapes as :func:`vanilla_policy_loss`; ratio metrics are over the sequence ratios s_i.
    """
    keep = loss_mask != 0
    diff = torch.where(keep, log_probs - old_log_probs, 0.0)
    n = keep.sum(dim=-1, keepdim=True).clamp(min=1).to(diff.dtype)
    log_seq = (diff.sum(dim=-1, keepdim=True) / n).clamp(-cfg.log_ratio_clamp, cfg.log_ratio_clamp)
    lp = torch.where(keep, log_probs, 0.0)
    log_ratio = torch.where(keep, log_seq.detach() + lp - lp.detach(), 0.0)
    return _clipped_surrogate(torch.exp(log_ratio), log_ratio, advantages, keep, cfg, dual=False)
