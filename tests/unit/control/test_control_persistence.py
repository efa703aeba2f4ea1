"""RunPersistence on its own: a fake actor (a weight vector, a scheduler, a model spec), a fake
tokenizer contract and a real sampler, KL controller and state machine.  Checkpoints go through
the real ``megarl.checkpointing.checkpoint`` (temporary dir, MANIFEST with sha256 of every file, ``latest``,
RNG, verification on read); only the megatron dist-checkpoint of the roles
(``megarl.models.megatron_ckpt``) is replaced by a file holding the fake weights."""

from __future__ import annotations

import contextlib
import copy
import json
import os
import random
import sys
import types
from collections import Counter

import numpy as np
import pytest
import torch

from megarl.algo.kl import FixedKLController
from megarl.checkpointing import checkpoint
from megarl.config import section_hash
from megarl.control.interfaces import RunProgress
from megarl.control.persistence import RunPersistence
from megarl.control.state_machine import CompletionConditionError, IterationStateMachine, Phase
from megarl.data.prompts import PromptSampler
from tests._control_fakes import H, Dataset, load_cfg, prompt_records, sealed_batch, version


class Spec:
    def __init__(self, **d):
        self.d = d

    def to_dict(self):
        return dict(self.d)


class FakeDDP:
    def __init__(self):
        self.w = torch.zeros(3)
        self.megarl_spec = Spec(hidden=4, layers=2)


class FakeScheduler:
    def __init__(self):
        self.num_steps = 0

    def state_dict(self):
        return {"num_steps": self.num_steps}

    def load_state_dict(self, d):
        self.num_steps = d["num_steps"]


class FakeActor:
    def __init__(self):
        self.ddp, self.optimizer, self.scheduler, self.steps = FakeDDP(), None, FakeScheduler(), 0

    def onload(self):
        pass


class FakeTok:
    def __init__(self):
        self.hash, self.chat_template = H("tok"), "{{ messages }}"


class RewardFn:
    version = "arith/1"


@pytest.fixture
def fake_role_checkpoints(monkeypatch):
    mod = types.ModuleType("megarl.models.megatron_ckpt")

    def save_megatron_checkpoint(model, path):
        os.makedirs(path, exist_ok=True)
        torch.save({"w": model.w.clone()}, os.path.join(path, "w.pt"))

    def load_megatron_checkpoint(model, path):
        model.w.copy_(torch.load(os.path.join(path, "w.pt"))["w"])

    mod.save_megatron_checkpoint, mod.load_megatron_checkpoint = save_megatron_checkpoint, load_megatron_checkpoint
    monkeypatch.setitem(sys.modules, "megarl.models.megatron_ckpt", mod)
    rng = torch.get_rng_state(), np.random.get_state(), random.getstate()
    yield
    # resume restores the checkpoint's RNG: leave the process as it was
    torch.set_rng_state(rng[0])
    np.random.set_state(rng[1])
    random.setstate(rng[2])


class FakeReference:
    def __init__(self, w=0.0):
        self.model, self.version, self.refreshes = FakeDDP(), "ref-0", 0
        self.model.w += w

    def _on_device(self):
        return contextlib.nullcontext()

    def origin_id(self, identify):
        return identify(self.model)


class FakeRewardModel:
    def __init__(self, w=0.0, tok="rm-tok", template="{{ rm }}"):
        self.model, self.contract = FakeDDP(), types.SimpleNamespace(hash=H(tok), chat_template=template)
        self.model.w += w
        self.version = "rm-fake"


def weights_of(model) -> str:
    """The fake roles' weight identity: a hash of their weight vector."""
    return H(model.w.tolist())


def make(run_dir, *overrides, cfg=None, reference=None, reward_model=None, reward_fn=None, actor_w=0.0):
    cfg = copy.deepcopy(cfg) if cfg is not None else load_cfg(*overrides)
    if reward_model is not None and not cfg.reward.model.path:
        cfg.reward.model.path = "/rm"  # the entry the role was built from
    actor = FakeActor()
    actor.ddp.w += actor_w
    return RunPersistence(cfg, str(run_dir), actor=actor, critic=None, reference=reference,
                          sampler=PromptSampler(10, seed=3), kl_ctl=FixedKLController(0.001), progress=RunProgress(),
                          tok=FakeTok(), train_data=Dataset(prompt_records(2), stats={"sha256": "data-sha"}),
                          reward_fn=reward_fn or RewardFn(), reward_models=() if reward_model is None else (reward_model,),
                          layout={"tp": 1, "pp": 1, "dp": 1, "world": 1}, rank0=True, identify=weights_of)


# ---- contract hashes ----------------------------------------------------------------------------


