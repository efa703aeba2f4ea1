"""Scorers in worker processes (reward.isolation=process): every failure is a status in time.

A scorer that hangs holding the GIL (one bigint call lasting minutes) cannot be stopped on a
thread; in a worker process it is killed at its timeout and the sample is a ``timeout``.  A
worker that dies is that sample's ``error``; an unpicklable result is an ``error`` naming the
plug-in; no worker outlives the process that owns the pool, even a SIGKILLed one.
"""

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import psutil

from megarl.experience.schema import RewardStatus
from megarl.rewards import RewardRunner, RewardSample, build_reward_function
from megarl.rewards.isolation import resolve_isolation
from tests._dist import ROOT, subprocess_env

PLUG = "tests.plugins.hostile_rewards"
GRACE = 0.5
#: how long the hostile scorers would run unkilled (a bigint power, a pathological parse): minutes
HOG_MINUTES = 1


def sample(response, group="run/it0/r0/p000", sid="s", answer="3"):
    return RewardSample(sample_id=sid, prompt_id=group, group_id=group, prompt_text="1 + 2 =", response_text=response,
                        prompt_ids=(1,), response_ids=(2,), finish_reason="eos", ground_truth={"answer": answer})


def runner(fn, timeout_s=2.0, workers=2, **kw):
    spec = {"fn": fn, "kwargs": kw.pop("kwargs", {})}
    return RewardRunner(build_reward_function(spec["fn"], spec["kwargs"]), timeout_s=timeout_s, max_retries=0,
                        max_workers=workers, isolation="process", spec=spec, kill_grace_s=GRACE, **kw)


def timed(r, samples):
    t = time.monotonic()
    recs = r.score(samples)
    return recs, time.monotonic() - t


def test_auto_isolation():
    assert resolve_isolation("auto", "arithmetic") == "thread"
    assert resolve_isolation("auto", "exact_numeric") == "thread"
    assert resolve_isolation("auto", "composite", [{"name": "a", "fn": "regex"}, {"name": "b", "fn": "arithmetic"}]) == "thread"
    assert resolve_isolation("auto", "composite", [{"name": "a", "fn": "regex"}, {"name": "b", "fn": "math_verify"}]) == "process"
    assert resolve_isolation("auto", "math_verify") == "process"
    assert resolve_isolation("auto", f"{PLUG}:crash") == "process"
    assert resolve_isolation("auto", "code_exec") == "process" and resolve_isolation("auto", "http") == "thread"
    assert resolve_isolation("thread", "math_verify") == "thread"
    assert resolve_isolation("process", "arithmetic") == "process"


def test_gil_holding_scorer_is_a_timeout_and_the_trainer_keeps_running():
    """p001's scorer spends minutes in one GIL-holding bigint call: a timeout at timeout_s, its
    worker killed and replaced; the other samples score; the trainer's threads never stall."""
    with runner(f"{PLUG}:gil_hog", timeout_s=2.0, workers=2) as r:
        assert [x.total for x in r.score([sample("3")])] == [1.0]  # warm: the pool is up
        beats, stop = [], threading.Event()

        def heartbeat():  # a trainer thread: needs the GIL every 20 ms
            while not stop.is_set():
                beats.append(time.monotonic())
                time.sleep(0.02)

        hb = threading.Thread(target=heartbeat, daemon=True)
        hb.start()
        batch = ([sample("3", sid=f"ok{i}") for i in range(3)] + [sample("3", "run/it0/r0/p001", f"hog{i}") for i in range(2)]
                 + [sample("4", sid="wrong")])
        recs, wall = timed(r, batch)
        stop.set()
        hb.join()
        statuses = [x.status.value for x in recs]
        assert statuses == ["ok", "ok", "ok", "timeout", "timeout", "ok"], [(x.status, x.error) for x in recs]
        assert [x.total for x in recs[:3]] == [1.0] * 3 and recs[5].total == 0.0
        assert "timeout_s=2.0" in recs[3].error
        # the two hogs run side by side and are declared at 2 s, never before; unkilled they would
        # run for minutes (HOG_MINUTES).  How soon after the timeout the batch returns (forking
        # replacement workers) is bench/timeouts.py's to measure, not this test's
        assert 2.0 <= wall < HOG_MINUTES * 60, wall
        # a hog holding the trainer's GIL would stall this thread for the whole 2 s timeout; in a
        # worker process it cannot (the gaps a busy machine gives a 20 ms sleeper: bench/timeouts.py)
        gaps = [b - a for a, b in zip(beats, beats[1:], strict=False)]
        assert max(gaps) < 2.0, max(gaps)
        m = r.metrics()
        assert m["reward/gil_hog/timeouts"] == 2 and m["reward/gil_hog/worker_restarts"] == 2
        assert m["reward/gil_hog/latency_p50_s"] < 2.0 and m["reward/gil_hog/calls_per_s"] > 0
        time.sleep(GRACE + 0.5)
        assert r.score([sample("3")])[0].total == 1.0  # the pool recovered


def test_metrics_window_and_the_circuit_breaker_slot():
    from megarl.experience.schema import RewardRecord

    class Remote:  # a scorer with a breaker and metrics of its own, on threads
        name, version, circuit_open = "remote", "remote/1", False

        def __call__(self, s):
            return RewardRecord(total=1.0, scorer_version=self.version)

        def metrics(self):
            return {"breaker_state": 2.0}

    fn = Remote()
    with RewardRunner(fn, timeout_s=5.0) as r:
        r.score([sample("x")] * 4)
        m = r.metrics()
        assert m["reward/remote/timeouts"] == 0 and m["reward/remote/calls_per_s"] > 0
        assert m["reward/remote/circuit_open"] == 0.0 and m["reward/remote/breaker_state"] == 2.0
        assert m["reward/remote/latency_p50_s"] <= m["reward/remote/latency_p99_s"]
        fn.circuit_open = True
        m = r.metrics()  # a new window: no calls since
        assert m["reward/remote/calls_per_s"] == 0.0 and "reward/remote/latency_p50_s" not in m
        assert m["reward/remote/circuit_open"] == 1.0


