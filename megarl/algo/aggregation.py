"""Loss aggregation: the only place a token loss matrix becomes a scalar.

The normalisation contract (docs/design.md, contract 6): every mode divides by a normaliser that is
counted over the *global* batch of one optimizer step -- all micro-batches on all data-parallel
ranks -- and is passed in.  The value returned for one micro-batch is therefore that
micro-batch's *contribution* to the global loss, and

    sum over micro-batches and DP ranks of aggregate_loss(...) == the global loss,

whatever the micro-batch size, packing, padding or DP size.  Gradients accumulate by summation
across micro-batches and must be *summed* across DP ranks (:func:`aggregate_loss`).

Modes (``L`` the token loss matrix, ``m`` the loss mask, ``i`` a sequence, ``t`` a token,
sums over the local rows; ``N`` the global normaliser):

- ``token-mean``:              sum_i sum_t m_it L_it / N,   N = global number of masked-in tokens
- ``seq-mean-token-mean``:     sum_i (sum_t m_it L_it / sum_t m_it) / N,
                               N = global number of sequences with at least one masked-in token
- ``seq-mean-token-sum``:      sum_i sum_t m_it L_it / N,   N = same sequence count
- ``seq-mean-token-sum-norm``: sum_i sum_t m_it L_it / N,   N = sequence count * a constant
                               length (Dr. GRPO, Liu et al. 2025; :func:`global_normaliser`)

The mode names follow verl's ``agg_loss`` (``verl/trainer/ppo/core_algos.py``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Literal, Sequence, get_args

import torch
import torch.distributed as dist

AggMode = Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"]
AGG_MODES: tuple[str, ...] = get_args(AggMode)


def check_agg_mode(mode: str) -> None:
    if mode not in AGG_MODES:
        raise ValueError(f"loss aggregation mode {mode!r} is not one of {AGG_MODES}")


@dataclass(frozen=True)
class GlobalNormaliser:
    """The divisor of one aggregation mode over the global batch of one optimizer step.

    ``value`` is the token count (``token-mean``), the sequence count (``seq-mean-*``) or the
    sequence count times ``norm_constant`` (``seq-mean-token-sum-norm``), already summed over
    every micro-batch and every DP rank.  ``tokens`` and ``sequences`` are kept for metrics.
    """

    mode: str
    value: float
    tokens: int
    sequences: int
    norm_constant: float | None = None

    def __post_init__(self) -> None:
        check_agg_mode(self.mode)
        if not (self.value > 0):
            raise ValueError(
                f"GlobalNormaliser.value must be > 0 for mode {self.mode!r}, got {self.value} "
                f"(tokens={self.tokens}, sequences={self.sequences}): the global batch has no loss tokens"
            )


def _as_mask_list(loss_masks: torch.Tensor | Sequence[torch.Tensor]) -> list[torch.Tensor]:
    if isinstance(loss_masks, torch.Tensor):
        return [loss_masks]
    masks = list(loss_masks)
    if not masks:
        raise ValueError("global_normaliser: loss_masks is an empty list")
    return masks


def global_normaliser(
    loss_masks: torch.Tensor | Iterable[torch.Tensor],
    mode: str,
    *,
    norm_constant: float | None = None,
    dp_group: dist.ProcessGroup | None = None,
) -> GlobalNormaliser:
    """Count the normaliser of ``mode`` over the global batch.

    Args:
        loss_masks: the loss mask of every micro-batch this rank will run in the optimizer step,
            each ``(bs_mb, response_len)`` (0/1 or bool; widths may differ), or one tensor.
        mode: an aggregation mode (see module docstring).
        norm_constant: the constant length of ``seq-mean-token-sum-norm`` (e.g. the maximum
            response length of the sampling config); required for that mode, refused otherwise.
            Dr. GRPO (Liu et al. 2025, "Understanding R1-Zero-like training") replaces the
            per-sequence length normaliser |o_i| by a constant such as the generation budget,
            removing length bias.  Unlike verl's default for that mode (the padded width of the local
            tensor) the constant is explicit, so padding cannot change the loss.
        dp_group: the data-parallel group to all-reduce (SUM) the counts over; ``None`` when
            this rank sees the whole global batch.  (gloo has no ``ReduceOp.AVG``; only SUM is used.)

    Returns:
        GlobalNormaliser with tokens = sum_i sum_t m_it and sequences = #{i : sum_t m_it > 0}
        over all micro-batches of all ranks.
    """
    check_agg_mode(mode)
    if mode == "seq-mean-token-sum-norm":
        if norm_constant is None or not norm_constant > 0:
            raise ValueError(f"mode {mode!r} needs norm_constant > 0 (e.g. max response length), got {norm_constant}")
    elif norm_constant is not None:
        raise ValueError(f"norm_constant is only used by 'seq-mean-token-sum-norm', not by mode {mode!r}")
    tokens = 0
    sequences = 0
    for i, m in enumerate(_as_mask_list(loss_masks)):
        if m.dim() != 2:
            raise ValueError(f"loss_masks[{i}] must be (bs, response_len), got shape {tuple(m.shape)}")
        per_seq = (m != 0).sum(dim=-1)
        tokens += int(per_seq.sum())
        sequences += int((per_seq > 0).sum())
    counts = torch.tensor([tokens, sequences], dtype=torch.int64)
    if dp_group is not None:
        dist.all_reduce(counts, op=dist.ReduceOp.SUM, group=dp_group)
    tokens, sequences = int(counts[0]), int(counts[1])
    if mode == "token-mean":
        value = float(tokens)
    elif mode == "seq-mean-token-sum-norm":
        value = float(sequences) * float(norm_constant)
    else:
        value = float(sequences)
    return GlobalNormaliser(mode=mode, value=value, tokens=tokens, sequences=sequences, norm_constant=norm_constant)


def aggregate_loss(
    loss_mat: torch.Tensor,
    loss_mask: torch.Tensor,
    mode: str,
    global_normaliser: GlobalNormaliser,
    *,
    grad_reduce_scale: float = 1.0,
) -> torch.Tensor:
    """This micro-batch's contribution to the global loss (formulas in the module docstring).

    Args:
        loss_mat: ``(bs, response_len)`` per-token loss.  Values at masked-out positions are
            never read: they are selected away with ``torch.where``, so a NaN or inf there
            neither reaches the result nor its gradient.
        loss_mask: ``(bs, response_len)`` 0/1 or bool, 1 where the token is in the loss.
        mode: one of ``AGG_MODES``; must equal ``global_normaliser.mode``.
        global_normaliser: from :func:`global_normaliser` over the whole optimizer step.
        grad_reduce_scale: multiply the result by this; ``dp_size`` when the DP gradient
            reduction averages instead of sums (Megatron DDP divides by the DP size), since
            gradients must be *summed* across DP ranks.

    Returns:
        A 0-dim tensor.
    """
    check_agg_mode(mode)
    if global_normaliser.mode != mode:
        raise ValueError(f"aggregate_loss mode {mode!r} got a normaliser counted for mode {global_normaliser.mode!r}")
    if loss_mat.shape != loss_mask.shape or loss_mat.dim() != 2:
        raise ValueError(
            f"loss_mat {tuple(loss_mat.shape)} and loss_mask {tuple(loss_mask.shape)} must both be (bs, response_len)"
        )
    keep = loss_mask != 0
    masked = torch.where(keep, loss_mat, torch.zeros((), dtype=loss_mat.dtype, device=loss_mat.device))
    if mode == "seq-mean-token-mean":
        lengths = keep.sum(dim=-1)
        seq_loss = masked.sum(dim=-1) / lengths.clamp(min=1).to(loss_mat.dtype)
        total = seq_loss.sum()
    else:
        total = masked.sum()
    return total * (grad_reduce_scale / global_normaliser.value)


def masked_sum(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """sum of x where mask != 0 (masked-out entries are selected away, never multiplied)."""
    z = torch.where(mask != 0, x, torch.zeros((), dtype=x.dtype, device=x.device))
    return z.sum() if dim is None else z.sum(dim=dim)


def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """sum(x * m) / max(sum(m), 1) -- a *local* statistic for metrics, not for losses."""
    n = (mask != 0).sum() if dim is None else (mask != 0).sum(dim=dim)
    return masked_sum(x, mask, dim) / n.clamp(min=1).to(x.dtype)
