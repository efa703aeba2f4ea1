"""Liveness of the ranks of one world: a lost node is named within a bound, never hung on.

When a node dies (power, network, the OOM killer), the ranks that survive block in their next
collective.  If the link went down with it, gloo and NCCL wait out the process group's time-out
(30 minutes); if the dead process's sockets closed, the error names a socket address, not a rank.
Neither tells the operator, or the scheduler, what happened in time to act on it.

:class:`PeerWatch` gives every rank a heartbeat in the job's c10d store, watched by its ring
neighbour: a neighbour silent for ``parallel.peer_timeout_s`` is declared lost, and every rank
names it and ends with :data:`EXIT_PEER_LOST` (75, EX_TEMPFAIL), so the job is restarted from
its last checkpoint.  How, and why each part is bounded: :class:`PeerWatch`.  Split placement
has its own heartbeats between its two sides (:mod:`megarl.runtime.split`).
"""

from __future__ import annotations

import datetime
import os
import socket
import sys
import threading
import time
from typing import Callable, Optional

__all__ = ["PeerWatch", "EXIT_PEER_LOST", "start_peer_watch", "looks_like_a_lost_peer"]

EXIT_PEER_LOST = 75

# what a collective raises when the process at the other end is gone (gloo's TCP transport, NCCL)
_TRANSPORT_SIGNS = ("gloo/transport", "Connection closed by peer", "Connection reset by peer", "Broken pipe",
                    "NCCL communicator was aborted", "ncclRemoteError")


def looks_like_a_lost_peer(error: BaseException) -> bool:
    """Whether ``error`` is a collective's transport failure (a peer's connection went away)."""
    import torch.distributed as dist

    if isinstance(error, getattr(dist, "DistNetworkError", ())):
        return True
    return isinstance(error, RuntimeError) and any(s in str(error) for s in _TRANSPORT_SIGNS)


def _exit_peer_lost(message: str) -> None:
    print(message, file=sys.stderr, flush=True)
    sys.stdout.flush()
    os._exit(EXIT_PEER_LOST)


