"""hf rollout backend: log-prob spaces, version activation, manifest checks, refusal rules.

A transformers model stands in for the actor (megarl/builtin/hf_actor.py: HFActorStandIn); the
megatron-actor versions of these checks are the lead's.
"""

import pytest
import torch
from safetensors.torch import load_file

from megarl.control.state_machine import (
    CompletionConditionError,
    ExportEvidence,
    IterationStateMachine,
    Phase,
    RolloutActivation,
)
from megarl.rollout.hf_backend import HFRolloutEngine
from megarl.rollout.protocol import (
    EngineAsleepError,
    FinishReason,
    GenerationRequest,
    InvalidRequestError,
    NoActiveVersionError,
    RolloutBusyError,
    SamplingParams,
    VersionNotStagedError,
)
from megarl.rollout.weight_stream import ManifestMismatchError, TensorManifest, iter_buckets
from megarl.builtin.hf_actor import HFActorStandIn, tiny_llama_config
from tests._hf_engine import BUCKET, make_actor, sync
from tests._tolerance import NET_FP32_LOGPROB, max_abs_diff, within

PROMPTS = [
    GenerationRequest("p0", (2, 5, 17, 40, 9)),
    GenerationRequest("p1", (2, 33)),
    GenerationRequest("p2", (2, 7, 7, 101, 250, 64, 12)),
]


def greedy(engine, max_new_tokens=12):
    res = engine.generate(PROMPTS, SamplingParams(temperature=0.0, max_new_tokens=max_new_tokens))
    return [(r.request_id, r.response_ids) for r in res]


@pytest.fixture(scope="module")
def actor_engine(tmp_path_factory):
    actor = make_actor()
    d = actor.export_config(tmp_path_factory.mktemp("cfg"))
    engine = HFRolloutEngine(d)
    version, _ = sync(engine, actor, 0)
    return actor, engine, version


def teacher_forced_logits(model, prompt, response):
    ids = torch.tensor([list(prompt) + list(response)])
    with torch.no_grad():
        logits = model(ids).logits[0].float()
    return logits[len(prompt) - 1 : len(prompt) - 1 + len(response)]


def direct_processed_log_probs(logits, tokens, temperature, top_p):
    """Independent of transformers' warpers: scale, keep the smallest top set with mass >= top_p."""
    scaled = logits / temperature
    probs = scaled.softmax(-1)
    out, kept = [], []
    for row, tok in zip(range(scaled.shape[0]), tokens):
        p = probs[row]
        mass_above = (p[None, :] * (p[None, :] > p[:, None])).sum(1)  # mass of strictly likelier tokens
        keep = mass_above < top_p
        kept.append(int(keep.sum()))
        masked = scaled[row].masked_fill(~keep, float("-inf"))
        out.append(torch.log_softmax(masked, -1)[tok])
    return torch.stack(out), kept


def test_raw_and_processed_log_probs_match_a_direct_forward(actor_engine):
    actor, engine, version = actor_engine
    sampling = SamplingParams(temperature=0.7, top_p=0.9, max_new_tokens=10, n=2, seed=3)
    results = engine.generate(PROMPTS, sampling)
    assert len(results) == len(PROMPTS) * 2
    kept_sizes = []
    for r in results:
        assert r.policy_version == version.short_id
        logits = teacher_forced_logits(actor.model, r.prompt_ids, r.response_ids)
        raw = torch.log_softmax(logits, -1).gather(1, torch.tensor(r.response_ids)[:, None]).squeeze(1)
        # fp32, the engine (transformers generate, KV cache) vs a teacher-forced forward of the
        # stand-in actor: two code paths through the same network
        assert within(max_abs_diff(r.raw_log_probs, raw), NET_FP32_LOGPROB, "hf_backend/raw_vs_direct")
        processed, kept = direct_processed_log_probs(logits, r.response_ids, 0.7, 0.9)
        kept_sizes += kept
        assert torch.isfinite(processed).all(), "a sampled token lies outside the top-p set"
        assert within(max_abs_diff(r.processed_log_probs, processed), NET_FP32_LOGPROB, "hf_backend/processed_vs_direct")
        # the two spaces really differ (temperature + truncation), so mixing them up is visible
        assert (r.processed_log_probs - r.raw_log_probs).abs().max() > 1e-2
    vocab = actor.model.config.vocab_size
    assert min(kept_sizes) < vocab // 2, "top-p never truncated: the test would not see a filter bug"


