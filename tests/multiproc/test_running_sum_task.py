"""The built-in long-tail reasoning task (megarl/data/tasks/running_sum.py): deterministic,
train/heldout disjoint, worked answers that are right, the final-answer rule, and the tail of
response lengths its docstring states, measured with the tiny tokenizer."""

import json
import subprocess
import sys

import numpy as np
import pytest

from megarl.data.tasks import get_task
from megarl.data.tasks.running_sum import TAGS, length_cdf, make_problems, problem_split, score, solution
from tests._dist import subprocess_env


def _terms(row):
    return [int(x) for x in row["prompt"].split()[2:-1:2]]


def test_problems_are_deterministic_disjoint_and_worked_right():
    a = make_problems("train", 3, 500)
    assert a == make_problems("train", 3, 500) and a != make_problems("train", 4, 500)
    held = make_problems("heldout", 1, 300, distinct=True)
    assert len({r["prompt"] for r in held}) == 300
    assert not {r["prompt"] for r in a} & {r["prompt"] for r in held}
    for r in a + held:
        ts = _terms(r)
        tags = r["prompt"].split()[1:-1:2]
        assert tags == list(TAGS[:len(ts)]) and r["terms"] == len(ts) and all(1 <= t <= 9 for t in ts)
        assert problem_split(ts) == ("train" if r in a else "heldout")
        assert r["answer"] == str(sum(ts)) and r["solution"] == solution(ts)
        steps = r["solution"].split(" so ")[0].split(" , ")
        assert len(steps) == len(ts)  # one step per term: the chain is as long as the problem
        total = 0
        for tag, t, step in zip(tags, ts, steps):
            assert step == f"{tag} {t} + {total} = {total + t}"
            total += t
        assert score(r["solution"] + " <eos>", r["answer"]) == 1.0
    # exclude: a validation set is never drawn again
    val = make_problems("heldout", 2, 50, distinct=True)
    assert not {r["prompt"] for r in make_problems("heldout", 1, 300, exclude=val)} & {r["prompt"] for r in val}
    assert get_task("running_sum").score is score


def test_score_reads_only_the_final_answer():
    assert score("a 3 + 0 = 3 , b 5 + 3 = 8 so 8", "8") == 1.0
    assert score("b 5 + 3 = 9 so 8 <|end|>", "8") == 1.0  # a wrong step, the right total: scored right
    assert score("so 1 2 <eos>", "12") == 1.0 and score("so 012", "12") == 1.0
    for wrong in ("a 3 + 0 = 3 , b 5 + 3 = 8", "8", "so 9", "so 8 and more", "so", "", None):
        assert score(wrong, "8") == 0.0, wrong
    with pytest.raises(ValueError):
        score("so 8", "eight")


def test_response_lengths_have_the_stated_tail(tmp_path):
    """Median 27, p99 224 tokens, longest > 200 (p99 / median >= 8): the docstring's numbers."""
    from megarl.builtin.tiny_tokenizer import build_tiny_tokenizer

    tok = build_tiny_tokenizer(tmp_path / "tokenizer")
    rows = make_problems("train", 0, 10000)
    lengths = np.array([len(tok.encode(r["solution"], add_special_tokens=False)) + 1 for r in rows])
    p50, p99 = np.median(lengths), np.percentile(lengths, 99)
    assert p50 == 27 and 220 <= p99 <= 228 and lengths.max() >= 240, (p50, p99, lengths.max())
    assert p99 / p50 >= 8
    # the term counts follow the truncated power law: empirical CDF within sampling error of it
    ks = np.array([r["terms"] for r in rows])
    cdf = length_cdf()
    for k in (2, 3, 5, 10, 20):
        assert abs((ks <= k).mean() - cdf[k - 2]) < 4 * np.sqrt(0.25 / len(rows)), k


def test_cli_writes_rows_and_refuses_bad_arguments(tmp_path):
    out = tmp_path / "h.jsonl"
    run = subprocess.run([sys.executable, "-m", "megarl.data.tasks.running_sum", "--split", "heldout", "--seed", "1",
                          "--n", "20", "--distinct", "--out", str(out)], capture_output=True, text=True,
                         env=subprocess_env(), timeout=120)
    assert run.returncode == 0, run.stderr
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert rows == make_problems("heldout", 1, 20, distinct=True)
    bad = subprocess.run([sys.executable, "-m", "megarl.data.tasks.running_sum", "--split", "train", "--n", "5",
                          "--max-terms", "27", "--out", str(tmp_path / "x.jsonl")], capture_output=True, text=True,
                         env=subprocess_env(), timeout=120)
    assert bad.returncode != 0 and "--max-terms" in bad.stderr and "26" in bad.stderr, bad.stderr



