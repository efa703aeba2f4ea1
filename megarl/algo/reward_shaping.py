"""Turning outcome scores into per-token rewards, and DAPO's overlong-response shaping.

Outcome reward is observed after the last action, so it is placed on the last response token
that is a sampled action.  With KL placed in the reward (PPO / InstructGPT, Ouyang et al. 2022;
Ziegler et al. 2019) every action token also receives ``-beta * k1_t``, where
``k1_t = log pi_old(a_t) - log pi_ref(a_t)`` (the old policy: these are facts of the sealed
batch, computed once, never from the policy being updated).
"""

from __future__ import annotations

import dataclasses
import math

import torch

from megarl.algo.kl import kl_k1
from megarl.experience.schema import LogProbs, RewardRecord, RewardStatus, expect_producer


def last_action_index(response_mask: torch.Tensor) -> torch.Tensor:
    """Index of the last token with ``response_mask == 1`` per row, -1 for rows with none.

    Args:
        response_mask: ``(bs, response_len)``.
    Returns:
        ``(bs,)`` int64.
    """
    if response_mask.dim() != 2:
        raise ValueError(f"response_mask must be (bs, response_len), got {tuple(response_mask.shape)}")
    pos = torch.arange(response_mask.shape[1], device=response_mask.device).expand_as(response_mask)
    return torch.where(response_mask != 0, pos, torch.full_like(pos, -1)).max(dim=-1).values


def place_outcome_rewards(scores: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """r_{i,t} = score_i if t is the last action of sample i, else 0.

    Args:
        scores: ``(bs,)`` outcome reward per sample (finite).
        response_mask: ``(bs, response_len)``.
    Returns:
        ``(bs, response_len)`` token rewards, dtype of ``scores``.
    Raises:
        ValueError if a sample with a score has no action token (nowhere to put the reward).
    """
    if scores.dim() != 1 or scores.shape[0] != response_mask.shape[0]:
        raise ValueError(f"scores must be (bs,) = ({response_mask.shape[0]},), got {tuple(scores.shape)}")
    if not torch.isfinite(scores).all():
        raise ValueError("scores contain a non-finite value; a failed reward must be a status, not a number")
    last = last_action_index(response_mask)
    if (last < 0).any():
        rows = (last < 0).nonzero().flatten().tolist()
        raise ValueError(f"place_outcome_rewards: rows {rows} have no action token in response_mask")
    out = torch.zeros(response_mask.shape, dtype=scores.dtype, device=scores.device)
    out.scatter_(1, last.unsqueeze(1), scores.unsqueeze(1))
    return out


def kl_shaped_token_rewards(
    scores: torch.Tensor,
    response_mask: torch.Tensor,
    old_log_probs: LogProbs,
    ref_log_probs: LogProbs,
    beta: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """r_{i,t} = -beta * (log pi_old(a_t) - log pi_ref(a_t)) * m_{i,t} + score_i * [t = T_i].

    PPO-style per-token KL shaping (Ouyang et al. 2022; Schulman 2020 k1 estimator); T_i is the
    last action of sample i.  The producers are checked before any arithmetic: ``old_log_probs``
    must come from the actor (old policy) or the rollout engine, ``ref_log_probs`` from the
    reference.

    Args:
        scores: ``(bs,)``.
        response_mask: ``(bs, response_len)``.
        old_log_probs: LogProbs with values ``(bs, response_len)``.
        ref_log_probs: LogProbs with values ``(bs, response_len)``.
        beta: KL coefficient >= 0.
    Returns:
        (token_rewards, k1), both ``(bs, response_len)``, zero off the response mask.
    """
    expect_producer(old_log_probs, field="old_log_probs", roles=("actor", "rollout"))
    expect_producer(ref_log_probs, field="ref_log_probs", roles=("reference",))
    if not (beta >= 0 and math.isfinite(beta)):
        raise ValueError(f"beta must be finite and >= 0, got {beta}")
    keep = response_mask != 0
    k1 = torch.where(keep, kl_k1(old_log_probs.values, ref_log_probs.values), 0.0)
    rewards = place_outcome_rewards(scores.to(k1.dtype), response_mask) - beta * k1
    return rewards, k1


def overlong_penalty(response_lengths: torch.Tensor, max_response_length: int, overlong_buffer: int) -> torch.Tensor:
    """DAPO soft overlong punishment (Yu et al. 2025, eq. 13).

        R_len(y) = 0                               if |y| <= L_max - L_cache
                 = ((L_max - L_cache) - |y|) / L_cache  if L_max - L_cache < |y| <= L_max
                 = -1                              if |y| > L_max

    Args:
        response_lengths: ``(bs,)`` number of response action tokens |y|.
        max_response_length: L_max.
        overlong_buffer: L_cache, 0 < L_cache <= L_max.
    Returns:
        ``(bs,)`` float64 penalties in [-1, 0].
    """
    if not 0 < overlong_buffer <= max_response_length:
        raise ValueError(
            f"overlong_buffer (L_cache={overlong_buffer}) must be in (0, max_response_length={max_response_length}]"
        )
    n = response_lengths.to(torch.float64)
    start = float(max_response_length - overlong_buffer)
    soft = (start - n) / float(overlong_buffer)
    out = torch.where(n <= start, torch.zeros_like(n), soft)
    return torch.where(n > max_response_length, torch.full_like(n, -1.0), out)


def with_overlong_component(
    record: RewardRecord, response_length: int, max_response_length: int, overlong_buffer: int
) -> RewardRecord:
    """A new RewardRecord with the DAPO overlong penalty as component ``overlong`` added to total.

    Only an ``ok`` record is shaped; an error / timeout / invalid record stays a status (a penalty
    must never turn a failure into a number).
    """
    if record.status is not RewardStatus.OK:
        return record
    if "overlong" in record.components:
        raise ValueError("RewardRecord already has an 'overlong' component; shaping twice would double it")
    pen = float(overlong_penalty(torch.tensor([response_length]), max_response_length, overlong_buffer)[0])
    comps = dict(record.components)
    comps["overlong"] = pen
    return dataclasses.replace(record, total=record.total + pen, components=comps)
