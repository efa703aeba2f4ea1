"""The iteration state machine: every legal transition, every illegal one, conditions, timeouts."""

import pytest

from megarl.control.state_machine import (
    CompletionConditionError,
    ExportEvidence,
    IllegalTransitionError,
    IterationStateMachine,
    Phase,
    PhaseDeadlines,
    PhaseTimeoutError,
    RolloutActivation,
    SealEvidence,
    UpdateEvidence,
)
from megarl.hashing import json_sha256
from megarl.versions import PolicyVersion

H = lambda s: json_sha256({"x": s})  # noqa: E731


def version(step, weights="w0"):
    return PolicyVersion("run-a", step, 0, H(weights), H("tok"), H("cfg"))


class FakeClock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def activation(v, **over):
    kw = dict(version_id=v.short_id, manifest_hash=v.weight_manifest_hash, manifest_verified=True, cache_flushed=True)
    kw.update(over)
    return RolloutActivation(**kw)


def seal(v, **over):
    kw = dict(samples_expected=8, samples_written=8, groups_expected=2, groups_complete=2,
              sample_version_ids=frozenset({v.short_id}))
    kw.update(over)
    return SealEvidence(**kw)


# one call per transition, keyed by the phase it leaves
def step_calls(v, v_next):
    return {
        Phase.ACTOR_COMMITTED: ("begin_export", lambda sm: sm.begin_export()),
        Phase.EXPORTING: ("begin_rollout_loading", lambda sm: sm.begin_rollout_loading(ExportEvidence(v.weight_manifest_hash))),
        Phase.ROLLOUT_LOADING: ("mark_rollout_ready", lambda sm: sm.mark_rollout_ready([activation(v), activation(v)], 2)),
        Phase.ROLLOUT_READY: ("begin_generating", lambda sm: sm.begin_generating([v.short_id, v.short_id])),
        Phase.GENERATING: ("seal_experience", lambda sm: sm.seal_experience(seal(v))),
        Phase.EXPERIENCE_SEALED: ("begin_update", lambda sm: sm.begin_update()),
        Phase.UPDATING_FROM: ("commit", lambda sm: sm.commit(v_next, UpdateEvidence(4, 4, v_next.weight_manifest_hash))),
        Phase.FAILED: ("recover", lambda sm: sm.recover(v)),
    }


ORDER = [Phase.ACTOR_COMMITTED, Phase.EXPORTING, Phase.ROLLOUT_LOADING, Phase.ROLLOUT_READY,
         Phase.GENERATING, Phase.EXPERIENCE_SEALED, Phase.UPDATING_FROM]


def drive_to(sm, phase, v, v_next):
    calls = step_calls(v, v_next)
    while sm.state.phase is not phase:
        calls[sm.state.phase][1](sm)


def test_full_iterations_follow_the_seed_order():
    v0, v1 = version(0), version(1, "w1")
    v2 = version(2, "w2")
    sm = IterationStateMachine(v0)
    for v, nxt in ((v0, v1), (v1, v2)):
        calls = step_calls(v, nxt)
        for phase in ORDER:
            assert sm.state.phase is phase and sm.state.version == v
            calls[phase][1](sm)
        assert sm.state.phase is Phase.ACTOR_COMMITTED and sm.state.version == nxt
    assert sm.committed == v2
    assert [s.phase for s in sm.history] == [Phase.ACTOR_COMMITTED] + (ORDER[1:] + [Phase.ACTOR_COMMITTED]) * 2
    assert str(sm.history[1]) == f"EXPORTING({v0.short_id})"


@pytest.mark.parametrize("phase", ORDER + [Phase.FAILED])
def test_every_other_transition_is_illegal_and_leaves_the_state_alone(phase):
    v0, v1 = version(0), version(1, "w1")
    sm = IterationStateMachine(v0)
    if phase is Phase.FAILED:
        sm.fail("injected")
    else:
        drive_to(sm, phase, v0, v1)
    before = sm.state
    calls = step_calls(v0, v1)
    for leaving, (name, call) in calls.items():
        if leaving is phase:
            continue
        with pytest.raises(IllegalTransitionError, match=phase.value):
            call(sm)
        assert sm.state is before, name
    if phase is Phase.FAILED:
        with pytest.raises(IllegalTransitionError, match="already FAILED"):
            sm.fail("again")
    else:
        sm.fail("injected")  # fail() is legal from every non-failed phase
        assert sm.state.phase is Phase.FAILED and sm.state.reason == "injected"
        sm.recover(v0)
        assert sm.state.phase is Phase.ACTOR_COMMITTED and sm.state.version == v0


