"""Teacher-forced forwards through a (TP x PP x CP sharded) megatron model.

* :func:`forward_only`: micro-batches through the pipeline without gradients, each result broadcast
  from the last stage to every rank; :func:`teacher_forced_log_probs`, :func:`scalar_values` and
  :func:`response_log_probs` over rows of any lengths.

Rows are right-padded ``[batch, seq]`` token ids and attention is causal, so positions past a row's
end never influence its valid positions: rows of similar length share a micro-batch cut to its
longest row.  With ``pack=True`` (``algo.pack_sequences``) or a token budget
(``algo.micro_batch_tokens``) each micro-batch runs as one packed (THD) sequence, whose outputs
equal the padded forward's up to float rounding.  What a micro-batch is for megatron (padding,
packing, SP / CP / EP / VPP, the model and schedule calls) is :mod:`megarl.models.micro_batches`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, List, Optional

import torch
import torch.distributed as dist

from megarl.experience.packing import unpack
from megarl.models import context_parallel
from megarl.models.micro_batches import (MicroBatch, ModelInput, PackedMicroBatch, PositionWise, call_model,
                                         ep_common_packs, ep_common_widths, own_width, pad_columns, run_schedule,
                                         sequence_multiple, sp_aligned, tokens_of)
from megarl.models.router_replay import RecordRouting, RouterTargets, RoutingStats, RowRouting, record_to_rows
from megarl.models.weights import as_chunks, unwrap


@dataclass(frozen=True)
class Routing:
    """MoE routing for a forward pass (``algo.routing_replay``): ``rows`` on the pass's token
    grid; ``replay`` dispatches to the recorded experts; ``stats`` compares with the record."""

    rows: RowRouting
    replay: bool
    stats: Optional[RoutingStats] = None

    def targets(self, mb: MicroBatch, rows_idx, width: int) -> RouterTargets:
        part = self.rows.rows(rows_idx, width)
        if isinstance(mb, PackedMicroBatch):
            return RouterTargets.for_packed(part, mb.layout)
        return RouterTargets.for_padded(part)


def packing_unsupported_reason() -> Optional[str]:
    """None when this process can run packed (THD) forwards, else why not (for start-up checks).

    On CUDA the packed path is transformer-engine's attention (megatron's local
    ``DotProductAttention`` refuses ``packed_seq_params``); on CPU the local spec's attention is
    ``megarl.models.cpu_layers.LocalAttention``, which has a THD path.
    """
    import importlib.util

    from megarl.runtime import cpu_compat

    if cpu_compat.use_local_layer_stand_ins() or importlib.util.find_spec("transformer_engine") is not None:
        return None
    return ("transformer-engine is not installed: on CUDA only its attention takes packed (THD) sequences "
            "(megatron-core's local DotProductAttention refuses them)")


def _check_packable(model) -> None:
    """Refuse, before any forward, a model whose attention cannot take a packed sequence."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    if any(isinstance(m, DotProductAttention) and not getattr(m, "takes_thd", False)
           for m in unwrap(model).modules()):
        raise ValueError("pack=True (algo.pack_sequences): this model uses megatron-core's local "
                         "DotProductAttention, which has no packed-sequence (THD) path on CUDA; build it with "
                         "transformer-engine or run padded")


def _result(on_output, out: torch.Tensor, mb: MicroBatch, width: int) -> torch.Tensor:
    """``on_output`` of a micro-batch's output at its own width; under context parallelism
    ``out`` holds this rank's positions only, and ``on_output`` must be a :class:`PositionWise`."""
    if context_parallel.size() == 1:
        return on_output(*own_width(out, tokens_of(mb), width))
    if not isinstance(on_output, PositionWise):
        raise TypeError("forward_only under context parallelism needs a PositionWise output function "
                        f"(per position, labels shifted on the whole row), got {on_output!r}")
    cu = mb.cu_seqlens() if isinstance(mb, PackedMicroBatch) else None
    return on_output.on_context_parallel_share(out, tokens_of(mb), width, cu)


