"""Teacher-forced forwards through a (TP x PP sharded) megatron model.

* :func:`token_log_probs_from_logits` — vocab-parallel log-prob of given targets, exact with
  a padded vocabulary (padding rows are masked out of the partition function), differentiable.
* :func:`forward_only` — run micro-batches through the pipeline (megatron's own schedule) and
  return per-micro-batch results from the last stage, broadcast to every rank.

Sequences are right-padded ``[batch, seq]`` token ids; attention is causal, so positions
past a sequence's end never influence its valid positions.

With ``pack=True`` (``algo.pack_sequences``) the forward-only passes lay the real tokens of the
rows of each micro-batch back to back in one ``[1, total]`` sequence with megatron-core's
``PackedSeqParams(qkv_format="thd")``: attention never crosses a ``cu_seqlens`` boundary and
RoPE restarts at 0 in every sequence, so each row's outputs equal the padded forward's up to
float rounding.  On CUDA this is transformer-engine's varlen attention; without TE the local
attention gets its THD path from ``megarl.runtime.cpu_compat`` (CPU only).  With
``micro_batch_tokens`` (``algo.micro_batch_tokens``) the packed micro-batches are cut by a token
budget instead of a row count; the update's packed micro-batches
(:func:`megarl.models.optim.train_step`) reach their loss through :func:`next_token_terms` and
:func:`token_terms`.

Under context parallelism (``parallel.cp``) every forward runs this rank's positions of each row,
or of each packed sequence, and the output functions are :class:`PositionWise`: labels shifted on
the whole row, per-token results gathered back to rows (:mod:`megarl.models.context_parallel`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, List, Optional, Union

import torch
import torch.distributed as dist

from megarl.experience.packing import PackedLayout, pack, pack_layout, unpack
from megarl.models import context_parallel
from megarl.models.router_replay import (RecordRouting, RouterTargets, RoutingStats, RowRouting, record_to_rows,
                                         routed)
from megarl.models.weights import as_chunks, unwrap



def mask_padded_vocab(logits_shard: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Set logits of padding vocabulary rows (ids >= ``vocab_size``) to -inf on this TP shard.

    Padding rows are zero weights, so their logits are 0, not -inf: left in, they would add
    ``exp(0)`` terms to the softmax and bias every log-prob.
    """
    from megatron.core import parallel_state as ps

    per = logits_shard.shape[-1]
    start = ps.get_tensor_model_parallel_rank() * per
    n_pad = start + per - vocab_size
    if n_pad <= 0:
        return logits_shard
    keep = torch.arange(start, start + per, device=logits_shard.device) < vocab_size
    return logits_shard.masked_fill(~keep, float("-inf"))


def token_log_probs_from_logits(logits_shard: torch.Tensor, targets: torch.Tensor, vocab_size: int,
                                temperature: float = 1.0, chunk: int = 0) -> torch.Tensor:
    """``log softmax(logits / T)[target]`` from vocab-parallel logits.

    Args:
        logits_shard: ``(b, s, V_padded / tp)`` this TP rank's slice of the logits.
        targets: ``(b, s)`` token ids (global vocabulary).
        chunk: ``algo.log_prob_chunk``: positions at a time, without an fp32 copy of the whole
            logits (:mod:`megarl.models.chunked_logits`: the same values, bitwise); 0: all at once.
    Returns:
        ``(b, s)`` log-probs, identical on every TP rank, with gradient to the logits.
    """
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    if chunk:
        from megarl.models.chunked_logits import chunked_token_log_probs

        return chunked_token_log_probs(logits_shard, targets, vocab_size, temperature, chunk)

    logits = mask_padded_vocab(logits_shard, vocab_size)
    if temperature != 1.0:
        logits = logits / temperature
    # megatron's kernel expects [s, b, v], returns the negative log-likelihood, and works in place
    # on what it is given: always a copy (for one row in fp32, transpose, contiguous and float
    # would all hand it the model's own logits, which the entropy then read exponentiated)
    nll = vocab_parallel_cross_entropy(logits.transpose(0, 1).to(torch.float32, copy=True,
                                                                  memory_format=torch.contiguous_format),
                                       targets.transpose(0, 1).contiguous())
    return -nll.transpose(0, 1)


