"""Shared helpers for tests that start processes: a free port, the environment a child process
gets, and a worker script launched under torchrun (gloo) that fails the test with its output."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKERS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "workers")


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free right now (for torchrun's --master-port)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def subprocess_env() -> dict:
    """The environment of a child process: this one's, one OMP thread, no warnings, and the repo
    root first on PYTHONPATH (so ``megarl`` and ``tests.plugins`` import from this checkout).

    One thread because the suite's child processes share 2 cores (torchrun starts several);
    ``MEGARL_TEST_THREADS=N`` gives them N instead, to check that no comparison depends on the
    thread count (tests/_tolerance.py)."""
    return dict(os.environ, OMP_NUM_THREADS=os.environ.get("MEGARL_TEST_THREADS", "1"), PYTHONWARNINGS="ignore",
                PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))


def torchrun(script: str, nproc: int, *args: str, timeout: int = 600, check: bool = True):
    """Run ``tests/workers/<script>`` with ``nproc`` processes; return the CompletedProcess."""
    path = script if os.path.isabs(script) else os.path.join(WORKERS, script)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
           "--master-addr", "127.0.0.1", "--master-port", str(free_port()), path, *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=subprocess_env())
    if check and proc.returncode != 0:
        raise AssertionError(
            f"torchrun {script} x{nproc} {' '.join(args)} failed (rc={proc.returncode}):\n"
            f"--- stdout ---\n{proc.stdout[-6000:]}\n--- stderr ---\n{proc.stderr[-6000:]}"
        )
    return proc
