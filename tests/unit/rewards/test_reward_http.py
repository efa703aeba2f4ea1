"""reward.fn: http -- a remote reward service that misbehaves on command (127.0.0.1 only).

Every failure of the service is a named status, never a number; the circuit breaker opens,
fails fast and closes again after a half-open probe; the auth secret appears nowhere.
"""

import json
import logging
import math
import os
import socket
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from megarl.experience.schema import RewardStatus
from megarl.rewards import HttpReward, RewardConfigError, RewardRunner, RewardSample, build_reward_function

SECRET = "s3cr3t-token-do-not-leak-7f1e"
ENV = "MEGARL_TEST_REWARD_TOKEN"


def sample(i: int, answer: str = "3") -> RewardSample:
    return RewardSample(sample_id=f"s{i}", prompt_id="p0", group_id="g0", prompt_text="1+2?",
                        response_text=f"answer {i}", prompt_ids=(1, 2), response_ids=(3, 4 + i),
                        finish_reason="eos", ground_truth={"answer": answer})


class Service:
    """A reward service on 127.0.0.1 whose behaviour ``mode`` is set by the test."""

    def __init__(self):
        self.mode = "ok"
        self.requests: list[dict] = []
        self.auth: list[str | None] = []
        svc = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *a):  # keep the test output clean
                pass

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                svc.requests.append(body)
                svc.auth.append(self.headers.get("Authorization"))
                n, mode = len(body["samples"]), svc.mode
                if mode == "drop":
                    self.close_connection = True
                    self.connection.shutdown(socket.SHUT_RDWR)
                    return
                if mode == "slow":  # far past the 1 s the test gives it: its timeout is certain
                    time.sleep(30.0)
                status, payload = 200, None
                if mode in ("ok", "slow"):
                    payload = {"scores": [{"sample_id": s["sample_id"], "total": float(len(s["response"])),
                                           "components": {"len": float(len(s["response"]))}} for s in body["samples"]]}
                elif mode == "500":
                    status, payload = 500, {"detail": f"boom (your header was {self.headers.get('Authorization')})"}
                elif mode == "arith":  # the arithmetic task's rule, remotely
                    payload = {"scores": [{"total": float(s["response"].replace(" ", "").strip()
                                                          == str(s["ground_truth"]["answer"]))}
                                          for s in body["samples"]]}
                elif mode == "404":
                    status, payload = 404, {"detail": "no such route"}
                elif mode == "401":
                    status, payload = 401, {"detail": "bad token"}
                elif mode == "malformed":
                    raw = b"{not json"
                elif mode == "short":
                    payload = {"scores": [{"total": 1.0}] * (n - 1)}
                elif mode == "nan":
                    raw = json.dumps({"scores": [{"total": float("nan")}] + [{"total": 1.0}] * (n - 1)}).encode()
                elif mode == "per_sample":
                    payload = {"scores": [{"status": "invalid", "error": "no tests"}, {"status": "error", "error": "oom"}]
                               + [{"total": 0.5}] * (n - 2)}
                if payload is not None:
                    raw = json.dumps(payload).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(raw)))
                self.end_headers()
                self.wfile.write(raw)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/score"
        self.thread = threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
        self.thread.start()
        self.stopper = threading.Timer(120.0, self.stop)  # stops by itself if a test forgets
        self.stopper.daemon = True
        self.stopper.start()

    def stop(self):
        self.stopper.cancel()
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def service(monkeypatch):
    monkeypatch.setenv(ENV, SECRET)
    svc = Service()
    yield svc
    svc.stop()


def make(service, **kw) -> HttpReward:
    # a request to the local service takes milliseconds: 10 s never fires on a healthy one, however
    # busy the machine; the timeout test sets its own limit against a service that hangs for 30 s
    args = dict(url=service.url, auth_env=ENV, auth_prefix="Bearer ", timeout_s=10.0, max_retries=1, backoff_s=0.01,
                max_backoff_s=0.02, batch_size=4, max_concurrency=2, breaker_failures=100, breaker_reset_s=0.3)
    args.update(kw)
    return build_reward_function("http", args)


def no_secret(*things):
    for t in things:
        assert SECRET not in str(t), f"secret leaked into {str(t)[:200]!r}"


