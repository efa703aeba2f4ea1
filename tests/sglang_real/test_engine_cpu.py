"""megarl's SGLang backend against the real SGLang engine (the pin of docker/requirements-gpu.txt),
on CPU, with the megatron actor as the trainer side.

One fp32 engine serves the module (an ``Engine()`` start costs 15-60 s here; the bf16 engine's
test is test_engine_bf16.py, which runs first: SGLang's ``Engine.shutdown()`` kills every child
process of its caller, so an engine shut down beside another takes the other's scheduler with it).  The actor is
a tiny random Llama loaded into megatron (TP=PP=1, gloo); its weights reach the engine only
through the backend's stream (the engine starts from dummy weights).
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import types

import pytest
import torch

from megarl.rollout import sglang_cpu
from megarl.rollout.protocol import GenerationRequest, NoActiveVersionError, SamplingParams
from megarl.rollout.sglang_backend import SGLangRolloutEngine, WeightsNotWrittenError
from megarl.rollout.sglang_cpu import mends
from megarl.rollout.weight_stream import TensorManifest, iter_buckets
from tests._dist import subprocess_env
from tests.sglang_real._engine import EOS, FP32_TOL, PROMPTS, MegatronActor, load, make_model_dir

# A fresh engine per HF export, in a child process (an engine's shutdown() kills every child of the
# process that started it, so fresh engines never share this one's process): SGLang's own loader
# reads the safetensors from disk, megarl's stream is not involved.
FRESH_ENGINES = """
import json, sys
from megarl.rollout import sglang_cpu
sglang_cpu.prepare()
import sglang
dirs, prompts, params = json.loads(sys.argv[1])
out = []
for d in dirs:
    engine = sglang.Engine(model_path=d, skip_tokenizer_init=True, load_format="auto", dtype="float32",
                           random_seed=0, log_level="error", **sglang_cpu.engine_kwargs(4096))
    out.append([r["output_ids"] for r in engine.generate(input_ids=prompts, sampling_params=[params] * len(prompts))])
    engine.shutdown()
print("FRESH " + json.dumps(out))
"""


def fresh_engine_outputs(export_dirs, prompts, max_new_tokens):
    params = {"temperature": 0.0, "max_new_tokens": max_new_tokens, "stop_token_ids": [EOS]}
    proc = subprocess.run([sys.executable, "-c", FRESH_ENGINES, json.dumps([export_dirs, prompts, params])],
                          capture_output=True, text=True, env=subprocess_env(), timeout=600)
    assert proc.returncode == 0, proc.stderr[-6000:]
    (line,) = [ln for ln in proc.stdout.splitlines() if ln.startswith("FRESH ")]
    return json.loads(line[len("FRESH "):])

@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_model_dir(tmp_path_factory.mktemp("tiny_llama"))


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


def test_every_synced_version_serves_what_a_fresh_engine_from_its_export_serves(engine, actor, tmp_path):
    """Three versions streamed into one engine through megarl's path (buckets, manifest, session,
    activate); after each, its greedy output equals that of a fresh engine that SGLang started from
    that version's HF export (megarl.models.weights.export_hf: what the trainer writes)."""
    from megarl.models.weights import export_hf

    greedy = SamplingParams(temperature=0.0, max_new_tokens=8)
    served, exports = [], []
    for k in range(3):
        if k:
            actor.perturb(scale=0.3, seed=20 + k)
        load(engine, actor)
        served.append([list(r.response_ids) for r in engine.generate(PROMPTS, greedy)])
        exports.append(str(tmp_path / f"v{k}"))
        export_hf(actor.model, exports[-1])
    fresh = fresh_engine_outputs(exports, [list(p.prompt_ids) for p in PROMPTS], greedy.max_new_tokens)
    for k in range(3):
        assert served[k] == fresh[k], f"version {k}: synced engine {served[k]} != fresh engine {fresh[k]}"
    # negative control: the versions are told apart, so a stale or partly written engine would fail
    assert served[1] != fresh[0] and served[2] != fresh[1]


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


