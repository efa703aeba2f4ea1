#!/usr/bin/env python
"""Summarise iteration timelines recorded with ``trainer.profile_iterations``.

    python tools/timeline_summary.py RUN_DIR/profile/iter_3.rank*.json [--json out.json]

Reads the Chrome trace of each rank (the ``megarl/<phase> it=.. role=.. v=..`` spans of
``megarl/observability/profiling.py``) and prints, per phase in the order it ran: the slowest rank's duration
and its share of the iteration, the time each rank spent inside collectives during the phase
(waiting for the others), and the straggler -- the rank that waited least, i.e. the one the
others waited for.  The critical path of a synchronous iteration is its phases in order, each
as long as its slowest rank; what the spans do not cover is the controller's own time.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from collections import OrderedDict
from typing import List, Tuple

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megarl.observability.profiling import parse_label  # noqa: E402

COLLECTIVE = re.compile(r"gloo|nccl|c10d|all_?reduce|all_?gather|broadcast|barrier|reduce_scatter|"
                        r"alltoall|record_param_comms", re.I)


def load_trace(path: str) -> List[dict]:
    with open(path) as f:
        data = json.load(f)
    events = data["traceEvents"] if isinstance(data, dict) else data
    if not isinstance(events, list):
        raise ValueError(f"{path}: not a Chrome trace (no traceEvents list)")
    return [e for e in events if e.get("ph") == "X" and "dur" in e]


def _union(intervals: List[Tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total


def summarize_rank(events: List[dict]) -> dict:
    spans = []
    for e in events:
        lab = parse_label(e["name"])
        if lab is not None:
            spans.append((float(e["ts"]), float(e["ts"]) + float(e["dur"]), lab))
    if not spans:
        raise ValueError("no megarl/ spans in this trace (was it recorded with trainer.profile_iterations?)")
    its = [s for s in spans if s[2]["phase"] == "iteration"]
    t0, t1 = (its[0][0], its[0][1]) if its else (min(s[0] for s in spans), max(s[1] for s in spans))
    phases = [s for s in spans if s[2]["phase"] != "iteration"]
    # top level: not inside another phase span (a nested phase is part of its parent's time)
    top = [s for s in phases if not any(o is not s and o[0] <= s[0] and s[1] <= o[1] and (o[1] - o[0]) > (s[1] - s[0])
                                        for o in phases)]
    comms = [(float(e["ts"]), float(e["ts"]) + float(e["dur"])) for e in events
             if parse_label(e["name"]) is None and COLLECTIVE.search(e["name"])]
    out: "OrderedDict[str, dict]" = OrderedDict()
    for a, b, lab in sorted(top, key=lambda s: s[0]):
        p = out.setdefault(lab["phase"], {"us": 0.0, "wait_us": 0.0, "role": lab.get("role"), "start": a,
                                          "labels": lab})
        p["us"] += b - a
        p["wait_us"] += _union([(max(a, x), min(b, y)) for x, y in comms if x < b and y > a])
    return {"iteration_us": t1 - t0, "phases": out, "iteration": (its[0][2] if its else {}).get("it"),
            "version": (its[0][2] if its else {}).get("v")}


def summarize(paths: List[str]) -> dict:
    ranks = [summarize_rank(load_trace(p)) for p in paths]
    order: List[str] = []
    for r in ranks:
        for name in r["phases"]:
            if name not in order:
                order.append(name)
    rows = []
    it_max = max(r["iteration_us"] for r in ranks)
    for name in order:
        durs = [r["phases"].get(name, {}).get("us", 0.0) for r in ranks]
        waits = [r["phases"].get(name, {}).get("wait_us", 0.0) for r in ranks]
        slow = max(range(len(ranks)), key=lambda i: durs[i])
        role = next(r["phases"][name]["role"] for r in ranks if name in r["phases"])
        rows.append({"phase": name, "role": role, "max_ms": durs[slow] / 1e3, "slowest_rank": slow,
                     "min_ms": min(durs) / 1e3, "share": durs[slow] / it_max if it_max else 0.0,
                     "wait_ms_by_rank": [w / 1e3 for w in waits],
                     "straggler": min(range(len(ranks)), key=lambda i: waits[i]) if len(ranks) > 1 else 0})
    covered = sum(r["max_ms"] for r in rows)
    return {"files": paths, "ranks": len(ranks), "iteration": ranks[0]["iteration"], "version": ranks[0]["version"],
            "iteration_ms": it_max / 1e3, "phases": rows, "critical_path_ms": covered,
            "controller_ms": max(it_max / 1e3 - covered, 0.0)}


def render(s: dict) -> str:
    lines = [f"iteration {s['iteration']} (policy {s['version']}), {s['ranks']} rank(s): {s['iteration_ms']:.1f} ms",
             f"{'phase':<15}{'role':<16}{'max ms':>9}{'share':>8}{'min ms':>9}  {'in collectives, ms by rank':<28}straggler"]
    for r in s["phases"]:
        waits = " ".join(f"{w:.1f}" for w in r["wait_ms_by_rank"])
        lines.append(f"{r['phase']:<15}{r['role'] or '':<16}{r['max_ms']:>9.1f}{100 * r['share']:>7.1f}%"
                     f"{r['min_ms']:>9.1f}  {waits:<28}rank {r['straggler']}")
    path = " -> ".join(f"{r['phase']} {r['max_ms']:.1f}" for r in s["phases"])
    lines.append(f"critical path: {path} = {s['critical_path_ms']:.1f} ms; controller (outside every phase) "
                 f"{s['controller_ms']:.1f} ms ({100 * s['controller_ms'] / max(s['iteration_ms'], 1e-9):.1f}%)")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("traces", nargs="+", help="Chrome trace JSON files, one per rank, of the same iteration")
    ap.add_argument("--json", default=None, help="also write the summary as JSON")
    args = ap.parse_args(argv)
    try:
        s = summarize(args.traces)
    except (OSError, ValueError, KeyError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(render(s))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(s, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
