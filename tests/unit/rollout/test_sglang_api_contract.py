"""SGLangRolloutEngine against the recorded API of the SGLang releases it declares (CPU).

Each ``docker/sglang_api/sglang-<v>.json`` is read from that release's source (the lower bound of
``setup.py``'s ``gpu`` extra and the version the Docker image pins); ``tests/sglang_fake.py``
builds an ``sglang`` package from it whose ``Engine`` enforces the release's rules: parameter
names, return shapes, the weight-update session (0.5.21+), the memory tags (resuming an
unreleased tag kills the caller), the accepted ServerArgs / sampling_params names, the bucket
layout and the serializer's class admission, the environment ``Engine()`` sets.  Everything of
megarl's is real: the backend, the manifest checks, the stream, the parser.  A version bump that
changes any of these fails here, before a GPU run.
"""

from __future__ import annotations

import json
import os
import re
import sys

import pytest
import torch

from tests.sglang_fake import FakeSGLang, SchedulerDied, load_description, recorded_versions

from megarl.rollout.protocol import (
    EngineAsleepError,
    FinishReason,
    GenerationRequest,
    InvalidRequestError,
    NoActiveVersionError,
    RolloutError,
    SamplingParams,
    candidate_seed,
)
from megarl.rollout.sglang_backend import SGLangRolloutEngine
from megarl.rollout.sglang_outputs import result_from_sglang_output, sglang_sampling_params
from megarl.rollout.sglang_release import (
    KV_CACHE,
    LOG_PROB_ENV_VARS,
    TRAINER_ENV_VARS,
    WEIGHTS,
    WeightUpdateRejectedError,
)
from megarl.rollout.weight_stream import ManifestMismatchError, iter_buckets
from megarl.builtin.hf_actor import HFActorStandIn, tiny_llama_config

from tests._dist import ROOT
VERSIONS = recorded_versions()
CONTRACT_EOS, MODEL_EXTRA_EOS, STOP = 3, 5, 7
PROMPTS = [GenerationRequest(f"p{i}", (2, 10 + i, 11, 12 + i)) for i in range(3)]
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=12)
BUCKET = 16 << 10  # several buckets for the tiny model


@pytest.fixture(params=VERSIONS)
def desc(request):
    return load_description(request.param)


@pytest.fixture
def fake(desc, monkeypatch):
    environ = dict(os.environ)  # Engine() writes the caller's environment; give it back after
    yield FakeSGLang(desc).install(monkeypatch)
    os.environ.clear()
    os.environ.update(environ)


@pytest.fixture
def model_dir(tmp_path):
    """An exported model dir whose generation_config adds an eos id the tokenizer contract lacks
    (as Qwen2.5-Instruct's does)."""
    config = tiny_llama_config(eos_token_id=CONTRACT_EOS)
    config.save_pretrained(tmp_path)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [CONTRACT_EOS, MODEL_EXTRA_EOS]}))
    return str(tmp_path)


@pytest.fixture
def actor():
    return HFActorStandIn.create(tiny_llama_config(eos_token_id=CONTRACT_EOS), dtype=torch.bfloat16)


def checksums_weights() -> bool:
    """The installed (fake) release's weight checker has the ``checksum`` action (0.5.23)."""
    checker = sys.modules["sglang"].Engine._fake.desc.get("weight_checker")
    return checker is not None and "checksum" in checker["actions"]


def make_engine(model_dir, **kw):
    kw.setdefault("eos_token_ids", [CONTRACT_EOS])
    # the write check (the backend's default) where the release can checksum its parameters;
    # the others refuse it at start (test_a_write_check_the_engine_cannot_do_is_refused_at_start)
    kw.setdefault("verify_writes", "first" if checksums_weights() else "never")
    return SGLangRolloutEngine(model_dir, device="cpu", **kw)


def load(engine, actor, step):
    version, manifest = actor.commit(step)
    report = engine.load_weights(version, iter_buckets(actor.named_tensors(), BUCKET), manifest)
    engine.activate(version)
    return version, report


def calls(fake_engine, *names):
    return [n for n, _ in fake_engine.calls if not names or n in names]


# ---- the recorded API has what the backend calls ------------------------------------------------


def test_recorded_releases_are_the_ends_of_the_declared_range():
    from tests._gpu_pins import gpu_extra_sglang_range, pinned_gpu_requirements

    low, high = VERSIONS[0], VERSIONS[-1]
    spec = gpu_extra_sglang_range()
    assert spec == f">={low},<{_next_minor(high)}" or set(str(spec).split(",")) == {f">={low}", f"<{_next_minor(high)}"}, (
        f"setup.py gpu extra declares sglang{spec}; the recorded releases are {VERSIONS}")
    assert pinned_gpu_requirements()["sglang"] == f"=={high}", "the Docker pin is the newest recorded release"


