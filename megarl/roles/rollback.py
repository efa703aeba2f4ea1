"""Returning a trainable role to the committed version v after a failed update.

The rule for a failure inside the actor update: no partial update becomes visible, and
the actor, its optimizer and its LR schedule return to the committed version v on every rank.
:class:`UpdateSnapshot` is the "from memory" way: at the start of an update it copies, to one
flat host buffer, every device storage that holds v's parameters and optimizer state (the same
storage inventory the host offload uses, :func:`megarl.roles.offload.training_state_claims`),
plus the optimizer state that lives off the device (Adam's ``step`` on a GPU run), the param
groups' hyper-parameters, the LR schedule's step count, the grad scaler and the role's step
counter.  :meth:`UpdateSnapshot.restore` copies them back in place and deletes optimizer state
created after the snapshot (the first update creates Adam's moments), so the restored role is
bitwise the role at v -- the trainer proves it by the weight manifest's hash, which must equal
v's on every rank before the state machine recovers.

Gradients are not kept: every step zeroes the grad buffer before it accumulates.

Cost: one device-to-host copy of params + optimizer state per update (about 16 bytes per
parameter for fp32 Adam on this rank's shard), and that much host memory, reused across
iterations.  ``trainer.update_rollback=none`` skips it; a failed update then stops the run and
``resume=auto`` restarts from the last checkpoint.
"""

from __future__ import annotations

import copy
from typing import List, Optional

import torch

from megarl.errors import MegarlError
from megarl.models.optim import grad_scaler_states, load_grad_scaler_states
from megarl.roles.offload import _ALIGN, _as_chunks, _byte_view, _host_buffer, _sync, _torch_optimizers, \
    training_state_claims

__all__ = ["UpdateSnapshot", "RollbackError"]


class RollbackError(MegarlError, RuntimeError):
    """The role's state changed shape since the snapshot: it cannot be restored in place."""


class UpdateSnapshot:
    """A host copy of one role's trainable state (see the module docstring)."""

    def __init__(self):
        self._host: Optional[torch.Tensor] = None
        self._slots: List[tuple] = []
        self.nbytes = 0
        self.taken = False

    def take(self, ddp_model, optimizer, scheduler, steps: int) -> int:
        """Copy the role's state; returns the bytes copied."""
        return self._take(ddp_model, optimizer, scheduler, steps)

    def _take(self, ddp_model, optimizer, scheduler, steps: int) -> int:
        chunks = _as_chunks(ddp_model)
        opts = _torch_optimizers(optimizer)
        claims = training_state_claims(chunks, opts)
        storages = claims.storages("params") + claims.storages("optimizer")
        slots, off = [], 0
        for st, what in storages:
            slots.append((st, st.nbytes(), off, what))
            off += (st.nbytes() + _ALIGN - 1) // _ALIGN * _ALIGN
        if self._host is None or self._host.numel() < off:
            self._host = None
            self._host = _host_buffer(off)
        for st, n, o, _ in slots:
            self._host[o:o + n].copy_(_byte_view(st), non_blocking=True)
        _sync(claims.device)
        self._slots, self.nbytes = slots, sum(n for _, n, _, _ in slots)
        self._claimed = {st.data_ptr() for st, *_ in slots}
        # optimizer state off the device (not in the storage inventory), and which entries exist
        self._state_keys = [set(o.state.keys()) for o in opts]
        self._off_device = [(v, v.detach().clone()) for o in opts for st in o.state.values() for v in st.values()
                            if torch.is_tensor(v) and v.untyped_storage().data_ptr() not in self._claimed]
        self._groups = [[{k: copy.deepcopy(v) for k, v in g.items() if k != "params"} for g in o.param_groups]
                        for o in opts]
        # megatron's ChainedOptimizer has no grad_scaler of its own: one per optimizer it chains
        self._scalers = grad_scaler_states(optimizer)
        self._sched_steps = None if scheduler is None else scheduler.num_steps
        self.steps = steps
        self.taken = True
        return self.nbytes

    def restore(self, ddp_model, optimizer, scheduler) -> int:
        """Put the snapshot back in place; returns the role's step count at the snapshot."""
        if not self.taken:
            raise RollbackError("restore() without a snapshot: take() it at the start of the update")
        opts = _torch_optimizers(optimizer)
        for o, keys in zip(opts, self._state_keys, strict=True):
            for p in [p for p in o.state if p not in keys]:
                del o.state[p]
        device = torch.device("cpu")
        for st, n, o, what in self._slots:
            if st.nbytes() != n:
                raise RollbackError(f"{what}: its storage holds {st.nbytes()} bytes, {n} at the snapshot; "
                                    "something re-allocated it during the update")
            _byte_view(st).copy_(self._host[o:o + n], non_blocking=True)
            device = st.device
        _sync(device)
        for live, saved in self._off_device:
            live.copy_(saved)
        for o, groups in zip(opts, self._groups, strict=True):
            for g, saved in zip(o.param_groups, groups, strict=True):
                g.update(copy.deepcopy(saved))
        load_grad_scaler_states(optimizer, self._scalers, "rollback")
        if scheduler is not None:
            scheduler.num_steps = self._sched_steps
            scheduler.step(increment=0)
        return self.steps
