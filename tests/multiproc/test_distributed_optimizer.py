"""megatron's distributed optimizer (ZeRO-1) on CPU over gloo: what the GPU default runs, proven
here.  Two DP=2 Adam steps equal the plain optimizer's bitwise; a checkpoint it writes (the
``fully_reshardable`` format, megarl/checkpointing/checkpoint.py) resumes bitwise at DP=2 and within
fp32 rounding at DP=1.  The CPU accommodations it needs (megarl/runtime/cpu_compat.py) are each
checked to still be needed, so a megatron-core that fixes them says so."""

from __future__ import annotations

import inspect

import pytest
import torch

from tests._dist import torchrun
from tests._tolerance import adam_weights_tol, formula_tol, within


@pytest.fixture(scope="module")
def hf(tmp_path_factory):
    from megarl.builtin.tiny_checkpoint import make_tiny_hf_checkpoint

    return make_tiny_hf_checkpoint(str(tmp_path_factory.mktemp("distopt") / "llama"), "llama", seed=3,
                                   vocab_size=300)


def _load(path):
    return torch.load(path, weights_only=False)


def test_two_dp2_steps_equal_the_plain_optimizers(hf, tmp_path):
    out = str(tmp_path / "steps.pt")
    torchrun("distopt_worker.py", 2, "--hf", hf, "--out", out, "--mode", "steps")
    got = _load(out)
    plain, dist = got["plain"], got["dist"]
    assert plain["optimizers"] == ["FP32Optimizer"] and dist["optimizers"] == ["DistributedOptimizer"]
    # the same elementwise Adam on each shard, the same gradient sums (two ranks: a + b either way)
    for name, w in plain["weights"].items():
        assert torch.equal(w, dist["weights"][name]), name
    # the grad norm is the one reduction done in another grouping (per shard, then over ranks)
    n = sum(w.numel() for w in plain["weights"].values())
    for a, b in zip(plain["grad_norms"], dist["grad_norms"], strict=True):
        assert within(abs(a * a - b * b), formula_tol(torch.float32, ops=n, scale=a * a), "distopt/grad_norm_sq")


def test_a_checkpoint_resumes_bitwise_at_dp2_and_at_dp1(hf, tmp_path):
    """Saved after one DP=2 step, then a second step: loading it (every file's sha256 verified)
    and taking the second step again gives the same weights, bitwise at DP=2; at DP=1 the state
    is resliced and the gradient sums run in another order (four micro-batches on one rank)."""
    ckpt = tmp_path / "ck" / "iter_000001"
    ckpt.parent.mkdir()
    ref = str(tmp_path / "save.pt")
    torchrun("distopt_worker.py", 2, "--hf", hf, "--out", ref, "--mode", "save", "--ckpt", str(ckpt))
    want = _load(ref)["weights"]
    for dp in (2, 1):
        out = str(tmp_path / f"resume{dp}.pt")
        torchrun("distopt_worker.py", dp, "--hf", hf, "--out", out, "--mode", "resume", "--ckpt", str(ckpt))
        got = _load(out)
        assert got["optimizers"] == ["DistributedOptimizer"]
        if dp == 2:
            for name, w in want.items():
                assert torch.equal(w, got["weights"][name]), name
        else:
            err = max(float((w - got["weights"][k]).abs().max()) for k, w in want.items())
            assert within(err, adam_weights_tol(lr=1e-2, steps=1, grad_scale=1.0), "distopt/resume_dp1"), err


