"""Context parallelism (``parallel.cp``): each sequence split over ``cp`` ranks along its length.

The layout is megatron's (``get_pos_emb_on_this_cp_rank``, transformer-engine's CP attention): a
sequence of ``L`` positions (``L`` a multiple of ``2 * cp``) is cut into ``2 * cp`` equal chunks
and CP rank ``r`` holds chunks ``r`` and ``2 * cp - 1 - r`` ("zig-zag"), so that under a causal
mask every rank has the same attention work.  Every CP rank of a data-parallel replica holds the
same rows; only the positions differ.

What the data path must get right, and where megarl does it:

* **Labels are shifted before the split.**  The target of position ``t`` is token ``t + 1`` of
  the whole sequence; the last position of a rank's chunk predicts the first token of the *next
  chunk*, which another rank holds.  :func:`shifted_labels` shifts the whole row, then
  :func:`split` cuts the labels exactly as the tokens (shifting each rank's slice instead drops
  or misplaces one target per chunk edge: verl PR #4250).
* **One loss, one normaliser.**  Every CP rank computes its positions' per-token terms, and
  :func:`gather` all-gathers them into whole rows, so every CP rank evaluates *the same* loss of
  the same rows with the step's global normaliser.  The backward of the gather keeps this rank's
  positions of the gradient and adds nothing: each rank back-propagates only its own terms'
  share, and megatron's DDP sums the parameter gradients over data-parallel x context-parallel
  ranks.  (Summing the gathered gradient instead -- the backward of
  ``torch.distributed.nn.all_gather`` -- would multiply every gradient by ``cp``.)
* **Metrics once per replica.**  The gathered loss is the same on every CP rank, so its
  metrics are reported by CP rank 0 only (``megarl.control.learning``), never summed over CP.
* **Padding to** ``2 * cp`` (times ``tp`` under sequence parallelism, which splits each rank's
  share again): :attr:`megarl.models.builder.BuildOptions.sequence_multiple`.  The padding is at
  the end of each row, which causal attention never lets reach a real position.
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


def all_positions(length: int, cp: int, device=None) -> torch.Tensor:
    """The positions of every CP rank's share, rank after rank: the order of an all-gather."""
    return torch.cat([positions(length, cp, r, device) for r in range(cp)])


def split(x: torch.Tensor, dim: int = 1) -> torch.Tensor:
    """This CP rank's positions of ``x`` along ``dim`` (the whole sequence there)."""
    cp = size()
    if cp == 1:
        return x
    return x.index_select(dim, positions(x.shape[dim], cp, rank(), x.device))


def shifted_labels(tokens: torch.Tensor) -> torch.Tensor:
    """``(b, s)`` next-token targets of whole rows: ``tokens[:, t + 1]`` at position ``t``, and 0 at
    the last position (it predicts past the row; its term is cut off by the caller)."""
    return torch.cat([tokens[:, 1:], tokens.new_zeros((tokens.shape[0], 1))], 1)


class _Gather(torch.autograd.Function):
    """All-gather the CP ranks' positions of ``(b, s / cp, ...)`` into whole ``(b, s, ...)`` rows;
    the backward returns this rank's positions of the gradient (every CP rank computes the same
    loss of the gathered rows: module doc)."""

    @staticmethod
    def forward(ctx, local: torch.Tensor, cp_group, cp: int, cp_rank: int) -> torch.Tensor:
        n = local.shape[1]
        ctx.keep = positions(n * cp, cp, cp_rank, local.device)
        moved = local.movedim(1, 0).contiguous()  # gather along the first dimension
        parts = moved.new_empty((cp * n,) + tuple(moved.shape[1:]))
        dist.all_gather_into_tensor(parts, moved, group=cp_group)
        whole = torch.empty_like(parts).index_copy_(0, all_positions(n * cp, cp, local.device), parts)
        return whole.movedim(0, 1)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad.index_select(1, ctx.keep), None, None, None


def gather(local: torch.Tensor) -> torch.Tensor:
    """Whole rows ``(b, s, ...)`` from every CP rank's ``(b, s / cp, ...)`` positions, the same on
    every CP rank; differentiable (module doc: the gradient is not summed over CP)."""
    cp = size()
    if cp == 1:
        return local
    return _Gather.apply(local, group(), cp, rank())


def check_supported(*, packed: bool, moe: bool, routing: bool = False) -> Optional[str]:
    """None when context parallelism can run this pass, else why not (the callers raise it)."""
    if packed:
        return ("packed (THD) micro-batches (algo.pack_sequences, algo.micro_batch_tokens) are not split over "
                "context-parallel ranks yet: run padded micro-batches with parallel.cp > 1")
    if moe:
        return "mixture-of-experts models are not run with context parallelism yet"
    if routing:
        return "routing replay is not run with context parallelism yet"
    return None
