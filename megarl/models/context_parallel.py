"""Context parallelism (``parallel.cp``): each sequence split over ``cp`` ranks along its length.

The layout is megatron's (``get_pos_emb_on_this_cp_rank``, transformer-engine's CP attention): a
sequence of ``L`` positions (``L`` a multiple of ``2 * cp``) is cut into ``2 * cp`` equal chunks
and CP rank ``r`` holds chunks ``r`` and ``2 * cp - 1 - r`` ("zig-zag"), so that under a causal
mask every rank has the same attention work.  Every CP rank of a data-parallel replica holds the
same rows; only the positions differ.

What the data path must get right, and where megarl does it: labels are shifted on the whole
row before the split (:func:`shifted_labels`); every CP rank evaluates the same loss of whole
rows with the step's global normaliser, and the gradient is not summed over CP (:func:`gather`);
the gathered loss's metrics are reported by CP rank 0 only (``megarl.control.learning``), never
summed over CP; rows are padded to a multiple of ``2 * cp`` and a packed (THD) micro-batch's
sequences are split one by one (:func:`sequence_positions`).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist


def size() -> int:
    """The context-parallel size of the initialised parallel state (1 when none is)."""
    from megatron.core import parallel_state as ps

    if not ps.model_parallel_is_initialized():
        return 1
    return ps.get_context_parallel_world_size()


def rank() -> int:
    from megatron.core import parallel_state as ps

    return ps.get_context_parallel_rank()


def group():
    from megatron.core import parallel_state as ps

    return ps.get_context_parallel_group()


def positions(length: int, cp: int, cp_rank: int, device=None) -> torch.Tensor:
    """The positions of a ``length``-long sequence that CP rank ``cp_rank`` of ``cp`` holds:
    chunks ``cp_rank`` and ``2 * cp - 1 - cp_rank`` of ``2 * cp`` equal chunks, in order."""
    if length % (2 * cp):
        raise ValueError(f"context parallelism: a sequence of {length} positions does not split into "
                         f"2 x cp = {2 * cp} equal chunks (pad it to a multiple of {2 * cp})")
    c = length // (2 * cp)
    first, second = cp_rank * c, (2 * cp - 1 - cp_rank) * c
    return torch.cat([torch.arange(first, first + c, device=device), torch.arange(second, second + c, device=device)])


def sequence_positions(cu_seqlens: torch.Tensor, cp: int, cp_rank: int, device=None) -> torch.Tensor:
    """The positions of a packed (THD) pack that CP rank ``cp_rank`` holds: every sequence of
    ``cu_seqlens`` (each a multiple of ``2 * cp`` long) split on its own, its two chunks in
    sequence order (transformer-engine's THD layout, and megatron's per-sequence RoPE rows).

    **Padding to** ``2 * cp`` (times ``tp`` under sequence parallelism, which splits each rank's
    share again): :attr:`megarl.models.builder.BuildOptions.sequence_multiple`.  The padding is at
    the end of each row, which causal attention never lets reach a real position.

    **Packed (THD) micro-batches** (``algo.pack_sequences``, ``algo.micro_batch_tokens``): every
    sequence of the pack is split on its own (:func:`sequence_positions`), so each row is padded at
    its end to a multiple of ``2 * cp`` (padding that belongs to the row's sequence and that none of
    its real tokens attends to), and the pack's filler sequence to a multiple of ``2 * cp`` (times
    tp under SP) in all.  ``cu_seqlens`` stay the whole pack's; megatron's THD RoPE picks each
    sequence's chunks by them.
    """
    cu = [int(c) for c in cu_seqlens]
    return torch.cat([start + positions(end - start, cp, cp_rank, device)
                      for start, end in zip(cu[:-1], cu[1:], strict=True)])


def _held(length: int, cp: int, cp_rank: int, cu_seqlens, device) -> torch.Tensor:
    if cu_seqlens is None:
        return positions(length, cp, cp_rank, device)
    if int(cu_seqlens[-1]) != length:
        raise ValueError(f"context parallelism: cu_seqlens ends at {int(cu_seqlens[-1])}, "
                         f"the pack has {length} positions")
    return sequence_positions(cu_seqlens, cp, cp_rank, device)


def all_positions(length: int, cp: int, device=None, cu_seqlens=None) -> torch.Tensor:
    """The positions of every CP rank's share, rank after rank: the order of an all-gather."""
    return torch.cat([_held(length, cp, r, cu_seqlens, device) for r in range(cp)])


