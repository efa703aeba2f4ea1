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
the command exits 0; megarl/checkpointing/run_dir.py), and a stopped run prints the command that resumes it.
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
    from megarl.config import load_config

    cfg = load_config(args.config, args.overrides)
    if args.dry_run:
        from megarl.commands.dry_run import dry_run

        return dry_run(cfg, world_size=args.world_size)
    from megarl.commands.training import prepare_start, run_training

    world = int(os.environ.get("WORLD_SIZE", "1"))
    start = prepare_start(cfg, world)
    if start.finished:
        return {"finished": True}
    return run_training(cfg, world, start)


if __name__ == "__main__":
    main()
