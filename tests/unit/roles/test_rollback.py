"""UpdateSnapshot: a failed update's partial steps are undone bitwise (params, optimizer state,
state created by the failed update removed), so the retried update equals an update that never
failed."""

import pytest
import torch

from megarl.models.optim import train_step
from megarl.roles.rollback import RollbackError, UpdateSnapshot
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


def _poisoned_step(ddp, opt, loss_fn, seed):
    """A step whose loss is NaN: megatron applies NaN gradients (no grad scaler in fp32)."""
    def nan_loss(output, mb):
        loss, m = loss_fn(output, mb)
        return loss * float("nan"), m
    res = train_step(ddp, opt, make_batch(seed), nan_loss)
    assert not torch.isfinite(torch.tensor(res.grad_norm))
    return res


@pytest.mark.parametrize("steps_before", [0, 2], ids=["before-first-step", "with-adam-state"])
def test_restore_undoes_a_failed_update_bitwise(hf, steps_before):
    a_ddp, a_opt, a_loss = make_actor(hf)
    b_ddp, b_opt, b_loss = make_actor(hf)
    for s in range(steps_before):
        good_step(a_ddp, a_opt, a_loss, seed=s)
        good_step(b_ddp, b_opt, b_loss, seed=s)
    snap = UpdateSnapshot()
    nbytes = snap.take(a_ddp, a_opt, None, steps=steps_before)
    assert nbytes >= sum(p.numel() * 4 for p in a_ddp.parameters())
    # the failed update: one good step, then a step that writes NaN into weights and moments
    good_step(a_ddp, a_opt, a_loss, seed=10)
    _poisoned_step(a_ddp, a_opt, a_loss, seed=11)
    assert any(not torch.isfinite(p).all() for p in a_ddp.parameters())
    garbage = churn_memory()
    assert snap.restore(a_ddp, a_opt, None) == steps_before
    del garbage
    assert_same(params_copy(a_ddp), params_copy(b_ddp), "params after restore")
    assert_same(opt_state_copy(a_opt), opt_state_copy(b_opt), "optimizer state after restore")
    # the retried update is the update that never failed
    for s in (10, 11):
        good_step(a_ddp, a_opt, a_loss, seed=s)
        good_step(b_ddp, b_opt, b_loss, seed=s)
    assert_same(params_copy(a_ddp), params_copy(b_ddp), "params after the retried update")
    assert_same(opt_state_copy(a_opt), opt_state_copy(b_opt), "optimizer state after the retried update")


def test_restore_needs_a_snapshot(hf):
    ddp, opt, _ = make_actor(hf)
    with pytest.raises(RollbackError, match="without a snapshot"):
        UpdateSnapshot().restore(ddp, opt, None)
