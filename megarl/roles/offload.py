"""Time-slicing one GPU between the rollout engine and the trainer (docs/design.md, "Roles and
their physical home").

While the rollout engine generates, the actor's parameters, gradients and optimizer state sit
in (pinned) host memory and their device memory is returned; the reference model lives on the
host between its forwards.  Physical tricks never change the logical contract: a step after
``offload()``/``onload()`` is bitwise the step without them (``tests/multiproc/test_offload.py``).

Everything is moved at the level of *storages*, not tensors (:class:`_StorageGroup` says how
and why); :func:`training_state_claims` says which storages belong to which kind.

Not supported: NCCL user-buffer registration (``nccl_ub``) and CUDA graphs that captured these
storages' addresses: the storage's address changes across a round trip.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Dict, Iterator, List, Optional, Sequence

import torch

from megarl.errors import MegarlError

__all__ = [
    "OffloadStateError",
    "ActorOffloader",
    "ReferenceOffloader",
]

_ALIGN = 512  # byte alignment of each storage's slot in the flat host buffer


class OffloadStateError(MegarlError, RuntimeError):
    """offload()/onload() called in the wrong state, or a storage changed behind our back."""


# --------------------------------------------------------------------------------------------
# storage-level moves


def _byte_view(storage: torch.UntypedStorage) -> torch.Tensor:
    """A flat uint8 tensor over the whole of ``storage``."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


def _host_buffer(nbytes: int) -> torch.Tensor:
    pin = torch.cuda.is_available()
    return torch.empty(nbytes, dtype=torch.uint8, device="cpu", pin_memory=pin)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _empty_cache(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.empty_cache()


@dataclass
class _Slot:
    storage: torch.UntypedStorage
    nbytes: int
    offset: int  # into the host buffer
    what: str  # a human name for error messages


class _StorageGroup:
    """A set of distinct device storages moved to and from one flat host buffer together.

    Everything is moved at the level of *storages*, not tensors.  megatron DDP keeps gradients
    (and, with the distributed optimizer, parameters) in one contiguous ``_ParamAndGradBuffer``
    per dtype; each ``param.data`` / ``param.main_grad`` / bucket / optimizer shard is a *view* into
    ``buffer.param_data`` / ``buffer.grad_data``.  Offloading copies each distinct device storage
    into one flat host buffer per kind and then ``untyped_storage().resize_(0)``s it (the approach
    of verl's ``offload_megatron_model_to_cpu`` and megatron's own
    ``_ParamAndGradBuffer.offload_to_cpu``).  Every view keeps pointing at the same storage object,
    so onloading is ``resize_(nbytes)`` plus a copy back and no view needs re-pointing.  Storages
    are deduplicated, so a buffer holding a hundred parameter views moves as one copy, and a tensor
    that two kinds reach (an FP32 optimizer's params *are* the model params; a distributed
    optimizer's fp32 shards are views of ``param_data``) is moved only by the kind that owns it.

    The host copies are allocated once per kind (pinned when CUDA is available) and reused on every
    cycle; on CPU (tests) the "device" is the CPU, so offload is a copy to a separate host buffer
    plus freeing the original storage, which is exactly what the tests check.
    """

    def __init__(self, kind: str, preserve: bool = True):
        self.kind = kind
        self.preserve = preserve  # False: contents are dropped and come back zeroed
        self._host: Optional[torch.Tensor] = None
        self._slots: List[_Slot] = []
        self._device: Optional[torch.device] = None
        self.offloaded = False

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes for s in self._slots)

    @property
    def host_capacity(self) -> int:
        return 0 if self._host is None else self._host.numel()

    def offload(self, storages: Sequence[tuple], device: torch.device) -> int:
        """Copy ``storages`` (``(storage, what)`` pairs, distinct) to the host and free them."""
        assert not self.offloaded
        slots, off = [], 0
        for st, what in storages:
            n = st.nbytes()
            slots.append(_Slot(st, n, off, what))
            off += (n + _ALIGN - 1) // _ALIGN * _ALIGN
        if self.preserve and off > self.host_capacity:
            self._host = None  # drop the old one before allocating the larger one
            self._host = _host_buffer(off)
        if self.preserve:
            for s in slots:
                self._host[s.offset:s.offset + s.nbytes].copy_(_byte_view(s.storage), non_blocking=True)
            _sync(device)  # the copies must land before the device memory is released
        for s in slots:
            s.storage.resize_(0)
        self._slots, self._device, self.offloaded = slots, device, True
        return sum(s.nbytes for s in slots)

    def onload(self) -> None:
        assert self.offloaded
        for s in self._slots:
            if s.storage.nbytes() != 0:
                raise OffloadStateError(
                    f"{self.kind}: the storage of {s.what} was re-allocated while offloaded "
                    f"(it holds {s.storage.nbytes()} bytes); something else moved it")
        for s in self._slots:
            s.storage.resize_(s.nbytes)
            dst = _byte_view(s.storage)
            if self.preserve:
                dst.copy_(self._host[s.offset:s.offset + s.nbytes], non_blocking=True)
            else:
                dst.zero_()
        _sync(self._device)
        self.offloaded = False

    def release_host(self) -> None:
        assert not self.offloaded
        self._host = None


