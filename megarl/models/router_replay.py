"""Trainer-side rollout routing replay (R3, Ma et al. 2025, arXiv 2510.11370).

The rollout engine and the trainer route tokens independently, and small numeric differences
flip the top-k choice of some routers; the trainer then computes the probability of a token under
a different sub-network than the one that sampled it.  Replay makes every training-side forward
of the policy dispatch each token to the experts the rollout recorded for it
(:class:`megarl.experience.schema.RoutedExperts`), through megatron-core's router replay
(``moe_enable_routing_replay``; ``RouterReplayAction.REPLAY_FORWARD``).

The router still computes its logits and the gate probabilities of the replayed experts
(``scores.gather(replayed ids)``), so the router weights keep receiving gradient; only the
discrete top-k choice is taken from the record.

Token order: megatron's router sees ``[seq, batch]`` hidden states flattened to ``seq * batch``
tokens (a packed micro-batch: its ``total`` tokens in packed order); :class:`RouterTargets`
lays a micro-batch's routing out in that order.

:class:`RoutingStats` compares, on every MoE layer of this stage, the experts the router
dispatched to and the experts it would have chosen by itself with the record: the first must
equal the record exactly under replay, the second is the rollout / trainer routing mismatch
that replay removes.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Dict, Iterator, List, Optional, Tuple

import torch
import torch.distributed as dist

from megarl.experience.packing import PackedLayout, pack
from megarl.models.weights import unwrap


class RoutingReplayError(RuntimeError):
    pass


@dataclass(frozen=True)
class RowRouting:
    """Per-row routing on the actor's right-aligned token grid.

    ``experts`` ``(b, s, layers, top_k)`` int, ``valid`` ``(b, s)`` bool (the positions the
    rollout recorded; every other position holds experts ``0 .. k-1``), ``moe_layers`` the
    decoder-layer index of each column."""

    experts: torch.Tensor
    valid: torch.Tensor
    moe_layers: Tuple[int, ...]

    def rows(self, idx, width: Optional[int] = None) -> "RowRouting":
        e, v = self.experts[idx], self.valid[idx]
        if width is not None:
            e, v = e[:, :width], v[:, :width]
            if width > e.shape[1]:  # right padding past the grid: filler experts, never valid
                extra = width - e.shape[1]
                fill = torch.arange(e.shape[-1], dtype=e.dtype, device=e.device).expand(e.shape[0], extra, *e.shape[2:])
                e = torch.cat([e, fill], 1)
                v = torch.cat([v, v.new_zeros(v.shape[0], extra)], 1)
        return RowRouting(e, v, self.moe_layers)


@dataclass(frozen=True)
class RouterTargets:
    """One micro-batch's routing in the router's token order: ``experts`` ``(T, layers, k)``
    (int64), ``valid`` ``(T,)``."""

    experts: torch.Tensor
    valid: torch.Tensor
    moe_layers: Tuple[int, ...]

    @classmethod
    def for_padded(cls, rows: RowRouting) -> "RouterTargets":
        """A padded ``(b, s)`` micro-batch: the router sees token ``(b_i, s_i)`` at ``s_i * b + b_i``."""
        b, s = rows.valid.shape
        e = rows.experts.transpose(0, 1).reshape(s * b, *rows.experts.shape[2:])
        return cls(e.long(), rows.valid.transpose(0, 1).reshape(s * b).bool(), rows.moe_layers)

    def widened(self, b: int, extra: int) -> "RouterTargets":
        """The targets of the same padded ``(b, s)`` micro-batch right-padded by ``extra`` columns:
        in the router's order those come last (``s_i * b + b_i``), with the filler experts
        ``0 .. k-1`` and never valid."""
        k = self.experts.shape[-1]
        fill = torch.arange(k, dtype=self.experts.dtype, device=self.experts.device).expand(
            extra * b, *self.experts.shape[1:-1], k)
        return RouterTargets(torch.cat([self.experts, fill]), torch.cat([self.valid, self.valid.new_zeros(extra * b)]),
                             self.moe_layers)

    @classmethod
    def for_packed(cls, rows: RowRouting, layout: PackedLayout) -> "RouterTargets":
        return cls(pack(rows.experts, layout).long(), pack(rows.valid, layout).bool(), rows.moe_layers)


@dataclass(frozen=True)
class RecordRouting:
    """The routing of some rows of an experience record, for a forward pass over them.

    ``experts`` ``(b, P + R, layers, k)`` as sealed (:class:`~megarl.experience.schema.RoutedExperts`);
    ``replay``: dispatch to them; ``stats``: compare with them; ``real_rows`` ``(b,)`` bool: rows
    that count in ``stats`` (a data-parallel shard's padding rows repeat a real row)."""

    experts: torch.Tensor
    moe_layers: Tuple[int, ...]
    replay: bool
    stats: Optional[RoutingStats] = None
    real_rows: Optional[torch.Tensor] = None


def record_to_rows(experts: torch.Tensor, attention_mask: torch.Tensor, prompt_len: int,
                   moe_layers: Tuple[int, ...], length: Optional[int] = None,
                   real_rows: Optional[torch.Tensor] = None) -> RowRouting:
    """The record's routing ``(b, P + R, layers, k)`` (aligned with ``attention_mask``: left-padded
    prompt, right-padded response) moved to the actor's right-aligned rows
    (:func:`megarl.models.forward.right_align`), ``length`` columns (default: the longest row).

    Valid positions are every real token but each row's last (the rollout never routes the
    last token) of the ``real_rows``; the rest hold experts ``0 .. k-1``, a valid top-k for a
    replaying forward."""
    B, S = attention_mask.shape
    P = prompt_len
    plen = attention_mask[:, :P].sum(1).long()
    total = attention_mask.sum(1).long()
    L = int(total.max()) if length is None else length
    pos = torch.arange(L)[None, :]
    col = torch.where(pos < plen[:, None], P - plen[:, None] + pos, P + pos - plen[:, None]).clamp(0, S - 1)
    k = experts.shape[-1]
    idx = col.reshape(B, L, 1, 1).expand(B, L, experts.shape[2], k)
    out = experts.gather(1, idx.to(experts.device))
    valid = pos < (total[:, None] - 1)
    if real_rows is not None:
        valid = valid & real_rows.bool().cpu()[:, None]
    fill = torch.arange(k, dtype=out.dtype).expand_as(out)
    out = torch.where(valid[:, :, None, None], out, fill)
    return RowRouting(out, valid, tuple(moe_layers))


def local_routers(model) -> List[Tuple[int, torch.nn.Module]]:
    """``(decoder-layer index, TopKRouter)`` of every MoE layer on this pipeline stage."""
    inner = unwrap(model)
    out = []
    for layer in inner.decoder.layers:
        router = getattr(getattr(layer, "mlp", None), "router", None)
        if router is not None:
            out.append((int(layer.layer_number) - 1, router))
    return out


@dataclass
class RoutingStats:
    """Routing comparisons with the record, accumulated over the micro-batches of a forward pass
    (this rank's rows; :meth:`reduce` sums over stages and data-parallel ranks).

    Per layer column j: ``natural[j]`` tokens whose router's own top-k set differs from the
    record, ``dispatched[j]`` tokens whose dispatched set differs (0 under replay);
    ``valid`` recorded tokens; per token, whether the own top-k differs in at least one layer."""

    moe_layers: Tuple[int, ...]
    natural: torch.Tensor = None
    dispatched: torch.Tensor = None
    valid: int = 0
    token_flags: List[torch.Tensor] = field(default_factory=list)
    #: the comparisons were of this TP rank's share of the sequence (summed over TP in reduce)
    sequence_parallel: bool = False

    def __post_init__(self):
        n = len(self.moe_layers)
        self.natural = torch.zeros(n, dtype=torch.long)
        self.dispatched = torch.zeros(n, dtype=torch.long)

    def reduce(self, dp_group=None) -> Dict[str, float]:
        """Collective over the pipeline group and ``dp_group``: the metrics (shares of recorded
        tokens) ``mismatch_tokens`` (own top-k differs in >= 1 layer), ``mismatch_layer/<i>``,
        ``mismatch_router`` (mean over layers), ``replay_differs`` (the share of (token, layer)
        pairs whose dispatched set differs from the record: 0 when replaying), ``tokens``."""
        flags = torch.cat(self.token_flags) if self.token_flags else torch.zeros(0, dtype=torch.bool)
        flags = flags.long()
        nat, disp = self.natural.clone(), self.dispatched.clone()
        if dist.is_initialized():
            from megatron.core import parallel_state as ps

            if ps.get_pipeline_model_parallel_world_size() > 1:  # each stage saw its own layers
                pp_group = ps.get_pipeline_model_parallel_group()
                dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=pp_group)
                dist.all_reduce(nat, group=pp_group)
                dist.all_reduce(disp, group=pp_group)
        totals = torch.cat([torch.tensor([self.valid, int(flags.sum())]), nat, disp])
        if self.sequence_parallel:  # each TP rank compared its own part of the sequence
            from megatron.core import parallel_state as ps

            dist.all_reduce(totals, group=ps.get_tensor_model_parallel_group())
        if dp_group is not None and dist.get_world_size(dp_group) > 1:
            dist.all_reduce(totals, group=dp_group)
        n = max(int(totals[0]), 1)
        L = len(self.moe_layers)
        nat, disp = totals[2:2 + L], totals[2 + L:]
        m = {"tokens": float(totals[0]), "mismatch_tokens": float(totals[1]) / n,
             "mismatch_router": float(nat.sum()) / (n * L), "replay_differs": float(disp.sum()) / (n * L)}
        for j, layer in enumerate(self.moe_layers):
            m[f"mismatch_layer/{layer}"] = float(nat[j]) / n
        return m


