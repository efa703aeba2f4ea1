"""One micro-batch layer: sealed rows -> this rank's micro-batches -> megatron's schedule.

Both kinds of pass come through here: the forward-only passes (log-probs, values:
:mod:`megarl.models.forward`) and the update's optimizer step (:func:`megarl.models.optim.train_step`).
What a micro-batch must be for megatron is decided once:

* padded ``(b, w)`` rows or one packed (THD) sequence of them (:class:`PackedMicroBatch`);
* sequence parallelism: lengths a multiple of tp (:func:`sp_aligned`);
* context parallelism: this rank's positions, the output functions :class:`PositionWise`;
* MoE at EP > 1: as many micro-batches of equal length over the dispatch group (:func:`ep_common_widths`,
  :func:`ep_common_packs`, :func:`common_pack_lengths`); routing-replay targets widened alike;
* virtual pipeline stages: fillers up to a multiple of pp (:func:`run_schedule`);
* the model call (:func:`call_model`) and the schedule call (:func:`run_schedule`), one each.

The update's micro-batches of a mini-batch are cut here too (:func:`rank_rows` and :func:`padded_micro_batches`,
:func:`token_micro_batches`) and made what the layout needs (:func:`update_inputs`); their outputs
go back to rows by :func:`next_token_terms` and :func:`token_terms`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, Union

import torch
import torch.distributed as dist

from megarl.experience.packing import PackedLayout, pack, pack_layout, unpack
from megarl.experience.token_budget import plan_token_micro_batches
from megarl.models import context_parallel
from megarl.models.router_replay import RouterTargets, RoutingStats, RowRouting, routed
from megarl.models.weights import as_chunks, unwrap


def position_ids_for(tokens: torch.Tensor) -> torch.Tensor:
    return torch.arange(tokens.shape[1], device=tokens.device).unsqueeze(0).expand_as(tokens)


def round_up(width: int, multiple: int) -> int:
    return -(-width // multiple) * multiple


def pad_columns(tokens: torch.Tensor, width: int) -> torch.Tensor:
    """``tokens`` right-padded with id 0 to ``width`` columns (unchanged when it has them)."""
    if tokens.shape[1] >= width:
        return tokens
    return torch.cat([tokens, tokens.new_zeros((tokens.shape[0], width - tokens.shape[1]))], 1)


def sequence_multiple(model) -> int:
    """What a forward's sequence length must be a multiple of: tp under sequence parallelism
    (megatron splits the sequence into tp equal chunks), else 1."""
    return unwrap(model).megarl_opts.sequence_multiple


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


def tokens_of(mb: MicroBatch) -> torch.Tensor:
    return mb.tokens if isinstance(mb, PackedMicroBatch) else mb


def sp_aligned(mb: MicroBatch, tg: Optional[RouterTargets], m: int):
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


def own_width(out: torch.Tensor, tokens: torch.Tensor, width: Optional[int]):
    """A micro-batch's output and tokens at its own width (``width`` None: as they are)."""
    if width is None or width == tokens.shape[1]:
        return out, tokens
    return out[:, :width], tokens[:, :width]


def moe_dispatch_group(model):
    """The group megatron's allgather token dispatcher gathers over (expert TP x EP) when the
    model has routed experts spread over EP > 1 ranks; else None."""
    from megatron.core import parallel_state as ps

    spec = getattr(unwrap(model), "megarl_spec", None)
    if getattr(spec, "moe", None) is None or ps.get_expert_model_parallel_world_size() == 1:
        return None
    return ps.get_expert_tensor_and_model_parallel_group()


def ep_common_widths(model, groups: List[torch.Tensor], widths: List[int]) -> List[int]:
    """The width each micro-batch runs at: its own, except for an MoE model at EP > 1.

    There the allgather token dispatcher (megatron-core ``MoEAllGatherTokenDispatcher``, which
    ``cpu_compat`` selects on CPU) gathers every micro-batch's tokens over the expert TP x EP group
    with one equal-sized all-gather, so the ranks of that group, which hold different rows (they
    are data-parallel ranks for everything but the experts), must run the same number of
    micro-batches of the same shape: each is widened to the widest among them.  (The alltoall
    dispatcher built on CUDA needs only the same number.)  The extra columns are right padding,
    which causal attention never lets reach a row's real positions.  Collective over that group."""
    group = moe_dispatch_group(model)
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


