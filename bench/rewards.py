#!/usr/bin/env python
"""Reward scoring throughput: worker threads vs worker processes (reward.isolation).

    python bench/rewards.py                 # math_verify on 200 samples + the tiny recipe's arithmetic
    python bench/rewards.py --n 400 --workers 2 4

* math_verify on ``--n`` realistic samples (boxed integers, fractions, decimals, roots, powers,
  intervals; about a third wrong), samples/s through a :class:`RewardRunner` on threads and on a
  process pool of the same size, after one warm-up pass (pool start-up excluded);
* arithmetic (the tiny recipes' scorer) on one iteration's 128 samples (B=16 x G=8): ms per
  ``score`` on threads and on processes -- why ``reward.isolation=auto`` keeps it on threads.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault("OMP_NUM_THREADS", "1")


def math_samples(n: int, seed: int = 0):
    from megarl.rewards import RewardSample

    rng = random.Random(seed)
    out = []
    for i in range(n):
        a, b = rng.randint(1, 50), rng.randint(2, 12)
        kind = i % 6
        if kind == 0:
            gold, pred = str(a * b), rf"\boxed{{{a * b}}}"
        elif kind == 1:
            gold, pred = rf"\frac{{{a}}}{{{b}}}", rf"\boxed{{\frac{{{2 * a}}}{{{2 * b}}}}}"
        elif kind == 2:
            gold, pred = f"{a / 4}", rf"\boxed{{\frac{{{a}}}{{4}}}}"
        elif kind == 3:
            gold, pred = rf"{b}\sqrt{{{a}}}", rf"\boxed{{\sqrt{{{a * b * b}}}}}"
        elif kind == 4:
            gold, pred = rf"x^{{{b}}}", rf"\boxed{{x^{{{b}}}}}"
        else:
            gold, pred = rf"[{a}, {a + b}]", rf"\boxed{{[{a}, {a + b}]}}"
        if rng.random() < 0.33:
            pred = rf"\boxed{{{a + b + 1000}}}"
        text = f"Let me work through this step by step. First we compute the pieces, then combine them. {pred}"
        out.append(RewardSample(sample_id=f"s{i}", prompt_id=f"p{i}", group_id=f"g{i}", prompt_text="Solve.",
                                response_text=text, prompt_ids=(), response_ids=(), finish_reason="eos",
                                ground_truth={"answer": gold}))
    return out


def arith_samples(n: int = 128):
    from megarl.rewards import RewardSample

    return [RewardSample(sample_id=f"s{i}", prompt_id="p", group_id="g", prompt_text="1 2 + 3 4 =",
                         response_text=" ".join(str(46 + i % 2)), prompt_ids=(), response_ids=(), finish_reason="eos",
                         ground_truth={"answer": "46"}) for i in range(n)]


def run(fn: str, isolation: str, workers: int, samples, repeats: int):
    from megarl.rewards import RewardRunner, build_reward_function

    spec = {"fn": fn}
    with RewardRunner(build_reward_function(fn), timeout_s=60, max_workers=workers, isolation=isolation,
                      spec=spec) as r:
        warm = r.score(samples)  # thread: first-call costs; process: the pool's start-up
        times = []
        for _ in range(repeats):
            t = time.perf_counter()
            recs = r.score(samples)
            times.append(time.perf_counter() - t)
        assert [x.to_json() for x in recs] == [x.to_json() for x in warm], "scores differ between passes"
        return statistics.median(times), recs


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=200)
    ap.add_argument("--workers", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    print(f"cpus: {os.cpu_count()}  python {sys.version.split()[0]}")
    ms = math_samples(args.n)
    for w in args.workers:
        res = {}
        for iso in ("thread", "process"):
            dt, recs = run("math_verify", iso, w, ms, args.repeats)
            res[iso] = recs
            ok = sum(x.total == 1.0 for x in recs)
            print(f"math_verify  n={args.n} workers={w} {iso:7s}: {args.n / dt:8.1f} samples/s  ({dt * 1e3:.0f} ms/pass, "
                  f"{ok} correct)", flush=True)
        assert [x.to_json() for x in res["thread"]] == [x.to_json() for x in res["process"]]
    a = arith_samples()
    for iso in ("thread", "process"):
        dt, _ = run("arithmetic", iso, 4, a, max(args.repeats, 5))
        print(f"arithmetic   n={len(a)} workers=4 {iso:7s}: {dt * 1e3:8.2f} ms per score()  ({len(a) / dt:.0f} samples/s)",
              flush=True)


if __name__ == "__main__":
    main()
