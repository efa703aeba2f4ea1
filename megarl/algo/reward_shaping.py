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
from megarl.experience.schema import LogProbs, RewardRecord, RewardStatus, TokenOrigins, expect_producer


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


def place_step_rewards(step_rewards: torch.Tensor, step_token_ends: torch.Tensor,
                       response_mask: torch.Tensor) -> torch.Tensor:
    """r_{i,t} = sum_k step_rewards[i, k] * [step_token_ends[i, k] = t]: each part of a reward on the
    action after which it is received (a process step's end, a turn's last policy token).

    Args:
        step_rewards: ``(bs, S)`` finite.
        step_token_ends: ``(bs, S)`` int64 response index of each part's last token (an action),
            -1 for a row's padding parts (their reward is ignored).
        response_mask: ``(bs, response_len)``.
    Returns:
        ``(bs, response_len)`` token rewards, dtype of ``step_rewards``, 0 where nothing lands.
    Raises:
        ValueError if an end is past the response or not an action token, or a reward is not finite.
    """
    bs, R = response_mask.shape
    if step_rewards.dim() != 2 or step_rewards.shape[0] != bs or step_token_ends.shape != step_rewards.shape:
        raise ValueError(f"place_step_rewards: step_rewards and step_token_ends must both be (bs={bs}, S), got "
                         f"{tuple(step_rewards.shape)} and {tuple(step_token_ends.shape)}")
    has = step_token_ends >= 0
    if bool((step_token_ends >= R).any()):
        raise ValueError(f"place_step_rewards: an end is >= response_len={R}")
    rows = torch.arange(bs, device=response_mask.device)[:, None].expand_as(step_token_ends)
    if bool((response_mask[rows[has], step_token_ends[has]] == 0).any()):
        raise ValueError("place_step_rewards: an end is not an action token (a reward is received after an action)")
    if not torch.isfinite(step_rewards[has]).all():
        raise ValueError("place_step_rewards: a reward is not finite; a failed reward must be a status")
    out = torch.zeros((bs, R), dtype=step_rewards.dtype, device=step_rewards.device)
    return out.scatter_add_(1, step_token_ends.clamp(min=0), torch.where(has, step_rewards, 0.0))


def turn_rewards(rewards: torch.Tensor, origins: TokenOrigins) -> torch.Tensor:
    """Per-turn rewards of multi-turn trajectories as token rewards: r_{i,t} = rewards[i, k] if t
    is the last policy token of turn k of sample i, else 0.

    Optional (an outcome-only run uses :func:`place_outcome_rewards`); the two add up, and the
    last turn's reward lands on the same token as the outcome.

    Args:
        rewards: ``(bs, K)`` finite, K >= every sample's number of turns; entries of turns a
            sample does not have must be 0 (a reward for a turn that never happened is refused).
        origins: the record's :class:`~megarl.experience.origins.TokenOrigins` ``(bs, R)``.
    Returns:
        ``(bs, R)`` token rewards, dtype of ``rewards``, 0 off the policy tokens.
    """
    bs, R = origins.source.shape
    if rewards.dim() != 2 or rewards.shape[0] != bs:
        raise ValueError(f"turn_rewards: rewards must be (bs={bs}, turns), got {tuple(rewards.shape)}")
    if not torch.isfinite(rewards).all():
        raise ValueError("turn_rewards: rewards contain a non-finite value; a failed reward must be a status")
    K = rewards.shape[1]
    n = origins.num_turns()
    if bool((n > K).any()):
        b = int((n > K).nonzero()[0])
        raise ValueError(f"turn_rewards: row {b} has {int(n[b])} turns, rewards only {K} columns")
    absent = torch.arange(K)[None, :] >= n[:, None]
    if bool((absent & (rewards != 0)).any()):
        b, k = (absent & (rewards != 0)).nonzero()[0].tolist()
        raise ValueError(f"turn_rewards: row {b} has {int(n[b])} turns but a non-zero reward for turn {k}")
    policy = origins.policy_mask()
    pos = torch.arange(R).expand(bs, R)
    # last policy position of each (row, turn): scatter-max of the positions by turn index
    last = torch.full((bs, max(K, 1)), -1, dtype=torch.long)
    last.scatter_reduce_(1, origins.turn.long().clamp(min=0), torch.where(policy, pos, -1), reduce="amax")
    out = torch.zeros((bs, R), dtype=rewards.dtype)
    has = last[:, :K] >= 0
    rows = torch.arange(bs)[:, None].expand(bs, K)
    out[rows[has], last[:, :K][has]] = rewards[has]
    return out


def kl_shaped_token_rewards(
    scores: torch.Tensor,
    response_mask: torch.Tensor,
    old_log_probs: LogProbs,
    ref_log_probs: LogProbs,
    beta: float,
    placed: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """r_{i,t} = -beta * (log pi_old(a_t) - log pi_ref(a_t)) * m_{i,t} + score_i * [t = T_i].

    PPO-style per-token KL shaping (Ouyang et al. 2022; Schulman 2020 k1 estimator); T_i is the
    last action of sample i.  ``placed`` ``(bs, response_len)``: the task rewards already on their
    tokens (:func:`place_step_rewards`), shaped instead of the score at T_i.  The producers are
    checked before any arithmetic: ``old_log_probs`` must come from the actor (old policy) or the
    rollout engine, ``ref_log_probs`` from the reference.

    Args:
        scores: ``(bs,)``.
        response_mask: ``(bs, response_len)``.
        old_log_probs: LogProbs with values ``(bs, response_len)``.
        ref_log_probs: LogProbs with values ``(bs, response_len)``.
        beta: KL coefficient >= 0.
    Returns:
        (token_rewards, k1), both ``(bs, response_len)``, zero off the response mask.
    """
    expect_producer(old_log_probs, field="old_log_probs", roles=("actor", "rollout", "engine"))
    expect_producer(ref_log_probs, field="ref_log_probs", roles=("reference",))
    if not (beta >= 0 and math.isfinite(beta)):
        raise ValueError(f"beta must be finite and >= 0, got {beta}")
    keep = response_mask != 0
    k1 = torch.where(keep, kl_k1(old_log_probs.values, ref_log_probs.values), 0.0)
    task = place_outcome_rewards(scores.to(k1.dtype), response_mask) if placed is None else placed.to(k1.dtype)
    rewards = task - beta * k1
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