def gather_vocab(logits_shard: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Full ``(b, s, vocab_size)`` logits from the TP shards (for tests and inspection)."""
    from megatron.core import parallel_state as ps

    tp = ps.get_tensor_model_parallel_world_size()
    if tp > 1:
        parts = [torch.empty_like(logits_shard) for _ in range(tp)]
        dist.all_gather(parts, logits_shard.contiguous(), group=ps.get_tensor_model_parallel_group())
        logits_shard = torch.cat(parts, -1)
    return logits_shard[..., :vocab_size]


def position_ids_for(tokens: torch.Tensor) -> torch.Tensor:
    return torch.arange(tokens.shape[1], device=tokens.device).unsqueeze(0).expand_as(tokens)


@dataclass(frozen=True)
class PackedMicroBatch:
    """The rows of one micro-batch as one packed (THD) sequence.

    ``tokens`` / ``position_ids`` ``(1, total + filler)``: the real tokens of every row back to
    back and their positions within their row, then ``filler`` tokens of id 0 that form a
    sequence of their own (attention never crosses a ``cu_seqlens`` boundary, so they change no
    real token's output; they make the length what sequence parallelism or the MoE dispatcher
    needs); ``layout`` maps the real packed tokens back to the ``(b, s)`` rows.
    """

    tokens: torch.Tensor
    position_ids: torch.Tensor
    layout: PackedLayout
    filler: int = 0

    @classmethod
    def from_rows(cls, tokens: torch.Tensor, lengths: torch.Tensor) -> "PackedMicroBatch":
        """Pack right-padded ``tokens (b, s)`` whose row b has ``lengths[b] >= 1`` real tokens."""
        mask = torch.arange(tokens.shape[1], device=tokens.device)[None, :] < lengths.to(tokens.device)[:, None]
        layout = pack_layout(mask, tokens.shape[1])
        return cls(pack(tokens, layout)[None], layout.position_ids[None], layout)

    @property
    def real_tokens(self) -> int:
        return self.layout.total_tokens

    def padded_to(self, length: int) -> "PackedMicroBatch":
        """The same micro-batch with filler tokens up to ``length`` in all (unchanged when it
        has them already)."""
        extra = length - self.tokens.shape[1]
        if extra <= 0:
            return self
        filler_positions = torch.arange(extra, dtype=self.position_ids.dtype, device=self.position_ids.device)
        return PackedMicroBatch(pad_columns(self.tokens, length), torch.cat([self.position_ids, filler_positions[None]], 1),
                                self.layout, self.filler + extra)

    def to(self, dev) -> "PackedMicroBatch":
        return PackedMicroBatch(self.tokens.to(dev), self.position_ids.to(dev), self.layout, self.filler)

    def cu_seqlens(self) -> torch.Tensor:
        """The pack's sequence boundaries, the filler sequence included."""
        cu = self.layout.cu_seqlens.to(self.tokens.device)
        if self.filler:
            cu = torch.cat([cu, cu.new_full((1,), int(cu[-1]) + self.filler)])
        return cu

    def packed_seq_params(self):
        """megatron-core's THD parameters: attention within ``cu_seqlens`` boundaries (the filler is
        one more sequence), RoPE per sequence (``max_seqlen`` sizes the RoPE table)."""
        from megatron.core.packed_seq_params import PackedSeqParams

        cu = self.cu_seqlens()
        n = max(self.layout.max_seqlen, self.filler)
        return PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=n, max_seqlen_kv=n)

    def rows_padded_to(self, multiple: int) -> "PackedMicroBatch":
        """The same rows with every sequence lengthened at its end to a multiple of ``multiple``
        (context parallelism splits each sequence into ``2 x cp`` chunks): padding of the row's own
        sequence, after its real tokens, which causal attention never lets them see.  ``layout``
        then maps the padded sequences (outputs past a row's real length are the caller's to drop)."""
        if multiple == 1:
            return self
        if self.filler:
            raise ValueError("rows_padded_to: pad the rows before adding filler tokens")
        lengths = (self.layout.cu_seqlens[1:] - self.layout.cu_seqlens[:-1]).long().cpu()
        rows = unpack(self.tokens[0, :self.real_tokens], self.layout)
        run = -(-lengths // multiple) * multiple
        return PackedMicroBatch.from_rows(pad_columns(rows, int(run.max())), run)


MicroBatch = Union[torch.Tensor, PackedMicroBatch]


@dataclass(frozen=True)
class PositionWise:
    """A forward-only pass's output function given position by position: ``fn(outputs (n, t,
    ...), labels (n, t)) -> (n, t, ...)``; with ``shift`` the labels are the next tokens and the
    last position (which predicts past the sequence) is dropped.

    Called as ``on_output(output, tokens)`` on a whole sequence, it is the function
    :func:`forward_only` has always taken.  Given position by position, the same function runs on
    a context-parallel rank's share of a sequence (:mod:`megarl.models.context_parallel`: labels
    shifted on the whole row, then split; the per-position results gathered back to rows)."""

    fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    shift: bool

    def __call__(self, output: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        if self.shift:
            return self.fn(output[:, :-1], tokens[:, 1:])
        return self.fn(output, tokens)

    def on_context_parallel_share(self, output: torch.Tensor, tokens: torch.Tensor, width: int,
                                  cu_seqlens: Optional[torch.Tensor] = None) -> torch.Tensor:
        """The whole rows' result from this CP rank's ``output`` (its positions of ``tokens``, the
        whole padded rows, or the whole pack of ``cu_seqlens``), cut to ``width`` (less the shifted
        position)."""
        labels = context_parallel.shifted_labels(tokens) if self.shift else tokens
        whole = context_parallel.gather(self.fn(output, context_parallel.split(labels, cu_seqlens=cu_seqlens)),
                                        cu_seqlens)
        return whole[:, :width - 1] if self.shift else whole[:, :width]


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


def _call(model, mb: MicroBatch, targets: Optional[RouterTargets] = None, routing: Optional[Routing] = None):
    with routed(model, targets, routing is not None and routing.replay, routing.stats if routing else None):
        # context parallelism: this rank's positions of the rows, of each packed sequence (the whole rows otherwise)
        if isinstance(mb, PackedMicroBatch):
            cu = mb.cu_seqlens()
            return model(context_parallel.split(mb.tokens, cu_seqlens=cu),
                         context_parallel.split(mb.position_ids, cu_seqlens=cu), None,
                         packed_seq_params=mb.packed_seq_params())
        return model(context_parallel.split(mb), context_parallel.split(position_ids_for(mb)), None)


def _result(on_output, out: torch.Tensor, mb: MicroBatch, width: int) -> torch.Tensor:
    """``on_output`` of a micro-batch's output at its own width; under context parallelism
    ``out`` holds this rank's positions only, and ``on_output`` must be a :class:`PositionWise`."""
    if context_parallel.size() == 1:
        return on_output(*_own(out, _tokens(mb), width))
    if not isinstance(on_output, PositionWise):
        raise TypeError("forward_only under context parallelism needs a PositionWise output function "
                        f"(per position, labels shifted on the whole row), got {on_output!r}")
    cu = mb.cu_seqlens() if isinstance(mb, PackedMicroBatch) else None
    return on_output.on_context_parallel_share(out, _tokens(mb), width, cu)


def _tokens(mb: MicroBatch) -> torch.Tensor:
    return mb.tokens if isinstance(mb, PackedMicroBatch) else mb


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
    from megatron.core.pipeline_parallel import get_forward_backward_func

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
    # sequence parallelism: each micro-batch runs on whole tp-sized chunks of its rows (right
    # padding, never attended to by a causal model); on_output sees the micro-batch's own width
    aligned = [_aligned(mb, tg, sequence_multiple(model)) for mb, tg in zip(micro_batches, targets, strict=True)]
    was_training = model.training
    for c in chunks:
        c.eval()
    try:
        with torch.no_grad():
            if pp == 1:
                for mb, tg, width in aligned:
                    mb = mb.to(dev)
                    out = _call(model, mb, tg, routing)
                    results.append(_result(on_output, out, mb, width))
                return results
            items = [(mb.to(dev), tg, width) for mb, tg, width in aligned]
            real = len(items)
            if len(chunks) > 1 and real % pp:
                # megatron's interleaved schedule runs micro-batches in groups of pp: repeat the last
                # one up to a multiple of pp (their results are dropped)
                items += [items[-1]] * (pp - real % pp)
            # every model chunk draws the micro-batches in order from an iterator of its own
            it = iter(items) if len(chunks) == 1 else [iter(items) for _ in chunks]

            def step(data_iterator, m):
                mb, tg, width = next(data_iterator)
                out = _call(m, mb, tg, routing)

                def loss_func(output):
                    res = _result(on_output, output, mb, width)
                    # the schedule divides the first element in place by the micro-batch count
                    # (megatron's loss averaging): a scalar of its own, never the result
                    return torch.zeros((), device=res.device), {"result": res}

                return out, loss_func

            # every micro-batch in one schedule call, so the stages work on different
            # micro-batches at once; their shapes differ (widths; a packed one travels between
            # stages as [total, 1, hidden]), so the stages tell each other every activation's shape
            # (megatron's variable_seq_lengths, for this call only: training steps have one shape)
            shapes = [tuple(_tokens(mb).shape) for mb, _tg, _width in items]  # megatron divides by cp itself
            config = inner.config
            variable = config.variable_seq_lengths
            config.variable_seq_lengths = True
            try:
                store = get_forward_backward_func()(
                    forward_step_func=step, data_iterator=it, model=chunks, num_microbatches=len(items),
                    seq_length=max(s[1] for s in shapes), micro_batch_size=max(s[0] for s in shapes),
                    forward_only=True)
            finally:
                config.variable_seq_lengths = variable
            # the results live on the last stage (broadcast below)
            last = ps.is_pipeline_last_stage()
            results.extend([entry["result"] for entry in store][:real] if last else [None] * real)
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
    run = _ep_common_widths(model, groups, widths)
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


def _moe_dispatch_group(model):
    """The group megatron's allgather token dispatcher gathers over (expert TP x EP) when the
    model has routed experts spread over EP > 1 ranks; else None."""
    from megatron.core import parallel_state as ps

    spec = getattr(unwrap(model), "megarl_spec", None)
    if getattr(spec, "moe", None) is None or ps.get_expert_model_parallel_world_size() == 1:
        return None
    return ps.get_expert_tensor_and_model_parallel_group()


def _ep_common_widths(model, groups: List[torch.Tensor], widths: List[int]) -> List[int]:
    """The width each micro-batch runs at: its own, except for an MoE model at EP > 1.

    There the allgather token dispatcher (megatron-core ``MoEAllGatherTokenDispatcher``, which
    ``cpu_compat`` selects on CPU) gathers every micro-batch's tokens over the expert TP x EP group
    with one equal-sized all-gather, so the ranks of that group, which hold different rows (they
    are data-parallel ranks for everything but the experts), must run the same number of
    micro-batches of the same shape: each is widened to the widest among them.  (The alltoall
    dispatcher built on CUDA needs only the same number.)  The extra columns are right padding,
    which causal attention never lets reach a row's real positions.  Collective over that group."""
    group = _moe_dispatch_group(model)
    if group is None:
        return widths
    mine = ([len(g) for g in groups], widths)
    every: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(every, mine, group=group)
    if any(rows != mine[0] for rows, _ in every):
        raise ValueError("MoE at expert parallel size > 1: the ranks of an expert-parallel group must run the same "
                         f"number of micro-batches with the same rows each (the token dispatcher gathers them); got "
                         f"{[rows for rows, _ in every]}")
    return [max(ws) for ws in zip(*(w for _, w in every), strict=True)]


def _aligned(mb: MicroBatch, tg: Optional[RouterTargets], m: int):
    """``(micro-batch, targets, width)``: a micro-batch lengthened to a multiple of ``m`` (tp, for
    sequence parallelism) -- a padded one by right padding, a packed one by filler tokens -- with
    its routing targets widened alike, and the width its outputs are cut back to."""
    if isinstance(mb, PackedMicroBatch):
        run = round_up(mb.tokens.shape[1], m)
        if tg is not None and run > mb.tokens.shape[1]:
            tg = tg.widened(1, run - mb.tokens.shape[1])
        return mb.padded_to(run), tg, mb.real_tokens
    w = mb.shape[1]
    run = round_up(w, m)
    if run == w:
        return mb, tg, w
    return pad_columns(mb, run), (None if tg is None else tg.widened(mb.shape[0], run - w)), w


def _own(out: torch.Tensor, tokens: torch.Tensor, width: Optional[int]):
    """A micro-batch's output and tokens at its own width (``width`` None: as they are)."""
    if width is None or width == tokens.shape[1]:
        return out, tokens
    return out[:, :width], tokens[:, :width]


def sequence_multiple(model) -> int:
    """What a forward's sequence length must be a multiple of: tp under sequence parallelism
    (megatron splits the sequence into tp equal chunks), else 1."""
    return unwrap(model).megarl_opts.sequence_multiple


def round_up(width: int, multiple: int) -> int:
    return -(-width // multiple) * multiple


def pad_columns(tokens: torch.Tensor, width: int) -> torch.Tensor:
    """``tokens`` right-padded with id 0 to ``width`` columns (unchanged when it has them)."""
    if tokens.shape[1] >= width:
        return tokens
    return torch.cat([tokens, tokens.new_zeros((tokens.shape[0], width - tokens.shape[1]))], 1)


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
    items, tg = _ep_common_packs(model, items, tg, routing)
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


def common_pack_lengths(model, lengths: List[int]) -> List[int]:
    """The length each packed micro-batch runs at: its own, except for an MoE model at EP > 1,
    where megatron's allgather token dispatcher (``cpu_compat`` selects it on CPU) gathers equal
    token counts over the expert TP x EP group, whose ranks hold different rows: there the ranks
    must run as many micro-batches, and each is lengthened (by filler tokens) to the longest of its
    index over the group.  (The alltoall dispatcher built on CUDA needs only as many; the filler is
    a few tokens.)  Collective over that group."""
    group = _moe_dispatch_group(model)
    if group is None:
        return list(lengths)
    every: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(every, list(lengths), group=group)
    counts = [len(e) for e in every]
    if len(set(counts)) != 1:
        raise ValueError("MoE at expert parallel size > 1: the ranks of an expert-parallel group must run as many "
                         f"packed micro-batches (the token dispatcher gathers each); got {counts}")
    return [max(column) for column in zip(*every, strict=True)]


def _ep_common_packs(model, items: List[PackedMicroBatch], tg: Optional[List[RouterTargets]],
                     routing: Optional[Routing]):
    """The packed micro-batches an MoE model at EP > 1 runs (:func:`common_pack_lengths`): as many
    on every rank of the dispatch group (a rank with fewer repeats its first, whose results are
    dropped), each lengthened by filler tokens to the longest of its index.  Collective over that
    group; as given otherwise."""
    group = _moe_dispatch_group(model)
    if group is None:
        return items, tg
    counts: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(counts, len(items), group=group)
    extra = max(counts) - len(items)
    items = items + [items[0]] * extra
    if tg is not None:  # a repeat is dispatched as the first was, and counts in no routing statistic
        tg = tg + [RouterTargets(tg[0].experts, torch.zeros_like(tg[0].valid), tg[0].moe_layers)] * extra
    longest = common_pack_lengths(model, [int(it.tokens.shape[1]) for it in items])
    if tg is not None:
        tg = [t.widened(1, n - it.tokens.shape[1]) if n > it.tokens.shape[1] else t
              for t, it, n in zip(tg, items, longest, strict=True)]
    return [it.padded_to(n) for it, n in zip(items, longest, strict=True)], tg


def next_token_terms(output: torch.Tensor, mb, fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """``(b, w - 1)``: ``fn(logits, next tokens)`` per position of a training micro-batch's rows
    (position t of a row: the output at its token t against its token t + 1), whether the model ran
    them padded (``output`` ``(b, w, ...)``) or packed (``mb["packed"]``; ``output`` ``(1, total,
    ...)`` over the real packed tokens: computed there, then unpacked to the rows).  ``fn`` maps
    ``(n, t, ...)`` outputs and ``(n, t)`` tokens to ``(n, t)``."""
    p = mb.get("packed")
    run = mb.get("context_parallel_width")
    if run is not None:  # this CP rank's positions of the rows padded to run (module context_parallel)
        return PositionWise(fn, shift=True).on_context_parallel_share(output, pad_columns(mb["tokens"], run),
                                                                      mb["tokens"].shape[1])
    if p is not None and mb.get("context_parallel_packed"):  # this CP rank's positions of each sequence
        vals = PositionWise(fn, shift=True).on_context_parallel_share(output, p.tokens, p.real_tokens, p.cu_seqlens())
        return unpack(torch.cat([vals[0], vals.new_zeros(1)]), p.layout)[:, :mb["tokens"].shape[1] - 1]
    if p is None:
        return fn(output[:, :-1], mb["tokens"][:, 1:])
    vals = fn(output[:, :-1], p.tokens[:, 1:p.real_tokens])[0]
    # a row's last token predicts the next row's first: that entry lands past the row's end
    return unpack(torch.cat([vals, vals.new_zeros(1)]), p.layout)[:, :-1]


def token_terms(values: torch.Tensor, mb) -> torch.Tensor:
    """``(b, w)``: a per-token output of a training micro-batch (``(b, w)`` padded, ``(1, total)``
    packed) on its rows."""
    if mb.get("context_parallel_width") is not None:
        return context_parallel.gather(values)[:, :mb["tokens"].shape[1]]
    p = mb.get("packed")
    if p is not None and mb.get("context_parallel_packed"):
        whole = context_parallel.gather(values, p.cu_seqlens())[0, :p.real_tokens]
        return unpack(whole, p.layout)[:, :mb["tokens"].shape[1]]
    return values if p is None else unpack(values[0], p.layout)


def teacher_forced_log_probs(model, tokens: torch.Tensor, micro_batch_size: int = 0,
                             temperature: float = 1.0, lengths: Optional[torch.Tensor] = None,
                             pack: bool = False, routing: Optional[Routing] = None,
                             micro_batch_tokens: int = 0, log_prob_chunk: int = 0) -> torch.Tensor:
    """``(b, s-1)``: log-prob of ``tokens[:, t+1]`` given ``tokens[:, :t+1]`` on every rank.

    With ``lengths`` (each row's real tokens; right padding after them), micro-batches group
    rows of similar length and skip the padding; positions past a row's length are 0.
    ``pack=True``: each micro-batch runs as one packed (THD) sequence (see the module doc);
    ``micro_batch_tokens``: packed micro-batches cut by that token budget.  ``log_prob_chunk``:
    log-probs from the logits that many positions at a time (:func:`token_log_probs_from_logits`).
    ``routing`` (MoE): the rows' routing, replayed and / or compared (:class:`Routing`)."""
    V = unwrap(model).megarl_spec.vocab_size

    on_output = PositionWise(lambda out, nxt: token_log_probs_from_logits(out, nxt, V, temperature,
                                                                           log_prob_chunk).float(), shift=True)
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
    :func:`token_log_probs_from_logits`.
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


def vocab_parallel_entropy(logits_shard: torch.Tensor, vocab_size: int, chunk: int = 0) -> torch.Tensor:
    """Entropy ``-sum_v p_v log p_v`` of softmax(logits) from vocab-parallel logits, ``(b, s)``.

    H = log Z - sum_v p_v z_v with Z = sum_v exp(z_v): the two sums are all-reduced over the TP
    group by megatron's ``reduce_from_tensor_model_parallel_region``, whose backward is the
    identity: every TP rank computes the same loss from the reduced sums, so each shard's gradient
    is its own part of that one loss's.  (``torch.distributed.nn.functional.all_reduce`` sums the
    gradients in its backward instead, which scaled an entropy bonus's gradient by tp.)  Padded
    vocabulary rows are excluded.  ``chunk`` (``algo.log_prob_chunk``): that many positions at a
    time (:mod:`megarl.models.chunked_logits`: the same values, bitwise; gradients to fp32 noise).
    """
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import reduce_from_tensor_model_parallel_region

    if chunk:
        from megarl.models.chunked_logits import chunked_entropy

        return chunked_entropy(logits_shard, vocab_size, chunk)

    z = mask_padded_vocab(logits_shard, vocab_size).float()
    group = ps.get_tensor_model_parallel_group()
    tp = ps.get_tensor_model_parallel_world_size()
    m = z.detach().max(dim=-1, keepdim=True).values
    if tp > 1:
        dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)
    finite = torch.isfinite(z)
    e = torch.where(finite, torch.exp(z - m), torch.zeros((), dtype=z.dtype, device=z.device))
    s = e.sum(-1)
    ez = (e * torch.where(finite, z - m, torch.zeros((), dtype=z.dtype, device=z.device))).sum(-1)
    if tp > 1:
        s = reduce_from_tensor_model_parallel_region(s)
        ez = reduce_from_tensor_model_parallel_region(ez)
    return torch.log(s) - ez / s
