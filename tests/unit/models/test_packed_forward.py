"""Packed forward-only passes (``algo.pack_sequences``): the old / reference log-probs and the
critic values computed with each micro-batch as one packed (THD) sequence equal the padded
forward's, on the tiny Llama, for rows of very different lengths.

On CPU the packed attention is megatron's local attention given a THD path by
``megarl.runtime.cpu_compat`` (both of its strategies are checked); RoPE restarting per sequence
is megatron's own THD code.  TP=2 / PP=2 are covered by ``tests/multiproc/test_model_parity.py``.
"""

import os
import os.path

import pytest
import torch

from megarl.commands.run_checks import check_run
from megarl.config import ConfigError, load_config
from megarl.models.forward import response_log_probs, right_align, scalar_values, teacher_forced_log_probs
from megarl.models.micro_batches import PackedMicroBatch
from megarl.builtin.tiny_checkpoint import make_tiny_hf_checkpoint
from megarl.models.megatron_ckpt import load_model
from megarl.runtime import cpu_compat
from tests._tolerance import LAYOUT_FP32_LOGPROB, LAYOUT_FP32_VALUE, within

from tests._dist import ROOT
# packed (THD) against padded rows: one implementation, fp32, 2 layers; the GEMMs see one packed
# row instead of padded rows, so their blocking (and on another CPU their reduction order) may
# differ.  Measured 0 (bitwise) here for the "repad" attention strategy.
TOL, VTOL = LAYOUT_FP32_LOGPROB, LAYOUT_FP32_VALUE


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory, megatron_world):
    d = tmp_path_factory.mktemp("packed")
    actor = make_tiny_hf_checkpoint(str(d / "llama"), "llama", seed=3, vocab_size=300)
    critic = make_tiny_hf_checkpoint(str(d / "llama_vh"), "llama", seed=4, vocab_size=300, value_head=True)
    return {"actor": actor, "critic": critic}


def ragged_batch(seed=0):
    """12 rows in the experience layout: prompts 1..32 tokens, responses 0..64 (one of each extreme)."""
    g = torch.Generator().manual_seed(seed)
    P, R = 32, 64
    plen = torch.tensor([1, 32, 3, 17, 1, 30, 8, 2, 25, 5, 12, 32])
    rlen = torch.tensor([64, 1, 0, 40, 1, 64, 7, 55, 2, 33, 19, 0])
    pos = torch.arange(P + R)
    attn = ((pos >= (P - plen)[:, None]) & (pos < (P + rlen)[:, None])).long()
    prompt = torch.randint(1, 300, (len(plen), P), generator=g) * attn[:, :P]
    response = torch.randint(1, 300, (len(plen), R), generator=g) * attn[:, P:]
    return prompt, response, attn, rlen


@pytest.fixture(params=["repad", "block_mask"])
def thd_attention(request, monkeypatch):
    from megarl.models import cpu_layers

    monkeypatch.setattr(cpu_layers, "THD_ATTENTION", request.param)
    return request.param


def test_packed_log_probs_equal_padded(ckpts, thd_attention):
    from megarl.config import OptimSettings
    from megarl.roles.actor import Actor
    from megarl.roles.reference import Reference

    prompt, response, attn, rlen = ragged_batch()
    actor = Actor(ckpts["actor"], 1, 1, OptimSettings(), total_steps=1)
    ref = Reference(ckpts["actor"], 1, 1, version="ref-0")
    worst = 0.0
    for mbs in (0, 5, 16):
        for role in (actor, ref):
            padded = role.log_probs(prompt, response, attn, mbs)
            packed = role.log_probs(prompt, response, attn, mbs, pack=True)
            # algo.micro_batch_tokens: rows first-fit into 40 tokens (the 96-token rows alone), or 200
            budgets = [role.log_probs(prompt, response, attn, mbs, micro_batch_tokens=b) for b in (40, 200)]
            assert packed.shape == padded.shape == response.shape
            past = torch.arange(response.shape[1])[None, :] >= rlen[:, None]
            assert not packed[past].any() and padded[~past].ne(0).any()
            assert not any(b[past].any() for b in budgets)
            worst = max([worst, float((packed - padded).abs().max())] + [float((b - padded).abs().max()) for b in budgets])
    print(f"\nmax |packed - padded| log-prob ({thd_attention}): {worst:.3e}")
    assert within(worst, TOL, f"packed_forward/log_probs/{thd_attention}"), worst


