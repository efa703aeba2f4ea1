#!/usr/bin/env python
"""Wall-clock to target on the long-tail reasoning recipe (``configs/grpo_rsum_tiny.yaml``):
synchronous, partial-rollout and asynchronous megarl, on the same 2 processes of this CPU,
several seeds per configuration (issue 32, item 6), and TRL's GRPOTrainer on the same task.

    pip install -e ".[bench]"          # TRL is a bench extra, never a runtime dependency
    python bench/long_tail.py [--iterations 120] [--seeds 1 2 3] [--only NAME ...] [--skip-trl] [--out DIR]

The runs, one after the other, each a fresh ``torchrun --nproc-per-node 2`` (one torch thread per
process), every one the recipe with the same start model (its own warm-started build), task,
batch (the recipe's B prompts x G samples), lengths, lr and iterations; a seed sets ``trainer.seed`` and the run id
(the sampling seeds derive from both):

1. ``sync hybrid``: the recipe, DP=2 (both processes generate -- the decode that retires finished
   rows -- and train, in turn);
2. ``sync partial``: hybrid with ``async_rl.partial_rollouts`` at eta 0 (over-sampled by
   ``--extra-groups``, generated ``--segment-tokens`` at a time; unfinished groups start again,
   due next iteration);
3. ``async split eta=k``: ``placement.mode=split`` (1 trainer + 1 rollout rank), generation k
   steps ahead, ``async_rl.correction=tis``;
4. ``async split eta=k engine``: the same, with the proximal policy's log-probs teacher-forced
   by the rollout engine while the trainer trains (``async_rl.proximal_log_probs=engine``);
5. ``partial eta=k``: hybrid partial rollouts whose unfinished candidates carry over, each token
   keeping its version, within k steps;
6. ``TRL``: TRL's ``GRPOTrainer`` under the same torchrun, set up as ``bench/async.py`` sets it up
   (``vs_trl.trl_trainer``) with this recipe's start model, train split, scorer, B x G, new
   tokens, lr and KL coefficient, ``seed`` as its seed.  Its weights are saved every
   ``--eval-every`` steps (the saves are not charged) and scored afterwards, outside every clock,
   by the warm start's greedy evaluation (``megarl.builtin.tasks.running_sum.greedy_answers``: the same
   held-out rows, chat template, scorer and new-token limit as megarl's in-run evaluation).

The clock, the target rule and the curves are ``bench/async.py``'s (evaluation and start-up are
not charged; an accuracy is placed at the commit of its weights).  The target is the mean over
the sync hybrid seeds of the accuracy each holds from ``--hold-from`` of its iterations on.
Reported per configuration (mean over seeds, and each seed): wall-clock to target, final
accuracy (the mean of the last 3 evaluations), seconds per iteration, generation share
(``rollout/generate_s`` over the charged iteration), the idle shares split placement reports, the
mean / max response-length ratio per batch, the seconds per iteration of each stage, the staleness
histogram (share of trained samples by age, in steps), the bound generation puts on any gain (sync
hybrid's iteration over its iteration without generation: Amdahl) and, with TRL, each configuration's wall-clock to TRL's final accuracy.  Written to ``--out``: ``long_tail.json``, ``long_tail.png`` and ``runs/``.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import statistics
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context
from typing import Dict, List

BENCH = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, BENCH)
clock = importlib.import_module("async")  # bench/async.py: the clock, the curves, the machine watch
ROOT = clock.ROOT
RECIPE = os.path.join(ROOT, "configs", "grpo_rsum_tiny.yaml")

ASYNC = ["async_rl.correction=tis", "rollout.reuse_rollout_log_probs=false"]


def configurations(etas: List[int], segment_tokens: int, extra_groups: int) -> List[tuple]:
    """(name, overrides) per megarl configuration, in the order they run."""
    partial = ["async_rl.partial_rollouts=true", f"async_rl.segment_tokens={segment_tokens}",
               f"async_rl.extra_groups={extra_groups}"]
    runs = [("sync hybrid", []), ("sync partial", partial)]
    runs += [(f"async split eta={e}", ["placement.mode=split", f"async_rl.max_staleness={e}", *ASYNC]) for e in etas]
    runs += [(f"async split eta={e} engine", ["placement.mode=split", f"async_rl.max_staleness={e}", *ASYNC,
                                              "async_rl.proximal_log_probs=engine"]) for e in etas]
    runs += [(f"partial eta={e}", [*partial, f"async_rl.max_staleness={e}", *ASYNC]) for e in etas]
    return runs


def run_stats(rows: List[dict]) -> dict:
    """What the issue asks per run, from its metrics.jsonl rows."""
    work = [r for r in rows[1:] or rows]
    charged = [r["e2e/iteration_s"] - r.get("e2e/stage_s/eval", 0.0) for r in work]
    out = {"generation_share": statistics.mean(r["rollout/generate_s"] / c for r, c in zip(work, charged)),
           "len_mean_over_max": statistics.mean(r["rollout/response_len_mean"] / r["rollout/response_len_max"]
                                                for r in work),
           "response_len_max": max(r["rollout/response_len_max"] for r in rows),
           "response_len_mean": statistics.mean(r["rollout/response_len_mean"] for r in rows)}
    for key in ("async/idle_share/rollout", "async/idle_share/trainer"):
        vals = [r[key] for r in work if key in r]
        if vals:
            out["idle_share_" + key.rsplit("/", 1)[1]] = statistics.mean(vals)
    stages = sorted({k for r in work for k in r if k.startswith("e2e/stage_s/") and k != "e2e/stage_s/eval"})
    out["stage_s"] = {k.rsplit("/", 1)[1]: statistics.mean(r.get(k, 0.0) for r in work) for k in stages}
    ages: Dict[str, float] = {}
    for r in rows:
        for k, v in r.items():
            if k.startswith("prep/staleness/samples_age_"):
                ages[k.rsplit("_", 1)[1]] = ages.get(k.rsplit("_", 1)[1], 0.0) + v / len(rows)
    out["staleness_histogram"] = dict(sorted(ages.items(), key=lambda kv: int(kv[0])))
    return out


def run_one(out: str, name: str, overrides: List[str], seed: int, iterations: int, eval_every: int) -> dict:
    clock.RECIPE, clock.RUN_ID = RECIPE, f"longtail-s{seed}"
    tag = f"{name} s{seed}"
    with clock.CpuWatch() as watch:
        r = clock.run_megarl(out, tag, [f"trainer.seed={seed}", *overrides], iterations, eval_every)
    r["machine"] = watch.report()
    rows = [json.loads(line) for line in open(os.path.join(r["run_dir"], "metrics.jsonl"))]
    r.update(run_stats(rows), config=name, seed=seed)
    accs = [p["accuracy"] for p in r["curve"]]
    r["final_accuracy"] = statistics.mean(accs[-3:])
    print(f"{tag}: {r['s_per_iter']:.2f} s/iter, final {r['final_accuracy']:.3f}, generation share "
          f"{r['generation_share']:.2f}, others {r['machine']['others_cpu_share']:.2f} cores", flush=True)
    return r


# ---- TRL -------------------------------------------------------------------------------------


def trl_task(seed: int) -> dict:
    """What TRL is given of the recipe: its files, B x G per optimizer step, scorer, lengths, lr,
    KL coefficient."""
    from megarl.config import load_config
    from megarl.data.tasks.running_sum import score

    cfg = load_config(RECIPE, [])
    return {"paths": (cfg.model.path, cfg.data.train_path, cfg.data.heldout_path),
            "batch": (cfg.trainer.prompts_per_iteration, cfg.rollout.n),
            "trainer": {"score": score, "max_new": cfg.rollout.max_new_tokens, "lr": cfg.actor.optim.lr,
                        "beta": cfg.algo.kl.beta, "seed": seed},
            "eval_n": cfg.eval.n, "eval_max_new": cfg.eval.max_new_tokens}


def greedy_accuracy(model_dir: str) -> float:
    """The held-out accuracy of an HF checkpoint as megarl's in-run evaluation takes it (greedy, the
    first ``eval.n`` held-out rows, the recipe's new-token limit), with transformers."""
    import torch

    from megarl.builtin.tasks.running_sum import greedy_answers

    torch.set_num_threads(1)
    task = trl_task(0)
    rows = [json.loads(line) for line in open(task["paths"][2])][:task["eval_n"]]
    right, _ = greedy_answers(model_dir, rows, max_new_tokens=task["eval_max_new"])
    return sum(right) / len(right)