def test_a_load_that_leaves_an_engine_parameter_unwritten_fails_naming_it(engine, actor, monkeypatch):
    """SGLang's Llama loader skips a name it has no parameter for.  A stream whose layer-1
    post-attention norm is renamed (and its manifest with it, so megarl's own checks pass) leaves
    that engine parameter as it was, while the update reports success."""
    load(engine, actor)
    version, _ = actor.commit(engine.dtype)
    named = actor.tensors(engine.dtype)
    bad = [(n.replace("layers.1.post_attention_layernorm", "layers.1.post_attention_layernorm_renamed"), t)
           for n, t in named]
    assert [n for n, _ in bad] != [n for n, _ in named]
    bad_manifest = TensorManifest.from_named_tensors(bad)
    bad_version = dataclasses.replace(version, weight_manifest_hash=bad_manifest.global_hash)
    monkeypatch.setattr(engine, "verify_writes", "every")
    with pytest.raises(WeightsNotWrittenError, match=r"left 1 of \d+ engine parameters unwritten.*"
                                                     r"model\.layers\.1\.post_attention_layernorm\.weight"):
        engine.load_weights(bad_version, iter_buckets(bad, 16 << 10), bad_manifest)
    assert engine.active_version is None and engine._versions.staged is None
    assert "post_attention_layernorm" in engine.last_load_error
    with pytest.raises(NoActiveVersionError):
        engine.generate(PROMPTS, SamplingParams(temperature=0.0, max_new_tokens=4))
    # negative control: without the check the same stream loads "successfully"
    monkeypatch.setattr(engine, "verify_writes", "never")
    engine.load_weights(bad_version, iter_buckets(bad, 16 << 10), bad_manifest)
    engine.activate(bad_version)
    # and a correct stream passes the check
    monkeypatch.setattr(engine, "verify_writes", "every")
    load(engine, actor)
    assert engine.active_version is not None


def test_agent_sessions_continue_from_token_ids_on_the_real_engine(engine, actor, tmp_path):
    """A multi-turn session on SGLang (megarl.rollout.agent): every turn is fed exactly the
    trajectory so far as ``input_ids``, and the policy tokens' raw log-probs equal the megatron
    actor's teacher-forced ones over the whole trajectory, environment tokens included."""
    from megarl.builtin.tiny_tokenizer import build_tiny_tokenizer
    from megarl.data.tokenizer import TokenizerContract
    from megarl.envs.render import EnvTurnRenderer
    from megarl.models.forward import teacher_forced_log_probs
    from megarl.rollout.agent import POLICY, AgentLimits, AgentSessionEngine, audit
    from tests.plugins.echo_tool import EchoTool

    load(engine, actor)
    # a stop token that prompt 0's greedy continuation reaches (the random model rarely emits EOS):
    # its first turn ends there, so its session takes a second turn after the tool's answer
    (first,) = engine.generate(PROMPTS[:1], SamplingParams(temperature=0.0, max_new_tokens=8))
    k = next(i for i in range(2, len(first.response_ids)) if first.response_ids[i] not in first.response_ids[:i])
    stop = first.response_ids[k]
    build_tiny_tokenizer(str(tmp_path / "tok"))
    contract = TokenizerContract.from_pretrained(str(tmp_path / "tok"))  # ids < 128: inside the vocabulary
    agent = AgentSessionEngine(engine, env_factory=EchoTool, renderer=EnvTurnRenderer(contract),
                               limits=AgentLimits(max_turns=3, max_total_tokens=48),
                               decode=lambda ids: " ".join(map(str, ids)), step_timeout_s=30.0, max_workers=4)
    reqs = [GenerationRequest(q.request_id, q.prompt_ids, task={}) for q in PROMPTS]
    results = agent.generate(reqs, SamplingParams(temperature=0.0, max_new_tokens=8, stop_token_ids=(stop,)))
    multi = [r for r in results if len(r.episode.generated) >= 2]
    assert multi, f"no session took a second turn: {[(r.request_id, r.finish_reason) for r in results]}"
    err, control = 0.0, 0.0
    for r in results:
        t = r.episode
        assert audit(t) == [], audit(t)
        for j, g in enumerate(t.generated):  # each turn was fed exactly the trajectory so far, as ids
            start = sum(len(x.response_ids) for x in t.generated[:j]) + sum(len(x) for x in t.rendered[:j])
            assert g.prompt_ids == t.prompt_ids + tuple(t.response_ids[:start]), f"{r.request_id}: turn {j} input"
        ids = torch.tensor([list(t.prompt_ids) + list(t.response_ids)])
        lp = teacher_forced_log_probs(actor.model, ids)[0, len(t.prompt_ids) - 1:]
        pol = torch.tensor(t.source) == POLICY
        err = max(err, float((lp[pol] - r.raw_log_probs[pol]).abs().max()))
        if len(t.generated) >= 2:  # negative control: the second turn scored without the tool's tokens
            kept = [tok for tok, s in zip(t.response_ids, t.source) if s == POLICY]
            lp_no_env = teacher_forced_log_probs(actor.model, torch.tensor([list(t.prompt_ids) + kept]))[0]
            lp_no_env = lp_no_env[len(t.prompt_ids) - 1:]
            second = torch.tensor(t.turn)[pol] >= 1
            control = max(control, float((lp_no_env[second] - r.raw_log_probs[pol][second]).abs().max()))
    assert err < FP32_TOL, f"agent trajectories: raw log-prob parity {err} >= {FP32_TOL}"
    assert control > 100 * FP32_TOL, control
