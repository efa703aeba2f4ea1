"""Per-stage metrics: stage timers, the JSONL writer (fanned out to the trackers), and the console progress line.

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
from typing import Dict, Optional, Sequence

from megarl.observability.profiling import phase_context, span


class StageTimer:
    """Wall seconds per named stage of one iteration, in the order first entered.  Each stage is
    also a timeline span (``megarl.observability.profiling.span``) labelled with the iteration, the policy
    version and the stage's counters."""

    def __init__(self, iteration: Optional[int] = None, version: Optional[str] = None):
        self.seconds: Dict[str, float] = {}
        self.started: Dict[str, float] = {}  # perf_counter when each stage first began
        self.iteration, self.version = iteration, version
        self._t0 = time.perf_counter()

    @contextmanager
    def stage(self, name: str, **counters):
        t = time.perf_counter()
        self.started.setdefault(name, t)
        try:
            # what runs inside (the weight sync's sub-phases, a broadcast) is about the same
            # iteration and version
            with span(name, self.iteration, self.version, **counters), phase_context(self.iteration, self.version):
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
    """One row per iteration to ``<run_dir>/metrics.jsonl`` (the source of truth), then the same
    numeric values to every tracker (:mod:`megarl.observability.trackers`: TensorBoard, wandb, mlflow) at
    ``step = iteration``.  Rank 0 writes; other ranks hold a writer that does nothing."""

    def __init__(self, run_dir: str, enabled: bool, trackers: Sequence = ()):
        self.enabled = enabled
        self.path = os.path.join(run_dir, "metrics.jsonl")
        self._f = open(self.path, "a") if enabled else None
        self.trackers = list(trackers) if enabled else []

    @classmethod
    def for_run(cls, cfg, run_dir: str, run_id: str, enabled: bool, resumed_at: Optional[int]) -> "MetricsWriter":
        """The writer of a training run: the trackers ``trainer.loggers`` names, opened on rank 0
        (continuing the tracker runs of ``<run_dir>/trackers.json`` on a resume)."""
        from megarl.observability.trackers import open_trackers

        return cls(run_dir, enabled, open_trackers(cfg, run_dir, run_id, resumed_at) if enabled else ())

    def write(self, iteration: int, metrics: Dict[str, object]) -> None:
        if not self.enabled:
            return
        row = {"iteration": iteration, "time": time.time()}
        for k, v in sorted(metrics.items()):
            row[k] = _clean(v)
        self._f.write(json.dumps(row) + "\n")
        self._f.flush()
        if self.trackers:
            from megarl.observability.trackers import call_guarded

            values = {k: v for k, v in row.items()
                      if k not in ("iteration", "time") and isinstance(v, (int, float)) and not isinstance(v, bool)}
            call_guarded(self.trackers, "log_metrics", iteration, values, row["time"])

    def log_table(self, iteration: int, columns, rows) -> None:
        """A sample table to every tracker that has tables."""
        if self.trackers:
            from megarl.observability.trackers import call_guarded

            call_guarded(self.trackers, "log_table", iteration, list(columns), rows)

    def close(self) -> None:
        if self._f is not None:
            self._f.close()
            self._f = None
        if self.trackers:
            from megarl.observability.trackers import call_guarded

            call_guarded(self.trackers, "close")
            self.trackers = []


def progress_line(it: int, total: int, m: Dict[str, object], last_acc: Optional[float],
                  unscored: Optional[tuple] = None) -> str:
    """One console line per iteration: reward, held-out accuracy, KL, seconds.  ``unscored`` is
    ``(unscored, prompts)`` of the last evaluation: ``heldout acc 0.812 (3 unscored)``, or
    ``heldout acc - (50/50 unscored)`` when nothing was scored (there is no accuracy then)."""
    def f(key, fmt):
        v = m.get(key)
        return fmt.format(v) if isinstance(v, (int, float)) else "-"

    acc = "-" if last_acc is None else f"{last_acc:.3f}"
    if unscored and unscored[0]:
        acc += f" ({unscored[0]} unscored)" if last_acc is not None else f" ({unscored[0]}/{unscored[1]} unscored)"
    kl = m.get("update/kl_ref", m.get("update/approx_kl"))
    kl_s = f"{kl:.4f}" if isinstance(kl, (int, float)) else "-"
    return (f"iter {it}/{total} | reward {f('rollout/reward_mean', '{:.3f}')} | heldout acc {acc} | "
            f"kl {kl_s} | resp len {f('rollout/response_len_mean', '{:.1f}')} | "
            f"{f('e2e/iteration_s', '{:.1f}')}s")