def _routing_map(ids: torch.Tensor, num_experts: int) -> torch.Tensor:
    return torch.zeros(ids.shape[0], num_experts, dtype=torch.bool, device=ids.device).scatter_(1, ids, True)


@contextmanager
def routed(model, targets: Optional[RouterTargets], replay: bool,
           stats: Optional[RoutingStats] = None) -> Iterator[None]:
    """Run one micro-batch's forward with its routing: ``replay`` dispatches every token of every
    MoE layer on this stage to ``targets``' experts; ``stats`` accumulates the comparisons.
    Nothing happens when ``targets`` is None.  The replay state is cleared on exit (the backward
    of an un-recomputed forward needs no routing) -- unless the model recomputes its routers in
    the backward (``parallel.recompute``: full, or selective with "moe"): then each router keeps
    this micro-batch's experts queued and replays them in the recompute (megatron's
    ``REPLAY_BACKWARD``, first in first out, the order the schedules run the backwards in), and
    the caller clears them after the step (:func:`clear_replay`)."""
    if targets is None:
        yield
        return
    from megatron.core.transformer.moe.router_replay import RouterReplayAction

    routers = local_routers(model)
    keep = replay and model.training and recomputes_routers(unwrap(model).config)
    cols = {layer: j for j, layer in enumerate(targets.moe_layers)}
    missing = [layer for layer, _ in routers if layer not in cols]
    if missing:
        raise RoutingReplayError(f"the routing record has no columns for MoE layers {missing} "
                                 f"(it has layers {list(targets.moe_layers)})")
    shard = _sequence_shard(unwrap(model).config, targets.valid.shape[0])
    valid = targets.valid[shard]
    # the comparisons stay on the routers' device until the micro-batch ends: one transfer per
    # micro-batch, not a host sync per layer
    dev = routers[0][1].weight.device if routers else valid.device
    acc = None
    if stats is not None:
        n = len(targets.moe_layers)
        acc = {"flags": torch.zeros(valid.shape[0], dtype=torch.bool, device=dev),
               "natural": torch.zeros(n, dtype=torch.long, device=dev),
               "dispatched": torch.zeros(n, dtype=torch.long, device=dev)}
    handles = []
    try:
        for layer, router in routers:
            j = cols[layer]
            ids = targets.experts[shard, j].to(router.weight.device)
            if ids.shape[-1] != router.topk:
                raise RoutingReplayError(f"layer {layer}: the record has top-{ids.shape[-1]} routing, "
                                         f"the router routes to {router.topk} experts")
            if replay:
                rr = router.router_replay
                if rr is None:
                    raise RoutingReplayError("routing replay needs a model built with moe_enable_routing_replay")
                if keep:
                    rr.set_target_indices(ids)  # also queued for the recompute in the backward
                else:
                    rr.target_topk_idx = ids
                rr.router_replay_action = RouterReplayAction.REPLAY_FORWARD
            if acc is not None:
                handles.append(router.register_forward_hook(_observer(j, ids, valid.to(ids.device), replay, acc)))
        yield
    finally:
        for _layer, router in routers:
            rr = router.router_replay
            if rr is None:
                continue
            if keep:
                rr.target_topk_idx = None
                rr.router_replay_action = RouterReplayAction.REPLAY_BACKWARD
            else:
                rr.clear_indices()
                rr.clear_router_replay_action()
        for h in handles:
            h.remove()
    if stats is not None:
        stats.sequence_parallel = shard != slice(None)
        stats.valid += int(valid.sum())
        stats.token_flags.append(acc["flags"].cpu())
        stats.natural += acc["natural"].cpu()
        stats.dispatched += acc["dispatched"].cpu()


