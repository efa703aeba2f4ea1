"""What the GPU checks share: whether this machine can run them, the fixed tokenizer hash and
response budget, and the PASS / FAIL / NOT RUN table every check reports into."""

from __future__ import annotations

import importlib.util
import sys
import time
import traceback

import torch

SKIP_REASON = None
if not torch.cuda.is_available():
    SKIP_REASON = "needs a CUDA GPU (the sglang backend runs SGLang schedulers on GPU)"
elif importlib.util.find_spec("sglang") is None:
    SKIP_REASON = "needs the 'sglang' package: pip install -e \".[gpu]\" (or the Docker image)"

TOKENIZER_HASH = "sha256:" + "0" * 64  # the check has no tokenizer
MAX_NEW = 16
# bf16 TE forward vs bf16 SGLang kernels: log-prob parity within tests._tolerance.bf16_logprob_tol and
# greedy divergences accepted under bf16_near_tie, both from the model's depth and the largest
# |logit| each check measures on the actor (no fixed number: a random checkpoint's logits scale
# with its init std).  Not run yet: no GPU has been lent.


def run_as_pytest(script: str, timeout_var: str, default_timeout: float) -> None:
    """The pytest entry of a GPU check program: skip (saying why) where it cannot run, else run
    ``script`` in a fresh process (SGLang's schedulers are processes) within ``$timeout_var``
    seconds and fail with its output unless it exits 0."""
    import os
    import subprocess

    import pytest

    if SKIP_REASON:
        pytest.skip(SKIP_REASON)
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    proc = subprocess.run([sys.executable, os.path.abspath(script)], capture_output=True, text=True,
                          env=dict(os.environ, PYTHONPATH=root),
                          timeout=float(os.environ.get(timeout_var, default_timeout)) + 30)
    print(proc.stdout[-8000:])
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]


# ---- the table -------------------------------------------------------------------------------------


class NotRun(Exception):
    pass


class Table:
    def __init__(self):
        self.rows: list[dict] = []

    def run(self, name: str, fn, needs: tuple[str, ...] = ()):
        missing = [n for n in needs if not any(r["name"] == n and r["status"] == "PASS" for r in self.rows)]
        t0 = time.perf_counter()
        if missing:
            row = {"name": name, "status": "NOT RUN", "detail": f"needs: {'; '.join(missing)}"}
        else:
            try:
                row = {"name": name, "status": "PASS", "detail": fn() or ""}
            except Exception as e:  # noqa: BLE001 - every row reports, the table goes on
                tb = traceback.format_exc(limit=-3)
                row = {"name": name, "status": "FAIL", "detail": f"{type(e).__name__}: {e}".splitlines()[0][:300],
                       "traceback": tb}
                print(tb, file=sys.stderr, flush=True)
        row["seconds"] = round(time.perf_counter() - t0, 1)
        self.rows.append(row)
        print(f"[gpu-check] {row['status']:7s} {row['seconds']:6.1f}s  {name}: {row['detail']}", flush=True)
        return row["status"] == "PASS"

    @property
    def ok(self) -> bool:
        return all(r["status"] == "PASS" for r in self.rows)

    def print(self):
        w = max(len(r["name"]) for r in self.rows)
        line = f"+-{'-' * 7}-+-{'-' * w}-+-{'-' * 8}-+-{'-' * 60}"
        print("\n" + line)
        print(f"| {'result':7s} | {'check':{w}s} | {'seconds':>8s} | figures")
        print(line)
        for r in self.rows:
            print(f"| {r['status']:7s} | {r['name']:{w}s} | {r['seconds']:8.1f} | {r['detail']}")
        print(line)
        print(f"GPU check: {'all passed' if self.ok else 'FAILED'} on {torch.cuda.get_device_name()}", flush=True)