def run_trl_seed(out: str, seed: int, iterations: int, eval_every: int, start_accuracy: float) -> dict:
    with clock.CpuWatch() as watch:
        t = clock.run_trl(out, iterations, eval_every, script=__file__, extra=["--seed", str(seed)],
                          name=f"trl_s{seed}")
    t["machine"] = watch.report()
    with ProcessPoolExecutor(max_workers=clock.NPROC, mp_context=get_context("spawn")) as pool:
        scores = list(pool.map(greedy_accuracy, [p["checkpoint"] for p in t["checkpoints"]]))
    t["curve"] = [{"iteration": 0, "clock_s": 0.0, "accuracy": start_accuracy}] + [
        {"iteration": p["iteration"], "clock_s": p["clock_s"], "accuracy": a} for p, a in zip(t["checkpoints"], scores)]
    t.update(config="TRL", seed=seed, final_accuracy=statistics.mean(scores[-3:]), staleness_histogram={})
    print(f"TRL s{seed}: {t['s_per_iter']:.2f} s/iter, final {t['final_accuracy']:.3f}", flush=True)
    return t


# ---- results ---------------------------------------------------------------------------------


def summarize(runs: List[dict], target: float) -> List[dict]:
    table = []
    trl = [r for r in runs if r["config"] == "TRL"]
    trl_level = statistics.mean(r["final_accuracy"] for r in trl) if trl else None
    for name in dict.fromkeys(r["config"] for r in runs):
        mine = [r for r in runs if r["config"] == name]
        for r in mine:
            r["to_target_s"] = clock.time_to(r["curve"], target)
            if trl_level is not None:
                r["to_trl_accuracy_s"] = clock.time_to(r["curve"], trl_level)
        reached = [r["to_target_s"] for r in mine if r["to_target_s"] is not None]
        row = {"config": name, "seeds": [r["seed"] for r in mine], "reached": len(reached),
               "to_target_s": statistics.mean(reached) if len(reached) == len(mine) else None,
               "to_target_s_each": [r["to_target_s"] for r in mine]}
        if trl_level is not None:
            each = [r["to_trl_accuracy_s"] for r in mine]
            row["to_trl_accuracy_s"] = statistics.mean(each) if None not in each else None
        for key in ("final_accuracy", "s_per_iter", "generation_share", "len_mean_over_max", "idle_share_rollout",
                    "idle_share_trainer"):
            vals = [r[key] for r in mine if key in r]
            if vals:
                row[key] = statistics.mean(vals)
        stages = dict.fromkeys(st for r in mine for st in r.get("stage_s", {}))
        row["stage_s"] = {st: statistics.mean(r["stage_s"].get(st, 0.0) for r in mine if "stage_s" in r) for st in stages}
        hist: Dict[str, float] = {}
        for r in mine:
            for a, v in r["staleness_histogram"].items():
                hist[a] = hist.get(a, 0.0) + v / len(mine)
        row["staleness_histogram"] = hist
        table.append(row)
    base = next((t for t in table if t["config"] == "sync hybrid"), None)
    if base is not None and base.get("stage_s", {}).get("generate") is not None:
        # Amdahl: with generation free and everything else as it is, an iteration of the same batch
        # still costs the rest; no configuration that trains the same batches, as many times, beats that
        rest = base["s_per_iter"] - base["stage_s"]["generate"]
        base["generation_free_speedup_bound"] = base["s_per_iter"] / rest if rest > 0 else None
    trl_row = next((t for t in table if t["config"] == "TRL"), None)
    for t in table:
        t["speedup_vs_sync_hybrid"] = clock.ratio(base and base["to_target_s"], t["to_target_s"])
        if trl_row is not None:
            t["speedup_vs_trl_to_trl_accuracy"] = clock.ratio(trl_row["to_trl_accuracy_s"], t["to_trl_accuracy_s"])
    return table