def test_contract_hashes_are_golden_and_each_changes_only_with_its_contract(tmp_path):
    p = make(tmp_path)
    base = p.contract_hashes()
    assert set(base) == {"tokenizer", "chat_template", "sampling", "reward", "model_config", "train_data"}
    assert base["tokenizer"] == H("tok") and base["train_data"] == "data-sha"
    assert base["chat_template"] == section_hash({"template": "{{ messages }}"})
    sampling = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "max_new_tokens": 6, "n": 8}
    assert base["sampling"] == section_hash(sampling)
    assert base["reward"] == section_hash(p.cfg.reward)
    changes = [
        (lambda q: setattr(q.tok, "hash", H("tok2")), {"tokenizer"}),
        (lambda q: setattr(q.tok, "chat_template", "{{ other }}"), {"chat_template"}),
        (lambda q: setattr(q.cfg.rollout, "temperature", 0.7), {"sampling"}),
        (lambda q: setattr(q.cfg.rollout, "n", 4), {"sampling"}),
        (lambda q: setattr(q.cfg.rollout, "bucket_mb", 64), set()),  # transport, not a contract
        (lambda q: setattr(q.cfg.reward, "timeout_s", 3.0), {"reward"}),
        (lambda q: q.cfg.reward.penalty.__setitem__("error", -1.0), {"reward"}),
        (lambda q: q.actor.ddp.megarl_spec.d.__setitem__("hidden", 8), {"model_config"}),
        (lambda q: q.train_data.stats.__setitem__("sha256", "other"), {"train_data"}),
        (lambda q: setattr(q.cfg.algo, "clip_low", 0.1), set()),  # not a checkpoint contract (a pending one)
    ]
    for change, fields in changes:
        q = make(tmp_path, cfg=p.cfg)
        change(q)
        now = q.contract_hashes()
        assert {k for k in base if now[k] != base[k]} == fields


# ---- checkpoints ---------------------------------------------------------------------------------


def test_save_and_resume_restore_the_position_and_counters_stay_cumulative(tmp_path, fake_role_checkpoints):
    v = version(6)
    p = make(tmp_path)
    p.progress.counters.update({"candidates_lost": 3})
    p.progress.parity_checked, p.progress.last_eval = True, 0.75
    p.sampler.next_indices(4)
    p.actor.steps, p.actor.scheduler.num_steps = 6, 6
    p.actor.ddp.w += 7.0
    path = p.save(2, "run", v, v.weight_manifest_hash)
    assert os.path.basename(path) == "iter_000002" and checkpoint.find_latest(p.ckpt_root) == path
    assert p.progress.counters["checkpoints"] == 1
    state = checkpoint.read_state(path)  # verified against its MANIFEST
    assert state["counters"] == {"candidates_lost": 3, "checkpoints": 1}  # the checkpoint counts itself
    assert state["policy_version"] == v.to_dict() and state["weight_manifests"] == {"actor": v.weight_manifest_hash}
    assert state["hashes"] == p.contract_hashes() and state["scorer_version"] == "arith/1"

    q = make(tmp_path)
    got = q.resume()
    assert (got["iteration"], got["run_id"]) == (2, "run")
    assert q.progress.counters == Counter({"candidates_lost": 3, "checkpoints": 1, "resumes": 1})
    assert q.progress.parity_checked and q.progress.last_eval == 0.75
    assert q.sampler.state_dict() == p.sampler.state_dict()
    assert (q.actor.steps, q.actor.scheduler.num_steps) == (6, 6)
    assert torch.equal(q.actor.ddp.w, torch.full((3,), 7.0))
    q.save(3, "run", v, v.weight_manifest_hash)
    assert checkpoint.read_state(checkpoint.find_latest(q.ckpt_root))["counters"]["checkpoints"] == 2


def test_resume_refuses_a_changed_contract_naming_the_field_unless_forced(tmp_path, fake_role_checkpoints):
    v = version(6)
    make(tmp_path).save(2, "run", v, v.weight_manifest_hash)
    q = make(tmp_path, "rollout.temperature=0.7")
    with pytest.raises(checkpoint.CheckpointError) as e:
        q.resume()
    assert "sampling changed" in str(e.value) and "iter_000002" in str(e.value)
    assert "resume_force" in str(e.value)
    forced = make(tmp_path, "rollout.temperature=0.7", "trainer.resume_force=true")
    state = forced.resume()
    assert state["run_id"] == "run-forced2"
    assert forced.progress.counters["forced_resumes"] == 1 and forced.progress.counters["resumes"] == 1


# ---- identities: what a start rebuilds from a path must be the checkpoint's ----------------------


def saved_run(tmp_path, *overrides, **roles):
    """A checkpoint of a run whose roles were built with ``roles`` (reference, reward model...)."""
    v = version(6)
    p = make(tmp_path, *overrides, **roles)
    p.record_origins()
    p.save(2, "run", v, v.weight_manifest_hash)
    return p


