"""Reward functions in worker processes: a scorer that hangs, even holding the GIL, is killed.

A Python thread cannot be stopped, and a thread stuck in one C call that holds the GIL (a
power tower inside sympy: ``9**(9**9)`` is one bigint call lasting minutes) freezes every other
thread of the trainer, its timeout included.  :class:`ProcessPool` runs the reward function in
``size`` worker processes instead; :class:`~megarl.rewards.runner.RewardRunner` drives it with
the same contract as its thread pool (``submit`` / ``abandon`` / ``close``), so statuses,
retries and counters do not change.  How workers are started, limited, killed and replaced, and
why none is left behind: :class:`ProcessPool`.

:func:`resolve_isolation` decides ``auto``: threads for the cheap rule builtins
(:data:`THREAD_SAFE_BUILTINS`) and the batched remote service (:data:`SELF_LIMITED_BUILTINS`),
processes for everything else (math_verify, code_exec, plug-ins).
"""

from __future__ import annotations

import collections
import itertools
import os
import signal
import sys
import threading
import time
from concurrent.futures import Future
from typing import Any, Mapping, Sequence

__all__ = ["ISOLATION_MODES", "THREAD_SAFE_BUILTINS", "SELF_LIMITED_BUILTINS", "resolve_isolation", "ProcessPool",
           "WorkerDied"]

ISOLATION_MODES = ("auto", "process", "thread")
#: builtins that cannot hang (linear-time rules) and run on threads under ``auto``; everything
#: else -- math_verify, code execution, plug-ins -- runs in worker processes
THREAD_SAFE_BUILTINS = frozenset({"exact_numeric", "regex", "arithmetic", "running_sum", "running_sum_steps"})
#: builtins scored in one ``score_batch`` call in the trainer, with their own timeouts (the remote
#: service: I/O, never holds the GIL): a process pool would sit idle, so ``auto`` keeps threads
SELF_LIMITED_BUILTINS = frozenset({"http"})


def resolve_isolation(mode: str, fn: str | None, components: Sequence[Mapping[str, Any]] | None = None) -> str:
    """``process`` or ``thread`` for ``reward.isolation`` = ``mode`` and the reward spec."""
    if mode not in ISOLATION_MODES:
        raise ValueError(f"reward.isolation {mode!r} is not one of {list(ISOLATION_MODES)}")
    if mode != "auto":
        return mode
    return "thread" if _cheap(fn, components) else "process"


def _cheap(fn, components) -> bool:
    if fn in THREAD_SAFE_BUILTINS or fn in SELF_LIMITED_BUILTINS:
        return True
    if fn == "composite":
        return bool(components) and all(
            isinstance(c, Mapping) and _cheap(c.get("fn"), c.get("components")) for c in components
        )
    return False


class WorkerDied(RuntimeError):
    """The worker process scoring a call exited before answering."""


class _RemoteError(Exception):
    """An exception raised by the reward function inside a worker (named by its type there)."""


_REMOTE_TYPES: dict[str, type] = {}


def _remote_exception(type_name: str, message: str) -> Exception:
    cls = _REMOTE_TYPES.get(type_name)
    if cls is None:
        cls = _REMOTE_TYPES[type_name] = type(type_name, (_RemoteError,), {})
    return cls(message)


def describe_exit(exitcode: int | None) -> str:
    if exitcode is None:
        return "still running"
    if exitcode < 0:
        try:
            return f"killed by signal {signal.Signals(-exitcode).name}"
        except ValueError:
            return f"killed by signal {-exitcode}"
    return f"exited with code {exitcode}"


# ---- the worker side -------------------------------------------------------------------------


def _die_with_parent(owner_pid: int) -> None:
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG: the kernel kills us with our parent
    except Exception:  # noqa: BLE001 -- not Linux: the watchdog and the pipe EOF remain
        pass

    def watchdog():
        while True:
            try:
                os.kill(owner_pid, 0)
            except ProcessLookupError:
                os._exit(0)
            except PermissionError:
                pass
            time.sleep(0.5)

    try:
        os.kill(owner_pid, 0)
    except ProcessLookupError:
        os._exit(0)
    threading.Thread(target=watchdog, name="reward-worker-watchdog", daemon=True).start()


