"""Token-budget micro-batches (``algo.micro_batch_tokens``).

* The scheduler (``megarl/experience/token_budget.py``): every row exactly once over the ranks,
  every micro-batch of two or more rows within the budget, a longer row alone, the same number
  of micro-batches on every data-parallel rank, the same plan wherever it is computed.
* The update (the real ``Learner``, PPO: actor and critic) on packed token-budget micro-batches
  equals the update on padded micro-batches of rows: the gradient norms and every weight after
  two SGD steps, at TP=2, PP=2, DP=2 and TP=2 with sequence parallelism (one launch,
  ``tests/workers/token_budget_worker.py``).  EP=2 (GRPO, MoE) is in ``tests/multiproc/test_moe_training.py``.
  The loss keeps the global normaliser, so only the order of the sums changes: fp32 rounding.
* Chunked log-probs and entropy (``algo.log_prob_chunk``: ``megarl/models/fused_output.py``, the
  output layer a chunk at a time, and ``megarl/models/chunked_logits.py``) in the same launch: the
  functions against megatron's kernel at TP=2, and the forward-only pass and the update with them.
"""

import random

import pytest
import torch
from safetensors.torch import load_file

from megarl.builtin.tiny_checkpoint import make_tiny_hf_checkpoint
from megarl.experience.token_budget import _split_to, first_fit, plan_token_micro_batches
from tests._dist import torchrun
from tests._tolerance import within


def check_plan(lengths, budget, dp):
    """The scheduler's contract on one input; returns the plan."""
    plans = plan_token_micro_batches(lengths, budget, dp)
    assert len(plans) == dp
    assert len({len(p.bins) for p in plans}) == 1, "every DP rank runs as many micro-batches"
    real = [i for p in plans for b, pad in zip(p.bins, p.pad) if not pad for i in b]
    assert sorted(real) == list(range(len(lengths))), "every row exactly once"
    for p in plans:
        assert len(p.bins) == len(p.pad)
        for b, pad in zip(p.bins, p.pad):
            assert b, "no empty micro-batch"
            if pad:
                assert len(b) == 1
            elif len(b) > 1:
                assert sum(lengths[i] for i in b) <= budget, "a micro-batch of several rows within the budget"
    assert plans == plan_token_micro_batches(list(lengths), budget, dp), "a pure function of the lengths"
    return plans


def test_scheduler_on_heavy_tailed_lengths():
    rng = random.Random(0)
    for trial in range(200):
        n = rng.randint(1, 70)
        # 8-1024 tokens, most short: a reasoning batch's tail
        lengths = [min(1024, int(8 * rng.paretovariate(0.9))) for _ in range(n)]
        budget = rng.choice([16, 64, 256, 1024, 4096])
        check_plan(lengths, budget, rng.choice([1, 2, 3, 4, 8]))


def test_scheduler_cases():
    # a row longer than the budget gets a micro-batch of its own; the rest fill first-fit decreasing
    assert first_fit([5, 40, 3, 9, 2], 10) == [[1], [3], [0, 2, 4]]
    with pytest.raises(ValueError, match="budget must be >= 1"):
        first_fit([1], 0)
    # rows dealt by tokens: the 100-token row alone on one rank, the short ones on the other; the
    # first rank cannot split its one row, so it runs a filler micro-batch (row 0 again, not counted)
    p0, p1 = check_plan([100, 10, 10, 10, 10], 25, 2)
    assert (p0.bins, p0.pad, p1.bins, p1.pad) == ([[0], [0]], [False, True], [[1, 2], [3, 4]], [False, False])
    # a rank short of micro-batches halves its fullest before it takes a filler
    assert _split_to([[1, 2, 3, 4], [5]], 3) == [[1, 2], [3, 4], [5]]
    assert _split_to([[1], [5]], 3) == [[1], [5]]
    # more ranks than rows: filler micro-batches
    plans = check_plan([7], 100, 3)
    assert [p.pad for p in plans] == [[False], [True], [True]]
    with pytest.raises(ValueError, match="without rows"):
        plan_token_micro_batches([], 8, 2)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("token_budget")
    hf = make_tiny_hf_checkpoint(str(root / "llama"), "llama", seed=3, vocab_size=300)
    torchrun("token_budget_worker.py", 2, "--hf", hf, "--out", str(root))
    return torch.load(root / "token_budget.pt"), load_file(f"{hf}/model.safetensors")


@pytest.mark.parametrize("layout", ["tp2", "pp2", "dp2", "tp2sp"])
def test_update_on_token_budget_equals_padded(runs, layout):
    results, initial = runs
    padded, tokens = results[layout]["padded"], results[layout]["tokens"]
    moved = max((padded["actor"][k] - initial[k]).abs().max().item() for k in initial)
    assert moved > 1e-4, "the update did not move the actor; the comparison would be vacuous"
    # the two modes ran different micro-batches: rows in 2s, padded, against packed bins of 1-2 rows
    assert all(not packed for step in padded["micro_batches"] for packed, *_ in step)
    assert all(packed for step in tokens["micro_batches"] for packed, *_ in step)
    assert [len(s) for s in tokens["micro_batches"]] != [len(s) for s in padded["micro_batches"]]
    assert tokens["metrics"]["update/optimizer_steps"] == padded["metrics"]["update/optimizer_steps"] == 2
    assert tokens["metrics"]["update/tokens"] == padded["metrics"]["update/tokens"]
    # fp32 sums in another order: the norms within 1e-6 relative (measured <= 1e-7)
    for key in ("update/grad_norm", "update/critic_grad_norm", "update/pg_loss", "update/entropy",
                "update/kl_loss"):
        rel = abs(tokens["metrics"][key] - padded["metrics"][key]) / max(abs(padded["metrics"][key]), 1e-12)
        assert within(rel, 1e-6, f"token_budget/{layout}/{key}"), (key, rel)
    # SGD at lr 0.5: a weight moves by 0.5 x its gradient; the gradients agree to ~1e-7 relative,
    # so the weights to 1e-6 absolute (measured 2.4e-7 on the critic, whose gradient norm is ~9)
    for role in ("actor", "critic"):
        err = max((padded[role][k] - tokens[role][k]).abs().max().item() for k in padded[role])
        assert within(err, 1e-6, f"token_budget/{layout}/{role}_weights"), (role, err)


