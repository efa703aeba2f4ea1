"""Experiment trackers and sample logs (megarl/trackers.py, megarl/sample_log.py).

One real run on the tiny model, in two invocations: logging to jsonl, tensorboard, wandb
(offline) and mlflow (a file store in the run dir), it checkpoints every iteration and is asked
to stop (``<run_dir>/STOP``) after its first checkpoint; the same command resumes it and
finishes.  What the trackers hold is read back with their own readers (wandb's protobuf records
from its offline ``.wandb`` files, mlflow's ``MlflowClient``, TensorBoard's event reader) and must
be, value for value at ``step = iteration``, what ``metrics.jsonl`` holds, in one tracker run per
tracker across the stop.  ``samples.jsonl`` must decode the sealed experience of its iterations.

The config error paths (an unknown logger, a tracker that is not installed) run in-process.
"""

from __future__ import annotations

import glob
import json
import os
import struct
import subprocess
import time

import pytest

from tests._dist import ROOT, subprocess_env
from tests._train_runs import GRPO, ITERS, batches, checkpointed_run_cmd, metrics, run_to_exit

LOGGERS = "trainer.loggers=[jsonl,tensorboard,wandb,mlflow]"


# ---- reading back what the trackers wrote ---------------------------------------------------------


def wandb_records(path):
    """The protobuf records of a wandb ``.wandb`` file.  The file is a LevelDB log (a 7-byte
    ``:W&B`` header, then 32 KiB blocks of chunks: crc32c, length, type full/first/middle/last);
    wandb >= 0.19 ships no Python reader for it, only the record schema (``wandb.proto``).  A run
    killed hard may end in a torn chunk, which is where reading stops."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = open(path, "rb").read()
    assert data[:4] == b":W&B", path
    block, head, pos, buf = 32768, 7, 7, b""
    while pos + head <= len(data):
        left = block - pos % block
        if left < head:  # the block's trailer: too short for a chunk header
            pos += left
            continue
        _crc, n, kind = struct.unpack("<IHB", data[pos:pos + head])
        if kind == 0 or pos + head + n > len(data):
            break
        chunk, pos = data[pos + head:pos + head + n], pos + head + n
        buf = chunk if kind in (1, 2) else buf + chunk
        if kind in (1, 4):
            rec = pb.Record()
            rec.ParseFromString(buf)
            yield rec


def wandb_runs(wandb_dir):
    """Per offline run directory, in the order they were made: (run id, config, {step: {key: value}})."""
    out = []
    for f in sorted(glob.glob(os.path.join(wandb_dir, "wandb", "offline-run-*", "run-*.wandb"))):
        run_id, config, history = None, {}, {}
        for rec in wandb_records(f):
            kind = rec.WhichOneof("record_type")
            if kind == "run":
                run_id = rec.run.run_id
                config.update({u.key: json.loads(u.value_json) for u in rec.run.config.update})
            elif kind == "history":
                row = {(i.key or "/".join(i.nested_key)): json.loads(i.value_json) for i in rec.history.item}
                history[row["_step"]] = row
        out.append((run_id, config, history))
    return out


def numeric(row):
    """The values a tracker gets from a metrics.jsonl row."""
    return {k: v for k, v in row.items() if k not in ("iteration", "time") and isinstance(v, (int, float))}


def tensorboard_scalars(run_dir):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(os.path.join(run_dir, "tensorboard"), size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


# ---- the run ----------------------------------------------------------------------------------------


def _latest(run_dir):
    path = os.path.join(run_dir, "checkpoints", "latest")
    return int(open(path).read().strip().rsplit("_", 1)[-1]) if os.path.isfile(path) else -1


def stop_after_a_checkpoint(cmd, run_dir, log):
    """Start ``cmd``; once it has a checkpoint, ask it to stop (``<run_dir>/STOP``, what
    launch/multinode.sh writes on Slurm's warning): it checkpoints at the next commit and exits 0.
    Returns the iteration it stopped at."""
    from tests._train_runs import kill_tree

    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=subprocess_env(),
                                start_new_session=True)
    try:
        t0 = time.time()
        while _latest(run_dir) < 1:
            assert proc.poll() is None and time.time() - t0 < 600, open(log).read()[-3000:]
            time.sleep(0.02)
        open(os.path.join(run_dir, "STOP"), "w").close()
        assert proc.wait(timeout=600) == 0, open(log).read()[-3000:]
    finally:
        kill_tree(proc.pid)
    text = open(log).read()
    assert "on a signal" in text, text[-3000:]
    return _latest(run_dir), text


def test_trackers_match_metrics_jsonl_and_continue_the_same_run_after_a_stop(assets, tmp_path, monkeypatch):
    import numpy as np
    from mlflow.tracking import MlflowClient

    from megarl.trackers import mlflow_key

    d = str(tmp_path / "run")
    wandb_dir = str(tmp_path / "wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", wandb_dir)
    os.makedirs(wandb_dir)
    cmd = checkpointed_run_cmd(assets, d, GRPO, 1, [
        LOGGERS, "trainer.log_samples_every=1", "trainer.log_samples_n=3", "trainer.log_samples_console=1",
        "trainer.save_experience=true"])
    stopped_at, text = stop_after_a_checkpoint(cmd, d, str(tmp_path / "first.log"))
    assert 1 <= stopped_at < ITERS
    assert "sample it0 p000/c00 | reward" in text, text[-2000:]
    first = json.load(open(os.path.join(d, "trackers.json")))
    assert first["run_id"] == "resume-test" and set(first) == {"run_id", "wandb", "mlflow"}
    out = run_to_exit(cmd)
    assert "resumed from" in out.stdout, out.stdout[-2000:]
    assert json.load(open(os.path.join(d, "trackers.json"))) == first  # the same tracker runs, continued

    rows = metrics(d)
    assert [r["iteration"] for r in rows] == list(range(ITERS))
    info = json.load(open(os.path.join(d, "run.json")))

    # wandb: one run id in both offline segments, the steps before the stop, then the rest
    runs = wandb_runs(wandb_dir)
    assert [r[0] for r in runs] == [first["wandb"]["id"]] * 2
    assert [sorted(r[2]) for r in runs] == [list(range(stopped_at)), list(range(stopped_at, ITERS))]
    config = runs[1][1]
    assert config["megarl_run_id"] == "resume-test" and config["config_hash"] == info["config_hash"]
    assert config["algo"]["name"] == "grpo" and config["trainer"]["iterations"] == ITERS
    history = {**runs[0][2], **runs[1][2]}
    for row in rows:
        got = history[row["iteration"]]
        want = numeric(row)
        assert {k: got.get(k) for k in want} == want, row["iteration"]
        assert got["samples/_type"] == "table-file" and got["samples/nrows"] == 3

    # mlflow: one run, every metric's history one value per iteration, equal to metrics.jsonl
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # mlflow 3 reads a file store only with it
    client = MlflowClient("file:" + os.path.join(d, "mlruns"))
    run = client.get_run(first["mlflow"]["id"])
    assert run.info.status == "FINISHED" and run.info.run_name == "resume-test"
    assert run.data.tags["megarl.run_id"] == "resume-test"
    assert run.data.tags["megarl.config_hash"] == info["config_hash"]
    assert run.data.params["algo.name"] == "grpo" and run.data.params["rollout.n"] == "4"
    assert {a.path for a in client.list_artifacts(run.info.run_id)} >= {"config.yaml", "samples"}
    keys = set().union(*(numeric(r) for r in rows))
    for key in keys:
        hist = sorted((m.step, m.value) for m in client.get_metric_history(run.info.run_id, mlflow_key(key)))
        want = [(r["iteration"], float(r[key])) for r in rows if key in numeric(r)]
        assert hist == want, key

    # tensorboard (float32 values): two event files, each iteration once
    tb = tensorboard_scalars(d)
    for key in ("rollout/reward_mean", "update/kl_ref", "e2e/policy_version_step"):
        assert tb[key] == [(r["iteration"], float(np.float32(r[key]))) for r in rows], key

    # samples.jsonl: 3 rows per iteration, each the sealed experience of its iteration decoded
    from megarl.data.tokenizer import TokenizerContract

    samples = [json.loads(line) for line in open(os.path.join(d, "samples.jsonl"))]
    assert [s["iteration"] for s in samples] == [k for k in range(ITERS) for _ in range(3)]
    tok = TokenizerContract.from_pretrained(assets["model"])
    sealed = batches(d)
    for s in samples:
        f, der = sealed[s["iteration"]].facts, sealed[s["iteration"]].derived
        b = f.sample_id.index(s["sample_id"])
        n = int(f.response_mask[b].sum())
        prompt = f.prompt_ids[b][f.attention_mask[b, :f.prompt_len] != 0].tolist()
        assert s["prompt"] == tok.decode(prompt, skip_special_tokens=True)
        assert s["response"] == tok.decode(f.response_ids[b, :n].tolist(), skip_special_tokens=True)
        assert s["response_tokens"] == n and s["reward"] == f.rewards[b].total
        assert s["reward_components"] == dict(f.rewards[b].components) and s["reward_status"] == "ok"
        assert s["finish_reason"] == f.finish_reason[b].value and s["policy_version"] == f.policy_version[b]
        assert s["advantage"] == pytest.approx(float(der.advantages[b, 0]), abs=1e-6)  # GRPO: one per sample
    # the first sample of groups 0, 1, 2 of 4 (n=3: groups i * 4 // 3)
    assert [s["sample_id"].split("/", 2)[2] for s in samples[:3]] == ["r0/p000/c00", "r0/p001/c00", "r0/p002/c00"]
    # the same table in mlflow and wandb
    table = client.download_artifacts(run.info.run_id, f"samples/iter_{ITERS - 1:06d}.json", str(tmp_path))
    mt = json.load(open(table))
    assert [dict(zip(mt["columns"], r))["response"] for r in mt["data"]] == [s["response"] for s in samples[-3:]]
    wt_path = os.path.join(sorted(glob.glob(os.path.join(wandb_dir, "wandb", "offline-run-*")))[-1], "files",
                           history[ITERS - 1]["samples/path"])
    wt = json.load(open(wt_path))
    assert [dict(zip(wt["columns"], r))["reward"] for r in wt["data"]] == [s["reward"] for s in samples[-3:]]


# ---- config errors, in-process ------------------------------------------------------------------------


def _cfg(*overrides):
    from megarl.config import load_config

    return load_config(os.path.join(ROOT, "configs", "grpo_arith_tiny.yaml"), list(overrides))


def test_unknown_logger_and_bad_sample_keys_are_config_errors():
    from megarl.config import ConfigError, validate

    for overrides, words in (
        (["trainer.loggers=[jsonl,neptune]"], ("trainer.loggers", "'neptune'", "wandb", "mlflow")),
        (["trainer.loggers=[wandb,wandb]"], ("trainer.loggers", "more than once")),
        (["trainer.wandb.mode=cloud"], ("trainer.wandb.mode", "'cloud'")),
        (["trainer.log_samples_every=-1"], ("trainer.log_samples_every", ">= 0")),
        (["trainer.log_samples_n=0"], ("trainer.log_samples_n", ">= 1")),
        (["trainer.log_samples_n=2", "trainer.log_samples_console=3"], ("trainer.log_samples_console",)),
    ):
        with pytest.raises(ConfigError) as e:
            validate(_cfg(*overrides), 1)
        assert all(w in str(e.value) for w in words), (overrides, str(e.value))
    # jsonl alone, or omitted, is fine: metrics.jsonl is always written
    for loggers in ("[jsonl]", "[]", "[tensorboard]"):
        validate(_cfg(f"trainer.loggers={loggers}"), 1)


@pytest.mark.parametrize("name", ["wandb", "mlflow"])
def test_a_tracker_that_is_not_installed_names_its_extra(monkeypatch, name):
    import importlib.util

    from megarl.config import ConfigError, validate

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda mod, *a: None if mod == name else real(mod, *a))
    with pytest.raises(ConfigError) as e:
        validate(_cfg(f"trainer.loggers=[jsonl,{name}]"), 1)
    assert str(e.value) == (f"trainer.loggers: names {name!r}, but the {name} package is not installed: "
                            f'pip install -e ".[{name}]"')


def test_a_failing_tracker_is_dropped_and_metrics_jsonl_goes_on(tmp_path, capsys):
    from megarl.metrics import MetricsWriter
    from megarl.trackers import Tracker

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
    from megarl.sample_log import pick_rows

    groups = [f"g{i // 4}" for i in range(16)]  # 4 groups of 4, in group order
    assert pick_rows(groups, 2) == [0, 8]
    assert pick_rows(groups, 4) == [0, 4, 8, 12]
    assert pick_rows(groups, 6) == [0, 4, 8, 12, 1, 5]  # more rows than groups: then second samples
    assert sorted(pick_rows(groups, 99)) == list(range(16))
    assert pick_rows(["a", "a", "b"], 2) == [0, 2]  # uneven groups (allow_partial)


def test_a_resume_drops_the_sample_rows_of_the_iterations_that_run_again(tmp_path):
    from megarl.config import TrainerConfig
    from megarl.sample_log import SampleLogger

    path = tmp_path / "samples.jsonl"
    path.write_text("".join(json.dumps({"iteration": k, "sample_id": f"s{k}"}) + "\n" for k in (0, 0, 1, 2, 3)))
    SampleLogger(TrainerConfig(), str(tmp_path), tok=None, metrics=None, enabled=True, resumed_at=2)
    assert [json.loads(line)["sample_id"] for line in path.read_text().splitlines()] == ["s0", "s0", "s1"]
    SampleLogger(TrainerConfig(), str(tmp_path), tok=None, metrics=None, enabled=True, resumed_at=None)  # fresh
    assert len(path.read_text().splitlines()) == 3
