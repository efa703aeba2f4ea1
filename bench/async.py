#!/usr/bin/env python
"""Wall-clock to the tiny GRPO recipe's target held-out accuracy: asynchronous vs synchronous
megarl, and TRL, all on the same 2 processes of this 2-core CPU (issue 21, "Measure").

    pip install -e ".[bench]"          # TRL is a bench extra, never a runtime dependency
    python bench/async.py [--iterations 200] [--etas 1 2 4] [--skip-trl] [--out DIR]

The runs, one after the other, each a fresh ``torchrun --nproc-per-node 2`` (one torch thread
per process), every one the recipe ``configs/grpo_arith_tiny.yaml`` with the same start model,
task, batch (B=16 prompts x G=8 samples), lengths, lr, seed and run id (the sampling seeds
derive from it), and the same number of iterations (one optimizer step each); megarl logs to
metrics.jsonl only (``trainer.loggers=[jsonl]``, no sample tables) and evaluates every
``--eval-every`` iterations instead of the recipe's 20:

1. ``sync hybrid``: the recipe's defaults, DP=2 (both processes train and generate, time-sliced);
2. ``sync split``: ``placement.mode=split``, eta 0 (1 trainer rank + 1 rollout rank);
3. ``async eta=k``: split with ``async_rl.max_staleness=k`` (generation runs up to k optimizer
   steps ahead of training), ``async_rl.correction=tis``, ``rollout.reuse_rollout_log_probs=false``;
4. ``TRL``: TRL's ``GRPOTrainer`` under ``torchrun --nproc-per-node 2`` in its own data-parallel
   mode (gloo; 64 samples = 8 prompts x 8 per process, 128 per optimizer step), set up by
   ``bench/vs_trl.py``'s ``trl_trainer`` (the same model, task, reward, batch, lengths, lr, clip,
   KL as megarl's recipe; the known differences are listed there).

**The clock.**  Each run's clock starts when its first iteration (TRL: its first optimizer
step) begins, so process start-up (reported apart, ``startup_s``) is not in it, and stops at the
end of its last.  Held-out evaluation is not charged to anyone: megarl evaluates in-run every
``--eval-every`` iterations (greedy, ``eval.n`` = 200 held-out prompts), and its
``e2e/stage_s/eval`` (and the final evaluation's ``eval/seconds``) are subtracted from its clock;
TRL saves its weights at the same iterations inside the run (the save time is subtracted from
its clock) and they are scored afterwards, outside any clock, by ``vs_trl.evaluate`` (the same
greedy evaluation of the same 200 held-out prompts; the bench checks that it gives megarl's
in-run figure on megarl's own final export, ``eval_check`` in the JSON).  An accuracy is placed
on the clock at the moment its weights were committed: the version after iteration k at the end
of iteration k.  ``s/iter`` is the charged clock over the iterations.

**The target** (``--target`` overrides it): the held-out accuracy the synchronous hybrid run
*holds* from ``--hold-from`` (default 60 %) of its iterations on, i.e. the lowest of its
evaluations at or after that iteration.  A run's wall-clock to target is the clock at its first
evaluation at or above the target ("not reached" if none within its iterations); the JSON also
has ``to_target_held_s`` (from that evaluation on every later one stays at or above it) and
``to_target_with_startup_s`` (start-up added).  Speed-ups are ratios of wall-clock to target
(> 1: the async run is faster), for each eta against sync split, sync hybrid and TRL.  Against
TRL also: each run's wall-clock to TRL's final accuracy, and TRL's own to it.

The issue's goals: >= 1.6x less wall-clock to target than synchronous on the same 2 processes,
and TRL's accuracy in less wall-clock than TRL.  Written to ``--out``: ``async.json`` (every
number and curve, with each megarl run's median seconds per stage), ``async.png`` (accuracy
vs wall-clock, one line per run, the target dotted; right: the mean of the last 3 evaluations)
and ``runs/`` (each run's metrics.jsonl and exports; TRL's checkpoints).  The machine is a
shared VM: the JSON records the load average and the CPU time of other processes during each
run (``others_cpu_share``: their CPU seconds over the run's wall seconds, in cores).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context
from typing import Dict, List, Optional

BENCH = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, BENCH)
import vs_trl  # noqa: E402  (bench/vs_trl.py: TRL's setup, the greedy evaluation, the shared constants)

ROOT, RECIPE = vs_trl.ROOT, vs_trl.RECIPE
RUN_ID = "asyncbench"  # one run id for every megarl run: the same prompt order and sampling seeds
NPROC = 2


def _torchrun(*args: str) -> List[str]:
    # --standalone: a free rendezvous port of its own (others may run torchrun on this machine)
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={NPROC}", *args]


def megarl_runs(etas: List[int]) -> List[tuple]:
    """(name, overrides) per megarl run, in the order they run."""
    runs = [("sync hybrid", []), ("sync split", ["placement.mode=split"])]
    for eta in etas:
        runs.append((f"async eta={eta}", ["placement.mode=split", f"async_rl.max_staleness={eta}",
                                          "async_rl.correction=tis", "rollout.reuse_rollout_log_probs=false"]))
    return runs


# ---- what else runs on the machine ------------------------------------------------------------


class CpuWatch:
    """CPU seconds used by processes outside this bench's process tree while a run goes (a
    sample of /proc every ``period`` s, in a thread): the machine is shared."""

    def __init__(self, period: float = 2.0):
        import threading

        self.period, self.ticks = period, os.sysconf("SC_CLK_TCK")
        self.last: Dict[int, float] = {}
        self.used: Dict[str, float] = {}
        self.stop_ev = threading.Event()
        self.thread = threading.Thread(target=self._loop, daemon=True)

    @staticmethod
    def _procs():
        out = {}
        for d in os.listdir("/proc"):
            if not d.isdigit():
                continue
            try:
                with open(f"/proc/{d}/stat") as f:
                    s = f.read()
                rest = s[s.rindex(")") + 2:].split()
                with open(f"/proc/{d}/cmdline", "rb") as f:
                    cmd = f.read().replace(b"\0", b" ").decode(errors="replace").strip()[:120]
                out[int(d)] = (int(rest[1]), int(rest[11]) + int(rest[12]), cmd or s[s.index("(") + 1:s.rindex(")")])
            except (OSError, ValueError, IndexError):
                continue
        return out

    def _sample(self, first: bool = False) -> None:
        procs, me = self._procs(), os.getpid()

        def ours(pid):
            seen = 0
            while pid > 1 and seen < 64:
                if pid == me:
                    return True
                pid, seen = procs[pid][0] if pid in procs else 0, seen + 1
            return False

        for pid, (_, t, cmd) in procs.items():
            before = self.last.get(pid, None if first else 0)
            self.last[pid] = t
            if before is None or ours(pid):
                continue
            if t > before:
                self.used[cmd] = self.used.get(cmd, 0.0) + (t - before) / self.ticks

    def _loop(self):
        while not self.stop_ev.wait(self.period):
            self._sample()

    def __enter__(self):
        self.t0, self.load0 = time.time(), os.getloadavg()
        self._sample(first=True)
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.stop_ev.set()
        self.thread.join()
        self._sample()
        self.wall = time.time() - self.t0
        self.load1 = os.getloadavg()

    def report(self) -> dict:
        top = sorted(self.used.items(), key=lambda kv: -kv[1])[:4]
        return {"wall_s": self.wall, "loadavg_1m_before": self.load0[0], "loadavg_1m_after": self.load1[0],
                "others_cpu_share": sum(self.used.values()) / max(self.wall, 1e-9),
                "others_top": [{"cmd": c, "cpu_s": round(s, 1)} for c, s in top if s >= 1.0]}


# ---- megarl ----------------------------------------------------------------------------------


def megarl_curve(rows: List[dict]) -> dict:
    """Held-out accuracy vs the charged clock from a run's metrics.jsonl (the module docstring:
    the clock starts when iteration 0 begins; evaluation time is subtracted)."""
    t0 = rows[0]["time"] - rows[0]["e2e/iteration_s"]
    committed = {0: 0.0}  # policy version -> charged clock when it was committed
    eval_s = 0.0
    points = []
    for r in rows:
        if "e2e/stage_s/eval" in r:  # a periodic evaluation, inside the iteration's timer
            eval_s += r["e2e/stage_s/eval"]
        elif "eval/seconds" in r:  # the final evaluation, after the last iteration, before its row
            eval_s += r["eval/seconds"]
        committed[r["iteration"] + 1] = r["time"] - t0 - eval_s
        if "eval/accuracy" in r:
            points.append((int(r["eval/policy_version_step"]), r["eval/accuracy"]))
    curve = [{"iteration": v, "clock_s": committed[v], "accuracy": a} for v, a in points]
    iters = len(rows)
    stages = sorted({k for r in rows for k in r if k.startswith("e2e/stage_s/") and k != "e2e/stage_s/eval"})
    return {"curve": curve, "train_s": committed[iters], "eval_s": eval_s, "iterations": iters,
            "median_stage_s": {k.rsplit("/", 1)[1]: statistics.median(r.get(k, 0.0) for r in rows[1:] or rows)
                               for k in stages},
            "s_per_iter": committed[iters] / iters,
            "median_iteration_s": statistics.median(r["e2e/iteration_s"] - r.get("e2e/stage_s/eval", 0.0)
                                                    for r in rows[1:] or rows)}


def run_megarl(out: str, name: str, overrides: List[str], iterations: int, eval_every: int) -> dict:
    run_dir = os.path.join(out, "runs", name.replace(" ", "_").replace("=", ""))
    if os.path.exists(run_dir):
        shutil.rmtree(run_dir)
    cmd = _torchrun("-m", "megarl.train", "--config", RECIPE, f"trainer.run_dir={run_dir}",
                    f"trainer.run_id={RUN_ID}", f"trainer.iterations={iterations}", f"eval.every={eval_every}",
                    "trainer.loggers=[jsonl]", "trainer.log_samples_every=0", *overrides)
    os.makedirs(os.path.dirname(run_dir), exist_ok=True)
    launch = time.time()
    with open(run_dir + ".log", "w") as log:
        proc = subprocess.run(cmd, env=vs_trl._env(), cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    if proc.returncode != 0:
        raise SystemExit(f"{name}: megarl exited {proc.returncode}; see {run_dir}.log")
    rows = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))]
    res = megarl_curve(rows)
    res.update(name=name, command=" ".join(cmd[2:]), run_dir=run_dir,
               startup_s=rows[0]["time"] - rows[0]["e2e/iteration_s"] - launch,
               final_export=os.path.join(run_dir, "export", f"iter_{iterations}"))
    staleness = [r["prep/staleness/max_token_age"] for r in rows if "prep/staleness/max_token_age" in r]
    if staleness:
        res["max_token_age"] = max(staleness)
        res["mean_sample_age"] = statistics.mean(r.get("prep/staleness/mean_sample_age", 0.0) for r in rows)
    for key in ("async/idle_share/rollout", "async/idle_share/trainer", "async/queue_depth"):
        vals = [r[key] for r in rows[1:] if key in r]
        if vals:
            res["mean_" + key.replace("async/", "").replace("/", "_")] = statistics.mean(vals)
    return res


# ---- TRL -------------------------------------------------------------------------------------


def trl_worker(out: str, iterations: int, eval_every: int, task: Optional[dict] = None) -> None:
    """One of the 2 torchrun processes of the TRL run: trains, saves the weights at every
    ``eval_every`` steps and at the end (rank 0; the save time is kept apart), writes the clock.
    ``task``: another recipe's ``paths`` (model, train, held-out), ``batch`` (prompts, samples per
    prompt per optimizer step) and ``trainer`` (keyword arguments of ``vs_trl.trl_trainer``:
    scorer, lengths, lr, beta, seed); default the arithmetic recipe's (bench/long_tail.py passes
    the running-sum recipe's)."""
    import torch
    from transformers import TrainerCallback

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    task = task or {}
    model_dir, train_path, _ = task.get("paths") or vs_trl.recipe_paths()

    class Clock(TrainerCallback):
        """Charged clock: from the first step's begin, less the checkpoint saves."""

        def __init__(self):
            self.t0, self.save_s, self.points, self.step_s = None, 0.0, [], []

        def on_step_begin(self, args, state, control, **kw):
            self.begin = time.time()
            if self.t0 is None:
                self.t0 = self.begin

        def on_step_end(self, args, state, control, model=None, **kw):
            now = time.time()
            self.step_s.append(now - self.begin)
            step = state.global_step
            if step % eval_every == 0 or step == iterations:
                ckpt = os.path.join(out, "checkpoints", f"step_{step}")
                if state.is_world_process_zero:
                    model.save_pretrained(ckpt)
                    tok.save_pretrained(ckpt)
                self.points.append({"iteration": step, "clock_s": now - self.t0 - self.save_s, "checkpoint": ckpt})
                self.save_s += time.time() - now  # rank 1 waits for it at the next collective

    clock = Clock()
    prompts, G = task.get("batch", (vs_trl.B, vs_trl.G))
    trainer, tok = vs_trl.trl_trainer(os.path.join(out, "trl_out"), iterations, model_dir, train_path,
                                      callbacks=[clock], per_device_train_batch_size=prompts * G // world,
                                      num_generations=G, ddp_backend="gloo", **task.get("trainer", {}))
    first = time.time()
    trainer.train()
    if trainer.state.is_world_process_zero:
        lengths = [float(h["completions/mean_length"]) for h in trainer.state.log_history
                   if "completions/mean_length" in h]
        with open(os.path.join(out, "clock.json"), "w") as f:
            json.dump({"t0": clock.t0, "train_called": first, "save_s": clock.save_s, "points": clock.points,
                       "step_s": clock.step_s, "response_len_mean": lengths,
                       "world": trainer.accelerator.num_processes}, f)


