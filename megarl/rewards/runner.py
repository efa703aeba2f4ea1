"""Running reward functions with timeouts and retries, turning every failure into a status.

:class:`RewardRunner` calls the reward function once per sample on a small pool of worker
threads, with a per-call timeout.  An exception becomes an attempt with status ``error``
(``"<ExceptionType>: <message>"``), an overrun becomes ``timeout``; both are retried with
exponential backoff, ``invalid`` is not (the input will not get better).  After the last attempt
the failed record (``total=None``) is returned: a failure is never a number here.
:func:`apply_penalties` is the one place where a failure may become a score, and only for
statuses the user gave a penalty.

Hung calls.  Python cannot kill a thread.  A call that overruns its timeout is *abandoned*: its
result is ignored whenever it comes, its worker thread is replaced so the pool keeps its size,
and that thread exits once the call returns -- if it never returns, it keeps running (and may
keep burning CPU) for the life of the process.  The workers are daemon threads, so an abandoned
call cannot block interpreter exit; this is why the pool is not a
``concurrent.futures.ThreadPoolExecutor`` (whose threads are joined at exit, so one stuck scorer
would hang the trainer's shutdown, and each stuck thread would shrink the pool for good).  A
retry of an abandoned call may run while the abandoned one is still going, so reward functions
must be safe to run concurrently with themselves.  Scorers that can hang for real (sandboxed
code execution, pathological sympy input, any plug-in) run with ``isolation="process"``
instead (:mod:`megarl.rewards.isolation`, ``reward.isolation``): the same loop drives a pool of
worker processes, and an overdue call's worker is killed and replaced.  Threads give parallelism only to scorers that release the GIL (I/O: remote reward
models, sandboxes); for pure-Python rules the pool is about timeouts, not speed.
"""

from __future__ import annotations

import heapq
import math
import numbers
import queue
import threading
import time
import weakref
from collections import Counter
from concurrent.futures import FIRST_COMPLETED, Future, wait
from typing import Any, Callable, Mapping, Sequence

from megarl.experience.schema import RewardRecord, RewardStatus
from megarl.rewards.base import (BatchRewardFunction, RewardConfigError, RewardFunction, RewardMetricsSource, RewardSample,
                                 check_number, reward_identity)

__all__ = ["RewardRunner", "apply_penalties", "PENALTY_KEYS"]

PENALTY_KEYS = (RewardStatus.ERROR.value, RewardStatus.TIMEOUT.value, RewardStatus.INVALID.value)
_RETRIED = (RewardStatus.ERROR, RewardStatus.TIMEOUT)


class _Task:
    """One attempt: the worker sets ``thread`` and then ``started`` before running ``fn(arg)``."""

    __slots__ = ("future", "fn", "arg", "thread", "started")

    def __init__(self, fn: Callable, arg: Any):
        self.future: Future = Future()
        self.fn, self.arg = fn, arg
        self.thread: threading.Thread | None = None
        self.started: float | None = None


class _WorkerPool:
    """``size`` live daemon worker threads on one queue; see the module docstring for why."""

    def __init__(self, size: int, name: str):
        self._size, self._name = size, name
        self._q: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._live = 0
        self._abandoned: set[threading.Thread] = set()
        self._closed = False
        self._spawned = 0
        self.restarts = 0  # threads are never replaced (an abandoned call's thread runs on)

    def submit(self, fn: Callable, arg: Any) -> _Task:
        with self._lock:
            if self._closed:
                raise RuntimeError("RewardRunner is closed")
            while self._live < self._size:
                self._spawn_locked()
        task = _Task(fn, arg)
        self._q.put(task)
        return task

    def abandon(self, task: _Task) -> None:
        """Give up on a running task: its thread exits when the call returns; start a replacement."""
        with self._lock:
            if task.thread is not None and task.thread not in self._abandoned:
                self._abandoned.add(task.thread)
                self._live -= 1
                if not self._closed:
                    self._spawn_locked()

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            for _ in range(self._live):
                self._q.put(None)

    def _spawn_locked(self) -> None:
        self._spawned += 1
        t = threading.Thread(target=self._work, name=f"{self._name}-{self._spawned}", daemon=True)
        self._live += 1
        t.start()

    def _work(self) -> None:
        me = threading.current_thread()
        while True:
            task = self._q.get()
            if task is None:
                return
            task.thread = me
            task.started = time.monotonic()
            if not task.future.set_running_or_notify_cancel():
                continue
            try:
                result = task.fn(task.arg)
            except BaseException as e:  # noqa: BLE001 -- any failure of a user scorer is a status
                task.future.set_exception(e)
            else:
                task.future.set_result(result)
            del task
            with self._lock:
                if me in self._abandoned:
                    self._abandoned.discard(me)
                    return


