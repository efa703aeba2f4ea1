"""Advantage estimators, registered by name.

Every estimator has the signature ``fn(inputs: AdvantageInputs, cfg: AdvantageConfig, *,
process_group=None) -> AdvantageResult`` and is pure torch over ``(bs, response_len)`` tensors.
Group estimators (GRPO, Dr. GRPO, RLOO, GRPO with process rewards) need every group complete on
the calling rank (:mod:`megarl.experience.groups` guarantees it); the batch-normalising
estimator (REINFORCE++) reduces its statistics over ``process_group`` when one is given.

Zero-variance groups (all rewards equal, std <= ``std_eps``, or a single member) follow
``cfg.zero_std_rule`` and are counted in ``metrics["zero_std_groups"]``:
- ``epsilon``: the group's advantages are exactly 0 (equivalent to dividing by max(std, eps)
  with r - mean = 0), its tokens stay in the loss and its normaliser;
- ``skip``: the group carries no training signal; its samples leave ``loss_mask`` (and so the
  normaliser) and their advantages are 0.
No estimator ever produces a NaN: statistics of a degenerate group are never divided by.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, get_args

import torch
import torch.distributed as dist

from megarl.algo.registry import EstimatorNeeds, register_advantage

ZeroStdRule = Literal["epsilon", "skip"]
ZERO_STD_RULES: tuple[str, ...] = get_args(ZeroStdRule)


@dataclass(frozen=True)
class AdvantageConfig:
    """Hyperparameters of the estimators.

    gamma, lam: discount and GAE lambda.  zero_std_rule / std_eps: see module docstring.
    """

    gamma: float = 1.0
    lam: float = 1.0
    zero_std_rule: str = "epsilon"
    std_eps: float = 1e-6
    whiten_eps: float = 1e-8

    def __post_init__(self) -> None:
        if not 0.0 <= self.gamma <= 1.0:
            raise ValueError(f"AdvantageConfig.gamma must be in [0, 1], got {self.gamma}")
        if not 0.0 <= self.lam <= 1.0:
            raise ValueError(f"AdvantageConfig.lam must be in [0, 1], got {self.lam}")
        if self.zero_std_rule not in ZERO_STD_RULES:
            raise ValueError(f"AdvantageConfig.zero_std_rule {self.zero_std_rule!r} is not one of {ZERO_STD_RULES}")
        if not self.std_eps > 0 or not self.whiten_eps > 0:
            raise ValueError("AdvantageConfig.std_eps and whiten_eps must be > 0")


@dataclass(frozen=True)
class AdvantageInputs:
    """What an estimator may read.  Shapes: ``bs`` samples, ``R`` = response_len.

    response_mask: ``(bs, R)`` 1 on sampled action tokens.
    scores: ``(bs,)`` outcome reward totals (group estimators).
    group_index: ``(bs,)`` int64 group of each sample, 0..n_groups-1 (group estimators).
    token_rewards: ``(bs, R)`` per-token rewards, 0 off the mask (GAE, REINFORCE++).
    values: ``(bs, R)`` critic values V(s_t) before action t (GAE).
    terminated: ``(bs,)`` bool, True when the episode ended after the last action (eos / stop).
    bootstrap_values: ``(bs,)`` V(s_T) of the state after the last action; read for truncated
        samples only (GAE).
    step_rewards: ``(bs, S)`` process rewards, one per reasoning step (GRPO process).
    step_token_ends: ``(bs, S)`` int64 response index of each step's last token, -1 = no step.
    old_log_probs / teacher_log_probs: ``(bs, R)`` the student's sealed old log-probs and the
        teacher's of the same tokens (on-policy distillation).
    """

    response_mask: torch.Tensor
    scores: torch.Tensor | None = None
    group_index: torch.Tensor | None = None
    token_rewards: torch.Tensor | None = None
    values: torch.Tensor | None = None
    terminated: torch.Tensor | None = None
    bootstrap_values: torch.Tensor | None = None
    step_rewards: torch.Tensor | None = None
    step_token_ends: torch.Tensor | None = None
    old_log_probs: torch.Tensor | None = None
    teacher_log_probs: torch.Tensor | None = None


@dataclass(frozen=True)
class AdvantageResult:
    """advantages / returns / loss_mask ``(bs, R)``; metrics are plain floats."""

    advantages: torch.Tensor
    loss_mask: torch.Tensor
    returns: torch.Tensor | None = None
    metrics: dict[str, float] = field(default_factory=dict)


def _need(inputs: AdvantageInputs, name: str, estimator: str) -> torch.Tensor:
    t = getattr(inputs, name)
    if t is None:
        raise ValueError(f"advantage estimator {estimator!r} needs AdvantageInputs.{name}")
    return t


def _check_shape(name: str, t: torch.Tensor, shape: tuple[int, ...]) -> None:
    if tuple(t.shape) != shape:
        raise ValueError(f"AdvantageInputs.{name} must have shape {shape}, got {tuple(t.shape)}")


def _check_token_rewards(rewards: torch.Tensor, mask: torch.Tensor) -> None:
    _check_shape("token_rewards", rewards, tuple(mask.shape))
    if (rewards[mask == 0] != 0).any():
        raise ValueError("AdvantageInputs.token_rewards is non-zero outside response_mask (reward on a prompt/padding position?)")
    if not torch.isfinite(rewards).all():
        raise ValueError("AdvantageInputs.token_rewards contains a non-finite value")


# ----------------------------------------------------------------------------------------------
# group statistics


@dataclass(frozen=True)
class GroupStats:
    """Per-group statistics of a ``(bs,)`` vector, all ``(n_groups,)`` float64.

    ``std`` is the Bessel-corrected sample std, sqrt(sum (x - mean)^2 / (n - 1)), 0 for n = 1;
    ``degenerate`` marks groups with n < 2 or std <= eps (no usable group baseline / scale).
    """

    count: torch.Tensor
    mean: torch.Tensor
    std: torch.Tensor
    degenerate: torch.Tensor


def group_stats(x: torch.Tensor, group_index: torch.Tensor, eps: float, weights: torch.Tensor | None = None) -> GroupStats:
    """mean_g = sum_{i in g} w_i x_i / n_g, std_g = sqrt(sum_{i in g} w_i (x_i - mean_g)^2 / (n_g - 1)).

    Args:
        x: ``(n,)`` values (scores, or flattened step rewards).
        group_index: ``(n,)`` int64 group of each value.
        eps: std threshold below which a group is degenerate.
        weights: optional ``(n,)`` 0/1 membership (pooled step rewards use it for padding steps).
    """
    if group_index.dtype not in (torch.int32, torch.int64) or group_index.shape != x.shape:
        raise ValueError(f"group_index must be an int tensor shaped like the values {tuple(x.shape)}, got {group_index.dtype} {tuple(group_index.shape)}")
    if group_index.numel() and group_index.min() < 0:
        raise ValueError("group_index must be >= 0")
    n_groups = int(group_index.max()) + 1 if group_index.numel() else 0
    x64 = x.to(torch.float64)
    w = torch.ones_like(x64) if weights is None else weights.to(torch.float64)
    gi = group_index.long()
    count = torch.zeros(n_groups, dtype=torch.float64, device=x.device).index_add_(0, gi, w)
    total = torch.zeros_like(count).index_add_(0, gi, w * x64)
    mean = total / count.clamp(min=1)
    dev = (x64 - mean[gi]) * w
    sq = torch.zeros_like(count).index_add_(0, gi, dev * dev)
    std = torch.where(count > 1, torch.sqrt(sq / (count - 1).clamp(min=1)), torch.zeros_like(sq))
    degenerate = (count < 2) | (std <= eps)
    return GroupStats(count=count, mean=mean, std=std, degenerate=degenerate)


def _group_inputs(inputs: AdvantageInputs, estimator: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    mask = inputs.response_mask
    scores = _need(inputs, "scores", estimator)
    gidx = _need(inputs, "group_index", estimator)
    bs = mask.shape[0]
    _check_shape("scores", scores, (bs,))
    _check_shape("group_index", gidx, (bs,))
    if not torch.isfinite(scores).all():
        raise ValueError("AdvantageInputs.scores contains a non-finite value; failed rewards must not reach the estimator")
    return mask, scores, gidx


def _finish_group_estimator(
    per_sample: torch.Tensor, stats: GroupStats, gidx: torch.Tensor, mask: torch.Tensor, cfg: AdvantageConfig, dtype
) -> AdvantageResult:
    """Zero the degenerate groups, apply the zero-std rule, broadcast per-sample values to tokens."""
    deg_sample = stats.degenerate[gidx]
    per_sample = torch.where(deg_sample, torch.zeros_like(per_sample), per_sample)
    valid = mask != 0
    if cfg.zero_std_rule == "skip":
        loss_mask = valid & ~deg_sample[:, None]
    else:
        loss_mask = valid
    adv = torch.where(loss_mask, per_sample[:, None].to(dtype), torch.zeros((), dtype=dtype, device=mask.device))
    return AdvantageResult(
        advantages=adv,
        loss_mask=loss_mask.to(mask.dtype),
        returns=None,
        metrics=_group_metrics(stats, deg_sample, cfg),
    )


def _group_metrics(stats: GroupStats, deg_sample: torch.Tensor, cfg: AdvantageConfig) -> dict[str, float]:
    present = stats.count > 0
    n_deg = int((stats.degenerate & present).sum())
    return {
        "groups": float(present.sum()),
        "zero_std_groups": float(n_deg),
        "skipped_groups": float(n_deg if cfg.zero_std_rule == "skip" else 0),
        "skipped_samples": float(deg_sample.sum() if cfg.zero_std_rule == "skip" else 0),
        "group_size_min": float(stats.count[present].min()) if present.any() else 0.0,
        "group_size_max": float(stats.count[present].max()) if present.any() else 0.0,
    }


# ----------------------------------------------------------------------------------------------
# outcome-reward group estimators


@register_advantage("grpo", EstimatorNeeds(groups=True))
def grpo_outcome_advantage(inputs: AdvantageInputs, cfg: AdvantageConfig, *, process_group=None) -> AdvantageResult:
    """GRPO outcome supervision (Shao et al. 2024, DeepSeekMath, sec. 4.1.2).

        A_{i,t} = (r_i - mean(r_g)) / std(r_g)   for every action token t of sample i in group g

    with the Bessel-corrected std; a zero-variance group follows ``cfg.zero_std_rule``.

    Reads: response_mask ``(bs, R)``, scores ``(bs,)``, group_index ``(bs,)``.
    Returns: advantages ``(bs, R)`` (0 off the loss mask), loss_mask ``(bs, R)``.
    """
    mask, scores, gidx = _group_inputs(inputs, "grpo")
    st = group_stats(scores, gidx, cfg.std_eps)
    safe_std = torch.where(st.degenerate, torch.ones_like(st.std), st.std)
    a = (scores.to(torch.float64) - st.mean[gidx]) / safe_std[gidx]
    return _finish_group_estimator(a, st, gidx, mask, cfg, scores.dtype if scores.is_floating_point() else torch.float32)


@register_advantage("dr_grpo", EstimatorNeeds(groups=True))
def dr_grpo_advantage(inputs: AdvantageInputs, cfg: AdvantageConfig, *, process_group=None) -> AdvantageResult:
    """Dr. GRPO (Liu et al. 2025, "Understanding R1-Zero-like training"): no std division.

        A_{i,t} = r_i - mean(r_g)

    Pair with the ``seq-mean-token-sum-norm`` aggregation (constant length normaliser).  A
    zero-variance group (advantage 0 anyway) is counted and follows ``cfg.zero_std_rule``.
    Shapes as :func:`grpo_outcome_advantage`.
    """
    mask, scores, gidx = _group_inputs(inputs, "dr_grpo")
    st = group_stats(scores, gidx, cfg.std_eps)
    a = scores.to(torch.float64) - st.mean[gidx]
    return _finish_group_estimator(a, st, gidx, mask, cfg, scores.dtype if scores.is_floating_point() else torch.float32)


@register_advantage("rloo", EstimatorNeeds(groups=True))
def rloo_advantage(inputs: AdvantageInputs, cfg: AdvantageConfig, *, process_group=None) -> AdvantageResult:
    """RLOO, leave-one-out baseline (Ahmadian et al. 2024, "Back to Basics"; Kool et al. 2019).

        A_{i,t} = r_i - (1 / (n_g - 1)) * sum_{j in g, j != i} r_j

    A group of one has no baseline and a zero-variance group has A = 0; both are degenerate and
    follow ``cfg.zero_std_rule``.  Shapes as :func:`grpo_outcome_advantage`.
    """
    mask, scores, gidx = _group_inputs(inputs, "rloo")
    st = group_stats(scores, gidx, cfg.std_eps)
    s = scores.to(torch.float64)
    n = st.count[gidx]
    total = st.mean[gidx] * n
    a = s - (total - s) / (n - 1).clamp(min=1)
    return _finish_group_estimator(a, st, gidx, mask, cfg, scores.dtype if scores.is_floating_point() else torch.float32)


@register_advantage("reinforce_plus_plus_baseline", EstimatorNeeds(groups=True))
def reinforce_plus_plus_baseline_advantage(inputs: AdvantageInputs, cfg: AdvantageConfig, *,
                                           process_group: dist.ProcessGroup | None = None) -> AdvantageResult:
    """REINFORCE++ with a group baseline (Hu et al. 2025, arXiv:2501.03262, "REINFORCE++-baseline"):
    the group mean as the baseline, then the batch's normalisation instead of each group's std.

        a_i     = r_i - mean(r_g)                                     (sample i in group g)
        A_{i,t} = (a_i - mean_batch(a)) / sqrt(var_batch(a) + eps)     over every action token kept

    The batch statistics are token-weighted over the loss mask of the *global* batch (pass the DP
    group as ``process_group`` when the batch is sharded).  A zero-variance group (a_i = 0) follows
    ``cfg.zero_std_rule``: ``skip`` drops it from the loss mask (and the statistics); ``epsilon``
    keeps its tokens, which the normalisation then moves off 0 by -mean_batch / std_batch.  The KL
    to the reference is the loss's (``algo.kl.placement: loss``), as the paper's baseline variant.
    Shapes as :func:`grpo_outcome_advantage`.
    """
    mask, scores, gidx = _group_inputs(inputs, "reinforce_plus_plus_baseline")
    st = group_stats(scores, gidx, cfg.std_eps)
    a = scores.to(torch.float64) - st.mean[gidx]
    res = _finish_group_estimator(a, st, gidx, mask, cfg, scores.dtype if scores.is_floating_point() else torch.float32)
    kept = (res.loss_mask != 0).sum().to(torch.float64).reshape(1)
    if process_group is not None:
        dist.all_reduce(kept, op=dist.ReduceOp.SUM, group=process_group)
    # every group skipped (zero_std_rule=skip): nothing is trained, nothing to normalise
    adv = masked_whiten(res.advantages, res.loss_mask, cfg.whiten_eps, process_group) if kept[0] >= 2 else res.advantages
    return AdvantageResult(advantages=adv, loss_mask=res.loss_mask, returns=None, metrics=res.metrics)


@register_advantage("grpo_process", EstimatorNeeds(groups=True, step_rewards=True))
def grpo_process_advantage(inputs: AdvantageInputs, cfg: AdvantageConfig, *, process_group=None) -> AdvantageResult:
    """GRPO with process supervision (Shao et al. 2024, DeepSeekMath, sec. 4.1.3).

    All step rewards of all samples of group g are pooled:  r~_{i,k} = (r_{i,k} - mean(R_g)) / std(R_g).
    A token's advantage is the sum of the normalised rewards of the steps ending at or after it:

        A_{i,t} = sum_{k : end(i,k) >= t} r~_{i,k}

    Reads: response_mask ``(bs, R)``, group_index ``(bs,)``, step_rewards ``(bs, S)``,
    step_token_ends ``(bs, S)`` (response index of step k's last token, an action token;
    -1 marks a padding step).  A group with < 2 pooled steps or std <= eps is degenerate.
    Returns: advantages ``(bs, R)``, loss_mask ``(bs, R)``.
    """
    mask = inputs.response_mask
    gidx = _need(inputs, "group_index", "grpo_process")
    rewards = _need(inputs, "step_rewards", "grpo_process")
    ends = _need(inputs, "step_token_ends", "grpo_process")
    bs, R = mask.shape
    _check_shape("group_index", gidx, (bs,))
    if rewards.dim() != 2 or rewards.shape[0] != bs:
        raise ValueError(f"AdvantageInputs.step_rewards must be (bs={bs}, n_steps), got {tuple(rewards.shape)}")
    _check_shape("step_token_ends", ends, tuple(rewards.shape))
    has = ends >= 0
    if (ends >= R).any():
        raise ValueError(f"AdvantageInputs.step_token_ends has an index >= response_len={R}")
    rows = torch.arange(bs, device=mask.device)[:, None].expand_as(ends)
    if (mask[rows[has], ends[has]] == 0).any():
        raise ValueError("AdvantageInputs.step_token_ends points at a token outside response_mask (a step must end on an action)")
    if not torch.isfinite(rewards[has]).all():
        raise ValueError("AdvantageInputs.step_rewards contains a non-finite value")
    sorted_ok = bool(((ends[:, 1:] > ends[:, :-1]) | ~has[:, 1:]).all()) and not bool((has[:, 1:] & ~has[:, :-1]).any())
    if not sorted_ok:
        raise ValueError("AdvantageInputs.step_token_ends must be strictly increasing per row, padding steps (-1) last")
    flat_g = gidx[:, None].expand_as(ends).reshape(-1)
    st = group_stats(rewards.reshape(-1), flat_g, cfg.std_eps, weights=has.reshape(-1))
    safe_std = torch.where(st.degenerate, torch.ones_like(st.std), st.std)
    norm = (rewards.to(torch.float64) - st.mean[gidx][:, None]) / safe_std[gidx][:, None]
    norm = torch.where(has & ~st.degenerate[gidx][:, None], norm, torch.zeros_like(norm))
    placed = torch.zeros((bs, R), dtype=torch.float64, device=mask.device)
    placed.scatter_add_(1, ends.clamp(min=0), norm)
    adv = placed.flip(1).cumsum(1).flip(1)  # sum over steps ending at or after t
    deg_sample = st.degenerate[gidx]
    valid = mask != 0
    loss_mask = valid & ~deg_sample[:, None] if cfg.zero_std_rule == "skip" else valid
    dtype = rewards.dtype if rewards.is_floating_point() else torch.float32
    adv = torch.where(loss_mask, adv, torch.zeros_like(adv)).to(dtype)
    return AdvantageResult(advantages=adv, loss_mask=loss_mask.to(mask.dtype), metrics=_group_metrics(st, deg_sample, cfg))


# ----------------------------------------------------------------------------------------------
# token-reward estimators


def discounted_gae(
    token_rewards: torch.Tensor,
    values: torch.Tensor,
    response_mask: torch.Tensor,
    terminated: torch.Tensor,
    bootstrap_values: torch.Tensor | None,
    gamma: float,
    lam: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GAE over the action tokens of each response (Schulman et al. 2016, eq. 16).

    Over the action positions t_1 < ... < t_T of a sample (positions with response_mask 0 --
    padding, tool output -- are skipped, they are not actions):

        delta_k = r_{t_k} + gamma * V_{t_{k+1}} - V_{t_k}            (k < T)
        delta_T = r_{t_T} + gamma * (1 - d) * V_boot - V_{t_T}
        A_k     = delta_k + gamma * lam * A_{k+1},  A_{T+1} = 0;     returns_k = A_k + V_{t_k}

    with d = 1 for a terminated sample (eos / stop / environment: nothing follows) and d = 0 for a
    truncated one (length, tool, env_truncated, max_turns), which bootstraps from V_boot = V(s_T),
    the value of the state after its last action.  In a multi-turn trajectory the environment
    tokens between turns have response_mask 0: they are skipped, so the discount runs over the
    policy tokens only (the last action of turn k is followed directly by the first of turn k+1).

    Args:
        token_rewards: ``(bs, R)``; values: ``(bs, R)``; response_mask: ``(bs, R)``;
        terminated: ``(bs,)`` bool; bootstrap_values: ``(bs,)`` or None if all terminated.
    Returns:
        (advantages, returns), ``(bs, R)``, exactly 0 off the mask.
    """
    bs, R = response_mask.shape
    valid = response_mask != 0
    dtype = torch.promote_types(token_rewards.dtype, values.dtype)
    r, v = token_rewards.to(dtype), values.to(dtype)
    if bootstrap_values is None:
        if not bool(terminated.all()):
            raise ValueError("bootstrap_values is required: some samples are truncated "
                             "(finish_reason length / tool / env_truncated / max_turns)")
        boot = torch.zeros(bs, dtype=dtype, device=r.device)
    else:
        boot = bootstrap_values.to(dtype)
        if not torch.isfinite(boot[~terminated]).all():
            raise ValueError("bootstrap_values must be finite for every truncated sample")
    next_v = torch.where(terminated, torch.zeros_like(boot), boot)
    next_a = torch.zeros(bs, dtype=dtype, device=r.device)
    adv = torch.zeros((bs, R), dtype=dtype, device=r.device)
    for t in range(R - 1, -1, -1):
        m = valid[:, t]
        a = r[:, t] + gamma * next_v - v[:, t] + (gamma * lam) * next_a
        adv[:, t] = torch.where(m, a, 0.0)
        next_v = torch.where(m, v[:, t], next_v)
        next_a = torch.where(m, a, next_a)
    returns = torch.where(valid, adv + v, torch.zeros((), dtype=dtype))
    return adv, returns