def print_table(res: dict) -> None:
    print(f"\ntarget {res['target']:.3f} ({res['target_rule']}); {res['iterations']} iterations, seeds {res['seeds']}")
    print(f"{'config':<27}{'to target s':>12}{'x hybrid':>9}{'x TRL':>7}{'final':>7}{'s/iter':>8}{'gen share':>10}"
          f"{'mean/max len':>13}{'idle roll':>10}{'idle train':>11}  staleness")
    for t in res["table"]:
        f = clock._f
        print(f"{t['config']:<27}{f(t['to_target_s']):>12}{f(t['speedup_vs_sync_hybrid'], '{:.2f}x', '-'):>9}"
              f"{f(t.get('speedup_vs_trl_to_trl_accuracy'), '{:.2f}x', '-'):>7}"
              f"{t['final_accuracy']:>7.3f}{t['s_per_iter']:>8.2f}{f(t.get('generation_share'), '{:.2f}', '-'):>10}"
              f"{f(t.get('len_mean_over_max'), '{:.2f}', '-'):>13}{f(t.get('idle_share_rollout'), '{:.2f}', '-'):>10}"
              f"{f(t.get('idle_share_trainer'), '{:.2f}', '-'):>11}  "
              + " ".join(f"{a}:{v:.2f}" for a, v in t["staleness_histogram"].items()))
    print("\nseconds per iteration by stage (mean over seeds; split placement: the trainer's)")
    for t in res["table"]:
        print(f"{t['config']:<27}" + ", ".join(f"{st} {v:.2f}" for st, v in t.get("stage_s", {}).items() if v >= 0.005))
    bound = next((t.get("generation_free_speedup_bound") for t in res["table"] if t["config"] == "sync hybrid"), None)
    if bound:
        print(f"with generation free, sync hybrid would be {bound:.2f}x faster per iteration: the most any configuration "
              "that trains the same batches as often can gain")


