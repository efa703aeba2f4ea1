"""The versioned iteration state machine of one synchronous PPO/GRPO iteration.

    ACTOR_COMMITTED(v) -> EXPORTING(v) -> ROLLOUT_LOADING(v) -> ROLLOUT_READY(v)
      -> GENERATING(v) -> EXPERIENCE_SEALED(v) -> UPDATING_FROM(v) -> ACTOR_COMMITTED(v+1)
    any of them -> FAILED(reason);  FAILED --recover()--> ACTOR_COMMITTED(last committed v)

Read top to bottom: one method per transition, named after the phase it enters, each taking
the evidence of the completion condition of the phase it leaves: every transition has one
(all shards received, checksums equal, stale KV flushed, every sample written to the manifest,
groups complete, or the gradient step succeeded).  Three kinds of outcome:

* wrong phase for the call      -> IllegalTransitionError, state unchanged (a caller bug);
* condition not met / timed out -> state becomes FAILED(reason), CompletionConditionError or
                                   PhaseTimeoutError raised (never onward);
* condition met                 -> next phase.

ACTOR_COMMITTED is the in-memory version that may be published; whether a checkpoint of it is
on disk is a different question, answered by ``megarl.checkpointing.checkpoint`` (the ``latest`` pointer).
"""

from __future__ import annotations

import dataclasses

import enum
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from megarl.versions import PolicyVersion, outside_bound

__all__ = [
    "Phase",
    "IterationState",
    "PhaseDeadlines",
    "IterationStateMachine",
    "StateMachineError",
    "IllegalTransitionError",
    "CompletionConditionError",
    "PhaseTimeoutError",
    "ExportEvidence",
    "RolloutActivation",
    "SealEvidence",
    "UpdateEvidence",
]


class Phase(enum.Enum):
    ACTOR_COMMITTED = "ACTOR_COMMITTED"
    EXPORTING = "EXPORTING"
    ROLLOUT_LOADING = "ROLLOUT_LOADING"
    ROLLOUT_READY = "ROLLOUT_READY"
    GENERATING = "GENERATING"
    EXPERIENCE_SEALED = "EXPERIENCE_SEALED"
    UPDATING_FROM = "UPDATING_FROM"
    FAILED = "FAILED"


class StateMachineError(RuntimeError):
    """Base of the state machine's errors."""


class IllegalTransitionError(StateMachineError):
    """The requested transition does not start from the current phase."""


class CompletionConditionError(StateMachineError):
    """The phase being left has not met its completion condition; the machine is now FAILED."""


class PhaseTimeoutError(StateMachineError):
    """The phase being left ran past its deadline; the machine is now FAILED."""


# ---- evidence: what the caller proves to leave a phase ------------------------------------


@dataclass(frozen=True)
class ExportEvidence:
    """EXPORTING is done when the actor's manifest of the tensors it streams is the manifest of
    the committed version (the stream carries v, not weights changed after the commit)."""

    manifest_hash: str


@dataclass(frozen=True)
class RolloutActivation:
    """Reported by each inference group's engine after activate(): the version it now serves,
    the manifest it verified and whether its KV/prefix caches were flushed."""

    version_id: str
    manifest_hash: str
    manifest_verified: bool
    cache_flushed: bool


@dataclass(frozen=True)
class SealEvidence:
    """GENERATING is done when every sample is written, every group is complete and every sample
    records the version being generated.

    ``max_staleness`` (eta, the producer's declared bound, ``ProducedRollout.max_staleness``):
    0 is the synchronous rule, every id in ``sample_version_ids`` is v's.  With eta > 0 (an
    asynchronous producer) every id must name a step in ``[s - eta, s]``, s = v's optimizer step,
    and an id of step s must be v itself (:func:`megarl.versions.outside_bound`)."""

    samples_expected: int
    samples_written: int
    groups_expected: int
    groups_complete: int
    sample_version_ids: frozenset[str]
    max_staleness: int = 0


