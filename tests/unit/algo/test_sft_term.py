"""The SFT term of ``algo.sft`` on golden tensors: its loss share and gradient against a hand
computation under its own normaliser; the demonstrations' columns (prompt then response and eos,
the mask on the response only) and their cursor (the stream of a seeded sampler, epoch after
epoch, restored from its state); the config and file refusals name their key."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch

from megarl.algo.sft import sft_nll_loss
from megarl.commands.run_checks import check_run
from megarl.config import ConfigError, load_config
from megarl.data.demonstrations import load_demonstrations
from tests._dist import ROOT

GRPO = os.path.join(ROOT, "configs", "grpo_arith_tiny.yaml")


def test_the_loss_share_and_its_gradient_are_the_hand_computed_ones():
    g = torch.Generator().manual_seed(0)
    lp = (-torch.rand(3, 5, generator=g, dtype=torch.float64) * 3).requires_grad_()
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [0, 0, 0, 0, 0]])  # the last row evens out the ranks
    out = sft_nll_loss(lp, mask, coef=0.25, tokens=20)  # 8 tokens here, 12 on the other ranks
    want = 0.25 * -(lp[0, :3].sum() + lp[1].sum()) / 20
    assert out.loss.item() == pytest.approx(want.item(), rel=1e-15)
    assert out.metrics["sft_nll"] == pytest.approx(want.item() / 0.25, rel=1e-15)
    out.loss.backward()
    grad = torch.where(mask != 0, torch.tensor(-0.25 / 20, dtype=torch.float64), 0.0)
    assert torch.allclose(lp.grad, grad, rtol=1e-15, atol=0)
    # negative control: the share under the micro-batch's own token count is not the step's
    assert out.loss.item() != pytest.approx(0.25 * -(lp[0, :3].sum() + lp[1].sum()).item() / 8, rel=1e-6)


def test_shares_of_a_step_add_up_to_its_mean_nll():
    g = torch.Generator().manual_seed(1)
    lp = -torch.rand(6, 4, generator=g, dtype=torch.float64)
    mask = (torch.rand(6, 4, generator=g) > 0.3).long()
    n = int(mask.sum())
    parts = [sft_nll_loss(lp[i:i + 2], mask[i:i + 2], 1.0, n).metrics["sft_nll"] for i in (0, 2, 4)]
    assert sum(parts) == pytest.approx(float(-(lp * mask).sum() / n), rel=1e-12)


@pytest.mark.parametrize("kwargs,match", [({"coef": -1.0, "tokens": 3}, "coef"), ({"coef": 1.0, "tokens": 0}, "> 0")])
def test_the_loss_refuses_what_cannot_be_a_share(kwargs, match):
    with pytest.raises(ValueError, match=match):
        sft_nll_loss(torch.zeros(1, 2), torch.ones(1, 2), **kwargs)
    with pytest.raises(ValueError, match="differ"):
        sft_nll_loss(torch.zeros(1, 2), torch.ones(1, 3), 1.0, 2)


def _demos(tmp_path, rows, name="demos.jsonl"):
    p = tmp_path / name
    p.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(p)


def _tiny_contract(tmp_path):
    from megarl.builtin.tiny_tokenizer import build_tiny_tokenizer
    from megarl.data.tokenizer import TokenizerContract

    build_tiny_tokenizer(tmp_path / "tok")
    return TokenizerContract.load(tmp_path / "tok")


def test_demonstrations_are_prompt_then_response_and_eos_drawn_by_their_cursor(tmp_path):
    tok = _tiny_contract(tmp_path)
    rows = [{"id": f"d{i}", "prompt": f"what is {i} plus {i} ?", "response": str(2 * i)} for i in range(7)]
    path = _demos(tmp_path, rows)
    cfg = load_config(GRPO, [f"algo.sft.path={path}", "algo.sft.coef=1", "algo.sft.rows=3",
                             "trainer.seed=5"])
    d = load_demonstrations(cfg, tok)
    assert len(d.rows) == 7 and d.per_step == 3
    for (p, r), row in zip(d.rows, rows, strict=True):
        assert list(p) == tok.encode_prompt([{"role": "user", "content": row["prompt"]}])
        assert list(r) == tok.tokenizer.encode(row["response"], add_special_tokens=False) + [tok.eos_token_id]
    stream = [i for e in range(2) for i in np.random.default_rng([5, e]).permutation(7).tolist()]
    first = d.draw()
    saved = d.sampler.state_dict()
    second, third = d.draw(), d.draw()  # the third crosses into epoch 1
    assert first + second + third == stream[:9]
    d.sampler.load_state_dict(saved)
    assert d.draw() == second  # the cursor restored draws what it would have drawn
    cols = d.columns([2, 0], pad_id=0)
    (p2, r2), (p0, r0) = d.rows[2], d.rows[0]
    assert cols["prompt_lens"].tolist() == [len(p2), len(p0)] and cols["response_lens"].tolist() == [len(r2), len(r0)]
    assert cols["tokens"][0, :len(p2) + len(r2)].tolist() == list(p2) + list(r2)
    assert cols["loss_mask"].sum(1).tolist() == [len(r2), len(r0)]


def test_a_file_without_the_response_field_is_refused_naming_the_key(tmp_path):
    tok = _tiny_contract(tmp_path)
    path = _demos(tmp_path, [{"id": "a", "prompt": "what is 1 plus 1 ?", "answer": "2"}])
    cfg = load_config(GRPO, [f"algo.sft.path={path}", "algo.sft.coef=1"])
    with pytest.raises(ConfigError, match=r"^algo\.sft\.response_field: row 'a' of .* has no text in 'response'"):
        load_demonstrations(cfg, tok)
    cfg = load_config(GRPO, [f"algo.sft.path={tmp_path / 'missing.jsonl'}", "algo.sft.coef=1",
                             "data.apply_chat_template=false"])
    with pytest.raises(ConfigError, match=r"^algo\.sft\.path: "):
        load_demonstrations(cfg, tok)


@pytest.mark.parametrize("overrides,key", [
    (["algo.sft.path=/d.jsonl"], "algo.sft.coef"),
    (["algo.sft.coef=0.5"], "algo.sft.path"),
    (["algo.sft.path=/d.jsonl", "algo.sft.coef=-1"], "algo.sft.coef"),
    (["algo.sft.path=/d.jsonl", "algo.sft.coef=1", "algo.sft.rows=0"], "algo.sft.rows"),
])
def test_config_refusals_name_the_key(overrides, key):
    with pytest.raises(ConfigError) as e:
        check_run(load_config(GRPO, overrides), 1)
    assert str(e.value).startswith(key + ":"), str(e.value)
    assert check_run(load_config(GRPO, ["algo.sft.path=/d.jsonl", "algo.sft.coef=0.5"]), 1) == 1
