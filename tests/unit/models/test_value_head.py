"""The scalar value-head variant (critic / neural reward model) matches transformers'
``*ForTokenClassification`` (num_labels=1) and round-trips through the mapping."""

import torch

from megarl.builtin.tiny_checkpoint import make_tiny_hf_checkpoint
from megarl.models import mapping
from megarl.models.forward import scalar_values
from megarl.models.hf_config import load_spec
from megarl.models.megatron_ckpt import load_model
from megarl.models.weights import iter_hf_tensors
from tests._tolerance import LAYOUT_FP32_LOGPROB, LAYOUT_FP32_VALUE, NET_FP32_LOGPROB, within


def test_value_head_parity_and_export(tmp_path, megatron_world):
    import transformers
    from safetensors.torch import load_file

    hf = make_tiny_hf_checkpoint(str(tmp_path / "critic"), "qwen2", seed=5, value_head=True)
    spec = load_spec(hf)
    assert spec.value_head and spec.architecture == "Qwen2ForTokenClassification"
    assert [r.hf_names for r in mapping.rules(spec)[-2:]] == [("score.weight",), ("score.bias",)]
    model = load_model(hf)
    tokens = torch.randint(0, 300, (3, 11))
    ref = transformers.AutoModelForTokenClassification.from_pretrained(hf).eval()
    with torch.no_grad():
        want = ref(tokens).logits[..., 0]
    got = scalar_values(model, tokens)
    # fp32 values, transformers vs megatron: two implementations of the same 2-layer network
    err = (got - want).abs().max().item()
    assert within(err, NET_FP32_LOGPROB, "value_head/vs_transformers"), err
    src = load_file(f"{hf}/model.safetensors")
    out = dict(iter_hf_tensors(model))
    assert set(out) == set(src)
    for k in src:
        assert torch.equal(out[k], src[k]), k


def test_length_sorted_micro_batches_equal_one_row_at_a_time(tmp_path, megatron_world):
    """Forward-only passes group rows of similar length and skip the padding after each row:
    every real position equals the row run alone at its own length, the rest is 0."""
    from megarl.models.forward import response_log_probs, right_align, teacher_forced_log_probs

    hf = make_tiny_hf_checkpoint(str(tmp_path / "actor"), "llama", seed=3)
    model = load_model(hf)
    g = torch.Generator().manual_seed(0)
    B, P, R = 7, 6, 5
    plen = torch.tensor([6, 1, 3, 6, 2, 4, 5])
    rlen = torch.tensor([5, 0, 2, 1, 5, 3, 4])
    prompt = torch.randint(1, 300, (B, P), generator=g)
    response = torch.randint(1, 300, (B, R), generator=g)
    attn = torch.zeros(B, P + R, dtype=torch.long)
    for b in range(B):
        attn[b, P - plen[b]:P + rlen[b]] = 1
        response[b, rlen[b]:] = 0
    tokens, pl, rl = right_align(prompt, response, attn)
    lengths = pl + rl
    sorted_lp = teacher_forced_log_probs(model, tokens, micro_batch_size=3, lengths=lengths)
    full_lp = teacher_forced_log_probs(model, tokens, micro_batch_size=3)
    assert sorted_lp.shape == full_lp.shape == (B, tokens.shape[1] - 1)
    for b in range(B):
        n = int(lengths[b]) - 1  # predicted positions of row b (0 for a lone prompt token)
        if n:
            alone = teacher_forced_log_probs(model, tokens[b:b + 1, :n + 1])[0]
            # one implementation; the GEMMs see other batch and sequence shapes (fp32, 2 layers)
            err = max(float((sorted_lp[b, :n] - alone).abs().max()), float((full_lp[b, :n] - alone).abs().max()))
            assert within(err, LAYOUT_FP32_LOGPROB, "value_head/sorted_vs_alone"), (b, err)
        assert not sorted_lp[b, n:].any()
    per_response = response_log_probs(model, prompt, response, attn, micro_batch_size=2)
    assert per_response.shape == (B, R) and not per_response[rlen[:, None] <= torch.arange(R)].any()
    values = scalar_values(model, tokens, 4, lengths=lengths)
    full = scalar_values(model, tokens, 4)
    for b in range(B):
        n = int(lengths[b])
        err = float((values[b, :n] - full[b, :n]).abs().max())
        assert within(err, LAYOUT_FP32_VALUE, "value_head/values_sorted_vs_full"), (b, err)
        assert not values[b, n:].any()