def _next_minor(v):
    major, minor, patch = (int(p) for p in v.split(".")[:3])
    return f"{major}.{minor}.{patch + 1}"


def test_engine_methods_and_arguments_the_backend_uses_exist(desc):
    m = desc["engine"]["methods"]
    used = {
        "update_weights_from_tensor": {"named_tensors", "load_format", "flush_cache"},
        "generate": {"input_ids", "sampling_params", "return_logprob"},
        "release_memory_occupation": {"tags"},
        "resume_memory_occupation": {"tags"},
        "flush_cache": set(),
        "shutdown": set(),
    }
    for method, args in used.items():
        assert method in m, f"SGLang {desc['sglang_version']} Engine has no {method}"
        assert args <= set(m[method]["params"]), f"{method}: {args - set(m[method]['params'])} not accepted"
    assert m["__init__"]["var_keyword"]  # Engine(**ServerArgs)
    ret = {k: v.get("returns", "").split(" (")[0] for k, v in m.items()}
    assert ret["update_weights_from_tensor"] == "Tuple[bool, str]"
    assert ret["flush_cache"] == "FlushCacheReqOutput"
    assert ret["release_memory_occupation"] == ret["resume_memory_occupation"] == "None"
    session = desc["weight_update_session"]
    if session["required_for_update_weights_from_tensor"]:
        assert session["methods"] == ["begin_weight_update", "end_weight_update"]
        assert ret["begin_weight_update"] == ret["end_weight_update"] == "Tuple[bool, str]"


def test_server_args_sampling_params_and_switches_the_backend_sends_exist(desc):
    fields = set(desc["server_args"]["fields"])
    sent = {"model_path", "tp_size", "base_gpu_id", "enable_memory_saver", "skip_tokenizer_init", "load_format",
            "dtype", "mem_fraction_static", "random_seed", "log_level", "enable_deterministic_inference",
            "ep_size"}  # ep_size: rollout.ep > 1 (megarl/control/placement.py)
    assert sent <= fields, sent - fields
    sp = sglang_sampling_params(SamplingParams(temperature=0.7, stop_token_ids=(STOP,)), 1, True, (CONTRACT_EOS,))
    assert set(sp) <= set(desc["sampling_params"]["fields"]), set(sp) - set(desc["sampling_params"]["fields"])
    assert "sampling_seed" in sp
    assert set(desc["raw_logprob_env"]["names"]) & set(LOG_PROB_ENV_VARS), desc["raw_logprob_env"]
    assert {KV_CACHE, WEIGHTS} <= set(desc["memory"]["tags"].values())
    assert desc["memory"]["resume_unreleased_tag_raises"] and desc["memory"]["scheduler_exception_kills_parent"]
    assert desc["flattened_bucket"]["module"] == "sglang.srt.weight_sync.tensor_bucket"
    assert desc["finish_reason"]["FINISH_MATCHED_TOKEN"] == {**desc["finish_reason"]["FINISH_MATCHED_TOKEN"],
                                                            "type": "stop", "keys": ["type", "matched"]}
    assert "generation_config.json eos_token_id" in desc["eos"]["engine_stops_on"]
    assert desc["sampling_seed"]["requires_enable_deterministic_inference"]
    trainer_facing = {k for k in desc["parent_env_overrides"]["vars"] if k.startswith(("NCCL_", "CUDA_DEVICE_MAX"))}
    assert trainer_facing <= set(TRAINER_ENV_VARS), trainer_facing - set(TRAINER_ENV_VARS)


# ---- load / activate / generate -------------------------------------------------------------------


