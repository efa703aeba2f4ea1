"""Split placement: one torchrun world divided once into trainer ranks and rollout ranks.

``placement.mode=split`` with ``placement.rollout_ranks=R`` makes the last R ranks of the world
rollout ranks: each runs a rollout engine and nothing else (:mod:`megarl.rollout.remote`).
The others are the trainer world, and everything in megarl that asks ``torch.distributed`` for
its rank, its world or its groups sees only them: the trainer ranks initialise the default
process group over themselves (megatron-core's TP/PP/DP groups are carved out of it, as in
hybrid placement), the rollout ranks over themselves.  Between the two sides:

* a **bridge** process group of trainer rank 0 and every rollout rank (bridge rank 0 is the
  trainer), which carries the weight buckets (gloo on CPU, NCCL on GPU), every collective under
  ``placement.timeout_s``;
* a **control channel** of ordered mailboxes over the job's c10d store (:class:`Mailbox`):
  commands to each rollout rank, replies back;
* **heartbeats**: each process bumps a counter in the store every second; a wait for the other
  side ends with :class:`PeerLostError`, naming the rank, once its heartbeat has not moved for
  ``placement.timeout_s`` -- so a killed process is detected within that bound, never hung on.

The store is the job's: torchrun's agent hosts it (``TORCHELASTIC_USE_AGENT_STORE``), else the
process of global rank 0 does (a plain launch with RANK / WORLD_SIZE / MASTER_ADDR /
MASTER_PORT, as ``env://`` would).  Keys are namespaced by torchrun's restart count, so a
restarted job never reads its predecessor's messages.
"""

from __future__ import annotations

import datetime
import os
import pickle
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch.distributed as dist

from megarl.errors import MegarlError

__all__ = ["SplitWorld", "PeerLostError", "Mailbox", "Heartbeat", "init_split", "split_world", "role_of"]


class PeerLostError(MegarlError, RuntimeError):
    """The other side of a split placement stopped answering (its heartbeat stalled or its
    connection closed) within ``placement.timeout_s``."""


def role_of(global_rank: int, world_size: int, rollout_ranks: int) -> str:
    """``"rollout"`` for the last ``rollout_ranks`` ranks of the world, else ``"trainer"``."""
    return "rollout" if global_rank >= world_size - rollout_ranks else "trainer"


class Heartbeat:
    """A daemon thread that bumps ``hb/<name>`` in the store every ``period_s`` seconds, and the
    reader side: :meth:`stalled_for` says how long a peer's counter has not moved."""

    def __init__(self, store, name: str, period_s: float = 1.0):
        self.store, self.name, self.period_s = store, name, period_s
        self._stop = threading.Event()
        self._seen: dict = {}  # peer -> (last value, monotonic time it last changed)
        store.add(f"hb/{name}", 1)
        self._thread = threading.Thread(target=self._beat, name=f"megarl-heartbeat-{name}", daemon=True)
        self._thread.start()

    def _beat(self) -> None:
        while not self._stop.wait(self.period_s):
            try:
                self.store.add(f"hb/{self.name}", 1)
            except Exception:  # the store is gone (its host exited): the waits will say so
                return

    def stalled_for(self, peer: str) -> float:
        """Seconds since ``peer``'s counter last moved (0 on the first look)."""
        now = time.monotonic()
        value = int(self.store.add(f"hb/{peer}", 0))
        last = self._seen.get(peer)
        if last is None or last[0] != value:
            self._seen[peer] = (value, now)
            return 0.0
        return now - last[1]

    def stop(self) -> None:
        """Stop beating and wait for the thread: a daemon thread still inside the store's C++ call
        when the interpreter exits is unwound through it, which aborts the process
        ("terminate called without an active exception", seen at the end of a loaded run)."""
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=self.period_s + 30.0)  # one store round trip, on a loaded machine


