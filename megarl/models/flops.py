"""Model FLOPs of a training step, for model FLOPs utilisation (MFU).

The PaLM convention (Chowdhery et al. 2022, "PaLM: Scaling Language Modeling with Pathways",
Appendix B): a token of a sequence of length T costs ``6 N + 12 L H Q T`` FLOPs in a forward and
backward pass, N the parameters its matrix multiplications touch (attention and MLP projections
and the output layer: no embedding lookup, norm or bias), L the layers, H the attention heads and
Q the head dimension (multi-latent attention: the mean of its query/key and value widths, and N
its latent projections); the second term is the attention scores and their weighted sum, counted in
full (not halved for the causal mask) as PaLM counts it.  A mixture-of-experts layer touches its
router, its shared expert and ``top_k`` routed experts per token.  MFU is these FLOPs over the
step's seconds times the devices' declared peak (``trainer.peak_flops``): recomputed activations
and padding are not model FLOPs, so they count against it.
"""

from __future__ import annotations

from typing import Iterable

__all__ = ["matmul_params_per_token", "train_flops"]


def matmul_params_per_token(spec, vocab_size: int) -> int:
    """N: the weights one token's forward multiplies by (``vocab_size``: the output layer's rows,
    the padded vocabulary; a value head's one row instead)."""
    h, d = spec.hidden_size, spec.head_dim
    q, kv = spec.num_attention_heads * d, spec.num_query_groups * d
    attn = h * (q + 2 * kv) + q * h
    mla = getattr(spec, "mla", None)
    if mla is not None:  # the down and up projections of the q and kv latents, and o
        n = spec.num_attention_heads
        attn = (h * n * d if mla.q_lora_rank is None else (h + n * d) * mla.q_lora_rank)
        attn += h * (mla.kv_lora_rank + mla.qk_rope_head_dim) + mla.kv_lora_rank * n * (mla.qk_nope_head_dim
                                                                                     + mla.v_head_dim)
        attn += n * mla.v_head_dim * h
    moe = getattr(spec, "moe", None)
    n = 0
    for i in range(spec.num_layers):
        if moe is not None and moe.moe_layers[i]:
            n += attn + moe.num_experts * h + 3 * h * (moe.shared_expert_ffn_hidden_size or 0)
            n += h if moe.shared_expert_gate else 0
            n += moe.top_k * 3 * h * moe.ffn_hidden_size
        else:
            n += attn + 3 * h * spec.ffn_hidden_size  # SwiGLU: gate, up, down
    return n + (h if spec.value_head else vocab_size * h)


def train_flops(spec, vocab_size: int, lengths: Iterable[int]) -> float:
    """``sum_T (6 N + 12 L H Q T) T`` over sequences of ``lengths`` tokens (one forward and
    backward of each)."""
    n = matmul_params_per_token(spec, vocab_size)
    lhq = spec.num_layers * spec.num_attention_heads * spec.head_dim
    mla = getattr(spec, "mla", None)
    if mla is not None:  # scores over q_head_dim, the weighted sum over v_head_dim: 6 L H (Q + V) T
        lhq = spec.num_layers * spec.num_attention_heads * (spec.head_dim + mla.v_head_dim) / 2
    return float(sum((6 * n + 12 * lhq * t) * t for t in lengths))
