"""The router's load-balancing (aux) loss and z-loss inside megarl's loss contract.

Both are megatron-core's (``megatron/core/transformer/moe/router.py``), switched on by
``actor.moe_aux_loss_coeff`` / ``actor.moe_z_loss_coeff`` (off by default: RL fine-tuning keeps the
router's function free of pre-training regularisers).  Per MoE layer l and micro-batch m, over
the micro-batch's T token positions (padding included: megarl passes the router no padding
mask) with router probabilities p = softmax(router logits z) over E experts and top-k:

    aux_lm = E * sum_i f_i * P_i,   f_i = (tokens routed to expert i) / (T * k),  P_i = mean_t p_ti
    (Switch Transformer, Fedus et al. 2021, eq. 4; megatron's ``switch_load_balancing_loss_func``)
    z_lm   = mean_t (logsumexp_i z_ti)^2            (ST-MoE, Zoph et al. 2022, eq. 5)

and megarl's objective for one optimizer step over M micro-batches per rank and dp data-parallel
ranks is

    L = (policy loss, already a share of the global normaliser)
        + c_aux * (1 / (M * dp)) * sum_{m, ranks} sum_l aux_lm
        + c_z   * (1 / (M * dp)) * sum_{m, ranks} sum_l z_lm,

i.e. the coefficient multiplies the mean over micro-batches and ranks, the scaling megatron
documents as the intended one ("1/(num_micro_batches * dp_size)").

Why megarl has to intervene, and how: :func:`step_scope`.  ``tests/unit/models/test_moe_losses.py`` checks
the gradient against a hand computation of the formulas above.
"""

from __future__ import annotations

import contextlib
from typing import Dict, Iterator

import torch

#: megatron tracker names -> the metric names megarl reports (``update/<name>``)
TRACKED = {"load_balancing_loss": "moe_aux_loss", "z_loss": "moe_z_loss"}


def enabled(tconf) -> bool:
    """Whether the model's config has an aux or z loss switched on (False for a dense model)."""
    if getattr(tconf, "num_moe_experts", None) is None:
        return False
    return bool(tconf.moe_aux_loss_coeff) or tconf.moe_z_loss_coeff is not None


@contextlib.contextmanager
def step_scope(ddp_model, num_micro_batches: int) -> Iterator[Dict[str, float]]:
    """Around one optimizer step's forward/backward: the coefficients scaled to ``c / (M * dp)``,
    megatron's tracker cleared before and read after.  Yields a dict that holds, after the block,
    ``moe_aux_loss`` / ``moe_z_loss`` (the enabled ones).  Inert (no collective, nothing
    changed) for a dense model or one with both losses off.

    Why megarl has to intervene: megatron attaches the losses with ``MoEAuxLossAutoScaler``,
    whose backward scale the schedule sets to 1 under ``calculate_per_token_loss`` (megarl's
    setting), and a router built with ``calculate_per_token_loss`` multiplies the loss by the
    micro-batch's token count, expecting ``finalize_model_grads`` to divide by the global token
    count -- which megarl's finalize does not (its policy loss is already normalised).  Left alone,
    the aux gradient would be T (or M * dp) times what the coefficient says and would change with
    the micro-batch size and the DP size (contract 6).  So for each step: the routers do not multiply
    by T, and the coefficients megatron reads are ``c / (M * dp)`` (restored afterwards).

    Megatron's tracker records the losses divided by the coefficient in use, so the reported
    values are the unscaled ``aux`` / ``z`` whatever the scaling: ``moe_aux_loss`` /
    ``moe_z_loss`` are the means over micro-batches, MoE layers and DP ranks
    (``update/moe_aux_loss``: 1.0 is a perfectly balanced top-k).
    """
    from megarl.models.weights import as_chunks

    chunks = as_chunks(ddp_model)  # virtual pipeline stages
    tconf = chunks[0].config
    out: Dict[str, float] = {}
    if not enabled(tconf):
        yield out
        return
    from megatron.core import parallel_state as ps
    from megatron.core.transformer.moe.moe_utils import clear_aux_losses_tracker
    from megatron.core.transformer.moe.router import Router

    for m in (m for c in chunks for m in c.modules()):
        if isinstance(m, Router):
            m.calculate_per_token_loss = False  # no x T: megarl's finalize does not divide by T
    dp = ps.get_data_parallel_world_size()
    share = 1.0 / (num_micro_batches * dp)
    aux, z = tconf.moe_aux_loss_coeff, tconf.moe_z_loss_coeff
    clear_aux_losses_tracker()
    tconf.moe_aux_loss_coeff = aux * share
    tconf.moe_z_loss_coeff = None if z is None else z * share
    try:
        yield out
    finally:
        tconf.moe_aux_loss_coeff, tconf.moe_z_loss_coeff = aux, z
    out.update(_tracked_means(tconf, num_micro_batches, dp))


@contextlib.contextmanager
def suspended(tconf) -> Iterator[None]:
    """Around the forward of a filler micro-batch (virtual pipeline stages fill the micro-batch
    count to a multiple of pp with zero-weight copies): the routers attach no aux / z loss and
    record none, so the fillers add nothing to the objective or the reported means.  The
    coefficients are read in the forward; a recompute in the backward would read them again,
    which is why the router's losses with virtual stages and recomputation are refused
    (megarl/config/validation.py)."""
    aux, z = tconf.moe_aux_loss_coeff, tconf.moe_z_loss_coeff
    tconf.moe_aux_loss_coeff, tconf.moe_z_loss_coeff = 0.0, None
    try:
        yield
    finally:
        tconf.moe_aux_loss_coeff, tconf.moe_z_loss_coeff = aux, z


def _tracked_means(tconf, num_micro_batches: int, dp: int) -> Dict[str, float]:
    """The tracker's per-layer sums over this rank's micro-batches -> means over micro-batches,
    MoE layers and DP ranks (collective over the PP and DP groups; gloo has no AVG, so a sum)."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.transformer.moe.moe_utils import get_moe_layer_wise_logging_tracker

    tracker = get_moe_layer_wise_logging_tracker()
    freq = tconf.moe_layer_freq
    moe_layers = sum(freq) if isinstance(freq, list) else len(range(0, tconf.num_layers, freq))
    wanted = [("load_balancing_loss", bool(tconf.moe_aux_loss_coeff)), ("z_loss", tconf.moe_z_loss_coeff is not None)]
    names = [n for n, on in wanted if on]
    vals = torch.zeros(len(names), dtype=torch.float64)
    for i, n in enumerate(names):
        if n in tracker:  # a PP stage without MoE layers has no entry
            vals[i] = tracker[n]["values"].double().sum()
    if ps.get_pipeline_model_parallel_world_size() > 1:
        dist.all_reduce(vals, group=ps.get_pipeline_model_parallel_group())
    if dp > 1:
        dist.all_reduce(vals, group=ps.get_data_parallel_group())
    vals /= num_micro_batches * dp * moe_layers
    return {TRACKED[n]: float(v) for n, v in zip(names, vals, strict=True)}