def test_ok_batches_schema_and_auth(service):
    fn = make(service)
    samples = [sample(i) for i in range(10)]
    recs = fn.score_batch(samples)
    assert [r.status for r in recs] == [RewardStatus.OK] * 10
    assert [r.total for r in recs] == [float(len(s.response_text)) for s in samples]
    assert recs[0].components == {"len": 8.0}
    assert len(service.requests) == 3  # batch_size 4: 4 + 4 + 2
    req = next(r for r in service.requests if r["samples"][0]["sample_id"] == "s0")  # requests run concurrently
    assert req["schema"] == "megarl.reward/1"
    assert set(req["samples"][0]) == {"sample_id", "prompt_id", "group_id", "prompt", "response", "prompt_ids",
                                      "response_ids", "finish_reason", "ground_truth", "messages"}
    assert req["samples"][1]["response_ids"] == [3, 5] and req["samples"][0]["ground_truth"] == {"answer": "3"}
    assert service.auth == [f"Bearer {SECRET}"] * 3  # the header carries it, nothing else does
    m = fn.metrics()
    assert m["requests"] == 3 and m["request_ok"] == 3 and m["breaker_state"] == 0 and m["samples_ok"] == 10
    assert 1 <= m["inflight_max"] <= 2
    no_secret(fn.version, repr(fn), m, [r.to_json() for r in recs])
    assert fn(sample(0)).total == 8.0  # per-sample call = batch of one


@pytest.mark.parametrize("mode, status, tag, retried", [
    ("500", RewardStatus.ERROR, "[http_5xx]", True),
    ("404", RewardStatus.ERROR, "[http_4xx]", False),
    ("401", RewardStatus.ERROR, "[http_4xx]", False),
    ("malformed", RewardStatus.ERROR, "[malformed_response]", True),
    ("short", RewardStatus.ERROR, "[wrong_length]", True),
    ("drop", RewardStatus.ERROR, "[connection]", True),
    ("slow", RewardStatus.TIMEOUT, "[timeout]", True),
])
def test_each_failure_is_a_named_status(service, caplog, capsys, mode, status, tag, retried):
    service.mode = mode
    fn = make(service, **({"timeout_s": 1.0} if mode == "slow" else {}))
    caplog.set_level(logging.DEBUG)
    with RewardRunner(fn, timeout_s=5.0, max_retries=0) as runner:
        recs = runner.score([sample(i) for i in range(3)])
    for r in recs:
        assert r.status is status and r.total is None, r
        assert r.error.startswith(tag), r.error
        assert "giving up" in r.error
    assert len(service.requests) == (2 if retried else 1)
    assert runner.counters[status.value] == 3 and runner.counters["failed"] == 3 and runner.counters["calls"] == 3
    assert runner.counters["retries"] == (1 if retried else 0)
    if hasattr(runner, "metrics"):  # the runner's per-scorer telemetry merges fn.metrics()
        m = runner.metrics()
        assert m["reward/http/requests"] == len(service.requests) and m["reward/http/breaker_state"] == 0
    assert fn.metrics()["request_failures"] == len(service.requests)
    out = capsys.readouterr()
    no_secret([r.to_json() for r in recs], caplog.text, out.out, out.err, fn.metrics())


def test_non_finite_score_and_per_sample_statuses(service):
    service.mode = "nan"
    fn = make(service)
    recs = fn.score_batch([sample(i) for i in range(3)])
    assert recs[0].status is RewardStatus.ERROR and recs[0].error.startswith("[non_finite_score]")
    assert [r.total for r in recs[1:]] == [1.0, 1.0]
    service.mode = "per_sample"
    recs = fn.score_batch([sample(i) for i in range(3)])
    assert recs[0].status is RewardStatus.INVALID and recs[0].error == "[service_invalid] no tests"
    assert recs[1].status is RewardStatus.ERROR and recs[1].error == "[service_error] oom"
    assert recs[2].total == 0.5
    for r in recs[:2]:
        assert r.total is None


def test_breaker_opens_fails_fast_and_recovers(service, caplog):
    """The breaker's clock is stepped by the test (no sleeps): what is asserted is the state
    machine at the configured reset period, not how fast this machine is."""
    caplog.set_level(logging.INFO)
    service.mode = "500"
    fn = make(service, max_retries=0, breaker_failures=3, breaker_reset_s=1.0, batch_size=1)
    now = [1000.0]
    fn._breaker.clock = lambda: now[0]
    for i in range(3):
        assert fn(sample(i)).error.startswith("[http_5xx]")
    assert fn.metrics()["breaker_state"] == 2 and fn.metrics()["breaker_opens"] == 1 and fn.circuit_open()
    n_before = len(service.requests)
    recs = fn.score_batch([sample(i) for i in range(5)])
    assert len(service.requests) == n_before, "an open breaker fails fast: no request while open"
    for r in recs:
        assert r.status is RewardStatus.ERROR and r.error.startswith("[breaker_open]") and r.total is None
    assert fn.metrics()["breaker_rejected"] == 5
    now[0] += 0.999  # just inside the reset period: still open
    assert fn(sample(0)).error.startswith("[breaker_open]") and len(service.requests) == n_before
    # half-open probe fails: open again for another reset period
    now[0] += 0.001
    assert fn(sample(0)).error.startswith("[http_5xx]")
    assert len(service.requests) == n_before + 1
    assert fn(sample(0)).error.startswith("[breaker_open]")
    assert fn.metrics()["breaker_opens"] == 2
    # the service recovers: the next probe closes the breaker and scoring resumes
    service.mode = "ok"
    now[0] += 1.0
    recs = fn.score_batch([sample(i) for i in range(3)])
    assert all(r.status is RewardStatus.OK for r in recs)
    assert fn.metrics()["breaker_state"] == 0
    assert "circuit breaker open" in caplog.text and "circuit breaker closed" in caplog.text
    no_secret(caplog.text)


