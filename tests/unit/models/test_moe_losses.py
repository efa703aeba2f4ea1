"""The router's aux (load-balancing) and z losses of a mixture-of-experts actor
(``actor.moe_aux_loss_coeff`` / ``actor.moe_z_loss_coeff``, megarl/models/moe_losses.py).

The golden value: one megarl ``train_step`` over two micro-batches, with a policy loss that is
exactly zero, must leave in every parameter's gradient what autograd gives for the formulas
written out by hand on an independent copy of the model (router logits from each router's own
input and weight, Switch-Transformer aux loss, ST-MoE z-loss, the mean over micro-batches),
and report the unscaled losses as metrics.  Left to megatron's own scaling the aux gradient would
be T = 18 times larger (the micro-batch's token count), and the sum instead of the mean over the
two micro-batches doubles it again: both are what this test would catch.
"""

from __future__ import annotations

import pytest
import torch

from megarl.builtin.tiny_checkpoint import make_tiny_hf_checkpoint
from megarl.config import OptimSettings
from tests._tolerance import within
from tests._dist import ROOT

E, K, C_AUX, C_Z = 4, 2, 0.05, 0.003


@pytest.fixture(scope="module")
def moe_ckpt(tmp_path_factory):
    d = tmp_path_factory.mktemp("moe_losses")
    moe = make_tiny_hf_checkpoint(str(d / "moe"), "qwen3_moe", seed=5, vocab_size=96, hidden_size=32,
                                  num_layers=2, num_heads=2, num_kv_heads=1, intermediate_size=64,
                                  num_experts=E, num_experts_per_tok=K)
    dense = make_tiny_hf_checkpoint(str(d / "dense"), "llama", seed=5, vocab_size=96, hidden_size=32,
                                    num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=64)
    return moe, dense


def _micro_batches():
    g = torch.Generator().manual_seed(11)
    return [{"tokens": torch.randint(0, 96, (2, 9), generator=g)} for _ in range(2)]


def _hand_losses(model, tokens):
    """Sum over MoE layers of the aux and z losses of one micro-batch, from each router's input
    (captured by a hook) and weight: logits z = x W^T (fp32), p = softmax(z), n_i = tokens whose
    top-k holds expert i, aux = E / (k T^2) sum_i n_i sum_t p_ti, z-loss = mean_t logsumexp(z_t)^2."""
    from megatron.core.transformer.moe.router import Router

    from megarl.models.micro_batches import position_ids_for

    inputs = []
    hooks = [m.register_forward_hook(lambda mod, args, out: inputs.append((mod, args[0])))
             for m in model.modules() if isinstance(m, Router)]
    try:
        model(tokens, position_ids_for(tokens), None)
    finally:
        for h in hooks:
            h.remove()
    assert len(inputs) == 2  # one router per layer
    aux = z = 0.0
    for router, x in inputs:
        logits = (x.float() @ router.weight.float().t()).reshape(-1, E)
        T = logits.shape[0]
        p = torch.softmax(logits, dim=-1)
        n = torch.zeros(E).index_add_(0, logits.topk(K, dim=-1).indices.reshape(-1), torch.ones(T * K))
        aux = aux + E / (K * T * T) * (n * p.sum(0)).sum()
        z = z + torch.logsumexp(logits, dim=-1).square().mean()
    return aux, z