class Mailbox:
    """An ordered one-way channel over the store: message ``i`` is the key ``<name>/<i>``,
    written once by the sender and deleted by the receiver after reading.  ``recv`` waits until
    the next message exists, or fails with :class:`PeerLostError` once ``alive()`` (the peer's
    heartbeat check) says the peer is gone."""

    def __init__(self, store, name: str, alive: Optional[Callable[[], Optional[str]]] = None):
        self.store, self.name, self.alive = store, name, alive
        self.sent = self.received = 0
        self._peeked: Any = None
        self._has_peeked = False

    def send(self, obj: Any) -> None:
        self.store.set(f"{self.name}/{self.sent}", pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL))
        self.sent += 1

    def ready(self) -> bool:
        return self._has_peeked or self.store.check([f"{self.name}/{self.received}"])

    def peek(self, what: Optional[str] = None) -> Any:
        """The next message without taking it: call only when :meth:`ready`, or name ``what``
        is awaited to block for it as :meth:`recv` does."""
        if not self._has_peeked:
            if what is not None:
                self._wait(f"{self.name}/{self.received}", None, what)
            self._peeked = pickle.loads(self.store.get(f"{self.name}/{self.received}"))
            self._has_peeked = True
        return self._peeked

    def recv(self, timeout_s: Optional[float] = None, what: str = "a message") -> Any:
        """The next message.  Blocks while the peer is alive (and, when given, for at most
        ``timeout_s``)."""
        key = f"{self.name}/{self.received}"
        if self._has_peeked:
            obj, self._peeked, self._has_peeked = self._peeked, None, False
            self.store.delete_key(key)
            self.received += 1
            return obj
        self._wait(key, timeout_s, what)
        data = self.store.get(key)
        self.store.delete_key(key)
        self.received += 1
        return pickle.loads(data)

    def _wait(self, key: str, timeout_s: Optional[float], what: str) -> None:
        t0, pause, looked = time.monotonic(), 0.0005, None
        while not self.store.check([key]):
            now = time.monotonic()
            # the peer's heartbeat is a store round trip of its own: read it a few times a second
            if self.alive is not None and (looked is None or now - looked >= 0.25):
                looked = now
                lost = self.alive()
                if lost:
                    raise PeerLostError(f"waiting for {what} on {self.name}: {lost}")
            if timeout_s is not None and time.monotonic() - t0 > timeout_s:
                raise PeerLostError(f"waiting for {what} on {self.name}: nothing after {timeout_s:.0f}s")
            time.sleep(pause)
            pause = min(pause * 2, 0.005)  # a reply is waited on several times an iteration: keep latency low


def wait_either(first: Mailbox, second: Mailbox, what: str) -> Mailbox:
    """The first of two mailboxes from the same peer that has a message (``first`` when both
    do); fails as :meth:`Mailbox.recv` does once the peer is gone."""
    pause, looked = 0.0005, None
    while True:
        if first.ready():
            return first
        if second.ready():
            return second
        now = time.monotonic()
        if looked is None or now - looked >= 0.25:
            looked = now
            for box in (first, second):
                lost = box.alive() if box.alive is not None else None
                if lost:
                    raise PeerLostError(f"waiting for {what} on {first.name} / {second.name}: {lost}")
        time.sleep(pause)
        pause = min(pause * 2, 0.005)


