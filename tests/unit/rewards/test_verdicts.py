"""A generative judge's verdict rule (megarl/rewards/verdicts.py): parsed or a status, never a 0."""

import math

import pytest

from megarl.rewards.verdicts import VerdictRule, check_template, parse_verdict, template_ground_truth_fields, yes_probability


def test_yes_no_is_the_first_whole_word():
    rule = VerdictRule()
    assert parse_verdict("the answer is right . yes", False, rule).score == 1.0
    v = parse_verdict("No , then yes", False, rule)
    assert (v.score, v.word, v.at) == (0.0, "no", 0)
    # a word that only contains yes / no is not a verdict: "nothing", "yesterday", "know"
    bad = parse_verdict("nothing yesterday i know", False, rule)
    assert bad.score is None and "unparseable" in bad.error and "'nothing yesterday i know'" in bad.error
    cut = parse_verdict("the sum is 9", True, rule)
    assert cut.score is None and "truncated" in cut.error and "max_new_tokens" in cut.error
    custom = VerdictRule(yes="right", no="wrong")
    assert parse_verdict("WRONG.", False, custom).score == 0.0


def test_score_pattern_reads_one_group_and_refuses_non_numbers():
    rule = VerdictRule(kind="score", pattern=r"score\s*:\s*(\S+)")
    assert parse_verdict("reasoning ... score: 7.5 out of 10", False, rule).score == 7.5
    nan = parse_verdict("score: nan", False, rule)
    assert nan.score is None and "not a finite number" in nan.error
    assert parse_verdict("score : x", False, rule).score is None
    assert "truncated" in parse_verdict("reasoning goes on", True, rule).error


@pytest.mark.parametrize("kwargs, words", [
    (dict(kind="maybe"), "not one of"),
    (dict(yes="yes", no="YES"), "two different words"),
    (dict(kind="score"), "needs a pattern"),
    (dict(kind="score", pattern=r"(\d)(\d)"), "exactly one group"),
])
def test_bad_rules_are_refused(kwargs, words):
    with pytest.raises(ValueError, match=words):
        VerdictRule(**kwargs)


def test_the_prompt_must_read_the_response():
    assert check_template("q: {prompt} a: {response}", "k") == ("prompt", "response")
    with pytest.raises(ValueError, match=r"reward.judges\[0\].prompt: the judge's prompt has no \{response\}"):
        check_template("is {prompt} easy?", "reward.judges[0].prompt")
    # any other name is a ground-truth field of the row (a reference-guided judge)
    assert check_template("{prompt} {answer} {response} {answer}", "k") == ("prompt", "answer", "response", "answer")
    assert template_ground_truth_fields("{prompt} {answer} {response} {answer}") == ("answer",)
    assert template_ground_truth_fields("q: {prompt} a: {response}") == ()
    for bad in ("{prompt} {0} {response}", "{answer.x} {response}", "{answer[0]} {response}", "{} {response}"):
        with pytest.raises(ValueError, match="are not names"):
            check_template(bad, "k")


def test_a_reward_models_user_turn_reads_the_prompt_and_the_rows_fields_never_the_response():
    from megarl.rewards.verdicts import check_context_template

    assert check_context_template("{prompt} answer : {answer} {answer}", "k") == ("answer",)
    assert check_context_template("{prompt}", "k") == ()
    with pytest.raises(ValueError, match=r"^reward.models\[0\].prompt: \{response\} is not the user turn's"):
        check_context_template("{prompt} {response}", "reward.models[0].prompt")
    with pytest.raises(ValueError, match="are not names"):
        check_context_template("{prompt} {answer[0]}", "k")


def test_yes_probability_is_the_two_words_renormalised():
    assert yes_probability(math.log(0.3), math.log(0.1)) == pytest.approx(0.75, abs=1e-12)
    assert yes_probability(0.0, 0.0) == 0.5
