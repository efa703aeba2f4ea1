"""Padded ``(bs, seq)`` <-> packed 1-D ``(total_tokens,)`` with ``cu_seqlens`` and position ids.

The padded layout is the experience layout: ``seq = prompt_len + response_len``, prompt
left-padded, response right-padded, ``attention_mask`` 1 on real tokens.  Packing keeps the real
tokens of every row, in order, back to back (varlen / THD layout for flash-attention and
megatron-core ``PackedSeqParams``):

    cu_seqlens   = [0, n_0, n_0 + n_1, ...]        (bs + 1,) int32
    position_ids = [0..n_0-1, 0..n_1-1, ...]      (total,)   int64 (equal to the padded
                                                  position ids cumsum(mask) - 1 on real tokens)

A per-token tensor computed in packed form is aligned with the packed *tokens*: entry k
belongs to packed token k (for a log-prob, log p(token_k | earlier tokens of its sequence)).
:func:`unpack_response` puts entry k back on ``(sample, response position)``, exactly.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Tuple

import torch


@dataclass(frozen=True)
class PackedLayout:
    """The index map between a padded ``(bs, seq)`` grid and its packed form.

    flat_index: ``(total,)`` int64, packed token k sits at ``b * seq + s`` of the padded grid.
    cu_seqlens: ``(bs + 1,)`` int32 cumulative sequence lengths.
    position_ids: ``(total,)`` int64 position of each packed token within its sequence.
    """

    batch_size: int
    seq_len: int
    prompt_len: int
    flat_index: torch.Tensor
    cu_seqlens: torch.Tensor
    position_ids: torch.Tensor
    max_seqlen: int

    @property
    def total_tokens(self) -> int:
        return int(self.flat_index.numel())

    @property
    def response_len(self) -> int:
        return self.seq_len - self.prompt_len


def pack_layout(attention_mask: torch.Tensor, prompt_len: int) -> PackedLayout:
    """Build the packed layout of a padded batch.

    Args:
        attention_mask: ``(bs, seq)`` 0/1; each row's real tokens must be one contiguous run
            (left-padded prompt followed by right-padded response).
        prompt_len: width of the prompt part; ``seq - prompt_len`` is response_len.
    """
    if attention_mask.dim() != 2:
        raise ValueError(f"attention_mask must be (bs, seq), got {tuple(attention_mask.shape)}")
    bs, seq = attention_mask.shape
    if not 0 < prompt_len <= seq:
        raise ValueError(f"prompt_len {prompt_len} must be in (0, seq={seq}]")
    m = attention_mask != 0
    lengths = m.sum(dim=1)
    first = torch.where(m.any(dim=1), m.int().argmax(dim=1), torch.zeros_like(lengths))
    pos = torch.arange(seq, device=m.device)
    contiguous = m == ((pos >= first[:, None]) & (pos < (first + lengths)[:, None]))
    if not contiguous.all():
        rows = (~contiguous.all(dim=1)).nonzero().flatten().tolist()
        raise ValueError(f"attention_mask rows {rows} are not one contiguous run of real tokens; cannot pack")
    if (lengths == 0).any():
        rows = (lengths == 0).nonzero().flatten().tolist()
        raise ValueError(f"attention_mask rows {rows} have no real token")
    flat_index = m.reshape(-1).nonzero().flatten()
    cu = torch.zeros(bs + 1, dtype=torch.int32, device=m.device)
    cu[1:] = lengths.cumsum(0).to(torch.int32)
    starts = torch.repeat_interleave(cu[:-1].long(), lengths)
    position_ids = torch.arange(flat_index.numel(), device=m.device) - starts
    return PackedLayout(
        batch_size=bs,
        seq_len=seq,
        prompt_len=prompt_len,
        flat_index=flat_index,
        cu_seqlens=cu,
        position_ids=position_ids,
        max_seqlen=int(lengths.max()),
    )


def pack(x: torch.Tensor, layout: PackedLayout) -> torch.Tensor:
    """``(bs, seq, *rest)`` -> ``(total, *rest)``: the real tokens, row by row."""
    if tuple(x.shape[:2]) != (layout.batch_size, layout.seq_len):
        raise ValueError(f"pack: x must start with (bs, seq) = {(layout.batch_size, layout.seq_len)}, got {tuple(x.shape)}")
    return x.reshape(layout.batch_size * layout.seq_len, *x.shape[2:]).index_select(0, layout.flat_index)


def unpack(x: torch.Tensor, layout: PackedLayout, fill: float = 0) -> torch.Tensor:
    """``(total, *rest)`` -> ``(bs, seq, *rest)`` with ``fill`` on padding.  Differentiable in x;
    the gradient reaching a padding position is exactly zero (there is none)."""
    if x.shape[0] != layout.total_tokens:
        raise ValueError(f"unpack: x must have total_tokens={layout.total_tokens} rows, got {tuple(x.shape)}")
    out = torch.full(
        (layout.batch_size * layout.seq_len, *x.shape[1:]), fill, dtype=x.dtype, device=x.device
    ).index_copy(0, layout.flat_index, x)
    return out.reshape(layout.batch_size, layout.seq_len, *x.shape[1:])


def unpack_response(x: torch.Tensor, layout: PackedLayout, fill: float = 0) -> torch.Tensor:
    """``(total, *rest)`` packed per-token values -> ``(bs, response_len, *rest)`` on response tokens.

    Entry k of packed token at padded position ``(b, prompt_len + t)`` lands on ``[b, t]``; prompt
    entries are dropped (their gradient is exactly zero), response padding gets ``fill``.
    """
    return unpack(x, layout, fill)[:, layout.prompt_len :]


def pack_response(x: torch.Tensor, layout: PackedLayout) -> torch.Tensor:
    """``(bs, response_len, *rest)`` -> ``(total, *rest)``; packed prompt tokens get 0."""
    if tuple(x.shape[:2]) != (layout.batch_size, layout.response_len):
        raise ValueError(
            f"pack_response: x must start with (bs, response_len) = {(layout.batch_size, layout.response_len)}, got {tuple(x.shape)}"
        )
    full = torch.cat([x.new_zeros((layout.batch_size, layout.prompt_len, *x.shape[2:])), x], dim=1)
    return pack(full, layout)


def unpadded_rows(prompt_ids: torch.Tensor, response_ids: torch.Tensor,
                  attention_mask: torch.Tensor) -> Tuple[List[List[int]], List[List[int]]]:
    """Each row's real prompt tokens (left-padded) and every real response token (an agent's
    environment tokens too: context for the turns after them), as token-id lists."""
    P = prompt_ids.shape[1]
    prompts = [prompt_ids[b][attention_mask[b, :P] != 0].tolist() for b in range(prompt_ids.shape[0])]
    responses = [response_ids[b][:int(attention_mask[b, P:].sum())].tolist() for b in range(response_ids.shape[0])]
    return prompts, responses
