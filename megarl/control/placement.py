"""Where rollout engines live and which requests each one serves.

* ``hf`` (CPU default): one engine per training data-parallel replica, held by the replica's
  model-parallel leader (tp rank 0, first PP stage); the other ranks of the replica drain the
  weight stream.
* ``sglang`` (GPU): inference groups of ``rollout.tp`` consecutive ranks; every rank of a group
  holds the group's engine handle (SGLang runs its TP schedulers itself; rank 0 of the group
  talks to them).
* ``placement.mode=split``: the rollout ranks are a world of their own
  (:mod:`megarl.runtime.split`); the trainer side sees them as one inference group whose handle,
  a :class:`~megarl.rollout.remote.RemoteEngine`, trainer rank 0 holds.

Requests are dealt to inference groups in contiguous, near-equal shares; results are gathered
to every rank in request order, so the whole batch exists everywhere.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Sequence

import torch.distributed as dist

from megarl.observability.profiling import span
from megarl.rollout.protocol import GenerationRequest, GenerationResult, SamplingParams
from megarl.runtime.data_parallel import dp_rank, dp_size, gather_objects, is_mp_leader


@dataclass
class Placement:
    num_groups: int  # inference groups
    group_index: int  # this rank's group, or -1 when it holds no engine
    is_group_leader: bool  # answers for its group when results are gathered
    process_group: Optional[object] = None  # sglang inference group

    @property
    def holds_engine(self) -> bool:
        return self.group_index >= 0


def make_placement(backend: str, rollout_tp: int, split: bool = False) -> Placement:
    if split:  # one inference group: the rollout ranks, behind trainer rank 0's remote handle
        lead = dist.get_rank() == 0
        return Placement(num_groups=1, group_index=0 if lead else -1, is_group_leader=lead)
    if backend == "hf":
        lead = is_mp_leader()
        return Placement(num_groups=dp_size(), group_index=dp_rank() if lead else -1, is_group_leader=lead)
    world, rank = dist.get_world_size(), dist.get_rank()
    if world % rollout_tp:
        from megarl.errors import ConfigError

        raise ConfigError(f"rollout.tp={rollout_tp} does not divide the world size {world}")
    mine = None
    for start in range(0, world, rollout_tp):  # every rank creates every group (collective)
        g = dist.new_group(list(range(start, start + rollout_tp)))
        if start <= rank < start + rollout_tp:
            mine = g
    return Placement(num_groups=world // rollout_tp, group_index=rank // rollout_tp,
                     is_group_leader=rank % rollout_tp == 0, process_group=mine)


def create_engine(cfg, placement: Placement, config_dir: str, eos_token_ids: Sequence[int], pad_token_id: int):
    """The rollout engine of this rank's inference group (None when it holds none)."""
    if not placement.holds_engine:
        return None
    from megarl.rollout import create_rollout_engine

    r = cfg.rollout
    if r.backend == "hf":
        from megarl.runtime.distributed import device

        return create_rollout_engine("hf", config_dir, eos_token_ids=list(eos_token_ids),
                                     pad_token_id=pad_token_id, device=str(device()),
                                     retire_finished=r.retire_finished)
    from megarl.rollout import sglang_cpu

    # no CUDA device: SGLang's CPU engine, through megarl's mends (inert where CUDA exists)
    sglang_cpu.prepare()
    lora = engine_lora(cfg, config_dir)
    return create_rollout_engine(
        "sglang", config_dir, tp_size=r.tp, group=placement.process_group, eos_token_ids=list(eos_token_ids),
        mem_fraction_static=r.mem_fraction_static, seed=cfg.trainer.seed,
        deterministic_inference=r.deterministic_inference, verify_writes=r.verify_engine_weights,
        # routing replay reads the experts the engine routed each token to: SGLang records them
        # only when started with enable_return_routed_experts
        return_routed_experts=cfg.algo.routing_replay != "none",
        **sglang_cpu.backend_kwargs(),
        lora=lora,
        engine_kwargs={"enable_memory_saver": r.enable_memory_saver,
                       **({"ep_size": r.ep} if r.ep > 1 else {}),  # SGLang's expert parallelism (MoE)
                       **sglang_cpu.engine_kwargs(), **(sglang_cpu.lora_engine_kwargs() if lora else {})})


#: the HF linears each megatron LoRA target stands for (SGLang's ``lora_target_modules``)
HF_LORA_MODULES = {"linear_qkv": ("q_proj", "k_proj", "v_proj"), "linear_proj": ("o_proj",),
                   "linear_fc1": ("gate_proj", "up_proj"), "linear_fc2": ("down_proj",)}