@dataclass
class SplitWorld:
    """This process's place in a split placement (see the module docstring)."""

    role: str  # "trainer" | "rollout"
    global_rank: int
    world_size: int
    rollout_ranks: int
    timeout_s: float
    store: Any
    heartbeat: Heartbeat
    bridge: Any = None  # trainer rank 0 and every rollout rank; None elsewhere
    bridge_rank: Optional[int] = None

    @property
    def trainer_ranks(self) -> int:
        return self.world_size - self.rollout_ranks

    @property
    def rollout_index(self) -> int:
        """This rollout rank's index among the rollout ranks (0 .. R-1)."""
        return self.global_rank - self.trainer_ranks

    def peer_lost(self, peer: str) -> Optional[str]:
        """Why ``peer`` ("trainer" or "rollout<i>") counts as gone, or None while it beats."""
        try:
            stalled = self.heartbeat.stalled_for(peer)
        except Exception as e:  # the store's host (global rank 0 or the agent) is gone
            return f"the job's store is unreachable ({type(e).__name__}: {e})"
        if stalled > self.timeout_s:
            return (f"{peer}'s heartbeat has not moved for {stalled:.0f}s (placement.timeout_s={self.timeout_s:g}); "
                    "its process is gone or stuck")
        return None

    def peers(self) -> list:
        """The names of the other side's processes (their heartbeats)."""
        if self.role == "trainer":
            return [f"rollout{i}" for i in range(self.rollout_ranks)]
        return ["trainer"]

    def name_the_lost_peer(self, wait_s: float) -> Optional[str]:
        """After a collective with the other side failed: wait (at most ``wait_s``) until one of
        its heartbeats has stalled for ``timeout_s`` and return :meth:`peer_lost`'s reason for
        it, or None if every peer still beats by then.  A dead process's connection closes at
        once, but which process died is known only from the heartbeat it no longer sends."""
        deadline = time.monotonic() + wait_s
        while True:
            for peer in self.peers():
                why = self.peer_lost(peer)
                if why:
                    return why
            if time.monotonic() > deadline:
                return None
            time.sleep(0.2)

    # ``channel``: "cmd", the ordered commands, or "urgent", the ones that may overtake them
    # (teacher-forcing jobs, taken between generation segments and before the next command)
    def to_rollout(self, i: int, channel: str = "cmd") -> Mailbox:
        return Mailbox(self.store, f"{channel}/{i}", alive=lambda: self.peer_lost(f"rollout{i}"))

    def from_rollout(self, i: int) -> Mailbox:
        return Mailbox(self.store, f"reply/{i}", alive=lambda: self.peer_lost(f"rollout{i}"))

    def from_trainer(self, channel: str = "cmd") -> Mailbox:
        return Mailbox(self.store, f"{channel}/{self.rollout_index}", alive=lambda: self.peer_lost("trainer"))

    def to_trainer(self) -> Mailbox:
        return Mailbox(self.store, f"reply/{self.rollout_index}", alive=lambda: self.peer_lost("trainer"))

    def close(self) -> None:
        self.heartbeat.stop()


_WORLD: Optional[SplitWorld] = None


def split_world() -> Optional[SplitWorld]:
    """This process's :class:`SplitWorld`, or None outside split placement."""
    return _WORLD


def _job_store(timeout: datetime.timedelta):
    host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        return dist.TCPStore(host, port, world_size=None, is_master=False, timeout=timeout, wait_for_workers=False)
    return dist.TCPStore(host, port, world_size=world, is_master=rank == 0, timeout=timeout, wait_for_workers=False)


def _bridge_group(store, rank: int, size: int, timeout: datetime.timedelta, backend: str):
    """The weight group: a process group of its own over its own store prefix (torch cannot add
    a group spanning two default worlds, so it is constructed directly).  The NCCL branch is
    written for GPUs and has never run (no GPU was lent); gloo is what the CPU tests exercise."""
    if backend == "nccl":
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        return dist.ProcessGroupNCCL(store, rank, size, opts)
    return dist.ProcessGroupGloo(store, rank, size, timeout)


def init_split(rollout_ranks: int, timeout_s: float, backend: str,
               default_timeout: datetime.timedelta) -> SplitWorld:
    """Bring up this process's side of a split world (see the module docstring); returns it.
    Needs the torchrun environment (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT)."""
    global _WORLD
    missing = [k for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if k not in os.environ]
    if missing:
        raise MegarlError(f"placement.mode=split needs a torchrun world (torchrun --nproc-per-node N ...); "
                          f"{', '.join(missing)} not set")
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    role = role_of(rank, world, rollout_ranks)
    timeout = datetime.timedelta(seconds=timeout_s)
    base = _job_store(datetime.timedelta(seconds=max(timeout_s, 300.0)))
    store = dist.PrefixStore(f"megarl/split/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", base)
    trainers = world - rollout_ranks
    local = rank if role == "trainer" else rank - trainers
    size = trainers if role == "trainer" else rollout_ranks
    dist.init_process_group(backend=backend, store=dist.PrefixStore(role, store), rank=local, world_size=size,
                            timeout=default_timeout)
    name = "trainer" if role == "trainer" else f"rollout{local}"
    heartbeat = Heartbeat(store, name if (role == "rollout" or local == 0) else f"trainer{local}")
    bridge, bridge_rank = None, None
    if role == "rollout" or local == 0:
        bridge_rank = 0 if role == "trainer" else 1 + local
        bridge = _bridge_group(dist.PrefixStore("bridge", store), bridge_rank, 1 + rollout_ranks, timeout, backend)
    _WORLD = SplitWorld(role=role, global_rank=rank, world_size=world, rollout_ranks=rollout_ranks,
                        timeout_s=timeout_s, store=store, heartbeat=heartbeat, bridge=bridge, bridge_rank=bridge_rank)
    return _WORLD
