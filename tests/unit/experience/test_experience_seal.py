"""Experience record: validation, sealing (read-only), save / load with hash verification."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from tests._experience import make_facts
from tests.dist_algo_invariance import ACTOR
from megarl.experience.schema import (
    DerivedTensors,
    ExperienceBatch,
    FinishReason,
    LogProbProducer,
    LogProbs,
    RewardRecord,
    RewardStatus,
)
from megarl.experience.seal import CorruptExperienceError, SealedWriteError, load_sealed, save_sealed, seal, verify, with_derived


def sealed_batch() -> ExperienceBatch:
    facts = make_facts()
    sealed = seal(ExperienceBatch(facts))
    adv = torch.randn(facts.batch_size, facts.response_len)
    return with_derived(sealed, DerivedTensors(advantages=adv, loss_mask=facts.response_mask, estimator="grpo", hyperparameters={"eps": 1e-6}))


def test_facts_validation_names_the_field():
    f = make_facts()
    assert f.terminated().tolist() == [False] + [True] * 5
    with pytest.raises(ValueError, match="old_log_probs must be produced by role"):
        make_facts(old_log_probs=f.ref_log_probs)
    with pytest.raises(ValueError, match="ref_log_probs must be produced by role"):
        make_facts(ref_log_probs=f.old_log_probs)
    with pytest.raises(ValueError, match="old_log_probs version 'v6' must be the behaviour policy_version"):
        make_facts(old_log_probs=LogProbs(f.old_log_probs.values, LogProbProducer("actor", "v6")))
    with pytest.raises(ValueError, match=r"ExperienceFacts.group_id has 5 entries, expected bs=6"):
        make_facts(group_id=f.group_id[:5])
    with pytest.raises(ValueError, match="finish_reason 'abort'"):
        make_facts(finish_reason=(FinishReason.ABORT,) + f.finish_reason[1:])
    with pytest.raises(ValueError, match=r"ExperienceFacts.values must have shape \(6, 9\)"):
        make_facts(values=f.values[:, :-1])


def test_reward_failures_are_statuses_not_zeros():
    with pytest.raises(ValueError, match="total must be None when status is 'timeout'"):
        RewardRecord(total=0.0, scorer_version="rm-1", status=RewardStatus.TIMEOUT, error="verifier timed out")
    with pytest.raises(ValueError, match="error must explain"):
        RewardRecord(total=None, scorer_version="rm-1", status="error")
    bad = RewardRecord(total=None, scorer_version="rm-1", status="invalid", error="unparseable answer")
    f = make_facts(rewards=(bad,) + make_facts().rewards[1:])
    with pytest.raises(ValueError, match="reward status 'invalid'"):
        f.scores()


def test_sealed_batch_refuses_every_kind_of_write():
    batch = sealed_batch()
    assert batch.sealed
    old = batch.facts.old_log_probs.values
    before = old.clone()
    writes = [
        lambda: old.__setitem__((0, 0), 1.0),
        lambda: old.add_(1),
        lambda: old[0].zero_(),
        lambda: old.detach().fill_(3),
        lambda: torch.add(old, 1, out=old),
        lambda: batch.derived.advantages.mul_(2),
        lambda: batch.facts.response_mask.copy_(torch.zeros_like(batch.facts.response_mask)),
        lambda: old.requires_grad_(True),
    ]
    for w in writes:
        with pytest.raises(SealedWriteError):
            w()
    with pytest.raises(ValueError, match="read-only"):
        old.numpy()[0, 0] = 5.0
    with pytest.raises(dataclasses.FrozenInstanceError):
        batch.facts.old_log_probs = batch.facts.ref_log_probs
    assert torch.equal(old, before)
    verify(batch)
    # reading and arithmetic still work, and give ordinary tensors
    y = old * 2 + 1
    y.add_(1)
    assert type(y) is torch.Tensor


def test_sealing_copies_the_callers_tensors():
    facts = make_facts()
    sealed = seal(ExperienceBatch(facts))
    facts.old_log_probs.values.add_(1.0)  # the caller's unsealed tensor
    verify(sealed)
    assert not torch.equal(sealed.facts.old_log_probs.values, facts.old_log_probs.values)


def test_save_load_roundtrip_verifies_hash(tmp_path):
    batch = sealed_batch()
    manifest = save_sealed(batch, tmp_path / "exp")
    data = json.loads(manifest.read_text())
    assert data["content_hash"] == batch.content_hash and data["metadata"]["sample_id"] == list(batch.facts.sample_id)
    back = load_sealed(tmp_path / "exp")
    assert back.content_hash == batch.content_hash and back.sealed
    assert back.facts.old_log_probs.producer == ACTOR and back.facts.rewards == batch.facts.rewards
    assert back.facts.finish_reason == batch.facts.finish_reason and back.facts.sampling == batch.facts.sampling
    for a, b in [(back.facts.old_log_probs.values, batch.facts.old_log_probs.values), (back.derived.advantages, batch.derived.advantages)]:
        assert torch.equal(a, b)
    with pytest.raises(SealedWriteError):
        back.facts.ref_log_probs.values[0, 0] = 0.0


def test_a_flipped_byte_is_detected(tmp_path):
    batch = sealed_batch()
    save_sealed(batch, tmp_path / "exp")
    path = tmp_path / "exp" / "experience.safetensors"
    raw = bytearray(path.read_bytes())
    raw[-5] ^= 0x01  # inside the tensor data
    path.write_bytes(bytes(raw))
    with pytest.raises(CorruptExperienceError, match="sha256"):
        load_sealed(tmp_path / "exp")


def test_a_tampered_manifest_is_detected(tmp_path):
    save_sealed(sealed_batch(), tmp_path / "exp")
    mpath = tmp_path / "exp" / "manifest.json"
    m = json.loads(mpath.read_text())
    m["metadata"]["rewards"][2]["total"] = 99.0  # still a valid batch, but not the sealed one
    mpath.write_text(json.dumps(m))
    with pytest.raises(CorruptExperienceError, match="content hash"):
        load_sealed(tmp_path / "exp")
