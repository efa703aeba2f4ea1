"""megarl's SGLang backend against the real SGLang engine (the pin of docker/requirements-gpu.txt),
on CPU, with the megatron actor as the trainer side.

One engine per dtype serves the module (an ``Engine()`` start costs 15-60 s here).  The actor is
a tiny random Llama loaded into megatron (TP=PP=1, gloo); its weights reach the engine only
through the backend's stream (the engine starts from dummy weights).
"""

from __future__ import annotations

import os
import types

import pytest
import torch

from megarl.hashing import json_sha256
from megarl.rollout import sglang_cpu
from megarl.rollout.protocol import GenerationRequest, NoActiveVersionError, SamplingParams
from megarl.rollout.sglang_backend import SGLangRolloutEngine
from megarl.rollout.sglang_cpu import mends
from megarl.rollout.weight_stream import TensorManifest, iter_buckets
from megarl.versions import PolicyVersion
from tests._tolerance import NET_FP32_LOGPROB

EOS = 3
PROMPTS = [GenerationRequest(f"p{i}", (2, 10 + i, 11, 12 + i, 40 + 3 * i)) for i in range(4)]
# one fp32 network, two implementations (SGLang's torch-native layers and SDPA against megatron's
# local layers): tests/_tolerance.py's budget; 4.8e-7 was observed against transformers
FP32_TOL = NET_FP32_LOGPROB


def _config(tmp):
    from transformers import AutoModelForCausalLM, LlamaConfig

    cfg = LlamaConfig(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, bos_token_id=2,
                      eos_token_id=EOS, pad_token_id=0, tie_word_embeddings=False, initializer_range=0.1,
                      architectures=["LlamaForCausalLM"])
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).save_pretrained(tmp)
    return str(tmp)


class MegatronActor:
    """The trainer side: the megatron model, its HF-named stream and its versions."""

    def __init__(self, path):
        from megarl.models.megatron_ckpt import load_model

        self.path = path
        self.model = load_model(path)
        self.step = 0

    def tensors(self, dtype=None):
        from megarl.models.weights import iter_hf_tensors

        return list(iter_hf_tensors(self.model, dtype=dtype))

    def commit(self, dtype=None):
        """The next version, its manifest and its tensors (cast to the engine's ``dtype``, as
        megarl's weight sync sends them)."""
        named = self.tensors(dtype)
        manifest = TensorManifest.from_named_tensors(named)
        version = PolicyVersion(run_id="sglang-cpu", optimizer_step=self.step, update_attempt=0,
                                weight_manifest_hash=manifest.global_hash,
                                tokenizer_hash=json_sha256({"tokenizer": "none"}),
                                model_config_hash=json_sha256({"path": "tiny"}))
        self.step += 1
        return version, manifest, named

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
        from megarl.models.forward import full_logits

        return max(float(full_logits(self.model, torch.tensor([list(r.prompt_ids) + list(r.response_ids)])).abs().max())
                   for r in results)


def load(engine, actor):
    version, manifest, named = actor.commit(engine.dtype)
    engine.load_weights(version, iter_buckets(named, 16 << 10), manifest)
    engine.activate(version)
    return version


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return _config(tmp_path_factory.mktemp("tiny_llama"))


@pytest.fixture(scope="module")
def actor(megatron_world, model_dir):
    return MegatronActor(model_dir)


@pytest.fixture(scope="module")
def engine(model_dir):
    e = SGLangRolloutEngine(model_dir, eos_token_ids=[EOS], dtype="float32", device="cpu",
                            engine_kwargs=sglang_cpu.engine_kwargs(4096))
    yield e
    e.shutdown()


# ---- the CPU mends -------------------------------------------------------------------------------


def test_the_cpu_mends_hold_against_the_installed_sglang():
    import importlib.util

    import sgl_kernel

    # the stand-in shadows the installed CUDA kernel package, and SGLang's allocator calls it
    assert getattr(sgl_kernel, "STAND_IN", False), sgl_kernel.__file__
    assert os.path.dirname(os.path.dirname(sgl_kernel.__file__)) == sglang_cpu.PYTHONPATH_DIR
    assert importlib.util.find_spec("sglang") is not None
    from sglang.srt.mem_cache import allocation

    assert allocation.assign_req_to_token_pool_cpu is sgl_kernel.assign_req_to_token_pool_cpu
    # its one real kernel, on a golden example: request 0 -> row 2 [1:3], request 1 -> row 0 [0:3]
    table = torch.zeros(3, 5, dtype=torch.int32)
    sgl_kernel.assign_req_to_token_pool_cpu(torch.tensor([2, 0]), table, torch.tensor([1, 0]), torch.tensor([3, 3]),
                                            torch.tensor([7, 8, 9, 10, 11]), 5)
    assert torch.equal(table, torch.tensor([[9, 10, 11, 0, 0], [0, 0, 0, 0, 0], [0, 7, 8, 0, 0]], dtype=torch.int32))
    with pytest.raises(NotImplementedError, match="verify_tree_greedy_cpu"):
        sgl_kernel.verify_tree_greedy_cpu()
    # no CUDA device: the device module is torch.cpu, the host registration a no-op
    assert torch.get_device_module() is torch.cpu and torch.get_device_module.__megarl_mend__
    from sglang.srt.mem_cache.pool_host import common

    assert common._cuda_host_register.__megarl_mend__
    assert common._cuda_host_register(torch.zeros(4), 4096) is None
    # negative control: a release without the target is named, not silently passed over
    with pytest.raises(mends.AccommodationError, match="_cuda_host_register is gone"):
        mends._mend_host_register(types.SimpleNamespace())
    assert sglang_cpu.engine_kwargs(123)["max_total_tokens"] == 123


