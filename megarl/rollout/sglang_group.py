"""Collectives within one SGLang inference group (its TP ranks), shared by every engine call.

Every rank of the group constructs the engine and calls every method (SPMD); the group's first
rank owns ``sglang.Engine``.  What only that rank can do is run there and its outcome broadcast
(:meth:`InferenceGroup._leader_call`), so no rank is left waiting in a collective when it fails.
"""

from __future__ import annotations

import torch

from megarl.rollout.protocol import RolloutError
from megarl.rollout.sglang_release import WeightUpdateRejectedError


class InferenceGroup:
    """The collectives of an engine whose ranks form one inference group.  The engine sets
    ``group`` (None: one rank, no torch.distributed), ``device``, ``rank_in_group`` and
    ``src_global_rank`` (the global rank of the group's first rank)."""

    def _barrier(self):
        if self.group is not None:
            import torch.distributed as dist

            dist.barrier(group=self.group)

    def _all_ok(self, ok: bool) -> bool:
        if self.group is None:
            return ok
        import torch.distributed as dist

        flag = torch.tensor([1 if ok else 0], device=self.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=self.group)
        return bool(flag.item())

    def _broadcast(self, obj):
        if self.group is None:
            return obj
        import torch.distributed as dist

        box = [obj]
        dist.broadcast_object_list(box, src=self.src_global_rank, group=self.group)
        return box[0]

    def _synchronize(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _leader_result(self, what: str, fn, run: bool = True):
        """``fn()`` on the group's first rank (when ``run``), its result broadcast to every rank (None
        where it did not run).  An exception is raised on every rank: itself on the first, a
        :class:`RolloutError` naming ``what`` on the others (the broadcast is also the sync point)."""
        result, failure, error = None, None, None
        if self.rank_in_group == 0 and run:
            try:
                result = fn()
            except Exception as e:  # noqa: BLE001 - re-raised below, after the other ranks know
                error, failure = e, f"{type(e).__name__}: {e}"
        result, failure = self._broadcast((result, failure))
        if error is not None:
            raise error
        if failure is not None:
            raise RolloutError(f"{what} failed on the inference group's first rank: {failure}")
        return result

    def _leader_call(self, what: str, fn, error: type[RolloutError] = WeightUpdateRejectedError) -> None:
        """Run ``fn() -> (ok, message)`` on the group's first rank; every rank raises ``error`` if
        it failed (one broadcast: also the sync point, so no rank is left waiting)."""
        status = (True, "")
        if self.rank_in_group == 0:
            try:
                status = fn()
            except Exception as e:  # noqa: BLE001 - an engine exception must not strand the other ranks
                status = (False, f"{type(e).__name__}: {e}")
        ok, message = self._broadcast(status)
        if not ok:
            raise error(f"SGLang {what} failed: {message}")