def test_weights_from_the_stream_are_what_the_engine_serves(fake, desc, model_dir, actor):
    engine = make_engine(model_dir)
    assert engine.dtype == torch.bfloat16 and engine.log_prob_spaces == frozenset({"raw"})
    v0, report = load(engine, actor, 0)
    assert report.num_buckets > 1 and engine.active_version == v0
    g0 = engine.generate(PROMPTS, GREEDY)
    assert all(r.policy_version == v0.short_id and r.seed is None for r in g0)
    names = calls(fake.engine, "begin_weight_update", "update_weights_from_tensor", "end_weight_update", "flush_cache")
    if desc["weight_update_session"]["required_for_update_weights_from_tensor"]:
        assert names[0] == "begin_weight_update" and names.count("begin_weight_update") == 1
        assert names.index("end_weight_update") > max(i for i, n in enumerate(names) if n == "update_weights_from_tensor")
    else:
        assert "begin_weight_update" not in names
    assert fake.engine.session is None
    for _, kw in fake.engine.calls:
        assert kw.get("flush_cache", False) is False  # one flush after the whole update, not per bucket

    actor.perturb(scale=0.5, seed=3)
    v1, _ = load(engine, actor, 1)
    g1 = engine.generate(PROMPTS, GREEDY)
    assert [r.response_ids for r in g1] != [r.response_ids for r in g0], "the engine still serves v0"
    fresh = make_engine(model_dir)  # a fresh engine from the same version generates the same
    load(fresh, actor, 1)
    assert [r.response_ids for r in fresh.generate(PROMPTS, GREEDY)] == [r.response_ids for r in g1]
    assert all(r.policy_version == v1.short_id for r in g1)


def test_a_refused_update_fails_the_load_and_closes_the_session(fake, desc, model_dir, actor):
    engine = make_engine(model_dir)
    load(engine, actor, 0)
    fake.engine.fail_next_update = "Failed to update parameter online: shape mismatch"
    version, manifest = actor.commit(1)
    with pytest.raises(WeightUpdateRejectedError, match="shape mismatch"):
        engine.load_weights(version, iter_buckets(actor.named_tensors(), BUCKET), manifest)
    assert engine.active_version is None and "shape mismatch" in engine.last_load_error
    assert fake.engine.session is None, "a failed load must close the weight-update session"
    with pytest.raises(NoActiveVersionError, match="last load failed.*shape mismatch"):
        engine.generate(PROMPTS, GREEDY)
    load(engine, actor, 1)  # the next load works
    assert engine.generate(PROMPTS, GREEDY)


def test_without_the_session_every_update_is_refused_and_the_load_fails(fake, desc, model_dir, actor):
    """The 0.5.21+ rule itself: what happened before this backend opened a session (silently, as
    the answer was not checked).  A release without the rule has no session methods, and the
    backend loads there without one."""
    engine = make_engine(model_dir)
    version, manifest = actor.commit(0)
    if not desc["weight_update_session"]["required_for_update_weights_from_tensor"]:
        assert not engine._has_session and not hasattr(fake.engine, "begin_weight_update")
        engine.load_weights(version, iter_buckets(actor.named_tensors(), BUCKET), manifest)
        engine.activate(version)
        assert engine.active_version == version and engine.generate(PROMPTS, GREEDY)
        return
    engine._has_session = False  # the backend as it was: no begin/end around the updates
    with pytest.raises(WeightUpdateRejectedError, match=re.escape("begin_weight_update() and end_weight_update()")):
        engine.load_weights(version, iter_buckets(actor.named_tensors(), BUCKET), manifest)
    assert fake.engine.weights_state in ("dummy", "reset") and engine.active_version is None
    # (no update landed: "reset" is the write check's random values before the first one)


def test_a_corrupted_bucket_is_refused_before_any_hand_over(fake, model_dir, actor):
    engine = make_engine(model_dir)
    v0, _ = load(engine, actor, 0)
    g0 = engine.generate(PROMPTS, GREEDY)
    first = actor.named_tensors()[0][0]
    before = len(fake.engine.calls)

    def corrupted():
        for b in iter_buckets(actor.named_tensors(), BUCKET):
            yield [(n, t + 1 if n == first else t) for n, t in b]

    with pytest.raises(ManifestMismatchError, match=re.escape(first)):
        engine.load_weights(v0, corrupted(), actor.commit(0)[1])
    assert calls(fake.engine)[before:] == []  # no session, no update
    assert engine.active_version == v0 and [r.response_ids for r in engine.generate(PROMPTS, GREEDY)] == \
        [r.response_ids for r in g0]