def test_packed_critic_values_equal_padded(ckpts, thd_attention):
    from megarl.config import CriticConfig
    from megarl.roles.critic import Critic

    prompt, response, attn, rlen = ragged_batch(seed=1)
    critic = Critic(CriticConfig(path=ckpts["critic"]), None, 1, 1, total_steps=1)
    worst = 0.0
    for mbs in (0, 5):
        per_token, boot = critic.values(prompt, response, attn, mbs)
        per_token_p, boot_p = critic.values(prompt, response, attn, mbs, pack=True)
        per_token_b, boot_b = critic.values(prompt, response, attn, mbs, micro_batch_tokens=64)  # a token budget
        assert per_token.ne(0).any() and boot.ne(0).all()
        worst = max(worst, float((per_token_p - per_token).abs().max()), float((boot_p - boot).abs().max()),
                    float((per_token_b - per_token).abs().max()), float((boot_b - boot).abs().max()))
    print(f"\nmax |packed - padded| value ({thd_attention}): {worst:.3e}")
    assert within(worst, VTOL, f"packed_forward/values/{thd_attention}"), worst


def test_full_rows_and_teacher_forced_positions(ckpts):
    """Without ``lengths`` (every row full) and through the lower-level functions."""
    model = load_model(ckpts["actor"])
    prompt, response, attn, _ = ragged_batch(seed=2)
    tokens, plen, rlen = right_align(prompt, response, attn)
    lengths = plen + rlen
    for kw in ({}, {"lengths": lengths}):
        a = teacher_forced_log_probs(model, tokens, 4, **kw)
        b = teacher_forced_log_probs(model, tokens, 4, pack=True, **kw)
        assert within((a - b).abs().max(), TOL, "packed_forward/teacher_forced"), float((a - b).abs().max())
    err = (response_log_probs(model, prompt, response, attn, 3, temperature=0.7)
           - response_log_probs(model, prompt, response, attn, 3, temperature=0.7, pack=True)).abs().max()
    assert within(err, TOL, "packed_forward/response_log_probs_t07"), float(err)


def test_attention_stays_inside_each_sequence(ckpts):
    """The packed logits of each row equal that row run alone; the same tokens run as one causal
    sequence (no boundaries, positions running on) do not -- so the boundaries are doing the work."""
    model = load_model(ckpts["actor"])
    g = torch.Generator().manual_seed(5)
    lengths = torch.tensor([9, 1, 23, 4])
    tokens = torch.randint(1, 300, (4, 23), generator=g)
    mb = PackedMicroBatch.from_rows(tokens, lengths)
    assert mb.tokens.shape == (1, int(lengths.sum()))
    assert mb.position_ids[0].tolist() == [j for n in lengths.tolist() for j in range(n)]
    with torch.no_grad():
        packed = model(mb.tokens, mb.position_ids, None, packed_seq_params=mb.packed_seq_params())[0]
        leaky = model(mb.tokens, torch.arange(mb.tokens.shape[1])[None], None)[0]
        starts = [0] + lengths.cumsum(0).tolist()
        for i, n in enumerate(lengths.tolist()):
            alone = model(tokens[i:i + 1, :n], torch.arange(n)[None], None)[0]
            err = (packed[starts[i]:starts[i] + n] - alone).abs().max()
            assert within(err, TOL, "packed_forward/logits_vs_alone"), (i, float(err))
            if i:  # attention across the boundary: far outside the tolerance
                assert (leaky[starts[i]:starts[i] + n] - alone).abs().max() > 100 * TOL, i
        # filler tokens (what sequence parallelism and the MoE dispatcher ask for) are one more
        # sequence: the real tokens' logits do not move
        filled = mb.padded_to(mb.tokens.shape[1] + 5)
        assert filled.filler == 5 and filled.position_ids[0, -5:].tolist() == list(range(5))
        assert filled.packed_seq_params().cu_seqlens_q.tolist() == starts + [starts[-1] + 5]
        with_filler = model(filled.tokens, filled.position_ids, None, packed_seq_params=filled.packed_seq_params())[0]
        assert torch.equal(with_filler[:mb.real_tokens], packed)