def refused(q) -> str:
    q.record_origins()
    with pytest.raises(checkpoint.CheckpointError) as e:
        q.resume()
    return str(e.value)


def test_the_unrefreshed_reference_is_named_by_its_weights(tmp_path):
    p = make(tmp_path, reference=FakeReference(1.0))
    o = p.record_origins()
    assert o["reference"] == {"key": "model.path", "path": p.cfg.model.path, "id": weights_of(p.reference.model)}
    assert p.reference.version == "ref-0-" + weights_of(p.reference.model).split(":")[1][:8]
    assert o["model"]["id"] == weights_of(p.actor.ddp) and o["scorer"]["id"] == "arith/1"


def test_a_resume_refuses_another_reference_naming_the_key_and_both_identities(tmp_path, fake_role_checkpoints):
    """The measured hole: the same run directory resumed with reference.path at another export of
    the same architecture went on without a word, and the KL anchor was another model."""
    p = saved_run(tmp_path, reference=FakeReference(1.0))
    saved = p.origins["reference"]["id"]
    q = make(tmp_path, "reference.path=/exports/other", reference=FakeReference(2.0))
    msg = refused(q)
    assert msg.startswith("resume from ") and "reference.path:" in msg, msg
    assert saved in msg and q.origins["reference"]["id"] in msg and "/exports/other" in msg
    assert "new trainer.run_dir" in msg and "resume_force" in msg and "\n" not in msg
    # the same reference: resumes (negative control of the refusal)
    assert make(tmp_path, reference=FakeReference(1.0)).resume() is not None
    # forced: continues under a new run id, counted
    forced = make(tmp_path, "reference.path=/exports/other", "trainer.resume_force=true", reference=FakeReference(2.0))
    forced.record_origins()
    assert forced.resume()["run_id"] == "run-forced2" and forced.progress.counters["forced_resumes"] == 1


def test_a_resume_refuses_another_model_path_reward_model_or_scorer(tmp_path, fake_role_checkpoints):
    saved_run(tmp_path, reward_model=FakeRewardModel())
    assert "model.path:" in refused(make(tmp_path, actor_w=3.0, reward_model=FakeRewardModel()))
    for rm, what in ((FakeRewardModel(w=1.0), "weights="), (FakeRewardModel(tok="other"), "tokenizer="),
                     (FakeRewardModel(template="{{ other }}"), "template=")):
        msg = refused(make(tmp_path, reward_model=rm))
        assert "reward.model.path:" in msg and what in msg and msg.count("model.path:") == 1, msg

    class Upgraded:
        version = "arith/2"

    msg = refused(make(tmp_path, reward_model=FakeRewardModel(), reward_fn=Upgraded()))
    assert "reward.fn:" in msg and "(arith/1)" in msg and "(arith/2)" in msg, msg
    q = make(tmp_path, reward_model=FakeRewardModel())  # the same roles resume
    q.record_origins()
    assert q.resume()["iteration"] == 2


def test_a_refreshed_reference_survives_a_checkpoint_bitwise(tmp_path, fake_role_checkpoints, monkeypatch):
    """A refreshed reference is restored from the checkpoint (its path no longer matters) and must
    hash to what was saved.  Negative control: a load that changes one weight is refused."""
    ref = FakeReference(1.0)
    p = make(tmp_path, reference=ref)
    p.record_origins()
    ref.model.w += 4.0  # refresh_from copies the actor's weights in
    ref.refreshes, ref.version = 1, "ref-v6.0-0000abcd"
    v = version(6)
    p.save(2, "run", v, v.weight_manifest_hash)
    assert checkpoint.read_state(checkpoint.find_latest(p.ckpt_root))["reference"]["weights"] == weights_of(ref.model)
    q = make(tmp_path, "reference.path=/anything", reference=FakeReference(9.0))  # rebuilt, then loaded over
    q.record_origins()
    q.resume()
    assert torch.equal(q.reference.model.w, ref.model.w) and q.reference.version == "ref-v6.0-0000abcd"
    mod = sys.modules["megarl.models.megatron_ckpt"]
    load = mod.load_megatron_checkpoint

    def corrupting(model, path):
        load(model, path)
        if os.path.basename(path) == "reference":
            model.w[0] = torch.nextafter(model.w[0], torch.tensor(float("inf")))  # one ulp

    monkeypatch.setattr(mod, "load_megatron_checkpoint", corrupting)
    msg = refused(make(tmp_path, reference=FakeReference(9.0)))
    assert "the refreshed reference loaded from the checkpoint hashes to" in msg, msg