def test_only_sglangs_own_bucket_class_is_sent(fake, desc):
    """megarl's in-process bucket class cannot cross: SGLang's unpickler admits only its own
    classes (0.5.5+), and the backend never uses it."""
    from megarl.rollout.weight_stream import FlattenedTensorBucket, get_flattened_tensor_bucket_class

    assert get_flattened_tensor_bucket_class() is fake.bucket_cls
    ser = sys.modules["sglang.srt.utils"].MultiprocessingSerializer
    ours = FlattenedTensorBucket(named_tensors=[("w", torch.ones(3))])
    payload = ser.serialize({"flattened_tensor": ours.get_flattened_tensor(), "metadata": ours.get_metadata()},
                            output_str=True)
    if desc["serializer"]["safe_unpickler"]:
        with pytest.raises(RuntimeError, match="Blocked unsafe global"):
            ser.deserialize(payload)
    theirs = fake.bucket_cls(named_tensors=[("w", torch.ones(3, dtype=torch.bfloat16))])
    back = ser.deserialize(ser.serialize({"flattened_tensor": theirs.get_flattened_tensor(),
                                          "metadata": theirs.get_metadata()}, output_str=True))
    rebuilt = fake.bucket_cls(flattened_tensor=back["flattened_tensor"], metadata=back["metadata"]).reconstruct_tensors()
    assert torch.equal(rebuilt[0][1], torch.ones(3, dtype=torch.bfloat16))


def test_no_fallback_bucket_class_without_sglang(monkeypatch):
    from megarl.rollout.weight_stream import flatten_bucket_by_dtype, get_flattened_tensor_bucket_class

    monkeypatch.setitem(sys.modules, "sglang", None)  # import sglang -> ImportError
    with pytest.raises(ImportError, match="FlattenedTensorBucket"):
        get_flattened_tensor_bucket_class()
    with pytest.raises(ImportError):
        flatten_bucket_by_dtype([("w", torch.ones(2))])


# ---- sleep / wake ----------------------------------------------------------------------------------


def test_sleep_wake_twice_resumes_exactly_what_was_released(fake, desc, model_dir, actor):
    engine = make_engine(model_dir)
    load(engine, actor, 0)
    for _ in range(2):
        engine.sleep()
        assert fake.engine.offloaded == {KV_CACHE, WEIGHTS} and engine.active_version is None
        with pytest.raises(EngineAsleepError):
            engine.generate(PROMPTS, GREEDY)
        engine.wake()
        assert fake.engine.offloaded == set()
        load(engine, actor, 0)
    released = [kw["tags"] for n, kw in fake.engine.calls if n == "release_memory_occupation"]
    resumed = [kw["tags"] for n, kw in fake.engine.calls if n == "resume_memory_occupation"]
    assert released == resumed == [[KV_CACHE, WEIGHTS]] * 2

    g = engine.generate(PROMPTS, GREEDY)  # kv cache only: the weights and the version stay
    engine.sleep(release_weights=False)
    engine.sleep(release_weights=False)  # again while asleep: nothing more to release
    engine.wake()
    engine.wake()  # awake: nothing to resume
    assert engine.active_version is not None
    assert [r.response_ids for r in engine.generate(PROMPTS, GREEDY)] == [r.response_ids for r in g]
    assert [kw["tags"] for n, kw in fake.engine.calls if n == "resume_memory_occupation"][-1] == [KV_CACHE]


def test_resuming_every_tag_after_a_partial_release_kills_the_caller(fake, desc, model_dir):
    """What wake() did before: resume_memory_occupation() with no tags."""
    make_engine(model_dir)
    raw = fake.engine
    partial = [KV_CACHE, WEIGHTS] if "cuda_graph" in desc["memory"]["resume_default"] else [KV_CACHE]
    raw.release_memory_occupation(tags=partial)
    with pytest.raises(SchedulerDied, match="KeyError"):
        raw.resume_memory_occupation()


# ---- eos, seeds, environment ------------------------------------------------------------------------


def test_stop_ids_sent_are_exactly_what_the_parser_accepts(fake, model_dir, actor):
    engine = make_engine(model_dir)
    assert engine.eos_token_ids == (CONTRACT_EOS, MODEL_EXTRA_EOS)
    load(engine, actor, 0)
    sp = SamplingParams(temperature=0.0, max_new_tokens=40, stop_token_ids=(STOP,))
    results = engine.generate([GenerationRequest(f"q{i}", (2, 30 + i)) for i in range(24)], sp)
    sent = {tuple(p["stop_token_ids"]) for n, kw in fake.engine.calls if n == "generate" for p in kw["sampling_params"]}
    assert sent == {(CONTRACT_EOS, MODEL_EXTRA_EOS, STOP)}
    ends = {(r.finish_reason, r.response_ids[-1]) for r in results if r.finish_reason is not FinishReason.LENGTH}
    assert {(FinishReason.EOS, CONTRACT_EOS), (FinishReason.EOS, MODEL_EXTRA_EOS), (FinishReason.STOP, STOP)} <= ends
    out = {"output_ids": [9, 11], "meta_info": {"finish_reason": {"type": "stop", "matched": 11},
                                               "output_token_logprobs": [(-1.0, 9, None), (-1.0, 11, None)]}}
    with pytest.raises(RolloutError, match="not one of the stop ids sent"):
        result_from_sglang_output(out, PROMPTS[0], 0, sp, engine.eos_token_ids, "v", None)