def run_trl(out: str, iterations: int, eval_every: int, script: Optional[str] = None, extra: List[str] = (),
            name: str = "trl") -> dict:
    """TRL under torchrun: ``script --trl-worker ...`` (default this file) with ``extra`` arguments,
    in ``out/runs/<name>``."""
    trl_dir = os.path.join(out, "runs", name)
    if os.path.exists(trl_dir):
        shutil.rmtree(trl_dir)
    os.makedirs(trl_dir)
    cmd = _torchrun(os.path.abspath(script or __file__), "--trl-worker", "--out", trl_dir, "--iterations",
                    str(iterations), "--eval-every", str(eval_every), *extra)
    launch = time.time()
    with open(trl_dir + ".log", "w") as log:
        proc = subprocess.run(cmd, env=vs_trl._env(), cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    if proc.returncode != 0:
        raise SystemExit(f"TRL exited {proc.returncode}; see {trl_dir}.log")
    c = json.load(open(os.path.join(trl_dir, "clock.json")))
    train_s = c["points"][-1]["clock_s"]
    import trl

    return {"name": "TRL", "trl_version": trl.__version__, "command": " ".join(cmd[2:]), "run_dir": trl_dir,
            "startup_s": c["t0"] - launch, "save_s": c["save_s"], "train_s": train_s, "iterations": iterations,
            "s_per_iter": train_s / iterations, "median_iteration_s": statistics.median(c["step_s"][1:] or c["step_s"]),
            "checkpoints": c["points"], "response_len_mean": statistics.mean(c["response_len_mean"] or [0.0])}


def _evaluate(model_dir: str) -> float:
    import torch
    from transformers.utils import logging

    torch.set_num_threads(1)
    logging.disable_progress_bar()
    return vs_trl.evaluate(model_dir, vs_trl.recipe_paths()[2])


# ---- results ---------------------------------------------------------------------------------


def time_to(curve: List[dict], level: float) -> Optional[float]:
    """The clock at the first evaluation at or above ``level`` (None: never)."""
    for p in curve:
        if p["accuracy"] >= level - 1e-9:
            return p["clock_s"]
    return None


def time_held(curve: List[dict], level: float) -> Optional[float]:
    """The clock at the first evaluation from which every later one stays at or above ``level``."""
    held = None
    for p in curve:
        if p["accuracy"] >= level - 1e-9:
            held = p["clock_s"] if held is None else held
        else:
            held = None
    return held


def ratio(a: Optional[float], b: Optional[float]) -> Optional[float]:
    return a / b if a is not None and b is not None and b > 0 else None


def summarize(runs: List[dict], target: float, trl_level: Optional[float]) -> None:
    by = {r["name"]: r for r in runs}
    for r in runs:
        accs = [p["accuracy"] for p in r["curve"]]
        r.update(best_accuracy=max(accs), final_accuracy=accs[-1], to_target_s=time_to(r["curve"], target),
                 to_target_held_s=time_held(r["curve"], target),
                 to_trl_accuracy_s=time_to(r["curve"], trl_level) if trl_level is not None else None)
        r["to_target_with_startup_s"] = None if r["to_target_s"] is None else r["to_target_s"] + r["startup_s"]
    for r in runs:
        if r["name"].startswith("async"):
            r["speedup_vs_sync_split"] = ratio(by["sync split"]["to_target_s"], r["to_target_s"])
            r["speedup_vs_sync_hybrid"] = ratio(by["sync hybrid"]["to_target_s"], r["to_target_s"])
            if "TRL" in by:
                r["speedup_vs_trl"] = ratio(by["TRL"]["to_target_s"], r["to_target_s"])
        if "TRL" in by and r["name"] != "TRL":
            r["speedup_vs_trl_to_trl_accuracy"] = ratio(by["TRL"]["to_trl_accuracy_s"], r["to_trl_accuracy_s"])


def _f(x, fmt="{:.1f}", none="not reached"):
    return none if x is None else fmt.format(x)


def print_table(res: dict) -> None:
    runs = res["runs"]
    print(f"\ntarget held-out accuracy {res['target']:.3f} ({res['target_rule']}); start {res['start_accuracy']:.3f}; "
          f"{res['iterations']} iterations, eval every {res['eval_every']}, B=16 x G=8, 2 processes")
    hdr = (f"{'run':<14}{'to target s':>12}{'best':>7}{'final':>7}{'s/iter':>8}{'startup s':>10}"
           f"{'x split':>9}{'x hybrid':>9}{'x TRL':>7}{'to TRL acc s':>13}{'x TRL@acc':>10}{'others':>8}")
    print(hdr)
    for r in runs:
        print(f"{r['name']:<14}{_f(r['to_target_s']):>12}{r['best_accuracy']:>7.3f}{r['final_accuracy']:>7.3f}"
              f"{r['s_per_iter']:>8.3f}{r['startup_s']:>10.1f}"
              f"{_f(r.get('speedup_vs_sync_split'), '{:.2f}x', '-'):>9}"
              f"{_f(r.get('speedup_vs_sync_hybrid'), '{:.2f}x', '-'):>9}"
              f"{_f(r.get('speedup_vs_trl'), '{:.2f}x', '-'):>7}"
              f"{_f(r.get('to_trl_accuracy_s'), '{:.1f}', 'no' if res.get('trl_accuracy') is not None else '-'):>13}"
              f"{_f(r.get('speedup_vs_trl_to_trl_accuracy'), '{:.2f}x', '-'):>10}"
              f"{r['machine']['others_cpu_share']:>8.2f}")
    print("to target / to TRL acc: charged seconds (evaluation and TRL's checkpoint saves excluded) to the first "
          "evaluation at or above the level;\nx split / x hybrid / x TRL: that run's speed-up in wall-clock to "
          "target (> 1 = faster); others: CPU cores used by other processes during the run")
    if res.get("eval_check"):
        e = res["eval_check"]
        print(f"evaluation check on {e['run']}'s final export: vs_trl.evaluate {e['evaluate']:.3f}, "
              f"megarl in-run {e['in_run']:.3f}")


def plot(res: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(13, 4.8), sharey=True)
    styles = {"sync hybrid": ("k", "-"), "sync split": ("gray", "-"), "TRL": ("C3", "--")}
    for smooth, ax in zip((1, 3), axes):
        for i, r in enumerate(res["runs"]):
            color, ls = styles.get(r["name"], (f"C{i - 2}", "-"))
            accs = [p["accuracy"] for p in r["curve"]]
            accs = [statistics.mean(accs[max(0, j - smooth + 1):j + 1]) for j in range(len(accs))]
            ax.plot([p["clock_s"] for p in r["curve"]], accs, ls, color=color, marker="." if smooth == 1 else None,
                    label=f"{r['name']} ({_f(r['to_target_s'], '{:.0f} s', 'not reached')})")
        ax.axhline(res["target"], color="C2", ls=":", label=f"target {res['target']:.3f}")
        ax.set_xlabel("wall-clock seconds (training only: evaluation and start-up excluded)")
        ax.set_title("each evaluation" if smooth == 1 else f"mean of the last {smooth} evaluations", fontsize=9)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("held-out greedy accuracy (n=200)")
    axes[0].legend(fontsize=8, loc="lower right")
    fig.suptitle(f"GRPO tiny arithmetic, 2 CPU processes, {res['iterations']} iterations: accuracy vs wall-clock "
                 "(legend: wall-clock to target)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--iterations", type=int, default=200)
    ap.add_argument("--etas", type=int, nargs="*", default=[1, 2, 4])
    ap.add_argument("--skip-trl", action="store_true")
    ap.add_argument("--out", default=os.path.join(ROOT, "runs", "bench_async"))
    ap.add_argument("--eval-every", type=int, default=10, help="iterations between held-out evaluations")
    ap.add_argument("--hold-from", type=float, default=0.6,
                    help="share of the iterations from which the sync hybrid run's held accuracy is the target")
    ap.add_argument("--target", type=float, default=None, help="a fixed target accuracy instead of the rule")
    ap.add_argument("--trl-worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    out = os.path.abspath(args.out)
    if args.trl_worker:
        return trl_worker(out, args.iterations, args.eval_every)
    os.makedirs(out, exist_ok=True)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    t_bench = time.time()
    runs = []
    for name, overrides in megarl_runs(args.etas):
        with CpuWatch() as watch:
            r = run_megarl(out, name, overrides, args.iterations, args.eval_every)
        r["machine"] = watch.report()
        runs.append(r)
        print(f"{name}: {r['s_per_iter']:.3f} s/iter, final accuracy {r['curve'][-1]['accuracy']:.3f}, "
              f"others {r['machine']['others_cpu_share']:.2f} cores", flush=True)
    t = None
    if not args.skip_trl:
        with CpuWatch() as watch:
            t = run_trl(out, args.iterations, args.eval_every)
        t["machine"] = watch.report()
        print(f"TRL: {t['s_per_iter']:.3f} s/iter; scoring {len(t['checkpoints'])} checkpoints", flush=True)
    # scoring, outside every clock, two at a time: the start model, megarl's final export (the
    # check that vs_trl.evaluate and megarl's in-run evaluation agree) and TRL's checkpoints
    jobs = [vs_trl.recipe_paths()[0], runs[0]["final_export"]]
    jobs += [p["checkpoint"] for p in (t or {}).get("checkpoints", [])]
    with ProcessPoolExecutor(max_workers=NPROC, mp_context=get_context("spawn")) as pool:
        scores = list(pool.map(_evaluate, jobs))
    start_eval, check = scores[0], scores[1]
    if t is not None:
        t["curve"] = [{"iteration": 0, "clock_s": 0.0, "accuracy": start_eval}] + [
            {"iteration": p["iteration"], "clock_s": p["clock_s"], "accuracy": a}
            for p, a in zip(t["checkpoints"], scores[2:])]
        runs.append(t)
    hybrid = runs[0]
    if args.target is not None:
        target, rule = args.target, "fixed by --target"
    else:
        hold = int(round(args.hold_from * args.iterations))
        held = [p["accuracy"] for p in hybrid["curve"] if p["iteration"] >= hold]
        target, rule = min(held), f"the lowest sync hybrid evaluation from iteration {hold} on"
    trl_level = t["curve"][-1]["accuracy"] if t is not None else None
    summarize(runs, target, trl_level)
    res = {"iterations": args.iterations, "eval_every": args.eval_every, "etas": args.etas, "target": target,
           "target_rule": rule, "trl_accuracy": trl_level, "start_accuracy": hybrid["curve"][0]["accuracy"],
           "start_accuracy_evaluate": start_eval, "bench_wall_s": time.time() - t_bench,
           "eval_check": {"run": hybrid["name"], "evaluate": check, "in_run": hybrid["curve"][-1]["accuracy"]},
           "nproc": NPROC, "cpus": os.cpu_count(), "runs": runs}
    print_table(res)
    with open(os.path.join(out, "async.json"), "w") as f:
        json.dump(res, f, indent=1)
    plot(res, os.path.join(out, "async.png"))
    print(f"wrote {os.path.join(out, 'async.json')} and {os.path.join(out, 'async.png')}")


if __name__ == "__main__":
    main()