@pytest.mark.parametrize(
    "phase, call, message",
    [
        (Phase.EXPORTING, lambda sm, v, n: sm.begin_rollout_loading(ExportEvidence(H("other"))), "export manifest"),
        (Phase.ROLLOUT_LOADING, lambda sm, v, n: sm.mark_rollout_ready([activation(v)], 2), "1 of 2 inference groups"),
        (Phase.ROLLOUT_LOADING, lambda sm, v, n: sm.mark_rollout_ready([activation(v, manifest_verified=False)], 1), "manifest not verified"),
        (Phase.ROLLOUT_LOADING, lambda sm, v, n: sm.mark_rollout_ready([activation(v, cache_flushed=False)], 1), "cache not flushed"),
        (Phase.ROLLOUT_LOADING, lambda sm, v, n: sm.mark_rollout_ready([activation(v, version_id="v9.0-deadbeef")], 1), "serves v9.0-deadbeef"),
        (Phase.ROLLOUT_LOADING, lambda sm, v, n: sm.mark_rollout_ready([activation(v, manifest_hash=H("x"))], 1), "manifest sha256"),
        (Phase.ROLLOUT_READY, lambda sm, v, n: sm.begin_generating([v.short_id, "v-1.0-stale"]), "engines serve"),
        (Phase.ROLLOUT_READY, lambda sm, v, n: sm.begin_generating([]), "engines serve"),
        (Phase.GENERATING, lambda sm, v, n: sm.seal_experience(seal(v, samples_written=7)), "7 of 8 samples"),
        (Phase.GENERATING, lambda sm, v, n: sm.seal_experience(seal(v, groups_complete=1)), "1 of 2 groups"),
        (Phase.GENERATING, lambda sm, v, n: sm.seal_experience(seal(v, sample_version_ids=frozenset({v.short_id, "vX"}))), "samples carry versions"),
        (Phase.UPDATING_FROM, lambda sm, v, n: sm.commit(n, UpdateEvidence(3, 4, n.weight_manifest_hash)), "3 of 4 ranks"),
        (Phase.UPDATING_FROM, lambda sm, v, n: sm.commit(version(5, "w5"), UpdateEvidence(4, 4, H("w5"))), "not the successor"),
        (Phase.UPDATING_FROM, lambda sm, v, n: sm.commit(n, UpdateEvidence(4, 4, H("other"))), "new weights manifest"),
    ],
)
def test_unmet_completion_condition_fails_never_onward(phase, call, message):
    v0, v1 = version(0), version(1, "w1")
    sm = IterationStateMachine(v0)
    drive_to(sm, phase, v0, v1)
    with pytest.raises(CompletionConditionError, match=message):
        call(sm, v0, v1)
    assert sm.state.phase is Phase.FAILED and message in sm.state.reason
    assert phase.value in sm.state.reason  # the reason says where it failed
    assert sm.committed == v0  # nothing was committed
    with pytest.raises(IllegalTransitionError):
        step_calls(v0, v1)[phase][1](sm)  # cannot continue from FAILED


@pytest.mark.parametrize("phase", ORDER[1:])
def test_timeout_leads_to_failed_never_onward(phase):
    v0, v1 = version(0), version(1, "w1")
    clock = FakeClock()
    sm = IterationStateMachine(v0, deadlines=PhaseDeadlines(*(10.0,) * 6), clock=clock)
    drive_to(sm, phase, v0, v1)
    clock.t += 10.5
    with pytest.raises(PhaseTimeoutError, match=f"timeout in {phase.value}"):
        step_calls(v0, v1)[phase][1](sm)
    assert sm.state.phase is Phase.FAILED
    assert sm.committed == v0


def test_deadline_watchdog_and_in_time_transition():
    v0, v1 = version(0), version(1, "w1")
    clock = FakeClock()
    sm = IterationStateMachine(v0, deadlines=PhaseDeadlines(exporting=5.0), clock=clock)
    sm.begin_export()
    clock.t += 4.9
    sm.check_deadline()
    assert sm.state.phase is Phase.EXPORTING
    clock.t += 0.2
    with pytest.raises(PhaseTimeoutError):
        sm.check_deadline()
    assert sm.state.phase is Phase.FAILED
    clock.t += 1000  # a resting state has no deadline
    sm.recover(v0)
    clock.t += 10_000
    sm.check_deadline()
    assert sm.state.phase is Phase.ACTOR_COMMITTED


def test_collective_deadline_fails_every_rank_together():
    """check_deadline(agree=...) fails a rank that is in time when another rank is late (the
    reduction says so), with the late rank's own reason where it is the late one."""
    v0 = version(0)
    clock = FakeClock()
    seen = []

    def others_late(in_time):  # an all-reduce where some other rank reported "late"
        seen.append(in_time)
        return False

    sm = IterationStateMachine(v0, deadlines=PhaseDeadlines(generating=60.0), clock=clock)
    drive_to(sm, Phase.GENERATING, v0, version(1, "w1"))
    clock.t += 1.0
    sm.check_deadline(agree=lambda in_time: in_time)  # everyone in time: nothing happens
    assert sm.state.phase is Phase.GENERATING
    with pytest.raises(PhaseTimeoutError, match="another rank is past the deadline"):
        sm.check_deadline(agree=others_late)
    assert seen == [True] and sm.state.phase is Phase.FAILED

    sm = IterationStateMachine(v0, deadlines=PhaseDeadlines(generating=60.0), clock=clock)
    drive_to(sm, Phase.GENERATING, v0, version(1, "w1"))
    clock.t += 61.0
    with pytest.raises(PhaseTimeoutError, match="timeout in GENERATING"):
        sm.check_deadline(agree=lambda in_time: in_time)  # this rank is the late one
    assert sm.state.phase is Phase.FAILED