def common_pack_lengths(model, lengths: List[int]) -> List[int]:
    """The length each packed micro-batch runs at: its own, except for an MoE model at EP > 1,
    where megatron's allgather token dispatcher (``cpu_compat`` selects it on CPU) gathers equal
    token counts over the expert TP x EP group, whose ranks hold different rows: there the ranks
    must run as many micro-batches, and each is lengthened (by filler tokens) to the longest of its
    index over the group.  (The alltoall dispatcher built on CUDA needs only as many; the filler is
    a few tokens.)  Collective over that group."""
    group = moe_dispatch_group(model)
    if group is None:
        return list(lengths)
    every: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(every, list(lengths), group=group)
    counts = [len(e) for e in every]
    if len(set(counts)) != 1:
        raise ValueError("MoE at expert parallel size > 1: the ranks of an expert-parallel group must run as many "
                         f"packed micro-batches (the token dispatcher gathers each); got {counts}")
    return [max(column) for column in zip(*every, strict=True)]


def ep_common_packs(model, items: List[PackedMicroBatch], tg: Optional[List[RouterTargets]]):
    """The packed micro-batches an MoE model at EP > 1 runs (:func:`common_pack_lengths`): as many
    on every rank of the dispatch group (a rank with fewer repeats its first, whose results are
    dropped), each lengthened by filler tokens to the longest of its index.  Collective over that
    group; as given otherwise."""
    group = moe_dispatch_group(model)
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


