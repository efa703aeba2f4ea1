"""Shared by the real-engine tests: the tiny model, the megatron actor that plays the trainer, and
a load through megarl's weight stream."""

from __future__ import annotations

import torch

from megarl.hashing import json_sha256
from megarl.rollout.protocol import GenerationRequest
from tests._tolerance import NET_FP32_LOGPROB

EOS = 3
PROMPTS = [GenerationRequest(f"p{i}", (2, 10 + i, 11, 12 + i, 40 + 3 * i)) for i in range(4)]
# one fp32 network, two implementations (SGLang's torch-native layers and SDPA against megatron's
# local layers): tests/_tolerance.py's budget; 4.8e-7 was observed against transformers
FP32_TOL = NET_FP32_LOGPROB


def make_model_dir(tmp):
    from transformers import AutoModelForCausalLM, LlamaConfig

    cfg = LlamaConfig(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, bos_token_id=2,
                      eos_token_id=EOS, pad_token_id=0, tie_word_embeddings=False, initializer_range=0.1,
                      architectures=["LlamaForCausalLM"])
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).save_pretrained(tmp)
    return str(tmp)


class MegatronActor:
    """The trainer side: the megatron model, versioned and streamed by megarl's own weight sync
    (``megarl.rollout.weight_sync``), as the trainer does it."""

    def __init__(self, path):
        from megarl.models.megatron_ckpt import load_model

        self.path = path
        self.model = load_model(path)
        self.step = 0

    def tensors(self, dtype=None):
        from megarl.models.weights import iter_hf_tensors

        return list(iter_hf_tensors(self.model, dtype=dtype))

    def commit(self, dtype=None):
        """The next version and its manifest (checksums of the tensors cast to the engine's ``dtype``)."""
        from megarl.rollout.weight_sync import actor_manifest, make_version

        manifest = actor_manifest(self.model, dtype)
        version = make_version(self.model, manifest, "sglang-cpu", self.step, json_sha256({"tokenizer": "none"}))
        self.step += 1
        return version, manifest

    @torch.no_grad()
    def perturb(self, scale, seed):
        g = torch.Generator().manual_seed(seed)
        for p in self.model.parameters():
            p.add_(torch.randn(p.shape, generator=g).to(p.dtype) * scale)

    def log_probs(self, result, temperature=1.0):
        """Teacher-forced log-probs of the result's response tokens (fp32)."""
        from megarl.models.forward import teacher_forced_log_probs

        tokens = torch.tensor([list(result.prompt_ids) + list(result.response_ids)])
        lp = teacher_forced_log_probs(self.model, tokens, temperature=temperature)[0]
        return lp[len(result.prompt_ids) - 1:]

    def logit_scale(self, results):
        """The largest |logit| over the results' sequences (fp32)."""
        from tests._logits import full_logits

        return max(float(full_logits(self.model, torch.tensor([list(r.prompt_ids) + list(r.response_ids)])).abs().max())
                   for r in results)


def load(engine, actor):
    """Commit the actor's next version, stream it into ``engine`` the trainer's way (small buckets,
    so there are several), activate it."""
    from megarl.rollout.weight_sync import sync_actor_to_engine

    version, manifest = actor.commit(engine.dtype)
    sync_actor_to_engine(actor.model, engine, version, manifest, bucket_bytes=16 << 10)
    engine.activate(version)
    return version
