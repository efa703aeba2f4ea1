"""Contract 6/7: one optimizer step (megatron DDP + megatron optimizer) gives the same updated
logical weights at TP=1/DP=1 as at TP=2, PP=2 and DP=2 on the same global batch.

SGD shows the gradient itself is layout-invariant (its scale included: an averaging bug over
DP or micro-batches would halve the update); AdamW with weight decay and gradient clipping
(the clip coefficient depends on the global grad norm) shows the optimizer path is too.
"""

import pytest
import torch
from safetensors.torch import load_file

from megarl.builtin.tiny_checkpoint import make_tiny_hf_checkpoint
from tests._dist import torchrun
from tests._tolerance import adam_weights_tol, within

LAYOUTS = [(1, 1, 1), (2, 1, 1), (1, 2, 1), (1, 1, 2)]
#: sequence parallelism (parallel.sequence_parallel): TP=2 and TP=2 x PP=2; the batch's 13 tokens
#: are padded to a multiple of tp, which a causal model never attends to
SP_LAYOUTS = [(2, 1, 1), (2, 2, 1)]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("optim")
    hf = make_tiny_hf_checkpoint(str(root / "llama"), "llama", seed=3, vocab_size=300)
    for tp, pp, dp in LAYOUTS:
        torchrun("optim_step_worker.py", tp * pp * dp, "--tp", str(tp), "--pp", str(pp),
                 "--hf", hf, "--out", str(root))
    for tp, pp, dp in SP_LAYOUTS:
        torchrun("optim_step_worker.py", tp * pp * dp, "--tp", str(tp), "--pp", str(pp), "--sp",
                 "--hf", hf, "--out", str(root))
    return root, load_file(f"{hf}/model.safetensors")


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
@pytest.mark.parametrize("tp,pp,dp,sp", [(*lay, False) for lay in LAYOUTS[1:]] + [(*lay, True) for lay in SP_LAYOUTS],
                         ids=["tp2", "pp2", "dp2", "tp2sp", "tp2pp2sp"])
def test_one_step_matches_single_rank(runs, optimizer, tp, pp, dp, sp):
    """Also: under sequence parallelism the TP-replicated weights (the norms, whose gradients
    each TP rank computed on its part of the sequence) are identical on every TP rank after the
    step (asserted in the worker)."""
    root, initial = runs
    ref = torch.load(root / f"{optimizer}_tp1_pp1_dp1.pt")
    got = torch.load(root / f"{optimizer}_tp{tp}_pp{pp}_dp{dp}{'_sp' if sp else ''}.pt")
    assert set(got["weights"]) == set(initial)
    moved = max((ref["weights"][k] - initial[k]).abs().max().item() for k in initial)
    assert moved > 1e-4, "the step did not change the weights; the comparison would be vacuous"
    # the step at another layout sums the gradients in another order (fp32): SGD (lr 0.5) moves
    # each weight by lr x its gradient, whose rounding is ~1e-6 relative; Adam (lr 1e-3) by the
    # bound of tests/_tolerance.py (gradient terms <= ~1e-3)
    tol = 1e-5 if optimizer == "sgd" else adam_weights_tol(1e-3, 1, 1e-3)
    for k in initial:
        err = (got["weights"][k] - ref["weights"][k]).abs().max().item()
        assert within(err, tol, f"optim_step/{optimizer}/tp{tp}pp{pp}dp{dp}{'sp' if sp else ''}/weights"), \
            f"{optimizer} tp={tp} pp={pp} dp={dp}: {k} differs by {err}"
    # the norm of fp32 gradients summed in another order: relative 1e-5 (measured 3.5e-8)
    rel = abs(got["grad_norm"] - ref["grad_norm"]) / ref["grad_norm"]
    assert within(rel, 1e-5, f"optim_step/{optimizer}/tp{tp}pp{pp}dp{dp}{'sp' if sp else ''}/grad_norm_rel"), rel
