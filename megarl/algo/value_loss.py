"""Clipped value loss for the PPO critic."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megarl.algo.aggregation import GlobalNormaliser, aggregate_loss, masked_mean


@dataclass
class ValueLossOutput:
    loss: torch.Tensor
    metrics: dict[str, float]


def clipped_value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    loss_mask: torch.Tensor,
    clip_range: float | None,
    agg_mode: str,
    normaliser: GlobalNormaliser,
) -> ValueLossOutput:
    """PPO clipped value loss (Schulman et al. 2017; as in OpenAI baselines ppo2).

        V^clip_t = V_old_t + clip(V_t - V_old_t, -eps, eps)
        L_t      = 0.5 * max((V_t - G_t)^2, (V^clip_t - G_t)^2)       (eps = None: 0.5 (V_t - G_t)^2)

    Args:
        values: ``(bs, R)`` current critic predictions (requires grad).
        old_values: ``(bs, R)`` the sealed values the returns were computed with.
        returns: ``(bs, R)`` targets G_t.
        loss_mask: ``(bs, R)``.
        clip_range: eps > 0, or None for the unclipped loss.
        agg_mode, normaliser: see :mod:`megarl.algo.aggregation`.
    Returns:
        the aggregated loss and metrics: vf_clipfrac (tokens where the clipped branch is
        larger), value_mse and value_mae (prediction error of V_t against G_t), local means.
    """
    if not (values.shape == old_values.shape == returns.shape == loss_mask.shape):
        raise ValueError(
            f"values {tuple(values.shape)}, old_values {tuple(old_values.shape)}, returns {tuple(returns.shape)} "
            f"and loss_mask {tuple(loss_mask.shape)} must all be (bs, response_len)"
        )
    if clip_range is not None and not clip_range > 0:
        raise ValueError(f"clip_range must be > 0 or None, got {clip_range}")
    keep = loss_mask != 0
    err = torch.where(keep, values - returns, 0.0)
    l1 = err * err
    if clip_range is None:
        token = 0.5 * l1
        clipped = torch.zeros_like(keep)
    else:
        v_clip = old_values + (values - old_values).clamp(-clip_range, clip_range)
        err2 = torch.where(keep, v_clip - returns, 0.0)
        l2 = err2 * err2
        token = 0.5 * torch.maximum(l1, l2)
        clipped = l2 > l1
    loss = aggregate_loss(token, loss_mask, agg_mode, normaliser)
    with torch.no_grad():
        e = err.detach()
        metrics = {
            "vf_clipfrac": float(masked_mean(clipped.to(e.dtype), keep)),
            "value_mse": float(masked_mean(e * e, keep)),
            "value_mae": float(masked_mean(e.abs(), keep)),
        }
    return ValueLossOutput(loss=loss, metrics=metrics)
