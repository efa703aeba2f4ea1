"""PolicyVersion: validation, short id, dict round trip, successor relation."""

import re

import pytest

from megarl.hashing import json_sha256
from megarl.versions import PolicyVersion, VersionError

H = lambda s: json_sha256({"x": s})  # noqa: E731


def make(**over):
    kw = dict(run_id="rl-run-a", optimizer_step=42, update_attempt=1,
              weight_manifest_hash=H("w"), tokenizer_hash=H("t"), model_config_hash=H("c"))
    kw.update(over)
    return PolicyVersion(**kw)


def test_short_id_is_stable_and_depends_on_every_field():
    v = make()
    assert re.fullmatch(r"v42\.1-[0-9a-f]{8}", v.short_id)
    assert make().short_id == v.short_id  # stable across instances (and processes: sha256, no hash())
    for field, value in [("run_id", "other"), ("weight_manifest_hash", H("w2")),
                         ("tokenizer_hash", H("t2")), ("model_config_hash", H("c2"))]:
        assert make(**{field: value}).short_id != v.short_id, field


def test_dict_round_trip_and_strict_keys():
    v = make()
    assert PolicyVersion.from_dict(v.to_dict()) == v
    d = v.to_dict()
    d["extra"] = 1
    with pytest.raises(VersionError, match="unexpected keys \\['extra'\\]"):
        PolicyVersion.from_dict(d)
    d = v.to_dict()
    del d["tokenizer_hash"]
    with pytest.raises(VersionError, match="missing keys \\['tokenizer_hash'\\]"):
        PolicyVersion.from_dict(d)


@pytest.mark.parametrize("field, value", [("run_id", ""), ("run_id", "a/b"), ("optimizer_step", -1),
                                          ("update_attempt", "1"), ("weight_manifest_hash", "abc"),
                                          ("tokenizer_hash", "sha256:XYZ")])
def test_malformed_fields_are_named(field, value):
    with pytest.raises(VersionError, match=field):
        make(**{field: value})


def test_successor_and_retry():
    v = make()
    n = v.successor(H("w2"))
    assert (n.optimizer_step, n.update_attempt, n.weight_manifest_hash) == (43, 0, H("w2"))
    assert n.is_successor_of(v) and not v.is_successor_of(n)
    r = n.retried(H("w3"))
    assert (r.optimizer_step, r.update_attempt) == (43, 1) and r.is_successor_of(v)
    assert not make(run_id="other", optimizer_step=43).is_successor_of(v)
    assert not PolicyVersion(**{**n.to_dict(), "tokenizer_hash": H("t9")}).is_successor_of(v)
