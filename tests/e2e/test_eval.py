"""Evaluation metrics and the data-vs-reward start-up check, in-process with golden values, plus
the two command-line contracts that need a process:

* pass@k (Chen et al. 2021) and maj@k against hand computations, over scored samples only;
  per-source metrics; no accuracy at all when nothing was scored;
* the ground-truth fields each reward declares (answer_key honoured, composites, plug-ins,
  ``reward.required_fields``) and the answers maj@k votes over;
* a train or held-out file missing the field the reward reads is refused at start-up naming the
  file, the line (JSONL) / row (Parquet) and the field -- ``python -m megarl.train`` exits 2 before
  any model loads -- or, with ``data.on_missing_fields=skip``, its rows are dropped and counted;
* ``python -m megarl.eval`` on an export reproduces the training's own held-out evaluation
  (:func:`tests._train_runs.check_eval_reproduces_training`, called by tests/e2e/test_train_e2e.py on its GRPO run).
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest

from megarl.evaluation.estimators import (Candidate, PromptOutcome, accuracy_metrics, maj_at_k, pass_at_k,
                                          per_source_metrics, sampled_metrics)
from tests._control_fakes import load_cfg
from tests._dist import ROOT, subprocess_env

# ---- pass@k / maj@k -------------------------------------------------------------------------------


def test_pass_at_k_is_the_unbiased_estimator_by_hand():
    # n=5 samples, c=2 correct: 1 - C(3,k)/C(5,k)
    assert pass_at_k(5, 2, 1) == pytest.approx(1 - 3 / 5)  # 0.4
    assert pass_at_k(5, 2, 2) == pytest.approx(1 - 3 / 10)  # 0.7
    assert pass_at_k(5, 2, 3) == pytest.approx(1 - 1 / 10)  # 0.9
    assert pass_at_k(5, 2, 4) == 1.0  # n - c < k: some k-subset always holds a correct one
    assert pass_at_k(5, 0, 3) == 0.0 and pass_at_k(5, 5, 1) == 1.0
    assert pass_at_k(10, 3, 5) == pytest.approx(1 - 21 / 252)  # C(7,5)/C(10,5)
    with pytest.raises(ValueError):
        pass_at_k(3, 1, 4)


def test_maj_at_k_votes_over_the_first_k_answers():
    answers = ["3", "4", "4", "3", None, "5"]
    correct = [True, False, False, True, False, False]
    assert maj_at_k(answers, correct, 1) == 1.0  # "3"
    assert maj_at_k(answers, correct, 3) == 0.0  # "4" twice
    assert maj_at_k(answers, correct, 4) == 1.0  # 2-2 tie: the answer seen first ("3")
    assert maj_at_k(answers, correct, 6) == 1.0  # no answer does not vote
    assert maj_at_k([None, None], [True, True], 2) == 0.0  # no answer at all is wrong


def _cand(i, status, reward=None, text=None):
    return Candidate(index=i, status=status, reward=reward, response_text=text, response_len=1)


def _outcomes():
    """P0: 3 scored (2 correct), 1 lost; P1: 3 scored (1 correct), 1 scorer error; P2: nothing scored."""
    p0 = PromptOutcome(0, "p0", "q0", "a", [_cand(0, "ok", 1.0, "5"), _cand(1, "ok", 0.0, "4"),
                                             _cand(2, "ok", 1.0, "5"), _cand(3, "lost")])
    p1 = PromptOutcome(1, "p1", "q1", "b", [_cand(0, "ok", 0.0, "7"), _cand(1, "error"),
                                             _cand(2, "ok", 0.0, "8"), _cand(3, "ok", 1.0, "9")])
    p2 = PromptOutcome(2, "p2", "q2", "b", [_cand(i, "invalid") for i in range(4)])
    return [p0, p1, p2]


def test_pass_and_maj_at_k_over_scored_samples_by_hand():
    m = sampled_metrics(_outcomes(), 1.0, [1, 2, 3, 4], answer_of=lambda t: t)
    # P0: n=3, c=2 -> pass@1 2/3, pass@2 1 - C(1,2)/C(3,2) = 1, pass@3 1
    # P1: n=3, c=1 -> pass@1 1/3, pass@2 1 - C(2,2)/C(3,2) = 2/3, pass@3 1 - C(2,3)/C(3,3) = 1
    # P2: no scored sample -> in no mean
    assert m["eval/pass@1"] == pytest.approx(0.5) and m["eval/pass@2"] == pytest.approx(5 / 6)
    assert m["eval/pass@3"] == pytest.approx(1.0)
    # maj: P0 "5" (k=1), tie "5"/"4" -> "5" (k=2), "5" x2 (k=3): right; P1 "7" first in every tie: wrong
    assert (m["eval/maj@1"], m["eval/maj@2"], m["eval/maj@3"]) == (0.5, 0.5, 0.5)
    assert m["eval/prompts@1"] == m["eval/prompts@3"] == 2
    assert math.isnan(m["eval/pass@4"]) and math.isnan(m["eval/maj@4"]) and m["eval/prompts@4"] == 0
    assert (m["eval/sample_accuracy"], m["eval/samples_scored"], m["eval/samples_unscored"]) == (0.5, 6, 6)
    by_source = per_source_metrics(_outcomes(), lambda ps, prefix: sampled_metrics(ps, 1.0, [2], lambda t: t, prefix))
    assert by_source["eval/source/a/pass@2"] == 1.0 and by_source["eval/source/b/pass@2"] == pytest.approx(2 / 3)
    assert by_source["eval/source/b/prompts@2"] == 1  # P2 has nothing scored


def test_greedy_accuracy_is_over_scored_prompts_and_nan_when_none():
    m = accuracy_metrics(_outcomes(), 1.0)  # the first candidates: P0 right, P1 wrong, P2 invalid
    assert (m["eval/accuracy"], m["eval/scored"], m["eval/scorer_failures"], m["eval/n"]) == (0.5, 2, 1, 3)
    none = accuracy_metrics([_outcomes()[2]], 1.0)
    assert math.isnan(none["eval/accuracy"]) and none["eval/scored"] == 0 and none["eval/scorer_failures"] == 1
    src = per_source_metrics(_outcomes(), lambda ps, prefix: accuracy_metrics(ps, 1.0, prefix))
    assert src["eval/source/a/accuracy"] == 1.0 and src["eval/source/b/accuracy"] == 0.0
    assert src["eval/source/b/scored"] == 1 and src["eval/source/b/n"] == 2
    assert per_source_metrics([PromptOutcome(0, "x", "q", None, [_cand(0, "ok", 1.0)])], lambda ps, p: {"k": 1}) == {}


# ---- what rewards declare -------------------------------------------------------------------------


class PluginWithFields:
    required_fields = ["question_id", ("tests", "asserts")]

    def __call__(self, sample):
        return 1.0


def plugin_fn(sample, scale=1.0):
    return scale


plugin_fn.required_fields = ["label"]


def test_rewards_declare_the_fields_they_read():
    from megarl.rewards import build_reward_function
    from megarl.rewards.declarations import required_fields

    def fields(fn, kwargs=None, components=None):
        return required_fields(build_reward_function(fn, kwargs, components))

    assert fields("arithmetic") == ("answer",)
    assert fields("exact_numeric", {"answer_key": "target"}) == ("target",)
    assert fields("math_verify", {"answer_key": "solution"}) == ("solution",)
    assert fields("regex", {"pattern": "x"}) == ()
    assert fields("code_exec", {"namespaces": False, "uid": None, "gid": None}) == (("tests", "asserts"),)
    comp = [{"name": "acc", "fn": "exact_numeric", "kwargs": {"answer_key": "gold"}},
            {"name": "fmt", "fn": "regex", "kwargs": {"pattern": "x"}},
            {"name": "again", "fn": "arithmetic", "kwargs": {"answer_key": "gold"}}]
    assert fields("composite", components=comp) == ("gold",)
    assert fields("tests.e2e.test_eval:PluginWithFields") == ("question_id", ("tests", "asserts"))
    assert fields("tests.e2e.test_eval:plugin_fn", {"scale": 2.0}) == ("label",)
    assert fields("tests.plugins.faulty_rewards:digit_count") is None  # declares nothing


def test_config_declares_or_overrides_and_a_reward_model_reads_nothing():
    from megarl.commands.run_checks import check_run
    from megarl.config import ConfigError
    from megarl.rewards.dataset_fields import reward_requirements

    assert reward_requirements(load_cfg())[0] == ("answer",)
    assert reward_requirements(load_cfg("reward.kwargs.answer_key=target"))[0] == ("target",)
    assert reward_requirements(load_cfg("reward.required_fields=[gold,[a,b]]"))[0] == ("gold", ("a", "b"))
    assert reward_requirements(load_cfg("reward.fn=null", "reward.model.path=/rm"))[0] == ()
    # a reference-guided judge reads the fields its prompt names, beside (or without) the rule's
    judge = "reward.judges=[{name: j, path: /j, prompt: '{gold} {response} {answer} {gold}'}]"
    assert reward_requirements(load_cfg(judge)) == (("answer", "gold"), "reward.fn 'arithmetic' and "
                                                                        "reward.judges[0].prompt")
    assert reward_requirements(load_cfg("reward.fn=null", judge)) == (("gold", "answer"), "reward.judges[0].prompt")
    assert reward_requirements(load_cfg("reward.required_fields=[answer]", judge))[0] == ("answer", "gold")
    with pytest.raises(ConfigError, match="data.on_missing_fields"):
        check_run(load_cfg("data.on_missing_fields=drop"), 1)
    with pytest.raises(ConfigError, match=r"eval.k\[1\]"):
        check_run(load_cfg("eval.samples_per_prompt=4", "eval.k=[1,8]"), 1)


def test_answers_are_what_the_reward_parses():
    from megarl.rewards import build_reward_function
    from megarl.rewards.declarations import extract_answer

    num = build_reward_function("exact_numeric")
    assert extract_answer(num, "so x = 3 . 50 !") == "7/2" and extract_answer(num, "none") is None
    ar = build_reward_function("arithmetic")
    assert extract_answer(ar, "0 4 2 <eos>") == "42" and extract_answer(ar, "4 apples") is None
    assert extract_answer(build_reward_function("regex", {"pattern": "a"}), "  The   answer\n") == "The answer"
    comp = build_reward_function("composite", None, [{"name": "f", "fn": "regex", "kwargs": {"pattern": "a"}},
                                                     {"name": "n", "fn": "exact_numeric"}])
    assert extract_answer(comp, "it is 12") == "12"  # the first part that parses answers


# ---- the start-up check ---------------------------------------------------------------------------


def _write_jsonl(path, rows, blank_after=None):
    with open(path, "w") as f:
        for i, r in enumerate(rows):
            f.write(json.dumps(r) + "\n")
            if i == blank_after:
                f.write("\n")
    return str(path)


ROWS = [{"id": f"r{i}", "prompt": f"what is {i} plus 1 ?", "answer": str(i + 1)} for i in range(6)]


def _without_answer(rows, bad):
    out = []
    for i, r in enumerate(rows):
        r = dict(r)
        if i in bad:
            r["target"] = r.pop("answer")
        out.append(r)
    return out


def test_a_file_missing_the_field_is_refused_naming_file_line_and_field(tmp_path):
    from megarl.data.prompts import PromptDatasetError
    from megarl.rewards.dataset_fields import check_datasets_against_reward

    good = _write_jsonl(tmp_path / "train.jsonl", ROWS)
    # line 4 is the row r2 after a blank line 2 (blank lines count: the line number is the file's)
    bad = _write_jsonl(tmp_path / "heldout.jsonl", _without_answer(ROWS, {2, 4}), blank_after=0)
    cfg = load_cfg(f"data.train_path={good}", f"data.heldout_path={bad}")
    with pytest.raises(PromptDatasetError) as e:
        check_datasets_against_reward(cfg)
    msg = str(e.value)
    assert msg.startswith(f"data.heldout_path: {bad}:4: the row has no 'answer' field, which reward.fn 'arithmetic'")
    assert "'target'" in msg and "data.on_missing_fields=skip" in msg
    # the train file too; a null field is missing; answer_key names the field
    cfg = load_cfg(f"data.train_path={bad}", "reward.kwargs.answer_key=target")
    with pytest.raises(PromptDatasetError, match=rf"data.train_path: {bad}:1: the row has no 'target' field"):
        check_datasets_against_reward(cfg)
    nulls = _write_jsonl(tmp_path / "nulls.jsonl", [dict(ROWS[0]), dict(ROWS[1], answer=None)])
    with pytest.raises(PromptDatasetError, match=rf"{nulls}:2: the row has no 'answer'"):
        check_datasets_against_reward(load_cfg(f"data.train_path={nulls}"))
    assert check_datasets_against_reward(load_cfg(f"data.train_path={good}", f"data.heldout_path={good}")) == {
        "data.train_path": 0, "data.heldout_path": 0}


def test_parquet_rows_are_named_by_their_1_based_row_number(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from megarl.data.prompts import PromptDatasetError
    from megarl.rewards.dataset_fields import check_datasets_against_reward

    rows = _without_answer(ROWS, {3})
    path = str(tmp_path / "train.parquet")
    pq.write_table(pa.Table.from_pylist(rows), path)
    with pytest.raises(PromptDatasetError, match=rf"data.train_path: {path}:4: the row has no 'answer' field"):
        check_datasets_against_reward(load_cfg(f"data.train_path={path}"))


def test_a_datasets_directory_is_checked_through_the_same_reader(tmp_path):
    import datasets  # a declared dev dependency: missing, this fails instead of skipping
    from megarl.data.prompts import PromptDatasetError
    from megarl.rewards.dataset_fields import check_datasets_against_reward

    path = str(tmp_path / "ds")
    datasets.DatasetDict({"test": datasets.Dataset.from_list(_without_answer(ROWS, {5}))}).save_to_disk(path)
    good = _write_jsonl(tmp_path / "train.jsonl", ROWS)
    cfg = load_cfg(f"data.train_path={good}", f"data.heldout_path={path}")  # data.heldout_split: "test"
    with pytest.raises(PromptDatasetError, match=rf"data.heldout_path: {path}\[test\]#5: the row has no 'answer'"):
        check_datasets_against_reward(cfg)


def test_skip_drops_and_counts_the_bad_rows(tmp_path, capsys):
    from megarl.data.prompts import PromptDataset, PromptRecord
    from megarl.rewards.dataset_fields import check_datasets_against_reward, drop_rows_missing_fields

    bad = _write_jsonl(tmp_path / "train.jsonl", _without_answer(ROWS, {1, 4}))
    # (no held-out file: the recipe's default path may exist in a checkout that has run it)
    cfg = load_cfg(f"data.train_path={bad}", "data.heldout_path=null", "data.on_missing_fields=skip")
    assert check_datasets_against_reward(cfg) == {"data.train_path": 2}
    assert f"data.train_path: 2 of 6 rows lack a field reward.fn 'arithmetic' reads (first: {bad}:2, 'answer')" \
        in capsys.readouterr().out
    recs = tuple(PromptRecord(r["id"], (1, 2), r["prompt"], None,
                              {k: v for k, v in r.items() if k not in ("id", "prompt")})
                 for r in _without_answer(ROWS, {1, 4}))
    ds = PromptDataset(recs, {"rows": 6, "kept": 6, "path": bad})
    kept = drop_rows_missing_fields(cfg, ds)
    assert [r.prompt_id for r in kept.records] == ["r0", "r2", "r3", "r5"]
    assert kept.stats["dropped_missing_fields"] == 2 and kept.stats["kept"] == 4 and kept.stats["rows"] == 6
    assert drop_rows_missing_fields(load_cfg(f"data.train_path={bad}"), ds) is ds  # error mode: checked at start-up


def test_the_start_up_check_reads_a_default_size_train_file(tmp_path):
    """Every row of a file of the default recipe's size, and a bad row at its end (its speed is
    bench/startup_checks.py's to print: ~0.1 s for these 20,000 rows on one core)."""
    from megarl.rewards.dataset_fields import check_file

    rows = [{"id": f"r{i}", "prompt": f"what is {i} plus 1 ?", "answer": str(i + 1)} for i in range(20000)]
    path = _write_jsonl(tmp_path / "big.jsonl", rows)
    found = check_file(path, ("answer",), reserved=("prompt", "messages", "id"))
    assert found.rows == 20000 and not found.bad
    path = _write_jsonl(tmp_path / "bad_last.jsonl", rows[:-1] + [{"id": "last", "prompt": "what is 1 plus 1 ?"}])
    found = check_file(path, ("answer",), reserved=("prompt", "messages", "id"), on_missing="skip")
    assert found.rows == 20000 and [where for where, _ in found.bad] == [f"{path}:20000"], found.bad


