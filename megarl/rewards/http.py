"""A remote reward service over HTTP (``reward.fn: http``).

Batches of samples are POSTed as JSON to ``url`` (schema ``megarl.reward/1``); the service
answers ``{"scores": [...]}``, exactly one result per request sample, in order: a total with
optional components, or the service's own ``error`` / ``invalid`` verdict.  Every way the service
can fail is a *status* with a message that starts with a bracketed tag naming the failure, never
a number.  The request and response formats, the table of failures (status, retried, counted by
the circuit breaker), the tags, auth, the breaker and the limits: ``docs/rewards.md``, "A remote
reward service".

The auth token is read from the environment (``auth_env``) at each request and never stored on
the object, put in the scorer version, logged or placed in an error text.  The worst case for one
:meth:`score_batch` is about ``ceil(n / batch_size / max_concurrency) * (1 + max_retries) *
(timeout_s + max_backoff_s)``.
"""

from __future__ import annotations

import json
import logging
import math
import numbers
import os
import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Sequence
from urllib.parse import urlsplit

from megarl.experience.schema import RewardRecord, RewardStatus
from megarl.rewards.base import RewardConfigError, RewardSample, check_number

__all__ = ["HttpReward", "REQUEST_SCHEMA"]

log = logging.getLogger(__name__)

REQUEST_SCHEMA = "megarl.reward/1"
_BREAKER_STATES = {"closed": 0, "half_open": 1, "open": 2}


class _Failure(Exception):
    """A failed attempt: ``tag`` names it, ``retry`` says whether another attempt may help,
    ``breaker`` whether it counts against the service's health."""

    def __init__(self, tag: str, message: str, *, retry: bool, breaker: bool, status=RewardStatus.ERROR):
        super().__init__(f"[{tag}] {message}")
        self.tag, self.retry, self.breaker, self.status = tag, retry, breaker, status


def _num(name: str, value: Any, *, positive: bool = False, integer: bool = False, allow_none: bool = False):
    value = check_number("http", name, value, positive=positive, integer=integer, allow_none=allow_none)
    return None if value is None else (int(value) if integer else float(value))


class _Breaker:
    """Consecutive-failure circuit breaker (closed -> open -> half-open probe -> closed/open).

    ``clock`` (monotonic seconds) is an attribute so that a test can step the reset period
    instead of sleeping through it."""

    def __init__(self, failures: int, reset_s: float, clock=time.monotonic):
        self.threshold, self.reset_s, self.clock = failures, reset_s, clock
        self._lock = threading.Lock()
        self.state = "closed"
        self.consecutive = 0
        self.opened_at = 0.0
        self.opens = 0
        self._probing = False
        self.last_error = ""

    def allow(self) -> tuple[bool, bool]:
        """(may send, is the half-open probe)."""
        with self._lock:
            if self.state == "closed":
                return True, False
            if self.state == "open" and self.clock() - self.opened_at >= self.reset_s:
                self.state = "half_open"
                self._probing = False
            if self.state == "half_open" and not self._probing:
                self._probing = True
                return True, True
            return False, False

    def record(self, ok: bool, probe: bool, error: str = "") -> None:
        with self._lock:
            if probe:
                self._probing = False
            if ok:
                self.consecutive = 0
                if self.state != "closed":
                    log.info("reward http: circuit breaker closed (service answered)")
                self.state = "closed"
                return
            self.consecutive += 1
            self.last_error = error
            if probe or self.state == "half_open" or (self.state == "closed" and self.consecutive >= self.threshold):
                if self.state != "open":
                    self.opens += 1
                    log.warning("reward http: circuit breaker open for %.1fs after %d failed request(s): %s",
                                self.reset_s, self.consecutive, error)
                self.state = "open"
                self.opened_at = self.clock()


