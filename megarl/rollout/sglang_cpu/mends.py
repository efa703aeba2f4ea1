"""The mends of :mod:`megarl.rollout.sglang_cpu`, applied when their module has loaded: in the
process that calls ``prepare()`` and, through ``sitecustomize``, in SGLang's spawned schedulers.

Each mend checks that its target exists and raises :class:`AccommodationError` naming it and the
installed SGLang otherwise, so a release that moves the code fails here, not somewhere later.
Nothing here imports ``sglang`` or ``torch`` eagerly: a hook runs when the module is imported.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys

#: the module whose host-buffer registration is made a no-op, and the function
HOST_REGISTER = ("sglang.srt.mem_cache.pool_host.common", "_cuda_host_register")


class AccommodationError(RuntimeError):
    """SGLang changed under one of megarl's CPU mends."""


def _sglang_version() -> str:
    try:
        from importlib.metadata import version

        return version("sglang")
    except Exception:  # noqa: BLE001 - only for the message
        return "?"


def _mend_device_module(torch) -> None:
    """``torch.get_device_module()`` (no argument) answers ``torch.cpu`` when no CUDA device exists."""
    original = getattr(torch, "get_device_module", None)
    if original is None:
        raise AccommodationError(f"torch {torch.__version__} has no torch.get_device_module, which SGLang "
                                 f"{_sglang_version()}'s weight_updater calls: the CPU mend has no target")
    if getattr(original, "__megarl_mend__", False):
        return

    def get_device_module(device=None):
        if device is None and not torch.cuda.is_available():
            return torch.cpu
        return original(device) if device is not None else original()

    get_device_module.__megarl_mend__ = True
    get_device_module.__wrapped__ = original
    torch.get_device_module = get_device_module


def _mend_host_register(module) -> None:
    """Registering a pinned host buffer with CUDA is a no-op when no CUDA device exists."""
    name = HOST_REGISTER[1]
    original = getattr(module, name, None)
    if original is None or not callable(original):
        raise AccommodationError(f"SGLang {_sglang_version()}: {HOST_REGISTER[0]}.{name} is gone; megarl's CPU mend "
                                 "for routed-expert capture (a no-op cudaHostRegister) must follow it")
    if getattr(original, "__megarl_mend__", False):
        return
    import torch

    def register(*args, **kwargs):
        if torch.cuda.is_available():
            return original(*args, **kwargs)
        return None

    register.__megarl_mend__ = True
    register.__wrapped__ = original
    setattr(module, name, register)


#: SGLang's LoRA modules, which allocate their host-side index buffers pinned (``pin_memory=True``)
LORA_PINNED = ("sglang.srt.lora.layers", "sglang.srt.lora.backend.torch_backend")
#: the torch factories those modules call with ``pin_memory=True``
PINNED_FACTORIES = ("tensor", "empty", "zeros", "ones", "full", "arange")


class _Unpinned:
    """``torch`` as a LoRA module sees it: without CUDA, a factory asked for pinned memory gives
    plain host memory (pinning is a CUDA transfer optimisation; nothing else changes)."""

    def __init__(self, torch):
        self._torch = torch

    def __getattr__(self, name):
        attr = getattr(self._torch, name)
        if name not in PINNED_FACTORIES:
            return attr
        torch = self._torch

        def factory(*args, **kwargs):
            if kwargs.get("pin_memory") and not torch.cuda.is_available():
                kwargs["pin_memory"] = False
            return attr(*args, **kwargs)

        return factory


def _mend_lora_pinned(module) -> None:
    """SGLang's LoRA layers and torch-native LoRA backend (``lora_backend="torch_native"``) pin their
    host buffers; without CUDA they get plain host memory (``Tensor.pin_memory()`` included)."""
    import torch

    if getattr(module, "torch", None) is not torch and not isinstance(getattr(module, "torch", None), _Unpinned):
        raise AccommodationError(f"SGLang {_sglang_version()}: {module.__name__} no longer imports torch as a "
                                 "module global; megarl's CPU mend for its pinned LoRA buffers must follow it")
    module.torch = _Unpinned(torch)
    original = torch.Tensor.pin_memory
    if getattr(original, "__megarl_mend__", False):
        return

    def pin_memory(self, *args, **kwargs):
        if torch.cuda.is_available():
            return original(self, *args, **kwargs)
        return self

    pin_memory.__megarl_mend__ = True
    pin_memory.__wrapped__ = original
    torch.Tensor.pin_memory = pin_memory


#: module name -> its mend, run once the module has loaded
MENDS = {"torch": _mend_device_module, HOST_REGISTER[0]: _mend_host_register,
         **{name: _mend_lora_pinned for name in LORA_PINNED}}


class _AfterImport(importlib.abc.MetaPathFinder):
    """Runs a mend right after its module executes (first on ``sys.meta_path``)."""

    def __init__(self, pending: dict):
        self.pending = pending

    def find_spec(self, name, path, target=None):
        if name not in self.pending:
            return None
        sys.meta_path.remove(self)
        try:
            spec = importlib.util.find_spec(name)
        finally:
            sys.meta_path.insert(0, self)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        mend, execute = self.pending.pop(name), spec.loader.exec_module

        def exec_module(module):
            execute(module)
            mend(module)

        spec.loader.exec_module = exec_module
        return spec


def install() -> None:
    """Apply every mend: at once to modules already loaded, the others when they load."""
    pending = {}
    for name, mend in MENDS.items():
        if name in sys.modules:
            mend(sys.modules[name])
        else:
            pending[name] = mend
    if pending and not any(isinstance(f, _AfterImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _AfterImport(pending))
