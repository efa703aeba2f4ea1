"""Running many environments concurrently, with per-call timeouts, failures as statuses.

:class:`EnvironmentPool` holds one environment per trajectory (``reset(rows)`` makes them) and
steps any subset of them at once on ``max_workers`` daemon threads.  Each call (the factory plus
``reset``, or one ``step``) has ``step_timeout_s``, measured from when it starts on a worker, as
for rewards (:mod:`megarl.rewards.runner`, whose worker pool this reuses):

- an exception is status ``error`` (``"<ExceptionType>: <message>"``);
- an overrun is ``timeout``: the call is *abandoned* (Python cannot kill a thread; its worker is
  replaced, its result ignored whenever it comes) and so is the instance -- its index refuses
  any further step with an :class:`EnvPoolError`, since its state is unknown;
- a return value of the wrong type or with a non-finite reward part is ``invalid``
  (:func:`megarl.envs.protocol.check_outcome`).

A failure is never retried (a step is not idempotent) and never a reward: the failed instance
refuses further steps, and the caller ends that trajectory with the status.  So do instances
whose episode ended (terminated or truncated).  Stepping a refused index, an unknown one, or the
same index twice in one call is a caller bug and raises :class:`EnvPoolError` before anything
runs.

``counters`` accumulate ``calls`` / ``ok`` / ``error`` / ``timeout`` / ``invalid`` over resets and
steps; :meth:`EnvironmentPool.metrics` gives ``env/<name>/...`` floats per window, with latency
p50 / p99 (like :mod:`megarl.rewards.telemetry`) and the summed ``info`` counts of the steps.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from concurrent.futures import FIRST_COMPLETED, wait
from enum import Enum
from typing import Any, Callable, Mapping, Sequence

from megarl.envs.protocol import EnvStatus, EnvStepResult, Environment, StepOutcome, check_messages, check_outcome
from megarl.errors import MegarlError
from megarl.rewards.runner import _WorkerPool
from megarl.rewards.telemetry import percentile

__all__ = ["EnvironmentPool", "EnvPoolError"]


class EnvPoolError(MegarlError, RuntimeError):
    """A misuse of the pool by its caller (stepping an abandoned, failed or finished instance)."""


class _State(str, Enum):
    READY = "ready"
    DONE = "done"  # the episode ended (terminated / truncated)
    FAILED = "failed"  # reset or a step gave error / invalid
    ABANDONED = "abandoned"  # a call timed out; the thread may still be running it


def _reset_call(arg):
    factory, row = arg
    env = factory()
    return env, env.reset(row)


def _step_call(arg):
    env, action = arg
    return env.step(action)


def _close_all(envs):
    for env in envs:
        close = getattr(env, "close", None)
        try:
            if callable(close):
                close()
        except Exception:  # noqa: BLE001 -- a failing close() must not stop the others
            pass


class EnvironmentPool:
    """One environment per trajectory, stepped concurrently (see the module docstring).

    Args:
        factory: makes one fresh environment (:func:`megarl.envs.protocol.load_environment`).
        step_timeout_s: the limit of one call (construction + reset, or one step), in seconds.
        max_workers: concurrent calls (threads).
    """

    def __init__(self, factory: Callable[[], Environment], *, step_timeout_s: float, max_workers: int):
        if not callable(factory):
            raise EnvPoolError(f"EnvironmentPool factory must be callable, got {type(factory).__name__}")
        if isinstance(step_timeout_s, bool) or not isinstance(step_timeout_s, (int, float)) or not step_timeout_s > 0:
            raise EnvPoolError(f"EnvironmentPool step_timeout_s must be > 0 seconds, got {step_timeout_s!r}")
        if isinstance(max_workers, bool) or not isinstance(max_workers, int) or max_workers < 1:
            raise EnvPoolError(f"EnvironmentPool max_workers must be an int >= 1, got {max_workers!r}")
        self.factory, self.step_timeout_s, self.max_workers = factory, float(step_timeout_s), max_workers
        # metrics name: the built-in's name, a plug-in's class name
        spec = getattr(factory, "spec", None) or getattr(factory, "__qualname__", None) or "env"
        self.name = str(spec).rpartition(":")[2]
        self._pool = _WorkerPool(max_workers, f"env-{self.name}")
        self._envs: list[Any] = []
        self._states: list[_State] = []
        self._why: list[str] = []
        self._closed = False
        self._lock = threading.Lock()  # one reset / step at a time per pool
        self.counters: Counter = Counter()
        self._latencies: list[float] = []
        self._info: Counter = Counter()
        self._last: dict[str, float] = {}

    # ---- the calls --------------------------------------------------------------------------

    def reset(self, rows: Sequence[Mapping]) -> list[EnvStepResult]:
        """Drop the current instances and make one per row (index i <-> rows[i]); each result's
        ``outcome.observation`` is that reset's messages (no reward, not done)."""
        with self._lock:
            self._check_open()
            self._drop_all()
            n = len(rows)
            self._envs, self._states, self._why = [None] * n, [_State.READY] * n, [""] * n
            results = self._run(list(range(n)), [(self.factory, row) for row in rows], _reset_call, self._reset_done)
            for i, r in enumerate(results):
                if r.status is not EnvStatus.OK:
                    self._fail(i, r)
            return results

    def step(self, indices: Sequence[int], actions: Sequence[str]) -> list[EnvStepResult]:
        """Step ``indices[k]`` with ``actions[k]`` (decoded policy text), concurrently; one result
        per index, in order.  An instance whose episode ends, or whose step fails, refuses
        further steps."""
        with self._lock:
            self._check_open()
            indices = [int(i) for i in indices]
            if len(indices) != len(actions):
                raise EnvPoolError(f"step got {len(indices)} indices and {len(actions)} actions")
            if len(set(indices)) != len(indices):
                raise EnvPoolError(f"step got an index twice: {indices} (one step at a time per environment)")
            for i, a in zip(indices, actions, strict=True):
                if not 0 <= i < len(self._envs):
                    raise EnvPoolError(f"environment index {i} out of range: the pool holds {len(self._envs)}")
                if self._states[i] is not _State.READY:
                    raise EnvPoolError(f"environment {i} refuses further steps: {self._why[i]}")
                if not isinstance(a, str):
                    raise EnvPoolError(f"the action for environment {i} must be str (decoded text), got {type(a).__name__}")
            calls = [(self._envs[i], a) for i, a in zip(indices, actions, strict=True)]
            results = self._run(indices, calls, _step_call,
                                lambda i, value: check_outcome(value))
            for i, r in zip(indices, results, strict=True):
                if r.status is not EnvStatus.OK:
                    self._fail(i, r)
                else:
                    self._info.update(r.outcome.info)  # tool_calls, tool_errors, ... summed per window
                if r.status is EnvStatus.OK and r.outcome.done:
                    self._states[i] = _State.DONE
                    self._why[i] = "its episode ended (terminated)" if r.outcome.terminated else \
                        "its episode ended (truncated)"
            return results

    def close(self) -> None:
        """Close the live instances (their optional ``close()``, not awaited) and stop the idle
        workers."""
        with self._lock:
            if self._closed:
                return
            self._drop_all()
            self._closed = True
            self._pool.close()

    def __enter__(self) -> "EnvironmentPool":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __len__(self) -> int:
        return len(self._envs)

    def refused(self, index: int) -> str | None:
        """Why instance ``index`` refuses steps (None: it is ready)."""
        return None if self._states[index] is _State.READY else self._why[index]

    # ---- metrics ----------------------------------------------------------------------------

    def metrics(self) -> dict:
        """``env/<name>/{calls, errors, timeouts, invalid, latency_p50_s, latency_p99_s}`` since the
        last call (latencies of the calls that answered), and the sums of the ok steps' ``info``
        counts (``env/calculator/tool_calls``)."""
        now = {"calls": float(self.counters["calls"]), "errors": float(self.counters[EnvStatus.ERROR.value]),
               "timeouts": float(self.counters[EnvStatus.TIMEOUT.value]),
               "invalid": float(self.counters[EnvStatus.INVALID.value])}
        lat, self._latencies = self._latencies, []
        info, self._info = self._info, Counter()
        p = f"env/{self.name}/"
        out = {p + k: v - self._last.get(k, 0.0) for k, v in now.items()}
        out.update({p + k: float(v) for k, v in sorted(info.items())})
        self._last = now
        if lat:
            out[p + "latency_p50_s"] = percentile(lat, 50)
            out[p + "latency_p99_s"] = percentile(lat, 99)
        return out

    # ---- internals --------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise EnvPoolError("EnvironmentPool is closed")

    def _reset_done(self, i: int, value: Any) -> StepOutcome:
        env, messages = value
        self._envs[i] = env  # kept even if the messages are invalid, so close() reaches it
        if not callable(getattr(env, "step", None)):
            raise ValueError(f"the factory made {type(env).__name__}, which has no step(action) method")
        return StepOutcome(check_messages(messages, "reset's messages"), {}, False, False)

    def _fail(self, i: int, r: EnvStepResult) -> None:
        self._states[i] = _State.ABANDONED if r.status is EnvStatus.TIMEOUT else _State.FAILED
        self._why[i] = f"an earlier call gave {r.status.value} ({r.error})"

    def _drop_all(self) -> None:
        """Forget the instances; their ``close()`` runs on one extra daemon thread, not awaited and
        not on the workers, so a close() that hangs costs that thread only, never a worker."""
        live = [env for env, state in zip(self._envs, self._states, strict=True)
                if env is not None and state is not _State.ABANDONED]
        self._envs, self._states, self._why = [], [], []
        if any(callable(getattr(env, "close", None)) for env in live):
            threading.Thread(target=_close_all, args=(live,), name=f"env-{self.name}-close", daemon=True).start()

    def _run(self, indices: list[int], args: list, fn: Callable, accept: Callable[[int, Any], StepOutcome]):
        """Submit ``fn(args[k])`` for each k, wait with the per-call timeout, and turn each into
        an :class:`EnvStepResult` (``accept(index, value)`` checks a returned value; a
        ``ValueError`` from it is ``invalid``)."""
        results: list[EnvStepResult | None] = [None] * len(indices)
        tasks = {}
        for k, arg in enumerate(args):
            self.counters["calls"] += 1
            task = self._pool.submit(fn, arg)
            tasks[task.future] = (k, task)
        timeout = self.step_timeout_s
        while tasks:
            now = time.monotonic()
            # a queued call has no deadline yet: look again within one timeout
            wake = min((t.started if t.started is not None else now) + timeout for _, t in tasks.values())
            done, _ = wait(list(tasks), timeout=max(0.0, wake - now), return_when=FIRST_COMPLETED)
            for fut in done:
                k, task = tasks.pop(fut)
                latency = time.monotonic() - (task.started or now)
                self._latencies.append(latency)
                results[k] = self._result(indices[k], fut, latency, accept)
            now = time.monotonic()
            for fut, (k, task) in list(tasks.items()):
                if task.started is not None and now >= task.started + timeout and not fut.done():
                    del tasks[fut]
                    self._pool.abandon(task)
                    results[k] = self._record(EnvStatus.TIMEOUT, None,
                                              f"no answer within rollout.agent.step_timeout_s={timeout:g}; "
                                              "the environment is abandoned", now - task.started)
        return results

    def _result(self, index: int, fut, latency: float, accept) -> EnvStepResult:
        exc = fut.exception()
        if exc is not None:
            return self._record(EnvStatus.ERROR, None, f"{type(exc).__name__}: {exc}", latency)
        try:
            outcome = accept(index, fut.result())
        except (ValueError, TypeError) as e:
            return self._record(EnvStatus.INVALID, None, str(e), latency)
        return self._record(EnvStatus.OK, outcome, None, latency)

    def _record(self, status: EnvStatus, outcome, error, latency: float) -> EnvStepResult:
        self.counters[status.value] += 1
        return EnvStepResult(status, outcome, error, float(latency))