def test_processed_log_probs_absent_when_distribution_is_untransformed(actor_engine):
    _, engine, _ = actor_engine
    res = engine.generate(PROMPTS[:1], SamplingParams(temperature=1.0, max_new_tokens=5, seed=1))
    assert res[0].processed_log_probs is None
    assert res[0].raw_log_probs.shape == (len(res[0].response_ids),)
    res = engine.generate(PROMPTS[:1], SamplingParams(temperature=0.0, max_new_tokens=5))
    assert res[0].processed_log_probs is None and res[0].seed is None


def test_greedy_equals_plain_transformers_generate(actor_engine):
    actor, engine, _ = actor_engine
    for (rid, resp), req in zip(greedy(engine), PROMPTS):
        out = actor.model.generate(
            torch.tensor([req.prompt_ids]), do_sample=False, max_new_tokens=12, eos_token_id=3, pad_token_id=0
        )
        plain = out[0, len(req.prompt_ids):].tolist()
        if 3 in plain:
            plain = plain[: plain.index(3) + 1]
        assert list(resp) == plain, rid


def test_seeded_sampling_is_reproducible_and_independent_of_the_batch(actor_engine):
    _, engine, _ = actor_engine
    sp = SamplingParams(temperature=0.9, top_k=50, max_new_tokens=8, n=3, seed=11)
    a = engine.generate(PROMPTS, sp)
    b = engine.generate(PROMPTS, sp)
    alone = engine.generate([PROMPTS[1]], sp)
    key = lambda r: (r.request_id, r.candidate_index)
    assert [(key(r), r.response_ids) for r in a] == [(key(r), r.response_ids) for r in b]
    in_batch = {key(r): r.response_ids for r in a if r.request_id == "p1"}
    assert {key(r): r.response_ids for r in alone} == in_batch
    assert len({r.seed for r in a}) == len(a)  # one seed per candidate
    other = engine.generate(PROMPTS, SamplingParams(temperature=0.9, top_k=50, max_new_tokens=8, n=3, seed=12))
    assert [r.response_ids for r in other] != [r.response_ids for r in a]
    assert [r.candidate_index for r in a[:3]] == [0, 1, 2]


def test_regenerating_chosen_candidates_keeps_their_seeds_and_echoes_the_attempt(actor_engine):
    """A retry after a lost result: only the asked-for candidates, each from its own seed stream
    (the same tokens as in the first attempt), tagged with the retry's attempt."""
    _, engine, _ = actor_engine
    sp = SamplingParams(temperature=0.9, top_k=50, max_new_tokens=8, n=4, seed=5)
    first = {(r.request_id, r.candidate_index): r for r in engine.generate(PROMPTS, sp)}
    retry = [GenerationRequest(PROMPTS[1].request_id, PROMPTS[1].prompt_ids, candidate_indices=(3, 1), attempt=2)]
    again = engine.generate(retry, sp)
    assert [(r.request_id, r.candidate_index, r.attempt) for r in again] == [("p1", 3, 2), ("p1", 1, 2)]
    for r in again:
        was = first[(r.request_id, r.candidate_index)]
        assert r.response_ids == was.response_ids and r.seed == was.seed and was.attempt == 0
        # one engine, a batch of 2 rows instead of 8: other GEMM shapes and padding
        assert within(max_abs_diff(r.raw_log_probs, was.raw_log_probs), NET_FP32_LOGPROB, "hf_backend/retry_vs_first")
    with pytest.raises(InvalidRequestError, match="outside"):
        engine.generate([GenerationRequest("p9", (1, 2), candidate_indices=(4,))], sp)
    with pytest.raises(InvalidRequestError, match="distinct"):
        GenerationRequest("p9", (1, 2), candidate_indices=(1, 1))


