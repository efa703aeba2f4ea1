"""Time-slicing (DESIGN.md): actor/reference offload round trips and per-phase peak memory.

On CPU the "device" is the CPU: offload copies each storage to a separate host buffer and frees
the original (``untyped_storage().nbytes() == 0``), which is what these tests check; pinned
memory and CUDA memory stats only run on a GPU machine.
"""

import pytest
import torch

from megarl.models.forward import token_log_probs_from_logits
from megarl.models.megatron_ckpt import load_model
from megarl.models.optim import OptimConfig, train_step, wrap_for_training
from megarl.models.tiny import make_tiny_hf_checkpoint
from megarl.roles.offload import (
    ActorOffloader,
    OffloadStateError,
    PhaseMemoryTracker,
    ReferenceOffloader,
)

ADAM = OptimConfig(optimizer="adam", lr=1e-3, weight_decay=0.1, clip_grad=0.05)


@pytest.fixture(scope="module")
def hf(tmp_path_factory, megatron_world):
    return make_tiny_hf_checkpoint(str(tmp_path_factory.mktemp("offload") / "llama"), "llama",
                                   seed=3, vocab_size=300)


def _batch(seed):
    g = torch.Generator().manual_seed(seed)
    B, S = 4, 11
    tokens = torch.randint(0, 250, (B, S), generator=g)
    lengths = torch.randint(4, S + 1, (B,), generator=g)
    mask = (torch.arange(S - 1)[None, :] < (lengths[:, None] - 1)).float()
    return [{"tokens": tokens[i:i + 2], "loss_mask": mask[i:i + 2], "norm": mask.sum()}
            for i in range(0, B, 2)]


def _loss_fn(vocab):
    def loss_fn(output, mb):
        lp = token_log_probs_from_logits(output[:, :-1], mb["tokens"][:, 1:], vocab)
        loss = -(lp * mb["loss_mask"]).sum() / mb["norm"]
        return loss, {"loss": loss.detach()}
    return loss_fn


def _actor(hf, cfg=ADAM):
    model = load_model(hf)
    ddp, opt = wrap_for_training(model, cfg)
    return ddp, opt, _loss_fn(model.megarl_spec.vocab_size)


def _step(ddp, opt, loss_fn, seed):
    res = train_step(ddp, opt, _batch(seed), loss_fn)
    assert res.update_successful
    return res


def _params(m):
    return {n: p.detach().clone() for n, p in m.named_parameters()}


def _opt_state(opt):
    inner = [o.optimizer for o in opt.chained_optimizers]
    return [{k: v.clone() for k, v in st.items()} for o in inner for st in o.state.values()]


def _churn():
    """Reuse freed memory with garbage, so a restore that copies nothing cannot pass by luck."""
    return [torch.full((n,), float("nan")) for n in (1 << 10, 1 << 14, 1 << 17, 1 << 20)]


def _assert_same(a, b, what):
    assert a.keys() == b.keys() if isinstance(a, dict) else len(a) == len(b)
    items = a.items() if isinstance(a, dict) else enumerate(a)
    for k, v in items:
        w = b[k]
        if isinstance(v, dict):
            _assert_same(v, w, f"{what}[{k}]")
        else:
            assert torch.equal(v, w), f"{what}[{k}] differs after the round trip"


def test_actor_round_trip_releases_storage(hf):
    ddp, opt, loss_fn = _actor(hf)
    _step(ddp, opt, loss_fn, seed=1)  # optimizer state and gradients exist from here on
    buf = ddp.buffers[0]
    params, grads, state = _params(ddp), buf.grad_data.clone(), _opt_state(opt)
    assert grads.abs().sum() > 0 and state and all("exp_avg_sq" in s for s in state)

    off = ActorOffloader(ddp, opt)
    moved = off.offload()
    assert off.is_offloaded
    n_param_bytes = sum(p.numel() * p.element_size() for p in ddp.parameters())
    n_state_bytes = sum(v.numel() * v.element_size() for s in state for v in s.values())
    assert moved == {"params": n_param_bytes, "grads": buf.grad_data.numel() * 4,
                     "optimizer": n_state_bytes}
    # every byte of every kind was released, views included
    assert all(p.untyped_storage().nbytes() == 0 for p in ddp.parameters())
    assert all(p.main_grad.untyped_storage().nbytes() == 0 for p in ddp.parameters())
    assert buf.grad_data.untyped_storage().nbytes() == 0
    inner = opt.chained_optimizers[0].optimizer
    assert all(v.untyped_storage().nbytes() == 0 for s in inner.state.values() for v in s.values())
    assert off.host_bytes() >= sum(moved.values())
    garbage = _churn()

    off.onload()
    assert not off.is_offloaded
    _assert_same(_params(ddp), params, "param")
    assert torch.equal(buf.grad_data, grads)
    _assert_same(_opt_state(opt), state, "optimizer state")
    # views are still views: main_grad points into the one grad buffer again
    gptr = buf.grad_data.untyped_storage().data_ptr()
    assert all(p.main_grad.untyped_storage().data_ptr() == gptr for p in ddp.parameters())
    del garbage

    # a second cycle reuses the host buffers and round-trips again
    host = off.host_bytes()
    off.offload()
    off.onload()
    assert off.host_bytes() == host
    _assert_same(_params(ddp), params, "param (2nd cycle)")