@register_advantage("gae", EstimatorNeeds(critic=True, token_rewards=True))
def gae_advantage(inputs: AdvantageInputs, cfg: AdvantageConfig, *, process_group=None) -> AdvantageResult:
    """PPO's GAE estimator (Schulman et al. 2016; formula in :func:`discounted_gae`).

    Reads: response_mask, token_rewards, values ``(bs, R)``; terminated ``(bs,)``;
    bootstrap_values ``(bs,)`` when any sample is truncated.  Returns advantages and returns
    ``(bs, R)``; values must be finite on action tokens.
    """
    mask = inputs.response_mask
    bs, R = mask.shape
    rewards = _need(inputs, "token_rewards", "gae")
    values = _need(inputs, "values", "gae")
    terminated = _need(inputs, "terminated", "gae")
    _check_token_rewards(rewards, mask)
    _check_shape("values", values, (bs, R))
    _check_shape("terminated", terminated, (bs,))
    if not torch.isfinite(values[mask != 0]).all():
        raise ValueError("AdvantageInputs.values is non-finite on an action token")
    if inputs.bootstrap_values is not None:
        _check_shape("bootstrap_values", inputs.bootstrap_values, (bs,))
    adv, ret = discounted_gae(rewards, values, mask, terminated.bool(), inputs.bootstrap_values, cfg.gamma, cfg.lam)
    return AdvantageResult(advantages=adv, returns=ret, loss_mask=(mask != 0).to(mask.dtype), metrics={})


