"""Fault injection for drills and tests: every fault is inert unless its ``faults.*`` key is set.

Faults are injected at the real seams -- the rollout engine's results, the reward function's
calls, the actor's optimizer step, the checkpoint writer -- and the trainer then handles them
through the same code paths a real failure takes.  Nothing here fakes a recovery.

Decisions are deterministic: whether fault ``kind`` fires for an event is
``sha256(seed | kind | key) < rate`` over the event's identity (sample id, candidate, attempt),
so a run with faults is reproducible, a retry (a new attempt) gets a fresh draw, and a test can
count exactly what was injected.  ``counts`` holds what this process injected; the trainer sums
them over ranks into the ``faults/injected/*`` metrics, next to what it observed.
"""

from __future__ import annotations

import hashlib
import threading
from collections import Counter
from typing import Any, Sequence

from megarl.errors import MegarlError
from megarl.rollout.protocol import EngineWrapper

__all__ = ["FaultInjector", "InjectedFault", "FaultyActor", "FaultyRolloutEngine"]


class InjectedFault(MegarlError, RuntimeError):
    """An exception raised on purpose by ``faults.*`` (never by a real component)."""


class FaultInjector:
    """Keyed, seeded fault decisions for one run (see the module docstring)."""

    def __init__(self, cfg, seed: int, rank: int = 0, world: int = 1):
        self.cfg, self.seed, self.rank, self.world = cfg, int(seed), rank, world
        self.counts: Counter = Counter()
        self._lock = threading.Lock()
        self._fired: set = set()  # one-shot faults already injected
        #: the iteration the run is in; the driver advances it, the seams key iteration faults on it
        self.iteration: int | None = None

    @property
    def active(self) -> bool:
        c = self.cfg
        return bool(c.rollout_error_rate or c.duplicate_result_rate or c.reward_timeout_rate
                    or c.reward_model_error_at or c.reward_model_timeout_at
                    or c.fail_optimizer_step_at or c.crash_during_checkpoint_at is not None
                    or c.crash_during_update_at is not None or c.corrupt_weight_sync_at)

    def fires(self, kind: str, rate: float, *key: Any) -> bool:
        if rate <= 0.0:
            return False
        h = hashlib.sha256("|".join(map(str, (self.seed, kind) + key)).encode()).digest()
        return int.from_bytes(h[:8], "little") / 2.0**64 < rate

    def count(self, what: str, n: int = 1) -> None:
        with self._lock:
            self.counts[what] += n

    def optimizer_fault(self, iteration: int, step: int, last_step: int) -> str | None:
        """``"exception"`` or ``"nan"`` when an optimizer-step fault fires at this step on this
        rank, else None.

        ``faults.fail_optimizer_step_at`` lists iterations; the fault fires once per listed
        iteration (the retry of that update runs clean), on rank ``faults.fail_optimizer_step_rank``
        (-1: the last rank), at the iteration's last optimizer step -- after the earlier steps
        already changed the weights, so the rollback has a partial update to undo.  The trainer
        applies it: ``exception`` raises after the optimizer applied the step, before the LR
        schedule advanced; ``nan`` makes this rank's loss non-finite, so the gradients (summed
        over DP) and the grad norm are NaN on every rank and the step writes NaN weights.
        """
        c = self.cfg
        if iteration not in (c.fail_optimizer_step_at or ()) or step != last_step:
            return None
        target = self.world - 1 if c.fail_optimizer_step_rank == -1 else c.fail_optimizer_step_rank
        if self.rank != target or (iteration, "optimizer") in self._fired:
            return None
        self._fired.add((iteration, "optimizer"))
        self.count("optimizer_step_failures")
        return c.fail_optimizer_step_kind