class _Claims:
    """Collects distinct storages on ``device`` per kind; the first kind to reach one owns it."""

    def __init__(self, device: torch.device):
        self.device = device
        self._owner: Dict[int, str] = {}
        self.by_kind: Dict[str, List[tuple]] = {}

    def add(self, kind: str, t: Optional[torch.Tensor], what: str) -> None:
        if t is None or not torch.is_tensor(t):
            return
        st = t.untyped_storage()
        if st.device.type != self.device.type or st.nbytes() == 0:
            return  # e.g. Adam's CPU ``step`` on a GPU run; or already released
        key = st.data_ptr()
        if key in self._owner:
            return
        if not st.resizable():
            raise OffloadStateError(
                f"cannot offload {what}: its storage is not resizable (memory-mapped or "
                "borrowed from another library); copy it into a torch-allocated tensor first")
        self._owner[key] = kind
        self.by_kind.setdefault(kind, []).append((st, what))

    def storages(self, kind: str) -> List[tuple]:
        return self.by_kind.get(kind, [])


def _model_device(modules: Sequence[torch.nn.Module]) -> torch.device:
    for m in modules:
        for p in m.parameters():
            return p.device
    raise ValueError("the model has no parameters")


def _add_module_tensors(claims: _Claims, kind: str, modules: Sequence[torch.nn.Module]) -> None:
    for i, m in enumerate(modules):
        for name, p in m.named_parameters(remove_duplicate=True):
            claims.add(kind, p, f"param {name} (chunk {i})")
        for name, b in m.named_buffers(remove_duplicate=True):
            claims.add(kind, b, f"buffer {name} (chunk {i})")


def _ddp_buffers(modules: Sequence[torch.nn.Module]) -> Iterator[tuple]:
    for i, m in enumerate(modules):
        for j, buf in enumerate(list(getattr(m, "buffers", None) or [])
                                + list(getattr(m, "expert_parallel_buffers", None) or [])):
            yield f"chunk {i} DDP buffer {j}", buf


def _torch_optimizers(optimizer) -> List[torch.optim.Optimizer]:
    """The ``torch.optim`` optimizers inside a megatron optimizer (ChainedOptimizer, FP32Optimizer,
    Float16OptimizerWithFloat16Params, DistributedOptimizer) or a bare torch optimizer."""
    if optimizer is None:
        return []
    if isinstance(optimizer, torch.optim.Optimizer):
        return [optimizer]
    chained = getattr(optimizer, "chained_optimizers", None)
    if chained is not None:
        out: List[torch.optim.Optimizer] = []
        for o in chained:
            out.extend(_torch_optimizers(o))
        return out
    if getattr(optimizer, "is_stub_optimizer", False):
        return []
    inner = getattr(optimizer, "optimizer", None)
    if isinstance(inner, torch.optim.Optimizer):
        return [inner]
    raise TypeError(f"do not know where {type(optimizer).__name__} keeps its state; expected a "
                    "megatron optimizer (with .optimizer or .chained_optimizers) or a torch optimizer")


def _as_chunks(model) -> List[torch.nn.Module]:
    if isinstance(model, torch.nn.Module):
        return [model]
    chunks = list(model)
    if not chunks or not all(isinstance(c, torch.nn.Module) for c in chunks):
        raise TypeError("expected a torch.nn.Module or a non-empty list of model chunks")
    return chunks


