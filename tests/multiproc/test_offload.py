"""Time-slicing (docs/design.md): actor/reference offload round trips.

On CPU the "device" is the CPU: offload copies each storage to a separate host buffer and frees
the original (``untyped_storage().nbytes() == 0``), which is what these tests check; pinned
memory and CUDA memory stats only run on a GPU machine.
"""

import pytest
import torch

from megarl.models.megatron_ckpt import load_model
from megarl.roles.offload import (
    ActorOffloader,
    OffloadStateError,
    ReferenceOffloader,
)
from tests._tiny_actor import (
    assert_same,
    churn_memory,
    good_step,
    make_actor,
    make_batch,
    opt_state_copy,
    params_copy,
    hf,  # noqa: F401  (the module's tiny checkpoint fixture)
)


def test_actor_round_trip_releases_storage(hf):
    ddp, opt, loss_fn = make_actor(hf)
    good_step(ddp, opt, loss_fn, seed=1)  # optimizer state and gradients exist from here on
    buf = ddp.buffers[0]
    params, grads, state = params_copy(ddp), buf.grad_data.clone(), opt_state_copy(opt)
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
    garbage = churn_memory()

    off.onload()
    assert not off.is_offloaded
    assert_same(params_copy(ddp), params, "param")
    assert torch.equal(buf.grad_data, grads)
    assert_same(opt_state_copy(opt), state, "optimizer state")
    # views are still views: main_grad points into the one grad buffer again
    gptr = buf.grad_data.untyped_storage().data_ptr()
    assert all(p.main_grad.untyped_storage().data_ptr() == gptr for p in ddp.parameters())
    del garbage

    # a second cycle reuses the host buffers and round-trips again
    host = off.host_bytes()
    off.offload()
    off.onload()
    assert off.host_bytes() == host
    assert_same(params_copy(ddp), params, "param (2nd cycle)")


def test_dropped_grads_come_back_zero_and_kinds_are_independent(hf):
    ddp, opt, loss_fn = make_actor(hf)
    good_step(ddp, opt, loss_fn, seed=1)
    buf = ddp.buffers[0]
    params, state = params_copy(ddp), opt_state_copy(opt)

    off = ActorOffloader(ddp, opt, preserve_grads=False)
    moved = off.offload()
    assert buf.grad_data.untyped_storage().nbytes() == 0 and moved["grads"] > 0
    off.onload()
    assert buf.grad_data.abs().sum() == 0, "preserve_grads=False: grads come back zeroed"
    assert_same(params_copy(ddp), params, "param")

    # optimizer only: FP32Optimizer's params *are* the model params and must stay put
    off = ActorOffloader(ddp, opt, offload_params=False, offload_grads=False)
    moved = off.offload()
    assert moved["params"] == moved["grads"] == 0 and moved["optimizer"] > 0
    assert all(p.untyped_storage().nbytes() > 0 for p in ddp.parameters())
    assert buf.grad_data.untyped_storage().nbytes() > 0
    off.onload()
    assert_same(opt_state_copy(opt), state, "optimizer state")


@pytest.mark.parametrize("preserve_grads", [True, False])
def test_train_step_after_round_trip_is_bitwise_identical(hf, preserve_grads):
    ddp_a, opt_a, loss_a = make_actor(hf)
    ddp_b, opt_b, loss_b = make_actor(hf)
    start = params_copy(ddp_a)
    for ddp, opt, loss in ((ddp_a, opt_a, loss_a), (ddp_b, opt_b, loss_b)):
        good_step(ddp, opt, loss, seed=1)
    off = ActorOffloader(ddp_a, opt_a, preserve_grads=preserve_grads)
    with off.offloaded():
        assert all(p.untyped_storage().nbytes() == 0 for p in ddp_a.parameters())
        garbage = churn_memory()
    del garbage
    res_a = good_step(ddp_a, opt_a, loss_a, seed=2)
    res_b = good_step(ddp_b, opt_b, loss_b, seed=2)
    assert res_a.grad_norm == res_b.grad_norm
    assert [m["loss"].item() for m in res_a.metrics] == [m["loss"].item() for m in res_b.metrics]
    got, ref = params_copy(ddp_a), params_copy(ddp_b)
    moved = max((ref[k] - start[k]).abs().max().item() for k in ref)
    assert moved > 1e-4, "the steps did not change the weights; the comparison would be vacuous"
    assert_same(got, ref, "updated weight")
    assert_same(opt_state_copy(opt_a), opt_state_copy(opt_b), "optimizer state")


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
    tokens = make_batch(5)[0]["tokens"]
    from tests._logits import full_logits
    before, params = full_logits(ddp, tokens), params_copy(ddp)

    with pytest.raises(ValueError, match="offload_optimizer=True needs the optimizer"):
        ActorOffloader(ddp, None)
    off = ActorOffloader(ddp, None, offload_optimizer=False)
    moved = off.offload()
    assert moved["params"] == buf.param_data.numel() * buf.param_data.element_size()
    assert buf.param_data.untyped_storage().nbytes() == 0
    assert all(p.untyped_storage().nbytes() == 0 for p in ddp.parameters())
    garbage = churn_memory()
    off.onload()
    del garbage
    pptr = buf.param_data.untyped_storage().data_ptr()
    assert all(p.untyped_storage().data_ptr() == pptr for p in ddp.parameters())
    assert_same(params_copy(ddp), params, "param")
    assert torch.equal(full_logits(ddp, tokens), before)


def test_reference_lives_on_host_between_forwards(hf):
    from tests._logits import full_logits

    model = load_model(hf)
    tokens = make_batch(5)[0]["tokens"]
    before, params = full_logits(model, tokens), params_copy(model)
    ref = ReferenceOffloader(model)
    n = ref.offload()
    assert n == sum(p.numel() * p.element_size() for p in model.parameters())
    assert all(p.untyped_storage().nbytes() == 0 for p in model.parameters())
    with pytest.raises(RuntimeError):  # a forward while offloaded fails loudly
        full_logits(model, tokens)
    garbage = churn_memory()
    for _ in range(2):
        with ref.on_device():
            assert not ref.is_offloaded
            assert torch.equal(full_logits(model, tokens), before)
        assert ref.is_offloaded
        assert all(p.untyped_storage().nbytes() == 0 for p in model.parameters())
    del garbage
    ref.onload()
    assert_same(params_copy(model), params, "reference param")


def test_double_offload_and_onload_raise(hf):
    ddp, opt, loss_fn = make_actor(hf)
    good_step(ddp, opt, loss_fn, seed=1)
    params = params_copy(ddp)
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
    assert_same(params_copy(ddp), params, "param")
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


def test_tp2_step_after_round_trip_matches(hf):
    """TP=2 (gloo, two processes): each rank's shard updates bitwise like without offloading."""
    from tests._dist import torchrun

    proc = torchrun("offload_worker.py", 2, "--tp", "2", "--hf", hf, timeout=300)
    assert "OFFLOAD_WORKER_OK" in proc.stdout