class PeerWatch:
    """Beat this rank's counter and watch the ring neighbour's.

    ``store`` is any c10d store (``add``, ``set``, ``get``, ``check``); ``on_lost`` is what is done
    with the reason once a peer is lost (default: print it and exit with :data:`EXIT_PEER_LOST`).

    It gives every rank a heartbeat in the job's c10d store and a daemon thread that,
    each ``period_s``, beats and reads its ring neighbour's counter (rank r watches r + 1 mod world:
    a constant number of store operations per rank, whatever the world's size).  A neighbour whose
    counter has not moved for ``parallel.peer_timeout_s`` seconds is declared lost, and the reason is
    posted in the store, where every rank's watcher reads it at its next look: each prints which rank
    was lost, on which host, and ends its process with :data:`EXIT_PEER_LOST` (75, EX_TEMPFAIL: try
    again).  The launcher sees failed workers, and the job is restarted (``launch/multinode.sh``'s
    requeue, or Slurm's own after a node failure) from its last checkpoint; nothing committed is lost,
    as a checkpoint is published atomically.  A store that stops answering (its host is the lost node)
    is reported the same way, bounded by the same time-out (a guard thread times each look: the c10d
    client's own time-out bounds waits for keys, not a reply that never comes).  A rank that ends its run says so first
    (:meth:`PeerWatch.stop`), so a finished rank is never taken for a lost one.

    The thread runs whatever the main thread is blocked in: a C++ collective releases the GIL.  Where
    a collective fails at once instead (the dead process's connection closed), :meth:`PeerWatch.explain`
    holds the failure until the watcher has named the rank, so the log says which one, not only
    "connection closed by peer".

    The store connection is the watcher's own (a client of the job's store at ``MASTER_ADDR:MASTER_PORT``,
    torchrun's agent's or rank 0's), with the time-out as its operation limit, so an unreachable store
    cannot block it longer than that.  Keys are namespaced by torchrun's restart count.
    """

    def __init__(self, store, rank: int, world_size: int, timeout_s: float, period_s: float = 1.0,
                 prefix: str = "megarl/live", on_lost: Optional[Callable[[str], None]] = None,
                 where: str = "the job's store"):
        if timeout_s <= 0 or period_s <= 0 or world_size < 2:
            raise ValueError(f"PeerWatch: timeout_s={timeout_s} and period_s={period_s} must be > 0, "
                             f"world_size={world_size} at least 2")
        self.store, self.rank, self.world_size = store, rank, world_size
        self.neighbour = (rank + 1) % world_size
        self.timeout_s, self.period_s, self.prefix, self.where = timeout_s, period_s, prefix, where
        self.on_lost = on_lost or _exit_peer_lost
        self.lost: Optional[str] = None
        self._found = threading.Event()
        self._stop = threading.Event()
        self._seen: Optional[tuple] = None  # (neighbour's counter, monotonic time it last moved)
        self._look_started: Optional[float] = None  # a look in progress: since when
        self._report_lock = threading.Lock()
        store.set(f"{prefix}/host/{rank}", socket.gethostname())
        store.add(self._key("beat", rank), 1)
        self._thread = threading.Thread(target=self._watch, name=f"megarl-peer-watch-{rank}", daemon=True)
        self._thread.start()
        # a store whose host stopped answering without closing the connection (its link cut) blocks
        # a store call for good: the c10d client's time-out bounds waits for keys, not replies
        self._guard = threading.Thread(target=self._guard_looks, name=f"megarl-peer-watch-guard-{rank}", daemon=True)
        self._guard.start()

    def _key(self, what: str, rank: Optional[int] = None) -> str:
        return f"{self.prefix}/{what}" if rank is None else f"{self.prefix}/{what}/{rank}"

    def _host(self, rank: int) -> str:
        try:
            if self.store.check([self._key("host", rank)]):
                return self.store.get(self._key("host", rank)).decode()
        except Exception:
            pass
        return "host unknown"

    def check(self) -> Optional[str]:
        """One look: beat, then why some rank counts as lost (posted by any rank's watcher, or
        this one's neighbour stalled), or None while all is well."""
        now = time.monotonic()
        try:
            self.store.add(self._key("beat", self.rank), 1)
            if self.store.check([self._key("lost")]):
                return self.store.get(self._key("lost")).decode()
            if self.store.check([self._key("done", self.neighbour)]):
                return None  # it finished its run
            value = int(self.store.add(self._key("beat", self.neighbour), 0))
        except Exception as e:
            return (f"{self.where} stopped answering ({type(e).__name__}: {str(e)[:200]}); its host is lost or "
                    f"cut off (parallel.peer_timeout_s={self.timeout_s:g})")
        if self._seen is None or self._seen[0] != value:
            self._seen = (value, now)
            return None
        stalled = now - self._seen[1]
        if stalled <= self.timeout_s:
            return None
        why = (f"rank {self.neighbour} ({self._host(self.neighbour)}) lost: its heartbeat has not moved for "
               f"{stalled:.0f} s (parallel.peer_timeout_s={self.timeout_s:g}), seen by rank {self.rank}; its process "
               "is gone, stuck or cut off")
        try:
            self.store.set(self._key("lost"), why)  # every other rank's watcher reads it at its next look
        except Exception:
            pass
        return why

    def _report(self, why: str) -> None:
        with self._report_lock:
            if self.lost is not None:
                return
            self.lost = why
        try:
            self.on_lost(f"megarl: rank {self.rank} ({socket.gethostname()}) stops: {why}; exit status "
                         f"{EXIT_PEER_LOST}, so that the job restarts from its last checkpoint")
        finally:
            self._found.set()

    def _watch(self) -> None:
        while not self._stop.wait(self.period_s):
            self._look_started = time.monotonic()
            why = self.check()
            self._look_started = None
            if why:
                self._report(why)
                return

    def _guard_looks(self) -> None:
        while not self._stop.wait(self.period_s) and self.lost is None:
            started = self._look_started
            if started is not None and time.monotonic() - started > self.timeout_s:
                self._report(f"{self.where} has not answered for {time.monotonic() - started:.0f} s; its host is "
                             f"lost or cut off (parallel.peer_timeout_s={self.timeout_s:g})")
                return

    def explain(self, error: BaseException) -> None:
        """After ``error`` in the main thread: when it is a transport failure, wait (at most the
        time-out and two periods) for the watcher to name the lost rank, which ends the process.
        Returns when nothing is found, for the caller to raise ``error`` as it is."""
        if looks_like_a_lost_peer(error) and self._thread.is_alive():
            self._found.wait(self.timeout_s + 2 * self.period_s + 5.0)

    def stop(self) -> None:
        """This rank has finished its run: say so (its watcher's ring neighbour stops watching it),
        stop beating and wait for the thread (never leave it inside a store call at exit)."""
        try:
            self.store.set(self._key("done", self.rank), "1")
        except Exception:
            pass
        self._stop.set()
        for t in (self._thread, self._guard):
            if t is not threading.current_thread():
                t.join(timeout=self.period_s + self.timeout_s + 5.0)


def start_peer_watch(timeout_s: Optional[float]) -> Optional[PeerWatch]:
    """The watch over this torchrun world (``RANK`` / ``WORLD_SIZE`` / ``MASTER_ADDR`` /
    ``MASTER_PORT``), or None: a world of one, a plain process, or ``timeout_s`` None (off)."""
    import torch.distributed as dist

    world = int(os.environ.get("WORLD_SIZE", "1"))
    if timeout_s is None or world < 2 or "MASTER_ADDR" not in os.environ:
        return None
    host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    store = dist.TCPStore(host, port, world_size=None, is_master=False,
                          timeout=datetime.timedelta(seconds=timeout_s), wait_for_workers=False)
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    period = min(1.0, timeout_s / 5)
    return PeerWatch(store, int(os.environ["RANK"]), world, timeout_s, period_s=period,
                     prefix=f"megarl/live/{restart}", where=f"the job's store at {host}:{port}")
