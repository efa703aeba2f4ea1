"""On-policy distillation: the teacher's per-token reverse KL on the student's own samples as a
dense advantage (Agarwal et al. 2024, GKD, arXiv:2306.13649; Gu et al. 2024, MiniLLM,
arXiv:2306.08543; Lu and Thinking Machines Lab 2025, "On-Policy Distillation").

The student pi samples y; the teacher T is teacher-forced on the same tokens.  Per action token

    k_t = log pi_old(a_t) - log T(a_t)        (the sampled estimate of KL(pi || T) at t)
    A_t = -k_t                                (``on_policy_distill``: the whole advantage)
    A_t = A^est_t - c * k_t                   (``algo.distill_coef`` c > 0 beside another estimator)

so minimising the policy loss with A = -k lowers the reverse KL on the student's own
distribution: a signal on every token where an outcome reward gives one per response.  No
discount and no baseline (the teacher's log-prob is already a per-token baseline-free target).
``pi_old`` is the student's sealed old log-prob (the policy that sampled), so A is a fact of the
batch, never a function of the weights being updated.
"""

from __future__ import annotations

import torch

from megarl.algo.advantages import AdvantageConfig, AdvantageInputs, AdvantageResult
from megarl.algo.aggregation import masked_mean
from megarl.algo.kl import kl_k1
from megarl.algo.registry import EstimatorNeeds, register_advantage

__all__ = ["reverse_kl_per_token", "on_policy_distill_advantage", "distill_metrics"]


def reverse_kl_per_token(student_log_probs: torch.Tensor, teacher_log_probs: torch.Tensor,
                         response_mask: torch.Tensor) -> torch.Tensor:
    """``k_t = log pi(a_t) - log T(a_t)`` on the action tokens, 0 elsewhere; all ``(bs, R)``.

    Raises ValueError on a shape mismatch or a non-finite value on an action token."""
    if student_log_probs.shape != response_mask.shape or teacher_log_probs.shape != response_mask.shape:
        raise ValueError(f"reverse_kl_per_token: log-probs {tuple(student_log_probs.shape)} / "
                         f"{tuple(teacher_log_probs.shape)} must be shaped like response_mask {tuple(response_mask.shape)}")
    keep = response_mask != 0
    k = torch.where(keep, kl_k1(student_log_probs.to(torch.float64), teacher_log_probs.to(torch.float64)), 0.0)
    if not torch.isfinite(k).all():
        raise ValueError("reverse_kl_per_token: a non-finite log-prob on an action token")
    return k


@register_advantage("on_policy_distill", EstimatorNeeds(teacher=True))
def on_policy_distill_advantage(inputs: AdvantageInputs, cfg: AdvantageConfig, *, process_group=None) -> AdvantageResult:
    """A_t = log T(a_t) - log pi_old(a_t) on every action token (module docstring).

    Reads response_mask, old_log_probs, teacher_log_probs ``(bs, R)``; returns advantages and
    loss_mask ``(bs, R)`` (every action token) and the ``reverse_kl`` metric (the mean k_t)."""
    mask = inputs.response_mask
    if inputs.old_log_probs is None or inputs.teacher_log_probs is None:
        raise ValueError("advantage estimator 'on_policy_distill' needs AdvantageInputs.old_log_probs and teacher_log_probs")
    k = reverse_kl_per_token(inputs.old_log_probs, inputs.teacher_log_probs, mask)
    keep = mask != 0
    adv = (-k).to(inputs.old_log_probs.dtype if inputs.old_log_probs.is_floating_point() else torch.float32)
    return AdvantageResult(advantages=adv, loss_mask=keep.to(mask.dtype),
                           metrics={"reverse_kl": float(masked_mean(k, keep)) if keep.any() else 0.0})


def distill_metrics(k: torch.Tensor, distill_part: torch.Tensor, advantages: torch.Tensor,
                    loss_mask: torch.Tensor) -> dict[str, float]:
    """``reverse_kl``: mean k_t over the kept tokens; ``advantage_share``: the distillation term's
    share of the advantage's magnitude, sum |c k_t| / sum |A_t| (1.0 for distillation alone)."""
    keep = loss_mask != 0
    if not keep.any():
        return {"reverse_kl": 0.0, "advantage_share": 0.0}
    total = float(advantages.to(torch.float64)[keep].abs().sum())
    return {"reverse_kl": float(k[keep].mean()),
            "advantage_share": float(distill_part.to(torch.float64)[keep].abs().sum()) / total if total > 0 else 0.0}