def _worker_main(conn, spec: dict, owner_pid: int, max_memory_mb, cpu_time_s) -> None:
    """Runs in the worker process: build the function, then score what arrives until None/EOF."""
    _die_with_parent(owner_pid)
    import resource

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the trainer's to handle
    try:
        if max_memory_mb is not None:
            limit = int(max_memory_mb) * 1024 * 1024
            resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
        from megarl.rewards.base import WarmingUp
        from megarl.rewards.registry import build_reward_function

        fn = build_reward_function(spec["fn"], spec.get("kwargs"), spec.get("components"))
    except BaseException as e:  # noqa: BLE001 -- reported to the pool, which fails every call with it
        conn.send(("fatal", f"{type(e).__name__}: {e}"))
        return
    name = str(fn.name or spec["fn"])
    warmup = fn.warmup if isinstance(fn, WarmingUp) else None  # lazy first-call costs before "ready", not in a timeout
    if warmup is not None:
        try:
            warmup()
        except Exception:  # noqa: BLE001 -- a failing warm-up shows up in the first real call
            pass
    conn.send(("ready", os.getpid()))
    from megarl.experience.schema import RewardRecord

    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            return
        if msg is None:
            return
        tid, sample = msg
        if cpu_time_s is not None:
            ru = resource.getrusage(resource.RUSAGE_SELF)
            soft = int(ru.ru_utime + ru.ru_stime + float(cpu_time_s)) + 1
            resource.setrlimit(resource.RLIMIT_CPU, (soft, resource.RLIM_INFINITY))
        try:
            out = fn(sample)
            reply = ("rec", tid, out.to_json()) if isinstance(out, RewardRecord) else ("raw", tid, out)
        except BaseException as e:  # noqa: BLE001 -- any failure of the scorer is a status
            reply = ("exc", tid, type(e).__name__, str(e)[:2000])
        try:
            conn.send(reply)
        except (EOFError, BrokenPipeError):
            return
        except Exception as e:  # noqa: BLE001 -- the value could not be pickled
            conn.send(("exc", tid, "UnpicklableResult",
                       f"reward function {name!r} ({spec['fn']}) returned a value that cannot be sent back "
                       f"from its worker process: {type(e).__name__}: {e}"))


# ---- the trainer side ------------------------------------------------------------------------


import io as _io
from multiprocessing import context as _mpc
from multiprocessing import forkserver as _forkserver
from multiprocessing import popen_forkserver as _popen_forkserver
from multiprocessing import reduction as _reduction
from multiprocessing import spawn as _spawn
from multiprocessing import util as _mputil


class _WorkerPopen(_popen_forkserver.Popen):
    """CPython 3.11's ``popen_forkserver.Popen._launch`` without the parent's ``__main__``.

    multiprocessing re-runs the parent's main module in every spawned / forkserver child (as
    ``__mp_main__``); for a script without a ``__main__`` guard that would start a trainer per
    worker, and it always costs the main module's imports.  A worker needs only
    ``_worker_main``, so the main-module entries are left out of the preparation data (the rest,
    ``sys.path`` included, is kept so plug-ins import as in the trainer).
    """

    def _launch(self, process_obj):
        prep_data = _spawn.get_preparation_data(process_obj._name)
        for key in ("init_main_from_name", "init_main_from_path"):
            prep_data.pop(key, None)
        buf = _io.BytesIO()
        _mpc.set_spawning_popen(self)
        try:
            _reduction.dump(prep_data, buf)
            _reduction.dump(process_obj, buf)
        finally:
            _mpc.set_spawning_popen(None)
        self.sentinel, w = _forkserver.connect_to_new_process(self._fds)
        _parent_w = os.dup(w)
        self.finalizer = _mputil.Finalize(self, _mputil.close_fds, (_parent_w, self.sentinel))
        with open(w, "wb", closefd=True) as f:
            f.write(buf.getbuffer())
        self.pid = _forkserver.read_signed(self.sentinel)


class WorkerProcess(_mpc.ForkServerProcess):
    """A forkserver process launched by :class:`_WorkerPopen`."""

    @staticmethod
    def _Popen(process_obj):
        return _WorkerPopen(process_obj)


class _Task:
    """One attempt, as :class:`~megarl.rewards.runner._Task`: ``started`` is set when it is sent."""

    __slots__ = ("future", "arg", "started", "tid")

    def __init__(self, arg: Any, tid: int):
        self.future: Future = Future()
        self.arg, self.tid = arg, tid
        self.started: float | None = None


class _Worker:
    __slots__ = ("proc", "conn", "task", "ready", "killed", "pid")

    def __init__(self, proc, conn):
        self.proc, self.conn = proc, conn
        self.task: _Task | None = None
        self.ready = False
        self.killed = False
        self.pid = proc.pid


