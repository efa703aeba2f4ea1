#!/usr/bin/env python
"""A run's numbers, as one digest, and the differences between two runs: every non-timing
metric of ``metrics.jsonl`` and the bytes of every export.

    python tools/run_digest.py RUN                 # the digest and what it covers
    python tools/run_digest.py RUN_A RUN_B         # which values and exports differ

This is how a change is checked against the default path: run the tiny recipes with a fixed
``trainer.run_id`` before and after it (``python -m megarl.train --config
configs/grpo_arith_tiny.yaml trainer.run_id=short trainer.iterations=5``, the same for PPO) and
compare the two run directories.  Wall times, throughputs and per-stage seconds (keys ending in
``_s``, ``per_s``, ``_share``, or holding ``time`` / ``seconds`` / ``hours`` / ``mfu``) differ between any
two runs and are left out; so are ``e2e/count/resumes``, a checkpoint's bytes (its state holds
the wall clock's device-hours) and the objects moved between ranks (some carry wall times).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys

TIMING = ("time", "_s", "stage_s", "stage_share", "per_s", "seconds", "e2e/count/resumes", "hours", "mfu",
          "checkpoint_bytes", "objects_moved")


def values(run_dir: str) -> dict:
    """``{(iteration, key): value}`` of every non-timing metric."""
    out = {}
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        for line in f:
            row = json.loads(line)
            for k, v in row.items():
                if k != "iteration" and not any(t in k for t in TIMING):
                    out[(row["iteration"], k)] = v
    return out


def exports(run_dir: str) -> dict:
    """``{export/iter_k/file: sha256}`` of every exported file."""
    root = os.path.join(run_dir, "export")
    out = {}
    for d, _, files in os.walk(root):
        for name in files:
            path = os.path.join(d, name)
            h = hashlib.sha256()
            with open(path, "rb") as f:
                for chunk in iter(lambda: f.read(1 << 20), b""):
                    h.update(chunk)
            out[os.path.relpath(path, run_dir)] = h.hexdigest()
    return out


def digest(run_dir: str) -> dict:
    v, e = values(run_dir), exports(run_dir)
    blob = json.dumps({"metrics": sorted((f"{i}|{k}", v[(i, k)]) for i, k in v), "exports": sorted(e.items())},
                      sort_keys=True).encode()
    return {"digest": "sha256:" + hashlib.sha256(blob).hexdigest(), "metric_values": len(v), "export_files": len(e)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("runs", nargs="+", help="one run directory (its digest) or two (their differences)")
    a = ap.parse_args(argv)
    if len(a.runs) == 1:
        print(json.dumps(digest(a.runs[0]), indent=1))
        return 0
    if len(a.runs) != 2:
        ap.error("give one run directory, or two to compare")
    (va, ea), (vb, eb) = ((values(r), exports(r)) for r in a.runs)
    differ = sorted(k for k in set(va) & set(vb) if va[k] != vb[k])
    only = sorted(set(va) ^ set(vb))
    files = sorted(k for k in set(ea) | set(eb) if ea.get(k) != eb.get(k))
    print(f"{len(differ)} of {len(set(va) & set(vb))} shared metric values differ; {len(only)} in one run only; "
          f"{len(files)} of {len(set(ea) | set(eb))} export files differ")
    for i, k in differ[:40]:
        print(f"  iteration {i} {k}: {va[(i, k)]!r} -> {vb[(i, k)]!r}")
    for i, k in only[:20]:
        print(f"  iteration {i} {k}: only in {'the first' if (i, k) in va else 'the second'}")
    for f in files[:20]:
        print(f"  {f}")
    return 1 if differ or only or files else 0


if __name__ == "__main__":
    sys.exit(main())
