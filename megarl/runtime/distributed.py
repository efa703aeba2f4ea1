"""Process-group bring-up: ``torch.distributed`` from the torchrun environment, then
megatron-core ``parallel_state`` with TP, PP, CP and DP, and for mixture-of-experts models EP
(expert parallel) and ETP (expert tensor parallel).

Expert parallelism is megatron's: the EP groups are carved out of the data-parallel ranks
(order ``tp-cp-ep-dp-pp``), so the experts of one layer are spread over ``ep`` ranks that hold
the same attention shards of different data; the expert layers are split over TP by their own
``etp`` (default: ``tp``).  The world must be divisible by ``tp * pp`` and by ``etp * ep * pp``.

Every megarl entry point (train, tools, tests' worker scripts) calls :func:`initialize` once.
Under ``torchrun`` the world comes from ``RANK``/``WORLD_SIZE``/``MASTER_ADDR``/``MASTER_PORT``;
a plain ``python -m ...`` process runs as a world of size 1.  NCCL is used when CUDA is
available, gloo otherwise (with :mod:`megarl.runtime.cpu_compat` installed).
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

from megarl.errors import MegarlError
from megarl.runtime import cpu_compat


class ParallelConfigError(MegarlError, ValueError):
    """A parallel layout that cannot be realised with the given world."""


@dataclass(frozen=True)
class ParallelLayout:
    """Sizes of the parallel dimensions; ``dp`` is derived from the world size."""

    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1
    etp: Optional[int] = None  # expert tensor parallel size; None: tp
    vpp: int = 1  # virtual pipeline stages per PP rank (interleaved 1F1B); needs pp > 1

    @property
    def resolved_etp(self) -> int:
        return self.tp if self.etp is None else self.etp

    def validate(self, world_size: int) -> int:
        """Return the data-parallel size, or raise naming the offending key."""
        for key in ("tp", "pp", "cp", "ep"):
            if getattr(self, key) < 1:
                raise ParallelConfigError(f"parallel.{key} must be >= 1, got {getattr(self, key)}")
        if self.vpp < 1 or (self.vpp > 1 and self.pp < 2):
            raise ParallelConfigError(f"virtual pipeline stages vpp={self.vpp}: expected 1, or more than 1 with "
                                      f"pp > 1 (pp={self.pp})")
        if self.etp is not None and self.etp < 1:
            raise ParallelConfigError(f"parallel.etp must be >= 1 or null, got {self.etp}")
        mp = self.tp * self.pp * self.cp
        if world_size % mp != 0:
            raise ParallelConfigError(
                f"world size {world_size} is not divisible by tp*pp*cp = {self.tp}*{self.pp}*{self.cp} = {mp}"
            )
        emp = self.resolved_etp * self.ep * self.pp
        if world_size % emp != 0:
            raise ParallelConfigError(
                f"parallel.ep={self.ep}: world size {world_size} is not divisible by etp*ep*pp = "
                f"{self.resolved_etp}*{self.ep}*{self.pp} = {emp} (megatron carves the expert-parallel "
                "groups out of the data-parallel ranks)"
            )
        return world_size // mp


def init_split_world(rollout_ranks: int, timeout_s: float, timeout_minutes: int = 30):
    """``placement.mode=split``: this process's side of the divided world
    (:func:`megarl.runtime.split.init_split`), on the backend :func:`init_process_group` would use."""
    from megarl.runtime import split

    backend = "gloo" if cpu_compat.on_cpu() else "nccl"
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    return split.init_split(rollout_ranks, timeout_s, backend, datetime.timedelta(minutes=timeout_minutes))


def init_process_group(timeout_minutes: int = 30) -> None:
    """Initialise ``torch.distributed`` from the torchrun environment (or as world size 1)."""
    if dist.is_initialized():
        return
    backend = "gloo" if cpu_compat.on_cpu() else "nccl"
    timeout = datetime.timedelta(minutes=timeout_minutes)
    if "RANK" not in os.environ:
        # A plain process: a world of one with an in-memory store (no port to race for).
        # Nothing is written to os.environ: child processes (tools, torchrun) must not
        # inherit a RANK/WORLD_SIZE that describes this process's world.
        if backend == "nccl":
            torch.cuda.set_device(0)
        dist.init_process_group(backend=backend, store=dist.HashStore(), rank=0, world_size=1,
                                timeout=timeout)
        return
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(backend=backend, timeout=timeout)


def initialize(
    tp: int = 1,
    pp: int = 1,
    cp: int = 1,
    ep: int = 1,
    seed: int = 1234,
    timeout_minutes: int = 30,
    etp: Optional[int] = None,
    vpp: int = 1,
    first_stage_layers: Optional[int] = None,
    last_stage_layers: Optional[int] = None,
) -> ParallelLayout:
    """Bring up torch.distributed and megatron-core parallel state; seed every rank.

    ``ep`` / ``etp``: megatron's expert-parallel and expert-tensor-parallel sizes (``etp`` None:
    ``tp``); ``cp``: context-parallel size (each sequence split over cp ranks,
    :mod:`megarl.models.context_parallel`); ``vpp``: virtual pipeline stages per PP rank (each
    rank holds ``vpp`` model chunks, :func:`megarl.models.builder.build_model_chunks`, and
    megatron's schedules interleave them).  Raises :class:`ParallelConfigError` (before touching any
    process group) when the layout does not fit the world size.
    """
    global _STAGE_LAYERS
    layout = ParallelLayout(tp=tp, pp=pp, cp=cp, ep=ep, etp=etp, vpp=vpp)
    if (first_stage_layers is not None or last_stage_layers is not None) and (pp < 2 or vpp > 1):
        raise ParallelConfigError(f"parallel.first_stage_layers / parallel.last_stage_layers: an uneven pipeline "
                                  f"split needs pp > 1 and no virtual stages (pp={pp}, vpp={vpp})")
    _STAGE_LAYERS = (first_stage_layers, last_stage_layers)
    # split placement brought up the trainer ranks' own world already (megarl.runtime.split)
    world = dist.get_world_size() if dist.is_initialized() else int(os.environ.get("WORLD_SIZE", "1"))
    layout.validate(world)
    cpu_compat.install()
    cpu_compat.check_megatron_version()
    init_process_group(timeout_minutes)
    from megatron.core import parallel_state

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        context_parallel_size=cp,
        expert_model_parallel_size=ep,
        expert_tensor_parallel_size=layout.resolved_etp,
        virtual_pipeline_model_parallel_size=vpp if vpp > 1 else None,
        distributed_timeout_minutes=timeout_minutes,
        create_gloo_process_groups=cpu_compat.on_cpu(),
    )
    cpu_compat.seed_megatron_rng(seed)
    return layout


#: (first, last): the decoder layers of the first and last pipeline stages when they are not an
#: even share (``parallel.first_stage_layers`` / ``last_stage_layers``; megarl/models/stages.py)
_STAGE_LAYERS: tuple = (None, None)


def stage_layers() -> tuple:
    """``(first, last)`` pipeline-stage layer counts this process was initialised with (None: even)."""
    return _STAGE_LAYERS


def set_stage_layers(first: Optional[int], last: Optional[int]) -> None:
    """Set them without (re)initialising the process groups (the full-size plan's fake ranks)."""
    global _STAGE_LAYERS
    _STAGE_LAYERS = (first, last)


def shutdown() -> None:
    """Tear down megatron parallel state and the process group (idempotent)."""
    from megatron.core import parallel_state

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def is_main() -> bool:
    return rank() == 0


def device() -> torch.device:
    """The device this rank computes on."""
    if cpu_compat.on_cpu():
        return torch.device("cpu")
    return torch.device("cuda", torch.cuda.current_device())