def forward_only(model, micro_batches: List[MicroBatch],
                 on_output: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
                 targets: Optional[List[RouterTargets]] = None, routing: Optional[Routing] = None,
                 ) -> List[torch.Tensor]:
    """Run ``micro_batches`` (each ``(b, s)`` token ids, same ``s`` within a micro-batch, or a
    :class:`PackedMicroBatch`) through the pipeline without gradients.  MoE: ``targets`` (one
    per micro-batch) and ``routing`` replay / observe each micro-batch's routing.

    ``on_output(model_output, tokens)`` runs on the last stage on every TP rank and must
    return a tensor whose shape is a function of ``tokens.shape`` only; its results are
    broadcast from the last stage so every rank returns the same list.  For a packed
    micro-batch, ``tokens`` is its ``(1, total)`` packed sequence.

    ``model``: one model, or this rank's list of model chunks under virtual pipeline stages
    (:func:`megarl.models.builder.build_model_chunks`), run by megatron's interleaved schedule.
    """
    from megatron.core import parallel_state as ps

    chunks = as_chunks(model)  # virtual pipeline stages: one per stage
    model = chunks[0]
    inner = unwrap(model)
    pp = ps.get_pipeline_model_parallel_world_size()
    dev = next(inner.parameters()).device
    if context_parallel.size() > 1:
        why = context_parallel.check_supported(routing=routing is not None)
        if why is not None:
            raise ValueError(f"parallel.cp={context_parallel.size()}: {why}")
    results: List[Optional[torch.Tensor]] = []
    targets = targets if targets is not None else [None] * len(micro_batches)
    replay, stats = routing is not None and routing.replay, routing.stats if routing else None
    # sequence parallelism: each micro-batch runs on whole tp-sized chunks of its rows (right
    # padding, never attended to by a causal model); on_output sees the micro-batch's own width
    items = [ModelInput(mb.to(dev), tg, width) for mb, tg, width in
             (sp_aligned(mb, tg, sequence_multiple(model)) for mb, tg in zip(micro_batches, targets, strict=True))]
    was_training = model.training
    for c in chunks:
        c.eval()
    try:
        with torch.no_grad():
            if pp == 1:
                for inp in items:
                    out = call_model(model, inp.tokens, inp.targets, replay, stats)
                    results.append(_result(on_output, out, inp.tokens, inp.width))
                return results

            def step(data_iterator, m):
                inp = next(data_iterator)
                out = call_model(m, inp.tokens, inp.targets, replay, stats)

                def loss_func(output):
                    res = _result(on_output, output, inp.tokens, inp.width)
                    # the schedule divides the first element in place by the micro-batch count
                    # (megatron's loss averaging): a scalar of its own, never the result
                    return torch.zeros((), device=res.device), {"result": res}

                return out, loss_func

            # every micro-batch in one schedule call, so the stages work on different micro-batches
            # at once; their shapes differ (widths; a packed one travels between stages as
            # [total, 1, hidden]), so the stages always tell each other every activation's shape
            store = run_schedule(chunks, items, step, forward_only=True, variable=True,
                                 shapes=[tokens_of(inp.tokens).shape for inp in items])
            # the results live on the last stage (broadcast below); a filler's are dropped
            real = len(items)
            results.extend([entry["result"] for entry in store][:real] if ps.is_pipeline_last_stage() else [None] * real)
    finally:
        if was_training:
            for c in chunks:
                c.train()
    # Broadcast each result from the last stage (shapes are agreed via a small header).
    group = ps.get_pipeline_model_parallel_group()
    src = dist.get_global_rank(group, pp - 1)
    out: List[torch.Tensor] = []
    for res in results:
        header = torch.zeros(8, dtype=torch.long, device=dev)  # NCCL needs device tensors
        if res is not None:
            header[0] = res.dim()
            header[1:1 + res.dim()] = torch.tensor(res.shape, device=dev)
        dist.broadcast(header, src=src, group=group)
        shape = tuple(header[1:1 + int(header[0])].tolist())
        buf = res.contiguous().to(dev) if res is not None else torch.empty(shape, device=dev)
        dist.broadcast(buf, src=src, group=group)
        out.append(buf)
    return out


def _micro_batches(tokens: torch.Tensor, micro_batch_size: int) -> List[torch.Tensor]:
    return list(tokens.split(micro_batch_size or tokens.shape[0], 0))


