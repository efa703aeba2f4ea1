"""The normalisation contract: loss and gradient w.r.t. the log-prob inputs do not depend on the
micro-batch split, packing vs padding, or DP size; no gradient reaches a prompt or padding token."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.dist_algo_invariance import LOSS_CASES, case_config, norm_constant, ragged_batch, run_actor_loss
from megarl.algo.advantages import AdvantageConfig, AdvantageInputs, reinforce_plus_plus_advantage
from megarl.algo.aggregation import global_normaliser
from megarl.experience.packing import pack, pack_layout, unpack, unpack_response
from megarl.experience.schema import check_mask_layout
from tests._dist import ROOT, free_port
from tests._tolerance import formula_tol, within

# float64 throughout: the same formulas over another split of the rows (DP shards, packed rows)
# reorder the sums; <= 11 x 9 tokens, <= 1000 dependent operations, operand magnitudes summing to
# <= 1000: twice the first-order rounding bound (tests/_tolerance.py), ~2e-10
TOL = dict(atol=formula_tol(torch.float64, ops=1000, scale=1000.0), rtol=0)
BS = 11


def full_batch_loss_and_grad(batch, name, mode):
    cfg = case_config(name, mode)
    norm = global_normaliser(batch["response_mask"], mode, norm_constant=norm_constant(mode, batch))
    lp = batch["log_probs"].clone().requires_grad_(True)
    loss = run_actor_loss(batch, slice(None), lp, cfg, norm)
    loss.backward()
    return loss.detach(), lp.grad


@pytest.mark.parametrize("name,mode", LOSS_CASES)
def test_micro_batch_split_and_repadding_do_not_change_loss_or_grad(name, mode):
    batch = ragged_batch(11, bs=BS, dtype=torch.float32)
    ref_loss, ref_grad = full_batch_loss_and_grad(batch, name, mode)
    cfg = case_config(name, mode)
    narrowed = 0
    for cuts in ([0, 1, BS], [0, 3, 4, 8, BS], list(range(BS + 1))):
        mbs = [slice(a, b) for a, b in zip(cuts, cuts[1:])]
        # every micro-batch is re-padded to its own longest response (different padding widths)
        P = batch["prompt_len"]
        widths = [int(batch["attention_mask"][m, P:].sum(1).max()) for m in mbs]
        narrowed += sum(w < batch["response_mask"].shape[1] for w in widths)
        norm = global_normaliser([batch["response_mask"][m, :w] for m, w in zip(mbs, widths)], mode, norm_constant=norm_constant(mode, batch))
        lp = batch["log_probs"].clone().requires_grad_(True)
        total = torch.zeros(())
        for m, w in zip(mbs, widths):
            loss = run_actor_loss(batch, m, lp[m], cfg, norm, width=w)
            loss.backward()
            total += loss.detach()
        # float32: the same per-token terms summed per micro-batch and then over micro-batches,
        # against one sum: a reordered sum of <= 99 terms, each |term| <= 10 (|A| <= 3, clipped
        # ratios), so twice the bound is 2 * 99 * u32 * 10 * 99 / 99 ~ 1.2e-4 (a wrong normaliser
        # is off by >= 1e-2 relative); each gradient entry is the same few elementwise operations
        # on the same values over the same exact (integer-valued) normaliser: <= 20 operations on
        # magnitudes <= 10
        err = float((total - ref_loss).abs())
        assert within(err, formula_tol(torch.float32, ops=99, scale=10.0), f"algo_invariance/{name}/{mode}/loss"), err
        err = float((lp.grad - ref_grad).abs().max())
        assert within(err, formula_tol(torch.float32, ops=20, scale=10.0), f"algo_invariance/{name}/{mode}/grad"), err
    assert narrowed > 0  # some micro-batches really were padded differently


def _grad_from_full_sequence(batch, name, mode, packed: bool, prompt_shift: int = 0):
    """Loss through per-token log-probs over the *whole* sequence (prompt + response), padded
    (bs, seq) or packed (total,); returns (loss, gradient on the padded (bs, seq) grid)."""
    P = batch["prompt_len"]
    layout = pack_layout(batch["attention_mask"], P)
    cfg = case_config(name, mode)
    norm = global_normaliser(batch["response_mask"], mode, norm_constant=norm_constant(mode, batch))
    full = batch["full_log_probs"].clone()
    full[:, P:] = batch["log_probs"]
    if packed:
        leaf = pack(full, layout).clone().requires_grad_(True)
        resp = unpack(leaf, layout)[:, P - prompt_shift : full.shape[1] - prompt_shift] if prompt_shift else unpack_response(leaf, layout)
    else:
        leaf = full.clone().requires_grad_(True)
        resp = leaf[:, P - prompt_shift : full.shape[1] - prompt_shift]
    loss = run_actor_loss(batch, slice(None), resp, cfg, norm)
    loss.backward()
    grad = unpack(leaf.grad, layout) if packed else leaf.grad
    return loss.detach(), grad


def assert_grad_confined_to_actions(grad, batch):
    """Zero exactly on prompt, padding and non-action tokens; non-zero on (almost) every action."""
    P = batch["prompt_len"]
    action = torch.zeros_like(grad, dtype=torch.bool)
    action[:, P:] = batch["response_mask"] != 0
    assert (grad[~action] == 0).all(), f"gradient leaks onto {(grad[~action] != 0).sum().item()} prompt/padding positions"
    assert (grad[action] != 0).float().mean() > 0.9, "gradient missing on the sampled actions"


@pytest.mark.parametrize("name,mode", LOSS_CASES)
def test_packed_equals_padded_and_gradient_stops_at_prompt(name, mode):
    batch = ragged_batch(12, bs=BS, dtype=torch.float64)
    loss_pad, g_pad = _grad_from_full_sequence(batch, name, mode, packed=False)
    loss_pack, g_pack = _grad_from_full_sequence(batch, name, mode, packed=True)
    ref_loss, ref_grad = full_batch_loss_and_grad(batch, name, mode)
    torch.testing.assert_close(loss_pad, ref_loss, **TOL)
    torch.testing.assert_close(loss_pack, ref_loss, **TOL)
    torch.testing.assert_close(g_pack, g_pad, **TOL)
    torch.testing.assert_close(g_pad[:, batch["prompt_len"] :], ref_grad, **TOL)
    assert_grad_confined_to_actions(g_pad, batch)
    assert_grad_confined_to_actions(g_pack, batch)


@pytest.mark.parametrize("packed", [False, True])
def test_off_by_one_response_mapping_is_caught(packed):
    batch = ragged_batch(13, bs=BS, dtype=torch.float64)
    _, grad = _grad_from_full_sequence(batch, "vanilla", "token-mean", packed=packed, prompt_shift=1)
    with pytest.raises(AssertionError, match="leaks"):
        assert_grad_confined_to_actions(grad, batch)


def test_off_by_one_response_mask_is_rejected_by_the_layout_check():
    batch = ragged_batch(14, bs=BS)
    am, rm, P = batch["attention_mask"], batch["response_mask"], batch["prompt_len"]
    check_mask_layout(am, rm, P)
    late = torch.zeros_like(rm)
    late[:, 1:] = rm[:, :-1]  # starts one token late and runs one into the padding
    with pytest.raises(ValueError, match="off-by-one"):
        check_mask_layout(am, late, P)
    early = torch.zeros_like(rm)
    early[:, :-1] = rm[:, 1:]  # the mask of the *next* token: slicing a full-sequence mask one too early
    with pytest.raises(ValueError, match="off-by-one"):
        check_mask_layout(am, early, P)


def test_dp2_gloo_equals_single_process(tmp_path: Path):
    batch = ragged_batch(15, bs=BS, dtype=torch.float64)
    torch.save(batch, tmp_path / "batch.pt")
    here = Path(ROOT) / "tests"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(here.parent), str(here), os.environ.get("PYTHONPATH", "")]), OMP_NUM_THREADS="1")
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
        "--master-port", str(free_port()), str(here / "dist_algo_invariance.py"), str(tmp_path / "batch.pt"), str(tmp_path),
    ]  # fmt: skip
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    assert ranks[0]["rows"] == (0, 2) and ranks[1]["rows"] == (2, BS)  # uneven shards
    for name, mode in LOSS_CASES:
        ref_loss, ref_grad = full_batch_loss_and_grad(batch, name, mode)
        for r in ranks:
            torch.testing.assert_close(r["loss"][(name, mode)], ref_loss, **TOL)
        grad = torch.cat([r["grad"][(name, mode)] for r in ranks])
        torch.testing.assert_close(grad, ref_grad, **TOL)
    full = reinforce_plus_plus_advantage(
        AdvantageInputs(response_mask=batch["response_mask"], token_rewards=batch["token_rewards"]), AdvantageConfig(gamma=0.97)
    )
    torch.testing.assert_close(torch.cat([r["reinforce_plus_plus"] for r in ranks]), full.advantages, **TOL)