@pytest.mark.parametrize("deterministic", [False, True])
def test_a_seed_is_recorded_only_when_the_engine_honours_it(fake, model_dir, actor, deterministic):
    engine = make_engine(model_dir, deterministic_inference=deterministic)
    assert fake.engine.kwargs.get("enable_deterministic_inference", False) is deterministic
    load(engine, actor, 0)
    hot = SamplingParams(temperature=0.9, max_new_tokens=16, n=2, seed=11)
    a, b = engine.generate(PROMPTS, hot), engine.generate(PROMPTS, hot)
    params = [p for n, kw in fake.engine.calls if n == "generate" for p in kw["sampling_params"]]
    if deterministic:
        assert [r.seed for r in a] == [candidate_seed(11, r.request_id, r.candidate_index) for r in a]
        assert all("sampling_seed" in p for p in params)
        assert [r.response_ids for r in a] == [r.response_ids for r in b]  # the seed is what decides
    else:
        assert all(r.seed is None for r in a) and not any("sampling_seed" in p for p in params)


def test_the_trainers_environment_is_restored_after_engine_start(fake, desc, model_dir, monkeypatch):
    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    for var in TRAINER_ENV_VARS[1:]:
        monkeypatch.delenv(var, raising=False)
    make_engine(model_dir)
    assert os.environ["CUDA_DEVICE_MAX_CONNECTIONS"] == "1"
    assert not any(var in os.environ for var in TRAINER_ENV_VARS[1:])
    assert all(os.environ.get(v) == "1" for v in LOG_PROB_ENV_VARS)  # raw log-probs stay switched on


def test_unknown_engine_arguments_fail_like_server_args(fake, model_dir):
    with pytest.raises(TypeError, match="no_such_switch"):
        make_engine(model_dir, engine_kwargs={"no_such_switch": True})


# ---- TP=2: one engine, two ranks ---------------------------------------------------------------------


def test_tp2_group_shares_failures_and_results():
    from tests._dist import torchrun

    proc = torchrun(os.path.abspath(__file__), 2, VERSIONS[-1], timeout=300)
    assert proc.stdout.count("TP2-OK") == 2, proc.stdout[-2000:]


def _tp2_worker(version: str) -> None:
    import tempfile

    import torch.distributed as dist

    dist.init_process_group("gloo")
    fake = FakeSGLang(load_description(version)).install()
    rank = dist.get_rank()
    with tempfile.TemporaryDirectory() as d:
        if rank == 0:
            tiny_llama_config(eos_token_id=CONTRACT_EOS).save_pretrained(d)
        box = [d]
        dist.broadcast_object_list(box, src=0)
        model = box[0]
        dist.barrier()
        engine = SGLangRolloutEngine(model, tp_size=2, group=dist.group.WORLD, device="cpu", eos_token_ids=[CONTRACT_EOS],
                                     # every TP rank's checksums, where the release has them
                                     verify_writes="first" if checksums_weights() else "never")
        assert (len(fake.engines) == 1) == (rank == 0)
        actor = HFActorStandIn.create(tiny_llama_config(eos_token_id=CONTRACT_EOS), dtype=torch.bfloat16)
        v0, m0 = actor.commit(0)
        engine.load_weights(v0, iter_buckets(actor.named_tensors(), BUCKET), m0)
        engine.activate(v0)
        if rank == 0:
            per_rank = [kw["named_tensors"] for n, kw in fake.engine.calls if n == "update_weights_from_tensor"]
            assert per_rank and all(len(p) == 2 for p in per_rank)  # one payload per TP rank
            assert engine._loads_verified == int(checksums_weights())  # both TP ranks' checksums compared
            fake.engine.fail_next_update = "refused on purpose"
        try:
            engine.load_weights(v0, iter_buckets(actor.named_tensors(), BUCKET), m0)
            raise AssertionError("the refused update did not fail the load on every rank")
        except WeightUpdateRejectedError as e:
            assert "refused on purpose" in str(e)
        engine.load_weights(v0, iter_buckets(actor.named_tensors(), BUCKET), m0)
        engine.activate(v0)
        got = engine.generate(PROMPTS, GREEDY)
        everyone = [None, None]
        dist.all_gather_object(everyone, [r.response_ids for r in got])
        assert everyone[0] == everyone[1] and len(got) == len(PROMPTS)
        engine.sleep()
        engine.wake()
        dist.barrier()
    dist.destroy_process_group()
    print("TP2-OK", flush=True)