class FaultyActor:
    """The real actor role whose optimizer steps fail on purpose, wrapped at its ``train_step``
    seam (the trainer's maths is untouched):

    * ``faults.fail_optimizer_step_at`` (see :meth:`FaultInjector.optimizer_fault`):
      ``exception`` raises once the optimizer applied the step, before the LR schedule
      advances; ``nan`` multiplies this rank's loss by NaN, so the summed gradients, the grad
      norm and the stepped weights are NaN on every rank;
    * ``faults.crash_during_update_at``: the process dies right after the iteration's first
      actor optimizer step, leaving the weights half-updated in memory.

    Steps are counted per iteration (``injector.iteration``); everything else is the actor's.
    """

    def __init__(self, actor, injector: FaultInjector, steps_per_update: int):
        self._actor, self._inj, self._last = actor, injector, steps_per_update - 1
        self._clock = [None, 0]  # iteration, actor steps taken in it

    # what the learner uses of the actor, forwarded by name (a rollback restores ``steps``)
    @property
    def ddp(self):
        return self._actor.ddp

    @property
    def optimizer(self):
        return self._actor.optimizer

    @property
    def scheduler(self):
        return self._actor.scheduler

    @property
    def steps(self) -> int:
        return self._actor.steps

    @steps.setter
    def steps(self, value: int) -> None:
        self._actor.steps = value

    @property
    def lr(self) -> float:
        return self._actor.lr

    @property
    def vocab_size(self) -> int:
        return self._actor.vocab_size

    @property
    def spec(self):
        return self._actor.spec

    def onload(self) -> None:
        self._actor.onload()

    def train_step(self, micro_batches, loss_fn, after_optimizer_step=None, replay_layers=None):
        k = self._inj.iteration
        if self._clock[0] != k:
            self._clock[:] = [k, 0]
        step = self._clock[1]
        self._clock[1] += 1
        fault = self._inj.optimizer_fault(k, step, self._last)
        if fault == "nan":
            real_loss = loss_fn

            def loss_fn(output, mb):
                loss, metrics = real_loss(output, mb)
                return loss * float("nan"), metrics
        if fault == "exception":
            rank = self._inj.rank

            def after_optimizer_step():
                raise InjectedFault(f"faults.fail_optimizer_step_at: injected failure in iteration {k}'s "
                                    f"optimizer step on rank {rank}")
        result = self._actor.train_step(micro_batches, loss_fn, after_optimizer_step=after_optimizer_step,
                                        replay_layers=replay_layers)
        if self._inj.cfg.crash_during_update_at == k and step == 0:
            crash_now("inside the update, after its first optimizer step,", k)
        return result


class FaultyRolloutEngine(EngineWrapper):
    """A real rollout engine whose results are lost, delivered late, or duplicated.

    * ``faults.rollout_error_rate``: a candidate's result is lost (the controller sees it
      missing and must regenerate it by sample id); the lost result itself is delivered late,
      appended to the *next* ``generate`` call's results, where it must be ignored;
    * ``faults.duplicate_result_rate``: a result is delivered twice in the same call.

    Everything else (load, activate, sleep, wake, the generation itself; submit and collect of a
    split placement's engine, whose results are not faulted) is the real engine's
    (:class:`~megarl.rollout.protocol.EngineWrapper`).
    """

    def __init__(self, engine, injector: FaultInjector):
        super().__init__(engine)
        self._engine, self._inj = engine, injector
        self._late: list = []

    def generate(self, requests: Sequence, sampling) -> list:
        late, self._late = self._late, []
        results = self._engine.generate(requests, sampling)
        c, out = self._inj.cfg, []
        for r in results:
            key = (r.request_id, r.candidate_index, r.attempt)
            if self._inj.fires("rollout_error", c.rollout_error_rate, *key):
                self._inj.count("rollout_errors")
                self._late.append(r)
                continue
            out.append(r)
            if self._inj.fires("duplicate_result", c.duplicate_result_rate, *key):
                self._inj.count("duplicate_results")
                out.append(r)
        self._inj.count("late_results", len(late))
        return out + late


def crash_now(what: str, iteration: int) -> None:
    """A hard process death (no cleanup, no atexit), as a kill or a node failure would be."""
    import os
    import sys

    print(f"faults: crashing {what} at iteration {iteration}", file=sys.stderr, flush=True)
    os._exit(17)