def _by_length(model, tokens: torch.Tensor, lengths: Optional[torch.Tensor], micro_batch_size: int,
               on_output: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], trim: int,
               pack: bool = False, routing: Optional[Routing] = None, micro_batch_tokens: int = 0) -> torch.Tensor:
    """``forward_only`` over micro-batches of rows of similar length, each cut to its longest row.

    Rows are right-padded and attention is causal, so the padding after a row's last token never
    changes that row's outputs; computing it is waste (a batch of short prompts and long
    responses is mostly padding).  Rows are sorted by ``lengths`` (longest first, stable), split
    into micro-batches of ``micro_batch_size``, each micro-batch is cut to its longest row, and
    the per-position results (``(b_i, L_i - trim, ...)``) go back to their rows in a zero-padded
    ``(b, s - trim, ...)`` tensor.  ``lengths=None``: micro-batches in row order at full width.

    ``pack=True``: the same micro-batches, each run as one packed sequence of its rows' real
    tokens (:class:`PackedMicroBatch`); ``on_output`` sees the ``(1, total)`` packed tokens and
    its ``(1, total - trim, ...)`` result is unpacked to the rows (entries that straddle two
    rows land past a row's ``length - trim`` and are zeroed like the padding).

    ``micro_batch_tokens`` (``algo.micro_batch_tokens``; implies ``pack``): micro-batches of at
    most that many real tokens instead of ``micro_batch_size`` rows.

    ``routing``: each micro-batch takes its rows' routing (same cut).
    """
    if pack or micro_batch_tokens:
        return _packed(model, tokens, lengths, micro_batch_size, on_output, trim, routing, micro_batch_tokens)
    if lengths is None:
        mbs = _micro_batches(tokens, micro_batch_size)
        step = micro_batch_size or tokens.shape[0]
        tg = None if routing is None else [
            routing.targets(mb, slice(i * step, i * step + mb.shape[0]), mb.shape[1]) for i, mb in enumerate(mbs)]
        return torch.cat(forward_only(model, mbs, on_output, tg, routing), 0)
    order = torch.argsort(lengths.cpu(), descending=True, stable=True)
    groups = list(order.split(micro_batch_size or tokens.shape[0]))
    widths = [max(int(lengths[g].max()), trim + 1) for g in groups]
    run = ep_common_widths(model, groups, widths)
    mbs = [pad_columns(tokens[g, :w], r) for g, w, r in zip(groups, widths, run, strict=True)]
    # a widened micro-batch replays the filler routing (0 .. k-1) on its extra columns
    tg = None if routing is None else [routing.targets(mb, g, mb.shape[1]) for mb, g in zip(mbs, groups, strict=True)]
    results = forward_only(model, mbs, on_output, tg, routing)
    first = results[0]
    out = first.new_zeros((tokens.shape[0], tokens.shape[1] - trim) + tuple(first.shape[2:]))
    for g, w, res in zip(groups, widths, results, strict=True):
        out[g.to(out.device), : w - trim] = res[:, : w - trim]
    past = torch.arange(out.shape[1], device=out.device)[None, :] >= (lengths.to(out.device) - trim)[:, None]
    return out.masked_fill_(past.reshape(past.shape + (1,) * (out.dim() - 2)), 0)


