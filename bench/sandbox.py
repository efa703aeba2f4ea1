#!/usr/bin/env python
"""What a code_exec run costs before the program runs, by sandbox: bubblewrap's private root,
the hand-written unshare launcher, and no namespaces.

    python bench/sandbox.py [--runs 30]

Each run is one ``CodeExec._run`` of a program that prints one line.  Printed per sandbox: the
median and p90 of start-up (spawn to the program's first line: namespaces, mounts, the user
drop, the interpreter's start-up) and of the whole run (spawn to the work directory removed),
in milliseconds, and what took effect.  Speed is this machine's, printed, never asserted.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--runs", type=int, default=30)
    a = p.parse_args()
    from megarl.rewards.code_exec import CodeExec

    kinds = {"bwrap": {"sandbox": "bwrap"}, "unshare": {"sandbox": "unshare"}, "none": {"namespaces": False}}
    rows = {}
    for name, kw in kinds.items():
        try:
            f = CodeExec(timeout_s=5.0, **kw)
        except Exception as e:  # bubblewrap missing: say so, measure the rest
            print(f"{name:8s} unavailable: {e}")
            continue
        f._run("print(1)", "")  # warm the page cache and the interpreter query
        start, whole = [], []
        for _ in range(a.runs):
            t = time.perf_counter()
            run = f._run("print(1)", "")
            whole.append(time.perf_counter() - t)
            start.append(run["startup_s"])
            assert run["stdout"].strip() == "1", run
        q = lambda xs, p: sorted(xs)[min(len(xs) - 1, int(p * len(xs)))] * 1e3  # noqa: E731
        iso = {k.split("/", 1)[1]: v for k, v in f.metrics().items() if k.startswith("isolation/") and v}
        rows[name] = {"startup_ms_median": statistics.median(start) * 1e3, "startup_ms_p90": q(start, 0.9),
                      "run_ms_median": statistics.median(whole) * 1e3, "run_ms_p90": q(whole, 0.9),
                      "in_effect": sorted(iso)}
        r = rows[name]
        print(f"{name:8s} start-up {r['startup_ms_median']:6.1f} ms (p90 {r['startup_ms_p90']:6.1f})   "
              f"whole run {r['run_ms_median']:6.1f} ms (p90 {r['run_ms_p90']:6.1f})   {','.join(r['in_effect'])}")
    print(json.dumps(rows))


if __name__ == "__main__":
    main()
