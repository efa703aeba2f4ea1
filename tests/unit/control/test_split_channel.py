"""The split placement's channel, in one process: the trainer's :class:`RemoteEngine` in this
thread, a :class:`RolloutService` over a real hf engine in another, a real gloo bridge group and
heartbeats over an in-memory store.

* weights stream in buckets (several, flattened per dtype) and the rollout engine verifies them
  itself: what it then generates is bitwise what a local engine loaded with the same weights
  generates, on the same version;
* commands run in the order sent: a batch submitted before v1 is published is generated on v0,
  one submitted after on v1 (what bounds the staleness of generation submitted ahead);
* a corrupted bucket is the engine's ManifestMismatchError on the trainer side, the engine stays
  on v0, and the next load succeeds; so does one after the trainer's own stream broke mid-way;
* a side that stops beating is named lost within ``timeout_s`` by the other, never waited on.
"""

from __future__ import annotations

import datetime
import threading
import time

import pytest
import torch
import torch.distributed as dist

from megarl.rollout.hf_backend import HFRolloutEngine
from megarl.rollout.protocol import GenerationRequest, SamplingParams
from megarl.rollout.remote import RemoteEngine, RolloutService
from megarl.rollout.weight_stream import ManifestMismatchError, iter_buckets
from megarl.runtime.split import Heartbeat, PeerLostError, SplitWorld
from megarl.builtin.hf_actor import HFActorStandIn, tiny_llama_config
from tests._tolerance import NET_FP32_LOGPROB, max_abs_diff, within

BUCKET = 40_000  # bytes: several buckets for the tiny model
PROMPTS = [GenerationRequest("p0", (2, 5, 17, 40, 9)), GenerationRequest("p1", (2, 33))]
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=8)