class ProcessPool:
    """``size`` worker processes scoring with ``build_reward_function(**spec)``.  ``restarts``
    counts replaced workers (killed for a timeout or dead).

    * the workers come from the ``forkserver`` context (never a fork of the trainer, which holds
      threads, gloo sockets and CUDA state); each builds its own reward function from a *spec*
      (``build_reward_function(**spec)``), so plug-ins are imported in the worker;
    * a call starts when it is sent to an idle, ready worker; an overdue call's worker is killed
      (SIGTERM, SIGKILL after ``kill_grace_s``) and replaced -- the runner has already recorded
      ``timeout`` at ``timeout_s``, it never waits for the kill;
    * a worker that dies while scoring (segfault, OOM kill, ``os._exit``, SIGXCPU) fails that call
      alone with status ``error`` naming the signal or exit code, and is replaced;
    * per-worker limits: ``max_memory_mb`` (RLIMIT_AS, the whole address space of the worker,
      interpreter and torch included: a MemoryError in the scorer is an ``error``) and
      ``cpu_time_s`` (RLIMIT_CPU, re-armed before every call so it is a per-call limit; exceeding it
      is a SIGXCPU death, an ``error``);
    * a return value that cannot be pickled is an ``error`` naming the reward function;
    * no orphans: each worker asks the kernel for SIGKILL when its parent dies
      (``PR_SET_PDEATHSIG``), watches the trainer's pid from a thread and exits on EOF of its pipe;
      the forkserver exits when the trainer does; :meth:`ProcessPool.close` (from ``runner.close()``
      or at interpreter exit) stops them.
    """

    def __init__(self, size: int, spec: Mapping[str, Any], name: str, *, kill_grace_s: float = 0.5,
                 max_memory_mb: int | None = None, cpu_time_s: float | None = None):
        import multiprocessing as mp
        from multiprocessing import forkserver

        if not isinstance(spec, Mapping) or not isinstance(spec.get("fn"), str):
            raise ValueError(f"process isolation needs a spec {{'fn': ..., 'kwargs': ..., 'components': ...}}, got {spec!r}")
        self._size, self._name = int(size), name
        self._spec = {"fn": spec["fn"], "kwargs": dict(spec.get("kwargs") or {}),
                      "components": list(spec.get("components") or [])}
        self._grace = float(kill_grace_s)
        self._limits = (max_memory_mb, cpu_time_s)
        # the forkserver imports the reward stack once (torch, via the record schema), so a
        # replacement worker starts in milliseconds; only effective if it is not running yet
        preload = ["megarl.rewards"] + (["math_verify"] if "math_verify" in repr(self._spec) else [])
        try:
            forkserver.set_forkserver_preload(preload)
        except Exception:  # noqa: BLE001
            pass
        self._ctx = mp.get_context("forkserver")
        self._lock = threading.Lock()
        self._pending: collections.deque[_Task] = collections.deque()
        self._workers: list[_Worker] = []
        self._ids = itertools.count()
        self._closed = False
        self._fatal: str | None = None
        self.restarts = 0
        self._wake_r, self._wake_w = self._ctx.Pipe(duplex=False)
        self._thread = threading.Thread(target=self._loop, name=f"reward-pool-{name}", daemon=True)
        self._thread.start()

    # the runner's interface
    def submit(self, fn, arg: Any) -> _Task:  # ``fn`` lives in the workers: built there from the spec
        with self._lock:
            if self._closed:
                raise RuntimeError("RewardRunner is closed")
            task = _Task(arg, next(self._ids))
            if self._fatal is not None:
                task.future.set_exception(RuntimeError(self._fatal))
                return task
            self._pending.append(task)
        self._wake()
        return task

    def abandon(self, task: _Task) -> None:
        """The call is overdue: kill its worker (SIGTERM, SIGKILL after the grace); replaced."""
        with self._lock:
            for w in self._workers:
                if w.task is task:
                    self._kill_locked(w)
        self._wake()

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            workers = list(self._workers)
            for t in self._pending:
                t.future.cancel()
            self._pending.clear()
        for w in workers:
            try:
                if w.task is None and w.ready:
                    w.conn.send(None)
                else:
                    w.proc.terminate()
            except Exception:  # noqa: BLE001
                pass
        self._wake()
        deadline = time.monotonic() + self._grace + 1.0
        for w in workers:
            w.proc.join(max(0.0, deadline - time.monotonic()))
            if w.proc.exitcode is None:
                w.proc.kill()
                w.proc.join(1.0)

    def worker_pids(self) -> list[int]:
        with self._lock:
            return [w.pid for w in self._workers]

    # internals
    def _wake(self) -> None:
        try:
            self._wake_w.send_bytes(b"x")
        except Exception:  # noqa: BLE001
            pass

    def _kill_locked(self, w: _Worker) -> None:
        if w.killed:
            return
        w.killed = True
        try:
            w.proc.terminate()
        except Exception:  # noqa: BLE001
            pass
        proc = w.proc

        def escalate():
            if proc.exitcode is None:
                try:
                    proc.kill()
                except Exception:  # noqa: BLE001
                    pass

        t = threading.Timer(self._grace, escalate)
        t.daemon = True
        t.start()

    def _start_worker(self) -> _Worker:
        parent, child = self._ctx.Pipe(duplex=True)
        proc = WorkerProcess(target=_worker_main, args=(child, self._spec, os.getpid(), *self._limits),
                                 name=f"reward-{self._name}", daemon=True)
        proc.start()
        child.close()
        return _Worker(proc, parent)

    def _loop(self) -> None:
        from multiprocessing.connection import wait

        from megarl.experience.schema import RewardRecord

        while True:
            with self._lock:
                if self._closed:
                    return
                need = self._size - len(self._workers) if self._fatal is None else 0
            for _ in range(max(0, need)):  # outside the lock: the first start waits for the forkserver
                try:
                    w = self._start_worker()
                except Exception as e:  # noqa: BLE001
                    self._fail_all(f"cannot start a reward worker process: {type(e).__name__}: {e}")
                    break
                with self._lock:
                    self._workers.append(w)
                    closed = self._closed
                if closed:  # close() ran while this one was starting: it did not see it
                    w.proc.terminate()
                    return
            with self._lock:
                if self._closed:
                    return
                for w in self._workers:
                    if not self._pending:
                        break
                    if w.ready and w.task is None and not w.killed:
                        task = self._pending.popleft()
                        if not task.future.set_running_or_notify_cancel():
                            continue
                        try:
                            w.conn.send((task.tid, task.arg))
                        except Exception as e:  # noqa: BLE001 -- e.g. an unpicklable sample
                            task.future.set_exception(RuntimeError(f"cannot send the sample to a reward worker: {e}"))
                            continue
                        task.started = time.monotonic()
                        w.task = task
                workers = list(self._workers)
            handles = [self._wake_r] + [w.conn for w in workers] + [w.proc.sentinel for w in workers]
            ready = wait(handles, timeout=1.0)
            if self._wake_r in ready:
                while self._wake_r.poll():
                    self._wake_r.recv_bytes()
            for w in workers:
                if w.conn in ready:
                    try:
                        msg = w.conn.recv()
                    except (EOFError, OSError):
                        msg = None
                    if msg is not None:
                        self._handle(w, msg, RewardRecord)
                        continue
                if w.proc.sentinel in ready or (w.conn in ready):
                    self._reap(w)

    def _handle(self, w: _Worker, msg: tuple, record_cls) -> None:
        kind = msg[0]
        if kind == "ready":
            w.ready = True
            return
        if kind == "fatal":
            self._fail_all(f"the reward function cannot be built in its worker process: {msg[1]}")
            return
        with self._lock:
            task, w.task = w.task, None
        if task is None or task.tid != msg[1] or w.killed:
            return  # an abandoned call's late answer
        if kind == "rec":
            try:
                task.future.set_result(record_cls.from_json(msg[2]))
            except Exception as e:  # noqa: BLE001
                task.future.set_exception(e)
        elif kind == "raw":
            task.future.set_result(msg[2])
        else:
            task.future.set_exception(_remote_exception(msg[2], msg[3]))

    def _reap(self, w: _Worker) -> None:
        w.proc.join(self._grace + 1.0)
        with self._lock:
            if w in self._workers:
                self._workers.remove(w)
                if not self._closed and self._fatal is None:
                    self.restarts += 1
            task, w.task = w.task, None
        try:
            w.conn.close()
        except Exception:  # noqa: BLE001
            pass
        if task is not None and not w.killed and not task.future.done():
            mem, cpu = self._limits
            task.future.set_exception(WorkerDied(
                f"reward worker process {w.pid} {describe_exit(w.proc.exitcode)} while scoring "
                f"(reward.max_memory_mb={mem}, reward.cpu_time_s={cpu})"))

    def _fail_all(self, why: str) -> None:
        with self._lock:
            self._fatal = why
            pending = list(self._pending)
            self._pending.clear()
        for t in pending:
            if t.future.set_running_or_notify_cancel():
                t.future.set_exception(RuntimeError(why))
        print(f"megarl.rewards: {why}", file=sys.stderr, flush=True)