PATHOLOGICAL = [
    r"The answer is \boxed{9^{9^{9^{9}}}}",
    r"The answer is \boxed{(10^{10})!}",
    r"The answer is \boxed{" + "(" * 3000 + "1" + ")" * 3000 + "}",
    r"The answer is \boxed{9^{9^{9}}} = \boxed{2^{2^{2^{2^{2^{2}}}}}}",
]


def test_math_verify_returns_within_its_timeout_on_pathological_answers():
    timeout = 3.0
    with runner("math_verify", timeout_s=timeout, workers=4) as r:
        assert r.score([sample(r"\boxed{3}")])[0].total == 1.0
        for text in PATHOLOGICAL:  # one at a time: each its own stall measurement
            (rec,), wall = timed(r, [sample(text)])
            assert rec.status in (RewardStatus.OK, RewardStatus.TIMEOUT), (text[:40], rec)
            # unbounded, each of these runs for minutes; how close to the timeout it returns is
            # bench/timeouts.py's measurement
            assert wall < HOG_MINUTES * 60, (text[:40], wall)
            print(f"{text[:40]!r}: {rec.status.value} in {wall:.2f} s")
        recs = r.score([sample(r"\boxed{3}"), sample(r"\boxed{\frac{6}{2}}"), sample(r"\boxed{4}")])
        assert [x.total for x in recs] == [1.0, 1.0, 0.0], [(x.status, x.error) for x in recs]


def test_a_dead_worker_fails_its_sample_alone():
    with runner(f"{PLUG}:crash", timeout_s=10.0, workers=2) as r:
        recs = r.score([sample("a"), sample("exit"), sample("b"), sample("segv"), sample("c")])
        assert [x.status.value for x in recs] == ["ok", "error", "ok", "error", "ok"]
        assert "exited with code 3" in recs[1].error and "SIGSEGV" in recs[3].error, (recs[1].error, recs[3].error)
        assert r.metrics()["reward/crash/worker_restarts"] == 2
        assert all(x.total == 1.0 for x in r.score([sample(str(i)) for i in range(6)]))


def test_unpicklable_result_is_an_error_naming_the_plugin():
    with runner(f"{PLUG}:unpicklable", timeout_s=10.0, workers=1) as r:
        (rec,) = r.score([sample("x")])
        assert rec.status is RewardStatus.ERROR and "'unpicklable'" in rec.error and "cannot be sent back" in rec.error


def test_cpu_and_memory_limits_are_errors():
    with runner(f"{PLUG}:cpu_spin", timeout_s=30.0, workers=1, cpu_time_s=1.0) as r:
        (spin,), wall = timed(r, [sample("spin")])
        assert spin.status is RewardStatus.ERROR and "SIGXCPU" in spin.error, spin.error
        assert wall < 10.0
        assert r.score([sample("x")])[0].total == 1.0
    with runner(f"{PLUG}:memory_hog", timeout_s=30.0, workers=1, max_memory_mb=6144) as r:
        big, small = r.score([sample("big"), sample("x")])
        assert big.status is RewardStatus.ERROR and "MemoryError" in big.error, big.error
        assert small.total == 1.0


def test_a_plugin_that_does_not_build_fails_every_call_with_its_reason():
    spec = {"fn": f"{PLUG}:crash", "kwargs": {"nope": 1}}
    with RewardRunner(lambda s: None, timeout_s=5.0, max_retries=1, backoff_s=0.0, isolation="process",
                      spec=spec) as r:
        recs = r.score([sample("a"), sample("b")])
        assert all(x.status is RewardStatus.ERROR and "cannot be built" in x.error for x in recs), recs


OWNER = textwrap.dedent("""
    import sys, time
    sys.path.insert(0, {root!r})
    from megarl.rewards import RewardRunner, RewardSample, build_reward_function
    spec = {{"fn": "tests.plugins.hostile_rewards:crash"}}
    r = RewardRunner(build_reward_function(spec["fn"]), timeout_s=30, max_workers=3, isolation="process", spec=spec)
    s = RewardSample(sample_id="s", prompt_id="p", group_id="g", prompt_text="", response_text="x", prompt_ids=(),
                     response_ids=(), finish_reason="eos", ground_truth={{}})
    assert r.score([s] * 6)[0].total == 1.0
    while len(r._pool.worker_pids()) < 3:
        time.sleep(0.05)
    print("READY", flush=True)
    time.sleep(600)
""")


def test_sigkill_of_the_owner_leaves_no_worker():
    proc = subprocess.Popen([sys.executable, "-c", OWNER.format(root=ROOT)], stdout=subprocess.PIPE, text=True,
                            env=subprocess_env())
    try:
        assert proc.stdout.readline().strip() == "READY"
        kids = psutil.Process(proc.pid).children(recursive=True)  # the forkserver and its 3 workers
        assert len(kids) >= 4, kids
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(10)
        deadline = time.monotonic() + 10.0
        alive = kids
        while alive and time.monotonic() < deadline:
            alive = [k for k in kids if k.is_running() and k.status() != psutil.STATUS_ZOMBIE]
            time.sleep(0.1)
        assert not alive, [(k.pid, k.name()) for k in alive]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
