"""The Bradley-Terry loss (megarl/algo/preference.py) against its formula written out here."""

import math

import torch

from megarl.algo.preference import bradley_terry_loss, pair_accuracy
from tests._tolerance import formula_tol, within


def _reference(chosen, rejected, n):
    """-log sigma(c - r) summed in Python floats, over the global pair count."""
    return sum(math.log1p(math.exp(-(c - r))) for c, r in zip(chosen, rejected)) / n


def test_loss_is_the_negative_log_likelihood_of_the_preferences():
    c, r = [1.0, 0.0, -2.0, 3.5], [0.0, 0.0, 1.0, 3.0]
    loss, m = bradley_terry_loss(torch.tensor(c), torch.tensor(r), normaliser=4)
    want = _reference(c, r, 4)
    # 4 terms of a log1p(exp) each (~4 ops), magnitudes <= ~4
    assert within(abs(float(loss) - want), formula_tol(torch.float32, ops=20, scale=4.0), "bt/golden"), (float(loss), want)
    assert m["pairs"] == 4 and m["correct"] == 2  # a tie is not a correct pair
    assert abs(m["margin_sum"] - sum(a - b for a, b in zip(c, r))) < 1e-6


def test_shares_over_ranks_sum_to_the_batch_mean_and_the_gradient_is_the_formula():
    g = torch.Generator().manual_seed(0)
    c, r = torch.randn(8, generator=g), torch.randn(8, generator=g)
    whole, _ = bradley_terry_loss(c, r, normaliser=8)
    shares = sum(bradley_terry_loss(c[i:i + 3], r[i:i + 3], normaliser=8)[0] for i in range(0, 8, 3))
    assert within(abs(float(whole - shares)), formula_tol(torch.float32, ops=16, scale=8.0), "bt/shares")
    cc = c.clone().requires_grad_(True)
    bradley_terry_loss(cc, r, normaliser=8)[0].backward()
    # d/dc of -log sigma(c - r) / N is -(1 - sigma(c - r)) / N
    want = -(1 - torch.sigmoid(c - r)) / 8
    assert within(float((cc.grad - want).abs().max()), formula_tol(torch.float32, ops=6, scale=1.0), "bt/grad")
    # negative control: a per-share mean (dividing by each share's own size) is not the batch mean
    wrong = sum(bradley_terry_loss(c[i:i + 3], r[i:i + 3], normaliser=len(c[i:i + 3]))[0] for i in range(0, 8, 3))
    assert abs(float(wrong - whole)) > 0.1


def test_the_centering_term_pulls_each_pairs_mean_score_to_zero():
    """``center_coef * (s_c + s_r)^2`` per pair (Eisenstein et al. 2023): its value and gradient
    against the formula; a pair shifted by a constant keeps its likelihood term and pays only the
    centering term (the offset the plain loss cannot see)."""
    c, r = [1.0, 0.0, -2.0, 3.5], [0.0, 0.0, 1.0, 3.0]
    loss, _ = bradley_terry_loss(torch.tensor(c), torch.tensor(r), normaliser=4, center_coef=0.01)
    want = _reference(c, r, 4) + 0.01 * sum((a + b) ** 2 for a, b in zip(c, r)) / 4
    assert within(abs(float(loss) - want), formula_tol(torch.float32, ops=30, scale=4.0), "bt/centered"), (float(loss), want)
    cc = torch.tensor(c).requires_grad_(True)
    bradley_terry_loss(cc, torch.tensor(r), normaliser=4, center_coef=0.01)[0].backward()
    # d/dc: -(1 - sigma(c - r)) / N + 2 coef (c + r) / N
    g = -(1 - torch.sigmoid(torch.tensor(c) - torch.tensor(r))) / 4 + 2 * 0.01 * (torch.tensor(c) + torch.tensor(r)) / 4
    assert within(float((cc.grad - g).abs().max()), formula_tol(torch.float32, ops=8, scale=1.0), "bt/centered_grad")
    shifted = [bradley_terry_loss(torch.tensor([2.0]) + k, torch.tensor([-2.0]) + k, 1, center_coef=0.01)[0]
               for k in (0.0, 5.0)]
    plain = [bradley_terry_loss(torch.tensor([2.0]) + k, torch.tensor([-2.0]) + k, 1)[0] for k in (0.0, 5.0)]
    assert float(plain[0]) == float(plain[1])  # negative control: the plain loss cannot see the offset
    assert abs(float(shifted[1] - shifted[0]) - 0.01 * 10.0 ** 2) < 1e-5


def test_accuracy_counts_strict_wins_and_shapes_are_checked():
    assert abs(pair_accuracy(torch.tensor([1.0, 0.0, 2.0]), torch.tensor([0.0, 0.0, 3.0])) - 1 / 3) < 1e-7
    try:
        bradley_terry_loss(torch.zeros(3), torch.zeros(2), normaliser=3)
    except ValueError as e:
        assert "(n,)" in str(e)
    else:
        raise AssertionError("mismatched shapes were accepted")
