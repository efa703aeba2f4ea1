"""The GRPO group completion policy of the seed."""

from __future__ import annotations

import pytest

from megarl.experience.groups import CandidateStatus, GroupBuffer, GroupContractError, GroupPolicy, group_index

G = 4


def open_group(buf: GroupBuffer, gid="runA/step42/p17", pid="p17", version="v7"):
    sids = [f"{gid}/candidate{i:02d}" for i in range(G)]
    buf.open_group(gid, pid, version, sids)
    return gid, pid, sids


def report(buf, gid, pid, sid, status="ok", attempt=0, version="v7", payload=None):
    return buf.report(group_id=gid, prompt_id=pid, sample_id=sid, policy_version=version, attempt=attempt, status=status, payload=payload or sid)


def test_group_released_only_when_all_candidates_are_in():
    buf = GroupBuffer(GroupPolicy(group_size=G))
    gid, pid, sids = open_group(buf)
    for s in sids[:-1]:
        report(buf, gid, pid, s)
        assert buf.pop_released() == []
    report(buf, gid, pid, sids[-1])
    (grp,) = buf.pop_released()
    assert grp.real_size == grp.expected_size == G and not grp.partial
    assert [s for s, _ in grp.samples] == sids
    assert buf.counters["released"] == 1


def test_retryable_failure_is_rerequested_on_the_same_version_until_the_limit():
    buf = GroupBuffer(GroupPolicy(group_size=G, max_retries=2))
    gid, pid, sids = open_group(buf)
    for s in sids[1:]:
        report(buf, gid, pid, s)
    r1 = report(buf, gid, pid, sids[0], status=CandidateStatus.RETRYABLE)
    assert (r1.sample_id, r1.policy_version, r1.attempt) == (sids[0], "v7", 1)
    assert report(buf, gid, pid, sids[0], status="retryable", attempt=0) is None  # late duplicate of attempt 0
    assert buf.counters["stale"] == 1
    assert report(buf, gid, pid, sids[0], status="ok", attempt=1, version="v8") is None  # wrong version never fills the slot
    assert buf.counters["wrong_version"] == 1 and buf.pop_released() == []
    r2 = report(buf, gid, pid, sids[0], status="retryable", attempt=1)
    assert r2.attempt == 2 and r2.policy_version == "v7"
    report(buf, gid, pid, sids[0], status="ok", attempt=2)
    (grp,) = buf.pop_released()
    assert grp.real_size == G and buf.counters["retries"] == 2


def test_after_the_retry_limit_the_group_is_dropped_by_default():
    buf = GroupBuffer(GroupPolicy(group_size=G, max_retries=1))
    gid, pid, sids = open_group(buf)
    for s in sids[1:]:
        report(buf, gid, pid, s)
    report(buf, gid, pid, sids[0], status="retryable")
    assert report(buf, gid, pid, sids[0], status="retryable", attempt=1) is None  # limit reached
    assert buf.pop_released() == [] and buf.counters["dropped"] == 1
    assert report(buf, gid, pid, sids[0], status="ok", attempt=1) is None  # a late result after the drop
    assert buf.counters["stale"] == 1 and buf.pop_released() == []


def test_explicit_partial_rule_releases_with_the_real_size():
    buf = GroupBuffer(GroupPolicy(group_size=G, max_retries=0, partial_rule="allow_partial", min_partial_size=3))
    gid, pid, sids = open_group(buf)
    report(buf, gid, pid, sids[0], status="fatal")
    for s in sids[1:]:
        report(buf, gid, pid, s)
    (grp,) = buf.pop_released()
    assert grp.partial and grp.real_size == 3 and grp.expected_size == G
    assert [s for s, _ in grp.samples] == sids[1:]
    gid2, pid2, sids2 = open_group(buf, gid="runA/step42/p18", pid="p18")
    for s in sids2[:2]:
        report(buf, gid2, pid2, s, status="fatal")
    for s in sids2[2:]:
        report(buf, gid2, pid2, s)
    assert buf.pop_released() == [] and buf.counters["dropped"] == 1 and buf.counters["released_partial"] == 1


def test_a_group_never_takes_a_sample_from_another_prompt():
    buf = GroupBuffer(GroupPolicy(group_size=G))
    gid, pid, sids = open_group(buf)
    with pytest.raises(GroupContractError, match="of prompt 'p18' offered to group"):
        report(buf, gid, "p18", sids[0])
    with pytest.raises(GroupContractError, match="is not a candidate"):
        report(buf, gid, pid, "runA/step42/p18/candidate00")
    with pytest.raises(ValueError, match="GroupPolicy.min_partial_size"):
        GroupPolicy(group_size=G, partial_rule="allow_partial")


def test_group_index_refuses_fragments():
    ids = ["g1", "g0", "g1", "g0", "g1"]
    idx, order = group_index(ids)
    assert idx.tolist() == [0, 1, 0, 1, 0] and order == ("g1", "g0")
    group_index(ids, {"g1": 3, "g0": 2})
    with pytest.raises(ValueError, match="group 'g1' has 3 samples in the batch, its recorded real size is 4"):
        group_index(ids, {"g1": 4, "g0": 2})
