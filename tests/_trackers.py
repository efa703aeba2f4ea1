"""Reading back what the experiment trackers wrote (wandb's offline records, mlflow's file store,
TensorBoard's events) and checking it against ``metrics.jsonl`` and the sealed experience, for
a run that was stopped and resumed any number of times (tests/e2e/test_checkpoint_resume.py)."""

from __future__ import annotations

import glob
import json
import os
import struct

import pytest
import torch

from tests._tolerance import formula_tol
from tests._train_runs import ITERS, batches, metrics

#: every tracker megarl has, as the stop-and-resume test runs them
LOGGERS = "trainer.loggers=[jsonl,tensorboard,wandb,mlflow]"


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


def check_trackers(run_dir, wandb_dir, tmp_path, tokenizer_dir, first_trackers, starts, samples_per_iteration):
    """The trackers hold, value for value at ``step = iteration``, what ``metrics.jsonl`` holds,
    in one tracker run per tracker across every stop (``starts``: the iteration each start of the
    run began at, ascending); ``samples.jsonl`` decodes the sealed experience of its iterations,
    and the same sample tables reached mlflow and wandb."""
    import numpy as np
    from mlflow.tracking import MlflowClient

    from megarl.data.tokenizer import TokenizerContract
    from megarl.observability.trackers import mlflow_key

    assert json.load(open(os.path.join(run_dir, "trackers.json"))) == first_trackers  # the same tracker runs
    rows = metrics(run_dir)
    assert [r["iteration"] for r in rows] == list(range(ITERS))
    info = json.load(open(os.path.join(run_dir, "run.json")))

    # wandb: one run id in every offline segment, each segment the steps of its start
    runs = wandb_runs(wandb_dir)
    assert [r[0] for r in runs] == [first_trackers["wandb"]["id"]] * len(starts)
    bounds = list(starts) + [ITERS]
    assert [sorted(r[2]) for r in runs] == [list(range(a, b)) for a, b in zip(bounds, bounds[1:])]
    config = runs[-1][1]
    assert config["megarl_run_id"] == "resume-test" and config["config_hash"] == info["config_hash"]
    assert config["algo"]["name"] == "grpo" and config["trainer"]["iterations"] == ITERS
    history = {k: v for r in runs for k, v in r[2].items()}
    for row in rows:
        got = history[row["iteration"]]
        want = numeric(row)
        assert {k: got.get(k) for k in want} == want, row["iteration"]
        assert got["samples/_type"] == "table-file" and got["samples/nrows"] == samples_per_iteration

    # mlflow: one run, every metric's history one value per iteration, equal to metrics.jsonl
    os.environ["MLFLOW_ALLOW_FILE_STORE"] = "true"  # mlflow 3 reads a file store only with it
    client = MlflowClient("file:" + os.path.join(run_dir, "mlruns"))
    run = client.get_run(first_trackers["mlflow"]["id"])
    assert run.info.status == "FINISHED" and run.info.run_name == "resume-test"
    assert run.data.tags["megarl.run_id"] == "resume-test"
    assert run.data.tags["megarl.config_hash"] == info["config_hash"]
    assert run.data.params["algo.name"] == "grpo" and run.data.params["rollout.n"] == "4"
    assert {a.path for a in client.list_artifacts(run.info.run_id)} >= {"config.yaml", "samples"}
    for key in set().union(*(numeric(r) for r in rows)):
        hist = sorted((m.step, m.value) for m in client.get_metric_history(run.info.run_id, mlflow_key(key)))
        want = [(r["iteration"], float(r[key])) for r in rows if key in numeric(r)]
        assert hist == want, key

    # tensorboard (float32 values): each iteration once, across one event file per start
    tb = tensorboard_scalars(run_dir)
    for key in ("rollout/reward_mean", "update/kl_ref", "e2e/policy_version_step"):
        assert tb[key] == [(r["iteration"], float(np.float32(r[key]))) for r in rows], key

    # samples.jsonl: the same number of rows per iteration, each the sealed experience decoded
    samples = [json.loads(line) for line in open(os.path.join(run_dir, "samples.jsonl"))]
    n = samples_per_iteration
    assert [s["iteration"] for s in samples] == [k for k in range(ITERS) for _ in range(n)]
    tok = TokenizerContract.from_pretrained(tokenizer_dir)
    sealed = batches(run_dir)
    for s in samples:
        f, der = sealed[s["iteration"]].facts, sealed[s["iteration"]].derived
        b = f.sample_id.index(s["sample_id"])
        length = int(f.response_mask[b].sum())
        prompt = f.prompt_ids[b][f.attention_mask[b, :f.prompt_len] != 0].tolist()
        assert s["prompt"] == tok.decode(prompt, skip_special_tokens=True)
        assert s["response"] == tok.decode(f.response_ids[b, :length].tolist(), skip_special_tokens=True)
        assert s["response_tokens"] == length and s["reward"] == f.rewards[b].total
        assert s["reward_components"] == dict(f.rewards[b].components) and s["reward_status"] == "ok"
        assert s["finish_reason"] == f.finish_reason[b].value and s["policy_version"] == f.policy_version[b]
        # GRPO: one per sample, the float32 mean of <= 6 copies of it (<= 7 operations, |A| <= 3)
        assert s["advantage"] == pytest.approx(float(der.advantages[b, 0]),
                                               abs=formula_tol(torch.float32, ops=7, scale=18.0))
    # the first sample of groups 0, 1, 2 of 4 (n=3: groups i * 4 // 3)
    assert [s["sample_id"].split("/", 2)[2] for s in samples[:3]] == ["r0/p000/c00", "r0/p001/c00", "r0/p002/c00"]
    # the same table in mlflow and wandb
    table = client.download_artifacts(run.info.run_id, f"samples/iter_{ITERS - 1:06d}.json", str(tmp_path))
    mt = json.load(open(table))
    assert [dict(zip(mt["columns"], r))["response"] for r in mt["data"]] == [s["response"] for s in samples[-n:]]
    wt_path = os.path.join(sorted(glob.glob(os.path.join(wandb_dir, "wandb", "offline-run-*")))[-1], "files",
                           history[ITERS - 1]["samples/path"])
    wt = json.load(open(wt_path))
    assert [dict(zip(wt["columns"], r))["reward"] for r in wt["data"]] == [s["reward"] for s in samples[-n:]]