def test_dropped_grads_come_back_zero_and_kinds_are_independent(hf):
    ddp, opt, loss_fn = _actor(hf)
    _step(ddp, opt, loss_fn, seed=1)
    buf = ddp.buffers[0]
    params, state = _params(ddp), _opt_state(opt)

    off = ActorOffloader(ddp, opt, preserve_grads=False)
    moved = off.offload()
    assert buf.grad_data.untyped_storage().nbytes() == 0 and moved["grads"] > 0
    off.onload()
    assert buf.grad_data.abs().sum() == 0, "preserve_grads=False: grads come back zeroed"
    _assert_same(_params(ddp), params, "param")

    # optimizer only: FP32Optimizer's params *are* the model params and must stay put
    off = ActorOffloader(ddp, opt, offload_params=False, offload_grads=False)
    moved = off.offload()
    assert moved["params"] == moved["grads"] == 0 and moved["optimizer"] > 0
    assert all(p.untyped_storage().nbytes() > 0 for p in ddp.parameters())
    assert buf.grad_data.untyped_storage().nbytes() > 0
    off.onload()
    _assert_same(_opt_state(opt), state, "optimizer state")


@pytest.mark.parametrize("preserve_grads", [True, False])
def test_train_step_after_round_trip_is_bitwise_identical(hf, preserve_grads):
    ddp_a, opt_a, loss_a = _actor(hf)
    ddp_b, opt_b, loss_b = _actor(hf)
    start = _params(ddp_a)
    for ddp, opt, loss in ((ddp_a, opt_a, loss_a), (ddp_b, opt_b, loss_b)):
        _step(ddp, opt, loss, seed=1)
    off = ActorOffloader(ddp_a, opt_a, preserve_grads=preserve_grads)
    with off.offloaded():
        assert all(p.untyped_storage().nbytes() == 0 for p in ddp_a.parameters())
        garbage = _churn()
    del garbage
    res_a = _step(ddp_a, opt_a, loss_a, seed=2)
    res_b = _step(ddp_b, opt_b, loss_b, seed=2)
    assert res_a.grad_norm == res_b.grad_norm
    assert [m["loss"].item() for m in res_a.metrics] == [m["loss"].item() for m in res_b.metrics]
    got, ref = _params(ddp_a), _params(ddp_b)
    moved = max((ref[k] - start[k]).abs().max().item() for k in ref)
    assert moved > 1e-4, "the steps did not change the weights; the comparison would be vacuous"
    _assert_same(got, ref, "updated weight")
    _assert_same(_opt_state(opt_a), _opt_state(opt_b), "optimizer state")


