"""Contract 7 (layouts) and the model layer's parity with transformers.

Tiny random checkpoints of every supported family are written with ``save_pretrained``;
megarl loads them at TP=1, TP=2, PP=2 and TP=2 x PP=2 (torchrun, gloo) and the full
logits must match transformers' forward within ``NET_FP32_LOGPROB`` (fp32, two implementations:
tests/_tolerance.py).
"""

import pytest
import torch

from megarl.builtin.tiny_checkpoint import FAMILIES, make_tiny_hf_checkpoint
from tests._dist import torchrun
from tests._tolerance import LAYOUT_FP32_LOGPROB, NET_FP32_LOGPROB, within

LAYOUTS = [(1, 1), (2, 1), (1, 2), (2, 2)]
#: sequence parallelism (parallel.sequence_parallel) at TP=2 and TP=2 x PP=2
SP_LAYOUTS = [(2, 1), (2, 2)]


@pytest.fixture(scope="module")
def family_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("families")
    overrides = {
        # llama: untied, Llama-3 RoPE scaling with non-default knobs, vocab needing padding
        "llama": dict(vocab_size=300, rope_parameters={
            "rope_type": "llama3", "rope_theta": 500000.0, "factor": 4.0, "low_freq_factor": 2.0,
            "high_freq_factor": 8.0, "original_max_position_embeddings": 64}),
        "qwen2": dict(vocab_size=257),  # tied embeddings, qkv bias
        "qwen3": dict(vocab_size=256),  # q/k RMSNorm
        "mistral": dict(vocab_size=300, num_kv_heads=4),  # MHA
    }
    for fam in FAMILIES:
        make_tiny_hf_checkpoint(str(root / fam), fam, seed=hash(fam) % 1000, **overrides[fam])
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 256, (5, 19), generator=g)
    torch.save(tokens, root / "tokens.pt")
    return root


def _reference(hf_dir, tokens):
    import transformers

    m = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    m.eval()
    with torch.no_grad():
        logits = m(tokens).logits.float()
    lp = torch.log_softmax(logits, -1)[:, :-1].gather(-1, tokens[:, 1:, None])[..., 0]
    return logits, lp


def _check_transformers_parity(got, ref_logits, ref_lp, fam, tag):
    """Logits and log-probs at a layout against transformers'."""
    assert got["logits"].shape == ref_logits.shape, fam
    # fp32, 2 layers, transformers vs megatron at this layout: two implementations, every
    # reduction in another order (logits of the tiny init are |x| < ~5)
    err = (got["logits"] - ref_logits).abs().max().item()
    assert within(err, NET_FP32_LOGPROB, f"model_parity/{fam}/{tag}/logits"), f"{fam} {tag}: max |logit diff| = {err}"
    lp_err = (got["log_probs"] - ref_lp).abs().max().item()
    assert within(lp_err, NET_FP32_LOGPROB, f"model_parity/{fam}/{tag}/log_probs"), \
        f"{fam} {tag}: max |log-prob diff| = {lp_err}"


@pytest.mark.parametrize("tp,pp", LAYOUTS, ids=[f"tp{t}pp{p}" for t, p in LAYOUTS])
def test_logits_match_transformers(family_dirs, tmp_path, tp, pp):
    torchrun("parity_worker.py", tp * pp, "--tp", str(tp), "--pp", str(pp),
             "--data", str(family_dirs), "--out", str(tmp_path), "--families", *FAMILIES)
    tokens = torch.load(family_dirs / "tokens.pt")
    for fam in FAMILIES:
        ref_logits, ref_lp = _reference(str(family_dirs / fam), tokens)
        got = torch.load(tmp_path / f"{fam}_tp{tp}_pp{pp}.pt")
        _check_transformers_parity(got, ref_logits, ref_lp, fam, f"tp{tp}pp{pp}")
        # without sequence parallelism every layer hands the next the whole sequence, [s, b, h]
        # (the negative control of the sequence-parallel test's [s/tp, b, h])
        assert {s[0] for s in got["layer_output_shapes"]} == {tokens.shape[1]}, got["layer_output_shapes"]
        if pp > 1:  # one pipelined schedule call over micro-batches of differing shapes, padded and packed
            assert got["pipelined_equals_alone"] == [True] * 6, got["pipelined_equals_alone"]
        # packed forward-only passes (algo.pack_sequences) equal the padded ones at every layout:
        # one implementation, the GEMMs see other shapes (one packed row vs padded rows)
        pk_err = (got["packed_log_probs"] - got["padded_log_probs"]).abs().max().item()
        assert got["padded_log_probs"].ne(0).any() and within(
            pk_err, LAYOUT_FP32_LOGPROB, f"model_parity/{fam}/tp{tp}pp{pp}/packed_vs_padded"), \
            f"{fam} tp={tp} pp={pp}: max |packed - padded log-prob| = {pk_err}"


