"""For the routing-replay tests: a forced MoE routing (seeded top-k sets the router would not
choose), and how often two routings disagree."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megarl.models.router_replay import RowRouting


def forced_routing(batch: int, seq: int, moe_layers, top_k: int, num_experts: int, lengths=None,
                   seed: int = 0) -> RowRouting:
    """``(batch, seq, layers, top_k)`` distinct random experts per token and layer (the same on
    every rank for a seed); valid on every real token but each row's last (as a rollout records)."""
    g = torch.Generator().manual_seed(seed)
    n = batch * seq * len(moe_layers)
    ids = torch.stack([torch.randperm(num_experts, generator=g)[:top_k] for _ in range(n)])
    lengths = torch.full((batch,), seq) if lengths is None else lengths
    valid = torch.arange(seq)[None, :] < (lengths - 1)[:, None]
    return RowRouting(ids.reshape(batch, seq, len(moe_layers), top_k), valid, tuple(moe_layers))


def moe_layer_indices(model) -> tuple:
    from megarl.models.weights import unwrap

    return tuple(i for i, m in enumerate(unwrap(model).megarl_spec.moe.moe_layers) if m)


@dataclass(frozen=True)
class RoutingMismatch:
    """token_share: share of counted tokens whose top-k set differs in at least one layer;
    per_layer ``(layers,)``: share of counted tokens whose set differs in that layer;
    router_share: share of (token, layer) pairs that differ (the mean of ``per_layer``);
    tokens: how many tokens were counted."""

    token_share: float
    per_layer: torch.Tensor
    router_share: float
    tokens: int


def _sets_differ(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``(..., tokens, layers)`` bool: the top-k sets of ``a`` and ``b`` differ."""
    if a.shape != b.shape:
        raise ValueError(f"routing shapes differ: {tuple(a.shape)} vs {tuple(b.shape)}")
    sa = a.to(torch.int64).sort(dim=-1).values
    sb = b.to(torch.int64).sort(dim=-1).values
    return (sa != sb).any(dim=-1)


def routing_mismatch(rollout: torch.Tensor, trainer: torch.Tensor, mask: torch.Tensor) -> RoutingMismatch:
    """How often the trainer routes a token elsewhere than the rollout did.

    Args:
        rollout: ``(..., tokens, layers, top_k)`` the rollout's expert ids.
        trainer: the same shape, the trainer's (a forward with replay off).
        mask: ``(..., tokens)`` 1 / True on the tokens to count (e.g.
            :func:`~megarl.experience.schema.routing_token_mask`).
    Returns:
        :class:`RoutingMismatch` (zeros when no token is counted).
    """
    diff = _sets_differ(rollout, trainer)  # (..., tokens, layers)
    keep = mask.to(torch.bool)
    if tuple(keep.shape) != tuple(diff.shape[:-1]):
        raise ValueError(f"mask shape {tuple(keep.shape)} != routing token shape {tuple(diff.shape[:-1])}")
    d = diff[keep]  # (n, layers)
    n = d.shape[0]
    if n == 0:
        return RoutingMismatch(0.0, torch.zeros(diff.shape[-1], dtype=torch.float64), 0.0, 0)
    per_layer = d.to(torch.float64).mean(dim=0)
    return RoutingMismatch(float(d.any(dim=1).to(torch.float64).mean()), per_layer, float(per_layer.mean()), n)
