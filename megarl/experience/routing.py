"""Routing of MoE samples: from each generated sample's routing to the batch record.

The per-sample routing (:class:`~megarl.experience.schema.SampleRouting`, what an engine returns)
covers prompt + response tokens except the last; the batch record
(:class:`~megarl.experience.schema.RoutedExperts`) lays the rows on the experience's padded grid
``(bs, prompt_len + response_len, layers, top_k)``: left-padded prompt, right-padded response, so
position ``s`` of row ``b`` is the token ``cat([prompt_ids, response_ids], 1)[b, s]``.  Positions
that no engine routed (padding, each row's last token) hold experts ``0 .. top_k-1``.  A packed
(THD) forward takes ``megarl.experience.packing.pack(experts, layout)``: the real tokens, in order.
"""

from __future__ import annotations

from typing import Sequence

import torch

from megarl.experience.schema import RoutedExperts, RoutingProducer, SampleRouting, compact_expert_dtype


def collate_routing(routings: Sequence[SampleRouting], prompt_lens: Sequence[int], response_lens: Sequence[int],
                    prompt_len: int, response_len: int, version: str) -> RoutedExperts:
    """Lay each sample's routing on the padded grid.

    Args:
        routings: one per sample, in batch order; all from one engine and model (same backend,
            number of experts, MoE layers and top-k).
        prompt_lens / response_lens: each sample's real prompt / response token counts.
        prompt_len / response_len: the padded widths ``P`` / ``R`` of the batch.
        version: the policy version the samples were generated on (the producer's version).
    Returns:
        the batch record, ``experts`` ``(bs, P + R, layers, top_k)``.
    """
    if not routings:
        raise ValueError("collate_routing: no samples")
    first = routings[0]
    for i, r in enumerate(routings):
        if (r.backend, r.num_experts, r.moe_layers, r.top_k) != (first.backend, first.num_experts, first.moe_layers, first.top_k):
            raise ValueError(
                f"collate_routing: sample {i} was routed by ({r.backend}, {r.num_experts} experts, layers "
                f"{r.moe_layers}, top-{r.top_k}), sample 0 by ({first.backend}, {first.num_experts} experts, "
                f"layers {first.moe_layers}, top-{first.top_k}): one batch, one model")
    B, L, k = len(routings), len(first.moe_layers), first.top_k
    dtype = compact_expert_dtype(first.num_experts)
    out = torch.arange(k, dtype=dtype).expand(B, prompt_len + response_len, L, k).clone()
    for b, (r, p, n) in enumerate(zip(routings, prompt_lens, response_lens, strict=True)):
        if r.experts.shape[0] != p + n - 1:
            raise ValueError(f"collate_routing: sample {b} has {r.experts.shape[0]} routing rows for {p} prompt and "
                             f"{n} response tokens (expected {p + n - 1})")
        out[b, prompt_len - p: prompt_len + n - 1] = r.experts
    return RoutedExperts(experts=out, producer=RoutingProducer("rollout", first.backend, version),
                         num_experts=first.num_experts, moe_layers=first.moe_layers)
