"""Everything that lets megatron-core run on a machine without CUDA, in one place.

megatron-core has no supported CPU path: it hard-codes ``device="cuda"`` literals,
``torch.cuda.current_device()`` and ``torch.cuda.synchronize()`` in the pipeline schedules,
p2p communication, tensor-parallel mappings and RoPE.  megarl's tests prove TP/PP/DP layouts
on CPU with gloo, so we redirect those CUDA references to the CPU *only when CUDA is absent*.
On a CUDA machine :func:`install` returns immediately and nothing here runs.

What is patched, and why (observed on megatron-core 0.16.1, see shared/notes):

* ``torch.cuda.current_device`` returns ``"cpu"`` so ``device=torch.cuda.current_device()``
  allocations land on the CPU.
* A :class:`torch.overrides.TorchFunctionMode` rewrites a ``device`` argument of type cuda to
  cpu for every torch function (``torch.zeros(..., device="cuda")`` in the schedules), and makes
  ``Tensor.cuda()`` return the tensor itself.
  Code that never reaches megatron lifts it with :func:`without_device_rewrite`.
* ``torch.cuda.synchronize`` / ``torch.cuda.empty_cache`` become no-ops.
* Gradient clipping: megatron's ``clip_grad_by_total_norm_fp32`` asserts CUDA grad types; a
  CPU twin with the same arithmetic replaces it (the norm itself is megatron's own).
* The CUDA RNG tracker that megatron requires is replaced by megatron's own tracker initialised
  in inference mode (dropout is 0 in RL fine-tuning; the tracker is never forked on CPU).

Callers that must avoid remaining CUDA-only paths on CPU (fp32 only, no distributed optimizer,
no fused grad clipping, explicit attention masks) ask :func:`on_cpu`.  ``tests/test_cpu_compat.py``
fails loudly when a megatron-core upgrade changes the surface patched here.
"""

from __future__ import annotations

import contextlib
import functools
import warnings
from typing import Iterator

import torch
from torch.overrides import TorchFunctionMode

_INSTALLED = False
_MODE: "_CudaToCpuMode | None" = None

#: megatron-core versions these accommodations were verified against.
VERIFIED_MEGATRON_CORE = ("0.16.",)


def on_cpu() -> bool:
    """True when this process runs without CUDA (the CPU/gloo path)."""
    return not torch.cuda.is_available()


def _is_cuda_device(dev) -> bool:
    if isinstance(dev, str):
        return dev.startswith("cuda")
    if isinstance(dev, torch.device):
        return dev.type == "cuda"
    return False


class _CudaToCpuMode(TorchFunctionMode):
    """Rewrites ``device=cuda`` to ``cpu`` and turns ``Tensor.cuda()`` into identity."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.cuda:
            return args[0]
        dev = kwargs.get("device")
        if dev is not None and _is_cuda_device(dev):
            kwargs = dict(kwargs, device="cpu")
        if func is torch.Tensor.to and args and len(args) > 1 and _is_cuda_device(args[1]):
            args = (args[0], "cpu", *args[2:])
        return func(*args, **kwargs)


@contextlib.contextmanager
def without_device_rewrite() -> Iterator[None]:
    """Run a block that never reaches megatron (transformers generation, weight staging) with
    the device-rewriting mode lifted on this thread.

    The mode costs every torch call a trip through Python (~2.75 us on this CPU); a rollout of
    the tiny recipe makes ~3000 of them per iteration.  Inert on CUDA (no mode is installed)
    and when another mode has been pushed above ours (then the block runs under both).
    """
    depth = torch._C._len_torch_function_stack()
    if _MODE is None or depth == 0 or torch._C._get_function_stack_at(depth - 1) is not _MODE:
        yield
        return
    _MODE.__exit__(None, None, None)
    try:
        yield
    finally:
        _MODE.__enter__()


def _noop(*_args, **_kwargs):
    return None


def install() -> bool:
    """Install the CPU accommodations once per process; returns True if installed.

    Does nothing (and returns False) when CUDA is available.
    """
    global _INSTALLED, _MODE
    if not on_cpu():
        return False
    if _INSTALLED:
        return True
    # megatron warns once per module that TE/apex are absent; on CPU that is the design.
    warnings.filterwarnings("ignore", message=".*(Transformer Engine|Apex|apex).*")
    torch.cuda.current_device = lambda: "cpu"  # type: ignore[assignment]
    torch.cuda.synchronize = _noop  # type: ignore[assignment]
    torch.cuda.empty_cache = _noop  # type: ignore[assignment]
    _MODE = _CudaToCpuMode()
    _MODE.__enter__()
    _patch_grad_clipping()
    _INSTALLED = True
    return True


def _clip_grad_by_total_norm_fp32_cpu(parameters, max_norm, total_norm, use_decoupled_grad=False):
    """megatron's ``clip_grad_by_total_norm_fp32`` minus its ``torch.cuda.FloatTensor`` assert.

    Same arithmetic: scale every grad by ``max_norm / (total_norm + 1e-6)`` when that is < 1.
    """
    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    attr = "decoupled_grad" if use_decoupled_grad else "grad"
    grads = [getattr(p, attr).detach() for p in parameters if getattr(p, attr, None) is not None]
    clip_coeff = max_norm / (total_norm + 1.0e-6)
    if clip_coeff < 1.0 and grads:
        torch._foreach_mul_(grads, clip_coeff)


def _patch_grad_clipping() -> None:
    from megatron.core.optimizer import clip_grads, optimizer

    clip_grads.clip_grad_by_total_norm_fp32 = _clip_grad_by_total_norm_fp32_cpu
    optimizer.clip_grad_by_total_norm_fp32 = _clip_grad_by_total_norm_fp32_cpu


def seed_megatron_rng(seed: int) -> None:
    """Seed torch and megatron's model-parallel RNG tracker for this rank.

    On CUDA this is megatron's own ``model_parallel_cuda_manual_seed``.  On CPU the CUDA RNG
    states it needs do not exist; megatron's inference-mode tracker is a correct stand-in as
    long as dropout is 0, which :func:`megarl.models.builder` enforces on CPU.
    """
    from megatron.core import tensor_parallel

    torch.manual_seed(seed)
    if on_cpu():
        tensor_parallel.random.initialize_rng_tracker(
            inference_rng_tracker=True, force_reset=True
        )
    else:
        tensor_parallel.model_parallel_cuda_manual_seed(seed)


@functools.lru_cache(maxsize=None)
def megatron_core_version() -> str:
    from importlib.metadata import version

    return version("megatron-core")


def check_megatron_version() -> None:
    """Fail loudly if megatron-core is a version these accommodations were not verified on."""
    v = megatron_core_version()
    if on_cpu() and not v.startswith(VERIFIED_MEGATRON_CORE):
        raise RuntimeError(
            f"megatron-core {v} is installed, but megarl's CPU accommodations "
            f"(megarl/runtime/cpu_compat.py) were verified on {VERIFIED_MEGATRON_CORE}; "
            "re-verify them (tests/test_cpu_compat.py) before running on CPU"
        )
