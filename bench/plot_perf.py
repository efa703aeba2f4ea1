#!/usr/bin/env python
"""PNG plots of the bench results docs/performance.md quotes.

    python bench/plot_perf.py [--dir docs/perf]

Reads ``vs_trl.json``, ``limits.json`` and ``scaling.json`` (written by ``bench/vs_trl.py``,
``bench/limits.py`` and ``bench/scaling.py`` with ``--json``) from ``--dir`` and writes
``vs_trl.png``, ``limits.png`` and ``scaling.png`` next to them.
"""

from __future__ import annotations

import argparse
import json
import os

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", default=os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                                  "docs", "perf"))
    d = ap.parse_args().dir

    v = json.load(open(os.path.join(d, "vs_trl.json")))
    fig, axes = plt.subplots(1, 2, figsize=(8, 3.2))
    names = ["megarl", f"TRL {v['trl_version']}"]
    axes[0].bar(names, [v["megarl"]["seconds_per_iteration"], v["trl"]["seconds_per_iteration"]], color=["C0", "C1"])
    axes[0].set_ylabel("seconds / iteration (median)")
    axes[1].bar(names, [v["megarl"]["heldout_accuracy"], v["trl"]["heldout_accuracy"]], color=["C0", "C1"])
    axes[1].axhline(v["start_accuracy"], color="gray", ls="--", label=f"start {v['start_accuracy']:.3f}")
    axes[1].set_ylabel(f"held-out accuracy after {v['iterations']} it.")
    axes[1].legend(loc="lower right")
    fig.suptitle(f"GRPO, tiny Llama, {v['batch']}: megarl / TRL = {v['ratio_seconds_per_iteration']:.2f}x s/iter")
    fig.tight_layout()
    fig.savefig(os.path.join(d, "vs_trl.png"), dpi=110)

    rows = json.load(open(os.path.join(d, "limits.json")))["rows"]
    fig, ax = plt.subplots(figsize=(8, 3.4))
    ax.barh([r["stage"] for r in rows][::-1], [r["ratio"] for r in rows][::-1], color="C2")
    ax.axvline(1.0, color="gray", ls="--")
    ax.set_xscale("log")
    ax.set_xlabel("time / floor (log scale; 1.0 = at the floor)")
    for i, r in enumerate(rows[::-1]):
        ax.text(r["ratio"], i, f" {r['ratio']:.2f}x", va="center", fontsize=8)
    fig.tight_layout()
    fig.savefig(os.path.join(d, "limits.png"), dpi=110)

    rows = json.load(open(os.path.join(d, "scaling.json")))
    fig, ax = plt.subplots(figsize=(8, 3.6))
    stages = ["generate", "old_log_prob", "ref_log_prob", "update", "weight_sync", "reward"]
    bottom = [0.0] * len(rows)
    for s in stages:
        vals = [r[f"{s}_s"] for r in rows]
        ax.barh([r["name"] for r in rows], vals, left=bottom, label=s)
        bottom = [b + x for b, x in zip(bottom, vals)]
    ax.barh([r["name"] for r in rows], [r["iteration_s"] - b for r, b in zip(rows, bottom)], left=bottom,
            label="other", color="lightgray")
    ax.invert_yaxis()
    ax.set_xlabel("seconds / iteration (median), by stage")
    ax.legend(fontsize=7, ncol=3, loc="upper right")
    fig.tight_layout()
    fig.savefig(os.path.join(d, "scaling.png"), dpi=110)
    print(f"wrote vs_trl.png, limits.png, scaling.png in {d}")


if __name__ == "__main__":
    main()
