"""The actor objective: policy loss + reference KL in the loss + entropy bonus, one aggregation.

    L_{i,t} = w_{i,t} * PG_{i,t} + beta * KL_{i,t} - c_ent * H_{i,t}
    loss    = aggregate_loss(L, loss_mask, cfg.agg_mode, normaliser)

with PG the registered policy loss (:mod:`megarl.algo.policy_loss`), w the optional truncated
IS weights (:mod:`megarl.algo.rollout_correction`), KL the chosen estimator between the current
policy and the reference (only when ``cfg.kl.placement == "loss"``; Shao et al. 2024), and H the
per-token entropy of the current policy.  Every term shares one mask and one normaliser, so
the sum aggregates exactly like each term (aggregation is linear).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megarl.algo.aggregation import GlobalNormaliser, aggregate_loss
from megarl.algo.kl import kl_estimate
from megarl.algo.policy_loss import PolicyLossConfig
from megarl.algo.registry import get_policy_loss
from megarl.experience.schema import LogProbs, expect_producer


@dataclass
class ActorLossOutput:
    loss: torch.Tensor
    metrics: dict[str, float]


def actor_loss(
    log_probs: torch.Tensor,
    *,
    old_log_probs: LogProbs,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    cfg: PolicyLossConfig,
    normaliser: GlobalNormaliser,
    ref_log_probs: LogProbs | None = None,
    entropy: torch.Tensor | None = None,
    is_weights: torch.Tensor | None = None,
    old_version: str | None = None,
    kl_beta: float | None = None,
) -> ActorLossOutput:
    """This micro-batch's contribution to the global actor loss (formula in the module docstring).

    The producer contract is checked first, before any tensor arithmetic: ``old_log_probs`` must
    come from a role in ``cfg.old_log_prob_roles`` in ``cfg.log_prob_space`` (and from
    ``old_version`` when given); ``ref_log_probs`` from the reference when the KL is in the loss.

    Args:
        log_probs: ``(bs, R)`` current-policy log-probs of the sampled tokens (requires grad).
        old_log_probs: LogProbs ``(bs, R)`` of the behaviour policy, sealed before any update.
        advantages: ``(bs, R)``.
        loss_mask: ``(bs, R)``.
        cfg: PolicyLossConfig.
        normaliser: GlobalNormaliser for ``cfg.agg_mode`` over the optimizer step.
        ref_log_probs: LogProbs ``(bs, R)`` of the reference (KL in loss).
        entropy: ``(bs, R)`` per-token entropy of the current policy (needed if entropy_coef > 0).
        is_weights: ``(bs, R)`` truncated IS weights (detached).
        old_version: the policy version the old log-probs must carry.
        kl_beta: overrides ``cfg.kl.beta`` (an adaptive controller's current value).
    """
    expect_producer(
        old_log_probs, field="old_log_probs", roles=cfg.old_log_prob_roles, version=old_version, space=cfg.log_prob_space
    )
    kl_in_loss = cfg.kl.placement == "loss"
    if kl_in_loss:
        if ref_log_probs is None:
            raise ValueError("ref_log_probs is required: cfg.kl.placement is 'loss'")
        expect_producer(ref_log_probs, field="ref_log_probs", roles=("reference",))
    if cfg.entropy_coef > 0 and entropy is None:
        raise ValueError(f"entropy is required: cfg.entropy_coef = {cfg.entropy_coef}")
    shape = tuple(log_probs.shape)
    named = {"old_log_probs": old_log_probs.values, "advantages": advantages, "loss_mask": loss_mask}
    if kl_in_loss:
        named["ref_log_probs"] = ref_log_probs.values
    if entropy is not None:
        named["entropy"] = entropy
    if is_weights is not None:
        named["is_weights"] = is_weights
    for k, v in named.items():
        if tuple(v.shape) != shape:
            raise ValueError(f"actor_loss: {k} has shape {tuple(v.shape)}, expected log_probs' {shape}")

    old = old_log_probs.values.detach()
    terms = get_policy_loss(cfg.name)(log_probs, old, advantages.detach(), loss_mask, cfg)
    token = terms.token_loss
    if is_weights is not None:
        token = token * is_weights.detach()
    metrics = dict(terms.metrics)
    metrics["pg_loss"] = float(aggregate_loss(token.detach(), loss_mask, cfg.agg_mode, normaliser))
    keep = loss_mask != 0
    if kl_in_loss:
        beta = cfg.kl.beta if kl_beta is None else kl_beta
        kl = kl_estimate(log_probs, ref_log_probs.values.detach(), cfg.kl.estimator)
        kl = torch.where(keep, kl, 0.0)
        token = token + beta * kl
        metrics["kl_loss"] = float(aggregate_loss(kl.detach(), loss_mask, cfg.agg_mode, normaliser))
        metrics["kl_beta"] = float(beta)
    if entropy is not None:
        ent = torch.where(keep, entropy, 0.0)
        if cfg.entropy_coef > 0:
            token = token - cfg.entropy_coef * ent
        metrics["entropy"] = float(aggregate_loss(ent.detach(), loss_mask, cfg.agg_mode, normaliser))
    loss = aggregate_loss(token, loss_mask, cfg.agg_mode, normaliser)
    return ActorLossOutput(loss=loss, metrics=metrics)
