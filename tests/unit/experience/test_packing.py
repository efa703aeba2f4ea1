"""Packing: padded (bs, seq) <-> packed 1-D with cu_seqlens and position ids, exactly."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from megarl.experience.packing import PackedLayout, pack, pack_layout, pack_response, unpack, unpack_response


# ---- reference computations the packed layout is checked against ------------------------------


def padded_position_ids(attention_mask: torch.Tensor) -> torch.Tensor:
    """``(bs, seq)`` position ids for the padded layout: cumsum(mask) - 1, 0 on left padding."""
    return (attention_mask.long().cumsum(dim=1) - 1).clamp(min=0)


def sequence_index(layout: PackedLayout) -> torch.Tensor:
    """``(total,)`` int64: the row (sample) each packed token belongs to."""
    return layout.flat_index // layout.seq_len


@dataclass(frozen=True)
class PackedBatch:
    """Model inputs in packed form: ``input_ids`` / ``position_ids`` ``(total,)`` plus the layout."""

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    cu_seqlens: torch.Tensor
    max_seqlen: int
    layout: PackedLayout


def pack_batch(input_ids: torch.Tensor, attention_mask: torch.Tensor, prompt_len: int) -> PackedBatch:
    """Pack ``input_ids`` ``(bs, seq)`` (prompt + response) under ``attention_mask`` ``(bs, seq)``."""
    layout = pack_layout(attention_mask, prompt_len)
    return PackedBatch(
        input_ids=pack(input_ids, layout),
        position_ids=layout.position_ids,
        cu_seqlens=layout.cu_seqlens,
        max_seqlen=layout.max_seqlen,
        layout=layout,
    )


@st.composite
def padded_batches(draw):
    bs = draw(st.integers(1, 6))
    P = draw(st.integers(1, 7))
    R = draw(st.integers(1, 9))
    plen = draw(st.lists(st.integers(1, P), min_size=bs, max_size=bs))
    rlen = draw(st.lists(st.integers(0, R), min_size=bs, max_size=bs))
    attn = torch.zeros(bs, P + R, dtype=torch.int64)
    for b in range(bs):
        attn[b, P - plen[b] : P + rlen[b]] = 1
    return attn, P, plen, rlen


def _causal_prefix_sums(values: torch.Tensor, cu: torch.Tensor) -> torch.Tensor:
    """A toy 'model' on packed tokens: running sum within each packed sequence (resets at cu_seqlens)."""
    out = torch.empty_like(values)
    for a, b in zip(cu[:-1].tolist(), cu[1:].tolist()):
        out[a:b] = values[a:b].cumsum(0)
    return out


@settings(max_examples=120, deadline=None)
@given(padded_batches(), st.integers(0, 2**31 - 1))
def test_pack_unpack_roundtrip_and_response_positions(batch, seed):
    attn, P, plen, rlen = batch
    bs, S = attn.shape
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(bs, S, 3, generator=g)
    layout = pack_layout(attn, P)
    packed = pack(x, layout)
    assert packed.shape == (sum(plen) + sum(rlen), 3)
    assert layout.cu_seqlens.tolist() == [sum(plen[:i]) + sum(rlen[:i]) for i in range(bs + 1)]
    assert layout.max_seqlen == max(p + r for p, r in zip(plen, rlen))
    back = unpack(packed, layout, fill=-7.0)
    m = attn.bool()
    assert torch.equal(back[m], x[m]) and (back[~m] == -7.0).all()
    # positions: 0.. within each sequence, equal to the padded position ids on real tokens
    assert torch.equal(layout.position_ids, pack(padded_position_ids(attn), layout))
    assert torch.equal(sequence_index(layout), torch.repeat_interleave(torch.arange(bs), torch.tensor(plen) + torch.tensor(rlen)))
    # a per-token value computed in packed form lands on (sample, response position) after unpacking
    tok = torch.randint(0, 1000, (bs, S), generator=g).float() * attn
    pk = pack_batch(tok.long(), attn, P)
    val_packed = _causal_prefix_sums(pk.input_ids.float(), pk.cu_seqlens)
    resp = unpack_response(val_packed, layout)
    for b in range(bs):
        for t in range(S - P):
            want = float(tok[b, : P + t + 1].sum()) if t < rlen[b] else 0.0  # prompt + response[:t+1]
            assert float(resp[b, t]) == want
    # pack_response is the inverse of unpack_response on response tokens, 0 on prompt tokens
    y = torch.randn(bs, S - P, generator=g) * attn[:, P:]
    yp = pack_response(y, layout)
    assert torch.equal(unpack_response(yp, layout), y)
    assert (unpack(yp, layout)[:, :P] == 0).all()


@settings(max_examples=60, deadline=None)
@given(padded_batches())
def test_gradient_through_unpack_response_reaches_only_response_tokens(batch):
    attn, P, plen, rlen = batch
    layout = pack_layout(attn, P)
    leaf = torch.randn(layout.total_tokens, dtype=torch.float64, requires_grad=True)
    w = torch.randn(attn.shape[0], attn.shape[1] - P, dtype=torch.float64)
    (unpack_response(leaf, layout) * w).sum().backward()
    grad = unpack(leaf.grad, layout)
    resp = torch.zeros_like(attn, dtype=torch.bool)
    resp[:, P:] = attn[:, P:] != 0
    assert (grad[~resp] == 0).all()
    assert torch.equal(grad[:, P:][resp[:, P:]], w[resp[:, P:]])


def test_non_contiguous_or_empty_rows_are_refused():
    with pytest.raises(ValueError, match=r"rows \[1\] are not one contiguous run"):
        pack_layout(torch.tensor([[0, 1, 1, 0], [1, 0, 1, 0]]), 2)
    with pytest.raises(ValueError, match=r"rows \[0\] have no real token"):
        pack_layout(torch.tensor([[0, 0, 0, 0], [1, 1, 1, 0]]), 2)
