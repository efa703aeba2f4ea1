"""A transformers model in the actor's place: its logical tensors feed the weight stream.

The rollout engines' tests and the weight-sync benchmarks (bench/weight_sync.py,
bench/sglang_cpu.py) publish weights without building a megatron actor; in training the lead
replaces it with the megatron actor's gathered stream.  Nothing is downloaded.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from megarl.hashing import json_sha256
from megarl.rollout.weight_stream import TensorManifest, hf_logical_tensors
from megarl.versions import PolicyVersion

__all__ = ["tiny_llama_config", "HFActorStandIn"]


def tiny_llama_config(vocab_size: int = 320, hidden: int = 64, layers: int = 2, **overrides):
    from transformers import LlamaConfig

    kw = dict(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=hidden * 2,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        bos_token_id=2,
        eos_token_id=3,
        pad_token_id=0,
        tie_word_embeddings=False,
        architectures=["LlamaForCausalLM"],  # SGLang picks its model class by it
    )
    kw.update(overrides)
    return LlamaConfig(**kw)


@dataclass
class HFActorStandIn:
    """A transformers model playing the actor: it exports its config, commits versions with a
    manifest of its logical tensors, and streams them."""

    model: torch.nn.Module
    run_id: str
    tokenizer_hash: str

    @classmethod
    def create(cls, config, run_id: str = "test-run", tokenizer_hash: str | None = None, seed: int = 0, dtype=torch.float32):
        from transformers import AutoModelForCausalLM

        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=dtype).eval()
        return cls(model, run_id, tokenizer_hash or json_sha256({"tokenizer": "none"}))

    def export_config(self, out_dir: str | os.PathLike) -> str:
        self.model.config.save_pretrained(os.fspath(out_dir))
        return os.fspath(out_dir)

    def named_tensors(self):
        return list(hf_logical_tensors(self.model))

    def manifest(self) -> TensorManifest:
        return TensorManifest.from_named_tensors(self.named_tensors())

    def commit(self, optimizer_step: int, update_attempt: int = 0) -> tuple[PolicyVersion, TensorManifest]:
        manifest = self.manifest()
        version = PolicyVersion(
            run_id=self.run_id,
            optimizer_step=optimizer_step,
            update_attempt=update_attempt,
            weight_manifest_hash=manifest.global_hash,
            tokenizer_hash=self.tokenizer_hash,
            model_config_hash=json_sha256(self.model.config.to_dict()),
        )
        return version, manifest

    @torch.no_grad()
    def perturb(self, scale: float = 0.05, seed: int = 1) -> None:
        """Stand-in for an optimizer step: add seeded noise to every parameter."""
        g = torch.Generator().manual_seed(seed)
        for _, p in hf_logical_tensors(self.model):
            p.add_(torch.randn(p.shape, generator=g, dtype=torch.float32).to(p.dtype) * scale)


def tiny_moe_config(family: str, vocab_size: int = 64, hidden: int = 32, layers: int = 2, experts: int = 4,
                    top_k: int = 2, **overrides):
    """A tiny random MoE config of ``family`` (qwen3_moe, qwen2_moe, mixtral): hidden 32, 2 layers,
    4 experts, top-2 by default; a wide init so routing depends on the input."""
    from transformers import MixtralConfig, Qwen2MoeConfig, Qwen3MoeConfig

    kw = dict(vocab_size=vocab_size, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=4,
              num_key_value_heads=2, num_experts_per_tok=top_k, max_position_embeddings=256, bos_token_id=2,
              eos_token_id=3, pad_token_id=0, tie_word_embeddings=False, initializer_range=0.3)
    if family == "qwen3_moe":
        kw.update(num_experts=experts, moe_intermediate_size=16, intermediate_size=64, head_dim=hidden // 4)
        cls = Qwen3MoeConfig
        kw["architectures"] = ["Qwen3MoeForCausalLM"]
    elif family == "qwen2_moe":
        kw.update(num_experts=experts, moe_intermediate_size=16, shared_expert_intermediate_size=16, intermediate_size=64)
        cls = Qwen2MoeConfig
        kw["architectures"] = ["Qwen2MoeForCausalLM"]
    elif family == "mixtral":
        kw.update(num_local_experts=experts, intermediate_size=16)
        cls = MixtralConfig
        kw["architectures"] = ["MixtralForCausalLM"]
    else:
        raise ValueError(f"unknown MoE family {family!r}")
    kw.update(overrides)
    return cls(**kw)
