"""What the real SGLang engine needs to run on a CPU-only machine: one place, inert where CUDA exists.

SGLang has a CPU path (``SGLANG_USE_CPU_ENGINE=1``: torch-native layers, the ``torch_native``
attention backend).  On a machine with neither a GPU nor SGLang's CPU kernel package (not on the
package index; its fast kernels need AMX anyway) five things stand in its way; each is mended
here, and each mend checks that what it mends is still there, failing loudly (naming the SGLang
version) when a release moves it.  The five, and why: docs/cpu.md, "SGLang on a CPU".  A sixth
lets SGLang's torch-native LoRA backend run (``actor.lora.engine: adapter``): its layers pin
their host buffers, which needs CUDA.

Use: call :func:`prepare` before anything imports ``sglang``, and build the backend with
:func:`backend_kwargs` and the engine with :func:`engine_kwargs`.  All do nothing where
``torch.cuda.is_available()`` (``prepare`` returns False, the others ``{}``).  ``tests/sglang_real`` runs the real engine through it.
"""

from __future__ import annotations

import os
import sys

#: the directory put first on PYTHONPATH (and sys.path): the stand-in ``sgl_kernel`` and the
#: ``sitecustomize`` that mends the spawned schedulers
PYTHONPATH_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "pythonpath")
#: set in the environment by prepare(): the spawned interpreters apply the mends
ENV_FLAG = "MEGARL_SGLANG_CPU"


def needed() -> bool:
    """Whether this process has no CUDA device (the mends apply)."""
    import torch

    return not torch.cuda.is_available()


def prepare() -> bool:
    """Ready this process (and the schedulers it will spawn) for SGLang's CPU engine.  Returns
    whether it did anything (False where CUDA exists).  Must run before ``sglang`` is imported:
    SGLang reads ``SGLANG_USE_CPU_ENGINE`` when its modules load."""
    if not needed():
        return False
    if os.environ.get(ENV_FLAG) == "1" and PYTHONPATH_DIR in sys.path:
        return True
    if any(m == "sglang" or m.startswith("sglang.") for m in sys.modules):
        raise RuntimeError("megarl.rollout.sglang_cpu.prepare() must run before sglang is imported: SGLang "
                           "reads SGLANG_USE_CPU_ENGINE when its modules load")
    os.environ["SGLANG_USE_CPU_ENGINE"] = "1"
    os.environ[ENV_FLAG] = "1"
    parts = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and p != PYTHONPATH_DIR]
    os.environ["PYTHONPATH"] = os.pathsep.join([PYTHONPATH_DIR, *parts])
    if PYTHONPATH_DIR not in sys.path:
        sys.path.insert(0, PYTHONPATH_DIR)
    from megarl.rollout.sglang_cpu.mends import install

    install()
    return True


def backend_kwargs() -> dict:
    """What megarl's ``SGLangRolloutEngine`` takes on CPU (``{}`` where CUDA exists): tensors staged
    on the CPU, and fp32 (the CPU actor's dtype, so the log-prob parity check compares like with
    like)."""
    if not needed():
        return {}
    return {"device": "cpu", "dtype": "float32"}


def engine_kwargs(max_total_tokens: int = 4096) -> dict:
    """The ``ServerArgs`` of SGLang's CPU engine (``{}`` where CUDA exists): the CPU device,
    pure-torch attention, no CUDA graphs, no memory saver (its hook library needs
    ``libcuda``), and a KV cache of ``max_total_tokens`` tokens (SGLang would size it from the
    free host memory)."""
    if not needed():
        return {}
    return {"device": "cpu", "attention_backend": "torch_native", "disable_cuda_graph": True,
            "enable_memory_saver": False, "max_total_tokens": int(max_total_tokens)}


def lora_engine_kwargs() -> dict:
    """SGLang's LoRA backend on CPU (``{}`` where CUDA exists: SGLang's default there): the
    torch-native one, its pinned host buffers plain host memory (the mend in :mod:`.mends`)."""
    if not needed():
        return {}
    return {"lora_backend": "torch_native"}
