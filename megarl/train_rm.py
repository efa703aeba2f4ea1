"""Reward-model training: Bradley-Terry on preference pairs through the megatron model.

    python -m megarl.train_rm --config configs/train_rm/arith_tiny.yaml [key=value ...]
    torchrun --nproc-per-node N -m megarl.train_rm --config ... parallel.tp=2
    python -m megarl.train_rm --config ... --print-config

The model starts from a causal LM (a zero score head on its trunk) or a reward model; it trains
at any TP / PP / DP (the loss is the batch mean whatever the split), reports held-out pair
accuracy, writes metrics (JSONL, TensorBoard) and checkpoints that resume exactly, and exports
``<run_dir>/export``: an HF ``*ForSequenceClassification`` checkpoint that transformers and
``reward.models`` read.
"""

from __future__ import annotations

import argparse

from megarl.errors import cli_main


@cli_main
def main(argv=None) -> dict:
    p = argparse.ArgumentParser(prog="python -m megarl.train_rm", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", required=True, metavar="RECIPE.yaml", help="a YAML recipe (configs/rm_*.yaml)")
    p.add_argument("--print-config", action="store_true", help="print the resolved config as YAML and exit")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides (omegaconf dotlist)")
    args = p.parse_args(argv)
    from megarl.commands.train_rm import main_rm

    return main_rm(args.config, args.overrides, print_only=args.print_config)


if __name__ == "__main__":
    main()
