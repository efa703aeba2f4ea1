"""``python -m megarl.tinymodel``: build the built-in tiny model (the program is
:func:`megarl.builtin.warmstart.build`; the tasks are :mod:`megarl.builtin.tasks`).

    python -m megarl.tinymodel --out DIR [--task arithmetic --target-accuracy 0.3 --steps 2000 ...]
    python -m megarl.tinymodel --help
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os

from megarl.builtin import warmstart
from megarl.builtin.tasks import TASKS, get_task, task_settings
from megarl.builtin.warmstart import FAMILIES, MARKER, ModelShape, WarmStartRun, build, is_built
from megarl.errors import MegarlError, cli_main


def _task_arg(text: str) -> tuple:
    if "=" not in text:
        raise MegarlError(f"--task-arg {text!r}: expected KEY=VALUE")
    k, v = text.split("=", 1)
    try:
        return k, json.loads(v)
    except ValueError:
        return k, v  # a bare string (a role name)


@cli_main
def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m megarl.tinymodel", description=warmstart.__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--task", default="arithmetic", choices=TASKS, help="the built-in task it is warm-started on")
    p.add_argument("--task-arg", action="append", default=[], metavar="KEY=VALUE",
                   help="one of the task's settings (data.task.args: e.g. max_digits=2, demos=0.15); repeatable")
    for f in dataclasses.fields(ModelShape):
        p.add_argument("--" + f.name.replace("_", "-"), type=type(f.default), default=f.default,
                       **({"choices": FAMILIES} if f.name == "family" else {}))
    p.add_argument("--steps", type=int, default=None,
                   help="the most warm-start steps (exactly this many with --target-accuracy 0; default: the task's)")
    p.add_argument("--target-accuracy", type=float, default=None,
                   help="stop at the first check where the teacher-forced validation accuracy reaches this (0: run "
                        "--steps steps; default: the task's)")
    p.add_argument("--check-every", type=int, default=None, help="steps between two validation checks (default: the task's)")
    p.add_argument("--validation-n", type=int, default=256, help="problems in the validation set")
    p.add_argument("--heldout-n", type=int, default=200,
                   help="problems in the evaluation set (the recipe's held-out file: data.task.heldout_n), kept "
                        "apart from validation; the reported held-out accuracy is on it")
    p.add_argument("--lr", type=float, default=None, help="the warm start's learning rate (default: the task's, else 2e-3)")
    p.add_argument("--adam-beta2", type=float, default=0.999, help="Adam's second-moment decay")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--overwrite", action="store_true")
    a = p.parse_args(argv)
    if is_built(a.out) and not a.overwrite:
        raise MegarlError(f"--out {a.out}: already holds a tiny model ({MARKER}); pass --overwrite to rebuild")
    if os.path.exists(a.out) and not is_built(a.out) and os.listdir(a.out) and not a.overwrite:
        raise MegarlError(f"--out {a.out}: exists and is not a tiny model build; refusing to overwrite")
    defaults = get_task(a.task).DEFAULTS
    steps = defaults["steps"] if a.steps is None else a.steps
    target = defaults["target_accuracy"] if a.target_accuracy is None else a.target_accuracy
    check_every = defaults["check_every"] if a.check_every is None else a.check_every
    lr = defaults.get("lr", 2e-3) if a.lr is None else a.lr
    if steps < 0 or a.batch < 1:
        raise MegarlError("--steps must be >= 0 and --batch >= 1")
    if not 0.0 <= a.adam_beta2 < 1.0:
        raise MegarlError(f"--adam-beta2 {a.adam_beta2}: must be in [0, 1)")
    if not 0.0 <= target <= 1.0 or check_every < 1 or a.validation_n < 1 or a.heldout_n < 1:
        raise MegarlError(f"--target-accuracy {target} must be in [0, 1], --check-every {check_every}, "
                          f"--validation-n {a.validation_n} and --heldout-n {a.heldout_n} >= 1")
    if a.family != "llama" and not 1 <= a.top_k <= a.num_experts:
        raise MegarlError(f"--top-k {a.top_k}: must be between 1 and --num-experts {a.num_experts}")
    settings = task_settings(a.task, dict(_task_arg(t) for t in a.task_arg), key="--task-arg")
    run = WarmStartRun(steps=steps, batch=a.batch, seed=a.seed, lr=lr, adam_beta2=a.adam_beta2,
                       target_accuracy=target, check_every=check_every, validation_n=a.validation_n,
                       heldout_n=a.heldout_n)
    problem = getattr(settings, "check_run", lambda run: None)(run)
    if problem:
        raise MegarlError(f"--task-arg {problem[0]}: {problem[1]}")
    shape = ModelShape(**{f.name: getattr(a, f.name) for f in dataclasses.fields(ModelShape)})
    plan = (f"up to {steps} steps, stopping at {target:g} validation accuracy" if target > 0 else f"{steps} steps")
    print(f"building the tiny model of the {a.task} task in {a.out} (warm start through the megatron actor: {plan})",
          flush=True)
    info = build(a.out, get_task(a.task).WarmStart, settings, run, shape)
    print(f"tiny model ready in {a.out}: held-out greedy accuracy {info['heldout_accuracy_greedy']:.3f} "
          f"after {info['warmstart']['steps']} warm-start steps ({info['seconds']:.0f}s)", flush=True)


if __name__ == "__main__":
    main()