@pytest.mark.parametrize("layout", ["tp2", "pp2", "dp2", "tp2sp"])
def test_chunked_log_probs_change_no_number_of_the_update(runs, layout):
    """algo.log_prob_chunk (3 positions at a time: the output layer applied to the hidden states a
    chunk at a time, megarl/models/fused_output.py) on the same token-budget update and on the
    forward-only log-probs: no tensor of the vocabulary's width holds more than 3 positions, and
    the numbers are the whole logits' up to fp32 rounding (the matmul's and dW's sums in another
    order)."""
    results, _ = runs
    tokens, chunked, chunk = results[layout]["tokens"], results[layout]["chunked"], results["chunk"]
    # the feature ran: nothing anywhere in the pass -- model forward, loss, backward, optimizer --
    # made a tensor of more than CHUNK positions of the vocabulary shard; the negative control (the
    # model's own output layer) makes the whole micro-batch's logits
    for phase in ("forward", "update"):
        assert 0 < chunked["probe"][phase] <= chunk, (phase, chunked["probe"])
        assert tokens["probe"][phase] > 4 * chunk, (phase, tokens["probe"])
    if layout != "pp2":  # rank 0 holds the last stage
        assert "algo.log_prob_chunk=3" in chunked["value_head_refusal"], chunked["value_head_refusal"]
        assert "ScalarValueHead" in chunked["value_head_refusal"]
    # forward-only log-probs of the rollout's tokens: |log p| <= ~10 in fp32, rounding ~1e-6
    err = (chunked["forward_log_probs"] - tokens["forward_log_probs"]).abs().max().item()
    assert within(err, 1e-5, f"token_budget/{layout}/fused_forward_log_probs"), err
    assert tokens["forward_log_probs"].abs().max() > 0.5
    for key in ("update/first_step_pg_loss", "update/grad_norm", "update/critic_grad_norm", "update/pg_loss",
                "update/entropy", "update/kl_loss"):
        rel = abs(chunked["metrics"][key] - tokens["metrics"][key]) / abs(tokens["metrics"][key])
        assert within(rel, 1e-6, f"token_budget/{layout}/chunked_{key}"), (key, rel)
    for role in ("actor", "critic"):
        err = max((chunked[role][k] - tokens[role][k]).abs().max().item() for k in tokens[role])
        assert within(err, 1e-6, f"token_budget/{layout}/chunked_{role}_weights"), (role, err)


def test_fused_functions_at_tp2(runs):
    """The fused output layer (temperature 0.7, a padded vocabulary split over two TP ranks) against
    the whole logits through megatron's kernel and the whole entropy: values, the hidden states'
    gradient and the weight shard's, to fp32 rounding (the same terms summed in another order)."""
    f = runs[0]["fused_functions_tp2"]
    whole, fused = f["whole"], f["fused"]
    assert bool((whole["log_probs"] < 0).all()) and whole["weight_grad"].abs().max() > 0.1
    # |terms| <= ~10 summed over 24 (matmul) or 57 (dW) of them in fp32: ~1e-5 absolute at worst
    for key, tol in (("log_probs", 1e-5), ("entropy", 1e-5), ("hidden_grad", 1e-5), ("weight_grad", 1e-5)):
        err = (whole[key] - fused[key]).abs().max().item()
        assert within(err, tol, f"token_budget/fused_{key}_tp2"), (key, err)


def test_chunked_functions_at_tp2(runs):
    """The chunked log-probs (temperature 0.7, a padded vocabulary split over two TP ranks) equal
    megatron's vocab-parallel cross-entropy bitwise, values and gradients; the chunked entropy its
    values bitwise and its gradient to fp32 rounding (another order of the same terms)."""
    results, _ = runs
    f = results["chunked_functions_tp2"]
    (lp_full, g_full), (lp_chunk, g_chunk) = f["log_probs"][0], f["log_probs"][4]
    assert torch.equal(lp_full, lp_chunk) and torch.equal(g_full, g_chunk)
    assert bool((lp_full < 0).all()) and g_full.abs().max() > 0.1
    (h_full, g_full), (h_chunk, g_chunk) = f["entropy"][0], f["entropy"][4]
    assert torch.equal(h_full, h_chunk)
    # each gradient entry is p_v (z_v - E[z]) x weight, |terms| <= ~10: fp32 rounding ~1e-6 absolute
    err = (g_full - g_chunk).abs().max().item()
    assert within(err, 1e-5, "token_budget/chunked_entropy_grad_tp2"), err
    assert g_full.abs().max() > 0.1
