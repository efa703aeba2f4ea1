"""On-policy distillation on golden tensors: the teacher's per-token reverse KL as the advantage
(alone, or beside GRPO's with ``algo.distill_coef``), derived from the sealed record's typed
``teacher_log_probs`` (producer role ``teacher``, never a reference or an old log-prob), saved
and re-derived; the config and tokenizer refusals name their key."""

from __future__ import annotations

import dataclasses
import json
import os

import pytest
import torch

from megarl.algo.advantages import AdvantageConfig, AdvantageInputs
from megarl.algo.derivation import DerivationSettings, derive
from megarl.algo.registry import get_advantage
from megarl.commands.run_checks import check_run
from megarl.config import ConfigError, load_config
from megarl.experience.schema import ExperienceBatch, LogProbProducer, LogProbs, RewardRecord, RewardStatus
from megarl.experience.seal import load_sealed, save_sealed, seal, with_derived
from tests._dist import ROOT
from tests._experience import make_facts
from tests.dist_algo_invariance import ragged_batch

TEACHER = LogProbProducer(role="teacher", version="teacher-0123abcd", space="raw")
GRPO = os.path.join(ROOT, "configs", "grpo_arith_tiny.yaml")


def _with_teacher(seed=0, **over):
    f = make_facts(seed, **over)
    g = torch.Generator().manual_seed(100 + seed)
    t = f.old_log_probs.values + torch.randn(f.old_log_probs.values.shape, generator=g, dtype=torch.float64).to(
        f.old_log_probs.values.dtype) * 0.5
    return dataclasses.replace(f, teacher_log_probs=LogProbs(t, TEACHER))


def test_the_advantage_is_the_teachers_log_ratio_on_every_action():
    b = ragged_batch(1)
    mask = b["response_mask"]
    old, teacher = b["old_log_probs"], b["ref_log_probs"]
    res = get_advantage("on_policy_distill")(
        AdvantageInputs(response_mask=mask, old_log_probs=old, teacher_log_probs=teacher), AdvantageConfig())
    keep = mask != 0
    want = torch.where(keep, teacher - old, 0.0)
    assert torch.equal(res.advantages, want) and torch.equal(res.loss_mask, keep.to(mask.dtype))
    assert res.metrics["reverse_kl"] == pytest.approx(float((old - teacher)[keep].mean()), abs=1e-12)
    with pytest.raises(ValueError, match="needs AdvantageInputs.old_log_probs and teacher_log_probs"):
        get_advantage("on_policy_distill")(AdvantageInputs(response_mask=mask), AdvantageConfig())
    bad = teacher.clone()
    bad[keep.nonzero()[0].tolist()[0], keep.nonzero()[0].tolist()[1]] = float("-inf")
    with pytest.raises(ValueError, match="non-finite"):
        get_advantage("on_policy_distill")(
            AdvantageInputs(response_mask=mask, old_log_probs=old, teacher_log_probs=bad), AdvantageConfig())


def test_derive_alone_reads_no_reward_and_records_nothing_new():
    """Distillation alone: a failed reward does not stop it (no reward enters the advantage)."""
    f = _with_teacher()
    failed = RewardRecord(total=None, status=RewardStatus.ERROR, error="scorer down", scorer_version="rm-1")
    f = dataclasses.replace(f, rewards=(failed,) + f.rewards[1:])
    d, m = derive(f, DerivationSettings(estimator="on_policy_distill"))
    keep = f.response_mask != 0
    want = torch.where(keep, f.teacher_log_probs.values - f.old_log_probs.values, 0.0).float()
    assert torch.equal(d.advantages, want)
    assert m["prep/distill/advantage_share"] == pytest.approx(1.0)
    k = (f.old_log_probs.values.double() - f.teacher_log_probs.values.double())[keep]
    assert m["prep/distill/reverse_kl"] == pytest.approx(float(k.mean()), abs=1e-9)
    assert "distill_coef" not in d.hyperparameters
    with pytest.raises(ValueError, match="the batch has no teacher_log_probs"):
        derive(make_facts(0), DerivationSettings(estimator="on_policy_distill"))


