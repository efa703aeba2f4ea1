"""The built-in judge's task (megarl/builtin/tasks/arithmetic_judge.py): its rows, what it trains
on, and that no config takes it for a policy's task."""

from collections import Counter

import pytest

from megarl.builtin.tasks import task_settings
from megarl.builtin.tasks.arithmetic_judge import (
    CYCLE, PROMPT, WRONG, judge_rows, judge_sequences, render_judge_prompt, splits,
)
from megarl.data.tasks.arithmetic import make_problems, problem_key, score
from megarl.errors import ConfigError


def test_half_the_candidates_are_right_and_every_wrong_one_is_wrong_by_the_rule():
    rows = judge_rows(make_problems("train", 3, 700, digits=(1, 2), ops=("plus", "minus")), seed=3)
    kinds = Counter(r["kind"] for r in rows)
    assert kinds["right"] == 350 and set(kinds) == {"right", *WRONG}
    assert min(kinds[k] for k in WRONG) >= 350 // len(CYCLE)
    for r in rows:
        right = score(r["candidate"], r["reference"]) == 1.0
        assert r["answer"] == ("yes" if right else "no") and right == (r["kind"] == "right"), r
    # a near miss the rule would grade right ("00" for "0") is never a "no" row
    assert all(r["candidate"] != "00" for r in rows if r["reference"] == "0")
    assert judge_rows(make_problems("train", 3, 50, digits=(1, 2), ops=("plus",)), seed=3) == \
        judge_rows(make_problems("train", 3, 50, digits=(1, 2), ops=("plus",)), seed=3)


def test_the_evaluation_rows_share_no_problem_with_the_training_rows():
    s = task_settings("arithmetic_judge", {})
    parts = splits(s, 2000, 200)
    train, heldout = parts["train"](), parts["heldout"]()
    key = lambda r: problem_key({"prompt": r["problem"]})  # noqa: E731
    assert len(heldout) == 200 and not {key(r) for r in train} & {key(r) for r in heldout}


def test_it_trains_on_the_judges_own_rendering(tmp_path):
    """The warm start's input is the reference-guided judge's rendering of a sample with the
    candidate as its response and the reference as its ground truth; the verdict word and EOS
    follow."""
    from megarl.builtin.tiny_tokenizer import build_tiny_tokenizer
    from megarl.data.tokenizer import TokenizerContract
    from megarl.roles.judge import judge_input

    build_tiny_tokenizer(tmp_path)
    tok = TokenizerContract.load(str(tmp_path))
    row = {"problem": "what is 5 plus 74 ?", "candidate": "77", "reference": "79", "answer": "no"}
    ids = render_judge_prompt(tok, PROMPT, row)
    assert ids == judge_input(tok, PROMPT, "what is 5 plus 74 ?", "7 7", {"answer": "79", "id": "x"})
    assert tok.decode(ids) == ("<bos> <|user|> answer : 7 9 result : 7 7 . is the result the answer ? <|end|> "
                               "<|assistant|>")
    assert tok.tokenizer.unk_token_id not in ids  # every word is the tiny tokenizer's
    prompts, answers = judge_sequences(tok, PROMPT, [row, dict(row, candidate="79", answer="yes")])
    assert answers == [[tok.tokenizer.convert_tokens_to_ids("no"), tok.eos_token_id],
                       [tok.tokenizer.convert_tokens_to_ids("yes"), tok.eos_token_id]]
    with pytest.raises(KeyError, match=r"reward.judges\[0\].prompt reads the row's \['answer'\]"):
        judge_input(tok, PROMPT, "q", "7", {"target": "7"}, key="reward.judges[0]")


@pytest.mark.parametrize("prompt, words", [
    ("answer : {answer} . is it ?", "has no {response}"),
    ("{gold} {response}", "carry only {answer}"),
    ("{answer.x} {response}", "are not names"),
])
def test_a_judge_prompt_it_cannot_fill_is_refused(prompt, words):
    with pytest.raises(ConfigError, match=r"--task-arg prompt: .*" + words.replace("{", r"\{").replace("}", r"\}")):
        task_settings("arithmetic_judge", {"prompt": prompt}, key="--task-arg")


def test_it_is_no_policys_task():
    from megarl.builtin.tasks.config_checks import check_builtin_task
    from megarl.config import load_config

    cfg = load_config("configs/grpo_arith_tiny.yaml", ["data.task.name=arithmetic_judge"])
    with pytest.raises(ConfigError, match="data.task.name: arithmetic_judge is a generative judge's warm start"):
        check_builtin_task(cfg)