def next_token_terms(output: torch.Tensor, mb, fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """``(b, w - 1)``: ``fn(logits, next tokens)`` per position of a training micro-batch's rows
    (position t of a row: the output at its token t against its token t + 1), whether the model ran
    them padded (``output`` ``(b, w, ...)``) or packed (``mb["packed"]``; ``output`` ``(1, total,
    ...)`` over the real packed tokens: computed there, then unpacked to the rows).  ``fn`` maps
    ``(n, t, ...)`` outputs and ``(n, t)`` tokens to ``(n, t)`` (or ``(n, t, k)``: k terms each)."""
    p = mb.get("packed")
    run = mb.get("context_parallel_width")
    if run is not None:  # this CP rank's positions of the rows padded to run (module context_parallel)
        return PositionWise(fn, shift=True).on_context_parallel_share(output, pad_columns(mb["tokens"], run),
                                                                      mb["tokens"].shape[1])
    if p is not None and mb.get("context_parallel_packed"):  # this CP rank's positions of each sequence
        vals = PositionWise(fn, shift=True).on_context_parallel_share(output, p.tokens, p.real_tokens, p.cu_seqlens())
        vals = torch.cat([vals[0], vals.new_zeros((1,) + vals.shape[2:])])
        return unpack(vals, p.layout)[:, :mb["tokens"].shape[1] - 1]
    if p is None:
        return fn(output[:, :-1], mb["tokens"][:, 1:])
    vals = fn(output[:, :-1], p.tokens[:, 1:p.real_tokens])[0]
    # a row's last token predicts the next row's first: that entry lands past the row's end
    return unpack(torch.cat([vals, vals.new_zeros((1,) + vals.shape[1:])]), p.layout)[:, :-1]


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


@dataclass(frozen=True)
class ModelInput:
    """What the model runs for one micro-batch: ``tokens`` (padded rows or a pack) at the length the
    layout needs, its routing ``targets`` (MoE replay or observation; None: none) and ``width``, the
    length its output is cut back to for the loss or the result (None: as it ran)."""

    tokens: MicroBatch
    targets: Optional[RouterTargets] = None
    width: Optional[int] = None


def call_model(model, mb: MicroBatch, targets: Optional[RouterTargets] = None, replay: bool = False,
               stats: Optional[RoutingStats] = None):
    """The one forward call of a micro-batch, training or not: under context parallelism this rank's
    positions of the rows or of each packed sequence (the whole rows otherwise), with its routing
    replayed (``replay``) and / or compared (``stats``) when ``targets`` is given."""
    with routed(model, targets, replay, stats):
        if isinstance(mb, PackedMicroBatch):
            cu = mb.cu_seqlens()
            return model(context_parallel.split(mb.tokens, cu_seqlens=cu),
                         context_parallel.split(mb.position_ids, cu_seqlens=cu), None,
                         packed_seq_params=mb.packed_seq_params())
        return model(context_parallel.split(mb), context_parallel.split(position_ids_for(mb)), None)


def run_schedule(chunks: List[Any], items: List[Any], step: Callable, *, forward_only: bool,
                 shapes: Sequence[Sequence[int]], filler: Callable[[Any], Any] = lambda item: item,
                 variable: bool = False):
    """megatron's forward-backward schedule over ``items`` (one per micro-batch), ``step(data_iterator,
    model) -> (output, loss_func)`` drawing them in order; returns the schedule's per-micro-batch
    reports.  ``shapes``: each item's ``(b, s)`` as the model runs it (whole sequences: megatron
    divides by cp itself).  Virtual pipeline stages (``chunks`` > 1): the interleaved schedule runs
    micro-batches in groups of pp, so ``filler(last item)`` repeats up to a multiple of pp (its report
    is the caller's to drop).  Micro-batches of different shapes: the stages tell each other every
    activation's shape (megatron's ``variable_seq_lengths``, for this call only; ``variable``: always)."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    config = unwrap(chunks[0]).config
    pp = config.pipeline_model_parallel_size
    shapes = [tuple(s) for s in shapes]
    if len(chunks) > 1 and len(items) % pp:
        n = pp - len(items) % pp
        items = items + [filler(items[-1])] * n
        shapes = shapes + [shapes[-1]] * n
    # every model chunk draws the micro-batches in order from an iterator of its own
    it = iter(items) if len(chunks) == 1 else [iter(items) for _ in chunks]
    was = config.variable_seq_lengths
    config.variable_seq_lengths = was or variable or len(set(shapes)) > 1
    try:
        return get_forward_backward_func()(
            forward_step_func=step, data_iterator=it, model=chunks, num_microbatches=len(items),
            seq_length=max(s[1] for s in shapes), micro_batch_size=max(s[0] for s in shapes),
            forward_only=forward_only)
    finally:
        config.variable_seq_lengths = was


def rank_rows(columns: Dict[str, torch.Tensor], rows: torch.Tensor, is_pad: torch.Tensor) -> Dict[str, torch.Tensor]:
    """This rank's rows of a mini-batch (``rows``; ``is_pad``: repeated rows that even out the DP
    ranks, their loss mask 0), copied once for every role that steps on them."""
    local = {name: t[rows].clone() for name, t in columns.items()}
    local["loss_mask"][is_pad] = 0
    return local


def padded_micro_batches(local: Dict[str, torch.Tensor], size: int) -> List[Dict[str, torch.Tensor]]:
    """:func:`rank_rows`' rows cut into micro-batches of ``size`` rows (0: all at once)."""
    n = local["tokens"].shape[0]
    step = size or n
    return [{name: t[i:i + step] for name, t in local.items()} for i in range(0, n, step)]


def token_micro_batches(columns: Dict[str, torch.Tensor], rows: torch.Tensor, budget: int, rank: int,
                        dp: int) -> List[Dict[str, torch.Tensor]]:
    """This rank's packed micro-batches of the mini-batch ``rows`` under a token budget
    (``algo.micro_batch_tokens``, :func:`~megarl.experience.token_budget.plan_token_micro_batches`):
    each holds its rows' columns cut to its longest row and, as ``packed``, the rows' real tokens
    back to back.  A filler micro-batch repeats a row with its loss mask 0."""
    lengths = (columns["prompt_lens"] + columns["response_lens"])[rows]
    plan = plan_token_micro_batches(lengths.tolist(), budget, dp)[rank]
    out = []
    for bin_rows, pad in zip(plan.bins, plan.pad, strict=True):
        idx = rows[torch.tensor(bin_rows, dtype=torch.long)]
        mb = {name: t[idx].clone() for name, t in columns.items()}
        own = mb["prompt_lens"] + mb["response_lens"]
        mb["tokens"] = mb["tokens"][:, :int(own.max())]
        if pad:
            mb["loss_mask"].zero_()
        mb["packed"] = PackedMicroBatch.from_rows(mb["tokens"], own)
        out.append(mb)
    return out


