"""The training command's two halves (``python -m megarl.train``; the order is that module's
docstring): :func:`prepare_start` checks everything that can fail before a model loads and makes
the built-in assets; :func:`run_training` brings up the world and runs the loop."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional

from megarl.commands.run_checks import check_run
from megarl.commands.startup import (check_model, check_reward, check_start_paths, ensure_builtin_model,
                                     ensure_builtin_task, ensure_teacher, write_run_files)
from megarl.checkpointing.run_dir import inspect_run_dir, start_decision
from megarl.config import config_hash, default_run_dir, require_installed
from megarl.rewards.dataset_fields import check_datasets_against_reward

__all__ = ["Start", "prepare_start", "run_training"]


@dataclass
class Start:
    """What the checks before any model loads found: the data-parallel size, the resolved model
    sources (for run.json), and whether the run directory holds a finished run."""

    dp: int
    sources: Optional[dict] = None
    finished: bool = False


def prepare_start(cfg, world: int) -> Start:
    dp = check_run(cfg, world)
    require_installed(cfg)  # rollout.backend=sglang without sglang: the install command, now
    check_start_paths(cfg)  # an unwritable trainer.run_dir fails here, before any model loads
    if cfg.trainer.run_dir:
        finished = start_decision(cfg, inspect_run_dir(cfg.trainer.run_dir))
        if finished:  # a finished run started again: said in one line, the run is left as it is
            if int(os.environ.get("RANK", "0")) == 0:
                print(f"megarl.train: {finished}", flush=True)
            return Start(dp, finished=True)
    check_reward(cfg)
    if cfg.rollout.backend == "sglang":  # no CUDA device: SGLang's CPU engine needs its mends before
        from megarl.rollout import sglang_cpu  # megatron or SGLang load, the tiny model's build included

        sglang_cpu.prepare()  # (inert where CUDA exists)
    ensure_builtin_task(cfg)
    check_datasets_against_reward(cfg)  # every row carries what the reward reads (data.on_missing_fields)
    ensure_builtin_model(cfg)
    ensure_teacher(cfg)  # teacher.build: made from its recipe when teacher.path is missing
    return Start(dp, sources=check_model(cfg))


def run_training(cfg, world: int, start: Start) -> dict:
    import torch

    from megarl.runtime import distributed as rt
    from megarl.runtime.liveness import start_peer_watch

    if cfg.trainer.deterministic:
        torch.use_deterministic_algorithms(True, warn_only=True)
    torch.manual_seed(cfg.trainer.seed)
    world_side = None
    if cfg.placement.mode == "split":  # the world divided once: trainer ranks and rollout ranks
        world_side = rt.init_split_world(cfg.placement.rollout_ranks, cfg.placement.timeout_s)
        if world_side.role == "rollout":
            from megarl.control.assembly import serve_rollout_rank

            stats = serve_rollout_rank(cfg, world_side)
            world_side.close()
            return {"role": "rollout", **stats}
    p = cfg.parallel
    rt.initialize(tp=p.tp, pp=p.pp, cp=p.cp, ep=p.ep, etp=p.etp, vpp=p.vpp, seed=cfg.trainer.seed,
                  first_stage_layers=p.first_stage_layers, last_stage_layers=p.last_stage_layers)
    # a rank lost mid-run is named within parallel.peer_timeout_s (split placement beats on its own)
    watch = start_peer_watch(p.peer_timeout_s) if world_side is None else None
    try:
        result = _train(cfg, world, start, world_side)
    except Exception as e:
        if watch is not None:
            watch.explain(e)  # a collective's broken connection: the watcher names the lost rank
        raise
    if watch is not None:
        watch.stop()  # before any rank leaves: rt.shutdown's barrier follows
    rt.shutdown()
    return result


def _train(cfg, world: int, start: Start, world_side) -> dict:
    from megarl.control.trainer import Trainer
    from megarl.runtime import distributed as rt
    from megarl.runtime.data_parallel import broadcast_object

    run_dir = broadcast_object(cfg.trainer.run_dir or default_run_dir(cfg))
    cfg.trainer.run_dir = run_dir
    cfg.trainer.run_id = cfg.trainer.run_id or os.path.basename(os.path.normpath(run_dir)).replace("/", "-")
    h = config_hash(cfg)
    if rt.is_main():
        write_run_files(cfg, run_dir, h, world, start.dp, sources=start.sources)
        print(_start_line(cfg, world, start.dp, run_dir, h), flush=True)
    tokenizer_dir = cfg.model.tokenizer or cfg.model.path
    trainer = Trainer(cfg, run_dir, cfg.model.path, tokenizer_dir, run_id=cfg.trainer.run_id)
    try:
        result = trainer.run()
    finally:
        trainer.close()
        if world_side is not None:  # the heartbeat stops before the interpreter exits
            world_side.close()
    if rt.is_main():
        acc = result.get("heldout_accuracy")
        print(f"done: {result['iterations']} iterations; final held-out accuracy "
              f"{'-' if acc is None else f'{acc:.3f}'}; exports in {os.path.join(run_dir, 'export')}", flush=True)
    return result


def _start_line(cfg, world: int, dp: int, run_dir: str, h: str) -> str:
    split = cfg.placement.mode == "split"
    cp = f" x cp {cfg.parallel.cp}" if cfg.parallel.cp > 1 else ""
    side = (f"world {world} = {world - cfg.placement.rollout_ranks} trainer rank(s): " if split else f"world {world} = ")
    rollout = (f" + {cfg.placement.rollout_ranks} rollout rank(s) (placement split, async_rl.max_staleness="
               f"{cfg.async_rl.max_staleness})" if split else "")
    return (f"megarl.train: recipe {cfg.recipe}, {cfg.algo.name} ({cfg.algo.advantage}), {side}"
            f"tp {cfg.parallel.tp} x pp {cfg.parallel.pp}{cp} x dp {dp}{rollout}, run dir {run_dir}, config {h[:15]}")
