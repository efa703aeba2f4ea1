"""A tiny megatron actor for in-process tests (offload round trips, update rollback): the
checkpoint it loads, seeded batches, a training step that must succeed, and bitwise copies and
comparisons of its weights and optimizer state."""

from __future__ import annotations

import pytest
import torch

from megarl.builtin.tiny_checkpoint import make_tiny_hf_checkpoint
from megarl.config import OptimSettings
from megarl.models.vocab_parallel import token_log_probs_from_logits
from megarl.models.megatron_ckpt import load_model
from megarl.models.optim import train_step, wrap_for_training

ADAM = OptimSettings(optimizer="adam", lr=1e-3, weight_decay=0.1, clip_grad=0.05)


def tiny_llama_checkpoint(tmp_path_factory) -> str:
    """A seeded tiny llama HF checkpoint in a fresh temporary directory; returns its path."""
    return make_tiny_hf_checkpoint(str(tmp_path_factory.mktemp("offload") / "llama"), "llama",
                                   seed=3, vocab_size=300)


def make_batch(seed):
    """Two micro-batches of two seeded ragged rows (tokens, loss mask, the batch's token count)."""
    g = torch.Generator().manual_seed(seed)
    B, S = 4, 11
    tokens = torch.randint(0, 250, (B, S), generator=g)
    lengths = torch.randint(4, S + 1, (B,), generator=g)
    mask = (torch.arange(S - 1)[None, :] < (lengths[:, None] - 1)).float()
    return [{"tokens": tokens[i:i + 2], "loss_mask": mask[i:i + 2], "norm": mask.sum()}
            for i in range(0, B, 2)]


def make_loss_fn(vocab):
    """Next-token negative log-likelihood over the loss mask, normalised by the batch's tokens."""
    def loss_fn(output, mb):
        lp = token_log_probs_from_logits(output[:, :-1], mb["tokens"][:, 1:], vocab)
        loss = -(lp * mb["loss_mask"]).sum() / mb["norm"]
        return loss, {"loss": loss.detach()}
    return loss_fn


def make_actor(hf, cfg=ADAM):
    """(DDP-wrapped model, optimizer, loss function) for the checkpoint at ``hf``."""
    model = load_model(hf)
    ddp, opt = wrap_for_training(model, cfg)
    return ddp, opt, make_loss_fn(model.megarl_spec.vocab_size)


def good_step(ddp, opt, loss_fn, seed):
    """One training step on ``make_batch(seed)``; it must succeed."""
    res = train_step(ddp, opt, make_batch(seed), loss_fn)
    assert res.update_successful
    return res


def params_copy(m):
    """A detached copy of every named parameter."""
    return {n: p.detach().clone() for n, p in m.named_parameters()}


def opt_state_copy(opt):
    """A copy of every optimizer state tensor (exp_avg, exp_avg_sq, ...), in a stable order."""
    inner = [o.optimizer for o in opt.chained_optimizers]
    return [{k: v.clone() for k, v in st.items()} for o in inner for st in o.state.values()]


def churn_memory():
    """Reuse freed memory with garbage, so a restore that copies nothing cannot pass by luck."""
    return [torch.full((n,), float("nan")) for n in (1 << 10, 1 << 14, 1 << 17, 1 << 20)]


def assert_same(a, b, what):
    """Bitwise equality of two (nested) dicts or lists of tensors, naming the first difference."""
    assert a.keys() == b.keys() if isinstance(a, dict) else len(a) == len(b)
    items = a.items() if isinstance(a, dict) else enumerate(a)
    for k, v in items:
        w = b[k]
        if isinstance(v, dict):
            assert_same(v, w, f"{what}[{k}]")
        else:
            assert torch.equal(v, w), f"{what}[{k}] differs after the round trip"


@pytest.fixture(scope="module")
def hf(tmp_path_factory, megatron_world):
    """The tiny Llama checkpoint of a test module (built once per module)."""
    return tiny_llama_checkpoint(tmp_path_factory)