# ---- the backend's contracts ---------------------------------------------------------------------


def test_raw_log_probs_equal_the_megatron_actors_greedy_and_sampled(engine, actor):
    load(engine, actor)
    greedy = engine.generate(PROMPTS, SamplingParams(temperature=0.0, max_new_tokens=8))
    sampled = engine.generate(PROMPTS, SamplingParams(temperature=0.7, top_p=0.9, max_new_tokens=8, n=2))
    assert len(sampled) == 2 * len(PROMPTS)
    worst = 0.0
    for r in greedy + sampled:
        assert len(r.response_ids) > 0 and r.raw_log_probs.shape == (len(r.response_ids),)
        worst = max(worst, float((r.raw_log_probs - actor.log_probs(r)).abs().max()))
    assert worst < FP32_TOL, worst
    # negative control: at T=0.7 the tempered log-probs are another space, far outside the tolerance
    gap = max(float((r.raw_log_probs - actor.log_probs(r, temperature=0.7)).abs().max()) for r in sampled)
    assert gap > 100 * FP32_TOL, gap


def test_a_weight_update_changes_what_the_engine_serves_and_survives_sleep(engine, actor):
    v0 = load(engine, actor)
    greedy = SamplingParams(temperature=0.0, max_new_tokens=8)
    before = engine.generate(PROMPTS, greedy)
    assert all(r.policy_version == v0.short_id for r in before)
    actor.perturb(scale=0.3, seed=7)
    v1 = load(engine, actor)
    after = engine.generate(PROMPTS, greedy)
    assert [r.response_ids for r in after] != [r.response_ids for r in before], "the engine still serves v0"
    assert all(r.policy_version == v1.short_id for r in after)
    assert max(float((r.raw_log_probs - actor.log_probs(r)).abs().max()) for r in after) < FP32_TOL
    # released weights are gone: nothing is served until a version is loaded again
    engine.sleep()
    assert engine.active_version is None
    engine.wake()
    with pytest.raises(NoActiveVersionError):
        engine.generate(PROMPTS, greedy)
    load(engine, actor)
    again = engine.generate(PROMPTS, greedy)
    assert [r.response_ids for r in again] == [r.response_ids for r in after]


def test_a_new_version_never_reads_the_old_versions_kv_cache(engine, actor, monkeypatch):
    """SGLang's radix (prefix) cache stays on: a prompt generated under v leaves its KV there; after
    v+1 is published the same prompt must be computed from v+1's weights, not v's cached prefix."""
    greedy = SamplingParams(temperature=0.0, max_new_tokens=8)
    long = [GenerationRequest("kv", tuple(range(20, 84)))]  # 64 prompt tokens: the prefix dominates

    def err(r):
        return float((r.raw_log_probs - actor.log_probs(r)).abs().max())

    load(engine, actor)
    engine.generate(long, greedy)  # v's KV of this prompt now sits in the radix cache
    actor.perturb(scale=0.3, seed=11)
    load(engine, actor)
    (fresh,) = engine.generate(long, greedy)
    assert err(fresh) < FP32_TOL, err(fresh)
    # negative control: the backend's flushes skipped, the same sequence serves v+1's cached prefix to v+2
    monkeypatch.setattr(engine, "flush_cache", lambda: None)
    actor.perturb(scale=0.3, seed=12)
    load(engine, actor)
    (stale,) = engine.generate(long, greedy)
    assert err(stale) > 100 * FP32_TOL, err(stale)
    monkeypatch.undo()
    engine.flush_cache()


def test_bf16_engine_log_probs_match_the_fp32_actor_within_bf16_rounding(megatron_world, model_dir):
    """A bf16 engine (the GPU default) against the fp32 actor on the same weights.  Each of the
    model's layers rounds its output to bf16 (unit roundoff u = 2^-8), and the weights themselves
    are rounded once: the logits carry about (layers + 1) * u * |logit| of error, and a log-prob
    twice that (the logit and the log-sum-exp).  The tolerance is twice that bound (measured: the
    error is ~1/7 of it); at T=0.5 the tempered log-probs (the wrong space) are off by about |logit|,
    far outside it."""
    from tests._tolerance import U

    actor = MegatronActor(model_dir)  # the initial weights: the module's actor was perturbed by the tests above
    e = SGLangRolloutEngine(model_dir, eos_token_ids=[EOS], dtype="bfloat16", device="cpu",
                            engine_kwargs=sglang_cpu.engine_kwargs(4096))
    try:
        assert e.dtype == torch.bfloat16
        load(e, actor)
        out = e.generate(PROMPTS, SamplingParams(temperature=0.0, max_new_tokens=8))
        out += e.generate(PROMPTS, SamplingParams(temperature=0.5, top_p=0.9, max_new_tokens=8, n=2))
    finally:
        e.shutdown()
    layers = 2
    tol = 2 * 2 * (layers + 1) * U[torch.bfloat16] * actor.logit_scale(out)
    worst = max(float((r.raw_log_probs - actor.log_probs(r)).abs().max()) for r in out)
    assert worst < tol, (worst, tol)
    gap = max(float((r.raw_log_probs - actor.log_probs(r, temperature=0.5)).abs().max()) for r in out[len(PROMPTS):])
    assert gap > 3 * tol, (gap, tol)