def test_finish_reasons_eos_stop_length(actor_engine, tmp_path):
    actor, engine, version = actor_engine
    free = engine.generate(PROMPTS[:1], SamplingParams(temperature=0.0, max_new_tokens=6))[0]
    assert free.finish_reason is FinishReason.LENGTH and len(free.response_ids) == 6
    third = free.response_ids[2]
    first_hit = free.response_ids.index(third)
    stopped = engine.generate(
        PROMPTS[:1], SamplingParams(temperature=0.0, max_new_tokens=6, stop_token_ids=(third,))
    )[0]
    assert stopped.finish_reason is FinishReason.STOP
    assert stopped.response_ids == free.response_ids[: first_hit + 1]
    # bitwise: the same prompt, batch and forward calls on the same shapes up to the stop, only
    # fewer of them
    assert torch.equal(stopped.raw_log_probs, free.raw_log_probs[: first_hit + 1])
    # the same token as the model's eos: reported as eos
    eos_engine = HFRolloutEngine(actor.export_config(tmp_path), eos_token_ids=[third])
    sync(eos_engine, actor, 0)
    eos = eos_engine.generate(PROMPTS[:1], SamplingParams(temperature=0.0, max_new_tokens=6))[0]
    assert eos.finish_reason is FinishReason.EOS and eos.response_ids == stopped.response_ids


def test_v_plus_1_served_only_after_activation_and_equals_fresh_export(tmp_path):
    actor = make_actor()
    engine = HFRolloutEngine(actor.export_config(tmp_path / "cfg"))
    v0, _ = sync(engine, actor, 0)
    out_v0 = greedy(engine)
    flushes = engine.cache_flushes

    actor.perturb(scale=0.2, seed=5)  # the "optimizer step"
    v1, m1 = actor.commit(1)
    assert v1.is_successor_of(v0)
    engine.load_weights(v1, iter_buckets(actor.named_tensors(), BUCKET), m1)
    assert engine.active_version == v0
    assert greedy(engine) == out_v0  # staged, not active: still v
    report = engine.activate(v1)
    assert report.cache_flushed and engine.cache_flushes == flushes + 1
    assert engine.active_version == v1
    out_v1 = greedy(engine)
    assert out_v1 != out_v0

    # a fresh engine loaded from an HF export of v+1
    export = tmp_path / "export_v1"
    actor.model.save_pretrained(export)
    on_disk = load_file(str(export / "model.safetensors"))
    fresh = HFRolloutEngine(export)
    disk_manifest = TensorManifest.from_named_tensors(on_disk.items())
    assert disk_manifest.global_hash == v1.weight_manifest_hash
    fresh.load_weights(v1, iter_buckets(on_disk.items(), 10**9), disk_manifest)
    fresh.activate(v1)
    assert greedy(fresh) == out_v1
    r_engine = engine.generate(PROMPTS, SamplingParams(temperature=0.0, max_new_tokens=12))
    r_fresh = fresh.generate(PROMPTS, SamplingParams(temperature=0.0, max_new_tokens=12))
    for a, b in zip(r_engine, r_fresh):
        assert torch.equal(a.raw_log_probs, b.raw_log_probs)
        assert a.policy_version == b.policy_version == v1.short_id


def corrupt_one_value(buckets, name):
    for bucket in buckets:
        out = []
        for n, t in bucket:
            if n == name:
                t = t.clone()
                t.view(-1)[7] += 1.0
            out.append((n, t))
        yield out


def test_corrupted_bucket_is_detected_engine_stays_on_v_and_state_machine_fails(tmp_path):
    actor = make_actor()
    engine = HFRolloutEngine(actor.export_config(tmp_path))
    v0, m0 = sync(engine, actor, 0)
    out_v0 = greedy(engine)

    actor.perturb(seed=9)
    v1, m1 = actor.commit(1)
    sm = IterationStateMachine(v1)  # the iteration that publishes the committed v1
    sm.begin_export()
    sm.begin_rollout_loading(ExportEvidence(m1.global_hash))
    target = "model.layers.1.mlp.up_proj.weight"
    with pytest.raises(ManifestMismatchError, match=target.replace(".", r"\.") + ": checksum"):
        engine.load_weights(v1, corrupt_one_value(iter_buckets(actor.named_tensors(), BUCKET), target), m1)
    assert engine.active_version == v0
    assert greedy(engine) == out_v0
    with pytest.raises(VersionNotStagedError):
        engine.activate(v1)
    with pytest.raises(CompletionConditionError):
        sm.mark_rollout_ready([], num_groups=1)
    assert sm.state.phase is Phase.FAILED and "0 of 1 inference groups" in sm.state.reason

    # recovery path: back to the committed version, retry the sync cleanly
    sm.recover(v1)
    sm.begin_export()
    sm.begin_rollout_loading(ExportEvidence(m1.global_hash))
    engine.load_weights(v1, iter_buckets(actor.named_tensors(), BUCKET), m1)
    rep = engine.activate(v1)
    sm.mark_rollout_ready(
        [RolloutActivation(rep.version_id, rep.manifest_hash, rep.manifest_verified, rep.cache_flushed)], 1
    )
    assert sm.state.phase is Phase.ROLLOUT_READY


