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

    name: a registered policy loss (``vanilla``, ``gspo``, ``cispo``, ``gmpo``, ``sapo``).
    clip_low / clip_high: ratio clipped to [1 - clip_low, 1 + clip_high] (DAPO clip-higher:
        clip_high > clip_low, Yu et al. 2025); ``gmpo`` bounds the log-ratio to
        [-clip_low, clip_high] instead; ``sapo`` has no clip.
    sapo_tau_pos / sapo_tau_neg: the temperatures of SAPO's gate for tokens with a positive /
        non-positive advantage.
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
    sapo_tau_pos: float = 1.0
    sapo_tau_neg: float = 1.05

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
        for key in ("sapo_tau_pos", "sapo_tau_neg"):
            tau = getattr(self, key)
            if not (tau > 0 and math.isfinite(tau)):
                raise ValueError(f"PolicyLossConfig.{key} must be finite and > 0, got {tau}")
        if self.log_prob_space not in LOG_PROB_SPACES:
            raise ValueError(f"PolicyLossConfig.log_prob_space {self.log_prob_space!r} is not one of {LOG_PROB_SPACES}")


@dataclass
class PolicyLossTerms:
    """token_loss ``(bs, R)`` (differentiable) and detached local metrics (floats)."""

    token_loss: torch.Tensor
    metrics: dict[str, float]


def _ratio_metrics(log_ratio: torch.Tensor, keep: torch.Tensor, **extra: float) -> dict[str, float]:
    """The ratio statistics every loss reports (detached), with a loss's own ``extra`` metrics."""
    with torch.no_grad():
        lr = log_ratio.detach()
        r = torch.exp(lr)
        n = int(keep.sum())
        return {
            "ratio_mean": float(masked_mean(r, keep)),
            "ratio_min": float(torch.where(keep, r, torch.inf).min()) if n else 1.0,
            "ratio_max": float(torch.where(keep, r, -torch.inf).max()) if n else 1.0,
            # KL(old || current) estimated on old samples: k1 = -log r, k3 = r - 1 - log r
            "ppo_kl_k1": float(masked_mean(-lr, keep)),
            "approx_kl": float(masked_mean(torch.expm1(lr) - lr, keep)),
            "tokens": float(n),
            **extra,
        }


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
        extra = {
            "clipfrac_high": float(masked_mean(((advantages > 0) & (r > hi)).to(r.dtype), keep)),
            "clipfrac_low": float(masked_mean(((advantages < 0) & (r < lo)).to(r.dtype), keep)),
            "dual_clipfrac": (
                float(masked_mean(((advantages < 0) & (r > cfg.dual_clip)).to(r.dtype), keep))
                if dual and cfg.dual_clip is not None
                else 0.0
            ),
        }
    return PolicyLossTerms(token_loss=loss, metrics=_ratio_metrics(log_ratio, keep, **extra))


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


@register_policy_loss("cispo")
def cispo_policy_loss(
    log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    cfg: PolicyLossConfig,
) -> PolicyLossTerms:
    """CISPO, clipped importance-sampling-weight policy optimisation (MiniMax 2025, MiniMax-M1,
    arXiv:2506.13585): a REINFORCE objective whose importance weight is clipped and
    stop-gradiented, so no token's gradient is ever dropped (PPO's clip zeroes it).

        r_t = exp(log pi(a_t) - log pi_old(a_t))
        L_t = -sg[clip(r_t, 1 - eps_low, 1 + eps_high)] * A_t * log pi(a_t)

    Gradient: -clip(r_t) A_t grad log pi(a_t).  MiniMax-M1 bounds only the weight's top (a large
    ``clip_low`` leaves the bottom free).  Metrics: clipfrac_high / clipfrac_low, the tokens whose
    weight the clip changed (their gradient is kept, scaled).
    """
    keep = loss_mask != 0
    log_ratio = torch.where(keep, log_probs - old_log_probs, 0.0).clamp(-cfg.log_ratio_clamp, cfg.log_ratio_clamp)
    lo, hi = 1.0 - cfg.clip_low, 1.0 + cfg.clip_high
    weight = torch.exp(log_ratio).clamp(lo, hi).detach()
    loss = torch.where(keep, -weight * advantages * torch.where(keep, log_probs, 0.0), 0.0)
    with torch.no_grad():
        r = torch.exp(log_ratio)
        extra = {"clipfrac_high": float(masked_mean((r > hi).to(r.dtype), keep)),
                 "clipfrac_low": float(masked_mean((r < lo).to(r.dtype), keep))}
    return PolicyLossTerms(token_loss=loss, metrics=_ratio_metrics(log_ratio, keep, **extra))