def recomputes_routers(config) -> bool:
    """Whether a training forward of a model with this config is re-run in its backward through
    the MoE routers (full recompute, or the selective recompute of the MoE layer)."""
    g = config.recompute_granularity
    return g == "full" or (g == "selective" and "moe" in (config.recompute_modules or ()))


def clear_replay(model) -> None:
    """Drop every router's replay state: targets, the experts queued for the backward's
    recompute, the action."""
    for _layer, router in local_routers(model):
        if router.router_replay is not None:
            router.router_replay.clear_indices()
            router.router_replay.clear_router_replay_action()


def _sequence_shard(config, n: int) -> slice:
    """The tokens this rank's routers see of a micro-batch's ``n`` (all of them; under sequence
    parallelism the TP rank's contiguous 1/tp: the router sees token ``(b_i, s_i)`` at
    ``s_i * b + b_i`` and each TP rank holds a range of positions ``s``)."""
    if not config.sequence_parallel:
        return slice(None)
    from megatron.core import parallel_state as ps

    tp, r = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
    if tp == 1:
        return slice(None)
    if n % tp:
        raise RoutingReplayError(f"sequence parallelism: {n} routed tokens do not split over {tp} TP ranks")
    k = n // tp
    return slice(r * k, (r + 1) * k)


def _observer(j: int, ids: torch.Tensor, valid: torch.Tensor, replay: bool, acc: Dict[str, torch.Tensor]):
    def hook(module, args, output):
        _probs, routing_map = output
        target = _routing_map(ids, routing_map.shape[1])
        acc["dispatched"][j] += ((routing_map != target).any(-1) & valid).sum()
        if replay:
            # the router's own choice on the same input: its routing with the replay action off
            # (under no_grad neither the aux losses nor the expert-bias counters are touched)
            rr = module.router_replay
            action = rr.router_replay_action
            rr.router_replay_action = None
            try:
                with torch.no_grad():
                    _, own = module.routing(module.gating(args[0].detach()))
            finally:
                rr.router_replay_action = action
        else:
            own = routing_map
        mism = (own != target).any(-1) & valid
        acc["natural"][j] += mism.sum()
        acc["flags"].logical_or_(mism)

    return hook
