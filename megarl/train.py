"""The main job: PPO / GRPO training.

    python -m megarl.train --config configs/grpo_arith_tiny.yaml [key=value ...]
    torchrun --nproc-per-node N -m megarl.train --config ... parallel.tp=2
    sbatch launch/multinode.sh configs/....yaml key=value ...
    python -m megarl.train --config ... --print-config | --dry-run [--world-size N]

Start-up order: the config is loaded and validated first (unknown keys, wrong types and
inconsistent sizes exit with status 2 and the key named, before any model loads); then the
built-in assets are made if the recipe asks for them and they are missing (the arithmetic task
files, then -- after every train and held-out row was checked against the reward -- the tiny
model: built once, cached at their paths); then torch.distributed and megatron
come up, the run directory gets the resolved config and its hash, and the loop runs.  Before
any model loads the run directory is checked too (writable; a finished run is left as it is and
the command exits 0; megarl/runtime/run_dir.py), and a stopped run prints the command that resumes it.
"""

from __future__ import annotations

import os

from megarl.errors import cli_main


@cli_main
def main(argv=None) -> dict:
    from megarl.commands.cli import parse_args

    args = parse_args(argv, description=__doc__ or "")
    if args.print_config:
        from megarl.commands.cli import print_config

        return print_config(args.config, args.overrides)

    from megarl.commands.startup import (check_model, check_reward, ensure_builtin_model, ensure_builtin_task,
                                         write_run_files)
    from megarl.commands.run_checks import check_run
    from megarl.config import config_hash, default_run_dir, load_config, require_installed

    cfg = load_config(args.config, args.overrides)
    if args.dry_run:
        from megarl.commands.dry_run import dry_run

        return dry_run(cfg, world_size=args.world_size)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    dp = check_run(cfg, world)
    require_installed(cfg)  # rollout.backend=sglang without sglang: the install command, now
    from megarl.commands.startup import check_start_paths
    from megarl.runtime.run_dir import inspect_run_dir, start_decision

    check_start_paths(cfg)  # an unwritable trainer.run_dir fails here, before any model loads
    if cfg.trainer.run_dir:
        finished = start_decision(cfg, inspect_run_dir(cfg.trainer.run_dir))
        if finished:  # a finished run started again: said in one line, the run is left as it is
            if int(os.environ.get("RANK", "0")) == 0:
                print(f"megarl.train: {finished}", flush=True)
            return {"finished": True}
    check_reward(cfg)
    from megarl.rewards.dataset_fields import check_datasets_against_reward

    if cfg.rollout.backend == "sglang":  # no CUDA device: SGLang's CPU engine needs its mends before
        from megarl.rollout import sglang_cpu  # megatron or SGLang load, the tiny model's build included

        sglang_cpu.prepare()  # (inert where CUDA exists)
    ensure_builtin_task(cfg)
    check_datasets_against_reward(cfg)  # every row carries what the reward reads (data.on_missing_fields)
    ensure_builtin_model(cfg)
    sources = check_model(cfg)

    import torch

    from megarl.control.trainer import Trainer
    from megarl.runtime import distributed as rt
    from megarl.runtime.data_parallel import broadcast_object

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
    rt.initialize(tp=cfg.parallel.tp, pp=cfg.parallel.pp, ep=cfg.parallel.ep, etp=cfg.parallel.etp,
                  seed=cfg.trainer.seed)
    run_dir = broadcast_object(cfg.trainer.run_dir or default_run_dir(cfg))
    cfg.trainer.run_dir = run_dir
    cfg.trainer.run_id = cfg.trainer.run_id or os.path.basename(os.path.normpath(run_dir)).replace("/", "-")
    h = config_hash(cfg)
    if rt.is_main():
        write_run_files(cfg, run_dir, h, world, dp, sources=sources)
        split = cfg.placement.mode == "split"
        side = (f"world {world} = {world - cfg.placement.rollout_ranks} trainer rank(s): " if split else f"world {world} = ")
        rollout = (f" + {cfg.placement.rollout_ranks} rollout rank(s) (placement split, async_rl.max_staleness="
                   f"{cfg.async_rl.max_staleness})" if split else "")
        print(f"megarl.train: recipe {cfg.recipe}, {cfg.algo.name} ({cfg.algo.advantage}), {side}"
              f"tp {cfg.parallel.tp} x pp {cfg.parallel.pp} x dp {dp}{rollout}, run dir {run_dir}, config {h[:15]}",
              flush=True)
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
    rt.shutdown()
    return result


if __name__ == "__main__":
    main()