def training_state_claims(chunks: Sequence[torch.nn.Module], torch_opts: Sequence[torch.optim.Optimizer]) -> _Claims:
    """The distinct device storages of a megatron-DDP model and its optimizer, by kind
    (``params``, ``grads``, ``optimizer``).

    Who owns what (megatron-core 0.16.1, checked against the installed source):

    * params: every module parameter and registered buffer, plus ``buffer.param_data`` of each DDP
      buffer (``None`` without the distributed optimizer: the params are then separate tensors);
    * grads: ``buffer.grad_data`` (``param.main_grad`` and the ``param.grad`` views megatron's
      optimizers set point into it) and any other ``.grad``/``.main_grad`` tensor;
    * optimizer: the inner ``torch.optim`` optimizers' ``state`` tensors (``exp_avg``,
      ``exp_avg_sq``, ``momentum_buffer``, ``step``) and their ``param_groups`` tensors that the
      model does not own: the fp32 main params of ``Float16OptimizerWithFloat16Params``
      (``fp32_from_float16_groups``) and of ``DistributedOptimizer``
      (``shard_fp32_from_float16_groups``).  ``ChainedOptimizer`` is walked recursively.
    """
    claims = _Claims(_model_device(chunks))
    # params: DDP's contiguous param buffers first (distributed optimizer), then every
    # module parameter/buffer (separate tensors otherwise, and anything outside DDP).
    for where, buf in _ddp_buffers(chunks):
        claims.add("params", getattr(buf, "param_data", None), f"{where}.param_data")
    _add_module_tensors(claims, "params", chunks)
    # grads: DDP's contiguous grad buffers, then any stray .main_grad / .grad.
    for where, buf in _ddp_buffers(chunks):
        claims.add("grads", getattr(buf, "grad_data", None), f"{where}.grad_data")
    opt_params = [p for o in torch_opts for g in o.param_groups for p in g["params"]]
    for i, m in enumerate(chunks):
        for name, p in m.named_parameters():
            claims.add("grads", getattr(p, "main_grad", None), f"{name}.main_grad (chunk {i})")
            claims.add("grads", p.grad, f"{name}.grad (chunk {i})")
    for j, p in enumerate(opt_params):
        claims.add("grads", p.grad, f"optimizer param {j}.grad")
    # optimizer: main params the model does not own, and the state tensors.
    for j, p in enumerate(opt_params):
        claims.add("optimizer", p, f"optimizer param {j}")
    for k, o in enumerate(torch_opts):
        for j, st in enumerate(o.state.values()):
            for key, v in st.items():
                claims.add("optimizer", v, f"optimizer {k} state[{j}][{key!r}]")
    return claims


# --------------------------------------------------------------------------------------------
# the actor


