#!/usr/bin/env python
"""Iteration time of the tiny GRPO recipe against group size G, processes and response length.

    python bench/scaling.py [--iterations 6] [--json scaling.json]

Each row is one run of ``configs/grpo_arith_tiny.yaml`` (the built-in tiny model and task, built
on first use) with one setting changed; the table gives the median seconds per iteration (the
first iteration and the final evaluation are left out), tokens per second and the share of the
biggest stages.  Processes: 1 (``python -m megarl.train``) and 2 (``torchrun``, DP=2).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RECIPE = os.path.join(ROOT, "configs", "grpo_arith_tiny.yaml")
STAGES = ("generate", "old_log_prob", "ref_log_prob", "update", "weight_sync", "reward")


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(work: str, name: str, nproc: int, overrides: list, iterations: int) -> dict:
    run_dir = os.path.join(work, name)
    head = [sys.executable, "-m", "megarl.train"] if nproc == 1 else [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--master-addr", "127.0.0.1",
        "--master-port", str(_port()), "-m", "megarl.train"]
    env = dict(os.environ, PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1",
               PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    subprocess.run(head + ["--config", RECIPE, f"trainer.run_dir={run_dir}", f"trainer.iterations={iterations}",
                           "trainer.loggers=[jsonl]", "eval.every=0", *overrides],
                   check=True, env=env, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    rows = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))][1:-1]
    med = lambda key: statistics.median(r.get(key, 0.0) for r in rows)  # noqa: E731
    out = {"name": name, "processes": nproc, "overrides": overrides, "iteration_s": med("e2e/iteration_s"),
           "tokens_per_s": med("e2e/tokens_per_s"), "response_len": med("rollout/response_len_mean")}
    out.update({f"{s}_s": med(f"e2e/stage_s/{s}") for s in STAGES})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--iterations", type=int, default=6)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    grid = [("baseline (G=8, 6 new tokens)", 1, [])]
    grid += [(f"G={g}", 1, [f"rollout.n={g}"]) for g in (4, 16)]
    grid += [("2 processes (DP=2)", 2, ["algo.micro_batch_size=32", "algo.forward_micro_batch_size=32"])]
    rows = []
    with tempfile.TemporaryDirectory() as work:
        # the warm-started model answers in ~3 tokens and stops; the length sweep uses the same
        # architecture and tokenizer untrained (no warm start), which rarely emits EOS
        untrained = os.path.join(work, "untrained")
        subprocess.run([sys.executable, "-m", "megarl.tinymodel", "--out", untrained, "--steps", "0",
                        "--hidden-size", "128", "--num-layers", "4", "--num-heads", "4", "--num-kv-heads", "2",
                        "--intermediate-size", "256"], check=True, cwd=ROOT, capture_output=True,
                       env=dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")))
        grid += [(f"untrained, max_new_tokens={n}", 1, [f"model.path={untrained}", "model.build_tiny=false",
                                                      f"rollout.max_new_tokens={n}", f"eval.max_new_tokens={n}"])
                 for n in (6, 24, 96)]
        for i, (name, nproc, ov) in enumerate(grid):
            rows.append(run(work, f"r{i}", nproc, ov, args.iterations))
            rows[-1]["name"] = name
            print(f"  done: {name}", file=sys.stderr, flush=True)
    print(f"{'setting':<30}{'procs':>6}{'s/iter':>9}{'tok/s':>9}{'resp len':>9}  " + "".join(f"{s:>13}" for s in STAGES))
    for r in rows:
        print(f"{r['name']:<30}{r['processes']:>6}{r['iteration_s']:>9.3f}{r['tokens_per_s']:>9.0f}"
              f"{r['response_len']:>9.1f}  " + "".join(f"{r[s + '_s']:>13.3f}" for s in STAGES))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
