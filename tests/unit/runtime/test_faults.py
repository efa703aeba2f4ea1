"""Fault injection is deterministic, keyed and countable; an engine failure reaches the trainer
as missing results, never as a hang of the other ranks."""

import torch

from megarl.config import FaultsConfig
from megarl.control.placement import Placement, generate_everywhere
from megarl.rollout.protocol import FinishReason, GenerationRequest, GenerationResult, RolloutError, SamplingParams
from megarl.rewards.faulty import FaultyRewardFunction
from megarl.rollout.faulty import FaultyRolloutEngine
from megarl.runtime.faults import FaultInjector


def test_decisions_are_deterministic_keyed_and_near_the_rate():
    inj = FaultInjector(FaultsConfig(rollout_error_rate=0.2), seed=7)
    draws = [inj.fires("rollout_error", 0.2, f"g{i}", 0, 0) for i in range(4000)]
    assert draws == [FaultInjector(FaultsConfig(), seed=7).fires("rollout_error", 0.2, f"g{i}", 0, 0)
                     for i in range(4000)]
    assert 0.18 < sum(draws) / len(draws) < 0.22
    retry = [inj.fires("rollout_error", 0.2, f"g{i}", 0, 1) for i in range(4000)]  # a new attempt: a fresh draw
    assert retry != draws
    assert not any(inj.fires("rollout_error", 0.0, f"g{i}", 0, 0) for i in range(100))
    other_seed = [FaultInjector(FaultsConfig(), seed=8).fires("rollout_error", 0.2, f"g{i}", 0, 0) for i in range(4000)]
    assert other_seed != draws


class _Engine:
    """A stand-in for an inference engine's process boundary: answers every candidate."""

    device = torch.device("cpu")

    def __init__(self, fail=False):
        self.fail, self.dtype = fail, "float32"

    def staging_target(self, name):
        return None

    def generate(self, requests, sampling):
        if self.fail:
            raise RolloutError("worker died")
        return [GenerationResult(q.request_id, c, q.prompt_ids, (5,), FinishReason.EOS, torch.zeros(1), None, "v0",
                                 attempt=q.attempt) for q in requests for c in q.candidates(sampling.n)]


def test_lost_results_arrive_late_and_duplicates_are_counted():
    inj = FaultInjector(FaultsConfig(rollout_error_rate=0.3, duplicate_result_rate=0.2), seed=1)
    eng = FaultyRolloutEngine(_Engine(), inj)
    assert eng.dtype == "float32"  # everything else is the real engine's
    assert eng.device == torch.device("cpu") and eng.staging_target("w") is None
    sp = SamplingParams(n=4)
    reqs = [GenerationRequest(f"g{i}", (1, 2)) for i in range(25)]
    first = eng.generate(reqs, sp)
    lost = inj.counts["rollout_errors"]
    assert 0 < lost < 100 and len(first) == 100 - lost + inj.counts["duplicate_results"]
    second = eng.generate([GenerationRequest("h", (1,))], SamplingParams(n=1))
    late = [r for r in second if r.request_id != "h"]
    assert len(late) == lost == inj.counts["late_results"] and all(r.attempt == 0 for r in late)


def test_engine_error_is_missing_results_not_a_hang():
    place = Placement(num_groups=1, group_index=0, is_group_leader=True, process_group=None)
    errors = []
    out = generate_everywhere(_Engine(fail=True), place, [GenerationRequest("g", (1,))], SamplingParams(n=2), errors)
    assert out == [] and errors == [(0, "RolloutError: worker died")]


def test_hung_reward_calls_are_keyed_by_sample_and_attempt():
    class Sample:
        def __init__(self, sid):
            self.sample_id = sid

    inj = FaultInjector(FaultsConfig(reward_timeout_rate=0.5), seed=3)
    fn = FaultyRewardFunction(lambda s: s.sample_id, inj, hang_s=0.0)
    fn.version = "v"
    assert [fn(Sample(f"s{i}")) for i in range(40)] == [f"s{i}" for i in range(40)]  # the real result, late
    want = lambda attempt: sum(inj.fires("reward_timeout", 0.5, f"s{i}", attempt) for i in range(40))  # noqa: E731
    assert inj.counts["reward_timeouts"] == want(0) and 10 < want(0) < 30
    for i in range(40):
        fn(Sample(f"s{i}"))  # the second attempt of each: its own draw
    assert inj.counts["reward_timeouts"] == want(0) + want(1)


class _Actor:
    """The actor's train_step seam: runs the loss closure once and the post-step hook."""

    def __init__(self):
        self.steps, self.losses = 0, []

    def train_step(self, micro_batches, loss_fn, after_optimizer_step=None, replay_layers=None):
        loss, _ = loss_fn(torch.ones(1), micro_batches[0])
        self.losses.append(float(loss))
        if after_optimizer_step is not None:
            after_optimizer_step()
        self.steps += 1
        return "result"


def _loss(output, mb):
    return output.sum() * 2.0, {}


def test_faulty_actor_poisons_the_last_step_of_a_listed_iteration_once():
    from megarl.roles.faulty_actor import FaultyActor

    inj = FaultInjector(FaultsConfig(fail_optimizer_step_at=[1], fail_optimizer_step_kind="nan",
                                     fail_optimizer_step_rank=0), seed=0, rank=0, world=1)
    actor = _Actor()
    faulty = FaultyActor(actor, inj, steps_per_update=3)
    for k in (0, 1, 1):  # iteration 1 runs twice: its retry must be clean
        inj.iteration = k
        for _ in range(3):
            assert faulty.train_step([{}], _loss) == "result"
    assert actor.losses[:5] == [2.0] * 5 and actor.losses[5] != actor.losses[5]  # NaN at iteration 1's last step
    assert actor.losses[6:] == [2.0] * 3 and inj.counts["optimizer_step_failures"] == 1
    faulty.steps = 42  # a rollback restoring the step count reaches the real actor
    assert actor.steps == 42 and faulty.steps == 42


def test_faulty_actor_raises_after_the_optimizer_applied_the_step():
    import pytest

    from megarl.roles.faulty_actor import FaultyActor
    from megarl.runtime.faults import InjectedFault

    inj = FaultInjector(FaultsConfig(fail_optimizer_step_at=[0], fail_optimizer_step_rank=-1), seed=0, rank=1, world=2)
    actor = _Actor()
    faulty = FaultyActor(actor, inj, steps_per_update=1)
    inj.iteration = 0
    with pytest.raises(InjectedFault, match="iteration 0's optimizer step on rank 1"):
        faulty.train_step([{}], _loss)
    assert actor.losses == [2.0]  # the loss was the real one; the step ran before the raise
    other_rank = FaultyActor(_Actor(), FaultInjector(inj.cfg, seed=0, rank=0, world=2), steps_per_update=1)
    other_rank._inj.iteration = 0
    assert other_rank.train_step([{}], _loss) == "result"  # only the chosen rank fails
