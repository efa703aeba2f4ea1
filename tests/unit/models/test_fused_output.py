"""The output layer a chunk at a time (megarl/models/fused_output.py) on one rank, against the
whole logits: fp32 values and gradients, the bf16 path against an fp64 truth, and the refusal of
an output layer it cannot stand in for.  TP=2 and the real update are in
tests/multiproc/test_token_budget.py."""

import pytest
import torch
import torch.nn.functional as F

from megarl.models.fused_output import fused_log_probs, output_head
from megarl.models.vocab_parallel import token_log_probs_from_logits, vocab_parallel_entropy

V, PADDED, H, T = 301, 304, 24, 0.7


def _inputs(dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(3, 19, H, generator=gen)
    weight = torch.randn(PADDED, H, generator=gen) * 0.5
    weight[V:] = 0  # megatron's padding rows
    targets = torch.randint(0, V, (3, 19), generator=gen)
    w_lp, w_ent = torch.randn(3, 19, generator=gen), torch.randn(3, 19, generator=gen)
    return hidden.to(dtype), weight.to(dtype), targets, w_lp, w_ent


def _whole(hidden, weight, targets, temperature=T):
    """The model's output layer, then megarl's logits functions (megatron's kernel)."""
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    logits = F.linear(h, w)
    lp = token_log_probs_from_logits(logits, targets, V, temperature)
    ent = vocab_parallel_entropy(logits / temperature, V)
    return lp, ent, h, w


def _fused(hidden, weight, targets, chunk, temperature=T):
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    lp, ent = fused_log_probs(h, w, targets, V, temperature, chunk)
    return lp, ent, h, w


@pytest.mark.parametrize("chunk", [1, 4, 100])
def test_values_and_gradients_equal_the_whole_logits_in_fp32(megatron_world, chunk):
    hidden, weight, targets, w_lp, w_ent = _inputs(torch.float32)
    got = {}
    for name, run in (("whole", lambda: _whole(hidden, weight, targets)),
                      ("fused", lambda: _fused(hidden, weight, targets, chunk))):
        lp, ent, h, w = run()
        ((lp * w_lp).sum() + (ent * w_ent).sum()).backward()
        got[name] = (lp.detach(), ent.detach(), h.grad, w.grad)
    # |logits| <~ 10, sums of 24 (matmul) and 57 (dW) fp32 terms: rounding ~1e-6
    for a, b, what in zip(got["whole"], got["fused"], ("log-probs", "entropy", "dh", "dW")):
        err = (a - b).abs().max().item()
        assert err < 1e-5, (what, chunk, err)
    assert got["whole"][3].abs().max() > 0.5  # the comparison is not of zeros
    assert torch.equal(got["fused"][3][V:], torch.zeros(PADDED - V, H))  # padding rows get no gradient


def test_the_temperature_enters_the_gradient(megatron_world):
    """Negative control: the whole logits at another temperature differ from the fused ones by far
    more than the tolerance above, in values and in the weight's gradient."""
    hidden, weight, targets, w_lp, _ = _inputs(torch.float32)
    lp_a, _, _, w_a = _fused(hidden, weight, targets, 4, temperature=T)
    lp_b, _, _, w_b = _whole(hidden, weight, targets, temperature=1.0)
    (lp_a * w_lp).sum().backward()
    (lp_b * w_lp).sum().backward()
    assert (lp_a - lp_b).abs().max() > 0.1 and (w_a.grad - w_b.grad).abs().max() > 0.1


def test_bf16_is_as_close_to_the_fp64_truth_as_the_whole_logits(megatron_world):
    """In bf16 the logits of a chunk are the model dtype's, as megatron's output layer makes them,
    and the weight's gradient is summed in fp32 over the chunks: both paths land within bf16's
    rounding of the fp64 computation on the same (bf16) inputs."""
    hidden, weight, targets, w_lp, w_ent = _inputs(torch.bfloat16)
    truth_lp, truth_ent, h64, w64 = _whole(hidden.double(), weight.double(), targets)
    ((truth_lp * w_lp.double()).sum() + (truth_ent * w_ent.double()).sum()).backward()
    errors = {}
    for name, run in (("whole", lambda: _whole(hidden, weight, targets)),
                      ("fused", lambda: _fused(hidden, weight, targets, 4))):
        lp, ent, h, w = run()
        ((lp * w_lp).sum() + (ent * w_ent).sum()).backward()
        assert h.grad.dtype == w.grad.dtype == torch.bfloat16
        errors[name] = [(lp.double() - truth_lp).abs().max().item()] + [
            ((grad.double() - truth).abs().max() / truth.abs().max()).item()
            for grad, truth in ((h.grad, h64.grad), (w.grad, w64.grad))]
    # a bf16 logit is off by up to 2^-8 of itself (|z| <~ 10: 0.04), the log-prob by about as much;
    # the gradients by bf16's rounding of the logits' gradient (measured 1.1-1.5% relative)
    for name, (lp_err, dh_rel, dw_rel) in errors.items():
        assert lp_err < 0.1 and dh_rel < 2 ** -5 and dw_rel < 2 ** -5, (name, errors[name])
    # and the fused path is no further from the truth than the whole one (measured: closer in all three)
    assert all(f <= 1.25 * w for f, w in zip(errors["fused"], errors["whole"])), errors


def test_an_output_layer_it_cannot_stand_in_for_is_refused_by_key(megatron_world):
    class Last(torch.nn.Module):
        post_process = True

        def __init__(self):
            super().__init__()
            self.output_layer = torch.nn.Linear(H, 1)  # a value head

    with pytest.raises(ValueError, match=r"algo.log_prob_chunk=8: .*\(Linear\).*set algo.log_prob_chunk=0"):
        with output_head(Last(), V, 8):
            pass
    with output_head(Last(), V, 0) as head:  # without the key: the model's own output, never touched
        assert type(head).__name__ == "LogitsHead"
