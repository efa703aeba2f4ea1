"""megatron DDP + megatron optimizer, and one optimizer step under a fixed loss contract.

The loss contract (docs/design.md, contract 6): a step's loss is a *sum* over the global batch of
per-token (or per-sequence) terms divided by a *global* normaliser computed before the step
(token or sequence count over all micro-batches and DP ranks).  Each micro-batch's loss
function returns its share ``sum(terms in micro-batch) / global_normaliser``; gradients are
then summed over micro-batches and DP ranks and nothing else rescales them.  To get that from
megatron we set ``calculate_per_token_loss=True`` (DDP sums instead of averaging, the schedule
does not divide by the micro-batch count) and finalize gradients without megatron's
``1/num_tokens`` scaling.  The result does not depend on micro-batch size, DP size, TP or PP.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch

from megarl.config.schema import OptimSettings
from megarl.runtime import cpu_compat


def _finalize_without_token_scaling(model_chunks, num_tokens=None, **kwargs):
    """megatron's ``finalize_model_grads`` (DP all-reduce, tied-embedding/layernorm sync) with
    the per-token rescaling disabled: our loss already divides by the global normaliser."""
    from megatron.core.distributed import finalize_model_grads

    return finalize_model_grads(model_chunks, num_tokens=None, **kwargs)


def wrap_for_training(model, cfg: OptimSettings, *, sgd_momentum: float = 0.0,
                      use_distributed_optimizer: Optional[bool] = None, overlap_grad_reduce: bool = False):
    """Wrap a freshly built megatron model in megatron DDP and build its optimizer.

    ``cfg`` is the config's optimizer section (``actor.optim`` / ``critic.optim``), used as it
    is: ``optimizer`` ("adam": AdamW, decoupled weight decay; or "sgd"), ``lr``, ``min_lr``,
    ``weight_decay``, ``adam_beta1/2``, ``adam_eps`` and ``clip_grad`` go to megatron's optimizer;
    the schedule fields (``lr_warmup_steps``, ``lr_decay_style``) are
    :func:`megarl.roles.common.lr_scheduler`'s.  Two settings are not config keys (a new key
    would change every run's config hash): ``sgd_momentum`` (0: plain SGD; megatron's own
    default is 0.9) and ``use_distributed_optimizer`` (None: on CUDA yes, on CPU no).
    ``overlap_grad_reduce`` (``parallel.overlap_grad_reduce``): megatron DDP starts each gradient
    bucket's data-parallel reduction as soon as the last micro-batch's backward has filled it,
    overlapping it with the rest of the backward; ``finalize_model_grads`` waits for them.  The
    same sums in the same buckets: the gradients do not change.

    ``model`` may be this rank's list of model chunks (virtual pipeline stages,
    :func:`megarl.models.builder.build_model_chunks`): each chunk gets its own DDP (bucketing on
    the first only, as megatron does), one optimizer spans them, and ``ddp_model`` is the list.

    Returns ``(ddp_model, optimizer)``.
    """
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    if cfg.optimizer not in ("adam", "sgd"):
        raise ValueError(f"optim.optimizer={cfg.optimizer!r}: expected 'adam' or 'sgd'")
    use_dist_opt = cpu_compat.use_distributed_optimizer(use_distributed_optimizer)
    from megarl.models.weights import as_chunks

    chunks = as_chunks(model)
    tconf = chunks[0].config
    if any(c.config is not tconf for c in chunks):
        raise ValueError("wrap_for_training: the model chunks must share one TransformerConfig (build_model_chunks)")
    tconf.calculate_per_token_loss = True
    tconf.finalize_model_grads_func = _finalize_without_token_scaling
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True,
        overlap_grad_reduce=overlap_grad_reduce,
        use_distributed_optimizer=use_dist_opt,
        average_in_collective=False,  # gloo has no ReduceOp.AVG; we sum by contract anyway
        # megatron's check raises on the rank whose *local* gradients are non-finite, before the
        # DP all-reduce, and leaves the other ranks blocked in it; instead the NaN is summed into
        # every rank's gradients, the grad norm is non-finite on all of them, and the trainer
        # rolls the step back everywhere (megarl/control/learning.py, update failures)
        check_for_nan_in_grad=False,
    )
    spec, opts = chunks[0].megarl_spec, chunks[0].megarl_opts
    ddps = [DistributedDataParallel(config=tconf, ddp_config=ddp_config, module=c, disable_bucketing=i > 0)
            for i, c in enumerate(chunks)]
    for ddp in ddps:
        ddp.megarl_spec, ddp.megarl_opts = spec, opts
    ocfg = OptimizerConfig(
        optimizer=cfg.optimizer,
        lr=cfg.lr,
        min_lr=cfg.min_lr,
        weight_decay=cfg.weight_decay,
        adam_beta1=cfg.adam_beta1,
        adam_beta2=cfg.adam_beta2,
        adam_eps=cfg.adam_eps,
        sgd_momentum=sgd_momentum,
        clip_grad=cfg.clip_grad,
        bf16=tconf.bf16,
        fp16=tconf.fp16,
        params_dtype=tconf.params_dtype,
        use_distributed_optimizer=use_dist_opt,
    )
    optimizer = get_megatron_optimizer(ocfg, ddps)
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        if getattr(opt, "init_state_fn", "absent") is None:
            # megatron gives SGD no state initialiser, and loading a checkpoint calls it
            # (sharded_state_dict(is_loading=True)): without one no SGD run could resume
            opt.init_state_fn = _init_sgd_state
    tconf.grad_scale_func = optimizer.scale_loss if (tconf.fp16 or tconf.bf16) else None
    if len(ddps) == 1:
        tconf.no_sync_func = ddps[0].no_sync
        return ddps[0], optimizer
    tconf.no_sync_func = [d.no_sync for d in ddps]
    return ddps, optimizer


def _init_sgd_state(opt, config=None) -> None:
    """The state a torch SGD holds after a step, before one (what megatron's Adam initialiser does
    for Adam): a zero momentum buffer per parameter when it keeps momentum, nothing otherwise."""
    for group in opt.param_groups:
        if group.get("momentum", 0.0):
            for p in group["params"]:
                if "momentum_buffer" not in opt.state[p]:
                    opt.state[p]["momentum_buffer"] = torch.zeros_like(p.data)


def grad_scaler_states(optimizer) -> List[Optional[dict]]:
    """The loss scaler state of each of megatron's optimizers (a ``ChainedOptimizer`` holds one
    per parameter set and has no ``grad_scaler`` of its own; None where one has no scaler: fp32,
    bf16 without a loss scale).  fp16's ``DynamicGradScaler``: ``scale`` (a float), and the
    ``growth_tracker`` / ``hysteresis_tracker`` counting the successful and overflowing steps
    towards the next change of scale."""
    out: List[Optional[dict]] = []
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        scaler = getattr(opt, "grad_scaler", None)
        if scaler is None:
            out.append(None)
            continue
        sd = scaler.state_dict()
        out.append({"kind": type(scaler).__name__,
                    **{k: (float(v.item()) if torch.is_tensor(v) else v) for k, v in sd.items()}})
    return out


def load_grad_scaler_states(optimizer, states: List[Optional[dict]], where: str) -> None:
    """Put ``states`` (from :func:`grad_scaler_states`) back into ``optimizer``'s scalers;
    raises ValueError naming ``where`` when the optimizers and the states do not match."""
    opts = getattr(optimizer, "chained_optimizers", [optimizer])
    if len(states) != len(opts):
        raise ValueError(f"{where}: {len(states)} loss scaler state(s) for {len(opts)} optimizer(s)")
    for i, (opt, st) in enumerate(zip(opts, states, strict=True)):
        scaler = getattr(opt, "grad_scaler", None)
        if (scaler is None) != (st is None) or (st is not None and st["kind"] != type(scaler).__name__):
            raise ValueError(f"{where}: optimizer {i} has loss scaler {type(scaler).__name__ if scaler else None}, "
                             f"the state is {st['kind'] if st else None}'s (a run in another precision?)")
        if st is None:
            continue
        sd = scaler.state_dict()
        scaler.load_state_dict({k: (torch.full_like(sd[k], st[k]) if torch.is_tensor(sd[k]) else st[k])
                                for k in sd})


#: loss_fn(model_output, micro_batch) -> (loss share of the global loss, metrics dict)
LossFn = Callable[[torch.Tensor, Dict[str, torch.Tensor]], Tuple[torch.Tensor, Dict[str, float]]]


@dataclass
class StepResult:
    update_successful: bool
    grad_norm: float
    metrics: List[Dict[str, float]]
    #: ``moe_aux_loss`` / ``moe_z_loss`` when enabled (megarl/models/moe_losses.py), already
    #: reduced over micro-batches, MoE layers and DP ranks; empty otherwise
    moe_losses: Dict[str, float] = field(default_factory=dict)
    #: where this rank's step went: ``forward_backward_s`` (the schedule, the gradient reduction
    #: included), ``grad_reduce_s`` (finalize_model_grads: the data-parallel reduction and the
    #: tied-weight syncs, waiting for any overlapped one), ``optimizer_s``, and ``micro_batches``
    seconds: Dict[str, float] = field(default_factory=dict)


def train_step(ddp_model, optimizer, micro_batches: Sequence[Dict[str, torch.Tensor]],
               loss_fn: LossFn, replay_layers: Optional[Tuple[int, ...]] = None) -> StepResult:
    """One optimizer step over ``micro_batches`` (this DP rank's part of the global batch).

    Each micro-batch is a dict with at least ``tokens`` ``(b, s)`` (all of one shape, padding masked
    out by ``loss_fn``), or, packed under a token budget (``algo.micro_batch_tokens``), also
    ``packed``: a :class:`~megarl.models.micro_batches.PackedMicroBatch` of its rows, which is what
    the model runs.  :func:`~megarl.models.micro_batches.update_inputs` makes them what the layout
    needs (SP, CP, EP, routing replay); ``loss_fn(output, mb)`` returns ``sum(terms) /
    global_normaliser`` from the output at the micro-batch's own width (packed: ``(1, total, ...)``;
    under CP this rank's positions), which :func:`~megarl.models.micro_batches.next_token_terms` and
    :func:`~megarl.models.micro_batches.token_terms` bring back to the rows.

    ``replay_layers`` (MoE routing replay): every micro-batch also holds ``routing`` ``(b, s,
    layers, k)`` and ``routing_valid`` ``(b, s)`` on its token grid
    (:func:`megarl.models.router_replay.record_to_rows`; columns: these decoder layers), and
    each forward dispatches its tokens to those experts.
    """
    from megarl.models import moe_losses
    from megarl.models.micro_batches import call_model, run_schedule, tokens_of, update_inputs
    from megarl.models.router_replay import clear_replay
    from megarl.models.weights import as_chunks, unwrap

    chunks = as_chunks(ddp_model)  # virtual pipeline stages
    items = update_inputs(ddp_model, micro_batches, replay_layers)
    config = unwrap(ddp_model).config

    def step(data_iterator, model):
        mb, inp = next(data_iterator)
        # a filler (virtual stages) carries no router loss either (moe_losses.suspended)
        with moe_losses.suspended(config) if mb.get("megarl_filler") else contextlib.nullcontext():
            out = call_model(model, inp.tokens, inp.targets, replay=True)

        def loss_func(output):
            own = inp.width
            loss, metrics = loss_fn(output[:, :own] if own is not None and output.shape[1] != own else output, mb)
            if mb.get("megarl_filler"):
                loss, metrics = loss * 0.0, None
            # (loss, num_tokens, reported): num_tokens is ignored by our finalize function.
            return loss, torch.ones((), dtype=torch.int, device=loss.device), metrics

        return out, loss_func

    for c in chunks:
        c.train()
        c.zero_grad_buffer()
    optimizer.zero_grad()
    pp = config.pipeline_model_parallel_size
    fillers = (-len(items)) % pp if len(chunks) > 1 else 0
    seconds = {"grad_reduce_s": 0.0, "micro_batches": float(len(items) + fillers)}
    finalize = config.finalize_model_grads_func

    def timed_finalize(*args, **kwargs):
        t = time.perf_counter()
        try:
            return finalize(*args, **kwargs)
        finally:
            seconds["grad_reduce_s"] += time.perf_counter() - t

    config.finalize_model_grads_func = timed_finalize if finalize is not None else None
    # the router's aux / z losses at the coefficient's scale (inert for dense models)
    t0 = time.perf_counter()
    with moe_losses.step_scope(ddp_model, len(micro_batches)) as moe:
        try:
            # megatron's interleaved schedule runs micro-batches in groups of pp: the last one again,
            # its loss times zero (no gradient, no metrics), up to a multiple of pp
            metrics = run_schedule(chunks, items, step, forward_only=False,
                                   shapes=[tokens_of(inp.tokens).shape for _mb, inp in items],
                                   filler=lambda item: (dict(item[0], megarl_filler=True), item[1]))
        finally:
            config.finalize_model_grads_func = finalize
            if replay_layers is not None:  # the experts queued for the recomputes, if any
                clear_replay(ddp_model)
    t1 = time.perf_counter()
    ok, grad_norm, _ = optimizer.step()
    seconds.update(forward_backward_s=t1 - t0, optimizer_s=time.perf_counter() - t1)
    return StepResult(bool(ok), float(grad_norm or 0.0), [m for m in metrics if m is not None], moe, seconds)