if __name__ == "__main__":  # the TP=2 worker, under torchrun (tests._dist: the checkout on PYTHONPATH)
    _tp2_worker(sys.argv[1])


# ---- routed experts (MoE, algo.routing_replay=rollout) ---------------------------------------------


def _has_routed_experts(desc):
    return desc["routed_experts"]["request_option"] is not None


def test_routed_experts_are_recorded_from_0_5_7_on(desc):
    """The request option and the server flag exist together, from 0.5.7 (the recording of
    0.5.7 is the first with them; 0.5.6.post2 has neither), with the layout the parser reads."""
    re_ = desc["routed_experts"]
    version = tuple(int(p) for p in desc["sglang_version"].split(".")[:3])
    assert _has_routed_experts(desc) == (version >= (0, 5, 7))
    if not _has_routed_experts(desc):
        assert re_["server_flag"] is None and "return_routed_experts" not in desc["engine"]["methods"]["generate"]["params"]
        return
    assert re_["request_option"] in desc["engine"]["methods"]["generate"]["params"]
    assert re_["server_flag"] == "enable_return_routed_experts" in desc["server_args"]["fields"]
    assert (re_["meta_info_key"], re_["dtype"], re_["rows"], re_["layers"], re_["top_k"]) == (
        "routed_experts", "int32", "[start, seqlen - 1)", "num_hidden_layers", "num_experts_per_tok")
    assert re_["encoding_with_skip_tokenizer_init"] in ("base64", "tensor")
    assert re_["capture"]["ids"] in ("logical", "physical")


@pytest.fixture
def moe_dir(tmp_path):
    from megarl.builtin.hf_actor import tiny_moe_config

    tiny_moe_config("qwen3_moe", layers=3, mlp_only_layers=[], decoder_sparse_step=1,
                    eos_token_id=CONTRACT_EOS).save_pretrained(tmp_path)
    return str(tmp_path)


def test_routed_experts_come_back_as_the_samples_routing(fake, desc, moe_dir):
    from megarl.builtin.hf_actor import tiny_moe_config

    if not _has_routed_experts(desc):
        with pytest.raises(RolloutError, match="needs SGLang >= 0.5.7"):
            make_engine(moe_dir, return_routed_experts=True)
        return
    # every layer sparse: SGLang's Qwen3-MoE has no dense layers (a config with some is refused, below)
    moe_actor = HFActorStandIn.create(tiny_moe_config("qwen3_moe", layers=3, mlp_only_layers=[], decoder_sparse_step=1,
                                                      eos_token_id=CONTRACT_EOS), dtype=torch.bfloat16)
    engine = make_engine(moe_dir, return_routed_experts=True)
    assert fake.engine.kwargs["enable_return_routed_experts"] is True
    load(engine, moe_actor, 0)
    sampling = SamplingParams(temperature=0.0, max_new_tokens=6, return_routed_experts=True)
    prompts = [GenerationRequest(f"m{i}", (2, 10 + i, 11, 12 + i)) for i in range(3)]
    results = engine.generate(prompts, sampling)
    assert calls(fake.engine, "generate") and fake.engine.calls[-1][1]["return_routed_experts"] is True
    for res, sent in zip(results, fake.engine.routed, strict=True):
        r = res.routed_experts
        assert r.backend == "sglang" and r.moe_layers == (0, 1, 2) and r.num_experts == 4 and r.top_k == 2
        assert r.experts.dtype == torch.uint8
        assert r.experts.shape == (len(res.prompt_ids) + len(res.response_ids) - 1, 3, 2)
        assert torch.equal(r.experts.long(), sent.long())
    # a plain request does not send the option (a release without it would refuse the name)
    engine.generate(prompts[:1], GREEDY)
    assert fake.engine.calls[-1][1].get("return_routed_experts") is None
    # asking an engine that was not started for it
    plain = make_engine(moe_dir)
    load(plain, moe_actor, 0)
    with pytest.raises(InvalidRequestError, match="not started with return_routed_experts"):
        plain.generate(prompts[:1], sampling)
    with pytest.raises(RolloutError, match="dense model"):
        make_engine(model_dir_dense(moe_dir), return_routed_experts=True)