def test_train_refuses_the_file_before_any_model_loads(tmp_path, capsys):
    """In-process for the train file, and one real ``python -m megarl.train`` for the held-out file:
    exit 2 and one ``error:`` line; model.path does not even exist (nothing was built or loaded)."""
    from megarl.train import main

    good = _write_jsonl(tmp_path / "train.jsonl", ROWS)
    bad = _write_jsonl(tmp_path / "heldout.jsonl", _without_answer(ROWS, {0}))
    common = ["model.build_tiny=false", "data.task.build=false", f"model.path={tmp_path / 'no_model'}",
              f"trainer.run_dir={tmp_path / 'run'}"]
    recipe = os.path.join(ROOT, "configs", "grpo_arith_tiny.yaml")
    with pytest.raises(SystemExit) as e:
        main(["--config", recipe, *common, f"data.train_path={bad}", f"data.heldout_path={good}"])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"error: data.train_path: {bad}:1: the row has no 'answer' field")
    proc = subprocess.run([sys.executable, "-m", "megarl.train", "--config", recipe, *common,
                           f"data.train_path={good}", f"data.heldout_path={bad}"],
                          capture_output=True, text=True, env=subprocess_env(), timeout=300)
    assert proc.returncode == 2, proc.stderr[-3000:]
    lines = proc.stderr.strip().splitlines()
    assert lines[-1].startswith(f"error: data.heldout_path: {bad}:1: the row has no 'answer' field"), proc.stderr
    assert "Traceback" not in proc.stderr and not os.path.exists(tmp_path / "run")


# ---- python -m megarl.eval on a training run's export -----------------------------------------


