#!/usr/bin/env python
"""On-policy distillation against GRPO from the same student: how many iterations and how much
wall-clock each needs to close 90% of the gap between the student's held-out accuracy and the
teacher's.

    python bench/distill.py --teacher .cache/megarl/tiny_arith_teacher/export/iter_400
    python bench/distill.py --teacher T --seeds 0 1 2 --iterations 200 --json docs/perf/distill.json --png docs/curves/distill.png
    python bench/distill.py --task rsum --teacher .cache/megarl/tiny_rsum_teacher/export/iter_150 --stop-at-target

Three methods, each ``python -m megarl.train`` from the task's cached tiny student, one run at a
time, ``trainer.seed=<seed>``:

- ``grpo``: ``configs/grpo_<task>_tiny.yaml`` (the task's reward, one number per answer);
- ``opd``: ``configs/opd_<task>_tiny.yaml`` (the teacher's per-token log-ratio, no reward);
- ``grpo+opd``: GRPO with ``algo.distill_coef=<coef>`` and the teacher beside it.

``--task arith``: answers of 1-3 tokens, where one reward per answer is nearly one per token;
``--task rsum``: running sums, worked answers of ~10-250 tokens graded on their final total.

The teacher's held-out accuracy is graded by ``python -m megarl.eval`` on the same held-out rows
(greedy, as the runs' evaluation; the held-out file must exist: any run of the recipe makes it).
A run reaches the target at its first evaluation at or above ``student + 0.9 (teacher -
student)`` (the student: the runs' first evaluation, or with ``--stop-at-target`` the same
``megarl.eval`` of the student before the runs, each run then stopped there); its wall-clock is the sum of its iterations' ``e2e/iteration_s``
up to that iteration (the evaluations themselves excluded: every method runs the same ones).
Prints one row per run and the mean per method; ``--json`` writes the rows, ``--png`` the
held-out accuracy curves.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Optional

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


#: per task: (the GRPO recipe, the distillation recipe)
RECIPES = {"arith": ("grpo_arith_tiny", "opd_arith_tiny"), "rsum": ("grpo_rsum_tiny", "opd_rsum_tiny")}


def _rows(path: str) -> list:
    if not os.path.isfile(path):
        return []
    with open(path) as fh:
        return [json.loads(line) for line in fh if line.endswith("\n")]


def run(method: str, seed: int, args, workdir: str, target: Optional[float] = None) -> dict:
    """One ``megarl.train`` run of ``method``; with ``target``, stopped at its first evaluation at
    or above it (what comes after does not enter the table)."""
    run_dir = os.path.join(workdir, f"{method}-s{seed}".replace("+", "_"))
    grpo, opd = RECIPES[args.task]
    recipe = opd if method == "opd" else grpo
    extra = [f"teacher.path={args.teacher}"] if method != "grpo" else []
    if method == "grpo+opd":
        extra.append(f"algo.distill_coef={args.coef}")
    cmd = [sys.executable, "-m", "megarl.train", "--config", os.path.join(ROOT, "configs", f"{recipe}.yaml"),
           f"trainer.seed={seed}", f"trainer.run_id=distill-{method}-s{seed}", f"trainer.run_dir={run_dir}",
           f"trainer.iterations={args.iterations}", f"eval.every={args.eval_every}", *extra]
    metrics = os.path.join(run_dir, "metrics.jsonl")
    stopped = False
    done = [r for r in _rows(metrics) if "e2e/iteration_s" in r]
    hit = target is not None and any(r.get("eval/accuracy", -1) >= target for r in _rows(metrics))
    if len(done) >= args.iterations or hit:  # a finished run kept in --workdir: read, not run again
        print(f"  {method} seed {seed}: read from {run_dir}", flush=True)
        return _result(method, seed, metrics, hit)
    if os.path.exists(metrics):
        raise SystemExit(f"{run_dir} holds an unfinished run ({len(done)} of {args.iterations} iterations): "
                         "delete it to run it again")
    with open(run_dir + ".log", "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT,
                                env=dict(os.environ, PYTHONWARNINGS="ignore"))
        while proc.poll() is None:
            time.sleep(2)
            if target is not None and any(r.get("eval/accuracy", -1) >= target for r in _rows(metrics)):
                proc.terminate()
                stopped = True
                try:
                    proc.wait(timeout=120)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
    if proc.returncode != 0 and not stopped:
        raise SystemExit(f"{method} seed {seed}: exit {proc.returncode}\n{open(run_dir + '.log').read()[-3000:]}")
    return _result(method, seed, metrics, stopped)


def _result(method: str, seed: int, metrics: str, stopped: bool) -> dict:
    rows = _rows(metrics)
    evals = [(r["iteration"], r["eval/accuracy"]) for r in rows if "eval/accuracy" in r]
    elapsed, wall = {}, 0.0
    for r in rows:
        if "e2e/iteration_s" in r:
            wall += r["e2e/iteration_s"]
            elapsed[r["iteration"]] = wall
    print(f"  {method} seed {seed}: {len(elapsed)} iterations, evaluations {evals}", flush=True)
    return {"method": method, "seed": seed, "evals": evals, "elapsed_s": elapsed, "stopped_at_target": stopped}


def held_out_accuracy(model: str, workdir: str, args, name: str) -> float:
    """``python -m megarl.eval`` of ``model`` on the recipe's held-out rows (greedy, its eval settings)."""
    sys.path.insert(0, ROOT)
    from megarl.config import load_config

    recipe = os.path.join(ROOT, "configs", f"{RECIPES[args.task][0]}.yaml")
    out = os.path.join(workdir, f"{name}_eval.{os.getpid()}.json")  # several benches may share --workdir
    cmd = [sys.executable, "-m", "megarl.eval", "--model", model, "--data", load_config(recipe).data.heldout_path,
           "--config", recipe, "--metrics-out", out]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    if proc.returncode != 0:
        raise SystemExit(f"evaluating the {name} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
    return float(json.load(open(out))["eval/accuracy"])


def reached(r: dict, target: float):
    for it, acc in r["evals"]:
        if acc >= target:
            return it, r["elapsed_s"].get(it, 0.0)
    return None, None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--teacher", required=True, help="the teacher's HF checkpoint (the GRPO recipe's export)")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--methods", nargs="+", default=["grpo", "opd", "grpo+opd"], choices=["grpo", "opd", "grpo+opd"])
    ap.add_argument("--iterations", type=int, default=200)
    ap.add_argument("--eval-every", type=int, default=10)
    ap.add_argument("--coef", type=float, default=1.0, help="algo.distill_coef of grpo+opd")
    ap.add_argument("--teacher-accuracy", type=float, default=None, help="skip evaluating the teacher")
    ap.add_argument("--task", choices=sorted(RECIPES), default="arith",
                    help="arith: the arithmetic recipes (answers of 1-3 tokens); rsum: running sums (worked "
                         "answers of ~10-250 tokens)")
    ap.add_argument("--stop-at-target", action="store_true",
                    help="evaluate the student first and stop each run at its first evaluation at or above the "
                         "target (the table is the same; the runs are shorter)")
    ap.add_argument("--workdir", help="keep the runs here (default: a temporary directory); a run already "
                                      "finished there is read, not run again, so seeds run apart can be tabulated "
                                      "together")
    ap.add_argument("--json")
    ap.add_argument("--png")
    args = ap.parse_args()
    with contextlib.nullcontext(os.path.abspath(args.workdir)) if args.workdir else \
            tempfile.TemporaryDirectory(prefix="megarl-distill-") as workdir:
        os.makedirs(workdir, exist_ok=True)
        t_acc = args.teacher_accuracy if args.teacher_accuracy is not None else \
            held_out_accuracy(args.teacher, workdir, args, "teacher")
        target = None
        if args.stop_at_target:
            sys.path.insert(0, ROOT)
            from megarl.config import load_config

            student_path = load_config(os.path.join(ROOT, "configs", f"{RECIPES[args.task][0]}.yaml")).model.path
            student = held_out_accuracy(student_path, workdir, args, "student")
            target = student + 0.9 * (t_acc - student)
            print(f"teacher {t_acc:.3f}  student {student:.3f}: each run stops at {target:.3f}", flush=True)
        results = [run(m, s, args, workdir, target) for s in args.seeds for m in args.methods]
    if target is None:
        student = statistics.mean(r["evals"][0][1] for r in results)
        target = student + 0.9 * (t_acc - student)
    print(f"teacher {t_acc:.3f}  student {student:.3f}  target (90% of the gap) {target:.3f}")
    print(f"{'method':9s} {'seed':>4s} {'final':>6s} {'best':>6s} {'last 5':>6s} {'s/iter':>6s} "
          f"{'iters to target':>15s} {'wall to target':>14s}")
    for r in results:
        it, wall = reached(r, target)
        per_iter = max(r["elapsed_s"].values()) / len(r["elapsed_s"]) if r["elapsed_s"] else None
        # the mean of the last five evaluations: one evaluation moves several points, a run's level does not
        last5 = statistics.mean(a for _, a in r["evals"][-5:])
        r.update(target=target, teacher=t_acc, iterations_to_target=it, wall_to_target_s=wall,
                 seconds_per_iteration=per_iter, last5_mean=last5)
        print(f"{r['method']:9s} {r['seed']:4d} {r['evals'][-1][1]:6.3f} {max(a for _, a in r['evals']):6.3f} "
              f"{last5:6.3f} {'-' if per_iter is None else f'{per_iter:.2f}':>6} "
              f"{'-' if it is None else it:>15} {'-' if wall is None else f'{wall:.1f} s':>14}")
    for m in args.methods:
        rs = [r for r in results if r["method"] == m]
        hit = [r for r in rs if r["iterations_to_target"] is not None]
        mean_wall = statistics.mean(r["wall_to_target_s"] for r in hit) if hit else None
        print(f"{m:9s} mean: reached {len(hit)}/{len(rs)}"
              + (f", {statistics.mean(r['iterations_to_target'] for r in hit):.0f} iterations, {mean_wall:.1f} s"
                 if hit else "")
              + f"; final {statistics.mean(r['evals'][-1][1] for r in rs):.3f}, last five evaluations "
                f"{statistics.mean(r['last5_mean'] for r in rs):.3f}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump([{k: v for k, v in r.items() if k != "elapsed_s"} for r in results], fh, indent=1)
    if args.png:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(7, 4))
        colours = {"grpo": "tab:blue", "opd": "tab:orange", "grpo+opd": "tab:green"}
        for r in results:
            it, acc = zip(*r["evals"])
            ax.plot(it, acc, color=colours[r["method"]], alpha=0.8,
                    label=r["method"] if r["seed"] == args.seeds[0] else None)
        ax.axhline(t_acc, color="black", linestyle="--", label="teacher")
        ax.axhline(target, color="grey", linestyle=":", label="90% of the gap")
        ax.set_xlabel("iteration")
        ax.set_ylabel("held-out accuracy")
        ax.legend()
        fig.tight_layout()
        fig.savefig(args.png, dpi=120)


if __name__ == "__main__":
    main()