def test_recipe_builds_its_task_files_and_model_then_reuses_or_refuses_them(tmp_path, capfd):
    """The recipe's start-up (megarl/commands/startup.py, megarl/builtin/tasks/running_sum.py): the task files
    (the held-out one is the warm start's evaluation set) and a small model build (30 steps, no
    target; its own process, as a recipe's build runs): the answer NLL falls, the export is a
    complete HF checkpoint with tiny_model.json, its greedy answers were scored by the task's
    rule.  The same settings reuse both; other settings are refused naming the key.  A target
    the build cannot reach fails naming the flags, leaving no half-built model."""
    from megarl.builtin.warmstart import MARKER
    from megarl.commands import startup
    from megarl.config import load_config
    from megarl.errors import MegarlError

    out = tmp_path / "rsum"
    overrides = [f"model.path={out}", f"data.train_path={tmp_path / 'train.jsonl'}",
                 f"data.heldout_path={tmp_path / 'held.jsonl'}", "data.task.train_n=50",
                 "data.task.heldout_n=8", "model.tiny.hidden_size=64", "model.tiny.num_layers=2",
                 "model.tiny.intermediate_size=128", "model.tiny.warmstart_batch=16",
                 "model.tiny.warmstart_steps=30", "model.tiny.warmstart_target_accuracy=null"]
    cfg = load_config("configs/grpo_rsum_tiny.yaml", overrides)
    startup.ensure_builtin_task(cfg)
    held = [json.loads(line) for line in open(tmp_path / "held.jsonl")]
    assert held == make_problems("heldout", 1, 8, distinct=True)
    assert [json.loads(line) for line in open(tmp_path / "train.jsonl")] == make_problems("train", 0, 50)
    startup.ensure_builtin_model(cfg)
    assert "tiny model ready" in capfd.readouterr().out
    info = json.loads((out / MARKER).read_text())
    assert info["task"] == {"name": "running_sum", "terms": [2, 26], "alpha": 1.8}
    assert info["warmstart"]["steps"] == 30 and info["warmstart"]["final_nll"] < 0.6 * info["warmstart"]["first_nll"]
    assert (out / "config.json").is_file() and (out / "tokenizer_config.json").is_file()
    assert sum(v["n"] for v in info["heldout_accuracy_by_terms"].values()) == 8
    assert 1 <= info["heldout_answer_tokens"]["median"] <= info["heldout_answer_tokens"]["max"] <= 320

    startup.ensure_builtin_task(cfg)  # the same settings: taken as they are
    startup.ensure_builtin_model(cfg)
    assert "building" not in capfd.readouterr().out
    other = load_config("configs/grpo_rsum_tiny.yaml", overrides + ["data.task.args.alpha=1.5"])
    with pytest.raises(MegarlError, match=r"data\.task\.args\.alpha: the cached build has 1\.8, the config 1\.5"):
        startup.ensure_builtin_model(other)
    with pytest.raises(MegarlError, match=r"data\.task: .*train\.jsonl holds another train split .*"
                                          r"data\.task\.build=false"):
        startup.ensure_builtin_task(other)
    arith = load_config("configs/grpo_arith_tiny.yaml", [f"model.path={out}"])
    with pytest.raises(MegarlError, match=r"model\.build_tiny: .* holds a tiny model built with other settings"):
        startup.ensure_builtin_model(arith)  # an arithmetic recipe does not train the running-sum model in silence

    small = ["--hidden-size", "64", "--num-layers", "2", "--intermediate-size", "128", "--batch", "16", "--heldout-n", "8"]
    never = subprocess.run([sys.executable, "-m", "megarl.tinymodel", "--task", "running_sum", "--out",
                            str(tmp_path / "never"), *small, "--steps", "2", "--target-accuracy", "0.99",
                            "--check-every", "1"], capture_output=True, text=True, env=subprocess_env(), timeout=600)
    assert never.returncode != 0 and "reach --target-accuracy 0.99 (model.tiny.warmstart_target_accuracy) within --steps 2" in never.stderr, never.stderr[-2000:]
    assert not (tmp_path / "never").exists() and not (tmp_path / "never.build").exists()


def test_recipe_settings_are_checked_by_key():
    from megarl.commands.run_checks import check_run
    from megarl.config import ConfigError, load_config

    check_run(load_config("configs/grpo_rsum_tiny.yaml"), 1)

    for extra, key in ((["data.task.args.min_digits=2"], "data.task.args: task running_sum takes no min_digits"),
                       (["data.task.args.min_terms=9", "data.task.args.max_terms=4"], "data.task.args.min_terms"),
                       (["data.task.args.max_terms=27"], "data.task.args.max_terms"),
                       (["data.task.args.alpha=fast"], "data.task.args.alpha: expects float"),
                       (["data.task.name=sudoku"], "data.task.name")):
        with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
            check_run(load_config("configs/grpo_rsum_tiny.yaml", extra), 1)