def _packed(model, tokens: torch.Tensor, lengths: Optional[torch.Tensor], micro_batch_size: int,
            on_output: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], trim: int,
            routing: Optional[Routing] = None, micro_batch_tokens: int = 0) -> torch.Tensor:
    """:func:`_by_length` with every micro-batch packed: ``micro_batch_size`` rows each, or, with
    ``micro_batch_tokens``, rows first-fit into that many tokens each
    (:func:`megarl.experience.token_budget.first_fit`)."""
    from megarl.experience.token_budget import first_fit

    _check_packable(model)
    B, S = tokens.shape
    if lengths is None:
        lengths = torch.full((B,), S, dtype=torch.long)
    lengths = lengths.cpu().long()
    if int(lengths.max()) > S:
        raise ValueError(f"lengths up to {int(lengths.max())} exceed the {S} token columns")
    # a row without tokens still takes one (its outputs are zeroed below, as with padding)
    real = lengths.clamp(min=1)
    if micro_batch_tokens:
        groups = [torch.tensor(b, dtype=torch.long) for b in first_fit(real.tolist(), micro_batch_tokens)]
    else:
        groups = list(torch.argsort(lengths, descending=True, stable=True).split(micro_batch_size or B))
    widths = [int(real[g].max()) for g in groups]
    cp = context_parallel.size()  # each sequence split into 2 x cp chunks: rows padded at their ends
    items = [PackedMicroBatch.from_rows(tokens[g, :w], real[g]).rows_padded_to(2 * cp if cp > 1 else 1)
             for g, w in zip(groups, widths, strict=True)]
    tg = None if routing is None else [routing.targets(it, g, w)
                                       for it, g, w in zip(items, groups, widths, strict=True)]
    n_own = len(items)
    items, tg = ep_common_packs(model, items, tg)
    results = forward_only(model, items, on_output, tg, routing)[:n_own]
    out = None
    for g, w, item, res in zip(groups, widths, items, results, strict=True):
        per_token = res[0]  # (total - trim, ...): entry k belongs to packed token k
        if trim:
            per_token = torch.cat([per_token, per_token.new_zeros((trim,) + tuple(per_token.shape[1:]))])
        rows = unpack(per_token, item.layout)  # (b_g, w, ...)
        if out is None:
            out = rows.new_zeros((B, max(S - trim, 0)) + tuple(rows.shape[2:]))
        n = min(w, S - trim)
        out[g.to(out.device), :n] = rows[:, :n]
    past = torch.arange(out.shape[1], device=out.device)[None, :] >= (lengths.to(out.device) - trim)[:, None]
    return out.masked_fill_(past.reshape(past.shape + (1,) * (out.dim() - 2)), 0)


def teacher_forced_log_probs(model, tokens: torch.Tensor, micro_batch_size: int = 0,
                             temperature: float = 1.0, lengths: Optional[torch.Tensor] = None,
                             pack: bool = False, routing: Optional[Routing] = None,
                             micro_batch_tokens: int = 0, log_prob_chunk: int = 0) -> torch.Tensor:
    """``(b, s-1)``: log-prob of ``tokens[:, t+1]`` given ``tokens[:, :t+1]`` on every rank.

    With ``lengths`` (each row's real tokens; right padding after them), micro-batches group
    rows of similar length and skip the padding; positions past a row's length are 0.
    ``pack=True``: each micro-batch runs as one packed (THD) sequence (see the module doc);
    ``micro_batch_tokens``: packed micro-batches cut by that token budget.  ``log_prob_chunk``:
    the output layer applied that many positions at a time, the full logits never made
    (:mod:`megarl.models.fused_output`).
    ``routing`` (MoE): the rows' routing, replayed and / or compared (:class:`Routing`)."""
    from megarl.models.fused_output import output_head

    V = unwrap(model).megarl_spec.vocab_size
    with output_head(model, V, log_prob_chunk) as head:
        on_output = PositionWise(lambda out, nxt: head.log_probs(out, nxt, temperature).float(), shift=True)
        return _by_length(model, tokens, lengths, micro_batch_size, on_output, trim=1, pack=pack, routing=routing,
                          micro_batch_tokens=micro_batch_tokens)


def scalar_values(model, tokens: torch.Tensor, micro_batch_size: int = 0,
                  lengths: Optional[torch.Tensor] = None, pack: bool = False,
                  micro_batch_tokens: int = 0) -> torch.Tensor:
    """``(b, s)`` scalar head outputs of a value-head model (critic / reward model); with
    ``lengths``, ``pack`` and ``micro_batch_tokens``, as :func:`teacher_forced_log_probs` (0 past a row's length)."""
    values = PositionWise(lambda out, _t: out[..., 0].float(), shift=False)
    return _by_length(model, tokens, lengths, micro_batch_size, values, trim=0,
                      pack=pack, micro_batch_tokens=micro_batch_tokens)


