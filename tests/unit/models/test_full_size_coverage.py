"""The full-size proof's coverage rule (megarl/commands/full_size.py): the slices the positions
read must tile each HF tensor along one dimension, or every reader reads it whole."""

from megarl.commands.full_size import _coverage

SHAPES = {"w": (8, 4), "norm": (4,)}


def test_a_tiling_and_a_whole_read_are_covered_once():
    assert _coverage(SHAPES, {"w": {(0, 0, 4), (0, 4, 8)}, "norm": {None}}) == []
    # data-parallel replicas read the same slices again: still once
    assert _coverage(SHAPES, {"w": {(0, 0, 4), (0, 4, 8), (0, 0, 4)}, "norm": {None}}) == []


def test_a_gap_an_overlap_a_mixed_read_and_an_unread_tensor_are_named():
    assert _coverage(SHAPES, {"w": {(0, 0, 3), (0, 4, 8)}, "norm": {None}}) == [
        "'w' [3:4] along dim 0 is read by no rank"]
    assert _coverage(SHAPES, {"w": {(0, 0, 5), (0, 4, 8)}, "norm": {None}}) == [
        "'w' [4:5] along dim 0 is read by two shards"]
    assert _coverage(SHAPES, {"w": {(0, 0, 4)}, "norm": {None}}) == ["'w' [4:8] along dim 0 is read by no rank"]
    assert _coverage(SHAPES, {"w": {(0, 0, 8), None}, "norm": {None}}) == [
        "'w' is read whole by some ranks and in slices by others"]
    assert _coverage(SHAPES, {"w": {(0, 0, 8), (1, 0, 4)}, "norm": {None}}) == ["'w' is sliced along dims [0, 1]"]
    assert _coverage(SHAPES, {"w": {(0, 0, 8)}}) == ["'norm' [4] is read by no rank"]


def test_sglang_shards_by_hand():
    """SGLang's cut of Qwen2-7B-shaped tensors (megarl/commands/engine_plan.py), hand-checked:
    28 query heads of 128 over 4 ranks are 7 heads a rank; Llama-3-8B's 8 KV heads over 16 ranks are one head
    each, replicated on two ranks; the vocabulary (152064, a multiple of 64) in 4 row ranges; a
    size that does not divide is refused naming rollout.tp."""
    import pytest

    from megarl.commands.engine_plan import engine_reads
    from megarl.config import ConfigError
    from megarl.models.hf_config import spec_from_hf_config

    spec = spec_from_hf_config({"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "vocab_size": 152064,
                                "hidden_size": 3584, "intermediate_size": 18944, "num_hidden_layers": 2,
                                "num_attention_heads": 28, "num_key_value_heads": 4, "tie_word_embeddings": False})
    at4 = engine_reads(spec, 4)
    assert at4["model.layers.0.self_attn.q_proj.weight"] == {(0, i * 896, (i + 1) * 896) for i in range(4)}
    assert at4["model.layers.0.self_attn.k_proj.weight"] == {(0, 0, 128), (0, 128, 256), (0, 256, 384), (0, 384, 512)}
    assert at4["model.layers.0.self_attn.o_proj.weight"] == {(1, i * 896, (i + 1) * 896) for i in range(4)}
    assert at4["model.embed_tokens.weight"] == {(0, i * 38016, (i + 1) * 38016) for i in range(4)}
    assert at4["model.layers.0.input_layernorm.weight"] == {None}
    from megarl.models.mapping import hf_shapes

    assert _coverage(hf_shapes(spec), at4) == []
    llama = spec_from_hf_config({"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 128256,
                                 "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 2,
                                 "num_attention_heads": 32, "num_key_value_heads": 8, "tie_word_embeddings": False})
    at16 = engine_reads(llama, 16)  # 8 KV heads over 16 ranks: each head on two ranks
    assert at16["model.layers.0.self_attn.v_proj.weight"] == {(0, h * 128, (h + 1) * 128) for h in range(8)}
    with pytest.raises(ConfigError, match=r"^rollout\.tp: SGLang splits num_attention_heads=28 over 8 ranks"):
        engine_reads(spec, 8)