def split(x: torch.Tensor, dim: int = 1, cu_seqlens=None) -> torch.Tensor:
    """This CP rank's positions of ``x`` along ``dim``: of the whole sequence there, or, for a
    packed pack (``cu_seqlens``), of each of its sequences."""
    cp = size()
    if cp == 1:
        return x
    return x.index_select(dim, _held(x.shape[dim], cp, rank(), cu_seqlens, x.device))


def shifted_labels(tokens: torch.Tensor) -> torch.Tensor:
    """``(b, s)`` next-token targets of whole rows: ``tokens[:, t + 1]`` at position ``t``, and 0 at
    the last position (it predicts past the row; its term is cut off by the caller).

    **Labels are shifted before the split.**  The target of position ``t`` is token ``t + 1`` of
    the whole sequence; the last position of a rank's chunk predicts the first token of the *next
    chunk*, which another rank holds.  :func:`shifted_labels` shifts the whole row, then
    :func:`split` cuts the labels exactly as the tokens (shifting each rank's slice instead drops
    or misplaces one target per chunk edge: verl PR #4250).
    """
    return torch.cat([tokens[:, 1:], tokens.new_zeros((tokens.shape[0], 1))], 1)


class _Gather(torch.autograd.Function):
    """All-gather the CP ranks' positions of ``(b, s / cp, ...)`` into whole ``(b, s, ...)`` rows;
    the backward returns this rank's positions of the gradient (every CP rank computes the same
    loss of the gathered rows: :func:`gather`)."""

    @staticmethod
    def forward(ctx, local: torch.Tensor, cp_group, cp: int, cp_rank: int, cu_seqlens) -> torch.Tensor:
        n = local.shape[1]
        ctx.keep = _held(n * cp, cp, cp_rank, cu_seqlens, local.device)
        moved = local.movedim(1, 0).contiguous()  # gather along the first dimension
        parts = moved.new_empty((cp * n,) + tuple(moved.shape[1:]))
        dist.all_gather_into_tensor(parts, moved, group=cp_group)
        order = all_positions(n * cp, cp, local.device, cu_seqlens)
        whole = torch.empty_like(parts).index_copy_(0, order, parts)
        return whole.movedim(0, 1)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad.index_select(1, ctx.keep), None, None, None, None


def gather(local: torch.Tensor, cu_seqlens=None) -> torch.Tensor:
    """Whole rows ``(b, s, ...)`` from every CP rank's ``(b, s / cp, ...)`` positions (of each
    sequence of ``cu_seqlens`` for a packed pack), the same on every CP rank; differentiable
    (the gradient is not summed over CP).

    **One loss, one normaliser.**  Every CP rank computes its positions' per-token terms, and
    :func:`gather` all-gathers them into whole rows, so every CP rank evaluates *the same* loss of
    the same rows with the step's global normaliser.  The backward of the gather keeps this rank's
    positions of the gradient and adds nothing: each rank back-propagates only its own terms'
    share, and megatron's DDP sums the parameter gradients over data-parallel x context-parallel
    ranks.  (Summing the gathered gradient instead -- the backward of
    ``torch.distributed.nn.all_gather`` -- would multiply every gradient by ``cp``.)

    **Metrics once per replica.**  The gathered loss is the same on every CP rank, so its
    metrics are reported by CP rank 0 only (``megarl.control.learning``), never summed over CP.
    """
    cp = size()
    if cp == 1:
        return local
    return _Gather.apply(local, group(), cp, rank(), cu_seqlens)


def check_supported(*, routing: bool = False) -> Optional[str]:
    """None when context parallelism can run this pass, else why not (the callers raise it)."""
    if routing:
        return "routing replay is not run with context parallelism yet"
    return None
