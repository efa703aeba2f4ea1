#!/usr/bin/env python
"""The embedded defaults from an empty cache, over build seeds and thread counts: how robust the
tiny model's warm start is, and what RL gains on it.

    python bench/warmstart.py                                  # GRPO and PPO, seeds 0 1 2, threads 1 2
    python bench/warmstart.py --recipes grpo_moe_tiny grpo_calc_tiny --seeds 0 1 --threads 1 2
    python bench/warmstart.py --json docs/perf/warmstart.json

Each row is the README's main command as a new user runs it -- ``python -m megarl.train
--config configs/<recipe>.yaml`` with ``MEGARL_CACHE`` pointing at an empty directory, so the
run builds the tiny model and the task files first -- with ``model.tiny.seed=<seed>`` and
``OMP_NUM_THREADS=<threads>``, one run at a time (the wall time is the whole command's, the build
included).  It prints, per run: the warm start's steps and held-out greedy accuracy
(``tiny_model.json``), the held-out accuracy of the first and the final evaluation
(``metrics.jsonl``: for the calculator recipe, with the tool), the gain, and the wall time; then,
per recipe, the spread of the warm-start accuracy and the smallest gain.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
#: where each recipe builds its tiny model under MEGARL_CACHE
MODEL_DIR = {"grpo_arith_tiny": "tiny_arith_llama", "ppo_arith_tiny": "tiny_arith_llama",
             "grpo_moe_tiny": "tiny_arith_qwen3_moe", "grpo_calc_tiny": "tiny_calc_llama"}


def one_run(recipe: str, seed: int, threads: int, workdir: str, extra) -> dict:
    cache, run_dir = os.path.join(workdir, "cache"), os.path.join(workdir, "run")
    env = dict(os.environ, MEGARL_CACHE=cache, OMP_NUM_THREADS=str(threads), PYTHONWARNINGS="ignore")
    cmd = [sys.executable, "-m", "megarl.train", "--config", os.path.join(ROOT, "configs", f"{recipe}.yaml"),
           f"model.tiny.seed={seed}", f"trainer.run_id=warmstart-s{seed}", f"trainer.run_dir={run_dir}", *extra]
    t0 = time.time()
    with open(os.path.join(workdir, "log.txt"), "w") as log:
        rc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=workdir).returncode
    wall = time.time() - t0
    if rc != 0:
        tail = open(os.path.join(workdir, "log.txt")).read()[-3000:]
        raise SystemExit(f"{recipe} seed {seed} threads {threads}: exit {rc}\n{tail}")
    info = json.load(open(os.path.join(cache, MODEL_DIR[recipe], "tiny_model.json")))
    rows = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))]
    evals = [(r["iteration"], r["eval/accuracy"]) for r in rows if "eval/accuracy" in r]
    return {"recipe": recipe, "seed": seed, "threads": threads, "warmstart_steps": info["warmstart"]["steps"],
            "warmstart_accuracy": info["heldout_accuracy_greedy"], "first_eval": evals[0][1],
            "final_eval": evals[-1][1], "gain": evals[-1][1] - evals[0][1], "wall_s": wall,
            "build_s": info["seconds"], "evals": evals}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--recipes", nargs="+", default=["grpo_arith_tiny", "ppo_arith_tiny"], choices=sorted(MODEL_DIR))
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--json", default=None, help="also write the rows here")
    ap.add_argument("--keep", default=None, help="keep each run's directory under this one")
    ap.add_argument("overrides", nargs="*", help="extra key=value overrides for every run")
    a = ap.parse_args()
    out = []
    print(f"{'recipe':<16} {'seed':>4} {'thr':>3} {'ws steps':>8} {'warm start':>10} {'first':>6} {'final':>6} "
          f"{'gain':>6} {'wall s':>7}", flush=True)
    for recipe in a.recipes:
        for seed in a.seeds:
            for threads in a.threads:
                work = tempfile.mkdtemp(prefix=f"warmstart-{recipe}-s{seed}-t{threads}-")
                try:
                    r = one_run(recipe, seed, threads, work, a.overrides)
                finally:
                    if a.keep:
                        shutil.copytree(work, os.path.join(a.keep, os.path.basename(work)), dirs_exist_ok=True)
                    shutil.rmtree(work, ignore_errors=True)
                out.append(r)
                print(f"{recipe:<16} {seed:>4} {threads:>3} {r['warmstart_steps']:>8} {r['warmstart_accuracy']:>10.3f} "
                      f"{r['first_eval']:>6.3f} {r['final_eval']:>6.3f} {r['gain']:>+6.3f} {r['wall_s']:>7.0f}",
                      flush=True)
    for recipe in a.recipes:
        rs = [r for r in out if r["recipe"] == recipe]
        ws = [r["warmstart_accuracy"] for r in rs]
        print(f"{recipe}: warm start {min(ws):.3f}..{max(ws):.3f} (spread {max(ws) - min(ws):.3f}), "
              f"gain min {min(r['gain'] for r in rs):+.3f} mean {sum(r['gain'] for r in rs) / len(rs):+.3f}, "
              f"wall max {max(r['wall_s'] for r in rs):.0f} s", flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"rows": out, "cpu": _cpu()}, f, indent=1)


def _cpu() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown"


if __name__ == "__main__":
    main()
