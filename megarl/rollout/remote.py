"""The rollout engines of split placement: a service on each rollout rank, and the trainer's
handle on them behind the one engine protocol.

:class:`RolloutService` runs on a rollout rank (``placement.mode=split``): it owns a real engine
(hf or sglang) and executes the trainer's commands strictly in the order they were sent --
``load`` (weight buckets over the bridge group, staged and checked against the manifest by the
engine itself), ``activate``, ``generate``, ``stop``.  Because the order is kept, a request sent
after version v was activated is generated on v (or on a version activated after it), never on
an older one; that is what lets the trainer bound the staleness of what it submits ahead.  One
command may overtake them, on a channel of its own: ``teacher_force`` (the proximal policy's
log-probs of a batch, ``async_rl.proximal_log_probs=engine``), taken before the next ordered
command and between generation segments, and run on the version it names, which must be the
one served.

:class:`RemoteEngine` (trainer rank 0) meets :class:`~megarl.rollout.protocol.RolloutEngine`, so
publication, production and evaluation drive the rollout ranks exactly as they drive a local
engine (:meth:`RemoteEngine.load_weights` included), and adds ``submit`` / ``collect``: requests
that generate while the trainer trains.  Every wait is bounded: by the other side's heartbeat (a lost process is a
:class:`~megarl.runtime.split.PeerLostError`, never a hang) and, for the bridge collectives, by
``placement.timeout_s``.

What has run (CPU, gloo: hf and SGLang's CPU engine) and what has not (the NCCL bridge, SGLang
on a GPU): docs/async.md.
"""

from __future__ import annotations

import datetime
import os
import signal
import time
from collections import defaultdict
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch

from megarl.observability.profiling import span
from megarl.rollout.protocol import (
    ActivationReport,
    GenerationRequest,
    GenerationResult,
    LoadReport,
    RolloutError,
    SamplingParams,
)
from megarl.rollout.segmented import generate_in_segments
from megarl.rollout.weight_stream import ManifestMismatchError, TensorManifest
from megarl.runtime.split import PeerLostError, SplitWorld, wait_either
from megarl.versions import PolicyVersion

__all__ = ["RemoteEngine", "RolloutService", "Ticket"]

#: the replies that answer a job (kept by job number until :meth:`RemoteEngine.collect` takes them)
_JOB_REPLIES = ("results", "gen_failed", "teacher_forced", "teacher_force_failed")

Bucket = Sequence[Tuple[str, torch.Tensor]]


def _dtype(name: str) -> torch.dtype:
    return getattr(torch, name.removeprefix("torch."))


def _by_dtype(meta: Sequence[tuple]) -> Dict[str, List[int]]:
    """Positions of a bucket's tensors per dtype, in bucket order (one flat tensor each)."""
    groups: Dict[str, List[int]] = {}
    for i, (_, _, dt) in enumerate(meta):
        groups.setdefault(dt, []).append(i)
    return groups


def _broadcast(world: SplitWorld, t: torch.Tensor, what: str) -> None:
    try:
        world.bridge.broadcast(t, 0, datetime.timedelta(seconds=world.timeout_s)).wait()
    except RuntimeError as e:  # a closed connection or the timeout: the other side is gone
        failed = f"{what}: the bridge broadcast failed ({str(e).splitlines()[0][:300]})"
        # name the process that is gone by its heartbeat, as every other wait does
        lost = world.name_the_lost_peer(world.timeout_s + 2.0)
        if lost is not None:
            raise PeerLostError(f"{lost}; {failed}") from None
        raise PeerLostError(f"{failed}, while every peer still beats; placement.timeout_s={world.timeout_s:g}") from None


class Ticket:
    """Requests submitted ahead: their job number and the rollout ranks that got a share."""

    def __init__(self, job: int, ranks: Tuple[int, ...]):
        self.job, self.ranks = job, ranks


