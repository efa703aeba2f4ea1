"""From generation results to the experience layout, and from a sealed batch to update steps.

* :func:`collate` -- accepted samples (in group order) to left-padded prompts, right-padded
  responses and their masks (the experience layout of ``megarl.experience.schema``).
* :func:`collate_trajectories` -- the same for multi-turn agent trajectories: each response is
  the whole token list after the prompt (policy and environment tokens interleaved), with the
  per-token origins (``token_origins``: source, turn, policy version).
* :func:`plan_mini_batches` -- a seeded shuffle of whole groups into mini-batches (a GRPO
  group is never split across mini-batches), each padded to equal micro-batches on every DP
  rank with rows whose loss mask is 0 (they contribute exactly nothing to loss or gradient).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from megarl.experience.origins import TokenOrigins, TokenSource, collate_origins
from megarl.experience.routing import collate_routing
from megarl.experience.schema import RoutedExperts, SampleRouting
from megarl.versions import behaviour_label


@dataclass(frozen=True)
class Collated:
    prompt_ids: torch.Tensor  # (bs, P) left-padded
    response_ids: torch.Tensor  # (bs, R) right-padded
    attention_mask: torch.Tensor  # (bs, P + R)
    response_mask: torch.Tensor  # (bs, R)
    rollout_log_probs: torch.Tensor  # (bs, R) raw space, 0 on padding
    routed_experts: Optional[RoutedExperts] = None  # (bs, P + R, layers, top_k), MoE with routing asked
    token_origins: Optional[TokenOrigins] = None  # (bs, R) source / turn / version, multi-turn trajectories
    #: the producer version of ``rollout_log_probs`` (the behaviour policy): ``version`` when every
    #: policy token is v's, else :func:`megarl.versions.behaviour_label` of every version that
    #: generated a policy token (asynchronous batches); None when no version was given
    behaviour_version: Optional[str] = None


def collate(prompts: Sequence[Sequence[int]], responses: Sequence[Sequence[int]],
            raw_log_probs: Sequence[torch.Tensor], pad_id: int,
            routing: Optional[Sequence[SampleRouting]] = None, version: Optional[str] = None,
            sample_versions: Optional[Sequence[str]] = None) -> Collated:
    """Every response token is a sampled action (no tool output in these rollouts).  ``routing``
    (one per sample, generated on ``version``) becomes the batch's routing record.

    ``sample_versions`` (the version that generated each sample) makes the record honest about
    its behaviour policy: ``behaviour_version`` is their :func:`megarl.versions.behaviour_label`
    (``version`` itself when all are ``version``), and it labels the routing record too."""
    B = len(prompts)
    bad = [b for b, (r, l) in enumerate(zip(responses, raw_log_probs, strict=True)) if l.numel() != len(r)]
    if bad:
        raise ValueError(f"collate: row {bad[0]} has {len(responses[bad[0]])} response tokens but "
                         f"{raw_log_probs[bad[0]].numel()} rollout log-probs")
    P = max(len(p) for p in prompts)
    R = max(max(len(r) for r in responses), 1)
    # one tensor per field from Python lists: a per-row torch loop costs ~0.1 ms a row
    prompt = torch.tensor([[pad_id] * (P - len(p)) + list(p) for p in prompts], dtype=torch.long)
    resp = torch.tensor([list(r) + [pad_id] * (R - len(r)) for r in responses], dtype=torch.long)
    plen = torch.tensor([len(p) for p in prompts], dtype=torch.long)[:, None]
    rlen = torch.tensor([len(r) for r in responses], dtype=torch.long)[:, None]
    cols = torch.arange(P + R)[None, :]
    am = ((cols >= P - plen) & (cols < P + rlen)).long()
    rm = (cols[:, :R] < rlen).long()
    lp = torch.zeros(B, R, dtype=torch.float32)
    if any(len(r) for r in responses):
        flat = torch.cat([l.reshape(-1).float() for l in raw_log_probs])
        lp[rm.bool()] = flat  # row-major order of the mask = each row's log-probs in turn
    behaviour = version
    if sample_versions is not None and set(sample_versions) != {version}:
        behaviour = behaviour_label(sample_versions)
    routed = None
    if routing is not None:
        routed = collate_routing(routing, [len(p) for p in prompts], [len(r) for r in responses], P, R, behaviour)
    return Collated(prompt, resp, am, rm, lp, routed, behaviour_version=behaviour)


def collate_trajectories(prompts: Sequence[Sequence[int]], responses: Sequence[Sequence[int]],
                         raw_log_probs: Sequence[torch.Tensor], sources: Sequence[Sequence[int]],
                         turns: Sequence[Sequence[int]], token_versions: Sequence[Sequence[Optional[str]]],
                         pad_id: int, routing: Optional[Sequence[SampleRouting]] = None,
                         version: Optional[str] = None, sample_versions: Optional[Sequence[str]] = None) -> Collated:
    """Multi-turn trajectories to the experience layout.

    Args:
        prompts: per sample, the prompt token ids.
        responses: per sample, every token after the prompt: policy turns and the rendered
            environment output between them, in order.  A trajectory starts and ends with a
            policy token (environment output after the last turn was never shown to the policy).
        raw_log_probs: per sample, one rollout log-prob per response token, 0.0 on environment
            tokens (the policy did not sample them).
        sources: per sample, 1 (policy) or 2 (environment) per response token.
        turns: per sample, the 0-based turn per response token (environment output shares the
            index of the policy turn before it).
        token_versions: per sample, the policy version ``short_id`` per policy token, None per
            environment token.
        pad_id: the padding token id.
        routing / version: as for :func:`collate` (MoE).
        sample_versions: as for :func:`collate`; the behaviour label then also covers every
            policy token's version (an earlier turn may be older than the sample's last one).
    Returns:
        :class:`Collated` with ``response_mask`` 1 exactly on policy tokens and ``token_origins``.
    """
    for b, (r, s) in enumerate(zip(responses, sources, strict=True)):
        if len(s) != len(r):
            raise ValueError(f"collate_trajectories: row {b} has {len(r)} response tokens but {len(s)} sources")
    if sample_versions is not None:  # the oldest policy token decides, not the last turn's version
        sample_versions = list(sample_versions) + [t for row in token_versions for t in row if t is not None]
    base = collate(prompts, responses, raw_log_probs, pad_id, routing, version,
                   sample_versions)  # checks the log-prob counts
    for b, (l, s) in enumerate(zip(raw_log_probs, sources, strict=True)):
        flat = l.reshape(-1).tolist()
        bad = [t for t, x in enumerate(s) if x == TokenSource.ENVIRONMENT and flat[t] != 0.0]
        if bad:
            raise ValueError(f"collate_trajectories: row {b}, response position {bad[0]}: rollout log-prob "
                             f"{flat[bad[0]]} on an environment token (must be 0.0: the policy did not sample it)")
    origins = collate_origins(sources, turns, token_versions, base.response_ids.shape[1])
    return dataclasses.replace(base, response_mask=origins.policy_mask().long(), token_origins=origins)


@dataclass(frozen=True)
class MiniBatchPlan:
    """Row indices of one mini-batch: ``rows`` the real samples, ``padded`` the same rows
    extended to a multiple of ``dp x micro_batch_size`` (extra entries repeat a real row and
    are marked in ``is_pad``)."""

    rows: torch.Tensor
    padded: torch.Tensor
    is_pad: torch.Tensor

    def rank_rows(self, dp_rank: int, dp_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        per = self.padded.numel() // dp_size
        sl = slice(dp_rank * per, (dp_rank + 1) * per)
        return self.padded[sl], self.is_pad[sl]


def plan_mini_batches(group_ids: Sequence[str], num_mini_batches: int, dp_size: int, micro_batch_size: int,
                      generator: torch.Generator) -> list[MiniBatchPlan]:
    """Shuffle whole groups, deal them into ``num_mini_batches`` mini-batches as evenly as the
    group count allows, shuffle rows within each (groups stay whole: only their position moves),
    and pad each to a multiple of ``dp_size x micro_batch_size`` (of ``dp_size`` when
    ``micro_batch_size`` is 0: one micro-batch per rank)."""
    order: dict[str, list[int]] = {}
    for i, g in enumerate(group_ids):
        order.setdefault(g, []).append(i)
    groups = list(order.values())
    perm = torch.randperm(len(groups), generator=generator).tolist()
    k = min(num_mini_batches, len(groups))
    plans = []
    for chunk in torch.tensor(perm).tensor_split(k) if k else []:
        rows = torch.tensor([i for gi in chunk.tolist() for i in groups[gi]], dtype=torch.long)
        rows = rows[torch.randperm(rows.numel(), generator=generator)]
        unit = dp_size * max(micro_batch_size, 1)
        total = -(-rows.numel() // unit) * unit
        pad = total - rows.numel()
        padded = torch.cat([rows, rows[:1].repeat(pad)]) if pad else rows
        is_pad = torch.cat([torch.zeros(rows.numel(), dtype=torch.bool), torch.ones(pad, dtype=torch.bool)])
        plans.append(MiniBatchPlan(rows, padded, is_pad))
    return plans
