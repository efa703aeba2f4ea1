"""GLM-4.5 and DeepSeek-V3 (issue 60, item 3) on the real SGLang engine on CPU, their weights streamed
from the megatron actor by megarl's own weight sync.

* GLM-4.5 (``Glm4MoeForCausalLM``: q/k/v bias, q/k norm, half of each head rotary, sigmoid routing
  with the expert bias over groups, a shared expert, a first dense layer): SGLang serves it on CPU;
  its teacher-forced log-probs equal transformers' on the same checkpoint within the fp32
  tolerance, and after the actor moves and syncs again, they are the new weights' (negative
  control: >100x off the old ones).
* DeepSeek-V3 (multi-latent attention): SGLang fuses each layer's ``q_a_proj`` and
  ``kv_a_proj_with_mqa`` into one parameter from a single load call; megarl streams the pair in one
  bucket, and the verified load passes.  Negative control: the pair split over two buckets leaves
  the fused parameter unwritten, and megarl's check after the load names it.  What SGLang's CPU
  path cannot do: run multi-latent attention -- its torch-native attention backend reads MLA's
  latent KV cache as per-head keys (a shape error at the first prefill), and the CPU MLA kernels
  are Intel AMX ones; DeepSeek-V3's serving rows are in tests/gpu/run.sh (docs/gpu.md).
"""

from __future__ import annotations

import pytest
import torch

from megarl.rollout import sglang_cpu
from megarl.rollout.sglang_backend import SGLangRolloutEngine, WeightsNotWrittenError
from tests._tolerance import NET_FP32_LOGPROB
from tests.sglang_real._engine import EOS, MegatronActor, load

PROMPTS = [[2, 10 + i, 11, 12 + i, 40 + 3 * i] for i in range(3)]
RESPONSES = [[5, 6, 7, 8], [9, 10, 11], [12, 13]]
SMALL = dict(vocab_size=320, hidden_size=64, intermediate_size=128, num_heads=4, max_position_embeddings=320)


def _engine(model_dir):
    return SGLangRolloutEngine(model_dir, eos_token_ids=[EOS], dtype="float32", device="cpu",
                               engine_kwargs=sglang_cpu.engine_kwargs(4096))


def _transformers_log_probs(model_dir):
    import transformers

    m = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    out = []
    for p, r in zip(PROMPTS, RESPONSES, strict=True):
        with torch.no_grad():
            logits = m(torch.tensor([p + r])).logits.float()
        out.append(torch.log_softmax(logits, -1)[0, len(p) - 1:-1].gather(-1, torch.tensor(r)[:, None])[:, 0])
    return out


def test_glm4_5_is_served_by_sglang_on_cpu_as_transformers_computes_it(megatron_world, tmp_path):
    from megarl.builtin.tiny_checkpoint import make_tiny_hf_checkpoint
    from megarl.models.weights import export_hf

    d = make_tiny_hf_checkpoint(str(tmp_path / "glm"), "glm4_moe", seed=7, num_kv_heads=2, **SMALL)
    actor = MegatronActor(d)
    engine = _engine(d)
    try:
        load(engine, actor)
        _, served = engine.teacher_force(PROMPTS, RESPONSES)
        ref = _transformers_log_probs(d)
        err = max(float((s - r).abs().max()) for s, r in zip(served, ref, strict=True))
        assert err < NET_FP32_LOGPROB, err
        actor.perturb(scale=0.05, seed=3)  # the actor trains; the engine serves the new weights
        load(engine, actor)
        _, moved = engine.teacher_force(PROMPTS, RESPONSES)
        export_hf(actor.model, str(tmp_path / "moved"))
        now = _transformers_log_probs(str(tmp_path / "moved"))
        err = max(float((s - r).abs().max()) for s, r in zip(moved, now, strict=True))
        assert err < NET_FP32_LOGPROB, err
        gap = max(float((s - r).abs().max()) for s, r in zip(moved, ref, strict=True))
        assert gap > 100 * NET_FP32_LOGPROB, gap  # negative control: not the old weights'
    finally:
        engine.shutdown()


def test_deepseek_v3_down_projections_load_fused_in_sglang_only_together(megatron_world, tmp_path, monkeypatch):
    from megarl.builtin.tiny_checkpoint import make_tiny_hf_checkpoint

    # SGLang's CPU rotary for DeepSeek-V2/V3 takes YaRN only, and its model reads the keys DeepSeek's own
    # config.json carries (transformers' DeepseekV3Config does not write them)
    yarn = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0, "original_max_position_embeddings": 8,
            "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}
    d = make_tiny_hf_checkpoint(str(tmp_path / "dsv3"), "deepseek_v3", seed=7, rope_parameters=yarn,
                                moe_layer_freq=1, topk_method="noaux_tc", scoring_func="sigmoid", **SMALL)
    actor = MegatronActor(d)
    engine = _engine(d)
    try:
        version = load(engine, actor)  # buckets of 16 KiB: the pair of each layer stays together
        assert engine.active_version == version
        # negative control: the pair split over two buckets -- the fused parameter is not written
        v, manifest = actor.commit(engine.dtype)
        monkeypatch.setattr(engine, "verify_writes", "every")
        named = actor.tensors(engine.dtype)
        q_a = [i for i, (n, _) in enumerate(named) if n.endswith("self_attn.q_a_proj.weight")]
        assert q_a and all(named[i + 1][0].endswith("kv_a_proj_with_mqa.weight") for i in q_a)
        split = [named[:q_a[0] + 1], named[q_a[0] + 1:]]  # layer 0's pair cut between two load calls
        with pytest.raises(WeightsNotWrittenError, match=r"model\.layers\.0\.self_attn\.fused_qkv_a_proj_with_mqa"):
            engine.load_weights(v, iter(split), manifest)
    finally:
        engine.shutdown()
