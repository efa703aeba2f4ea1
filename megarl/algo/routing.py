"""MoE routing statistics: per-expert load.  Pure torch.

Routing tensors are ``(..., tokens, layers, top_k)`` integer expert ids (the layout of
:class:`megarl.experience.schema.RoutedExperts`, padded ``(bs, seq, layers, k)`` or packed
``(total, layers, k)``); a token's routing in a layer is the *set* of its top-k ids, so two
producers that list the same experts in another order agree (the rollout-vs-trainer mismatch the
replay tests measure is ``tests/_routing.py``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict

import torch

from megarl.experience.schema import RoutedExperts, routing_token_mask


@dataclass(frozen=True)
class ExpertLoad:
    """counts ``(layers, num_experts)``: token slots routed to each expert; max_over_mean and cv
    ``(layers,)``: each layer's max load / mean load and coefficient of variation (std / mean,
    population std); 1 and 0 for a perfectly balanced layer."""

    counts: torch.Tensor
    max_over_mean: torch.Tensor
    cv: torch.Tensor


def expert_load(experts: torch.Tensor, mask: torch.Tensor, num_experts: int) -> ExpertLoad:
    """Per-expert load of a routing tensor.

    Args:
        experts: ``(..., tokens, layers, top_k)`` expert ids.
        mask: ``(..., tokens)`` the tokens to count.
        num_experts: the number of routed experts (ids are in ``[0, num_experts)``).
    """
    keep = mask.to(torch.bool)
    if tuple(keep.shape) != tuple(experts.shape[:-2]):
        raise ValueError(f"mask shape {tuple(keep.shape)} != routing token shape {tuple(experts.shape[:-2])}")
    e = experts[keep].to(torch.int64)  # (n, layers, k)
    L = experts.shape[-2]
    counts = torch.zeros(L, num_experts, dtype=torch.float64)
    if e.numel():
        layer = torch.arange(L).view(1, L, 1).expand_as(e)
        counts.index_put_((layer.reshape(-1), e.reshape(-1)), torch.ones(e.numel(), dtype=torch.float64),
                          accumulate=True)
    mean = counts.mean(dim=1)
    safe = torch.where(mean > 0, mean, torch.ones_like(mean))
    max_over_mean = torch.where(mean > 0, counts.max(dim=1).values / safe, torch.zeros_like(mean))
    cv = torch.where(mean > 0, counts.std(dim=1, unbiased=False) / safe, torch.zeros_like(mean))
    return ExpertLoad(counts, max_over_mean, cv)


def routing_load_metrics(routed: RoutedExperts, attention_mask: torch.Tensor, prefix: str = "prep/routing") -> Dict[str, float]:
    """The load metrics of a sealed batch's routing on the tokens it records: the worst layer's
    max/mean load and the mean over layers of max/mean and of the cv."""
    load = expert_load(routed.experts, routing_token_mask(attention_mask), routed.num_experts)
    return {
        f"{prefix}/load_max_over_mean_worst_layer": float(load.max_over_mean.max()),
        f"{prefix}/load_max_over_mean": float(load.max_over_mean.mean()),
        f"{prefix}/load_cv": float(load.cv.mean()),
    }