def test_resume_without_a_checkpoint_starts_fresh(tmp_path):
    assert make(tmp_path).resume() is None


def test_truncate_metrics_drops_the_rows_that_will_run_again(tmp_path):
    p = make(tmp_path)
    with open(tmp_path / "metrics.jsonl", "w") as f:
        for i in range(5):
            f.write(json.dumps({"iteration": i, "x": i}) + "\n")
    p.truncate_metrics(3)
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in rows] == [0, 1, 2]


# ---- the pending sealed batch (trainer.resume_experience=reuse) ------------------------------


def pending(tmp_path, *overrides):
    v = version(6)
    p = make(tmp_path, *overrides)
    p.sampler.next_indices(2)
    p.progress.parity_checked = True
    batch = sealed_batch(v, [[1.0, 0.0], [0.0, 1.0]], k=4)
    p.write_pending(4, v, batch, {"rollout/reward_mean": 0.5, "eval/accuracy": 0.25}, Counter(candidates_lost=2))
    return p, v, batch


def test_a_pending_batch_round_trips_with_what_its_rollout_changed(tmp_path):
    p, v, batch = pending(tmp_path)
    assert os.path.isfile(os.path.join(p.pending_dir, "position.json"))
    got, side = make(tmp_path).load_pending({"iteration": 4}, v)
    assert got.content_hash == batch.content_hash and set(got.facts.policy_version) == {v.short_id}
    assert side["sampler"] == p.sampler.state_dict() and side["counters"] == {"candidates_lost": 2}
    assert side["parity_checked"] is True and side["metrics"]["eval/accuracy"] == 0.25
    assert make(tmp_path).load_pending({"iteration": 3}, v) is None  # not the resumed iteration's: rerun it


@pytest.mark.parametrize("other,field", [
    (version(7), "optimizer_step"),
    (version(6, weights="w-other"), "weight_manifest_hash"),
    (version(6, run_id="run2"), "run_id"),
])
def test_a_pending_batch_of_another_version_is_refused_naming_the_field(tmp_path, other, field):
    pending(tmp_path)
    with pytest.raises(checkpoint.CheckpointError) as e:
        make(tmp_path).load_pending({"iteration": 4}, other)
    assert f"{field}=" in str(e.value) and "resume_experience=rerun" in str(e.value)


@pytest.mark.parametrize("override,field", [
    ("algo.clip_low=0.1", "algo"), ("rollout.top_k=5", "sampling"), ("reward.max_retries=0", "reward")])
def test_a_pending_batch_under_a_changed_config_is_refused_naming_the_field(tmp_path, override, field):
    _, v, _ = pending(tmp_path)
    with pytest.raises(checkpoint.CheckpointError) as e:
        make(tmp_path, override).load_pending({"iteration": 4}, v)
    assert str(e.value).startswith(f"trainer.resume_experience=reuse: {field} changed")


def test_a_pending_batch_that_is_not_the_described_one_is_refused(tmp_path):
    p, v, _ = pending(tmp_path)
    side_path = os.path.join(p.pending_dir, "position.json")
    side = json.load(open(side_path))
    side["content_hash"] = "sha256:" + "0" * 64
    json.dump(side, open(side_path, "w"))
    with pytest.raises(checkpoint.CheckpointError, match="not the one position.json describes"):
        make(tmp_path).load_pending({"iteration": 4}, v)


def test_adopting_a_pending_batch_seals_it_and_continues_the_counters(tmp_path):
    p, v, batch = pending(tmp_path)
    q = make(tmp_path)
    q.progress.counters.update({"candidates_lost": 1, "resumes": 1})
    sm = IterationStateMachine(v)
    got, metrics = q.adopt_pending(q.load_pending({"iteration": 4}, v), 4, v, sm)
    assert got.content_hash == batch.content_hash and metrics["rollout/reward_mean"] == 0.5
    assert [s.phase for s in sm.history] == [Phase.ACTOR_COMMITTED, Phase.EXPERIENCE_SEALED] and sm.state.version == v
    assert q.progress.counters == Counter({"candidates_lost": 3, "resumes": 1, "sealed_batches_reused": 1})
    assert q.progress.parity_checked and q.progress.last_eval == 0.25
    assert q.sampler.state_dict() == p.sampler.state_dict()


def test_adopting_a_batch_of_another_version_fails_the_state_machine(tmp_path):
    p, v, batch = pending(tmp_path)
    other = version(6, weights="w-other")
    sm = IterationStateMachine(other)
    with pytest.raises(CompletionConditionError, match="samples carry versions"):
        make(tmp_path).adopt_pending((batch, {"sampler": {}, "counters": {}, "parity_checked": False,
                                              "metrics": {}}), 4, other, sm)
    assert sm.state.phase is Phase.FAILED