class ActorOffloader:
    """Offloads a megatron-DDP actor's params, grads and optimizer state to host memory.

    ``offload()`` while the rollout engine generates, ``onload()`` before the next train step.
    Both are strict: offloading twice or onloading what is not offloaded raises
    :class:`OffloadStateError` and changes nothing.  The set of storages is recomputed at every
    ``offload()`` (optimizer state only exists after the first step).

    ``preserve_grads=False`` drops gradient contents instead of copying them (they come back
    zeroed, like megatron's ``DistributedDataParallel.restore_grad_buffers``): the cheap choice
    for RL time-slicing, since ``train_step`` zeroes the grad buffer before it accumulates.
    ``keep_host_buffers`` keeps the (pinned) host copies allocated between cycles, so pinning is
    paid once; ``release_host_buffers()`` frees them while onloaded.
    """

    KINDS = ("params", "grads", "optimizer")

    def __init__(self, ddp_model, optimizer, offload_params: bool = True, offload_grads: bool = True,
                 offload_optimizer: bool = True, preserve_grads: bool = True,
                 keep_host_buffers: bool = True):
        self.chunks = _as_chunks(ddp_model)
        if offload_optimizer and optimizer is None:
            raise ValueError("offload_optimizer=True needs the optimizer; pass it or set "
                             "offload_optimizer=False")
        self.optimizer = optimizer
        self._torch_opts = _torch_optimizers(optimizer)
        self.enabled = {"params": offload_params, "grads": offload_grads,
                        "optimizer": offload_optimizer}
        self.keep_host_buffers = keep_host_buffers
        self._groups = {k: _StorageGroup(k, preserve=(k != "grads" or preserve_grads))
                        for k in self.KINDS}
        self._offloaded = False

    @property
    def is_offloaded(self) -> bool:
        return self._offloaded

    def _claims(self) -> _Claims:
        return training_state_claims(self.chunks, self._torch_opts)

    def offload(self) -> Dict[str, int]:
        """Move the enabled kinds to host memory; returns bytes released per kind."""
        if self._offloaded:
            raise OffloadStateError("ActorOffloader.offload(): the actor is already offloaded; "
                                    "call onload() first")
        claims = self._claims()
        moved: Dict[str, int] = {k: 0 for k in self.KINDS}
        done: List[_StorageGroup] = []
        try:
            for kind in self.KINDS:
                if self.enabled[kind]:
                    moved[kind] = self._groups[kind].offload(claims.storages(kind), claims.device)
                    done.append(self._groups[kind])
        except BaseException:
            for g in done:  # all or nothing
                g.onload()
            raise
        _empty_cache(claims.device)
        self._offloaded = True
        return dict(moved)

    def onload(self) -> None:
        """Bring everything offloaded back to the device, contents bitwise unchanged."""
        if not self._offloaded:
            raise OffloadStateError("ActorOffloader.onload(): the actor is not offloaded; "
                                    "call offload() first")
        for kind in self.KINDS:
            g = self._groups[kind]
            if g.offloaded:
                g.onload()
                if not self.keep_host_buffers:
                    g.release_host()
        self._offloaded = False

    @contextlib.contextmanager
    def offloaded(self):
        """``with actor.offloaded(): generate()`` -- offload for the block, onload after."""
        self.offload()
        try:
            yield self
        finally:
            self.onload()

    def host_bytes(self) -> int:
        """Host bytes held by the host copies (pinned on CUDA)."""
        return sum(g.host_capacity for g in self._groups.values())

    def release_host_buffers(self) -> None:
        if self._offloaded:
            raise OffloadStateError("release_host_buffers(): the actor is offloaded; its only "
                                    "copy lives in those buffers")
        for g in self._groups.values():
            g.release_host()


# --------------------------------------------------------------------------------------------
# the reference model


class ReferenceOffloader:
    """Keeps a frozen (non-DDP) megatron model on the host between its forwards.

    ``offload()`` after a forward, ``onload()`` before one (strict, like :class:`ActorOffloader`);
    ``with ref.on_device(): ...`` onloads if needed and always leaves the model offloaded.
    """

    def __init__(self, model, keep_host_buffers: bool = True):
        from megatron.core.distributed import DistributedDataParallel

        self.chunks = _as_chunks(model)
        for c in self.chunks:
            if isinstance(c, DistributedDataParallel):
                raise TypeError("ReferenceOffloader takes the bare (frozen) model; a DDP-wrapped "
                                "model is a trainable actor: use ActorOffloader")
        self.keep_host_buffers = keep_host_buffers
        self._group = _StorageGroup("reference params")

    @property
    def is_offloaded(self) -> bool:
        return self._group.offloaded

    def offload(self) -> int:
        """Move params and registered buffers to host memory; returns bytes released."""
        if self._group.offloaded:
            raise OffloadStateError("ReferenceOffloader.offload(): the reference model is already "
                                    "offloaded; call onload() first")
        claims = _Claims(_model_device(self.chunks))
        _add_module_tensors(claims, "params", self.chunks)
        released = self._group.offload(claims.storages("params"), claims.device)
        _empty_cache(claims.device)
        return released

    def onload(self) -> None:
        if not self._group.offloaded:
            raise OffloadStateError("ReferenceOffloader.onload(): the reference model is not "
                                    "offloaded; call offload() first")
        self._group.onload()
        if not self.keep_host_buffers:
            self._group.release_host()

    @contextlib.contextmanager
    def on_device(self):
        """Onload (if offloaded) for the block; the model is offloaded when it ends."""
        if self._group.offloaded:
            self.onload()
        try:
            yield self
        finally:
            self.offload()