def masked_whiten(
    x: torch.Tensor, mask: torch.Tensor, eps: float, process_group: dist.ProcessGroup | None = None
) -> torch.Tensor:
    """(x - mu) / sqrt(var + eps) over the masked entries of the (global) batch.

    mu = sum m x / N, var = sum m (x - mu)^2 / (N - 1) (Bessel), N = sum m, each sum all-reduced
    (SUM) over ``process_group`` when given.  Shapes: x, mask ``(bs, R)``; returns ``(bs, R)``,
    0 off the mask.
    """
    keep = mask != 0
    x64 = torch.where(keep, x.to(torch.float64), 0.0)
    acc = torch.stack([x64.sum(), keep.sum().to(torch.float64)])
    if process_group is not None:
        dist.all_reduce(acc, op=dist.ReduceOp.SUM, group=process_group)
    total, n = acc[0], acc[1]
    if n < 2:
        raise ValueError(f"masked_whiten needs at least 2 masked entries over the batch, got {int(n)}")
    mu = total / n
    sq = torch.where(keep, (x64 - mu) ** 2, 0.0).sum().reshape(1)
    if process_group is not None:
        dist.all_reduce(sq, op=dist.ReduceOp.SUM, group=process_group)
    var = sq[0] / (n - 1)
    out = (x64 - mu) / torch.sqrt(var + eps)
    return torch.where(keep, out, 0.0).to(x.dtype)