@dataclass(frozen=True)
class UpdateEvidence:
    """UPDATING_FROM(v) is done when the optimizer step succeeded on every rank and the new
    in-memory weights are described by the new version's manifest."""

    ranks_succeeded: int
    world_size: int
    manifest_hash: str

    @classmethod
    def from_rank_reports(cls, reports: Sequence[tuple[bool, str]], manifest_hash: str) -> "UpdateEvidence":
        """From every rank's report ``(its update ran to the end, the manifest hash of the weights
        it now holds)``: a rank counts as succeeded only when it completed and holds the weights
        ``manifest_hash`` names (ranks that diverged would otherwise commit different weights
        under one version)."""
        ok = sum(1 for done, h in reports if done and h == manifest_hash)
        return cls(ranks_succeeded=ok, world_size=len(reports), manifest_hash=manifest_hash)


# ---- state ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class IterationState:
    phase: Phase
    version: PolicyVersion | None  # the version the phase is about; None only when FAILED
    reason: str | None = None
    entered_at: float = 0.0

    def __str__(self) -> str:
        if self.phase is Phase.FAILED:
            return f"FAILED({self.reason})"
        return f"{self.phase.value}({self.version.short_id})"


@dataclass(frozen=True)
class PhaseDeadlines:
    """Seconds each phase may last before the next transition out of it is refused (FAILED).
    None = no deadline.  ACTOR_COMMITTED has none: it is a resting state."""

    exporting: float | None = 600.0
    rollout_loading: float | None = 600.0
    rollout_ready: float | None = 600.0
    generating: float | None = 3600.0
    experience_sealed: float | None = 600.0
    updating_from: float | None = 3600.0

    def for_phase(self, phase: Phase) -> float | None:
        return getattr(self, phase.value.lower(), None)

    @classmethod
    def from_config(cls, section) -> "PhaseDeadlines":
        """From ``trainer.phase_timeout_s`` (one field per phase, seconds or None)."""
        return cls(**{f.name: getattr(section, f.name) for f in dataclasses.fields(cls)})