def test_aux_and_z_loss_gradient_is_the_coefficient_times_the_mean(moe_ckpt, megatron_world):
    from megarl.models.megatron_ckpt import load_model
    from megarl.models.optim import train_step, wrap_for_training

    moe, _ = moe_ckpt
    mbs = _micro_batches()
    model = load_model(moe, moe_aux_loss_coeff=C_AUX, moe_z_loss_coeff=C_Z)
    ddp, opt = wrap_for_training(model, OptimSettings(optimizer="sgd", lr=1e-9, clip_grad=1e9))
    before = {n: p.detach().clone() for n, p in model.named_parameters()}

    def zero_policy_loss(output, mb):  # the router losses are the only gradient
        return (output * 0.0).sum(), {}

    res = train_step(ddp, opt, mbs, zero_policy_loss)
    assert res.update_successful
    got = {n: p.main_grad.detach().clone() for n, p in model.named_parameters()}
    assert ddp.config.moe_aux_loss_coeff == C_AUX and ddp.config.moe_z_loss_coeff == C_Z  # restored

    # the same weights, losses off, in train mode; the formulas by hand; autograd
    ref = load_model(moe)
    with torch.no_grad():
        for n, p in ref.named_parameters():
            p.copy_(before[n])
    ref.train()
    auxes, zs = zip(*[_hand_losses(ref, mb["tokens"]) for mb in mbs])
    total = C_AUX * sum(auxes) / len(mbs) + C_Z * sum(zs) / len(mbs)
    params = dict(ref.named_parameters())
    want = dict(zip(params, torch.autograd.grad(total, list(params.values()), allow_unused=True)))

    router = [n for n in got if n.endswith("mlp.router.weight")]
    assert len(router) == 2 and all(want[n].abs().max() > 1e-4 for n in router)  # the losses reach the router
    reached = 0
    for n, g in got.items():
        w = torch.zeros_like(g) if want[n] is None else want[n]
        err, scale = float((g - w).abs().max()), float(w.abs().max())
        # fp32, megatron's aux / z losses through its autoscaler against autograd of the formulas
        # on the same weights: two implementations of a 2-layer forward and backward; relative
        # to the gradient's scale (the z-loss' gradients are ~1e-3 of the aux loss')
        assert within(err, 1e-5 * scale + 1e-9, f"moe_losses/grad_rel/{n}"), \
            f"{n}: max |grad - hand| {err:.3e} (max |hand| {scale:.3e})"
        reached += bool(w.abs().max() > 0)
    assert reached > len(router)  # and, through the hidden states, the layers below them

    # metrics: the unscaled losses, means over micro-batches and MoE layers
    assert res.moe_losses.keys() == {"moe_aux_loss", "moe_z_loss"}
    assert res.moe_losses["moe_aux_loss"] == pytest.approx(float(sum(auxes)) / (2 * len(mbs)), rel=1e-5)
    assert res.moe_losses["moe_z_loss"] == pytest.approx(float(sum(zs)) / (2 * len(mbs)), rel=1e-5)
    assert res.moe_losses["moe_aux_loss"] >= 1.0 - 1e-6  # E sum_i f_i P_i: 1 at perfect balance, above otherwise


def test_losses_off_leave_no_gradient_and_no_metric(moe_ckpt, megatron_world):
    from megarl.models.megatron_ckpt import load_model
    from megarl.models.optim import train_step, wrap_for_training

    moe, _ = moe_ckpt
    model = load_model(moe)
    ddp, opt = wrap_for_training(model, OptimSettings(optimizer="sgd", lr=1e-9, clip_grad=1e9))
    res = train_step(ddp, opt, _micro_batches(), lambda out, mb: ((out * 0.0).sum(), {}))
    assert res.moe_losses == {}
    assert all(float(p.main_grad.abs().max()) == 0.0 for p in model.parameters())


def test_router_losses_are_refused_on_a_dense_model_naming_the_key(moe_ckpt, megatron_world):
    from megarl.config import ConfigError, load_config
    from megarl.models.fit import validate_model_fit
    from megarl.models.hf_config import ModelConfigError, load_spec
    from megarl.models.megatron_ckpt import load_model

    _, dense = moe_ckpt
    with pytest.raises(ModelConfigError, match="dense model"):
        load_model(dense, moe_aux_loss_coeff=0.01)
    import os

    from tests._dist import ROOT

    recipe = os.path.join(ROOT, "configs", "grpo_arith_tiny.yaml")
    for key, value in (("moe_aux_loss_coeff", 0.01), ("moe_z_loss_coeff", 0.001)):
        with pytest.raises(ConfigError, match=rf"^actor\.{key}: .*dense model"):
            validate_model_fit(load_config(recipe, [f"actor.{key}={value}"]), load_spec(dense), where=dense)
    validate_model_fit(load_config(recipe, ["actor.moe_z_loss_coeff=0.001"]), load_spec(moe_ckpt[0]), where="moe")