class RemoteEngine:
    """The trainer's handle on the rollout ranks (see the module docstring).  Built on trainer
    rank 0 only; ``hello`` tells each service which model directory and token ids to build its
    engine with."""

    def __init__(self, world: SplitWorld, hello: dict, device: torch.device):
        self.world = world
        self.n = world.rollout_ranks
        self.to = [world.to_rollout(i) for i in range(self.n)]
        self.urgent = [world.to_rollout(i, "urgent") for i in range(self.n)]
        self.back = [world.from_rollout(i) for i in range(self.n)]
        self.device = device
        self._active: Optional[PolicyVersion] = None
        self._job = 0
        self.lost: Optional[str] = None  # why a rollout rank was named lost (then close() waits for none)
        self._done: Dict[int, Dict[int, tuple]] = defaultdict(dict)  # job -> rollout rank -> reply
        self._totals: Dict[int, Dict[str, float]] = {}  # rollout rank -> its cumulative seconds, as last reported
        for box in self.to:
            box.send(("hello", hello))
        ready = [self._expect(i, "ready", "the engine's start-up") for i in range(self.n)]
        self.dtype = _dtype(ready[0][1]["dtype"])
        self.log_prob_spaces = ready[0][1].get("log_prob_spaces")

    # ---- the reply stream ---------------------------------------------------------------------

    def _recv(self, i: int, what: str) -> tuple:
        try:
            return self.back[i].recv(what=what)
        except PeerLostError as e:
            self.lost = str(e)
            raise

    def _expect(self, i: int, kind, what: str) -> tuple:
        """The next reply of rollout rank ``i`` of ``kind`` (generate replies met on the way are
        kept for :meth:`collect`)."""
        kinds = (kind,) if isinstance(kind, str) else tuple(kind)
        while True:
            msg = self._recv(i, f"{what} from rollout rank {i}")
            if msg[0] in _JOB_REPLIES:
                self._done[msg[1]][i] = msg
                continue
            if msg[0] in kinds:
                return msg
            raise RolloutError(f"rollout rank {i} answered {msg[0]!r} while {what} was expected")

    # ---- the engine protocol ------------------------------------------------------------------

    @property
    def active_version(self) -> Optional[PolicyVersion]:
        return self._active

    def staging_target(self, name: str):
        return None  # the staging tensors are in another process

    def load_weights(self, version: PolicyVersion, named_tensor_buckets, expected_manifest: TensorManifest) -> LoadReport:
        """Ship ``version``'s buckets to every rollout rank (a broadcast over the bridge group,
        flattened per dtype); return only when each engine staged and verified what landed.  A
        refusal raises the engine's ManifestMismatchError, so the publisher's retry path is the
        one it takes for a local engine."""
        t0 = time.perf_counter()
        for box in self.to:
            box.send(("load", version, expected_manifest.to_dict()))
        for i in range(self.n):  # each service reaches the load after the commands sent before it
            self._expect(i, "receiving", f"the start of loading {version.short_id}")
        try:
            self._stream(version, named_tensor_buckets)
        except PeerLostError as e:
            self.lost = str(e)
            raise
        except BaseException:  # the trainer's own stream failed: end the load so the services stay in step
            for box in self.to:
                box.send(("end",))
            for i in range(self.n):
                self._expect(i, ("loaded", "load_failed"), f"the end of the abandoned load of {version.short_id}")
            raise
        for box in self.to:
            box.send(("end",))
        replies = [self._expect(i, ("loaded", "load_failed"), f"the check of {version.short_id}") for i in range(self.n)]
        failed = [f"rollout rank {i}: {r[1]}" for i, r in enumerate(replies) if r[0] == "load_failed"]
        if failed:
            mismatch = all(r[2] == "mismatch" for r in replies if r[0] == "load_failed")
            raise (ManifestMismatchError if mismatch else RolloutError)("; ".join(failed))
        rep = replies[0][1]
        return LoadReport(version_id=rep.version_id, manifest_hash=rep.manifest_hash, num_tensors=rep.num_tensors,
                          num_bytes=rep.num_bytes, num_buckets=rep.num_buckets, seconds=time.perf_counter() - t0)

    def _stream(self, version: PolicyVersion, named_tensor_buckets) -> None:
        for bucket in named_tensor_buckets:
            meta = [(name, tuple(t.shape), str(t.dtype)) for name, t in bucket]
            flats = [torch.cat([bucket[j][1].reshape(-1) for j in idx]).to(self.device)
                     for idx in _by_dtype(meta).values()]  # built before the meta is sent: a failure leaves no half bucket
            for box in self.to:
                box.send(("bucket", meta))
            with span("weight_sync.bridge", bytes=sum(f.numel() * f.element_size() for f in flats)):
                for flat in flats:
                    _broadcast(self.world, flat, f"sending {version.short_id}")

    def activate(self, version: PolicyVersion) -> ActivationReport:
        """Every rollout engine activates ``version``; every command sent from now on runs on it."""
        for box in self.to:
            box.send(("activate", version))
        replies = [self._expect(i, ("activated", "activate_failed"), f"the activation of {version.short_id}")
                   for i in range(self.n)]
        failed = [f"rollout rank {i}: {r[1]}" for i, r in enumerate(replies) if r[0] == "activate_failed"]
        if failed:
            raise RolloutError("; ".join(failed))
        reports = [r[1] for r in replies]
        self._active = version
        return ActivationReport(version_id=version.short_id, manifest_hash=reports[0].manifest_hash,
                                manifest_verified=all(r.manifest_verified and r.manifest_hash == reports[0].manifest_hash
                                                      for r in reports),
                                cache_flushed=all(r.cache_flushed for r in reports))

    def submit(self, requests: Sequence[GenerationRequest], sampling: SamplingParams, segmented: bool = True) -> Ticket:
        """Send ``requests`` (contiguous, near-equal shares over the rollout ranks) and return at
        once; :meth:`collect` waits for their results.  ``segmented``: the rollout ranks may
        apply a version published while they generate these (in segments, when configured);
        :meth:`generate` (evaluation, regeneration, the synchronous loop) asks for whole
        responses on the version active when they start."""
        self._job += 1
        ranks = []
        base, extra = divmod(len(requests), self.n)
        start = 0
        for i in range(self.n):
            k = base + (1 if i < extra else 0)
            if k:
                self.to[i].send(("generate", self._job, list(requests[start:start + k]), sampling, segmented))
                ranks.append(i)
            start += k
        return Ticket(self._job, tuple(ranks))

    def submit_teacher_force(self, prompts: Sequence[Sequence[int]], responses: Sequence[Sequence[int]],
                             version: str) -> Ticket:
        """Send a teacher-forcing job (rows split over the rollout ranks like :meth:`submit`) on the
        channel that overtakes queued generation; :meth:`collect` returns one float32 tensor of
        raw log-probs per row.  ``version``: the one that must score (the rank refuses the job
        when it serves another)."""
        self._job += 1
        ranks, start = [], 0
        base, extra = divmod(len(prompts), self.n)
        for i in range(self.n):
            k = base + (1 if i < extra else 0)
            if k:
                self.urgent[i].send(("teacher_force", self._job, [list(p) for p in prompts[start:start + k]],
                                     [list(r) for r in responses[start:start + k]], version))
                ranks.append(i)
            start += k
        return Ticket(self._job, tuple(ranks))

    def ready(self, ticket: Ticket) -> bool:
        """Whether every share of ``ticket`` has answered (reads what has arrived, waits for nothing)."""
        for i in ticket.ranks:
            while i not in self._done.get(ticket.job, {}) and self.back[i].ready():
                msg = self.back[i].recv()
                if msg[0] not in _JOB_REPLIES:
                    raise RolloutError(f"rollout rank {i} answered {msg[0]!r} with no command waiting for it")
                self._done[msg[1]][i] = msg
        return all(i in self._done.get(ticket.job, {}) for i in ticket.ranks)

    def collect(self, ticket: Ticket) -> List[GenerationResult]:
        """The results of ``ticket``, in request order (waits while the rollout ranks are alive).
        A share whose engine failed raises :class:`RolloutError` after every share answered."""
        for i in ticket.ranks:
            while i not in self._done.get(ticket.job, {}):
                msg = self._recv(i, f"the results of job {ticket.job} from rollout rank {i}")
                if msg[0] not in _JOB_REPLIES:
                    raise RolloutError(f"rollout rank {i} answered {msg[0]!r} with no command waiting for it")
                self._done[msg[1]][i] = msg
        replies = self._done.pop(ticket.job, {})
        out, failed = [], []
        for i in ticket.ranks:
            msg = replies[i]
            if msg[0] in ("gen_failed", "teacher_force_failed"):
                failed.append(f"rollout rank {i}: {msg[2]}")
                continue
            out.extend(msg[2])
            if msg[3]["jobs"] >= self._totals.get(i, {}).get("jobs", -1):  # collected out of order: keep the latest
                self._totals[i] = msg[3]
        if failed:
            raise RolloutError("; ".join(failed))
        return out

    @property
    def stats(self) -> Dict[str, float]:
        """The rollout ranks' cumulative seconds spent generating (``generate_s``), waiting for a
        command (``idle_s``) and loading weights (``load_s``), summed over ranks, as of their last
        results."""
        out: Dict[str, float] = defaultdict(float)
        for totals in self._totals.values():
            for key, value in totals.items():
                out[key] += value
        return dict(out)

    def generate(self, requests: Sequence[GenerationRequest], sampling: SamplingParams) -> List[GenerationResult]:
        return self.collect(self.submit(requests, sampling, segmented=False))

    def flush_cache(self) -> None:
        """Each engine flushes at its own activation (it holds the only KV state)."""

    def sleep(self) -> None:
        """Split placement gives the engines devices of their own: nothing to release."""

    def wake(self) -> None:
        pass

    def close(self) -> None:
        """Stop every service (after the commands already sent) and wait for each to say so --
        unless one was named lost already (the job is ending on that error; nothing to wait for)."""
        for box in self.to:
            box.send(("stop",))
        if self.lost is not None:
            return
        for i in range(self.n):
            try:
                self._expect(i, "stopped", "the end of the service")
            except PeerLostError:
                pass  # it is gone already: nothing left to stop