def update_inputs(model, micro_batches: Sequence[Dict[str, Any]], replay_layers=None) -> List[tuple]:
    """The update's micro-batches (:func:`padded_micro_batches` or :func:`token_micro_batches`) as
    ``(micro-batch, ModelInput)`` pairs on the model's device: all padded to one ``(b, s)``, or all
    packed; lengthened for sequence parallelism, for MoE at EP > 1 (collective over the dispatch
    group) and context parallelism; ``replay_layers``: their routing-replay targets.  Under context
    parallelism the micro-batch also records what its loss needs to gather this rank's positions
    back to the rows (``context_parallel_width``, or ``packed`` as it ran and ``context_parallel_packed``)."""
    if not micro_batches:
        raise ValueError("train_step needs at least one micro-batch")
    chunks = as_chunks(model)  # virtual pipeline stages
    if len(chunks) > 1 and replay_layers is not None:
        raise ValueError("routing replay with virtual pipeline stages is not supported yet")
    packed = ["packed" in mb for mb in micro_batches]
    if any(packed) and not all(packed):
        raise ValueError(f"micro-batches {[i for i, p in enumerate(packed) if not p]} are padded and the others "
                         "packed; a step runs one kind")
    multiple = sequence_multiple(model)
    cp = context_parallel.size()
    if cp > 1:
        why = context_parallel.check_supported(routing=replay_layers is not None)
        if why is not None:
            raise ValueError(f"parallel.cp={cp}: {why}")
        if packed[0]:  # each sequence is split into 2 x cp chunks: every row padded at its end
            micro_batches = [dict(mb, packed=mb["packed"].rows_padded_to(2 * cp), context_parallel_packed=True)
                             for mb in micro_batches]
    if packed[0]:
        # filler tokens: sequence parallelism, up to a multiple of tp; MoE at EP > 1 (on CPU), up to
        # the longest of the EP ranks' same micro-batch; context parallelism, 2 x cp (x tp)
        runs = [round_up(n, multiple) for n in
                common_pack_lengths(model, [mb["packed"].tokens.shape[1] for mb in micro_batches])]
    else:
        seq, mbs = micro_batches[0]["tokens"].shape[1], micro_batches[0]["tokens"].shape[0]
        for i, mb in enumerate(micro_batches):
            if tuple(mb["tokens"].shape) != (mbs, seq):
                raise ValueError(f"micro-batch {i} has tokens of shape {list(mb['tokens'].shape)}; "
                                 f"all micro-batches of a step must be [{mbs}, {seq}]")
        # sequence parallelism: the model runs on whole tp-sized chunks (right padding, which a
        # causal model never attends to); the loss sees the micro-batch's own width
        runs = [round_up(seq, multiple)] * len(micro_batches)
    dev = next(chunks[0].parameters()).device

    def model_input(mb, run) -> ModelInput:
        p, rows, targets = mb.get("packed"), None, None
        if replay_layers is not None:
            rows = RowRouting(mb["routing"], mb["routing_valid"], replay_layers).rows(
                slice(None), p.layout.seq_len if p is not None else run)
        if p is None:
            if rows is not None:
                targets = RouterTargets.for_padded(rows)
            if cp > 1:  # this rank's positions; the loss gathers its terms back to the rows (next_token_terms)
                mb["context_parallel_width"] = run
            return ModelInput(pad_columns(mb["tokens"], run), targets, None if cp > 1 else mb["tokens"].shape[1])
        if rows is not None:
            targets = RouterTargets.for_packed(rows, p.layout)
            if run > p.real_tokens:  # the filler sequence: filler experts, never valid
                targets = targets.widened(1, run - p.real_tokens)
        p = p.padded_to(run)
        if cp > 1:  # this rank's positions of each sequence; the loss gathers its terms (next_token_terms)
            mb["packed"] = p
        return ModelInput(p, targets, None if cp > 1 else p.real_tokens)

    items = []
    for mb, run in zip(micro_batches, runs, strict=True):
        mb = {k: (v.to(dev) if torch.is_tensor(v) or k == "packed" else v) for k, v in mb.items()}
        items.append((mb, model_input(mb, run)))
    return items