def test_beside_grpo_the_weighted_term_is_added_on_the_loss_mask():
    f = _with_teacher(2)
    base, _ = derive(f, DerivationSettings(estimator="grpo"))
    s = DerivationSettings(estimator="grpo", distill_coef=0.25)
    d, m = derive(f, s)
    keep = base.loss_mask != 0
    part = torch.where(keep, -0.25 * (f.old_log_probs.values.double() - f.teacher_log_probs.values.double()), 0.0)
    torch.testing.assert_close(d.advantages.double(), base.advantages.double() + part, atol=1e-6, rtol=0)
    share = float(part[keep].abs().sum() / d.advantages.double()[keep].abs().sum())
    assert m["prep/distill/advantage_share"] == pytest.approx(share, rel=1e-5)
    assert d.hyperparameters["distill_coef"] == 0.25 and DerivationSettings.from_record(d) == s


def test_the_record_keeps_the_teacher_typed(tmp_path):
    f = _with_teacher(0)
    d, _ = derive(f, DerivationSettings(estimator="on_policy_distill"))
    b = with_derived(seal(ExperienceBatch(f)), d)
    save_sealed(b, tmp_path / "x")
    back = load_sealed(tmp_path / "x")
    assert back.content_hash == b.content_hash
    assert back.facts.teacher_log_probs.producer == TEACHER
    assert torch.equal(back.facts.teacher_log_probs.values, f.teacher_log_probs.values)
    again, _ = derive(back.facts, DerivationSettings.from_record(back.derived))
    assert torch.equal(again.advantages, back.derived.advantages)  # re-derived offline, bitwise
    # the teacher's log-probs change the content hash; a record without them hashes as before
    assert seal(ExperienceBatch(make_facts(0))).content_hash != seal(ExperienceBatch(f)).content_hash
    for role in ("reference", "actor"):  # another role's log-probs are never the teacher's
        with pytest.raises(ValueError, match="teacher_log_probs"):
            dataclasses.replace(f, teacher_log_probs=LogProbs(f.teacher_log_probs.values,
                                                              LogProbProducer(role=role, version="v7")))


@pytest.mark.parametrize("overrides,key", [
    (["algo.advantage=on_policy_distill"], "teacher.path: is null"),
    (["algo.distill_coef=0.5"], "teacher.path: is null"),
    (["teacher.path=/t"], "teacher.path: is set, but nothing reads the teacher"),
    (["algo.advantage=on_policy_distill", "teacher.path=/t", "algo.distill_coef=0.5"], "algo.distill_coef"),
    (["algo.distill_coef=-1", "teacher.path=/t"], "algo.distill_coef: must be >= 0"),
])
def test_config_refusals_name_the_key(overrides, key):
    with pytest.raises(ConfigError) as e:
        check_run(load_config(GRPO, overrides), 1)
    assert str(e.value).startswith(key), str(e.value)
    assert check_run(load_config(GRPO, ["algo.distill_coef=0.5", "teacher.path=/t"]), 1) == 1


def test_a_teacher_must_read_the_actors_token_ids(tmp_path):
    from megarl.builtin.tiny_tokenizer import build_tiny_tokenizer
    from megarl.data.tokenizer import TokenizerContract
    from megarl.roles.teacher import check_teacher_tokenizer

    same, other = tmp_path / "same", tmp_path / "other"
    for d in (same, other):
        build_tiny_tokenizer(d)
        (d / "config.json").write_text("{}")
    actor = TokenizerContract.load(str(same))
    check_teacher_tokenizer(str(same), actor.hash, None)
    tj = json.loads((other / "tokenizer.json").read_text())  # the same words, two ids swapped
    vocab = tj["model"]["vocab"]
    a, b = sorted(k for k in vocab if k.isdigit())[:2]
    vocab[a], vocab[b] = vocab[b], vocab[a]
    (other / "tokenizer.json").write_text(json.dumps(tj))
    with pytest.raises(ConfigError, match=r"^teacher\.path: .* has another tokenizer than the actor's"):
        check_teacher_tokenizer(str(other), actor.hash, None)
    with pytest.raises(ConfigError, match=r"^teacher\.path: .* is not an HF checkpoint"):
        check_teacher_tokenizer(str(tmp_path / "missing"), actor.hash, None)