@register_advantage("reinforce_plus_plus", EstimatorNeeds(token_rewards=True))
def reinforce_plus_plus_advantage(
    inputs: AdvantageInputs, cfg: AdvantageConfig, *, process_group: dist.ProcessGroup | None = None
) -> AdvantageResult:
    """REINFORCE++ (Hu et al. 2025): discounted returns of KL-shaped token rewards, batch-normalised.

        r_t   = score * [t = T] - beta * k1_t            (built by reward_shaping.kl_shaped_token_rewards)
        G_t   = sum_{s >= t} gamma^{s - t} r_s            (over action tokens)
        A_t   = (G_t - mean_batch(G)) / sqrt(var_batch(G) + eps)

    The batch statistics are over every action token of the *global* batch: pass the DP group
    as ``process_group`` when the batch is sharded.  Reads response_mask, token_rewards
    ``(bs, R)``; returns advantages and returns (= G) ``(bs, R)``.
    """
    mask = inputs.response_mask
    rewards = _need(inputs, "token_rewards", "reinforce_plus_plus")
    _check_token_rewards(rewards, mask)
    bs = mask.shape[0]
    zeros = torch.zeros_like(rewards)
    done = torch.ones(bs, dtype=torch.bool, device=mask.device)
    _, returns = discounted_gae(rewards, zeros, mask, done, None, cfg.gamma, 1.0)
    adv = masked_whiten(returns, mask, cfg.whiten_eps, process_group)
    return AdvantageResult(advantages=adv, returns=returns, loss_mask=(mask != 0).to(mask.dtype), metrics={})


def check_finite(result: AdvantageResult) -> None:
    """Raise if an estimator result carries a NaN / inf (a guard before any cross-rank reduction)."""
    for name in ("advantages", "returns"):
        t = getattr(result, name)
        if t is not None and not torch.isfinite(t).all():
            raise FloatingPointError(f"AdvantageResult.{name} contains a non-finite value")


__all__ = [
    "AdvantageConfig",
    "AdvantageInputs",
    "AdvantageResult",
    "GroupStats",
    "group_stats",
    "discounted_gae",
    "masked_whiten",
    "grpo_outcome_advantage",
    "dr_grpo_advantage",
    "rloo_advantage",
    "grpo_process_advantage",
    "gae_advantage",
    "reinforce_plus_plus_advantage",
    "reinforce_plus_plus_baseline_advantage",
    "check_finite",
]
