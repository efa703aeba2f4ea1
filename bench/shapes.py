"""Llama-shaped HF configs the benches build random checkpoints from (no weights downloaded)."""


def llama(vocab, hidden, layers, ffn, heads, kv_heads, **extra) -> dict:
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": vocab,
           "hidden_size": hidden, "intermediate_size": ffn, "num_hidden_layers": layers,
           "num_attention_heads": heads, "num_key_value_heads": kv_heads, "rms_norm_eps": 1e-5,
           "rope_theta": 10000.0, "max_position_embeddings": 2048, "tie_word_embeddings": False}
    cfg.update(extra)
    return cfg


#: the shape of configs/grpo_arith_tiny.yaml's built-in model (its word-level vocabulary is < 64)
TINY_RECIPE = llama(vocab=64, hidden=128, layers=4, ffn=256, heads=4, kv_heads=2)
#: about 0.98 B parameters
ONE_B = llama(vocab=32000, hidden=2048, layers=16, ffn=5504, heads=16, kv_heads=16)
#: about 0.3 B parameters
POINT_3B = llama(vocab=32000, hidden=1024, layers=16, ffn=4096, heads=16, kv_heads=16)