class RolloutService:
    """The loop of a rollout rank (see the module docstring).  ``make_engine(config_dir, eos,
    pad)`` builds the engine named by the trainer's hello; ``make_generator(engine)``, when given,
    what answers generate commands over it (agent sessions); ``kill_at_load`` (a fault drill:
    ``faults.kill_rollout_at_load``) kills this process with SIGKILL while it receives the
    weights of that optimizer step."""

    #: after an in-flight load, wait for its activation before the next segment or turn.  False
    #: only in the negative control of tests/unit/control/test_split_channel.py, whose next turn then runs on
    #: the old version (and on no version at all with an engine that loads in place)
    waits_for_activation = True

    def __init__(self, world: SplitWorld, make_engine: Callable, device: torch.device,
                 kill_at_load: Optional[int] = None, segment_tokens: int = 0, segment_delay_s: float = 0.0,
                 segment_await_s: float = 0.0,
                 make_generator: Optional[Callable] = None):
        self.world, self.make_engine, self.device, self.kill_at_load = world, make_engine, device, kill_at_load
        self.make_generator = make_generator  # the engine -> what answers generate commands (agent sessions)
        self.segment_tokens, self.segment_delay_s = segment_tokens, segment_delay_s
        self.segment_await_s, self._await_next = segment_await_s, False
        self.inbox, self.outbox = world.from_trainer(), world.to_trainer()
        self.urgent = world.from_trainer("urgent")
        self.engine = None
        self.totals = {"generate_s": 0.0, "idle_s": 0.0, "load_s": 0.0, "jobs": 0.0, "inflight_activations": 0.0,
                       "teacher_force_s": 0.0}

    def serve(self) -> Dict[str, float]:
        hello = self.inbox.recv(what="the trainer's hello")[1]
        self.engine = self.make_engine(hello["config_dir"], hello["eos_token_ids"], hello["pad_token_id"])
        generator = self.make_generator(self.engine) if self.make_generator is not None else self.engine
        self.outbox.send(("ready", {"dtype": str(self.engine.dtype).removeprefix("torch."),
                                    "log_prob_spaces": self.engine.log_prob_spaces}))
        totals = self.totals
        idle_from = time.perf_counter()
        while True:
            msg = wait_either(self.urgent, self.inbox, "the trainer's next command").recv()
            now = time.perf_counter()
            totals["idle_s"] += now - idle_from
            kind = msg[0]
            if kind == "teacher_force":
                self._teacher_force(msg)
                idle_from = time.perf_counter()
                continue
            if kind == "stop":
                self.outbox.send(("stopped", totals))
                return totals
            if kind in ("load", "activate"):
                self._version_command(msg)
            elif kind == "generate":
                _, job, requests, sampling, segmented = msg
                inflight = segmented and self.segment_tokens > 0
                self._await_next = inflight and self.segment_await_s > 0
                try:
                    if self.make_generator is not None:  # agent sessions: versions change between turns
                        results = generator.generate(requests, sampling,
                                                     between_turns=self._between_segments if inflight else None)
                    else:
                        results = generate_in_segments(generator, requests, sampling,
                                                       self.segment_tokens if inflight else 0,
                                                       between=self._between_segments)
                except RolloutError as e:
                    self.outbox.send(("gen_failed", job, f"{type(e).__name__}: {e}"))
                else:
                    totals["generate_s"] += time.perf_counter() - now
                    totals["jobs"] += 1
                    self.outbox.send(("results", job, results, dict(totals)))
            else:
                raise RolloutError(f"rollout rank {self.world.rollout_index}: unknown command {kind!r}")
            idle_from = time.perf_counter()

    def _version_command(self, msg: tuple) -> bool:
        """Execute a load or an activation; True when it succeeded."""
        t0 = time.perf_counter()
        ok = True
        if msg[0] == "load":
            ok = self._load(msg[1], TensorManifest.from_dict(msg[2]))
        else:
            try:
                self.outbox.send(("activated", self.engine.activate(msg[1])))
            except RolloutError as e:
                ok = False
                self.outbox.send(("activate_failed", f"{type(e).__name__}: {e}"))
        self.totals["load_s"] += time.perf_counter() - t0
        return ok

    def _between_segments(self) -> None:
        """An in-flight weight update: a load or activation the trainer sent while this rank
        generates is applied now, if it is the next command (a generate command sent before it
        keeps its place, so every batch starts on the version it was submitted after).  The
        engine is idle between segments, so its flush at activation always succeeds."""
        if self.segment_delay_s:
            time.sleep(self.segment_delay_s)  # faults.rollout_segment_delay_s: a straggler
        if self._await_next:  # faults.rollout_segment_await_s: once per job
            self._await_next = False
            self._await_trainer()
        while self.urgent.ready():  # a teacher-forcing job overtakes the rest of this batch
            self._teacher_force(self.urgent.recv())
        loaded = False
        while True:
            if self.inbox.ready():
                kind = self.inbox.peek()[0]
            elif loaded and self.waits_for_activation:
                # the trainer sends the activation as soon as the load is reported: wait for it.
                # An engine that loads in place (SGLang: the new weights overwrite the served
                # ones) serves no version in between, and an agent session takes a version only
                # between turns, so the turn about to start must not run on the old one
                kind = self.inbox.peek(what="the activation of the version just loaded")[0]
            else:
                return
            if kind not in ("load", "activate"):
                return
            msg = self.inbox.recv()
            ok = self._version_command(msg)
            loaded = msg[0] == "load" and ok
            if msg[0] == "activate":
                self.totals["inflight_activations"] += 1

    def _await_trainer(self) -> None:
        """Wait, at most ``segment_await_s``, for the trainer's next command (taken by the
        caller); teacher-forcing jobs that arrive meanwhile are served."""
        deadline = time.monotonic() + self.segment_await_s
        while not self.inbox.ready() and time.monotonic() < deadline:
            if self.urgent.ready():
                self._teacher_force(self.urgent.recv())
            else:
                time.sleep(0.005)

    def _teacher_force(self, msg: tuple) -> None:
        """Score a batch's tokens under the version the trainer names, which must be the one
        served: the trainer sends the job only after that version's activation was reported."""
        _, job, prompts, responses, version = msg
        t0 = time.perf_counter()
        try:
            active = self.engine.active_version
            if active is None or active.short_id != version:
                raise RolloutError(f"rollout rank {self.world.rollout_index}: asked to teacher-force on {version}, but "
                                   f"it serves {active.short_id if active is not None else 'no version'}")
            if not hasattr(self.engine, "teacher_force"):
                raise RolloutError(f"rollout rank {self.world.rollout_index}: the {type(self.engine).__name__} engine "
                                   "cannot teacher-force (async_rl.proximal_log_probs=engine needs rollout.backend=hf)")
            scored, values = self.engine.teacher_force(prompts, responses)
            if scored.short_id != version:  # activations happen on this thread: a changed version is a bug
                raise RolloutError(f"rollout rank {self.world.rollout_index}: teacher-forced on {scored.short_id}, "
                                   f"not {version}")
        except RolloutError as e:
            self.outbox.send(("teacher_force_failed", job, f"{type(e).__name__}: {e}"))
        else:
            self.totals["teacher_force_s"] += time.perf_counter() - t0
            self.outbox.send(("teacher_forced", job, values, dict(self.totals)))

    def _buckets(self, version: PolicyVersion):
        """The buckets the trainer streams, as they arrive (every one is received, even after the
        engine refused an earlier one: the broadcast must stay in step)."""
        n = 0
        while True:
            msg = self.inbox.recv(what=f"the next bucket of {version.short_id}")
            if msg[0] == "end":
                return
            meta = msg[1]
            tensors: Dict[int, torch.Tensor] = {}
            for dt, idx in _by_dtype(meta).items():
                sizes = [int(torch.Size(meta[j][1]).numel()) for j in idx]
                flat = torch.empty(sum(sizes), dtype=_dtype(dt), device=self.device)
                _broadcast(self.world, flat, f"receiving {version.short_id}")
                for j, part in zip(idx, torch.split(flat, sizes), strict=True):
                    tensors[j] = part.view(meta[j][1])
            n += 1
            if self.kill_at_load is not None and version.optimizer_step == self.kill_at_load:
                # the drill: die mid-load, with no clean-up (the wall-clock time, for the test that
                # measures how long the trainer takes to name this rank lost)
                print(f"faults: killing rollout rank {self.world.rollout_index} while it receives "
                      f"{version.short_id} (at wall time {time.time():.3f})", flush=True)
                os.kill(os.getpid(), signal.SIGKILL)
            yield [(meta[j][0], tensors[j]) for j in range(len(meta))]

    def _load(self, version: PolicyVersion, manifest: TensorManifest) -> bool:
        self.outbox.send(("receiving", version.short_id))
        stream = self._buckets(version)
        try:
            report = self.engine.load_weights(version, stream, manifest)
        except ManifestMismatchError as e:
            for _ in stream:
                pass
            self.outbox.send(("load_failed", f"{type(e).__name__}: {e}", "mismatch"))
        except RolloutError as e:
            for _ in stream:
                pass
            self.outbox.send(("load_failed", f"{type(e).__name__}: {e}", "engine"))
        else:
            for _ in stream:  # an engine that stopped reading early still leaves the stream in step
                pass
            self.outbox.send(("loaded", report))
            return True
        return False
