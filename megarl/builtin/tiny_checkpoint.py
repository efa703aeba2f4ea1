"""Tiny random HF checkpoints of each supported family, made locally with ``transformers``.

The embedded default job and the tests use these: nothing is downloaded.  A real run points
``model.path`` at a real checkpoint instead.
"""

from __future__ import annotations

import os
from typing import Optional

import torch

FAMILIES = ("llama", "qwen2", "qwen3", "mistral")
#: the mixture-of-experts families (4 experts, top-2 by default): Qwen3-MoE (q/k norm, top-k
#: renormalised), Qwen2-MoE (q/k/v bias, a shared expert behind a sigmoid gate, raw top-k
#: weights), Mixtral (block_sparse_moe w1/w2/w3) and DeepSeek-V3 (multi-latent attention, sigmoid
#: routing with an expert-score bias over groups, scaled weights, a shared expert, a first dense layer)
#: and GLM-4.5 (q/k/v bias, q/k norm, half the head rotary, DeepSeek-V3's routing)
MOE_FAMILIES = ("qwen3_moe", "qwen2_moe", "mixtral", "deepseek_v3", "glm4_moe")


def tiny_hf_config(family: str, vocab_size: int = 300, hidden_size: int = 64, num_layers: int = 2,
                   num_heads: int = 4, num_kv_heads: int = 2, intermediate_size: int = 128,
                   tie_word_embeddings: Optional[bool] = None, max_position_embeddings: int = 512,
                   **extra):
    """A transformers config of ``family`` with small dimensions (GQA on by default)."""
    import transformers

    common = dict(vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=intermediate_size,
                  num_hidden_layers=num_layers, num_attention_heads=num_heads,
                  num_key_value_heads=num_kv_heads, max_position_embeddings=max_position_embeddings,
                  rms_norm_eps=1e-6, bos_token_id=None, eos_token_id=None, pad_token_id=None)
    if family == "llama":
        cfg = transformers.LlamaConfig(**common, tie_word_embeddings=bool(tie_word_embeddings),
                                       **extra)
    elif family == "qwen2":
        cfg = transformers.Qwen2Config(
            **common, tie_word_embeddings=True if tie_word_embeddings is None else tie_word_embeddings,
            **extra)
    elif family == "qwen3":
        cfg = transformers.Qwen3Config(**common, head_dim=hidden_size // num_heads,
                                       tie_word_embeddings=bool(tie_word_embeddings), **extra)
    elif family == "mistral":
        cfg = transformers.MistralConfig(**common, sliding_window=None,
                                         tie_word_embeddings=bool(tie_word_embeddings), **extra)
    elif family in MOE_FAMILIES:
        moe = dict(num_experts_per_tok=extra.pop("num_experts_per_tok", 2))
        experts = extra.pop("num_experts", 4)
        tie = bool(tie_word_embeddings)
        if family == "deepseek_v3":
            # every head its own key and value (MLA): num_kv_heads does not apply; two groups of
            # experts, one chosen (DeepSeek's group score, the two best, is megatron's at top-2)
            common["num_key_value_heads"] = num_heads
            mla = dict(kv_lora_rank=16, q_lora_rank=24, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=12,
                       n_group=2, topk_group=1, first_k_dense_replace=1 if num_layers > 1 else 0,
                       n_shared_experts=1, routed_scaling_factor=2.5, num_nextn_predict_layers=0)
            mla.update({k: extra.pop(k) for k in list(extra) if k in mla})
            cfg = transformers.DeepseekV3Config(**common, n_routed_experts=experts, tie_word_embeddings=tie,
                                                moe_intermediate_size=extra.pop("moe_intermediate_size",
                                                                                intermediate_size // 2),
                                                **moe, **mla, **extra)
        elif family == "glm4_moe":
            glm = dict(n_group=2, topk_group=1, first_k_dense_replace=1 if num_layers > 1 else 0, n_shared_experts=1,
                       routed_scaling_factor=2.5, num_nextn_predict_layers=0, attention_bias=True, use_qk_norm=True,
                       partial_rotary_factor=0.5)
            glm.update({k: extra.pop(k) for k in list(extra) if k in glm})
            cfg = transformers.Glm4MoeConfig(**common, head_dim=hidden_size // num_heads, n_routed_experts=experts,
                                             tie_word_embeddings=tie,
                                             moe_intermediate_size=extra.pop("moe_intermediate_size",
                                                                             intermediate_size // 2),
                                             **moe, **glm, **extra)
        elif family == "mixtral":
            cfg = transformers.MixtralConfig(**common, num_local_experts=experts, sliding_window=None,
                                             tie_word_embeddings=tie, **moe, **extra)
        else:
            moe.update(num_experts=experts,
                       moe_intermediate_size=extra.pop("moe_intermediate_size", intermediate_size // 2),
                       norm_topk_prob=extra.pop("norm_topk_prob", family == "qwen3_moe"))
            if family == "qwen3_moe":
                cfg = transformers.Qwen3MoeConfig(**common, head_dim=hidden_size // num_heads,
                                                  tie_word_embeddings=tie, **moe, **extra)
            else:
                moe["shared_expert_intermediate_size"] = extra.pop("shared_expert_intermediate_size", intermediate_size)
                cfg = transformers.Qwen2MoeConfig(**common, tie_word_embeddings=tie, **moe, **extra)
    else:
        raise ValueError(f"unknown tiny family {family!r}; choose from {FAMILIES + MOE_FAMILIES}")
    return cfg


def make_tiny_hf_checkpoint(out_dir: str, family: str = "llama", seed: int = 0,
                            value_head: bool = False, tokenizer_dir: Optional[str] = None,
                            sequence_head: bool = False, pad_token_id: Optional[int] = None,
                            dtype: torch.dtype = torch.float32, **config_kwargs) -> str:
    """Create a random HF checkpoint (``save_pretrained``, safetensors in ``dtype``) in ``out_dir``.

    Non-zero random norms and biases so that every mapped tensor matters in parity tests.
    """
    import transformers

    cfg = tiny_hf_config(family, **config_kwargs)
    if pad_token_id is not None:  # where a sequence-classification head reads its score
        cfg.pad_token_id = pad_token_id
    torch.manual_seed(seed)
    if sequence_head:  # a reward model's usual head: the score at the last non-pad token
        cfg.num_labels = 1
        model = transformers.AutoModelForSequenceClassification.from_config(cfg)
    elif value_head:
        cfg.num_labels = 1
        model = transformers.AutoModelForTokenClassification.from_config(cfg)
    else:
        model = transformers.AutoModelForCausalLM.from_config(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith("layernorm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            elif name.endswith(".bias"):
                p.copy_(0.05 * torch.randn_like(p))
            elif name.endswith(("mlp.gate.weight", "block_sparse_moe.gate.weight", "shared_expert_gate.weight")):
                # routers (and the shared expert's gate): decisive, far from ties between experts
                p.copy_(torch.randn_like(p))
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # DeepSeek-V3: the bias moves some choices
                b.copy_(0.1 * torch.randn_like(b))
    model = model.to(dtype)
    os.makedirs(out_dir, exist_ok=True)
    model.save_pretrained(out_dir, safe_serialization=True)
    if tokenizer_dir:
        from megarl.models.safetensors_io import copy_tokenizer_files

        copy_tokenizer_files(tokenizer_dir, out_dir)
    return out_dir


def write_random_hf_checkpoint(out_dir: str, config: dict, seed: int = 0, std: float = 0.02,
                               dtype: torch.dtype = torch.float32, max_shard_bytes: int = 2 * 1024**3) -> float:
    """Write a random HF checkpoint for ``config`` (an HF config dict) straight to safetensors,
    tensor by tensor (no transformers model is built, so multi-GB checkpoints are cheap).
    Norm weights are 1.  Returns the size in GB."""
    from megarl.models import mapping
    from megarl.models.hf_config import spec_from_hf_config
    from megarl.models.safetensors_io import write_hf_checkpoint

    spec = spec_from_hf_config(config)
    shapes = mapping.hf_shapes(spec)
    g = torch.Generator().manual_seed(seed)

    def tensors():
        for name, shape in shapes.items():
            if name.endswith("norm.weight") or name.endswith("layernorm.weight"):
                yield name, torch.ones(shape, dtype=dtype)
            else:
                yield name, (torch.randn(shape, generator=g) * std).to(dtype)

    write_hf_checkpoint(out_dir, tensors(), config, max_shard_bytes=max_shard_bytes)
    return sum(int(torch.Size(s).numel()) for s in shapes.values()) * torch.tensor([], dtype=dtype).element_size() / 1024**3
