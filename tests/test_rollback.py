"""UpdateSnapshot: a failed update's partial steps are undone bitwise (params, optimizer state,
state created by the failed update removed), so the retried update equals an update that never
failed."""

import pytest
import torch

from megarl.roles.rollback import RollbackError, UpdateSnapshot
from tests.test_offload import _actor, _assert_same, _batch, _churn, _opt_state, _params, _step, hf  # noqa: F401

from megarl.models.optim import train_step


def _poisoned_step(ddp, opt, loss_fn, seed):
    """A step whose loss is NaN: megatron applies NaN gradients (no grad scaler in fp32)."""
    def nan_loss(output, mb):
        loss, m = loss_fn(output, mb)
        return loss * float("nan"), m
    res = train_step(ddp, opt, _batch(seed), nan_loss)
    assert not torch.isfinite(torch.tensor(res.grad_norm))
    return res


@pytest.mark.parametrize("steps_before", [0, 2], ids=["before-first-step", "with-adam-state"])
def test_restore_undoes_a_failed_update_bitwise(hf, steps_before):  # noqa: F811
    a_ddp, a_opt, a_loss = _actor(hf)
    b_ddp, b_opt, b_loss = _actor(hf)
    for s in range(steps_before):
        _step(a_ddp, a_opt, a_loss, seed=s)
        _step(b_ddp, b_opt, b_loss, seed=s)
    snap = UpdateSnapshot()
    nbytes = snap.take(a_ddp, a_opt, None, steps=steps_before)
    assert nbytes >= sum(p.numel() * 4 for p in a_ddp.parameters())
    # the failed update: one good step, then a step that writes NaN into weights and moments
    _step(a_ddp, a_opt, a_loss, seed=10)
    _poisoned_step(a_ddp, a_opt, a_loss, seed=11)
    assert any(not torch.isfinite(p).all() for p in a_ddp.parameters())
    garbage = _churn()
    assert snap.restore(a_ddp, a_opt, None) == steps_before
    del garbage
    _assert_same(_params(a_ddp), _params(b_ddp), "params after restore")
    _assert_same(_opt_state(a_opt), _opt_state(b_opt), "optimizer state after restore")
    # the retried update is the update that never failed
    for s in (10, 11):
        _step(a_ddp, a_opt, a_loss, seed=s)
        _step(b_ddp, b_opt, b_loss, seed=s)
    _assert_same(_params(a_ddp), _params(b_ddp), "params after the retried update")
    _assert_same(_opt_state(a_opt), _opt_state(b_opt), "optimizer state after the retried update")


def test_restore_needs_a_snapshot(hf):  # noqa: F811
    ddp, opt, _ = _actor(hf)
    with pytest.raises(RollbackError, match="without a snapshot"):
        UpdateSnapshot().restore(ddp, opt, None)
