"""Per-stage metrics: stage timers, JSONL + TensorBoard writers, and the console progress line.

Metric names are ``<stage>/<name>`` with stages ``rollout`` (generation), ``prep`` (rewards and
the reference / old-policy / critic forwards, advantages), ``update`` (actor and critic
optimisation), ``e2e`` (the iteration as a whole) and ``eval`` (held-out evaluation).  One JSON
object per iteration goes to ``<run_dir>/metrics.jsonl``; ``tools/plot_metrics.py`` draws them.
"""

from __future__ import annotations

import json
import math
import os
import time
from contextlib import contextmanager
from typing import Dict, Optional

from megarl.profiling import span


class StageTimer:
    """Wall seconds per named stage of one iteration, in the order first entered.  Each stage is
    also a timeline span (``megarl.profiling.span``) labelled with the iteration, the policy
    version and the stage's counters."""

    def __init__(self, iteration: Optional[int] = None, version: Optional[str] = None):
        self.seconds: Dict[str, float] = {}
        self.iteration, self.version = iteration, version
        self._t0 = time.perf_counter()

    @contextmanager
    def stage(self, name: str, **counters):
        t = time.perf_counter()
        try:
            with span(name, self.iteration, self.version, **counters):
                yield
        finally:
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - t

    def metrics(self) -> Dict[str, float]:
        total = time.perf_counter() - self._t0
        out = {"e2e/iteration_s": total}
        for k, v in self.seconds.items():
            out[f"e2e/stage_s/{k}"] = v
            out[f"e2e/stage_share/{k}"] = v / total if total > 0 else 0.0
        out["e2e/controller_s"] = max(total - sum(self.seconds.values()), 0.0)
        return out


def _clean(v):
    if isinstance(v, bool):
        return int(v)
    if isinstance(v, (int, str)):
        return v
    try:
        f = float(v)
    except (TypeError, ValueError):
        return None
    return f if math.isfinite(f) else None


class MetricsWriter:
    """Rank 0 writes; other ranks hold a writer that does nothing."""

    def __init__(self, run_dir: str, enabled: bool, tensorboard: bool = True):
        self.enabled = enabled
        self.path = os.path.join(run_dir, "metrics.jsonl")
        self._f = open(self.path, "a") if enabled else None
        self._tb = None
        if enabled and tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self._tb = SummaryWriter(os.path.join(run_dir, "tensorboard"))
            except ImportError:  # tensorboard is a declared dependency; keep JSONL regardless
                self._tb = None

    def write(self, iteration: int, metrics: Dict[str, object]) -> None:
        if not self.enabled:
            return
        row = {"iteration": iteration, "time": time.time()}
        for k, v in sorted(metrics.items()):
            row[k] = _clean(v)
        self._f.write(json.dumps(row) + "\n")
        self._f.flush()
        if self._tb is not None:
            for k, v in row.items():
                if k not in ("iteration", "time") and isinstance(v, (int, float)) and not isinstance(v, bool):
                    self._tb.add_scalar(k, v, iteration)
            self._tb.flush()

    def close(self) -> None:
        if self._f is not None:
            self._f.close()
        if self._tb is not None:
            self._tb.close()


def progress_line(it: int, total: int, m: Dict[str, object], last_acc: Optional[float]) -> str:
    """One console line per iteration: reward, held-out accuracy, KL, seconds."""
    def f(key, fmt):
        v = m.get(key)
        return fmt.format(v) if isinstance(v, (int, float)) else "-"

    acc = "-" if last_acc is None else f"{last_acc:.3f}"
    kl = m.get("update/kl_ref", m.get("update/approx_kl"))
    kl_s = f"{kl:.4f}" if isinstance(kl, (int, float)) else "-"
    return (f"iter {it}/{total} | reward {f('rollout/reward_mean', '{:.3f}')} | heldout acc {acc} | "
            f"kl {kl_s} | resp len {f('rollout/response_len_mean', '{:.1f}')} | "
            f"{f('e2e/iteration_s', '{:.1f}')}s")