def test_commit_needs_every_rank_completed_on_the_same_weights():
    """The commit's evidence is each rank's report (update ran to the end, manifest of the
    weights it holds): one rank that did not finish, or that holds other weights, refuses v+1."""
    v0, v1 = version(0), version(1, "w1")
    w1 = H("w1")
    for reports, ok in (([(True, w1), (True, w1)], True),
                        ([(True, w1), (False, w1)], False),  # a rank's update did not complete
                        ([(True, w1), (True, H("w-other"))], False)):  # a rank diverged
        sm = IterationStateMachine(v0)
        drive_to(sm, Phase.UPDATING_FROM, v0, v1)
        evidence = UpdateEvidence.from_rank_reports(reports, w1)
        assert evidence.world_size == 2 and evidence.ranks_succeeded == sum(d and h == w1 for d, h in reports)
        if ok:
            sm.commit(v1, evidence)
            assert sm.committed == v1
        else:
            with pytest.raises(CompletionConditionError, match="succeeded on 1 of 2 ranks"):
                sm.commit(v1, evidence)
            assert sm.state.phase is Phase.FAILED and sm.committed == v0


def test_deadlines_from_config_section():
    from megarl.config import PhaseTimeoutsConfig

    d = PhaseDeadlines.from_config(PhaseTimeoutsConfig(generating=12.5, updating_from=None))
    assert d.for_phase(Phase.GENERATING) == 12.5 and d.for_phase(Phase.UPDATING_FROM) is None
    assert d.for_phase(Phase.EXPORTING) == PhaseTimeoutsConfig().exporting


def test_recover_requires_the_last_committed_version():
    v0, v1 = version(0), version(1, "w1")
    sm = IterationStateMachine(v0)
    drive_to(sm, Phase.UPDATING_FROM, v0, v1)
    sm.fail("optimizer step crashed on rank 3")
    with pytest.raises(CompletionConditionError, match="restore it"):
        sm.recover(v1)  # half-updated actor weights are not a committed version
    assert sm.state.phase is Phase.FAILED
    sm.recover(v0)
    assert sm.state.version == v0
    # retry the update as attempt 1 of the same step
    drive_to(sm, Phase.UPDATING_FROM, v0, v1)
    retry = v0.successor(H("w1b")).retried(H("w1b"))
    assert retry.update_attempt == 1
    sm.commit(retry, UpdateEvidence(4, 4, retry.weight_manifest_hash))
    assert sm.committed == retry


@pytest.mark.parametrize("phase", ORDER + [Phase.FAILED])
def test_retry_update_only_after_a_failure_inside_the_update(phase):
    """FAILED -> EXPERIENCE_SEALED(v) is the retry of v's update on its sealed batch: legal only
    when the failure came from UPDATING_FROM(v) and the actor holds v again."""
    v0, v1 = version(0), version(1, "w1")
    sm = IterationStateMachine(v0)
    if phase is not Phase.FAILED:
        drive_to(sm, phase, v0, v1)
    sm.fail("injected")
    if phase is not Phase.UPDATING_FROM:
        with pytest.raises(IllegalTransitionError, match="not from UPDATING_FROM"):
            sm.retry_update(v0)
        return
    with pytest.raises(CompletionConditionError, match="restore it first"):
        sm.retry_update(v1)
    assert sm.retry_update(v0).phase is Phase.EXPERIENCE_SEALED and sm.state.version == v0
    sm.begin_update()
    sm.commit(v1, UpdateEvidence(4, 4, v1.weight_manifest_hash))
    assert sm.committed == v1


def test_adopt_sealed_checks_the_batch_like_seal_and_only_from_committed():
    v0, v1 = version(0), version(1, "w1")
    sm = IterationStateMachine(v0)
    with pytest.raises(CompletionConditionError, match="expected only"):
        sm.adopt_sealed(seal(v1))  # a batch of another version
    sm.recover(v0)
    with pytest.raises(CompletionConditionError, match="1 of 2 groups complete"):
        sm.adopt_sealed(seal(v0, groups_complete=1))
    sm.recover(v0)
    assert sm.adopt_sealed(seal(v0)).phase is Phase.EXPERIENCE_SEALED
    with pytest.raises(IllegalTransitionError, match="requires ACTOR_COMMITTED"):
        sm.adopt_sealed(seal(v0))