def plot(res: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 5))
    names = list(dict.fromkeys(r["config"] for r in res["runs"]))
    for i, name in enumerate(names):
        for j, r in enumerate(r for r in res["runs"] if r["config"] == name):
            ax.plot([p["clock_s"] for p in r["curve"]], [p["accuracy"] for p in r["curve"]], color=f"C{i}",
                    alpha=0.8, label=name if j == 0 else None)
    ax.axhline(res["target"], color="k", ls=":", label=f"target {res['target']:.3f}")
    ax.set_xlabel("wall-clock seconds (training only)")
    ax.set_ylabel("held-out greedy accuracy")
    ax.set_title("GRPO on the long-tail running-sum task, 2 CPU processes (one line per seed)", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--iterations", type=int, default=120)
    ap.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    ap.add_argument("--etas", type=int, nargs="*", default=[1, 2])
    ap.add_argument("--segment-tokens", type=int, default=32)
    ap.add_argument("--extra-groups", type=int, default=8)
    ap.add_argument("--only", nargs="*", default=None, help="run only these configurations (names as listed)")
    ap.add_argument("--eval-every", type=int, default=10)
    ap.add_argument("--hold-from", type=float, default=0.6)
    ap.add_argument("--target", type=float, default=None)
    ap.add_argument("--skip-trl", action="store_true")
    ap.add_argument("--out", default=os.path.join(ROOT, "runs", "bench_long_tail"))
    ap.add_argument("--trl-worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--seed", type=int, default=1, help=argparse.SUPPRESS)
    args = ap.parse_args()
    out = os.path.abspath(args.out)
    if args.trl_worker:
        return clock.trl_worker(out, args.iterations, args.eval_every, task=trl_task(args.seed))
    os.makedirs(out, exist_ok=True)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    t0 = time.time()
    runs = []
    for name, overrides in configurations(args.etas, args.segment_tokens, args.extra_groups):
        if args.only and name not in args.only:
            continue
        for seed in args.seeds:
            runs.append(run_one(out, name, overrides, seed, args.iterations, args.eval_every))
    if not args.skip_trl and (not args.only or "TRL" in args.only):
        start = greedy_accuracy(trl_task(0)["paths"][0])
        runs += [run_trl_seed(out, seed, args.iterations, args.eval_every, start) for seed in args.seeds]
    hybrid = [r for r in runs if r["config"] == "sync hybrid"]
    if args.target is not None or not hybrid:
        target, rule = args.target or 0.0, "fixed by --target"
    else:
        hold = int(round(args.hold_from * args.iterations))
        target = statistics.mean(min(p["accuracy"] for p in r["curve"] if p["iteration"] >= hold) for r in hybrid)
        rule = f"the mean over sync hybrid seeds of the lowest evaluation from iteration {hold} on"
    res = {"iterations": args.iterations, "seeds": args.seeds, "target": target, "target_rule": rule,
           "segment_tokens": args.segment_tokens, "extra_groups": args.extra_groups, "bench_wall_s": time.time() - t0,
           "cpus": os.cpu_count(), "runs": runs}
    res["table"] = summarize(runs, target)
    print_table(res)
    with open(os.path.join(out, "long_tail.json"), "w") as f:
        json.dump(res, f, indent=1)
    plot(res, os.path.join(out, "long_tail.png"))
    print(f"wrote {os.path.join(out, 'long_tail.json')} and {os.path.join(out, 'long_tail.png')}")


if __name__ == "__main__":
    main()
