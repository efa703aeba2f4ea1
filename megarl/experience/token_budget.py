"""Micro-batches cut by a token budget instead of a row count (``algo.micro_batch_tokens``).

A row-count micro-batch is as wide as its longest row: one 4,096-token response makes every
row of its micro-batch 4,096 wide, and the update pays for the padding (NeMo-RL's design doc puts
it at 50-70% of the compute on reasoning traces).  Here a micro-batch is a set of rows whose real
tokens add up to at most ``budget``; they run as one packed (THD) sequence, so nothing pads them
but the few filler tokens sequence parallelism and the MoE dispatcher ask for.  Same idea as slime's
``--use-dynamic-batch-size --max-tokens-per-gpu`` and verl's ``use_dynamic_bsz`` /
``ppo_max_token_len_per_gpu``.

Two rules make it safe for megatron's schedules:

* every data-parallel rank runs the **same number** of micro-batches (the pipeline schedules and the
  DDP gradient reduction run in lock-step; at EP > 1 the token dispatcher all-gathers each
  micro-batch over ranks that hold different rows).  A rank with fewer bins splits its fullest
  bins; a rank that cannot (too few rows) gets filler micro-batches, which repeat a real row with
  nothing of it counted (``is_pad``);
* the loss keeps its **global normaliser** (computed over the whole mini-batch before the step),
  so how the rows are cut changes only the order of a sum.

The plan is a pure function of the rows' lengths: every rank computes the same plan for every
rank without a collective.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Sequence


def first_fit(lengths: Sequence[int], budget: int) -> List[List[int]]:
    """Indices of ``lengths`` in bins of at most ``budget`` tokens, first-fit decreasing.

    Rows are taken longest first (ties: lower index first) and each goes into the first bin it
    fits in; a row longer than ``budget`` gets a bin of its own.  Bins keep the order they were
    opened in (longest rows first), and rows within a bin their order of insertion."""
    if budget < 1:
        raise ValueError(f"a token budget must be >= 1, got {budget}")
    order = sorted(range(len(lengths)), key=lambda i: (-int(lengths[i]), i))
    bins: List[List[int]] = []
    room: List[int] = []
    for i in order:
        n = int(lengths[i])
        for b, free in enumerate(room):
            if n <= free:
                bins[b].append(i)
                room[b] -= n
                break
        else:
            bins.append([i])
            room.append(budget - n)
    return bins


@dataclass(frozen=True)
class RankMicroBatches:
    """One data-parallel rank's micro-batches: ``bins[j]`` the row indices of micro-batch j
    (indices into the mini-batch's rows), ``pad[j]`` True when micro-batch j is a filler (its one
    row repeats a real row and counts for nothing)."""

    bins: List[List[int]]
    pad: List[bool]


def _balance(lengths: Sequence[int], dp: int) -> List[List[int]]:
    """Rows dealt to ``dp`` ranks by tokens, longest first to the rank with the fewest tokens
    (ties: fewest rows, then lowest rank): the LPT rule, within 4/3 of the best split."""
    ranks: List[List[int]] = [[] for _ in range(dp)]
    load = [0] * dp
    for i in sorted(range(len(lengths)), key=lambda i: (-int(lengths[i]), i)):
        r = min(range(dp), key=lambda r: (load[r], len(ranks[r]), r))
        ranks[r].append(i)
        load[r] += int(lengths[i])
    return ranks


def _split_to(bins: List[List[int]], count: int) -> List[List[int]]:
    """``bins`` with its fullest bins (most rows; ties: first) halved until there are ``count``
    or none has two rows left.  Halves keep their rows' order."""
    bins = [list(b) for b in bins]
    while len(bins) < count:
        j = max(range(len(bins)), key=lambda j: (len(bins[j]), -j), default=None)
        if j is None or len(bins[j]) < 2:
            break
        b = bins[j]
        bins[j:j + 1] = [b[:len(b) // 2], b[len(b) // 2:]]
    return bins


def plan_token_micro_batches(lengths: Sequence[int], budget: int, dp: int) -> List[RankMicroBatches]:
    """Every rank's micro-batches for one mini-batch whose rows have ``lengths`` real tokens.

    Rows are dealt to ranks by tokens (:func:`_balance`), packed first-fit decreasing into bins of
    ``budget`` tokens on each rank, and every rank is brought to the largest bin count: by halving
    its fullest bins, else by filler micro-batches.  Every row appears exactly once over all ranks
    outside the fillers."""
    if dp < 1:
        raise ValueError(f"dp must be >= 1, got {dp}")
    if not len(lengths):
        raise ValueError("a mini-batch without rows has no micro-batches")
    per_rank = [[[rows[i] for i in b] for b in first_fit([lengths[i] for i in rows], budget)]
                for rows in _balance(lengths, dp)]
    count = max(len(b) for b in per_rank)
    plans = []
    for bins in per_rank:
        bins = _split_to(bins, count)
        filler = count - len(bins)
        plans.append(RankMicroBatches(bins + [[0]] * filler, [False] * len(bins) + [True] * filler))
    return plans
