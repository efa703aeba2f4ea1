"""megarl.hashing: the one definition of the stored hashes.

Every value here is stored in run files, checkpoints, sealed experience and policy versions, so
the bytes hashed must never change: the pinned digests below were computed by the per-module
implementations these functions replaced (config, versions, tokenizer, seal), and each call
site's former ``json.dumps`` spelling is checked to give the same text.
"""

import datetime
import hashlib
import json
import pathlib

import pytest

from megarl.config import section_hash
from megarl.hashing import canonical_json, file_sha256, json_sha256
from megarl.versions import PolicyVersion

VALUE = {"é": "ünï 字符", "b": [1, 2.5, None, True], "t": (1, 2), "f": 1e-6, "nested": {"z": 1, "a": {"y": [3]}}}
NOT_JSON = {"p": pathlib.Path("/a/b"), "dt": datetime.date(2020, 1, 2), "é": "字符"}
SAMPLES = [VALUE, {}, [], "x", 0, None, {"b": 1, "a": [{"d": 2, "c": 1.5}]}, {"k": float("inf")}]


def _old(obj, **kw) -> str:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), **kw)


@pytest.mark.parametrize("obj", SAMPLES + [NOT_JSON])
def test_canonical_json_is_what_config_and_versions_hashed(obj):
    # megarl.config.config_hash / section_hash and the former megarl.versions.config_hash
    assert canonical_json(obj) == _old(obj, default=str)
    assert json_sha256(obj) == "sha256:" + hashlib.sha256(_old(obj, default=str).encode()).hexdigest()


@pytest.mark.parametrize("obj", SAMPLES)
def test_canonical_json_is_what_the_tokenizer_and_seal_hashed(obj):
    # megarl.data.tokenizer (UTF-8, no fallback) and megarl.experience.seal (no fallback)
    assert canonical_json(obj, ensure_ascii=False, default=None) == _old(obj, ensure_ascii=False)
    assert canonical_json(obj, default=None) == _old(obj)


def test_without_fallback_a_non_json_value_is_an_error():
    with pytest.raises(TypeError):
        canonical_json(NOT_JSON, default=None)


def test_pinned_digests():
    assert json_sha256(VALUE) == "sha256:5260423e44619f266160f3dbb47387a508d37ee2e124f8c44aa6b01b986ec292"
    assert json_sha256(VALUE, ensure_ascii=False) == \
        "sha256:4a8a12b81c2edce4f83c2704df4c2e80c474761c8f7ea50c37a347e67e4dff79"
    assert json_sha256(NOT_JSON) == "sha256:818fa6492ad934539929a4dc7d89c0ff8aaf6f3698d449798623ba612f958130"
    assert section_hash(VALUE) == json_sha256(VALUE)
    assert section_hash({"template": "{{ '字符' }} é <|end|>"}) == \
        "sha256:ce312aa4657229c842d587fdbeafba3da91473b4bf40cfcac915d4b4b5b9ce75"
    none_tok = json_sha256({"tokenizer": "none"})  # megarl/builtin/hf_actor.py's default tokenizer hash
    assert none_tok == "sha256:e04372902c950f20d9a1aaa7d5953cb402629f472264bbd9fe0865f4990e814a"
    v = PolicyVersion("run-1", 3, 1, "sha256:" + "a" * 64, none_tok, json_sha256({"x": "c"}))
    assert v.identity_hash == "sha256:666cd0ff1ca50e7a143ecd9d748d85127278aff1ec974a5286cd06eedc6d436c"
    assert v.short_id == "v3.1-666cd0ff"


@pytest.mark.parametrize("size", [0, 3, (1 << 20) - 1, 1 << 20, 3 * (1 << 20) + 17])
def test_file_sha256_is_the_sha256_of_the_bytes(tmp_path, size):
    data = (bytes(range(256)) * (size // 256 + 1))[:size]
    p = tmp_path / "f.bin"
    p.write_bytes(data)
    want = "sha256:" + hashlib.sha256(data).hexdigest()
    assert file_sha256(p) == file_sha256(str(p)) == want