def test_distributed_optimizer_param_buffer_round_trip(hf):
    """With the distributed optimizer DDP re-maps every param into ``buffer.param_data``; the
    buffer moves as one storage and the param views stay views (no optimizer: megatron's
    DistributedOptimizer needs CUDA)."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    model = load_model(hf)
    ddp = DistributedDataParallel(
        config=model.config, module=model,
        ddp_config=DistributedDataParallelConfig(grad_reduce_in_fp32=True, average_in_collective=False,
                                                 use_distributed_optimizer=True))
    buf = ddp.buffers[0]
    assert buf.param_data is not None
    pptr = buf.param_data.untyped_storage().data_ptr()
    assert all(p.untyped_storage().data_ptr() == pptr for p in ddp.parameters())
    tokens = _batch(5)[0]["tokens"]
    from megarl.models.forward import full_logits
    before, params = full_logits(ddp, tokens), _params(ddp)

    with pytest.raises(ValueError, match="offload_optimizer=True needs the optimizer"):
        ActorOffloader(ddp, None)
    off = ActorOffloader(ddp, None, offload_optimizer=False)
    moved = off.offload()
    assert moved["params"] == buf.param_data.numel() * buf.param_data.element_size()
    assert buf.param_data.untyped_storage().nbytes() == 0
    assert all(p.untyped_storage().nbytes() == 0 for p in ddp.parameters())
    garbage = _churn()
    off.onload()
    del garbage
    pptr = buf.param_data.untyped_storage().data_ptr()
    assert all(p.untyped_storage().data_ptr() == pptr for p in ddp.parameters())
    _assert_same(_params(ddp), params, "param")
    assert torch.equal(full_logits(ddp, tokens), before)


def test_reference_lives_on_host_between_forwards(hf):
    from megarl.models.forward import full_logits

    model = load_model(hf)
    tokens = _batch(5)[0]["tokens"]
    before, params = full_logits(model, tokens), _params(model)
    ref = ReferenceOffloader(model)
    n = ref.offload()
    assert n == sum(p.numel() * p.element_size() for p in model.parameters())
    assert all(p.untyped_storage().nbytes() == 0 for p in model.parameters())
    with pytest.raises(RuntimeError):  # a forward while offloaded fails loudly
        full_logits(model, tokens)
    garbage = _churn()
    for _ in range(2):
        with ref.on_device():
            assert not ref.is_offloaded
            assert torch.equal(full_logits(model, tokens), before)
        assert ref.is_offloaded
        assert all(p.untyped_storage().nbytes() == 0 for p in model.parameters())
    del garbage
    ref.onload()
    _assert_same(_params(model), params, "reference param")


def test_double_offload_and_onload_raise(hf):
    ddp, opt, loss_fn = _actor(hf)
    _step(ddp, opt, loss_fn, seed=1)
    params = _params(ddp)
    off = ActorOffloader(ddp, opt)
    with pytest.raises(OffloadStateError, match="not offloaded; call offload"):
        off.onload()
    off.offload()
    with pytest.raises(OffloadStateError, match="already offloaded; call onload"):
        off.offload()
    assert off.is_offloaded
    with pytest.raises(OffloadStateError, match="offloaded; its only copy"):
        off.release_host_buffers()
    off.onload()  # the refused calls changed nothing
    _assert_same(_params(ddp), params, "param")
    with pytest.raises(OffloadStateError, match="not offloaded"):
        off.onload()

    # something else re-allocating an offloaded storage is caught, not silently overwritten
    off.offload()
    buf = ddp.buffers[0]
    buf.grad_data.untyped_storage().resize_(buf.grad_data.numel() * 4)
    with pytest.raises(OffloadStateError, match="re-allocated while offloaded"):
        off.onload()

    ref = ReferenceOffloader(load_model(hf))
    with pytest.raises(OffloadStateError, match="not offloaded"):
        ref.onload()
    ref.offload()
    with pytest.raises(OffloadStateError, match="already offloaded"):
        ref.offload()
    with pytest.raises(TypeError, match="use ActorOffloader"):
        ReferenceOffloader(ddp)


def test_phase_tracker_records_cpu_rss():
    tr = PhaseMemoryTracker()
    assert tr.device == "cpu-rss"
    with tr.phase("generate"):
        held = torch.ones(8 << 20)  # 32 MiB, touched, held past the phase
    with tr.phase("train"):
        pass
    with tr.phase("train"):
        pass
    r = tr.records
    assert set(r) == {"generate", "train"}
    g = r["generate"]
    assert g["device"] == "cpu-rss" and g["calls"] == 1 and g["seconds"] >= 0
    assert g["end_bytes"] - g["start_bytes"] >= 24 << 20
    assert g["peak_bytes"] >= max(g["start_bytes"], g["end_bytes"])
    assert r["train"]["calls"] == 2
    m = tr.as_metrics()
    assert m["mem/generate/device"] == "cpu-rss"
    assert m["mem/generate/peak_bytes"] == g["peak_bytes"]
    assert {"mem/train/seconds", "mem/train/start_bytes", "mem/train/end_bytes"} <= set(m)
    del held
    tr.reset()
    assert tr.records == {} and tr.as_metrics() == {}


class _FakeCuda:
    """The allocator counters the CUDA probe reads, driven by hand (resettable peak)."""
    device, resettable = "cuda", True

    def __init__(self):
        self.cur = self.hi = 0

    def alloc(self, n):
        self.cur += n
        self.hi = max(self.hi, self.cur)

    def sync(self):
        pass

    def current(self):
        return self.cur

    def peak(self):
        return self.hi

    def reset_peak(self):
        self.hi = self.cur


def test_phase_tracker_nested_peaks_with_resettable_counter():
    dev = _FakeCuda()
    tr = PhaseMemoryTracker(probe=dev)
    dev.alloc(100)
    with tr.phase("step"):
        dev.alloc(50)
        dev.alloc(-50)
        with tr.phase("ref_forward"):  # resets the peak; "step" must still see its own
            dev.alloc(30)
            dev.alloc(-30)
        dev.alloc(10)
    with tr.phase("ref_forward"):
        dev.alloc(5)
    r = tr.records
    assert r["step"] == {"device": "cuda", "peak_bytes": 150, "start_bytes": 100, "end_bytes": 110,
                         "peak_delta_bytes": 50, "seconds": r["step"]["seconds"], "calls": 1}
    assert r["ref_forward"]["peak_bytes"] == 130 and r["ref_forward"]["calls"] == 2
    assert r["ref_forward"]["start_bytes"] == 100 and r["ref_forward"]["end_bytes"] == 115
    assert r["ref_forward"]["peak_delta_bytes"] == 30
    with pytest.raises(ValueError, match="already active"):
        with tr.phase("x"):
            with tr.phase("x"):
                pass


def test_tp2_step_after_round_trip_matches(hf):
    """TP=2 (gloo, two processes): each rank's shard updates bitwise like without offloading."""
    from tests._dist import torchrun

    proc = torchrun("offload_worker.py", 2, "--tp", "2", "--hf", hf, timeout=300)
    assert "OFFLOAD_WORKER_OK" in proc.stdout