@register_policy_loss("gmpo")
def gmpo_policy_loss(
    log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    cfg: PolicyLossConfig,
) -> PolicyLossTerms:
    """GMPO, geometric-mean policy optimisation (Zhao et al. 2025,
    arXiv:2507.20673): the
    sequence's objective is the geometric mean of its tokens' clipped ratios, so one outlier
    token's ratio moves it far less than it moves GRPO's arithmetic mean.

        l_t   = log pi(a_t) - log pi_old(a_t)
        l~_t  = sgn(A_i) * min(sgn(A_i) l_t, sgn(A_i) clip(l_t, -eps_low, eps_high))   (token clip, log space)
        A_i   = mean_t A_{i,t}                                                          (the sequence's advantage)
        L_i   = -A_i * exp(mean_t l~_t)

    returned as ``L_{i,t} = L_i`` on every token of sequence i: with ``seq-mean-token-mean``
    aggregation the loss is mean_i L_i, the paper's objective.  ``clip_low`` / ``clip_high``
    bound the log-ratio here (the paper: 0.4 each, a ratio in (e^-0.4, e^0.4)).  Metrics:
    clipfrac_high / clipfrac_low, the tokens the clip held.
    """
    keep = loss_mask != 0
    log_ratio = torch.where(keep, log_probs - old_log_probs, 0.0).clamp(-cfg.log_ratio_clamp, cfg.log_ratio_clamp)
    n = keep.sum(dim=-1).clamp(min=1).to(log_ratio.dtype)
    adv = torch.where(keep, advantages, 0.0).sum(dim=-1) / n
    sgn = torch.sign(adv)[:, None]
    held = log_ratio.clamp(-cfg.clip_low, cfg.clip_high)
    clipped = sgn * torch.minimum(sgn * log_ratio, sgn * held)
    seq = -adv * torch.exp(torch.where(keep, clipped, 0.0).sum(dim=-1) / n)
    loss = torch.where(keep, seq[:, None].expand_as(log_ratio), 0.0)
    with torch.no_grad():
        moved = (clipped != log_ratio).to(log_ratio.dtype)
        extra = {"clipfrac_high": float(masked_mean(moved * (sgn > 0), keep)),
                 "clipfrac_low": float(masked_mean(moved * (sgn < 0), keep))}
    return PolicyLossTerms(token_loss=loss, metrics=_ratio_metrics(log_ratio, keep, **extra))


@register_policy_loss("sapo")
def sapo_policy_loss(
    log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    cfg: PolicyLossConfig,
) -> PolicyLossTerms:
    """SAPO, soft adaptive policy optimisation (Qwen team 2025,
    arXiv:2511.20347): a smooth
    gate in place of the hard clip, steeper for negative advantages.

        r_t   = exp(log pi(a_t) - log pi_old(a_t))
        tau_t = tau_pos if A_t > 0 else tau_neg
        f(r)  = sigmoid(tau_t (r - 1)) * 4 / tau_t
        L_t   = -f(r_t) * A_t

    Gradient: -4 sigmoid(.)(1 - sigmoid(.)) r_t A_t grad log pi(a_t), which is exactly the policy
    gradient -A_t grad log pi(a_t) on-policy (r = 1) and fades smoothly as r leaves 1 (faster for
    tau_neg > tau_pos).  No token's gradient is cut at a threshold.  The paper aggregates with
    ``seq-mean-token-mean``.  Metric ``gate_grad_mean``: the mean gradient scale 4 s(1 - s) r.
    """
    keep = loss_mask != 0
    log_ratio = torch.where(keep, log_probs - old_log_probs, 0.0).clamp(-cfg.log_ratio_clamp, cfg.log_ratio_clamp)
    ratio = torch.exp(log_ratio)
    pos, neg = (torch.tensor(x, dtype=ratio.dtype, device=ratio.device) for x in (cfg.sapo_tau_pos, cfg.sapo_tau_neg))
    tau = torch.where(advantages > 0, pos, neg)
    gate = torch.sigmoid(tau * (ratio - 1.0)) * (4.0 / tau)
    loss = torch.where(keep, -gate * advantages, 0.0)
    with torch.no_grad():
        sig = torch.sigmoid(tau * (ratio - 1.0))
        extra = {"gate_grad_mean": float(masked_mean(4.0 * sig * (1.0 - sig) * ratio, keep))}
    return PolicyLossTerms(token_loss=loss, metrics=_ratio_metrics(log_ratio, keep, **extra))