@pytest.mark.parametrize("tp,pp", SP_LAYOUTS, ids=[f"tp{t}pp{p}sp" for t, p in SP_LAYOUTS])
def test_sequence_parallel_logits_and_values(family_dirs, tmp_path, tp, pp):
    """Under sequence parallelism (the 19-token rows padded to a multiple of tp and trimmed back)
    the logits and log-probs are transformers' as at every other layout; a value-head model's
    values (its head all-gathers the [s/tp, b, h] hidden states) equal those of the same model
    without it."""
    torchrun("parity_worker.py", tp * pp, "--tp", str(tp), "--pp", str(pp), "--sp",
             "--data", str(family_dirs), "--out", str(tmp_path), "--families", *FAMILIES)
    tokens = torch.load(family_dirs / "tokens.pt")
    for fam in FAMILIES:
        ref_logits, ref_lp = _reference(str(family_dirs / fam), tokens)
        got = torch.load(tmp_path / f"{fam}_tp{tp}_pp{pp}_sp.pt")
        _check_transformers_parity(got, ref_logits, ref_lp, fam, f"tp{tp}pp{pp}sp")
        # the feature ran: between layers each TP rank held its 1/tp of the (padded) sequence
        shapes = got["layer_output_shapes"]
        assert shapes and {s[0] for s in shapes} == {-(-tokens.shape[1] // tp)}, shapes
        lengths = torch.tensor([19, 4, 11, 1, 16])
        keep = torch.arange(18)[None, :] < (lengths - 1)[:, None]
        pad_err = (got["padded_log_probs"] - ref_lp).abs()[keep].max().item()
        assert within(pad_err, NET_FP32_LOGPROB, f"model_parity/{fam}/tp{tp}pp{pp}sp/padded_log_probs"), pad_err
        if pp > 1:
            assert got["pipelined_equals_alone"] == [True] * 5, got["pipelined_equals_alone"]
        # one implementation, the same weights: the GEMMs see other shapes (the sequence split)
        v_err = (got["values_sp"] - got["values"]).abs().max().item()
        assert got["values"].ne(0).any() and within(v_err, LAYOUT_FP32_LOGPROB,
                                                      f"model_parity/{fam}/tp{tp}pp{pp}sp/values"), v_err


def test_parity_catches_a_mapping_mistake(family_dirs, megatron_world):
    """The negative control of the parity tests: the same checkpoint loaded by the same code, then
    one query group's K and V blocks of layer 0 exchanged in megatron's fused QKV (what a wrong
    de-interleave would do): the logits leave transformers' by far more than the tolerance."""
    from megarl.models.megatron_ckpt import load_model
    from megarl.models.weights import unwrap
    from tests._logits import full_logits

    tokens = torch.load(family_dirs / "tokens.pt")
    ref_logits, _ = _reference(str(family_dirs / "llama"), tokens)
    model = load_model(str(family_dirs / "llama"))
    with torch.no_grad():
        ok = (full_logits(model, tokens) - ref_logits).abs().max().item()
        spec = unwrap(model).megarl_spec
        hpg, hd = spec.num_attention_heads // spec.num_query_groups, spec.head_dim
        w = unwrap(model).decoder.layers[0].self_attention.linear_qkv.weight
        k, v = slice(hpg * hd, (hpg + 1) * hd), slice((hpg + 1) * hd, (hpg + 2) * hd)  # group 0: [q..; k; v]
        w[k], w[v] = w[v].clone(), w[k].clone()
        wrong = (full_logits(model, tokens) - ref_logits).abs().max().item()
    assert within(ok, NET_FP32_LOGPROB, "model_parity/negative_control/as_loaded"), ok
    assert wrong > 100 * NET_FP32_LOGPROB, wrong
