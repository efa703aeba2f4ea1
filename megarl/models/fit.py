"""Whether a model fits the run's layout: checked on its ``config.json`` at start-up, before any
weight loads, each failure a :class:`~megarl.errors.ConfigError` naming the key.

Run by the command that assembles the run (:mod:`megarl.commands.startup`, the dry run and
:mod:`megarl.commands.run_checks`), after the config's own checks.
"""

from __future__ import annotations

from typing import Optional

from megarl.errors import ConfigError, require
from megarl.models.hf_config import ExpertFitError, ModelConfigError, check_expert_fit, check_parallel_fit

__all__ = ["validate_model_fit", "moe_num_experts", "check_packing"]


def check_packing(cfg) -> None:
    """``algo.pack_sequences`` and ``algo.micro_batch_tokens`` need a process that can run packed
    (THD) forwards."""
    from megarl.models.forward import packing_unsupported_reason

    if cfg.algo.pack_sequences:
        why = packing_unsupported_reason()
        require(why is None, "algo.pack_sequences", f"is true, but {why}")
    if cfg.algo.micro_batch_tokens:
        why = packing_unsupported_reason()
        require(why is None, "algo.micro_batch_tokens", f"is {cfg.algo.micro_batch_tokens} (packed micro-batches), "
                f"but {why}")


def validate_model_fit(cfg, spec, where: str) -> None:
    """Heads / KV heads / FFN / layers / vocab padding against TP and PP, experts against EP and
    expert TP (config.json only)."""
    p = cfg.parallel
    try:
        check_parallel_fit(spec, p.tp, p.pp, where=where, experts=False, first_stage_layers=p.first_stage_layers,
                           last_stage_layers=p.last_stage_layers)
    except ModelConfigError as e:
        raise ConfigError(f"parallel.tp/parallel.pp: {e}") from None
    require(p.vpp == 1 or spec.num_layers % (p.pp * p.vpp) == 0, "parallel.vpp",
            f"{p.vpp}: {where} has num_hidden_layers={spec.num_layers}, not divisible by pp x vpp = {p.pp} x {p.vpp} "
            "(every virtual pipeline stage holds as many layers)")
    try:
        check_expert_fit(spec, p.tp, p.ep, p.etp, where=where)
    except ExpertFitError as e:
        raise ConfigError(f"parallel.{e.size}: {e}") from None
    # megatron-core's MoELayer refuses to train at TP > 1 without sequence parallelism: refused
    # here, naming the key, instead of in the first update
    require(getattr(spec, "moe", None) is None or p.tp == 1 or p.sequence_parallel, "parallel.sequence_parallel",
            f"is false with parallel.tp={p.tp} and the mixture-of-experts model {where}: megatron-core trains MoE "
            "layers at tp > 1 only with sequence parallelism; set parallel.sequence_parallel=true (or parallel.tp=1)")
    require(cfg.model.vocab_multiple % p.tp == 0, "model.vocab_multiple",
            f"{cfg.model.vocab_multiple} is not divisible by parallel.tp={p.tp} (the padded vocabulary is split over TP)")
    experts = moe_num_experts(spec)
    require(cfg.rollout.ep == 1 or (experts is not None and experts % cfg.rollout.ep == 0), "rollout.ep",
            f"{cfg.rollout.ep} must divide the number of routed experts of {where} "
            f"({experts if experts is not None else f'none: {spec.architecture} is dense'})")
    for key in ("moe_aux_loss_coeff", "moe_z_loss_coeff"):
        require(getattr(cfg.actor, key) in (None, 0.0) or moe_num_experts(spec) is not None, f"actor.{key}",
                f"is {getattr(cfg.actor, key)}, but {where} describes a dense model ({spec.architecture}: no router "
                f"to regularise); use actor.{key}={'null' if key == 'moe_z_loss_coeff' else '0'}")
    if cfg.algo.routing_replay != "none":
        require(moe_num_experts(spec) is not None, "algo.routing_replay",
                f"is {cfg.algo.routing_replay!r}, but {where} describes a dense model "
                f"({spec.architecture}: no routed experts); use algo.routing_replay=none")


def moe_num_experts(spec) -> Optional[int]:
    """The number of routed experts of an MoE model spec, None for a dense one (the spec's
    ``moe.num_experts`` when it has one, else config.json's ``num_experts`` / ``num_local_experts``
    / ``n_routed_experts``)."""
    moe = getattr(spec, "moe", None)
    n = getattr(moe, "num_experts", None)
    if n is None:
        raw = getattr(spec, "raw_config", None) or {}
        for key in ("num_experts", "num_local_experts", "n_routed_experts"):
            if raw.get(key):
                n = raw[key]
                break
    return int(n) if n else None