@dataclass
class IterationStateMachine:
    """In-memory iteration state.  Every rank may hold one; the transitions are cheap and
    deterministic given the same evidence, so SPMD ranks stay in lockstep."""

    committed: PolicyVersion
    deadlines: PhaseDeadlines = field(default_factory=PhaseDeadlines)
    clock: Callable[[], float] = time.monotonic
    state: IterationState = field(init=False)
    history: list[IterationState] = field(init=False, default_factory=list)

    def __post_init__(self):
        self.state = IterationState(Phase.ACTOR_COMMITTED, self.committed, entered_at=self.clock())
        self.history.append(self.state)

    # ---- the iteration, in order ----

    def begin_export(self) -> IterationState:
        """ACTOR_COMMITTED(v) -> EXPORTING(v).  Nothing to prove: v is committed."""
        self._require(Phase.ACTOR_COMMITTED)
        return self._enter(Phase.EXPORTING, self.committed)

    def begin_rollout_loading(self, evidence: ExportEvidence) -> IterationState:
        """EXPORTING(v) -> ROLLOUT_LOADING(v) once the exported manifest is v's manifest."""
        v = self._leave(Phase.EXPORTING)
        self._condition(
            evidence.manifest_hash == v.weight_manifest_hash,
            f"export manifest {evidence.manifest_hash} != committed {v.short_id} manifest "
            f"{v.weight_manifest_hash}",
        )
        return self._enter(Phase.ROLLOUT_LOADING, v)

    def mark_rollout_ready(self, activations: Sequence[RolloutActivation], num_groups: int) -> IterationState:
        """ROLLOUT_LOADING(v) -> ROLLOUT_READY(v) once every inference group activated v with a
        verified manifest and flushed caches."""
        v = self._leave(Phase.ROLLOUT_LOADING)
        self._condition(
            len(activations) == num_groups,
            f"{len(activations)} of {num_groups} inference groups reported an activation",
        )
        for i, a in enumerate(activations):
            self._condition(a.manifest_verified, f"inference group {i}: manifest not verified")
            self._condition(
                a.version_id == v.short_id,
                f"inference group {i} serves {a.version_id}, expected {v.short_id}",
            )
            self._condition(
                a.manifest_hash == v.weight_manifest_hash,
                f"inference group {i} manifest {a.manifest_hash} != {v.weight_manifest_hash}",
            )
            self._condition(a.cache_flushed, f"inference group {i}: KV/prefix cache not flushed")
        return self._enter(Phase.ROLLOUT_READY, v)

    def begin_generating(self, engine_version_ids: Sequence[str]) -> IterationState:
        """ROLLOUT_READY(v) -> GENERATING(v) when every engine still serves v."""
        v = self._leave(Phase.ROLLOUT_READY)
        stale = [e for e in engine_version_ids if e != v.short_id]
        self._condition(
            bool(engine_version_ids) and not stale,
            f"engines serve {list(engine_version_ids)}, expected all {v.short_id}",
        )
        return self._enter(Phase.GENERATING, v)

    def seal_experience(self, evidence: SealEvidence) -> IterationState:
        """GENERATING(v) -> EXPERIENCE_SEALED(v) when all samples are written, all groups are
        complete and every sample was generated by v (by a version at most
        ``evidence.max_staleness`` steps older, for an asynchronous producer)."""
        v = self._leave(Phase.GENERATING)
        self._sealed_conditions(v, evidence)
        return self._enter(Phase.EXPERIENCE_SEALED, v)

    def _sealed_conditions(self, v: PolicyVersion, e: SealEvidence) -> None:
        self._condition(
            e.samples_written == e.samples_expected,
            f"{e.samples_written} of {e.samples_expected} samples written",
        )
        self._condition(
            e.groups_complete == e.groups_expected,
            f"{e.groups_complete} of {e.groups_expected} groups complete",
        )
        if e.max_staleness == 0:
            self._condition(
                e.sample_version_ids == frozenset({v.short_id}),
                f"samples carry versions {sorted(e.sample_version_ids)}, expected only {v.short_id}",
            )
            return
        self._condition(e.max_staleness > 0, f"max_staleness must be >= 0, got {e.max_staleness}")
        self._condition(bool(e.sample_version_ids), f"no sample version recorded (trained from {v.short_id})")
        bad = outside_bound(e.sample_version_ids, v.short_id, e.max_staleness)
        self._condition(
            not bad,
            f"samples carry versions {bad} outside the staleness bound: steps "
            f"[{v.optimizer_step - e.max_staleness}, {v.optimizer_step}] (max_staleness={e.max_staleness}), "
            f"step {v.optimizer_step} only as {v.short_id}",
        )

    def begin_update(self) -> IterationState:
        """EXPERIENCE_SEALED(v) -> UPDATING_FROM(v).  Only now may the actor change."""
        v = self._leave(Phase.EXPERIENCE_SEALED)
        return self._enter(Phase.UPDATING_FROM, v)

    def commit(self, new_version: PolicyVersion, evidence: UpdateEvidence) -> IterationState:
        """UPDATING_FROM(v) -> ACTOR_COMMITTED(v+1) when the step succeeded on all ranks and
        ``new_version`` is v's successor with the manifest of the new weights."""
        v = self._leave(Phase.UPDATING_FROM)
        self._condition(
            evidence.ranks_succeeded == evidence.world_size,
            f"optimizer step succeeded on {evidence.ranks_succeeded} of {evidence.world_size} ranks",
        )
        self._condition(
            new_version.is_successor_of(v),
            f"{new_version.short_id} (step {new_version.optimizer_step}, run {new_version.run_id}) "
            f"is not the successor of {v.short_id} (step {v.optimizer_step}, run {v.run_id})",
        )
        self._condition(
            evidence.manifest_hash == new_version.weight_manifest_hash,
            f"new weights manifest {evidence.manifest_hash} != {new_version.short_id} manifest "
            f"{new_version.weight_manifest_hash}",
        )
        self.committed = new_version
        return self._enter(Phase.ACTOR_COMMITTED, new_version)

    # ---- failure and recovery ----

    def fail(self, reason: str) -> IterationState:
        """Any phase -> FAILED(reason).  Explicit entry for errors the caller caught itself."""
        if self.state.phase is Phase.FAILED:
            raise IllegalTransitionError(f"already {self.state}; cannot fail again with {reason!r}")
        return self._enter(Phase.FAILED, None, reason=reason)

    def recover(self, actor_version: PolicyVersion) -> IterationState:
        """FAILED -> ACTOR_COMMITTED(last committed v).

        The caller proves the actor holds v again (after a failure inside UPDATING_FROM it must
        have restored v from a checkpoint first): recovering onto a different version would
        publish weights no committed version describes.
        """
        self._require(Phase.FAILED)
        if actor_version != self.committed:
            raise CompletionConditionError(
                f"recover: actor holds {actor_version.short_id}, last committed is "
                f"{self.committed.short_id}; restore it before recovering"
            )
        return self._enter(Phase.ACTOR_COMMITTED, self.committed)

    def retry_update(self, actor_version: PolicyVersion) -> IterationState:
        """FAILED -> EXPERIENCE_SEALED(v), for a failure inside UPDATING_FROM(v) only.

        The sealed batch of v is still valid (it is about v, and the actor holds v again: the
        caller proves it by the restored weights' version), so the update may run again on it;
        a failure anywhere else has no sealed batch to return to."""
        self._require(Phase.FAILED)
        before = self.history[-2] if len(self.history) >= 2 else None
        if before is None or before.phase is not Phase.UPDATING_FROM:
            raise IllegalTransitionError(
                f"retry_update: the failure came from {before}, not from {Phase.UPDATING_FROM.value}")
        if actor_version != self.committed:
            raise CompletionConditionError(
                f"retry_update: actor holds {actor_version.short_id}, last committed is "
                f"{self.committed.short_id}; restore it first")
        return self._enter(Phase.EXPERIENCE_SEALED, self.committed)

    def adopt_sealed(self, evidence: SealEvidence) -> IterationState:
        """ACTOR_COMMITTED(v) -> EXPERIENCE_SEALED(v) for a batch sealed before a restart
        (``trainer.resume_experience=reuse``): the same completeness conditions as
        :meth:`seal_experience`, and every sample must be v's (or, with ``max_staleness`` > 0,
        within that many steps of v)."""
        v = self._leave(Phase.ACTOR_COMMITTED)
        self._sealed_conditions(v, evidence)
        return self._enter(Phase.EXPERIENCE_SEALED, v)

    def check_deadline(self, agree: Callable[[bool], bool] | None = None) -> None:
        """Move to FAILED (PhaseTimeoutError) if the current phase is past its deadline.

        ``agree`` makes the check collective: given this rank's "in time", it returns whether
        every rank is in time (e.g. an all-reduce), so that all ranks fail together when any
        one is late and none is left waiting in the next collective."""
        if agree is None:
            self._check_deadline()
            return
        late = self.overdue()
        if agree(late is None):
            return
        self._enter(Phase.FAILED, None, reason=late or f"timeout in {self.state}: another rank is past the deadline")
        raise PhaseTimeoutError(self.state.reason)

    def overdue(self) -> str | None:
        """Why the current phase is past its deadline, or None while it is in time."""
        limit = self.deadlines.for_phase(self.state.phase)
        if limit is None or self.state.phase is Phase.FAILED:
            return None
        elapsed = self.clock() - self.state.entered_at
        return f"timeout in {self.state} after {elapsed:.3f}s > {limit}s" if elapsed > limit else None

    # ---- machinery ----

    def _require(self, phase: Phase) -> None:
        if self.state.phase is not phase:
            raise IllegalTransitionError(
                f"transition requires {phase.value}, current state is {self.state}"
            )

    def _leave(self, phase: Phase) -> PolicyVersion:
        self._require(phase)
        self._check_deadline()
        return self.state.version

    def _check_deadline(self) -> None:
        late = self.overdue()
        if late is not None:
            self._enter(Phase.FAILED, None, reason=late)
            raise PhaseTimeoutError(self.state.reason)

    def _condition(self, ok: bool, message: str) -> None:
        if not ok:
            where = str(self.state)
            self._enter(Phase.FAILED, None, reason=f"{where}: {message}")
            raise CompletionConditionError(self.state.reason)

    def _enter(self, phase: Phase, version: PolicyVersion | None, reason: str | None = None) -> IterationState:
        self.state = IterationState(phase, version, reason, entered_at=self.clock())
        self.history.append(self.state)
        return self.state

