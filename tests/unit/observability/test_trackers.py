"""Experiment trackers and sample logs (megarl/observability/trackers.py, megarl/observability/sample_log.py), in-process:
the config error paths (an unknown logger, a tracker that is not installed) and a failing
tracker.

The real run is the stop-and-resume run of tests/e2e/test_checkpoint_resume.py
(``test_every_way_a_run_is_stopped_checkpoints_and_resumes_the_same_run``): it logs to jsonl,
tensorboard, wandb (offline) and mlflow (a file store in the run dir) across five starts, and what
the trackers hold is read back with their own readers (tests/_trackers.py) and must be, value
for value at ``step = iteration``, what ``metrics.jsonl`` holds, in one tracker run per tracker.
"""

from __future__ import annotations

import json
import os

import pytest

from tests._dist import ROOT


# ---- config errors, in-process ------------------------------------------------------------------------


def _cfg(*overrides):
    from megarl.config import load_config

    return load_config(os.path.join(ROOT, "configs", "grpo_arith_tiny.yaml"), list(overrides))


def test_unknown_logger_and_bad_sample_keys_are_config_errors():
    from megarl.commands.run_checks import check_run
    from megarl.config import ConfigError

    for overrides, words in (
        (["trainer.loggers=[jsonl,neptune]"], ("trainer.loggers", "'neptune'", "wandb", "mlflow")),
        (["trainer.loggers=[wandb,wandb]"], ("trainer.loggers", "more than once")),
        (["trainer.wandb.mode=cloud"], ("trainer.wandb.mode", "'cloud'")),
        (["trainer.log_samples_every=-1"], ("trainer.log_samples_every", ">= 0")),
        (["trainer.log_samples_n=0"], ("trainer.log_samples_n", ">= 1")),
        (["trainer.log_samples_n=2", "trainer.log_samples_console=3"], ("trainer.log_samples_console",)),
    ):
        with pytest.raises(ConfigError) as e:
            check_run(_cfg(*overrides), 1)
        assert all(w in str(e.value) for w in words), (overrides, str(e.value))
    # jsonl alone, or omitted, is fine: metrics.jsonl is always written
    for loggers in ("[jsonl]", "[]", "[tensorboard]"):
        check_run(_cfg(f"trainer.loggers={loggers}"), 1)


@pytest.mark.parametrize("name", ["wandb", "mlflow"])
def test_a_tracker_that_is_not_installed_names_its_extra(monkeypatch, name):
    import importlib.util

    from megarl.commands.run_checks import check_run
    from megarl.config import ConfigError

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda mod, *a: None if mod == name else real(mod, *a))
    with pytest.raises(ConfigError) as e:
        check_run(_cfg(f"trainer.loggers=[jsonl,{name}]"), 1)
    assert str(e.value) == (f"trainer.loggers: names {name!r}, but the {name} package is not installed: "
                            f'pip install -e ".[{name}]"')


def test_a_failing_tracker_is_dropped_and_metrics_jsonl_goes_on(tmp_path, capsys):
    from megarl.observability.metrics import MetricsWriter
    from megarl.observability.trackers import Tracker

    class Broken(Tracker):
        """A backend whose service went away mid-run (what call_guarded must survive)."""

        name = "broken"

        def log_metrics(self, step, values, wall_time):
            raise ConnectionError("service unavailable")

    w = MetricsWriter(str(tmp_path), enabled=True, trackers=[Broken()])
    w.write(0, {"a/x": 1.5})
    w.write(1, {"a/x": 2.5})
    w.close()
    assert w.trackers == []
    assert capsys.readouterr().err.count("the broken tracker failed (ConnectionError: service unavailable)") == 1
    assert [json.loads(line)["a/x"] for line in open(tmp_path / "metrics.jsonl")] == [1.5, 2.5]


def test_sample_rows_are_the_first_samples_of_groups_spread_over_the_batch():
    from megarl.observability.sample_log import pick_rows

    groups = [f"g{i // 4}" for i in range(16)]  # 4 groups of 4, in group order
    assert pick_rows(groups, 2) == [0, 8]
    assert pick_rows(groups, 4) == [0, 4, 8, 12]
    assert pick_rows(groups, 6) == [0, 4, 8, 12, 1, 5]  # more rows than groups: then second samples
    assert sorted(pick_rows(groups, 99)) == list(range(16))
    assert pick_rows(["a", "a", "b"], 2) == [0, 2]  # uneven groups (allow_partial)


def test_a_resume_drops_the_sample_rows_of_the_iterations_that_run_again(tmp_path):
    from megarl.config import TrainerConfig
    from megarl.observability.sample_log import SampleLogger

    path = tmp_path / "samples.jsonl"
    path.write_text("".join(json.dumps({"iteration": k, "sample_id": f"s{k}"}) + "\n" for k in (0, 0, 1, 2, 3)))
    SampleLogger(TrainerConfig(), str(tmp_path), tok=None, metrics=None, enabled=True, resumed_at=2)
    assert [json.loads(line)["sample_id"] for line in path.read_text().splitlines()] == ["s0", "s0", "s1"]
    SampleLogger(TrainerConfig(), str(tmp_path), tok=None, metrics=None, enabled=True, resumed_at=None)  # fresh
    assert len(path.read_text().splitlines()) == 3