def test_service_down_connection_refused(monkeypatch):
    monkeypatch.setenv(ENV, SECRET)
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    fn = HttpReward(f"http://127.0.0.1:{port}/score", auth_env=ENV, timeout_s=5.0, max_retries=1, backoff_s=0.01,
                    breaker_failures=2, breaker_reset_s=60)
    r = fn(sample(0))
    assert r.status is RewardStatus.ERROR and r.error.startswith("[connection]"), r.error
    r = fn(sample(1))
    assert r.error.startswith("[breaker_open]")
    no_secret(r.error)


def test_config_errors_never_show_the_secret(monkeypatch):
    monkeypatch.delenv(ENV, raising=False)
    with pytest.raises(RewardConfigError, match=ENV):
        build_reward_function("http", {"url": "http://127.0.0.1:1/x", "auth_env": ENV})
    for url in (f"http://user:{SECRET}@127.0.0.1:1/x", f"ftp://user:{SECRET}@127.0.0.1/x",
                f"http://127.0.0.1:1/x?token={SECRET}"):
        with pytest.raises(RewardConfigError, match="credentials") as e:
            build_reward_function("http", {"url": url})
        no_secret(e.value, e.value.__cause__)
    with pytest.raises(RewardConfigError, match="url"):
        build_reward_function("http", {"url": "ftp://127.0.0.1/x"})
    with pytest.raises(RewardConfigError, match="timeout_s"):
        build_reward_function("http", {"url": "http://127.0.0.1:1/x", "timeout_s": math.inf})


def test_runner_batch_branch_exceptions_are_statuses():
    class Broken:
        name, version = "broken", "broken/1"

        def __call__(self, s):
            raise AssertionError("per-sample path must not be used")

        def score_batch(self, samples):
            raise RuntimeError("service client crashed")

    with RewardRunner(Broken()) as runner:
        recs = runner.score([sample(0), sample(1)])
    assert [r.status for r in recs] == [RewardStatus.ERROR] * 2
    assert recs[0].error == "RuntimeError: service client crashed"
    assert runner.counters["error"] == 2 and runner.counters["failed"] == 2


def test_training_run_with_the_service_leaks_no_secret(service, assets, tmp_path):
    """A real 2-iteration GRPO run scored by the service: the token reaches the service's header
    and nowhere in the run directory, the config it saved, its metrics or its console output."""
    from tests._dist import subprocess_env
    from tests._train_runs import GRPO

    service.mode = "arith"
    run_dir = str(tmp_path / "run")
    cmd = [sys.executable, "-m", "megarl.train", "--config", GRPO, f"model.path={assets['model']}",
           "model.build_tiny=false", f"data.train_path={assets['train']}", f"data.heldout_path={assets['heldout']}",
           "data.task.build=false", f"trainer.run_dir={run_dir}", "trainer.iterations=2",
           "trainer.prompts_per_iteration=2", "rollout.n=2", "algo.num_mini_batches=1", "algo.micro_batch_size=4",
           "algo.forward_micro_batch_size=8", "eval.n=4", "eval.every=0", "trainer.save_experience=true",
           "reward.fn=http", f"reward.kwargs.url={service.url}", f"reward.kwargs.auth_env={ENV}",
           "reward.kwargs.auth_prefix=Bearer", "reward.kwargs.timeout_s=5", "reward.kwargs.batch_size=3",
           "reward.on_failure=quarantine"]
    env = dict(subprocess_env(), **{ENV: SECRET})
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900)
    assert proc.returncode == 0, f"--- stdout ---\n{proc.stdout[-4000:]}\n--- stderr ---\n{proc.stderr[-6000:]}"
    assert service.requests and set(service.auth) == {f"Bearer{SECRET}"}
    no_secret(proc.stdout, proc.stderr)
    files = 0
    for root, _, names in os.walk(run_dir):
        for n in names:
            with open(os.path.join(root, n), "rb") as f:
                assert SECRET.encode() not in f.read(), f"secret in {os.path.join(root, n)}"
            files += 1
    assert files > 3
    from tests._train_runs import batches

    recs = [r for b in batches(run_dir) for r in b.facts.rewards]
    assert recs and all(r.scorer_version.startswith("http/1(") and r.status.value == "ok" for r in recs)