def model_dir_dense(moe_dir):
    d = os.path.join(moe_dir, "dense")
    tiny_llama_config(eos_token_id=CONTRACT_EOS).save_pretrained(d)
    return d


def test_routed_experts_parser_reads_both_encodings_and_refuses_the_rest():
    import base64

    from megarl.rollout.sglang_outputs import MoELayout, routed_experts_from_sglang_output

    layout = MoELayout(num_hidden_layers=3, num_experts=4, top_k=2, moe_layers=(0, 2))
    ids = torch.tensor([[[0, 1], [0, 0], [2, 3]], [[3, 2], [0, 0], [1, 0]]], dtype=torch.int32)
    b64 = base64.b64encode(ids.numpy().tobytes()).decode()
    for value in (b64, ids):  # 0.5.23: base64 of the int32 bytes; 0.5.7: the tensor
        r = routed_experts_from_sglang_output({"routed_experts": value}, 2, layout, "req/0")
        assert r.experts.tolist() == [[[0, 1], [2, 3]], [[3, 2], [1, 0]]] and r.experts.dtype == torch.uint8
    with pytest.raises(RolloutError, match="no meta_info"):
        routed_experts_from_sglang_output({}, 2, layout, "req/0")
    with pytest.raises(RolloutError, match="expected 3 tokens"):
        routed_experts_from_sglang_output({"routed_experts": b64}, 3, layout, "req/0")
    with pytest.raises(RolloutError, match="outside"):
        routed_experts_from_sglang_output({"routed_experts": ids * 3}, 2, layout, "req/0")


def test_a_write_check_the_engine_cannot_do_is_refused_at_start(fake, model_dir):
    """0.5.3 has no weight checker; 0.5.7's has no ``checksum`` action and answers a
    ``CheckWeightsReqOutput``: both refused at start naming the key.  0.5.23's checksums every
    parameter: the engine starts, having asked for them once."""
    if checksums_weights():
        make_engine(model_dir, verify_writes="first")
        assert [c for c in fake.engine.calls if c[0] == "check_weights"] == [("check_weights", {"action": "checksum"})]
    else:
        with pytest.raises(RolloutError, match="verify_engine_weights=never"):
            make_engine(model_dir, verify_writes="first")
    with pytest.raises(ValueError, match="verify_writes='sometimes'"):
        make_engine(model_dir, verify_writes="sometimes")


def test_a_load_that_leaves_an_engine_parameter_unwritten_fails_naming_it(fake, model_dir, actor, monkeypatch):
    """The fake's loader, as SGLang's, keeps what it has no parameter for out of the model: a
    stream with the layer-1 post-attention norm renamed (its manifest with it, so megarl's own
    checks pass) leaves that parameter as the checker reset it, and the load fails naming it,
    with no version active.  The real engine's test is tests/sglang_real/test_engine_cpu.py."""
    import dataclasses

    from megarl.rollout.sglang_backend import WeightsNotWrittenError
    from megarl.rollout.weight_stream import TensorManifest

    if not checksums_weights():
        pytest.skip(f"SGLang {sys.modules['sglang'].__version__} cannot checksum its parameters: refused at start "
                    "(test_a_write_check_the_engine_cannot_do_is_refused_at_start)")
    engine = make_engine(model_dir, verify_writes="every")
    load(engine, actor, 0)
    version, _ = actor.commit(1)
    named = [(n, t.to(engine.dtype)) for n, t in actor.named_tensors()]
    bad = [(n.replace("layers.1.post_attention_layernorm", "layers.1.post_attention_layernorm_renamed"), t)
           for n, t in named]
    assert [n for n, _ in bad] != [n for n, _ in named]
    bad_manifest = TensorManifest.from_named_tensors(bad)
    bad_version = dataclasses.replace(version, weight_manifest_hash=bad_manifest.global_hash)
    with pytest.raises(WeightsNotWrittenError, match=r"left 1 of \d+ engine parameters unwritten.*"
                                                     r"model\.layers\.1\.post_attention_layernorm\.weight"):
        engine.load_weights(bad_version, iter_buckets(bad, BUCKET), bad_manifest)
    assert engine.active_version is None and "post_attention_layernorm" in engine.last_load_error
    # negative control: without the check the same stream loads "successfully"
    monkeypatch.setattr(engine, "verify_writes", "never")
    engine.load_weights(bad_version, iter_buckets(bad, BUCKET), bad_manifest)
    engine.activate(bad_version)
    # a correct stream passes the check, after resetting every parameter first
    monkeypatch.setattr(engine, "verify_writes", "every")
    load(engine, actor, 2)
    actions = [c[1]["action"] for c in fake.engine.calls if c[0] == "check_weights"]
    assert actions[-3:] == ["reset_tensors", "checksum", "checksum"], actions


