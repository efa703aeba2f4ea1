"""The command line of ``python -m megarl.train``: its flags, ``--help`` with every config key
(from the schema, :mod:`megarl.config.help`), and ``--print-config``.

Nothing here imports torch: ``--help`` and ``--print-config`` answer in a fraction of a second.
"""

from __future__ import annotations

import argparse
import os
import sys

USAGE_EXAMPLES = """\
examples:
  python -m megarl.train --config configs/grpo_arith_tiny.yaml trainer.iterations=5
  python -m megarl.train --config configs/grpo_arith_tiny.yaml --print-config rollout.n=4
  python -m megarl.train --config configs/grpo_qwen2_7b.yaml --dry-run --world-size 8 \
      model.path=/models/Qwen2.5-7B-Instruct data.train_path=/data/math.jsonl
  torchrun --nproc-per-node 8 -m megarl.train --config configs/grpo_qwen2_7b.yaml model.path=...
  sbatch launch/multinode.sh configs/grpo_qwen2_7b.yaml model.path=...

A stopped run prints the command that continues it (with trainer.run_dir=<its directory>); a
finished run started again says so and exits 0.
"""


def task_args_help() -> str:
    """``data.task.args`` of each built-in task (megarl/builtin/tasks): key, type, default, what it accepts."""
    import dataclasses
    import typing

    from megarl.builtin.tasks import POLICY_TASKS, get_task

    lines = ["data.task.args, by data.task.name (each task's own settings; docs/tiny-model.md):"]
    for name in POLICY_TASKS:
        settings = get_task(name).Settings
        hints = typing.get_type_hints(settings)
        lines.append(f"  {name}:")
        for f in dataclasses.fields(settings):
            rule, choices = f.metadata.get("range"), f.metadata.get("choices")
            accepts = f" [{rule.describe()}]" if rule else (f" [{' | '.join(choices)}]" if choices else "")
            lines.append(f"    {f.name:<16}{hints[f.name].__name__:<7}{f.default!s:<10}{accepts}".rstrip())
    return "\n".join(lines)


def build_parser(description: str = "") -> argparse.ArgumentParser:
    """The parser of ``python -m megarl.train``; ``description`` is the entry point's usage text."""
    from megarl.config.help import sections_help

    p = argparse.ArgumentParser(
        prog="python -m megarl.train", description=description.strip(), formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=USAGE_EXAMPLES + "\n" + sections_help() + "\n\n" + task_args_help())
    p.add_argument("--config", required=True, metavar="RECIPE.yaml", help="a YAML recipe (configs/*.yaml)")
    p.add_argument("--print-config", action="store_true",
                   help="print the resolved config (the recipe, the overrides, the defaults) as YAML and exit")
    p.add_argument("--dry-run", action="store_true",
                   help="validate, check the model, tokenizer, datasets and reward, print the plan (layout, batch "
                        "arithmetic, memory per role) and exit; nothing is trained or written")
    p.add_argument("--world-size", type=int, default=None, metavar="N",
                   help="with --dry-run: plan for N processes (default: $WORLD_SIZE or 1); packages missing on "
                        "this machine are then reported as not checked here instead of failing")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides (omegaconf dotlist)")
    return p


def parse_args(argv=None, description: str = "") -> argparse.Namespace:
    p = build_parser(description)
    args = p.parse_args(argv)
    if args.world_size is not None and not args.dry_run:
        p.error("--world-size goes with --dry-run (a real run's world size is torchrun's)")
    if args.world_size is not None and args.world_size < 1:
        p.error(f"--world-size must be >= 1, got {args.world_size}")
    return args


def print_config(path: str, overrides) -> dict:
    """The resolved YAML on stdout: what the run would write to ``<run_dir>/config.yaml``.
    Required keys not yet set print as ``???`` (listed on stderr); the command still exits 0,
    so a recipe can be inspected before its paths are known."""
    from omegaconf import OmegaConf

    from megarl.config import load_config, merge_config

    merged = merge_config(path, list(overrides))
    missing = sorted(OmegaConf.missing_keys(merged))
    if missing:
        if path is not None and merged.recipe == "custom":
            merged.recipe = os.path.splitext(os.path.basename(path))[0]
        text = OmegaConf.to_yaml(merged)  # unresolved: interpolations next to ??? stay visible
        print(f"note: required key(s) not set: {', '.join(missing)}", file=sys.stderr)
    else:
        text = OmegaConf.to_yaml(OmegaConf.structured(load_config(path, list(overrides))))
    sys.stdout.write(text)
    sys.stdout.flush()
    return {"printed": True, "missing": missing}
