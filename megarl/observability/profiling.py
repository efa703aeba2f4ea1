"""Timeline spans of the iteration, for a Chrome-trace / Perfetto view of who waits for whom.

Every phase of an iteration (weight sync, generate, reward, old / reference log-prob, critic
values, advantages, update, commit, checkpoint, ...) runs inside a span labelled

    megarl/<phase> it=<iteration> role=<role> v=<policy version> [<counter>=<n> ...]

through ``torch.profiler.record_function`` -- which costs next to nothing unless a profiler is
recording -- and, on CUDA, an NVTX range of the same label (for Nsight Systems).  With
``trainer.profile_iterations`` the trainer records those iterations with ``torch.profiler``
(CPU, and CUDA when present) and writes ``<run_dir>/profile/iter_<k>.rank<r>.json`` per rank:
Chrome trace JSON, which Perfetto (ui.perfetto.dev) and chrome://tracing open.
``tools/timeline_summary.py`` prints each phase's share and the critical path across ranks.
"""

from __future__ import annotations

import os
import threading
from contextlib import contextmanager
from typing import Iterable, Optional

import torch

#: who does the work of each phase (the label's ``role=``)
PHASE_ROLE = {
    "iteration": "trainer", "weight_sync": "actor->rollout", "eval": "rollout", "generate": "rollout",
    "reward": "reward", "old_log_prob": "actor", "ref_log_prob": "reference", "critic_values": "critic",
    "advantages": "controller", "pending_write": "controller", "update": "actor", "rollback": "actor",
    "commit": "actor", "checkpoint": "all", "export": "actor",
    # the weight sync's sub-phases (nested in weight_sync): the owner stage gathering a tensor's
    # shards, the stream cut into buckets, the engine receiving and checksumming them, the
    # comparison against the manifest, the activation with its cache flush
    "weight_sync.gather": "actor", "weight_sync.bucket": "actor", "weight_sync.load": "rollout",
    "weight_sync.verify": "rollout", "weight_sync.activate": "rollout", "reward_broadcast": "controller",
    # split placement: the buckets' broadcast over the bridge to the rollout ranks (inside load)
    "weight_sync.bridge": "actor->rollout",
    # the generated results gathered from each inference group's leader to every rank
    "results_gather": "controller",
}
PREFIX = "megarl/"


def span_label(phase: str, iteration: Optional[int], version: Optional[str], **counters) -> str:
    parts = [f"{PREFIX}{phase}", f"it={iteration}", f"role={PHASE_ROLE.get(phase, 'trainer')}", f"v={version}"]
    parts += [f"{k}={v}" for k, v in counters.items() if v is not None]
    return " ".join(parts)


def parse_label(name: str) -> Optional[dict]:
    """The fields of a :func:`span_label` (None for any other trace event)."""
    if not name.startswith(PREFIX):
        return None
    head, *fields = name.split(" ")
    out = {"phase": head[len(PREFIX):]}
    for f in fields:
        k, _, v = f.partition("=")
        out[k] = v
    return out


_CONTEXT = threading.local()  # .iteration, .version: what a span without them is about


@contextmanager
def phase_context(iteration: Optional[int], version: Optional[str]):
    """Spans opened inside (by code that knows neither: a backend, the weight stream) are labelled
    with this iteration and version."""
    saved = getattr(_CONTEXT, "iteration", None), getattr(_CONTEXT, "version", None)
    _CONTEXT.iteration, _CONTEXT.version = iteration, version
    try:
        yield
    finally:
        _CONTEXT.iteration, _CONTEXT.version = saved


@contextmanager
def span(phase: str, iteration: Optional[int] = None, version: Optional[str] = None, **counters):
    if iteration is None:
        iteration = getattr(_CONTEXT, "iteration", None)
    if version is None:
        version = getattr(_CONTEXT, "version", None)
    label = span_label(phase, iteration, version, **counters)
    nvtx = torch.cuda.is_available()
    if nvtx:
        torch.cuda.nvtx.range_push(label)
    try:
        with torch.profiler.record_function(label):
            yield
    finally:
        if nvtx:
            torch.cuda.nvtx.range_pop()


class IterationProfiler:
    """``torch.profiler`` around the iterations listed in ``trainer.profile_iterations``."""

    def __init__(self, iterations: Iterable[int], out_dir: str, rank: int):
        self.iterations = set(iterations or ())
        self.out_dir, self.rank = out_dir, rank
        self._prof = None
        self._it = None

    def start(self, iteration: int) -> None:
        if iteration not in self.iterations:
            return
        acts = [torch.profiler.ProfilerActivity.CPU]
        if torch.cuda.is_available():
            acts.append(torch.profiler.ProfilerActivity.CUDA)
        self._prof = torch.profiler.profile(activities=acts, record_shapes=False, with_stack=False)
        self._prof.__enter__()
        self._it = iteration

    def stop(self) -> Optional[str]:
        if self._prof is None:
            return None
        self._prof.__exit__(None, None, None)
        os.makedirs(self.out_dir, exist_ok=True)
        path = os.path.join(self.out_dir, f"iter_{self._it}.rank{self.rank}.json")
        self._prof.export_chrome_trace(path)
        self._prof, self._it = None, None
        return path
