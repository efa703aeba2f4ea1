"""The built-in arithmetic task: deterministic, train/heldout disjoint, correct answers, exact
scoring, tiny-tokenizer vocabulary only, and a CLI that refuses to overwrite."""

import json
import os
import subprocess
import sys

import pytest

from megarl.data.tasks import get_task
from megarl.data.tasks.arithmetic import make_problems, problem_split, score, write_jsonl

from tests._dist import ROOT
ALL_OPS = ("plus", "minus", "times")


def _solve(prompt):
    words = prompt.split()
    assert words[:2] == ["what", "is"] and words[-1] == "?" and len(words) == 6
    a, op, b = int(words[2]), words[3], int(words[4])
    return a, op, b, {"plus": a + b, "minus": a - b, "times": a * b}[op]


def test_deterministic_and_seed_dependent():
    a = make_problems("train", 3, 50, (1, 4), ALL_OPS)
    assert a == make_problems("train", 3, 50, (1, 4), ALL_OPS)
    assert a != make_problems("train", 4, 50, (1, 4), ALL_OPS)
    assert make_problems("train", 3, 20, (1, 4), ALL_OPS) == a[:20]  # a prefix of a longer draw
    assert [r["id"] for r in a[:2]] == ["arith-train-3-0", "arith-train-3-1"]
    assert set(a[0]) == {"id", "prompt", "answer"}


def test_splits_disjoint_whatever_the_seeds():
    train = {r["prompt"] for s in (0, 1) for r in make_problems("train", s, 1000, (1, 2), ALL_OPS)}
    heldout = {r["prompt"] for s in (0, 1) for r in make_problems("heldout", s, 1000, (1, 2), ALL_OPS)}
    assert len(heldout) > 100 and len(train) > 100
    assert not train & heldout
    # commutative ops: both operand orders are in the same split
    for p in heldout:
        a, op, b, _ = _solve(p)
        assert problem_split(a, op, b) == "heldout"
        if op != "minus":
            assert problem_split(b, op, a) == "heldout"


def test_answers_digits_and_ops():
    rows = make_problems("heldout", 7, 600, (2, 3), ALL_OPS)
    ops_seen = set()
    for r in rows:
        a, op, b, want = _solve(r["prompt"])
        ops_seen.add(op)
        assert r["answer"] == str(want) and want >= 0
        assert 2 <= len(str(a)) <= 3 and 2 <= len(str(b)) <= 3
    assert ops_seen == set(ALL_OPS)
    one = make_problems("train", 0, 300, (1, 1))
    assert {_solve(r["prompt"])[1] for r in one} == {"plus"}
    assert all(_solve(r["prompt"])[0] < 10 for r in one)


def test_bad_arguments_name_themselves():
    with pytest.raises(ValueError, match="'dev'"):
        make_problems("dev", 0, 3)
    with pytest.raises(ValueError, match="'divide'"):
        make_problems("train", 0, 3, ops=("plus", "divide"))
    with pytest.raises(ValueError, match="digits"):
        make_problems("train", 0, 3, digits=(3, 1))


@pytest.mark.parametrize("response,answer,want", [
    ("3 5 7", "357", 1.0),
    ("3 5 7 <eos>", "357", 1.0),
    ("357", "357", 1.0),
    ("  3 5 7 <|end|> <pad>", "357", 1.0),
    ("0 7", "7", 1.0),
    ("- 1 2", "-12", 1.0),
    ("3 5 8", "357", 0.0),
    ("357 apples", "357", 0.0),
    ("the answer is 357", "357", 0.0),
    ("3 5 7 .", "357", 0.0),
    ("", "357", 0.0),
    ("<eos>", "357", 0.0),
    ("-", "0", 0.0),
    ("3 5 7", 357, 1.0),
])
def test_score_golden(response, answer, want):
    assert score(response, answer) == want


def test_score_rejects_non_integer_answer():
    with pytest.raises(ValueError, match="answer"):
        score("1", "one")


def test_prompts_tokenize_without_unk(tmp_path):
    from megarl.builtin.tiny_tokenizer import build_tiny_tokenizer
    from megarl.data.tokenizer import TokenizerContract

    build_tiny_tokenizer(tmp_path / "tok")
    c = TokenizerContract.from_pretrained(tmp_path / "tok")
    unk = c.tokenizer.unk_token_id
    rows = make_problems("train", 0, 200, (1, 3), ALL_OPS) + make_problems("heldout", 0, 200, (1, 3), ALL_OPS)
    for r in rows:
        ids = c.encode_prompt([{"role": "user", "content": r["prompt"]}])
        assert unk not in ids, r["prompt"]
        assert unk not in c.tokenizer.encode(r["answer"], add_special_tokens=False)
        # the decoded answer tokens score 1.0
        answer_ids = c.tokenizer.encode(r["answer"], add_special_tokens=False) + [c.eos_token_id]
        assert score(c.decode(answer_ids), r["answer"]) == 1.0


def test_get_task_and_write_jsonl(tmp_path):
    assert get_task("arithmetic").score is score
    with pytest.raises(ValueError, match="'chess'"):
        get_task("chess")
    out = tmp_path / "sub" / "x.jsonl"
    assert write_jsonl(out, [{"id": "a", "prompt": "p"}, {"id": "b", "prompt": "q"}]) == 2
    assert [json.loads(l)["id"] for l in out.read_text().splitlines()] == ["a", "b"]
    assert os.listdir(out.parent) == ["x.jsonl"]  # no temp file left


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "megarl.data.tasks.arithmetic", *args],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)


def test_cli_writes_and_refuses_to_overwrite(tmp_path):
    out = tmp_path / "heldout.jsonl"
    args = ["--split", "heldout", "--seed", "5", "--n", "30", "--out", str(out), "--ops", "plus,minus"]
    r = _cli(*args)
    assert r.returncode == 0, r.stderr
    rows = [json.loads(l) for l in out.read_text().splitlines()]
    assert rows == make_problems("heldout", 5, 30, (1, 3), ("plus", "minus"))

    out.write_text("keep me\n")
    r = _cli(*args)
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:") and "--overwrite" in lines[0]
    assert out.read_text() == "keep me\n"

    assert _cli(*args, "--overwrite").returncode == 0
    assert len(out.read_text().splitlines()) == 30

    r = _cli("--split", "dev", "--n", "3", "--out", str(tmp_path / "y.jsonl"))
    assert r.returncode == 2 and r.stderr.startswith("error:") and "'dev'" in r.stderr
    assert not (tmp_path / "y.jsonl").exists()