class RewardRunner:
    """Score samples with ``fn``: per-call timeout, retries with backoff, failures as statuses.

    Args:
        fn: the reward function (``fn.version`` stamps the records the runner makes itself).
        timeout_s: per-call limit in seconds, measured from when the call starts on a worker;
            None waits forever.
        max_retries: extra attempts after an ``error`` / ``timeout`` (``invalid`` is final).
        backoff_s: delay before retry k is ``backoff_s * 2**(k-1)``.
        max_workers: concurrent calls (threads, or worker processes).
        isolation: ``"thread"`` (calls on daemon threads) or ``"process"`` (calls in killable
            worker processes, :class:`megarl.rewards.isolation.ProcessPool`; needs ``spec``).
        spec: ``{"fn", "kwargs", "components"}`` from which each worker process builds its own
            reward function with ``build_reward_function`` (``fn`` then only names the version).
        kill_grace_s, max_memory_mb, cpu_time_s: process isolation only (see that module).

    ``counters`` (a Counter) accumulates over calls of :meth:`score`: ``calls`` (attempts),
    ``ok`` / ``error`` / ``timeout`` / ``invalid`` per attempt (so they sum to ``calls``),
    ``retries``, and ``failed`` (samples whose final record is not ok).  One :meth:`score` runs
    at a time per runner.  :meth:`close` (or ``with RewardRunner(...)``) stops the idle workers.
    """

    def __init__(
        self,
        fn: RewardFunction | Callable[[RewardSample], RewardRecord],
        timeout_s: float | None = 30.0,
        max_retries: int = 2,
        backoff_s: float = 0.05,
        max_workers: int = 4,
        *,
        isolation: str = "thread",
        spec: Mapping[str, Any] | None = None,
        kill_grace_s: float = 0.5,
        max_memory_mb: int | None = None,
        cpu_time_s: float | None = None,
    ):
        if not callable(fn):
            raise RewardConfigError(f"RewardRunner fn must be callable, got {type(fn).__name__}")
        self.fn = fn
        self.timeout_s = check_number("RewardRunner", "timeout_s", timeout_s, allow_none=True, positive=True)
        self.max_retries = int(check_number("RewardRunner", "max_retries", max_retries, integer=True))
        self.backoff_s = float(check_number("RewardRunner", "backoff_s", backoff_s))
        self.max_workers = int(check_number("RewardRunner", "max_workers", max_workers, positive=True, integer=True))
        label, self.version = reward_identity(fn)
        self.counters: Counter = Counter()
        from megarl.rewards.telemetry import ScorerStats

        self.stats = ScorerStats(label)
        if isolation == "process":
            from megarl.rewards.isolation import ProcessPool

            self._pool = ProcessPool(
                self.max_workers, spec, str(label), kill_grace_s=check_number("RewardRunner", "kill_grace_s", kill_grace_s),
                max_memory_mb=check_number("RewardRunner", "max_memory_mb", max_memory_mb, allow_none=True, positive=True, integer=True),
                cpu_time_s=check_number("RewardRunner", "cpu_time_s", cpu_time_s, allow_none=True, positive=True))
        elif isolation == "thread":
            self._pool = _WorkerPool(self.max_workers, f"reward-{label}")
        else:
            raise RewardConfigError(f"RewardRunner isolation must be 'thread' or 'process', got {isolation!r}")
        self.isolation = isolation
        self._finalizer = weakref.finalize(self, self._pool.close)
        self._score_lock = threading.Lock()

    def close(self) -> None:
        """Stop the idle workers (abandoned, still-running calls are left to finish on their own)."""
        self._finalizer()

    def metrics(self) -> dict:
        """``reward/<name>/...`` floats since the last call (see :mod:`megarl.rewards.telemetry`)."""
        return self.stats.window(self.counters, self._pool.restarts, self.fn)

    def __enter__(self) -> "RewardRunner":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _failure(self, status: RewardStatus, error: str) -> RewardRecord:
        return RewardRecord(total=None, scorer_version=self.version, status=status, error=error)

    def _outcome(self, task: _Task) -> RewardRecord:
        exc = task.future.exception()
        if exc is not None:
            return self._failure(RewardStatus.ERROR, f"{type(exc).__name__}: {exc}")
        rec = task.future.result()
        if not isinstance(rec, RewardRecord):
            return self._failure(
                RewardStatus.ERROR,
                f"reward function returned {type(rec).__name__}, expected a RewardRecord "
                "(wrap plain callables in megarl.rewards.plugin.UserFunction)",
            )
        return rec

    def score(self, samples: Sequence[RewardSample]) -> list[RewardRecord]:
        """One final record per sample, in input order; never raises for a scorer failure."""
        with self._score_lock:
            if isinstance(self.fn, BatchRewardFunction):
                return self._score_batched(list(samples))
            return self._score(list(samples))

    def _score_batched(self, samples: list[RewardSample]) -> list[RewardRecord]:
        """A function with ``score_batch(samples) -> records`` (e.g. the HTTP service) gets the
        whole list in one call and enforces its own timeouts, retries and concurrency.  Counters
        stay per sample: ``calls`` += one per sample, ``ok`` / ``error`` / ``timeout`` /
        ``invalid`` by final record, ``retries`` += the function's own re-sends (the delta of its
        ``metrics()["retries"]``), ``failed`` as usual.  An exception or a wrong-length answer
        fails every sample with status ``error``."""
        reports = isinstance(self.fn, RewardMetricsSource)
        before = self.fn.metrics().get("retries", 0) if reports else 0
        t_begin = time.monotonic()
        try:
            recs = list(self.fn.score_batch(samples))
        except Exception as e:  # noqa: BLE001 -- any failure of a scorer is a status
            recs = [self._failure(RewardStatus.ERROR, f"{type(e).__name__}: {e}")] * len(samples)
        self.stats.busy(time.monotonic() - t_begin)
        if len(recs) != len(samples):
            recs = [self._failure(RewardStatus.ERROR,
                                  f"score_batch returned {len(recs)} records for {len(samples)} samples")] * len(samples)
        out = []
        for rec in recs:
            if not isinstance(rec, RewardRecord):
                rec = self._failure(RewardStatus.ERROR, f"score_batch returned {type(rec).__name__}, expected a RewardRecord")
            self.counters["calls"] += 1
            self.counters[rec.status.value] += 1
            if rec.status is not RewardStatus.OK:
                self.counters["failed"] += 1
            out.append(rec)
        if reports:
            self.counters["retries"] += int(self.fn.metrics().get("retries", 0) - before)
        return out

    def _score(self, samples: list[RewardSample]) -> list[RewardRecord]:
        n_attempts = 1 + self.max_retries
        results: list[RewardRecord | None] = [None] * len(samples)
        attempts = [0] * len(samples)
        inflight: dict[Future, tuple[int, _Task]] = {}
        retry_at: list[tuple[float, int]] = []  # heap of (monotonic time, sample index)
        t_begin = time.monotonic()

        def submit(i: int) -> None:
            attempts[i] += 1
            self.counters["calls"] += 1
            task = self._pool.submit(self.fn, samples[i])
            inflight[task.future] = (i, task)

        def finish_attempt(i: int, rec: RewardRecord) -> None:
            self.counters[rec.status.value] += 1
            if rec.status in _RETRIED and attempts[i] < n_attempts:
                delay = self.backoff_s * 2 ** (attempts[i] - 1)
                heapq.heappush(retry_at, (time.monotonic() + delay, i))
                return
            if rec.status in _RETRIED:
                rec = RewardRecord(
                    total=None,
                    scorer_version=rec.scorer_version,
                    status=rec.status,
                    error=f"{rec.error} (attempt {attempts[i]} of {n_attempts}, giving up)",
                )
            if rec.status is not RewardStatus.OK:
                self.counters["failed"] += 1
            results[i] = rec

        try:
            for i in range(len(samples)):
                submit(i)
            while inflight or retry_at:
                now = time.monotonic()
                while retry_at and retry_at[0][0] <= now:
                    _, i = heapq.heappop(retry_at)
                    self.counters["retries"] += 1
                    submit(i)
                wakeups = [retry_at[0][0]] if retry_at else []
                if self.timeout_s is not None:
                    for _, task in inflight.values():
                        # a queued call has no deadline yet: look again within one timeout
                        start = task.started if task.started is not None else now
                        wakeups.append(start + self.timeout_s)
                wait_s = max(0.0, min(wakeups) - now) if wakeups else None
                if inflight:
                    done, _ = wait(list(inflight), timeout=wait_s, return_when=FIRST_COMPLETED)
                else:
                    time.sleep(wait_s or 0.0)
                    done = set()
                for fut in done:
                    i, task = inflight.pop(fut)
                    if task.started is not None:
                        self.stats.latency(time.monotonic() - task.started)
                    finish_attempt(i, self._outcome(task))
                if self.timeout_s is not None:
                    now = time.monotonic()
                    for fut, (i, task) in list(inflight.items()):
                        if task.started is not None and now >= task.started + self.timeout_s and not fut.done():
                            del inflight[fut]
                            self._pool.abandon(task)
                            finish_attempt(
                                i, self._failure(RewardStatus.TIMEOUT, f"no result within timeout_s={self.timeout_s}")
                            )
        finally:
            self.stats.busy(time.monotonic() - t_begin)
            for fut in inflight:  # only reached with calls left on an exception (e.g. Ctrl-C)
                fut.cancel()
        return results  # type: ignore[return-value]


