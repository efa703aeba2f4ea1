"""Manifests and buckets of the weight stream."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from megarl.rollout.weight_stream import (
    FlattenedTensorBucket,
    ManifestMismatchError,
    TensorManifest,
    flatten_bucket_by_dtype,
    hf_logical_tensors,
    iter_buckets,
    tensor_checksum,
)
from megarl.builtin.hf_actor import tiny_llama_config


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
    assert diff.mismatched == (("b.bias", "checksum", m1.entries["b.bias"].checksum, m3.entries["b.bias"].checksum),)


def test_same_bytes_other_shape_or_dtype_differ():
    t = torch.arange(12, dtype=torch.float32)
    assert tensor_checksum(t) == tensor_checksum(t.reshape(3, 4))  # bytes only...
    a = TensorManifest.from_named_tensors([("x", t)])
    b = TensorManifest.from_named_tensors([("x", t.reshape(3, 4))])
    c = TensorManifest.from_named_tensors([("x", t.view(torch.int32))])
    assert a.compare(b).mismatched[0][1] == "shape"  # ...but the manifest also checks shape
    assert a.compare(c).mismatched[0][1] == "dtype"
    assert len({a.global_hash, b.global_hash, c.global_hash}) == 3


def test_non_contiguous_tensor_hashes_like_its_contiguous_copy():
    t = torch.randn(6, 4)
    assert tensor_checksum(t.t()) == tensor_checksum(t.t().contiguous())


def test_diff_names_missing_and_unexpected_and_dict_round_trip():
    m = TensorManifest.from_named_tensors(named())
    r = TensorManifest.from_named_tensors(named()[1:] + [("z", torch.zeros(1))])
    diff = m.compare(r)
    assert diff.missing == ("a.weight",) and diff.unexpected == ("z",) and not diff.ok
    assert "missing 1 tensor(s): ['a.weight']" in diff.describe()
    back = TensorManifest.from_dict(m.to_dict())
    assert back.global_hash == m.global_hash and back.entries == m.entries
    d = m.to_dict()
    d["tensors"][0]["checksum"] = "wsum64:" + "0" * 64
    with pytest.raises(ManifestMismatchError, match="does not match its tensors"):
        TensorManifest.from_dict(d)
    assert m.total_bytes == 4 * 3 * 4 + 5 * 2 + 4 + 16 * 2


def test_check_entry_names_the_tensor():
    m = TensorManifest.from_named_tensors(named())
    m.check_entry("a.weight", named()[0][1])
    with pytest.raises(ManifestMismatchError, match="'a.weight': checksum"):
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


def test_deepseek_down_projections_are_never_split_over_two_buckets():
    """SGLang fuses a layer's q_a_proj and kv_a_proj_with_mqa from one load call: the pair stays in one
    bucket however small the buckets (the mapping streams it adjacent); another layer's is its own;
    negative control: two unrelated tensors are split as usual."""
    a = "model.layers.3.self_attn."
    tensors = [(a + "q_a_proj.weight", torch.zeros(8, dtype=torch.uint8)),
               (a + "kv_a_proj_with_mqa.weight", torch.zeros(8, dtype=torch.uint8)),
               ("model.layers.4.self_attn.kv_a_proj_with_mqa.weight", torch.zeros(8, dtype=torch.uint8)),
               ("x", torch.zeros(8, dtype=torch.uint8)), ("y", torch.zeros(8, dtype=torch.uint8))]
    buckets = [[n for n, _ in b] for b in iter_buckets(tensors, 10)]
    assert buckets == [[a + "q_a_proj.weight", a + "kv_a_proj_with_mqa.weight"],
                       ["model.layers.4.self_attn.kv_a_proj_with_mqa.weight"], ["x"], ["y"]]


def test_the_mapping_streams_the_fused_pair_next_to_each_other():
    from megarl.builtin.tiny_checkpoint import tiny_hf_config
    from megarl.models import mapping
    from megarl.models.hf_config import spec_from_hf_config

    names = mapping.hf_names_in_order(spec_from_hf_config(tiny_hf_config("deepseek_v3", hidden_size=32).to_dict()))
    i = names.index("model.layers.0.self_attn.q_a_proj.weight")
    assert names[i + 1] == "model.layers.0.self_attn.kv_a_proj_with_mqa.weight"


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


def test_checksumming_a_parameter_leaves_its_storage_resizable():
    """The actor manifest checksums live parameters (at TP=1 the logical tensor is the
    parameter); the offloader later frees them by resizing their storage, which numpy would
    forbid -- also for a tensor smaller than one checksum row, whose words go to the host."""
    for shape in [(4, 3), (3000, 7)]:
        p = torch.nn.Parameter(torch.randn(*shape))
        before = tensor_checksum(p)
        assert p.untyped_storage().resizable()
        assert before == tensor_checksum(p.detach().clone())


def _reference_checksum(t: torch.Tensor) -> str:
    """The documented formula in plain Python integers (no torch reductions, no wrap-around)."""
    import hashlib
    import struct

    from megarl.rollout.weight_stream import CHECKSUM_PREFIX, CHECKSUM_ROW_WORDS as R

    mask = (1 << 64) - 1
    c = []
    for j in range(R):  # splitmix64(j) | 1
        z = (j * 0x9E3779B97F4A7C15 + 0x9E3779B97F4A7C15) & mask
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & mask
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & mask
        c.append((z ^ (z >> 31)) | 1)
    raw = t.contiguous().view(torch.uint8).reshape(-1).tolist()
    nbytes = len(raw)
    raw += [0] * (-len(raw) % 8)
    words = [int.from_bytes(bytes(raw[i:i + 8]), "little") for i in range(0, len(raw), 8)]
    m = len(words) // R
    sums = [sum(c[j] * words[i * R + j] for j in range(R)) & mask for i in range(m)]
    small = sums + words[m * R:]
    h = hashlib.sha256(f"{nbytes}|{m}|".encode())
    h.update(struct.pack(f"<{len(small)}Q", *small))
    return CHECKSUM_PREFIX + h.hexdigest()


@pytest.mark.parametrize("numel,dtype", [(3 * 4096 + 5, torch.float32), (2 * 8192 + 3, torch.bfloat16),
                                         (7, torch.float16), (0, torch.float32), (9000, torch.int64)])
def test_checksum_is_the_documented_formula(numel, dtype):
    """Golden: equal to the formula computed with Python integers, including sums that wrap
    modulo 2**64 (int64 words near the extremes) and zero-padded tails of odd-sized tensors."""
    g = torch.Generator().manual_seed(numel)
    if dtype == torch.int64:
        t = torch.randint(2**62, 2**63 - 1, (numel,), generator=g, dtype=torch.int64)
    else:
        t = torch.randn(numel, generator=g).to(dtype)
    assert tensor_checksum(t) == _reference_checksum(t)


def test_checksum_catches_every_single_bit_and_words_exchanged():
    from megarl.rollout.weight_stream import CHECKSUM_ROW_WORDS as R

    g = torch.Generator().manual_seed(0)
    t = torch.randn(3 * R + 4, 2, generator=g)  # 3 rows of int64 words plus a tail of 4
    base = tensor_checksum(t)
    words = t.view(-1).view(torch.int32)
    n = words.numel()
    for pos in [0, 1, R * 2 - 1, R * 2, n - 1]:
        for bit in [0, 7, 22, 31]:
            flipped = words.clone()
            flipped[pos] ^= (1 << bit) if bit < 31 else -(2**31)
            assert tensor_checksum(flipped.view(torch.float32)) != base, (pos, bit)
    w64 = t.view(-1).view(torch.int64)
    for i, j in [(0, 1), (0, R), (5, 2 * R + 5), (R - 1, R), (3, w64.numel() - 1), (10, R - 10)]:
        swapped = w64.clone()
        swapped[i], swapped[j] = w64[j].item(), w64[i].item()
        assert tensor_checksum(swapped) != tensor_checksum(w64), (i, j)
    rows = w64[: 3 * R].view(3, R)
    moved = torch.cat([rows[[1, 0, 2]].reshape(-1), w64[3 * R:]])
    assert tensor_checksum(moved) != tensor_checksum(w64)


def test_misplaced_tp_shards_are_caught():
    """Concatenating column- or row-parallel shards in the wrong order changes the checksum."""
    g = torch.Generator().manual_seed(1)
    for rows, cols in [(64, 64), (256, 1024)]:
        full = torch.randn(rows, cols, generator=g)
        base = tensor_checksum(full)
        a, b = full.chunk(2, dim=0)
        assert tensor_checksum(torch.cat([b, a], dim=0)) != base
        a, b = full.chunk(2, dim=1)
        assert tensor_checksum(torch.cat([b, a], dim=1)) != base
        assert tensor_checksum(full.t().contiguous().view(rows, cols)) != base


@pytest.mark.parametrize("numel,dtype", [(3 * 1024 + 5, torch.float32), (2 * 2048 + 3, torch.bfloat16),
                                         (7, torch.float16), (0, torch.float32), (5000, torch.bool)])
def test_the_accelerator_path_gives_the_host_checksum(numel, dtype):
    """The torch multiply-and-reduce used on GPUs (run here on CPU tensors) equals the numpy
    host path byte for byte, including odd sizes, padding and a storage offset."""
    from megarl.rollout.weight_stream import _finish, _row_sums_device

    def on_device(x):
        nbytes = x.numel() * x.element_size()
        return _finish(nbytes, *_row_sums_device(x, nbytes))

    g = torch.Generator().manual_seed(numel)
    t = (torch.rand(numel, generator=g) > 0.5) if dtype == torch.bool else torch.randn(numel, generator=g).to(dtype)
    assert on_device(t) == tensor_checksum(t)
    if numel > 1:
        shifted = t[1:]  # a view one element into its storage: not 8-byte aligned
        assert on_device(shifted) == tensor_checksum(shifted.clone())
        assert tensor_checksum(shifted) == tensor_checksum(shifted.clone())


@pytest.mark.parametrize("groups,rows,cols,gap,offset,dtype", [
    (4, 16, 128, 32, 0, torch.float32),    # each block 16 x 128 fp32 = one 8 KiB row: read in place
    (3, 64, 128, 0, 0, torch.bfloat16),    # 2 rows per block, no gap between the blocks
    (2, 24, 128, 8, 0, torch.bfloat16),    # blocks of 6 KiB: not whole rows, made contiguous first
    (4, 16, 128, 3, 1, torch.float32),     # blocks at addresses that are not 8-byte aligned
    (1, 32, 64, 0, 0, torch.float16)])
def test_strided_blocks_are_checksummed_in_place_exactly(groups, rows, cols, gap, offset, dtype):
    """Q, K or V inside a fused QKV is a strided view, one contiguous block per query group; its
    checksum, read in place when the blocks are whole rows, is exactly the checksum of the
    assembled tensor (also on the accelerator path), and a changed or reordered block is caught."""
    from megarl.rollout.weight_stream import _block_row_sums, _finish, _row_sums_device

    g = torch.Generator().manual_seed(groups * rows + gap)
    storage = torch.randn(offset + groups * (rows + gap) * cols, generator=g).to(dtype)
    fused = storage[offset:].view(groups, rows + gap, cols)
    view = fused[:, gap:]  # a block of `rows` per group, `gap` rows of another tensor between
    whole = view.contiguous()
    assert tensor_checksum(view) == tensor_checksum(whole)
    whole_rows = rows * cols * whole.element_size() % 8192 == 0 and offset == 0
    assert (_block_row_sums(view) is not None) == whole_rows
    manifest = TensorManifest()
    manifest.add_view("q", (groups * rows, cols), view)
    assert manifest.entries["q"].checksum == tensor_checksum(whole.view(groups * rows, cols))
    assert manifest.entries["q"].shape == (groups * rows, cols)
    with pytest.raises(ValueError, match="not a tensor of shape"):
        TensorManifest().add_view("q", (groups * rows + 1, cols), view)
    nbytes = whole.numel() * whole.element_size()
    assert _finish(nbytes, *_row_sums_device(whole, nbytes)) == tensor_checksum(view)
    if whole_rows:  # the accelerator's in-place path, run here on the CPU tensor
        assert _finish(nbytes, *_block_row_sums(view, on_host=False)) == tensor_checksum(whole)
    if groups > 1:
        assert tensor_checksum(view.flip(0)) != tensor_checksum(whole)
        bent = fused.clone()
        bent[-1, -1, -1:].view(torch.int16)[0] ^= 1  # one flipped bit in the last block
        assert tensor_checksum(bent[:, gap:]) != tensor_checksum(whole)