def right_align(prompt_ids: torch.Tensor, response_ids: torch.Tensor, attention_mask: torch.Tensor):
    """Experience layout -> actor input layout.

    The experience record keeps prompts left-padded ``(b, P)`` and responses right-padded
    ``(b, R)`` with ``attention_mask (b, P + R)``.  The actor runs right-padded sequences with
    positions ``0..len-1`` and a causal mask, so each row is re-packed as
    ``[real prompt tokens, real response tokens, padding]``.

    Returns ``(tokens (b, L), prompt_lens (b,), response_lens (b,))``.
    """
    B, P = prompt_ids.shape
    R = response_ids.shape[1]
    if attention_mask.shape != (B, P + R):
        raise ValueError(f"attention_mask shape {list(attention_mask.shape)} != [{B}, {P + R}]")
    plen = attention_mask[:, :P].sum(1).long()
    rlen = attention_mask[:, P:].sum(1).long()
    L = int((plen + rlen).max())
    pos = torch.arange(L, device=prompt_ids.device)[None, :]
    # position j < plen takes prompt column P - plen + j; then response column j - plen
    p_idx = (P - plen[:, None] + pos).clamp(0, P - 1)
    r_idx = (pos - plen[:, None]).clamp(0, max(R - 1, 0))
    from_prompt = prompt_ids.gather(1, p_idx)
    from_resp = response_ids.gather(1, r_idx) if R else torch.zeros_like(from_prompt)
    tokens = torch.where(pos < plen[:, None], from_prompt,
                         torch.where(pos < (plen + rlen)[:, None], from_resp, torch.zeros_like(from_prompt)))
    return tokens, plen, rlen


def gather_response(per_position: torch.Tensor, prompt_lens: torch.Tensor, response_lens: torch.Tensor,
                    response_len: int) -> torch.Tensor:
    """Pick the values that predict response tokens from a ``(b, L-1, ...)`` teacher-forced
    output: response token t of row b is predicted at position ``prompt_len_b - 1 + t``.

    Returns ``(b, response_len, ...)`` with zeros past each row's response.
    """
    B = per_position.shape[0]
    t = torch.arange(response_len, device=per_position.device)[None, :]
    idx = (prompt_lens[:, None] - 1 + t).clamp(0, per_position.shape[1] - 1)
    valid = t < response_lens[:, None]
    extra = per_position.shape[2:]
    idx_e = idx.reshape(B, response_len, *([1] * len(extra))).expand(B, response_len, *extra)
    out = per_position.gather(1, idx_e)
    mask = valid.reshape(B, response_len, *([1] * len(extra)))
    return torch.where(mask, out, torch.zeros((), dtype=out.dtype, device=out.device))


def response_log_probs(model, prompt_ids: torch.Tensor, response_ids: torch.Tensor,
                       attention_mask: torch.Tensor, micro_batch_size: int = 0,
                       temperature: float = 1.0, pack: bool = False,
                       routing: Optional[RecordRouting] = None, micro_batch_tokens: int = 0,
                       log_prob_chunk: int = 0) -> torch.Tensor:
    """Teacher-forced log-prob of every response token, ``(b, R)`` aligned with
    ``response_ids`` (0 at padding), from experience-layout tensors.  Collective over the
    model-parallel group; same result on every rank.  ``pack``: packed (THD) micro-batches;
    ``micro_batch_tokens``: packed ones cut by that token budget; ``log_prob_chunk``: see
    :func:`teacher_forced_log_probs`.
    ``routing`` (MoE): the record's routing of these rows, replayed and / or compared."""
    tokens, plen, rlen = right_align(prompt_ids, response_ids, attention_mask)
    rt = None
    if routing is not None:
        rows = record_to_rows(routing.experts, attention_mask.cpu(), prompt_ids.shape[1], routing.moe_layers,
                              tokens.shape[1], routing.real_rows)
        rt = Routing(rows, routing.replay, routing.stats)
    lp = teacher_forced_log_probs(model, tokens, micro_batch_size, temperature, lengths=plen + rlen, pack=pack,
                                  routing=rt, micro_batch_tokens=micro_batch_tokens, log_prob_chunk=log_prob_chunk)
    return gather_response(lp, plen, rlen, response_ids.shape[1])