def engine_lora(cfg, config_dir: str):
    """``actor.lora.engine: adapter``: the LoRA set-up SGLang starts with (``{"rank",
    "target_modules"}``), None otherwise.  A mixture-of-experts model is refused: its experts'
    adapters are served merged (``actor.lora.engine: merged``)."""
    lo = cfg.actor.lora
    if not lo.rank or lo.engine != "adapter":
        return None
    import json
    import os

    from megarl.errors import ConfigError

    with open(os.path.join(config_dir, "config.json"), encoding="utf-8") as f:
        model = json.load(f)
    if any(model.get(k) for k in ("num_experts", "num_local_experts", "n_routed_experts")):
        raise ConfigError("actor.lora.engine: 'adapter' is not built for a mixture-of-experts model (SGLang's LoRA "
                          "on routed experts is not proven here); use actor.lora.engine=merged")
    return {"rank": lo.rank, "target_modules": [m for t in lo.target_modules for m in HF_LORA_MODULES[t]]}


def create_remote_engine(world, config_dir: str, eos_token_ids: Sequence[int], pad_token_id: int):
    """Trainer rank 0 of a split placement: the handle on the rollout ranks (None elsewhere).
    Each rollout rank builds its engine on ``config_dir`` (an export of the actor)."""
    if dist.get_rank() != 0:
        return None
    from megarl.rollout.remote import RemoteEngine
    from megarl.runtime.distributed import device

    return RemoteEngine(world, {"config_dir": config_dir, "eos_token_ids": list(eos_token_ids),
                                "pad_token_id": int(pad_token_id)}, device=device())


def shares(n: int, parts: int) -> List[slice]:
    base, extra = divmod(n, parts)
    out, start = [], 0
    for i in range(parts):
        k = base + (1 if i < extra else 0)
        out.append(slice(start, start + k))
        start += k
    return out


def collect_everywhere(engine, placement: Placement, ticket, errors: Optional[list] = None) -> List[GenerationResult]:
    """Collective: the results of requests submitted ahead (``engine.submit``; the handle's
    holder has the ticket), gathered to every rank in request order -- the counterpart of
    :func:`generate_everywhere` for a producer that generates while the trainer trains.  An
    engine failure is reported into ``errors`` and contributes no results (the caller
    regenerates by sample id)."""
    from megarl.rollout.protocol import RolloutError

    mine, failure = [], None
    if placement.holds_engine:
        try:
            mine = engine.collect(ticket)
        except RolloutError as e:
            failure = f"{type(e).__name__}: {e}"
    with span("results_gather"):  # the generated experience, from each group's leader to every rank
        gathered = gather_objects((mine, failure) if placement.is_group_leader else None)
    results = [r for item in gathered if item is not None for r in item[0]]
    if errors is not None:
        errors.extend((0, item[1]) for item in gathered if item is not None and item[1] is not None)
    return results


def generate_everywhere(engine, placement: Placement, requests: Sequence[GenerationRequest],
                        sampling: SamplingParams, errors: Optional[list] = None) -> List[GenerationResult]:
    """Collective: each inference group serves its share; every rank gets all results, in
    request order (candidates of a request consecutive; results of requests not in this call,
    late ones, last).

    An inference group whose engine raises a :class:`RolloutError` contributes no results (its
    requests' candidates are then missing, and the caller regenerates them by sample id); the
    error does not leave the other ranks waiting in the gather.  ``errors`` (a list), when
    given, receives ``(group index, message)`` of each such failure.
    """
    from megarl.rollout.protocol import RolloutError

    mine: list = []
    failure = None
    if placement.holds_engine:
        share = list(requests[shares(len(requests), placement.num_groups)[placement.group_index]])
        try:
            mine = engine.generate(share, sampling) if share else []
        except RolloutError as e:
            mine, failure = [], f"{type(e).__name__}: {e}"
    with span("results_gather"):  # the generated experience, from each group's leader to every rank
        gathered = gather_objects((placement.group_index, mine, failure) if placement.is_group_leader else None)
    by_group = {g: res for item in gathered if item is not None for g, res, _ in [item]}
    if errors is not None:
        errors.extend((g, f) for item in gathered if item is not None for g, _, f in [item] if f is not None)
    results = [r for g in range(placement.num_groups) for r in by_group.get(g, [])]
    order = {r.request_id: i for i, r in enumerate(requests)}
    results.sort(key=lambda r: (order.get(r.request_id, len(order)), r.candidate_index))
    return results