def test_scalar_values_with_empty_row(ckpts):
    """A row with no token (never produced by the trainer) comes back 0, as in the padded path."""
    model = load_model(ckpts["critic"])
    tokens = torch.randint(1, 300, (3, 6), generator=torch.Generator().manual_seed(0))
    lengths = torch.tensor([6, 0, 2])
    a = scalar_values(model, tokens, 0, lengths=lengths)
    b = scalar_values(model, tokens, 0, lengths=lengths, pack=True)
    assert not b[1].any() and within((a - b).abs().max(), VTOL, "packed_forward/values_empty_row"), float((a - b).abs().max())


@pytest.mark.skipif(not cpu_compat.on_cpu(), reason="the local attention's THD path is a CPU accommodation")
def test_local_attention_without_thd_path_is_refused(ckpts, monkeypatch):
    """Without the CPU stand-in (megatron's local attention as on a CUDA machine without TE)
    a packed forward is refused up front, naming the key."""
    monkeypatch.setattr(cpu_compat, "use_local_layer_stand_ins", lambda: False)
    model = load_model(ckpts["actor"])
    with pytest.raises(ValueError, match="algo.pack_sequences"):
        teacher_forced_log_probs(model, torch.ones(2, 4, dtype=torch.long), pack=True)


def test_config_key_default_and_validation(monkeypatch):
    from megarl.config import AlgoConfig
    from megarl.models import forward

    assert AlgoConfig().pack_sequences is False
    path = os.path.join(ROOT, "configs", "grpo_arith_tiny.yaml")
    assert check_run(load_config(path, ["algo.pack_sequences=true"]), 1) == 1
    monkeypatch.setattr(forward, "packing_unsupported_reason", lambda: "no THD attention here")
    with pytest.raises(ConfigError, match="algo.pack_sequences.*no THD attention here"):
        check_run(load_config(path, ["algo.pack_sequences=true"]), 1)
    assert check_run(load_config(path, []), 1) == 1  # the default never asks
    with pytest.raises(ConfigError, match="algo.micro_batch_tokens.*no THD attention here"):
        check_run(load_config(path, ["algo.micro_batch_tokens=512"]), 1)
    monkeypatch.undo()
    assert AlgoConfig().micro_batch_tokens == 0
    with pytest.raises(ConfigError, match="algo.micro_batch_tokens: must be >= 0, got -1"):
        check_run(load_config(path, ["algo.micro_batch_tokens=-1"]), 1)
    # a token budget cuts the update's micro-batches: the row count need not divide the mini-batch
    assert check_run(load_config(path, ["algo.micro_batch_tokens=512", "algo.micro_batch_size=7"]), 1) == 1
    with pytest.raises(ConfigError, match="algo.micro_batch_size"):
        check_run(load_config(path, ["algo.micro_batch_size=7"]), 1)
    # packed sequences get filler tokens up to a multiple of tp: no longer refused with sequence parallelism
    sp = ["algo.pack_sequences=true", "algo.micro_batch_tokens=512", "parallel.tp=2", "parallel.sequence_parallel=true"]
    assert check_run(load_config(path, sp), 2) == 1
