"""megarl.runtime.liveness: a rank whose heartbeat stops is named by the others within the
time-out; a rank that finished is not; a store that stops answering is reported; a collective's
transport failure is held until the lost rank is named.  (The node-lost run through a real Slurm
cluster is tests/e2e/test_slurm_cluster.py.)"""

import datetime
import os
import signal
import subprocess
import sys
import time

import pytest
import torch.distributed as dist

from tests._dist import free_port

from megarl.runtime.liveness import EXIT_PEER_LOST, PeerWatch, looks_like_a_lost_peer

#: a time-out far above any scheduling delay of a beating thread on a loaded machine, a period
#: short enough for the tests to be quick
TIMEOUT, PERIOD = 3.0, 0.1


class _Ranks:
    """A world of PeerWatches over one in-memory store, each recording what it would exit with."""

    def __init__(self, n, store=None):
        self.store = store if store is not None else dist.HashStore()
        self.reasons = {}
        self.watches = [PeerWatch(self.store, r, n, TIMEOUT, PERIOD, on_lost=self._recorder(r)) for r in range(n)]

    def _recorder(self, r):
        return lambda why: self.reasons.setdefault(r, why)

    def kill(self, r):
        """The rank's process is gone: its thread stops beating without saying it finished."""
        self.watches[r]._stop.set()
        self.watches[r]._thread.join()

    def wait(self, ranks, limit):
        deadline = time.monotonic() + limit
        while time.monotonic() < deadline and not set(ranks) <= set(self.reasons):
            time.sleep(0.02)
        return dict(self.reasons)

    def close(self):
        for w in self.watches:
            w._stop.set()


def test_a_silent_rank_is_named_by_every_other_within_the_timeout():
    ranks = _Ranks(4)
    try:
        time.sleep(3 * PERIOD)
        t0 = time.monotonic()
        ranks.kill(2)
        reasons = ranks.wait([0, 1, 3], TIMEOUT + 20 * PERIOD + 5.0)  # margins for a loaded machine
        took = time.monotonic() - t0
        assert set(reasons) == {0, 1, 3}, reasons
        # not before its heartbeat has stood still for the time-out (it last moved up to a period before the kill)
        assert took >= TIMEOUT - PERIOD
        for r in (0, 1, 3):
            assert "rank 2 (" in reasons[r] and "lost" in reasons[r] and f"peer_timeout_s={TIMEOUT:g}" in reasons[r]
            assert reasons[r].startswith(f"megarl: rank {r} ") and f"exit status {EXIT_PEER_LOST}" in reasons[r]
        assert "seen by rank 1" in reasons[0]  # rank 1 watches rank 2; the others read what it posted
    finally:
        ranks.close()


def test_ranks_that_beat_or_finished_are_never_lost():
    """The negative control: all beating for several time-outs, then rank 1 ends its run (stop())
    and the others go on watching for several more: nobody is declared lost."""
    ranks = _Ranks(3)
    try:
        time.sleep(2 * TIMEOUT)
        assert ranks.reasons == {}
        ranks.watches[1].stop()
        time.sleep(3 * TIMEOUT)
        assert ranks.reasons == {}
        assert ranks.watches[0]._thread.is_alive() and ranks.watches[2]._thread.is_alive()
    finally:
        ranks.close()


class _FailingStore:
    """A store whose host went away after ``ok`` operations."""

    def __init__(self, ok):
        self.inner, self.ok = dist.HashStore(), ok

    def __getattr__(self, name):
        def call(*a):
            self.ok -= 1
            if self.ok < 0:
                raise RuntimeError("Connection reset by peer")
            return getattr(self.inner, name)(*a)
        return call


def test_a_store_that_stops_answering_is_reported():
    got = []
    w = PeerWatch(_FailingStore(ok=10), 0, 2, TIMEOUT, PERIOD, on_lost=got.append, where="the job's store at h:1")
    w._thread.join(timeout=10)
    assert len(got) == 1 and "the job's store at h:1 stopped answering" in got[0], got


def test_a_store_host_that_goes_silent_is_reported_within_the_timeout():
    """The store's host stops answering without closing its connections (SIGSTOP here; a cut link
    on a cluster): the c10d client's call would wait for good, so the guard times the look."""
    port = free_port()
    host = subprocess.Popen([sys.executable, "-c", "import datetime, time, torch.distributed as d; "
                             f"s = d.TCPStore('127.0.0.1', {port}, None, True, datetime.timedelta(seconds=60), "
                             "wait_for_workers=False); print('up', flush=True); time.sleep(600)"],
                            stdout=subprocess.PIPE, text=True)
    try:
        assert host.stdout.readline().strip() == "up"
        client = dist.TCPStore("127.0.0.1", port, None, False, datetime.timedelta(seconds=TIMEOUT),
                               wait_for_workers=False)
        got = []
        w = PeerWatch(client, 0, 2, TIMEOUT, PERIOD, on_lost=got.append, where=f"the job's store at 127.0.0.1:{port}")
        time.sleep(3 * PERIOD)
        assert got == []
        t0 = time.monotonic()
        os.kill(host.pid, signal.SIGSTOP)
        deadline = t0 + TIMEOUT + 20 * PERIOD + 5.0
        while not got and time.monotonic() < deadline:
            time.sleep(0.02)
        took = time.monotonic() - t0
        assert len(got) == 1 and f"the job's store at 127.0.0.1:{port} has not answered for" in got[0], got
        assert TIMEOUT - PERIOD <= took, took
    finally:
        host.kill()  # the blocked call fails on the closed connection, and the watcher's thread ends
        host.wait()
    w._thread.join(timeout=30)
    assert not w._thread.is_alive() and len(got) == 1  # reported once


def test_explain_holds_a_transport_failure_until_the_lost_rank_is_named():
    ranks = _Ranks(2)
    try:
        # anything else is raised at once, as it is, while the watcher runs
        other = ValueError("a bug")
        assert not looks_like_a_lost_peer(other) and not looks_like_a_lost_peer(RuntimeError("shape mismatch"))
        t0 = time.monotonic()
        ranks.watches[0].explain(other)  # held, it would return only when a rank is named lost
        assert time.monotonic() - t0 < TIMEOUT - PERIOD and ranks.watches[0]._thread.is_alive()
        broken = RuntimeError("[gloo/transport/tcp/pair.cc:553] Connection closed by peer [10.77.0.12]:20876")
        assert looks_like_a_lost_peer(broken)
        t0 = time.monotonic()
        ranks.kill(1)
        ranks.watches[0].explain(broken)  # returns once the watcher named rank 1 (it would have exited)
        assert time.monotonic() - t0 >= TIMEOUT - PERIOD and "rank 1 (" in ranks.reasons[0]
    finally:
        ranks.close()


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="timeout_s=0"):
        PeerWatch(dist.HashStore(), 0, 2, 0, PERIOD)
    with pytest.raises(ValueError, match="world_size=1"):
        PeerWatch(dist.HashStore(), 0, 1, TIMEOUT, PERIOD)
