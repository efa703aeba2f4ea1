"""The full-size proof of a recipe, without its hardware (megarl/commands/full_size.py).

    python -m megarl.plan --config configs/grpo_qwen2_7b.yaml --world-size 8 [--device-gib 80] [key=value ...]

``model.path`` needs only the model's ``config.json`` (a directory holding it, or a Hub id in the
local HF cache).  Every rank of the layout is brought up in this process on a fake process group;
each distinct position's model is built at full size on the meta device and mapped from the
checkpoint's shapes; the coverage of every HF tensor, the parameter count and the memory per
rank per phase are checked.  Exit 0 with the table; exit 2 with one ``error:`` line naming what a
real launch would hit.
"""

from __future__ import annotations

import argparse

from megarl.errors import cli_main


@cli_main
def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(prog="python -m megarl.plan", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", required=True)
    ap.add_argument("--world-size", type=int, required=True, help="the ranks the recipe runs on")
    ap.add_argument("--device-gib", type=float, default=80.0, help="memory of one GPU (default: an H100's 80)")
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args(argv)
    from megarl.commands.full_size import plan
    from megarl.commands.run_checks import check_run
    from megarl.config import load_config

    cfg = load_config(args.config, args.overrides)
    check_run(cfg, args.world_size)
    report = plan(cfg, args.world_size, device_gib=args.device_gib)
    print("\n".join(report.lines), flush=True)
    return {"world": report.world, "positions": len(report.positions), "hf_params": report.hf_params,
            "held": report.held, "memory": report.memory, "seconds": report.seconds}


if __name__ == "__main__":
    main()
