"""Process rewards for the running-sum task: each worked step checked against its problem and
placed on the step's last response token; grpo_process reads them from the sealed records."""

import pytest
import torch

from megarl.algo.derivation import step_tensors
from megarl.data.tasks.running_sum import prompt, solution, step_checks
from megarl.experience.schema import RewardRecord, RewardStatus
from megarl.rewards.base import RewardSample
from megarl.rewards.rules import RunningSumSteps, step_token_ends


def test_each_step_is_checked_against_the_problem():
    terms = [3, 5, 2]
    right = solution(terms)  # "a 3 + 0 = 3 , b 5 + 3 = 8 , c 2 + 8 = 10 so 10"
    assert [ok for _, ok in step_checks(prompt(terms), right)] == [True, True, True, True]
    # a wrong running total breaks that step; the next one, right from the true total, is right
    wrong = "a 3 + 0 = 3 , b 5 + 3 = 9 , c 2 + 8 = 10 so 10"
    assert [ok for _, ok in step_checks(prompt(terms), wrong)] == [True, False, True, True]
    # another tag or term is wrong too, and so is a step past the problem's last term
    assert [ok for _, ok in step_checks(prompt(terms), "a 3 + 0 = 3 , c 5 + 3 = 8 so 8")] == [True, False, False]
    assert [ok for _, ok in step_checks(prompt([4]), "a 4 + 0 = 4 , b 1 + 4 = 5 so 5")] == [True, False, False]
    # a chain cut short (no "so <total>") ends in a wrong step at its end: right steps that stop
    # before the answer are not a right response; an empty response has no step at all
    cut = "a 3 + 0 = 3 , b 5 + 3 = 8 ,"
    assert step_checks(prompt(terms), cut)[-1] == (len(cut), False)
    assert [ok for _, ok in step_checks(prompt(terms), cut)] == [True, True, False]
    assert step_checks(prompt(terms), "   ") == []
    # the tiny tokenizer's spaced digits and special markers keep their offsets
    spaced = "a 3 + 0 = 3 , b 5 + 3 = 8 , c 2 + 8 = 1 0 so 1 0 <eos>"
    checks = step_checks(prompt(terms), spaced)
    assert [ok for _, ok in checks] == [True, True, True, True]
    assert [spaced[e - 1] for e, _ in checks] == ["3", "8", "0", "0"] and checks[-1][0] == spaced.index(" <eos>")


def _sample(prompt_text, tokens, answer):
    text = " ".join(tokens)
    ends = tuple(len(" ".join(tokens[:t + 1])) for t in range(len(tokens)))
    return RewardSample(sample_id="s", prompt_id="p", group_id="g", prompt_text=prompt_text, response_text=text,
                        prompt_ids=(1,), response_ids=tuple(range(len(tokens))), finish_reason="eos",
                        ground_truth={"answer": answer}, response_char_ends=ends)


def test_steps_land_on_their_last_token_and_the_outcome_is_the_total():
    tokens = "a 3 + 0 = 3 , b 5 + 3 = 9 so 9".split()
    rec = RunningSumSteps()(_sample(prompt([3, 5]), tokens, "8"))
    assert rec.status is RewardStatus.OK and rec.total == 0.0
    assert rec.step_rewards == (1.0, 0.0, 0.0)
    assert [tokens[e] for e in rec.step_token_ends] == ["3", "9", "9"] and rec.step_token_ends == (5, 12, 14)
    assert dict(rec.components) == {"correct": 0.0, "step_accuracy": pytest.approx(1 / 3)}
    assert step_token_ends([0, 4, 5], [1, 3, 5]) == [0, 2, 2]  # the first token ending at or past it
    # without the token offsets the scorer is misconfigured: a status, never a score
    bare = RunningSumSteps()(RewardSample("s", "p", "g", prompt([3]), "a 3 + 0 = 3 so 3", (1,), (2,), "eos",
                                          {"answer": "3"}))
    assert bare.status is RewardStatus.ERROR and "response_char_ends" in bare.error


def test_step_tensors_pad_and_turn_a_stepless_record_into_one_step():
    mask = torch.tensor([[1, 1, 1, 1, 0], [1, 1, 1, 0, 0]])
    recs = [RewardRecord(total=1.0, scorer_version="v", step_rewards=(1.0, 0.0, 1.0), step_token_ends=(0, 2, 3)),
            RewardRecord(total=-1.0, scorer_version="v")]
    rewards, ends = step_tensors(recs, mask)
    assert rewards.tolist() == [[1.0, 0.0, 1.0], [-1.0, 0.0, 0.0]] and ends.tolist() == [[0, 2, 3], [2, -1, -1]]