def test_a_qwen3_moe_with_dense_layers_is_refused_before_the_engine_starts(fake, tmp_path):
    from megarl.builtin.hf_actor import tiny_moe_config

    tiny_moe_config("qwen3_moe", layers=3, mlp_only_layers=[1]).save_pretrained(tmp_path)
    with pytest.raises(RolloutError, match=r"mlp_only_layers=\[1\]"):
        make_engine(str(tmp_path))
    tiny_moe_config("qwen3_moe", layers=4, decoder_sparse_step=2).save_pretrained(tmp_path)
    with pytest.raises(RolloutError, match="decoder_sparse_step=2"):
        make_engine(str(tmp_path))
    assert fake.engines == []  # refused before Engine() started anything
    tiny_moe_config("qwen3_moe", layers=3, mlp_only_layers=[]).save_pretrained(tmp_path)  # all sparse: accepted
    make_engine(str(tmp_path))


def test_a_config_without_architectures_is_refused_before_the_engine_starts(fake, tmp_path):
    """SGLang picks its model class from config.json's ``architectures`` (0.5.23 fails without it in
    its registry with a bare TypeError, as the fake does): the backend names the file and the key."""
    tiny_llama_config(architectures=None).save_pretrained(tmp_path)
    with pytest.raises(RolloutError, match=r"config\.json has architectures=None"):
        make_engine(str(tmp_path))
    assert fake.engines == []
    with pytest.raises(TypeError):  # negative control: what SGLang itself says
        sys.modules["sglang"].Engine(model_path=str(tmp_path))


def test_on_cpu_torchs_reductions_are_left_alone(fake, model_dir, actor):
    """SGLang's monkey_patch_torch_reductions rewrites a tensor's reduction as a CUDA IPC handle's;
    on 0.5.23 it made the first real CPU load fail (IndexError).  The backend applies it only for
    CUDA staging."""
    engine = make_engine(model_dir)
    load(engine, actor, 0)
    assert fake.patched == []
    # negative control: with the patch applied the same load fails as it did
    sys.modules[fake.desc["patch_torch"]["module"]].__dict__[fake.desc["patch_torch"]["function"]]()
    with pytest.raises(IndexError):
        load(engine, actor, 1)


def test_an_engine_shut_down_beside_another_takes_the_others_schedulers(fake, model_dir, actor):
    """SGLang's Engine.shutdown() kills every child process of its caller: in one process, a second
    engine's schedulers die with the first's shutdown (hence one engine per process)."""
    a, b = make_engine(model_dir), make_engine(model_dir)
    load(b, actor, 0)
    a.shutdown()
    with pytest.raises(SchedulerDied, match="kill_process_tree"):
        b.generate(PROMPTS, GREEDY)


def test_the_trainers_engine_records_routing_when_routing_replay_needs_it(fake, desc, moe_dir, monkeypatch):
    """``algo.routing_replay`` reads the experts the engine routed each token to: the trainer's
    engine (control/placement.create_engine, both placements) is started with SGLang's
    ``enable_return_routed_experts`` then, and only then (found by the real engine on CPU: every
    generate was refused and every group dropped)."""
    from megarl.config import load_config
    from megarl.control.placement import Placement, create_engine

    if "enable_return_routed_experts" not in desc["server_args"]["fields"]:
        pytest.skip(f"SGLang {desc['sglang_version']} has no routed-expert capture: the backend refuses "
                    "return_routed_experts at start (test_routed_experts_come_back_as_the_samples_routing)")
    from megarl.rollout import sglang_cpu

    monkeypatch.setattr(sglang_cpu, "prepare", lambda: False)  # the fake is imported already: no mends
    recipe = os.path.join(ROOT, "configs", "grpo_moe_tiny.yaml")
    one = Placement(num_groups=1, group_index=0, is_group_leader=True)
    for replay, started_with in (("rollout", True), ("none", None)):
        cfg = load_config(recipe, ["rollout.backend=sglang", f"algo.routing_replay={replay}",
                                   "rollout.verify_engine_weights=never"])
        engine = create_engine(cfg, one, moe_dir, [CONTRACT_EOS], 0)
        assert fake.engines[-1].kwargs.get("enable_return_routed_experts") is started_with, replay
        assert (engine.moe_layout is not None) is bool(started_with)