def test_the_cpu_accommodations_are_still_needed():
    """Each of megatron-core's CPU / torch-optimizer gaps the accommodations route around is still
    in its source (else the accommodation can go)."""
    from megatron.core.optimizer import distrib_optimizer as d

    src = inspect.getsource(d)  # the module's file: the originals, whatever install() rebound
    # parameters are sorted by their CUDA type name (Tensor.type() rewritten on CPU)
    assert "elif model_param.type() == 'torch.cuda.FloatTensor':" in src
    # a torch optimizer without state has no per-parameter step (prepare_optimizer_for_load)
    assert "assert len(steps) == 1" in src and 'steps = list(set([s["step"].item()' in src
    # one step tensor for every parameter, and every state key copied from the loaded tensors
    # (_patch_distributed_optimizer_step_state)
    assert 's["step"] = step' in src and "dst_tensors[key].copy_(tensors[key])" in src
    # the default sharding format is one megatron's own dist_checkpointing refuses
    assert "'distrib_optim_sharding_type', 'fully_sharded_model_space'" in src
    # the loss scaler moves its restored scale to the current CUDA device (an entry point of the
    # device-rewriting mode: megarl.models.optim.load_grad_scaler_states calls it)
    from megatron.core.optimizer.grad_scaler import DynamicGradScaler

    from megarl.runtime.cpu_compat import ENTRY_POINTS

    assert ".cuda(torch.cuda.current_device())" in inspect.getsource(DynamicGradScaler.load_state_dict)
    assert ("megatron.core.optimizer.grad_scaler", "DynamicGradScaler.load_state_dict") in ENTRY_POINTS


def test_fp16_loss_scaler_survives_a_rollback_and_a_checkpoint(hf, tmp_path):
    """fp16 through megatron's Float16 optimizer (tests/workers/grad_scaler_worker.py): the
    dynamic loss scaler's state is golden after the overflows before the first successful step
    (2**32 halved once per overflow after the first, hysteresis 2); an update rollback puts it
    back (megatron's ChainedOptimizer has no ``grad_scaler`` of its own: the snapshot reads each
    chained optimizer's); a checkpoint saves it per rank beside the optimizer state and a resume
    restores it, so the next step equals the uninterrupted run's bitwise at DP=2, and at DP=1 the
    one state all saved ranks agree on.  Negative control: the same resume with the scaler reset
    to a fresh one's (2**32, what a resume that lost it runs with) overflows and skips the step,
    and the weights differ.  A checkpoint without the scaler file, or whose file disagrees with
    the optimizer state, is refused naming the file."""
    ckpt = tmp_path / "ck" / "iter_000001"
    ckpt.parent.mkdir()
    out = str(tmp_path / "save.pt")
    torchrun("grad_scaler_worker.py", 2, "--hf", hf, "--out", out, "--mode", "save", "--ckpt", str(ckpt))
    got = _load(out)
    (fresh,) = got["fresh"]
    assert fresh == {"kind": "DynamicGradScaler", "scale": 2.0 ** 32, "growth_tracker": 0, "hysteresis_tracker": 2}
    n = got["overflows"]
    assert n >= 2, n  # fp16 at 2**32 overflows: the scaler had work to do
    (first,) = got["first_success"]
    assert first == dict(fresh, scale=2.0 ** 32 * 0.5 ** (n - 1), growth_tracker=1, hysteresis_tracker=2 - n)
    assert got["after_overflow"][0]["scale"] == first["scale"] / 2  # the overflow moved it...
    assert got["after_rollback"] == [first]  # ...and the rollback put it back
    assert got["saved_file"] == {"per_rank": [[first], [first]]}
    assert got["uninterrupted_ok"] and got["resumed_ok"] and got["resumed_scalers"] == [first]
    for name, w in got["uninterrupted"].items():
        assert torch.equal(w, got["resumed"][name]), name
    # negative control: a resume that lost the scaler overflows at 2**32 and skips the step
    assert not got["lost_ok"]
    assert any(not torch.equal(w, got["lost"][name]) for name, w in got["uninterrupted"].items())
    per_rank = got["refused_per_rank"]
    assert all("actor_grad_scaler.json: missing" in r["refused_missing"] for r in per_rank), per_rank
    assert "the checkpoint's two records disagree" in per_rank[-1]["refused_edited"], per_rank
    one = _load(_resume_dp1(hf, ckpt, tmp_path))
    assert one["resumed_scalers"] == [first] and one["resumed_ok"]


def _resume_dp1(hf, ckpt, tmp_path) -> str:
    out = str(tmp_path / "resume1.pt")
    torchrun("grad_scaler_worker.py", 1, "--hf", hf, "--out", out, "--mode", "resume", "--ckpt", str(ckpt))
    return out
