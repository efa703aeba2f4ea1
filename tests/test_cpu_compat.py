"""The CPU accommodations for megatron-core (megarl/runtime/cpu_compat.py) are pinned to the
megatron-core surface they patch: if an upgrade moves it, these tests fail loudly."""

import inspect
import subprocess
import sys

import pytest

from megarl.runtime import cpu_compat


def test_megatron_core_version_is_verified():
    v = cpu_compat.megatron_core_version()
    assert v.startswith(cpu_compat.VERIFIED_MEGATRON_CORE), (
        f"megatron-core {v}: re-verify megarl/runtime/cpu_compat.py and update VERIFIED_MEGATRON_CORE")


def test_patched_surfaces_still_exist():
    from megatron.core import tensor_parallel
    from megatron.core.distributed import finalize_model_grads
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
    from megatron.core.optimizer import clip_grads, optimizer
    from megatron.core.pipeline_parallel import schedules

    # the CUDA-only assert we route around is still there (else the patch can go)
    src = inspect.getsource(clip_grads.clip_grad_by_total_norm_fp32) if not cpu_compat._INSTALLED \
        else inspect.getsource(sys.modules["megatron.core.optimizer.clip_grads"])
    assert "torch.cuda.FloatTensor" in src
    assert hasattr(optimizer, "clip_grad_by_total_norm_fp32")
    assert "inference_rng_tracker" in inspect.signature(
        tensor_parallel.random.initialize_rng_tracker).parameters
    assert "num_tokens" in inspect.signature(finalize_model_grads).parameters
    params = inspect.signature(RotaryEmbedding._apply_scaling).parameters
    for k in ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"):
        assert k in params, k
    # the loss contract relies on the 3-tuple path not rescaling under calculate_per_token_loss
    src = inspect.getsource(schedules.forward_step_calc_loss)
    assert "if not config.calculate_per_token_loss" in src
    # megatron still hard-codes device="cuda" in the schedules: the device rewrite is needed
    assert 'device="cuda"' in inspect.getsource(schedules)


def test_install_is_inert_when_cuda_is_present():
    code = (
        "import torch\n"
        "torch.cuda.is_available = lambda: True\n"
        "orig = torch.cuda.current_device\n"
        "from megarl.runtime import cpu_compat\n"
        "assert cpu_compat.install() is False\n"
        "assert torch.cuda.current_device is orig\n"
        "assert not cpu_compat._INSTALLED\n"
        "print('inert')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0 and "inert" in out.stdout, out.stderr


@pytest.mark.skipif(not cpu_compat.on_cpu(), reason="the CPU path is only exercised without CUDA")
def test_cuda_device_literals_land_on_cpu():
    import torch

    cpu_compat.install()
    assert torch.zeros(2, device="cuda").device.type == "cpu"
    assert torch.ones(1).cuda().device.type == "cpu"
    assert torch.cuda.current_device() == "cpu"


@pytest.mark.skipif(not cpu_compat.on_cpu(),
                    reason="with CUDA no device-rewriting mode is installed, so there is nothing to lift "
                           "(install() being inert on CUDA is tested above)")
def test_device_rewrite_is_lifted_only_inside_the_block():
    import torch
    from torch.overrides import TorchFunctionMode

    cpu_compat.install()
    with cpu_compat.without_device_rewrite():
        with pytest.raises((RuntimeError, AssertionError)):  # no CUDA here: the literal is real again
            torch.zeros(2, device="cuda")
    assert torch.zeros(2, device="cuda").device.type == "cpu"
    with pytest.raises(ValueError):
        with cpu_compat.without_device_rewrite():
            raise ValueError("the mode comes back on the way out of an error too")
    assert torch.zeros(2, device="cuda").device.type == "cpu"

    class Counting(TorchFunctionMode):
        calls = 0

        def __torch_function__(self, func, types, args=(), kwargs=None):
            Counting.calls += 1
            return func(*args, **(kwargs or {}))

    with Counting():  # another mode above ours: the block keeps both rather than pull ours out
        with cpu_compat.without_device_rewrite():
            assert torch.zeros(2, device="cuda").device.type == "cpu"
    assert Counting.calls >= 1
    assert torch.zeros(2, device="cuda").device.type == "cpu"
