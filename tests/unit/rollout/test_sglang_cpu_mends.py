"""megarl/rollout/sglang_cpu without SGLang: what prepare() does to a process and to the
interpreters it spawns (tests/sglang_real runs the mends against the real engine)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import types

import pytest

from megarl.rollout import sglang_cpu
from megarl.rollout.sglang_cpu import mends
from tests._dist import ROOT

PREPARED = r"""
import json, os, subprocess, sys
from megarl.rollout import sglang_cpu
assert sglang_cpu.prepare() is True and sglang_cpu.prepare() is True   # idempotent
out = {"env": {k: os.environ.get(k) for k in ("SGLANG_USE_CPU_ENGINE", "MEGARL_SGLANG_CPU")},
       "pythonpath_first": os.environ["PYTHONPATH"].split(os.pathsep)[0]}
try:
    import flash_mla
    out["flash_mla"] = "imported"
except ImportError as e:
    out["flash_mla"] = str(e)
import sgl_kernel
out["stand_in"] = sgl_kernel.STAND_IN
import torch
out["device_module"] = torch.get_device_module().__name__
# a spawned interpreter with nothing of megarl on its path: the sitecustomize mends it
child = subprocess.run([sys.executable, "-c", "import torch; print(torch.get_device_module().__name__, "
                        "getattr(torch.get_device_module, '__megarl_mend__', False))"],
                       capture_output=True, text=True, cwd="/", env=dict(os.environ, PYTHONPATH=out["pythonpath_first"]))
out["child"] = (child.returncode, child.stdout.strip(), child.stderr[-500:])
print(json.dumps(out))
"""


def test_prepare_readies_this_process_and_the_interpreters_it_spawns():
    env = {k: v for k, v in os.environ.items() if k not in ("SGLANG_USE_CPU_ENGINE", "MEGARL_SGLANG_CPU")}
    env["PYTHONPATH"] = ROOT
    proc = subprocess.run([sys.executable, "-c", PREPARED], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["env"] == {"SGLANG_USE_CPU_ENGINE": "1", "MEGARL_SGLANG_CPU": "1"}
    assert out["pythonpath_first"] == sglang_cpu.PYTHONPATH_DIR
    assert "CUDA kernel package" in out["flash_mla"]  # absent, as ImportError: megatron-core's except catches it
    assert out["stand_in"] is True
    assert out["device_module"] == "torch.cpu"
    assert tuple(out["child"][:2]) == (0, "torch.cpu True"), out["child"]
    # negative control: without the flag the same child is not mended (a CUDA build of torch would
    # answer torch.cuda there; a CPU build answers torch.cpu anyway, so only the flag is checked)
    plain = subprocess.run([sys.executable, "-c", "import sys; print('megarl_sglang_cpu_mends' in sys.modules)"],
                           capture_output=True, text=True, cwd="/",
                           env=dict(env, PYTHONPATH=sglang_cpu.PYTHONPATH_DIR), timeout=120)
    assert plain.stdout.strip() == "False"


def test_prepare_refuses_once_sglang_is_imported():
    code = ("import sys, types; sys.modules['sglang'] = types.ModuleType('sglang')\n"
            "from megarl.rollout import sglang_cpu\n"
            "try:\n    sglang_cpu.prepare()\nexcept RuntimeError as e:\n    print('refused:', e)\n")
    env = {k: v for k, v in os.environ.items() if k not in ("SGLANG_USE_CPU_ENGINE", "MEGARL_SGLANG_CPU")}
    env["PYTHONPATH"] = ROOT
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert "refused:" in proc.stdout and "before sglang is imported" in proc.stdout, proc.stdout + proc.stderr


def test_a_mend_whose_target_moved_fails_naming_it():
    with pytest.raises(mends.AccommodationError, match="_cuda_host_register is gone"):
        mends._mend_host_register(types.SimpleNamespace())
    with pytest.raises(mends.AccommodationError, match="get_device_module"):
        mends._mend_device_module(types.SimpleNamespace(__version__="0"))


def test_the_stand_in_kernel_and_the_cpu_server_args():
    sys.path.insert(0, sglang_cpu.PYTHONPATH_DIR)
    try:
        import importlib

        sgl_kernel = importlib.import_module("sgl_kernel")
    finally:
        sys.path.remove(sglang_cpu.PYTHONPATH_DIR)
    import torch

    assert sgl_kernel.STAND_IN
    table = torch.zeros(2, 4, dtype=torch.int64)
    sgl_kernel.assign_req_to_token_pool_cpu(torch.tensor([1, 0]), table, torch.tensor([0, 2]), torch.tensor([2, 4]),
                                            torch.tensor([5, 6, 7, 8]), 4)
    assert torch.equal(table, torch.tensor([[0, 0, 7, 8], [5, 6, 0, 0]]))
    with pytest.raises(NotImplementedError, match="rotate_input_ids_cpu"):
        sgl_kernel.rotate_input_ids_cpu()
    assert sglang_cpu.backend_kwargs() == {"device": "cpu", "dtype": "float32"}
    kw = sglang_cpu.engine_kwargs(2048)
    assert kw == {"device": "cpu", "attention_backend": "torch_native", "disable_cuda_graph": True,
                  "enable_memory_saver": False, "max_total_tokens": 2048}


def test_the_lora_mend_gives_plain_host_memory_for_pinned_requests():
    """SGLang's LoRA layers ask torch for pinned host buffers, which needs CUDA: on CPU the mended
    module's ``torch`` gives plain ones (same values), ``Tensor.pin_memory()`` returns the tensor;
    a module that no longer holds ``torch`` as a global fails naming itself."""
    import torch

    with pytest.raises(mends.AccommodationError, match="sglang.srt.lora.layers no longer imports torch"):
        mends._mend_lora_pinned(types.SimpleNamespace(__name__="sglang.srt.lora.layers"))
    module = types.SimpleNamespace(__name__="sglang.srt.lora.layers", torch=torch)
    original = torch.Tensor.pin_memory
    try:
        if not torch.cuda.is_available():  # negative control: unmended, the request fails without CUDA
            with pytest.raises(RuntimeError):
                torch.tensor([0, 3], dtype=torch.int32, pin_memory=True)
        mends._mend_lora_pinned(module)
        mends._mend_lora_pinned(module)  # idempotent
        t = module.torch.tensor([0, 3], dtype=torch.int32, device="cpu", pin_memory=True)
        assert torch.equal(t, torch.tensor([0, 3], dtype=torch.int32))
        assert module.torch.empty((2,), pin_memory=True).shape == (2,)
        assert module.torch.int32 is torch.int32  # everything else is torch's own
        if not torch.cuda.is_available():
            assert t.pin_memory() is t
    finally:
        torch.Tensor.pin_memory = getattr(torch.Tensor.pin_memory, "__wrapped__", original)
    assert torch.Tensor.pin_memory is original
    assert sglang_cpu.lora_engine_kwargs() == ({} if torch.cuda.is_available() else {"lora_backend": "torch_native"})