@pytest.mark.parametrize("fault", ["missing", "unexpected", "shape", "dtype", "duplicate"])
def test_bad_streams_raise_named_errors_and_keep_v(actor_engine, fault):
    actor, engine, v0 = actor_engine
    version, manifest = actor.commit(0)
    named = actor.named_tensors()
    victim = "model.norm.weight"
    if fault == "missing":
        named = [(n, t) for n, t in named if n != victim]
        match = r"missing 1 tensor\(s\): \['model\.norm\.weight'\]"
    elif fault == "unexpected":
        named = named + [("model.extra.weight", torch.zeros(3))]
        match = "model.extra.weight"
    elif fault == "shape":
        named = [(n, t[:-1] if n == victim else t) for n, t in named]
        match = r"model\.norm\.weight.*shape"
    elif fault == "dtype":
        named = [(n, t.double() if n == victim else t) for n, t in named]
        match = r"model\.norm\.weight.*dtype"
    else:
        named = named + [(victim, dict(named)[victim])]
        match = "model.norm.weight"
    before = greedy(engine, 6)
    with pytest.raises(ManifestMismatchError, match=match):
        engine.load_weights(version, iter_buckets(named, BUCKET), manifest)
    assert engine.active_version == v0 and greedy(engine, 6) == before


def test_expected_manifest_must_be_the_versions_manifest(actor_engine):
    actor, engine, _ = actor_engine
    version, manifest = actor.commit(0)
    other = TensorManifest.from_named_tensors(actor.named_tensors()[:-1])
    with pytest.raises(ManifestMismatchError, match=version.short_id):
        engine.load_weights(version, iter_buckets(actor.named_tensors(), BUCKET), other)


def test_generate_while_loading_is_refused_and_never_half_served(actor_engine):
    actor, engine, v0 = actor_engine
    version, manifest = actor.commit(0)
    seen = {}

    def stream():
        for i, bucket in enumerate(iter_buckets(actor.named_tensors(), BUCKET)):
            if i == 2:
                with pytest.raises(RolloutBusyError, match="loading"):
                    engine.generate(PROMPTS, SamplingParams(temperature=0.0, max_new_tokens=2))
                seen["refused"] = True
            yield bucket

    engine.load_weights(version, stream(), manifest)
    assert seen["refused"]
    engine.activate(version)


def test_no_generation_before_activation_and_request_validation(tmp_path):
    actor = make_actor()
    engine = HFRolloutEngine(actor.export_config(tmp_path))
    with pytest.raises(NoActiveVersionError):
        engine.generate(PROMPTS, SamplingParams(max_new_tokens=2))
    v0, _ = sync(engine, actor, 0)
    with pytest.raises(InvalidRequestError, match="outside"):
        engine.generate([GenerationRequest("x", (1, 5000))], SamplingParams(max_new_tokens=2))
    with pytest.raises(InvalidRequestError, match="duplicate"):
        engine.generate([PROMPTS[0], PROMPTS[0]], SamplingParams(max_new_tokens=2))
    with pytest.raises(InvalidRequestError, match="string"):
        GenerationRequest("s", "what is 1 + 1")
    with pytest.raises(InvalidRequestError, match="top_p"):
        SamplingParams(top_p=0.0)


def test_sleep_refuses_work_and_wake_restores_the_same_version(actor_engine):
    actor, engine, v0 = actor_engine
    before = greedy(engine, 6)
    engine.sleep()
    with pytest.raises(EngineAsleepError):
        engine.generate(PROMPTS, SamplingParams(max_new_tokens=2))
    version, manifest = actor.commit(0)
    with pytest.raises(EngineAsleepError):
        engine.load_weights(version, iter_buckets(actor.named_tensors(), BUCKET), manifest)
    engine.wake()
    assert engine.active_version == v0 and greedy(engine, 6) == before
    # the standby buffer was released; the next load rebuilds it
    sync(engine, actor, 0)
    assert greedy(engine, 6) == before


