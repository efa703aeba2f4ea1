"""WeightPublisher and EngineTimeSlice on their own.

The real ``sync_actor_to_engine`` runs (bucketing, the transport seam, draining); only the
megatron stream under it (``weight_sync.iter_hf_tensors``) is replaced by a fake actor's named
tensors.  The engine is a fake that verifies what landed exactly as the hf backend does: a real
:class:`TensorManifest` of the received tensors compared with the expected one (so the
corrupt-in-transit fault is refused by a real checksum comparison, not by a flag)."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from megarl.control.placement import Placement
from megarl.control.publication import EngineTimeSlice, WeightPublisher
from megarl.control.state_machine import CompletionConditionError, IterationStateMachine, Phase
from megarl.rollout import weight_sync
from megarl.rollout.protocol import ActivationReport, LoadReport, RolloutError, VersionNotStagedError
from megarl.rollout.weight_stream import ManifestMismatchError, TensorManifest
from megarl.versions import PolicyVersion
from tests._control_fakes import H, phases


class FakeModel:
    def __init__(self, seed=0):
        g = torch.Generator().manual_seed(seed)
        self.tensors = [("model.embed_tokens.weight", torch.randn(16, 8, generator=g)),
                        ("model.layers.0.mlp.up_proj.weight", torch.randn(12, 8, generator=g)),
                        ("model.norm.weight", torch.ones(8)),
                        ("lm_head.weight", torch.randn(16, 8, generator=g))]


class FakeRole:
    def __init__(self, model=None):
        self.ddp = model
        self.calls = Counter()

    def offload(self):
        self.calls["offload"] += 1

    def onload(self):
        self.calls["onload"] += 1


class VerifyingEngine:
    """Stages what arrives, checks it against the expected manifest, activates only a verified
    version (flushing its cache).  ``refuse``: the first N loads raise a RolloutError."""

    device = torch.device("cpu")
    dtype = torch.float32

    def __init__(self, refuse=0, report_flush=True):
        self.refuse, self.report_flush = refuse, report_flush
        self.active = self.staged = None
        self.loads, self.events, self.flushes = 0, [], 0
        self.received, self.held = [], {}

    def staging_target(self, name):
        return None

    def load_weights(self, version, buckets, expected, keep_unsent=False):
        self.loads += 1
        self.events.append("load" if not keep_unsent else "load_some")
        if expected.global_hash != version.weight_manifest_hash:
            raise ManifestMismatchError(f"expected manifest is not {version.short_id}'s")
        got, n_bytes, n_buckets = TensorManifest(), 0, 0
        for bucket in buckets:
            n_buckets += 1
            for name, t in bucket:
                got.add(name, t.clone())
                self.held[name] = t.clone()
                n_bytes += t.numel() * t.element_size()
        self.received.append(got)
        if keep_unsent:  # what it holds already, proven as it lies (the hf backend's KeepsUnsentTensors)
            got = TensorManifest()
            for name, t in self.held.items():
                got.add(name, t)
        if self.refuse:
            self.refuse -= 1
            raise RolloutError("scheduler busy")
        diff = expected.compare(got)
        if not diff.ok:
            raise ManifestMismatchError(f"{version.short_id}: {diff.describe()}", diff)
        self.staged = version
        return LoadReport(version.short_id, got.global_hash, len(got), n_bytes, n_buckets, 0.0)

    def activate(self, version):
        if self.staged != version:
            raise VersionNotStagedError(f"activate({version.short_id}): not staged")
        self.active, self.staged = version, None
        self.flushes += 1
        return ActivationReport(version.short_id, version.weight_manifest_hash, True, self.report_flush)

    def sleep(self):
        self.events.append("sleep")

    def wake(self):
        self.events.append("wake")


@pytest.fixture(autouse=True)
def fake_stream(monkeypatch):
    def iter_hf_tensors(model, dtype=None, device="cpu", out=None, names=None):
        for name, t in model.tensors:
            if names is None or name in names:
                yield name, (t if dtype is None else t.to(dtype)).to(device)

    monkeypatch.setattr(weight_sync, "iter_hf_tensors", iter_hf_tensors)


class Injector:
    def __init__(self):
        self.counts = Counter()

    def count(self, what, n=1):
        self.counts[what] += n


def committed(model, step=0):
    m = TensorManifest.from_named_tensors(model.tensors)
    return PolicyVersion("run", step, 0, m.global_hash, H("tok"), H("cfg")), m


def publisher(engine, *, max_retries=2, corrupt_at=(), critic=True, time_slice=None, groups=1):
    model = FakeModel()
    v, m = committed(model)
    sm = IterationStateMachine(v)
    pub = WeightPublisher(actor=FakeRole(model), critic=FakeRole() if critic else None, engine=engine,
                          placement=Placement(num_groups=groups, group_index=0, is_group_leader=True), sm=sm,
                          time_slice=time_slice or EngineTimeSlice(engine, False), counters=Counter(),
                          sync_dtype=None, bucket_mb=1, max_retries=max_retries, corrupt_at=corrupt_at,
                          injector=Injector(), rank0=False)
    return pub, sm, v, m, model


def test_a_verified_load_ends_rollout_ready_with_a_flushed_cache():
    engine = VerifyingEngine()
    ts = EngineTimeSlice(engine, True)
    ts.release()  # the engine slept through the last update
    pub, sm, v, m, model = publisher(engine, time_slice=ts)
    out = pub.publish(v, m, k=0)
    assert phases(sm) == ["ACTOR_COMMITTED", "EXPORTING", "ROLLOUT_LOADING", "ROLLOUT_READY"]
    assert sm.state.version == v and engine.active == v and engine.flushes == 1
    assert engine.events == ["sleep", "wake", "load"]  # woken before the stream
    assert engine.received[0].global_hash == v.weight_manifest_hash
    assert out["rollout/weight_sync_bytes"] == float(sum(t.numel() * 4 for _, t in model.tensors))
    assert pub.counters["kv_flushes"] == 1 and pub.counters["weight_load_failures"] == 0
    assert pub.actor.calls["offload"] == 1 and pub.critic.calls["offload"] == 1


def test_a_refused_load_is_retried_and_the_state_machine_records_each_failure():
    engine = VerifyingEngine(refuse=2)
    pub, sm, v, m, _ = publisher(engine, max_retries=2)
    pub.publish(v, m, k=1)
    assert engine.loads == 3 and engine.active == v
    assert pub.counters["weight_load_failures"] == 2
    fails = [s for s in sm.history if s.phase is Phase.FAILED]
    assert len(fails) == 2 and all(v.short_id in s.reason and "RolloutError: scheduler busy" in s.reason for s in fails)
    assert phases(sm)[-4:] == ["ACTOR_COMMITTED", "EXPORTING", "ROLLOUT_LOADING", "ROLLOUT_READY"]


def test_refusals_past_max_retries_raise_naming_the_version():
    engine = VerifyingEngine(refuse=10)
    pub, sm, v, m, _ = publisher(engine, max_retries=1)
    with pytest.raises(RolloutError) as e:
        pub.publish(v, m, k=1)
    assert v.short_id in str(e.value) and "2 times" in str(e.value) and "rollout.max_retries=1" in str(e.value)
    assert engine.loads == 2 and engine.active is None
    assert sm.state.phase is Phase.FAILED and pub.counters["weight_load_failures"] == 2
    assert pub.actor.calls["offload"] == 0  # the actor stays where it is: nothing was published


def test_a_bucket_corrupted_in_transit_is_refused_by_the_manifest_check_then_reloaded():
    engine = VerifyingEngine()
    pub, sm, v, m, model = publisher(engine, corrupt_at=(4,))
    before = [t.clone() for _, t in model.tensors]
    pub.publish(v, m, k=4)
    (fail,) = [s for s in sm.history if s.phase is Phase.FAILED]
    assert "ManifestMismatchError" in fail.reason and "model.embed_tokens.weight: checksum expected" in fail.reason
    bad, good = engine.received
    assert m.compare(bad).mismatched[0][:2] == ("model.embed_tokens.weight", "checksum")
    assert good.global_hash == v.weight_manifest_hash and engine.active == v
    assert pub.counters["weight_load_failures"] == 1 and pub.injector.counts["corrupted_weight_syncs"] == 1
    assert all(torch.equal(a, t) for a, (_, t) in zip(before, model.tensors))  # the actor's own weights untouched
    assert sm.state.phase is Phase.ROLLOUT_READY


@pytest.mark.parametrize("k", [None, 3])
def test_corruption_is_injected_only_in_the_named_iterations(k):
    engine = VerifyingEngine()
    pub, sm, v, m, _ = publisher(engine, corrupt_at=(4,))
    pub.publish(v, m, k=k)
    assert engine.loads == 1 and pub.counters["weight_load_failures"] == 0 and not pub.injector.counts


def test_an_unflushed_cache_never_reaches_rollout_ready():
    pub, sm, v, m, _ = publisher(VerifyingEngine(report_flush=False))
    with pytest.raises(CompletionConditionError, match="KV/prefix cache not flushed"):
        pub.publish(v, m, k=0)
    assert sm.state.phase is Phase.FAILED


def test_every_inference_group_must_report_an_activation():
    pub, sm, v, m, _ = publisher(VerifyingEngine(), groups=2)  # one process: only one group reports
    with pytest.raises(CompletionConditionError, match="1 of 2 inference groups"):
        pub.publish(v, m, k=0)


def test_a_manifest_that_is_not_the_versions_is_refused_before_any_load():
    engine = VerifyingEngine()
    pub, sm, v, m, model = publisher(engine)
    other = TensorManifest.from_named_tensors(FakeModel(seed=1).tensors)
    with pytest.raises(CompletionConditionError, match="export manifest"):
        pub.publish(v, other, k=0)
    assert engine.loads == 0 and sm.state.phase is Phase.FAILED


def test_ranks_without_an_engine_only_drain_the_stream():
    """A rank that holds no engine drains the stream and reports no activation: alone (no
    leader's report gathered) it cannot reach ROLLOUT_READY."""
    pub, sm, v, m, _ = publisher(None)
    pub.placement = Placement(num_groups=1, group_index=-1, is_group_leader=False)
    with pytest.raises(CompletionConditionError, match="0 of 1 inference groups"):
        pub.publish(v, m, k=0)


def test_engine_time_slice_releases_and_resumes_only_when_enabled():
    e = VerifyingEngine()
    ts = EngineTimeSlice(e, True)
    ts.resume()
    assert e.events == []  # never asleep: nothing to wake
    ts.release()
    ts.resume()
    ts.resume()
    assert e.events == ["sleep", "wake"] and not ts.asleep
    off = EngineTimeSlice(e, False)
    off.release()
    off.resume()
    assert e.events == ["sleep", "wake"]
    none = EngineTimeSlice(None, True)
    none.release()
    none.resume()
    assert not none.enabled and not none.asleep


def test_a_lora_actor_sends_its_adapted_tensors_after_a_whole_first_load():
    """changed_only (a LoRA actor's adapted linears): the first load is whole; later ones send
    only those, the engine keeping the rest proven against the manifest; a version that changed a
    tensor outside them fails that check and is retried whole."""
    engine = VerifyingEngine()
    pub, sm, v0, m0, model = publisher(engine)
    adapted = "model.layers.0.mlp.up_proj.weight"
    pub.changed_only = frozenset({adapted})
    pub.publish(v0, m0, k=0)
    model.tensors[1] = (adapted, model.tensors[1][1] + 1.0)
    v1, m1 = committed(model, step=1)
    pub.sm = IterationStateMachine(v1)  # the next iteration's, committed v1
    out = pub.publish(v1, m1, k=1)
    assert list(engine.received[-1].entries) == [adapted] and engine.active == v1
    assert out["rollout/weight_sync_bytes"] == 12 * 8 * 4 and engine.events[-1] == "load_some"
    model.tensors[2] = ("model.norm.weight", model.tensors[2][1] * 2.0)  # outside the adapted set
    v2, m2 = committed(model, step=2)
    pub.sm = sm = IterationStateMachine(v2)
    pub.publish(v2, m2, k=2)
    assert engine.events[-2:] == ["load_some", "load"] and engine.active == v2
    assert pub.counters["weight_load_failures"] == 1
    (fail,) = [s for s in sm.history if s.phase is Phase.FAILED]
    assert "model.norm.weight" in fail.reason