class HttpReward:
    """Scores samples by POSTing them in batches to a reward service; see docs/rewards.md.

    ``__call__`` scores one sample (a batch of one); :meth:`score_batch` is what
    :class:`~megarl.rewards.runner.RewardRunner` uses.  :meth:`metrics` returns request counts and
    the breaker state.  Thread-safe.
    """

    name = "http"

    def __init__(
        self,
        url: str,
        auth_env: str | None = None,
        auth_header: str = "Authorization",
        auth_prefix: str = "",
        timeout_s: float = 10.0,
        max_retries: int = 2,
        backoff_s: float = 0.2,
        max_backoff_s: float = 5.0,
        max_concurrency: int = 4,
        batch_size: int = 32,
        breaker_failures: int = 5,
        breaker_reset_s: float = 30.0,
        max_response_bytes: int = 16 << 20,
    ):
        if not isinstance(url, str) or not url:
            raise RewardConfigError(f"http url must be a non-empty string, got {url!r}")
        parts = urlsplit(url)
        if parts.username or parts.password or parts.query:
            raise RewardConfigError("http url must not carry credentials or a query string; "
                                    "name an environment variable in auth_env")
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise RewardConfigError(f"http url must be http(s)://host[:port]/path, got {url!r}")
        if auth_env is not None:
            if not isinstance(auth_env, str) or not auth_env:
                raise RewardConfigError(f"http auth_env must name an environment variable, got {auth_env!r}")
            if not os.environ.get(auth_env):
                raise RewardConfigError(f"http auth_env: environment variable {auth_env!r} is not set (or empty)")
        if not isinstance(auth_header, str) or not auth_header:
            raise RewardConfigError(f"http auth_header must be a header name, got {auth_header!r}")
        try:
            import requests
        except ImportError as e:  # pragma: no cover - a declared dependency
            raise RewardConfigError(f"reward 'http' needs the requests package: pip install requests ({e})") from e
        self._requests = requests
        self.url = url
        self.auth_env, self.auth_header, self.auth_prefix = auth_env, auth_header, str(auth_prefix)
        self.timeout_s = _num("timeout_s", timeout_s, positive=True)
        self.max_retries = _num("max_retries", max_retries, integer=True)
        self.backoff_s = _num("backoff_s", backoff_s)
        self.max_backoff_s = _num("max_backoff_s", max_backoff_s)
        self.max_concurrency = _num("max_concurrency", max_concurrency, positive=True, integer=True)
        self.batch_size = _num("batch_size", batch_size, positive=True, integer=True)
        self.max_response_bytes = _num("max_response_bytes", max_response_bytes, positive=True, integer=True)
        self._breaker = _Breaker(_num("breaker_failures", breaker_failures, positive=True, integer=True),
                                 _num("breaker_reset_s", breaker_reset_s))
        self._sem = threading.BoundedSemaphore(self.max_concurrency)
        self._local = threading.local()
        self._mlock = threading.Lock()
        self._m = {"requests": 0, "request_ok": 0, "request_failures": 0, "retries": 0, "breaker_rejected": 0,
                   "samples": 0, "samples_ok": 0, "samples_failed": 0, "inflight": 0, "inflight_max": 0}
        self.version = f"http/1(url={url},schema={REQUEST_SCHEMA})"

    # --- metrics ---------------------------------------------------------------------------
    def _count(self, key: str, n: int = 1) -> None:
        with self._mlock:
            self._m[key] += n

    def metrics(self) -> dict[str, float]:
        """Counters since construction and the breaker state (0 closed, 1 half-open, 2 open)."""
        with self._mlock:
            out = {k: float(v) for k, v in self._m.items()}
        out["breaker_state"] = float(_BREAKER_STATES[self._breaker.state])
        out["breaker_opens"] = float(self._breaker.opens)
        out["breaker_consecutive_failures"] = float(self._breaker.consecutive)
        return out

    def circuit_open(self) -> bool:
        """True while the breaker is open (failing fast); read by the runner's telemetry."""
        return self._breaker.state == "open"

    # --- secret handling -------------------------------------------------------------------
    def _secret(self) -> str | None:
        return os.environ.get(self.auth_env) if self.auth_env else None

    def _scrub(self, text: str) -> str:
        secret = self._secret()
        text = str(text)
        if secret:
            text = text.replace(secret, "***")
            if self.auth_prefix:
                text = text.replace((self.auth_prefix + secret).strip(), "***")
        return text[:500]

    # --- one request -----------------------------------------------------------------------
    def _session(self):
        s = getattr(self._local, "session", None)
        if s is None:
            s = self._local.session = self._requests.Session()
        return s

    @staticmethod
    def _payload(samples: Sequence[RewardSample]) -> bytes:
        return json.dumps({
            "schema": REQUEST_SCHEMA,
            "samples": [{
                "sample_id": s.sample_id, "prompt_id": s.prompt_id, "group_id": s.group_id,
                "prompt": s.prompt_text, "response": s.response_text,
                "prompt_ids": [int(t) for t in s.prompt_ids], "response_ids": [int(t) for t in s.response_ids],
                "finish_reason": s.finish_reason, "ground_truth": dict(s.ground_truth),
                "messages": None if s.messages is None else [dict(m) for m in s.messages],
            } for s in samples],
        }, default=str).encode()

    def _post(self, body: bytes, n: int) -> list:
        """One attempt; the ``scores`` list (length n) or raises :class:`_Failure`."""
        req = self._requests
        headers = {"Content-Type": "application/json", "Accept": "application/json"}
        if self.auth_env:
            secret = self._secret()
            if not secret:
                raise _Failure("auth", f"environment variable {self.auth_env!r} is not set", retry=False, breaker=False)
            headers[self.auth_header] = self.auth_prefix + secret
        deadline = time.monotonic() + self.timeout_s
        try:
            # no redirects: a redirect would carry the auth header to wherever it points
            resp = self._session().post(self.url, data=body, headers=headers, timeout=self.timeout_s, stream=True,
                                        allow_redirects=False)
            try:
                chunks, size = [], 0
                for chunk in resp.iter_content(65536):
                    chunks.append(chunk)
                    size += len(chunk)
                    if size > self.max_response_bytes:
                        raise _Failure("response_too_large", f"response over {self.max_response_bytes} bytes",
                                       retry=True, breaker=True)
                    if time.monotonic() > deadline:
                        raise _Failure("timeout", f"response body not complete within timeout_s={self.timeout_s}",
                                       retry=True, breaker=True, status=RewardStatus.TIMEOUT)
                raw = b"".join(chunks)
            finally:
                resp.close()
        except _Failure:
            raise
        except req.exceptions.Timeout as e:
            raise _Failure("timeout", f"no response within timeout_s={self.timeout_s} ({type(e).__name__})",
                           retry=True, breaker=True, status=RewardStatus.TIMEOUT) from None
        except (req.exceptions.ConnectionError, req.exceptions.ChunkedEncodingError) as e:
            raise _Failure("connection", f"{type(e).__name__}: {self._scrub(e)}", retry=True, breaker=True) from None
        except req.exceptions.RequestException as e:
            raise _Failure("connection", f"{type(e).__name__}: {self._scrub(e)}", retry=True, breaker=True) from None
        code = resp.status_code
        if code >= 500 or code in (408, 429):
            raise _Failure("http_5xx" if code >= 500 else "http_4xx",
                           f"HTTP {code} from reward service: {self._scrub(raw[:200].decode(errors='replace'))!r}",
                           retry=True, breaker=True)
        if code >= 400:
            raise _Failure("http_4xx",
                           f"HTTP {code} from reward service: {self._scrub(raw[:200].decode(errors='replace'))!r}",
                           retry=False, breaker=False)
        if code != 200:
            raise _Failure("malformed_response", f"HTTP {code} (expected 200; redirects are not followed)",
                           retry=True, breaker=True)
        try:
            doc = json.loads(raw)
        except ValueError as e:
            raise _Failure("malformed_response", f"body is not JSON ({e}): {self._scrub(raw[:120].decode(errors='replace'))!r}",
                           retry=True, breaker=True) from None
        scores = doc.get("scores") if isinstance(doc, dict) else None
        if not isinstance(scores, list):
            raise _Failure("malformed_response", "body has no 'scores' list", retry=True, breaker=True)
        if len(scores) != n:
            raise _Failure("wrong_length", f"{len(scores)} scores for a batch of {n} samples", retry=True, breaker=True)
        return scores

    # --- one sample's result -----------------------------------------------------------------
    def _failure(self, status: RewardStatus, error: str) -> RewardRecord:
        return RewardRecord(total=None, scorer_version=self.version, status=status, error=self._scrub(error))

    def _result(self, item: Any, sample: RewardSample) -> RewardRecord:
        if not isinstance(item, dict):
            return self._failure(RewardStatus.ERROR, f"[bad_result] result is {type(item).__name__}, expected an object")
        if "sample_id" in item and item["sample_id"] != sample.sample_id:
            return self._failure(RewardStatus.ERROR,
                                 f"[wrong_length] result for sample {item['sample_id']!r} in the place of {sample.sample_id!r}")
        status = item.get("status", "ok")
        if status in ("error", "invalid"):
            tag = "service_error" if status == "error" else "service_invalid"
            return self._failure(RewardStatus(status), f"[{tag}] {item.get('error') or 'no reason given'}")
        if status != "ok":
            return self._failure(RewardStatus.ERROR, f"[bad_result] unknown status {status!r}")
        total = item.get("total")
        if isinstance(total, bool) or not isinstance(total, numbers.Real):
            return self._failure(RewardStatus.ERROR, f"[bad_result] total is {total!r}, expected a number")
        if not math.isfinite(total):
            return self._failure(RewardStatus.ERROR, f"[non_finite_score] total is {total!r}")
        comps = item.get("components", {self.name: total})
        if not isinstance(comps, dict):
            return self._failure(RewardStatus.ERROR, "[bad_result] components is not an object")
        out = {}
        for k, v in comps.items():
            if isinstance(v, bool) or not isinstance(v, numbers.Real):
                return self._failure(RewardStatus.ERROR, f"[bad_result] component {k!r} is {v!r}, expected a number")
            if not math.isfinite(v):
                return self._failure(RewardStatus.ERROR, f"[non_finite_score] component {k!r} is {v!r}")
            out[str(k)] = float(v)
        return RewardRecord(total=float(total), components=out, scorer_version=self.version)

    # --- a batch with retries and the breaker ----------------------------------------------------
    def _send(self, samples: Sequence[RewardSample]) -> list[RewardRecord]:
        body = self._payload(samples)
        attempts = 1 + self.max_retries
        last: _Failure | None = None
        for k in range(1, attempts + 1):
            if k > 1:
                self._count("retries")
                delay = min(self.max_backoff_s, self.backoff_s * 2 ** (k - 2) * random.uniform(0.5, 1.5))
                time.sleep(delay)
            may, probe = self._breaker.allow()
            if not may:
                self._count("breaker_rejected")
                why = f"; last failure: {self._breaker.last_error}" if self._breaker.last_error else ""
                err = f"[breaker_open] reward service circuit breaker is open, failing fast{why}"
                if last is not None:
                    err += f" (attempt {k} of {attempts})"
                return [self._failure(RewardStatus.ERROR, err)] * len(samples)
            with self._sem:
                with self._mlock:
                    self._m["requests"] += 1
                    self._m["inflight"] += 1
                    self._m["inflight_max"] = max(self._m["inflight_max"], self._m["inflight"])
                try:
                    scores = self._post(body, len(samples))
                except _Failure as f:
                    last = f
                    self._count("request_failures")
                    msg = self._scrub(str(f))
                    if f.breaker:
                        self._breaker.record(False, probe, msg)
                    elif probe:
                        self._breaker.record(True, probe)  # the service answered: it is up
                    log.warning("reward http: request of %d sample(s) failed (attempt %d of %d): %s",
                                len(samples), k, attempts, msg)
                    if not f.retry:
                        break
                    continue
                finally:
                    self._count("inflight", -1)
            self._count("request_ok")
            self._breaker.record(True, probe)
            return [self._result(item, s) for item, s in zip(scores, samples, strict=True)]
        assert last is not None
        return [self._failure(last.status, f"{last} (attempt {k} of {attempts}, giving up)")] * len(samples)

    def score_batch(self, samples: Sequence[RewardSample]) -> list[RewardRecord]:
        """One record per sample, in order; requests of ``batch_size`` run ``max_concurrency`` at a
        time.  Never raises for a service failure."""
        samples = list(samples)
        chunks = [samples[i:i + self.batch_size] for i in range(0, len(samples), self.batch_size)]
        results = []
        if len(chunks) > 1 and self._breaker.state != "closed":
            # open / half-open: the first request alone is the probe; the rest follow its verdict
            results.append(self._send(chunks.pop(0)))
        if len(chunks) <= 1:
            results += [self._send(c) for c in chunks]
        else:
            with ThreadPoolExecutor(max_workers=min(self.max_concurrency, len(chunks)),
                                    thread_name_prefix="reward-http") as ex:
                results += list(ex.map(self._send, chunks))
        out = [r for chunk in results for r in chunk]
        ok = sum(r.status is RewardStatus.OK for r in out)
        with self._mlock:
            self._m["samples"] += len(out)
            self._m["samples_ok"] += ok
            self._m["samples_failed"] += len(out) - ok
        return out

    def __call__(self, sample: RewardSample) -> RewardRecord:
        return self.score_batch([sample])[0]

    def __repr__(self) -> str:
        return f"HttpReward({self.version}, auth_env={self.auth_env!r})"