def _worlds(timeout_s: float):
    """The trainer's and the rollout rank's SplitWorld over one in-memory store (the bridge group's
    two ranks are created concurrently: its constructor waits for the other)."""
    store = dist.HashStore()
    out = {}

    def make(role, rank):
        pg = dist.ProcessGroupGloo(dist.PrefixStore("bridge", store), rank, 2, datetime.timedelta(seconds=timeout_s))
        out[role] = SplitWorld(role=role, global_rank=rank, world_size=2, rollout_ranks=1, timeout_s=timeout_s,
                               store=store, heartbeat=Heartbeat(store, "trainer" if rank == 0 else "rollout0", 0.2),
                               bridge=pg, bridge_rank=rank)

    threads = [threading.Thread(target=make, args=a) for a in (("trainer", 0), ("rollout", 1))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out["trainer"], out["rollout"]


#: placement.timeout_s of the channel: every bridge collective and every mailbox wait is bounded
#: by it, so it must exceed, with a wide margin, anything a healthy side can take on a loaded
#: machine (a bucket broadcast, a generate call of the tiny model); the lost-peer test
#: configures its own, shorter one and asserts against it
TIMEOUT_S = 60.0
LOST_TIMEOUT_S = 4.0
BEAT_S = 1.0  # split.Heartbeat's period


@pytest.fixture
def channel(tmp_path, request):
    timeout_s = getattr(request, "param", TIMEOUT_S)
    actor = HFActorStandIn.create(tiny_llama_config(initializer_range=0.3), seed=0)
    config_dir = actor.export_config(tmp_path / "cfg")
    trainer, rollout = _worlds(timeout_s=timeout_s)
    service = RolloutService(rollout, lambda d, eos, pad: HFRolloutEngine(d, eos_token_ids=eos, pad_token_id=pad),
                             device=torch.device("cpu"))
    failure = []

    def serve():
        try:
            service.serve()
        except Exception as e:  # noqa: BLE001 -- the test reads it
            failure.append(e)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    remote = RemoteEngine(trainer, {"config_dir": config_dir, "eos_token_ids": [], "pad_token_id": 0},
                          device=torch.device("cpu"))
    yield actor, config_dir, remote, service, thread, failure, trainer, rollout
    trainer.close()
    rollout.close()


def _publish(remote, actor, step, stream=None):
    version, manifest = actor.commit(step)
    remote.load_weights(version, stream if stream is not None else iter_buckets(actor.named_tensors(), BUCKET), manifest)
    report = remote.activate(version)
    assert report.manifest_verified and report.cache_flushed and report.version_id == version.short_id
    return version


def test_weights_stream_verified_and_commands_run_in_order(channel):
    from megarl.observability.profiling import parse_label

    actor, config_dir, remote, service, thread, failure, *_ = channel
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        v0 = _publish(remote, actor, 0)
    # the bridge's broadcasts are a span of the timeline, one per bucket, with the bytes they carry
    bridge = [parse_label(e.name) for e in prof.events() if (parse_label(e.name) or {}).get("phase") == "weight_sync.bridge"]
    assert len(bridge) > 1 and sum(int(b["bytes"]) for b in bridge) == sum(
        t.numel() * t.element_size() for _, t in actor.named_tensors()), bridge
    local = HFRolloutEngine(config_dir, eos_token_ids=[], pad_token_id=0)
    version, manifest = actor.commit(0)
    local.load_weights(version, iter_buckets(actor.named_tensors(), BUCKET), manifest)
    local.activate(version)
    for a, b in zip(remote.generate(PROMPTS, GREEDY), local.generate(PROMPTS, GREEDY)):
        assert a.response_ids == b.response_ids and torch.equal(a.raw_log_probs, b.raw_log_probs)
        assert a.policy_version == b.policy_version == v0.short_id

    before = remote.submit(PROMPTS, GREEDY)  # sent before v1 is published
    actor.perturb(scale=0.2, seed=5)
    v1 = _publish(remote, actor, 1)
    after = remote.submit(PROMPTS, GREEDY)
    old, new = remote.collect(before), remote.collect(after)
    assert {r.policy_version for r in old} == {v0.short_id}
    assert {r.policy_version for r in new} == {v1.short_id}
    assert [r.response_ids for r in old] != [r.response_ids for r in new]
    assert remote.stats["generate_s"] > 0
    remote.close()
    thread.join(timeout=10)
    assert not thread.is_alive() and not failure


def test_corrupted_bucket_is_refused_by_the_rollout_engine(channel):
    actor, _, remote, *_ = channel
    v0 = _publish(remote, actor, 0)
    actor.perturb(seed=9)
    v1, m1 = actor.commit(1)

    def corrupt(buckets):
        for i, bucket in enumerate(buckets):
            if i == 1:
                name, t = bucket[0]
                bucket = [(name, t.clone().add_(1.0))] + list(bucket[1:])
            yield bucket

    with pytest.raises(ManifestMismatchError, match="rollout rank 0"):
        remote.load_weights(v1, corrupt(iter_buckets(actor.named_tensors(), BUCKET)), m1)
    assert {r.policy_version for r in remote.generate(PROMPTS, GREEDY)} == {v0.short_id}  # still v0

    def broken(buckets):  # the trainer's own stream fails after one bucket
        for i, bucket in enumerate(buckets):
            if i == 1:
                raise RuntimeError("the actor's stream broke")
            yield bucket

    with pytest.raises(RuntimeError, match="stream broke"):
        remote.load_weights(v1, broken(iter_buckets(actor.named_tensors(), BUCKET)), m1)
    assert {r.policy_version for r in remote.generate(PROMPTS, GREEDY)} == {v0.short_id}  # in step, still v0
    remote.load_weights(v1, iter_buckets(actor.named_tensors(), BUCKET), m1)  # the retry lands
    remote.activate(v1)
    assert {r.policy_version for r in remote.generate(PROMPTS, GREEDY)} == {v1.short_id}
    remote.close()


@pytest.mark.parametrize("channel", [LOST_TIMEOUT_S], indirect=True)
def test_a_side_that_stops_beating_is_named_lost_within_the_timeout(channel):
    """The bound is the configured placement.timeout_s: a stalled heartbeat is named once it has
    not moved for that long (its last beat came at most one beat period, 1 s, before it was
    stopped), and the wait ends rather than running into the command's own TIMEOUT_S.  How soon
    after the bound it ends is bench/timeouts.py's measurement."""
    actor, _, remote, service, thread, failure, trainer, rollout = channel
    _publish(remote, actor, 0)
    rollout.heartbeat.stop()  # the rollout rank "dies": it beats no more and answers nothing
    service.inbox.alive = lambda: "stopped for the test"  # its loop ends at its next wait
    stopped = time.monotonic()
    thread.join(timeout=10)
    with pytest.raises(PeerLostError, match=rf"rollout0's heartbeat has not moved for \d+s "
                                            rf"\(placement.timeout_s={LOST_TIMEOUT_S:g}\)"):
        remote.generate(PROMPTS, GREEDY)
    waited = time.monotonic() - stopped
    assert LOST_TIMEOUT_S - BEAT_S <= waited < TIMEOUT_S, waited

    # and the other way round: a rollout rank whose trainer stopped beating stops serving
    trainer.heartbeat.stop()
    stopped = time.monotonic()
    with pytest.raises(PeerLostError, match=rf"trainer's heartbeat has not moved for \d+s "
                                            rf"\(placement.timeout_s={LOST_TIMEOUT_S:g}\)"):
        rollout.from_trainer().recv(what="a command")
    waited = time.monotonic() - stopped
    assert LOST_TIMEOUT_S - BEAT_S <= waited < TIMEOUT_S, waited


def test_segments_continue_from_the_exact_tokens_and_label_each_with_its_version(tmp_path):
    """``generate_in_segments``: greedy in segments is the whole-response call (re-prefilled at
    every boundary); a version activated between two segments finishes the responses, and each
    token is labelled with the version that sampled it -- the later tokens' log-probs are the new
    weights' own (a fresh engine on v1, teacher-forced by continuing from the same prefix)."""
    from megarl.rollout.segmented import generate_in_segments, started_on

    actor = HFActorStandIn.create(tiny_llama_config(initializer_range=0.3), seed=0)
    engine = HFRolloutEngine(actor.export_config(tmp_path / "cfg"))  # the config's eos: some stop early
    v0, m0 = actor.commit(0)
    engine.load_weights(v0, iter_buckets(actor.named_tensors(), BUCKET), m0)
    engine.activate(v0)
    whole = engine.generate(PROMPTS, GREEDY)
    parts = generate_in_segments(engine, PROMPTS, GREEDY, segment_tokens=3)
    for a, b in zip(whole, parts):
        assert a.response_ids == b.response_ids and b.token_versions is None and b.policy_version == v0.short_id
        # segment 0 is the plain call cut short; later segments re-prefill (other shapes)
        assert within(max_abs_diff(a.raw_log_probs, b.raw_log_probs), NET_FP32_LOGPROB, "split_channel/segmented_vs_whole")

    actor.perturb(scale=0.2, seed=5)
    v1, m1 = actor.commit(1)
    switched = []

    def between():  # an in-flight update after the first segment
        if not switched:
            engine.load_weights(v1, iter_buckets(actor.named_tensors(), BUCKET), m1)
            engine.activate(v1)
            switched.append(True)

    mixed = generate_in_segments(engine, PROMPTS, GREEDY, segment_tokens=3, between=between)
    fresh = HFRolloutEngine(actor.export_config(tmp_path / "cfg1"))
    fresh.load_weights(v1, iter_buckets(actor.named_tensors(), BUCKET), m1)
    fresh.activate(v1)
    for a, r in zip(whole, mixed):
        assert len(r.response_ids) > 3, "every response goes on past the first segment"
        assert r.token_versions == (v0.short_id,) * 3 + (v1.short_id,) * (len(r.response_ids) - 3)
        assert started_on(r) == v0.short_id and r.policy_version == v1.short_id
        assert r.response_ids[:3] == a.response_ids[:3]  # v0's segment, then v1 continues it
        (cont,) = fresh.generate([GenerationRequest(r.request_id, r.prompt_ids + r.response_ids[:3])],
                                 SamplingParams(temperature=0.0, max_new_tokens=5))
        assert cont.finish_reason == r.finish_reason
        assert cont.response_ids == r.response_ids[3:]
        assert within(max_abs_diff(cont.raw_log_probs, r.raw_log_probs[3:]), NET_FP32_LOGPROB,
                      "split_channel/continued_vs_fresh")


class _LoadsInPlace:
    """The hf engine as SGLang behaves: a load overwrites the weights being served, so from the
    start of ``load_weights`` until ``activate`` no version is active and ``generate`` is refused.
    ``hold_first_generate`` (set by the test) is called inside the first generate call: it returns
    once the trainer's next command has reached the rollout rank, so that command is certainly an
    in-flight one (taken between segments)."""

    def __init__(self, engine):
        self.engine, self.unserved, self.hold_first_generate, self.calls = engine, False, None, 0

    def __getattr__(self, name):
        return getattr(self.engine, name)

    @property
    def active_version(self):
        return None if self.unserved else self.engine.active_version

    def load_weights(self, version, buckets, manifest):
        self.unserved = True
        return self.engine.load_weights(version, buckets, manifest)

    def activate(self, version):
        report = self.engine.activate(version)
        self.unserved = False
        return report

    def generate(self, requests, sampling):
        from megarl.rollout.protocol import NoActiveVersionError

        if self.unserved:
            raise NoActiveVersionError("generate refused: no version is active (loaded in place, not activated)")
        self.calls += 1
        out = self.engine.generate(requests, sampling)
        if self.calls == 1 and self.hold_first_generate is not None:
            self.hold_first_generate()
        return out


def test_an_engine_that_loads_in_place_waits_between_segments_for_the_activation(tmp_path):
    """An in-flight update on an engine that serves nothing between a load and its activation
    (SGLang): the rollout rank takes the load between two segments and waits for the activation
    the trainer sends after it, rather than generating the next segment on no version.  The
    trainer sends it late on purpose (0.5 s after the load was reported)."""
    actor = HFActorStandIn.create(tiny_llama_config(initializer_range=0.3), seed=0)
    config_dir = actor.export_config(tmp_path / "cfg")
    trainer, rollout = _worlds(timeout_s=TIMEOUT_S)
    engines = []

    def make_engine(d, eos, pad):
        engines.append(_LoadsInPlace(HFRolloutEngine(d, eos_token_ids=eos, pad_token_id=pad)))
        return engines[0]

    service = RolloutService(rollout, make_engine, device=torch.device("cpu"), segment_tokens=2)
    failure = []
    thread = threading.Thread(target=_serve, args=(service, failure), daemon=True)
    thread.start()
    try:
        remote = RemoteEngine(trainer, {"config_dir": config_dir, "eos_token_ids": [], "pad_token_id": 0},
                              device=torch.device("cpu"))
        v0 = _publish(remote, actor, 0)

        def until_the_load_is_sent():
            deadline = time.monotonic() + TIMEOUT_S
            while not service.inbox.ready():
                assert time.monotonic() < deadline, "the trainer's load never arrived"
                time.sleep(0.01)

        engines[0].hold_first_generate = until_the_load_is_sent
        ticket = remote.submit(PROMPTS, GREEDY, segmented=True)
        actor.perturb(scale=0.2, seed=5)
        v1, m1 = actor.commit(1)
        remote.load_weights(v1, iter_buckets(actor.named_tensors(), BUCKET), m1)
        time.sleep(0.5)  # the activation comes late: the rollout rank must wait for it
        assert remote.activate(v1).version_id == v1.short_id
        results = remote.collect(ticket)
        for r in results:
            assert r.token_versions == (v0.short_id,) * 2 + (v1.short_id,) * 6, r.token_versions
        assert remote.stats["inflight_activations"] == 1
        remote.close()
        thread.join(timeout=10)
        assert not thread.is_alive() and not failure
    finally:
        trainer.close()
        rollout.close()


class _TwoTurnEnv:
    """Answers the first action with a tool message and ends the episode at the second."""

    def reset(self, row):
        self.n = 0
        return ()

    def step(self, action):
        from megarl.envs.protocol import Message, StepOutcome

        self.n += 1
        if self.n >= 2:
            return StepOutcome((), {"steps": float(self.n)}, terminated=True, truncated=False)
        return StepOutcome((Message("tool", "result 1"),), {}, terminated=False, truncated=False)


@pytest.mark.parametrize("waits", [True, False], ids=["waits-for-the-activation", "negative-control-without-the-wait"])
def test_an_agent_session_takes_the_version_published_between_its_turns(assets, waits):
    """Agent sessions on the rollout rank with in-flight updates: a version loaded between two
    turns of a session is activated before the next turn starts (the rank waits for the
    activation the trainer sends after the load, however late), so the second turn's policy tokens
    are the new version's and the first turn's the old one's; environment tokens have no version.
    Negative control: a rank that does not wait for the activation
    (``RolloutService.waits_for_activation = False``; its activation is sent only after the
    results, so nothing can rescue it) runs the second turn on the old version: the sessions
    never span versions, the defect the end-to-end audit of
    tests/e2e/test_agent_training.py::test_calculator_agent_split_inflight_updates_between_turns
    (``audit_labels > 0``) catches."""
    from transformers import AutoModelForCausalLM

    from megarl.control.assembly import eos_and_pad
    from megarl.data.tokenizer import TokenizerContract
    from megarl.envs.render import EnvTurnRenderer
    from megarl.rollout.agent import POLICY, AgentLimits, AgentSessionEngine

    contract = TokenizerContract.from_pretrained(assets["model"])
    actor = HFActorStandIn(AutoModelForCausalLM.from_pretrained(assets["model"], dtype=torch.float32).eval(),
                           "agent-inflight", contract.hash)
    renderer = EnvTurnRenderer(contract)

    def make_generator(engine):
        return AgentSessionEngine(engine, env_factory=_TwoTurnEnv, renderer=renderer,
                                  limits=AgentLimits(max_turns=3, max_total_tokens=60),
                                  decode=contract.tokenizer.decode, step_timeout_s=TIMEOUT_S, max_workers=2)

    trainer, rollout = _worlds(timeout_s=TIMEOUT_S)
    # segment_await_s: at the first point between turns the rank waits for the trainer's next
    # command (the load below), so the update lands inside the sessions whatever the timing
    service = RolloutService(rollout, lambda d, eos, pad: HFRolloutEngine(d, eos_token_ids=eos, pad_token_id=pad),
                             device=torch.device("cpu"), segment_tokens=1, segment_await_s=TIMEOUT_S,
                             make_generator=make_generator)
    service.waits_for_activation = waits
    failure = []
    thread = threading.Thread(target=_serve, args=(service, failure), daemon=True)
    thread.start()
    try:
        eos, pad = eos_and_pad(contract.tokenizer, assets["model"])
        remote = RemoteEngine(trainer, {"config_dir": assets["model"], "eos_token_ids": eos, "pad_token_id": pad},
                              device=torch.device("cpu"))
        v0 = _publish(remote, actor, 0)
        requests = [GenerationRequest(f"q{i}", tuple(contract.encode_prompt([{"role": "user", "content": f"{i} + 3 ?"}])),
                                      task={"row": i}) for i in range(2)]
        ticket = remote.submit(requests, SamplingParams(temperature=1.0, max_new_tokens=6, n=2, seed=4), segmented=True)
        actor.perturb(scale=0.2, seed=5)
        v1, m1 = actor.commit(1)
        remote.load_weights(v1, iter_buckets(actor.named_tensors(), BUCKET), m1)  # taken after the first turns
        if waits:
            time.sleep(0.5)  # the activation comes late: the rank must wait for it
            assert remote.activate(v1).version_id == v1.short_id
            results = remote.collect(ticket)
        else:
            results = remote.collect(ticket)
            assert remote.activate(v1).version_id == v1.short_id
        assert len(results) == 4
        for r in results:
            t = r.episode
            assert t.policy_turns == 2, (t.policy_turns, t.turns, t.finish_reason)
            by_turn, env_versions = {}, set()
            for src, turn, v in zip(t.source, t.turn, t.token_versions, strict=True):
                if src == POLICY:
                    by_turn.setdefault(turn, set()).add(v)
                else:
                    env_versions.add(v)
            assert env_versions == {None} and sorted(by_turn) == [0, 1], (by_turn, env_versions)
            first, second = by_turn[0], by_turn[1]
            assert first == {v0.short_id}, by_turn
            if waits:
                assert second == {v1.short_id} and r.policy_version == v1.short_id, by_turn
            else:  # the defect: the version was loaded between the turns, yet the second ran on v0
                assert second == {v0.short_id} and r.policy_version == v0.short_id, by_turn
        assert remote.stats["inflight_activations"] == (1 if waits else 0)
        remote.close()
        thread.join(timeout=10)
        assert not thread.is_alive() and not failure
    finally:
        trainer.close()
        rollout.close()


def _serve(service, failure):
    try:
        service.serve()
    except Exception as e:  # noqa: BLE001 -- the test reads it
        failure.append(e)


def test_teacher_forcing_overtakes_queued_generation_on_the_served_version(tmp_path):
    """``async_rl.proximal_log_probs=engine``'s job: sent while the first of two segmented batches
    generates, it is taken at the next point between segments (no batch finished yet), scores on the version served
    -- each token's log-prob is the one the engine recorded when it sampled that token (its
    KV-cached decode vs one forward over the whole sequence, fp32) -- and a job naming a version
    the engine does not serve is refused, not scored on the wrong weights."""
    from megarl.rollout.protocol import RolloutError

    actor = HFActorStandIn.create(tiny_llama_config(initializer_range=0.3), seed=0)
    config_dir = actor.export_config(tmp_path / "cfg")
    trainer, rollout = _worlds(timeout_s=TIMEOUT_S)
    service = RolloutService(rollout, lambda d, eos, pad: HFRolloutEngine(d, eos_token_ids=eos, pad_token_id=pad),
                             device=torch.device("cpu"), segment_tokens=2, segment_delay_s=0.2)
    failure = []
    thread = threading.Thread(target=_serve, args=(service, failure), daemon=True)
    thread.start()
    try:
        # the config's eos (3) named: a sampled response ends at it
        remote = RemoteEngine(trainer, {"config_dir": config_dir, "eos_token_ids": [3], "pad_token_id": 0},
                              device=torch.device("cpu"))
        v0 = _publish(remote, actor, 0)
        sampled = remote.generate(PROMPTS, SamplingParams(temperature=1.0, max_new_tokens=8, seed=3))
        jobs0 = remote.stats["jobs"]
        taken = service.inbox.received
        queued = [remote.submit(PROMPTS, GREEDY, segmented=True) for _ in range(2)]
        deadline = time.monotonic() + TIMEOUT_S
        while service.inbox.received == taken:  # the first batch is being generated (4 segments)
            assert time.monotonic() < deadline, "the rollout rank never took the first batch"
            time.sleep(0.005)
        ticket = remote.submit_teacher_force([r.prompt_ids for r in sampled], [r.response_ids for r in sampled],
                                             version=v0.short_id)
        scored = remote.collect(ticket)
        assert remote.stats["jobs"] == jobs0 and remote.stats["teacher_force_s"] > 0  # before either batch ended
        for r, lp in zip(sampled, scored):
            assert lp.dtype == torch.float32 and lp.shape == r.raw_log_probs.shape
            assert within(max_abs_diff(lp, r.raw_log_probs), NET_FP32_LOGPROB, "split_channel/teacher_force")
        for t in queued:
            assert {r.policy_version for r in remote.collect(t)} == {v0.short_id}
        wrong = remote.submit_teacher_force([PROMPTS[0].prompt_ids], [(3, 4)], version="v7.0-00000000")
        with pytest.raises(RolloutError, match=f"asked to teacher-force on v7.0-00000000, but it serves {v0.short_id}"):
            remote.collect(wrong)
        remote.close()
        thread.join(timeout=10)
        assert not thread.is_alive() and not failure
    finally:
        trainer.close()
        rollout.close()