def apply_penalties(records: Sequence[RewardRecord], penalties: Mapping[str, float | None]) -> list[RewardRecord]:
    """Replace failed records by a configured penalty score; everything else passes unchanged.

    ``penalties`` maps a failure status (``"error"``, ``"timeout"``, ``"invalid"``) to a finite
    number, or None for "keep it a failure" (the sample is then dropped / its group handled by
    the trainer).  A penalised record is ok with ``total=penalty`` and
    ``components={"penalty/<status>": penalty}``, keeping its ``scorer_version``.  This is the
    only place a failure becomes a number, and only by explicit configuration.
    """
    checked: dict[str, float] = {}
    for key, value in penalties.items():
        if key not in PENALTY_KEYS:
            raise RewardConfigError(f"reward.penalties: unknown key {key!r}; expected one of {list(PENALTY_KEYS)}")
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
            raise RewardConfigError(f"reward.penalties.{key} must be a finite number or null, got {value!r}")
        checked[key] = float(value)
    out = []
    for rec in records:
        p = checked.get(rec.status.value) if rec.status is not RewardStatus.OK else None
        if p is None:
            out.append(rec)
        else:
            out.append(
                RewardRecord(total=p, components={f"penalty/{rec.status.value}": p}, scorer_version=rec.scorer_version)
            )
    return out
