"""Fault injection into the actor's optimizer steps (``faults.fail_optimizer_step_at``,
``faults.crash_during_update_at``), for the rollback drills and tests of the update path; the
injector is :class:`megarl.runtime.faults.FaultInjector`."""

from __future__ import annotations

from megarl.runtime.faults import FaultInjector, InjectedFault, crash_now

__all__ = ["FaultyActor"]


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
