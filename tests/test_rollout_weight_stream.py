"""Manifests and buckets of the weight stream."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from megarl.rollout.testing import tiny_llama_config
from megarl.rollout.weight_stream import (
    FlattenedTensorBucket,
    ManifestMismatchError,
    TensorManifest,
    flatten_bucket_by_dtype,
    hf_logical_tensors,
    iter_buckets,
    tensor_sha256,
)


def named(seed=0):
    g = torch.Generator().manual_seed(seed)
    return [
        ("a.weight", torch.randn(4, 3, generator=g)),
        ("b.bias", torch.randn(5, generator=g).to(torch.bfloat16)),
        ("c.scale", torch.randn((), generator=g)),
        ("d.weight", torch.randn(2, 8, generator=g).half()),
    ]


def test_global_hash_is_order_independent_and_bitwise():
    m1 = TensorManifest.from_named_tensors(named())
    m2 = TensorManifest.from_named_tensors(reversed(named()))
    assert m1.global_hash == m2.global_hash and m1.compare(m2).ok
    flipped = named()
    bits = flipped[1][1].view(torch.int16)
    bits[2] ^= 1  # one bit of one bf16 value
    m3 = TensorManifest.from_named_tensors(flipped)
    assert m3.global_hash != m1.global_hash
    diff = m1.compare(m3)
    assert diff.mismatched == (("b.bias", "sha256", m1.entries["b.bias"].sha256, m3.entries["b.bias"].sha256),)


def test_same_bytes_other_shape_or_dtype_differ():
    t = torch.arange(12, dtype=torch.float32)
    assert tensor_sha256(t) == tensor_sha256(t.reshape(3, 4))  # bytes only...
    a = TensorManifest.from_named_tensors([("x", t)])
    b = TensorManifest.from_named_tensors([("x", t.reshape(3, 4))])
    c = TensorManifest.from_named_tensors([("x", t.view(torch.int32))])
    assert a.compare(b).mismatched[0][1] == "shape"  # ...but the manifest also checks shape
    assert a.compare(c).mismatched[0][1] == "dtype"
    assert len({a.global_hash, b.global_hash, c.global_hash}) == 3


def test_non_contiguous_tensor_hashes_like_its_contiguous_copy():
    t = torch.randn(6, 4)
    assert tensor_sha256(t.t()) == tensor_sha256(t.t().contiguous())


def test_diff_names_missing_and_unexpected_and_dict_round_trip():
    m = TensorManifest.from_named_tensors(named())
    r = TensorManifest.from_named_tensors(named()[1:] + [("z", torch.zeros(1))])
    diff = m.compare(r)
    assert diff.missing == ("a.weight",) and diff.unexpected == ("z",) and not diff.ok
    assert "missing 1 tensor(s): ['a.weight']" in diff.describe()
    back = TensorManifest.from_dict(m.to_dict())
    assert back.global_hash == m.global_hash and back.entries == m.entries
    d = m.to_dict()
    d["tensors"][0]["sha256"] = "sha256:" + "0" * 64
    with pytest.raises(ManifestMismatchError, match="does not match its tensors"):
        TensorManifest.from_dict(d)
    assert m.total_bytes == 4 * 3 * 4 + 5 * 2 + 4 + 16 * 2


def test_check_entry_names_the_tensor():
    m = TensorManifest.from_named_tensors(named())
    m.check_entry("a.weight", named()[0][1])
    with pytest.raises(ManifestMismatchError, match="'a.weight': sha256"):
        m.check_entry("a.weight", named()[0][1] + 1)
    with pytest.raises(ManifestMismatchError, match="'nope' is not in the expected manifest"):
        m.check_entry("nope", torch.zeros(1))


@settings(max_examples=60, deadline=None)
@given(sizes=st.lists(st.integers(0, 40), min_size=0, max_size=20), bucket=st.integers(1, 100))
def test_buckets_preserve_stream_and_respect_size(sizes, bucket):
    tensors = [(f"t{i}", torch.zeros(n, dtype=torch.uint8)) for i, n in enumerate(sizes)]
    buckets = list(iter_buckets(tensors, bucket))
    flat = [x for b in buckets for x in b]
    assert [n for n, _ in flat] == [n for n, _ in tensors]
    assert all(x[1] is y[1] for x, y in zip(flat, tensors))  # no copies
    for b in buckets:
        assert b, "empty bucket"
        total = sum(t.numel() for _, t in b)
        assert total <= bucket or len(b) == 1  # only a lone oversized tensor exceeds the size
    for prev, nxt in zip(buckets, buckets[1:]):  # greedy: the next tensor did not fit
        assert sum(t.numel() for _, t in prev) + nxt[0][1].numel() > bucket


def test_bucket_size_must_be_positive():
    with pytest.raises(ValueError, match="bucket_bytes"):
        list(iter_buckets([], 0))


def test_flattened_buckets_per_dtype_round_trip():
    nts = named()
    buckets = flatten_bucket_by_dtype(nts, bucket_cls=FlattenedTensorBucket)
    assert set(buckets) == {torch.float32, torch.bfloat16, torch.float16}
    back = dict(x for b in buckets.values() for x in b.reconstruct_tensors())
    for name, t in nts:
        assert back[name].dtype == t.dtype and torch.equal(back[name], t), name
    assert buckets[torch.float32].get_flattened_tensor().numel() == 12 + 1
    with pytest.raises(ValueError, match="one dtype"):
        FlattenedTensorBucket(named_tensors=nts)


def test_hf_logical_tensors_skip_tied_lm_head():
    from transformers import AutoModelForCausalLM

    tied = AutoModelForCausalLM.from_config(tiny_llama_config(tie_word_embeddings=True))
    untied = AutoModelForCausalLM.from_config(tiny_llama_config(tie_word_embeddings=False))
    tied_names = [n for n, _ in hf_logical_tensors(tied)]
    untied_names = [n for n, _ in hf_logical_tensors(untied)]
    assert "lm_head.weight" not in tied_names and "lm_head.weight" in untied_names
    assert set(untied_names) - set(tied_names) == {"lm_head.weight"}
    assert "model.layers.0.self_attn.q_proj.weight" in tied_names
    assert not any("inv_freq" in n for n in tied_names)  # derived from the config, not weights


def test_hashing_a_parameter_leaves_its_storage_resizable():
    """The actor manifest hashes live parameters (at TP=1 the logical tensor is the parameter);
    the offloader later frees them by resizing their storage, which numpy would forbid."""
    import torch

    from megarl.rollout.weight_stream import tensor_sha256

    p = torch.nn.Parameter(torch.randn(4, 3))
    before = tensor_sha256(p)
    assert p.untyped_storage().resizable()
    assert before == tensor_sha256(p.detach().clone())
    bf = torch.randn(5).to(torch.bfloat16)
    import hashlib

    assert tensor_sha256(bf) == "sha256:" + hashlib.sha256(bf.view(torch.uint8).numpy().tobytes()).hexdigest()
