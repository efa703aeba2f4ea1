"""Data-parallel plumbing for the control loop: who owns which rows, and gathering them back.

Every rank holds the whole experience batch (tokens, masks, ids: small), so advantages and
normalisers are computed identically everywhere without a collective.  Only the expensive
model forwards are split: each DP rank runs its equal share of rows and the results are
all-gathered over the DP group.  Batches are padded to a multiple of the DP size by repeating
the last row; padded rows are dropped from the gathered result.
"""

from __future__ import annotations

import pickle
import time

from typing import Any, Callable, List

import torch
import torch.distributed as dist


def dp_group():
    from megatron.core import parallel_state as ps

    return ps.get_data_parallel_group()


def dp_size() -> int:
    from megatron.core import parallel_state as ps

    return ps.get_data_parallel_world_size()


def dp_rank() -> int:
    from megatron.core import parallel_state as ps

    return ps.get_data_parallel_rank()


def is_mp_leader() -> bool:
    """The first rank of this DP replica's model-parallel group (tp rank 0, cp rank 0, first PP
    stage): one per replica, as the context-parallel ranks of a replica hold the same rows."""
    from megatron.core import parallel_state as ps

    return (ps.get_tensor_model_parallel_rank() == 0 and ps.get_pipeline_model_parallel_rank() == 0
            and ps.get_context_parallel_rank() == 0)


def padded_rows(n: int, parts: int) -> int:
    return -(-n // parts) * parts


def pad_rows(t: torch.Tensor, n: int) -> torch.Tensor:
    """``t`` with its last row repeated until it has ``n`` rows."""
    if t.shape[0] == n:
        return t
    extra = t[-1:].expand(n - t.shape[0], *t.shape[1:])
    return torch.cat([t, extra], 0)


def local_rows(n: int) -> slice:
    """This DP rank's rows of a batch padded to ``padded_rows(n, dp)``."""
    per = padded_rows(n, dp_size()) // dp_size()
    r = dp_rank()
    return slice(r * per, (r + 1) * per)


def map_rows(fn: Callable[..., torch.Tensor], *tensors: torch.Tensor) -> torch.Tensor:
    """``fn(*local_shards)`` on each DP rank, gathered to the full ``(n, ...)`` result.

    Collective over the world: every rank must call it with the same shapes.
    """
    n = tensors[0].shape[0]
    size = dp_size()
    total = padded_rows(n, size)
    sl = local_rows(n)
    local = fn(*(pad_rows(t, total)[sl] for t in tensors))
    if size == 1:
        return local[:n]
    parts = [torch.empty_like(local) for _ in range(size)]
    dist.all_gather(parts, local.contiguous(), group=dp_group())
    return torch.cat(parts, 0)[:n]


#: what this rank's object collectives moved since :func:`take_objects_moved`: the pickled bytes it
#: sent (the samples, results and records the phases hand each other) and the seconds they took
_MOVED = {"bytes": 0, "seconds": 0.0}


def _count_moved(obj: Any, sends: bool, t0: float) -> None:
    if sends:
        _MOVED["bytes"] += len(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL))
    _MOVED["seconds"] += time.perf_counter() - t0


def take_objects_moved() -> dict:
    """``{"bytes", "seconds"}`` of this rank's object collectives since the last call; resets."""
    out = dict(_MOVED)
    _MOVED.update(bytes=0, seconds=0.0)
    return out


def gather_objects(obj: Any) -> List[Any]:
    """Every rank's ``obj`` (world order) on every rank."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return [obj]
    t0 = time.perf_counter()
    out: List[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    _count_moved(obj, True, t0)
    return out


def broadcast_object(obj: Any, src: int = 0) -> Any:
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return obj
    t0 = time.perf_counter()
    box = [obj]
    dist.broadcast_object_list(box, src=src)
    _count_moved(obj, dist.get_rank() == src, t0)
    return box[0]


def all_ranks_agree(flag: bool) -> bool:
    """True iff ``flag`` is true on every rank (a MIN all-reduce)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return flag
    t = torch.tensor([1 if flag else 0], dtype=torch.int64)
    from megarl.runtime.distributed import device

    t = t.to(device())
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return bool(t.item())