def test_tied_embeddings_are_streamed_once_and_retied(tmp_path):
    actor = HFActorStandIn.create(tiny_llama_config(initializer_range=0.3, tie_word_embeddings=True))
    names = [n for n, _ in actor.named_tensors()]
    assert "lm_head.weight" not in names and "model.embed_tokens.weight" in names
    engine = HFRolloutEngine(actor.export_config(tmp_path))
    sync(engine, actor, 0)
    served = engine._active.model
    assert served.lm_head.weight.data_ptr() == served.model.embed_tokens.weight.data_ptr()
    for (rid, resp), req in zip(greedy(engine, 8), PROMPTS):
        out = actor.model.generate(torch.tensor([req.prompt_ids]), do_sample=False, max_new_tokens=8, eos_token_id=3, pad_token_id=0)
        plain = out[0, len(req.prompt_ids):].tolist()
        plain = plain[: plain.index(3) + 1] if 3 in plain else plain
        assert list(resp) == plain


def test_counter_uniforms_are_splitmix64_per_row_and_step():
    """Golden: the vectorised draw equals splitmix64 in Python integers, row by row, whatever
    the other rows of the batch; and it is uniform enough (mean, spread) for inverse-CDF sampling."""
    from megarl.rollout.hf_backend import counter_uniforms

    def splitmix(seed, step):
        m = (1 << 64) - 1
        z = (seed + (step + 1) * 0x9E3779B97F4A7C15) & m
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & m
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & m
        z ^= z >> 31
        return (z >> 11) / 2**53

    seeds = [0, 1, 2**62 + 12345, 2**63 - 1, 987654321]
    for step in (0, 1, 5):
        got = counter_uniforms(torch.tensor(seeds), step).tolist()
        assert got == [splitmix(s, step) for s in seeds]
        assert counter_uniforms(torch.tensor(seeds[2:3]), step).tolist() == got[2:3]  # alone = in a batch
    u = counter_uniforms(torch.arange(100_000), 3)
    assert ((u >= 0) & (u < 1)).all() and abs(float(u.mean()) - 0.5) < 0.005 and abs(float(u.std()) - 12**-0.5) < 0.005


def test_a_load_of_some_tensors_keeps_the_rest_proven_in_place(tmp_path):
    """keep_unsent (a LoRA actor's sync): only the changed tensors are sent; the engine keeps the
    others, checksums them where they lie and activates a version equal to a whole load's.  Not
    sending a tensor that did change fails the load, naming it, and the engine stays where it was;
    a whole load afterwards recovers."""
    actor = make_actor()
    engine = HFRolloutEngine(actor.export_config(tmp_path))
    v0, _ = sync(engine, actor, 0)
    changed = "model.layers.0.self_attn.q_proj.weight"
    with torch.no_grad():
        dict(actor.model.named_parameters())[changed].add_(0.5)
    v1, m1 = actor.commit(1)
    sent = [(n, t) for n, t in actor.named_tensors() if n == changed]
    report = engine.load_weights(v1, [sent], m1, keep_unsent=True)
    assert report.num_tensors == len(m1.entries) and report.num_bytes == sent[0][1].numel() * 4
    engine.activate(v1)
    out_v1 = greedy(engine)
    whole = HFRolloutEngine(actor.export_config(tmp_path / "whole"))
    sync(whole, actor, 1)
    assert greedy(whole) == out_v1 and out_v1 != greedy_of(actor, v0, tmp_path)
    # the next version changes two tensors; sending one of them is caught by name
    other = "model.layers.1.mlp.down_proj.weight"
    with torch.no_grad():
        dict(actor.model.named_parameters())[changed].add_(0.5)
        dict(actor.model.named_parameters())[other].add_(0.5)
    v2, m2 = actor.commit(2)
    with pytest.raises(ManifestMismatchError, match=other.replace(".", r"\.") + ": checksum"):
        engine.load_weights(v2, [[(n, t) for n, t in actor.named_tensors() if n == changed]], m2, keep_unsent=True)
    assert engine.active_version == v1 and greedy(engine) == out_v1
    engine.load_weights(v2, iter_buckets(actor.named_tensors(), BUCKET), m2)
    engine.activate(v2)
    assert engine.active_version == v2


def greedy_of(actor, version, tmp_path):
    """The greedy outputs of a fresh engine on ``version``'s weights as the actor holds them now
    (the test uses it on v0 only before moving on: a fresh actor at seed 0)."""
    fresh_actor = make_actor()
    fresh = HFRolloutEngine(fresh_actor.export_config(tmp_path / "v0"))
    sync(fresh, fresh_actor, 0)
    return greedy(fresh)
