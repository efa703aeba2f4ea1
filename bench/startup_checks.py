#!/usr/bin/env python
"""How long the start-up data check takes (``megarl.rewards.dataset_fields.check_file``: every row of
the train file carries the fields the reward reads), by file size.

    python bench/startup_checks.py [--rows 20000 200000 2000000]

It runs before any model loads, on rank 0, once per start; this prints seconds and rows/s for
each size (the default recipe's train file has 20,000 rows).
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, nargs="+", default=[20_000, 200_000, 2_000_000])
    a = ap.parse_args()
    from megarl.rewards.dataset_fields import check_file

    with tempfile.TemporaryDirectory() as d:
        for n in a.rows:
            path = os.path.join(d, f"train_{n}.jsonl")
            with open(path, "w") as f:
                for i in range(n):
                    f.write(json.dumps({"id": f"r{i}", "prompt": f"what is {i} plus 1 ?", "answer": str(i + 1)}) + "\n")
            t0 = time.perf_counter()
            found = check_file(path, ("answer",), reserved=("prompt", "messages", "id"))
            s = time.perf_counter() - t0
            assert found.rows == n and not found.bad
            print(f"{n:>10,} rows: {s:7.3f} s  ({n / s:,.0f} rows/s)", flush=True)


if __name__ == "__main__":
    main()
