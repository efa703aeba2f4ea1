"""A forced MoE routing for replay tests: seeded top-k sets the router would not choose."""

from __future__ import annotations

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
