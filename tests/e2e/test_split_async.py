"""Split placement and asynchronous RL, end to end on the tiny model (torchrun over gloo, the hf
engine on the rollout rank).  Checked from what the runs leave behind.

* eta = 0 in split placement is the synchronous loop: a run with 1 trainer rank + 1 rollout rank
  ends bitwise like the hybrid run on one process (every metric but wall times, every exported
  weight): the remote engine, the bridge and the command order change nothing.
* eta = 2 (2 trainer ranks, DP=2, + 1 rollout rank): every policy token of every trained sample is audited against the version that
  trained it -- zero tokens older than 2 steps, none from the future, and with the producer's
  exact admission every sample is exactly min(k, 2) steps old at iteration k (its oldest token);
  the staleness histogram the run wrote equals the audit.  With in-flight weight updates
  (``async_rl.segment_tokens``, a straggling rollout rank) some responses are finished by a
  version published mid-way: every token of theirs is labelled with the version that sampled
  it (its rollout log-prob is that version's export's, teacher-forced), versions never go
  backwards along a response.
* A rollout rank killed (SIGKILL) while it receives weights: the trainer names it lost within
  ``placement.timeout_s`` (no hang, although nothing like torchrun's agent is there to kill it),
  the run resumes from its last checkpoint, gives the in-flight prompts back to the sampler
  (counted) and completes within the bound.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time

import torch

from tests._dist import free_port, subprocess_env
from tests._tolerance import NET_FP32_LOGPROB, within
from tests._train_runs import (
    GRPO,
    ITERS,
    _comparable,
    audit_labels,
    batches,
    checkpointed_run_cmd,
    metrics,
    run_to_exit,
    staleness_audit,
    uninterrupted,
)

SPLIT = ["placement.mode=split"]
ASYNC2 = SPLIT + ["async_rl.max_staleness=2", "async_rl.correction=tis", "rollout.reuse_rollout_log_probs=false",
                  "trainer.save_experience=true", "trainer.export_every=1",
                  # in-flight weight updates, made certain: each job's first segment boundary waits
                  # for the trainer's next command (a publication, when the trainer is not waiting
                  # for this job's results)
                  "async_rl.segment_tokens=1", "faults.rollout_segment_await_s=60"]


def test_split_eta0_is_the_synchronous_loop(assets, tmp_path_factory, tmp_path):
    ref = uninterrupted(assets, tmp_path_factory, GRPO, 1, [])
    d = str(tmp_path / "split")
    run_to_exit(checkpointed_run_cmd(assets, d, GRPO, 2, SPLIT))
    ma, mb = metrics(ref), metrics(d)
    assert len(ma) == len(mb) == ITERS
    for x, y in zip(ma, mb):
        assert _comparable(x) == _comparable(y), (
            x["iteration"], {k: (x.get(k), y.get(k)) for k in _comparable(x) if x.get(k) != y.get(k)})
    from safetensors.torch import load_file

    for it in (0, ITERS):
        wa = load_file(os.path.join(ref, "export", f"iter_{it}", "model.safetensors"))
        wb = load_file(os.path.join(d, "export", f"iter_{it}", "model.safetensors"))
        assert set(wa) == set(wb) and all(torch.equal(wa[k], wb[k]) for k in wa), f"export iter_{it} differs"


def _launch_plain(cmd_tail, port, log_dir):
    """The two processes of a split world started by hand (no torchrun agent to kill a survivor):
    global rank 0 hosts the job's store."""
    procs = []
    for rank in (0, 1):
        env = dict(subprocess_env(), RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", LOCAL_WORLD_SIZE="2",
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        out = open(os.path.join(log_dir, f"rank{rank}.log"), "w")
        procs.append((subprocess.Popen([sys.executable, "-m", "megarl.train", *cmd_tail], stdout=out,
                                       stderr=subprocess.STDOUT, env=env, start_new_session=True), out))
    return procs


def test_async_eta2_bound_and_killed_rollout_rank_resumes(assets, tmp_path):
    eta = 2
    # an uninterrupted asynchronous run: the per-token audit and the histogram it wrote
    d = str(tmp_path / "async")  # 2 trainer ranks (DP=2) + 1 rollout rank
    run_to_exit(checkpointed_run_cmd(assets, d, GRPO, 3, ASYNC2))
    hists = staleness_audit(d, eta)
    assert audit_labels(d) > 0  # some responses were finished by a version published mid-way
    ms = metrics(d)
    assert sorted(hists) == list(range(ITERS))
    for k, m in enumerate(ms):
        assert hists[k] == {min(k, eta): 1.0}  # exact admission: batch k was generated on v_{k - eta}
        written = {int(key.rsplit("_", 1)[1]): v for key, v in m.items() if key.startswith("prep/staleness/samples_age_")}
        assert written == hists[k]
        assert m["prep/staleness/max_token_age"] == min(k, eta)
        # the groups by the age of the version they were generated on: all of them min(k, eta) old
        assert m[f"rollout/by_age/{min(k, eta)}/groups_accepted"] == 4, m  # trainer.prompts_per_iteration
        assert m["async/queue_depth"] == min(eta, ITERS - 1 - k)  # batches waiting after this one
        assert m["async/max_staleness"] == eta
    state = json.load(open(os.path.join(d, "checkpoints", f"iter_{ITERS - 1:06d}", "state.json")))
    assert state["in_flight_dropped"]["iterations"] == [ITERS - 1]  # submitted ahead: dropped, prompts given back
    assert len(state["sampler"]["returned"]) == 4
    state = json.load(open(os.path.join(d, "checkpoints", f"iter_{ITERS:06d}", "state.json")))
    assert state["in_flight_dropped"]["iterations"] == [] and "returned" not in state["sampler"]

    # the same run, its rollout rank killed mid-load of v3 (iteration 3's publication)
    k = str(tmp_path / "killed")
    os.makedirs(k)
    timeout_s = 10
    tail = checkpointed_run_cmd(assets, k, GRPO, 1, ASYNC2 + ["faults.kill_rollout_at_load=3",
                                                              f"placement.timeout_s={timeout_s}"])[3:]
    procs = _launch_plain(tail, free_port(), k)
    rcs, ended = [], []
    for p, out in procs:
        try:
            rcs.append(p.wait(timeout=300))
            ended.append(time.time())
        finally:
            out.close()
    log0, log1 = (open(os.path.join(k, f"rank{r}.log")).read() for r in (0, 1))
    assert rcs[1] == -9, rcs  # the drill: SIGKILL while receiving
    assert rcs[0] not in (0, None), log0[-3000:]
    # the trainer names the lost rank by its heartbeat, with the configured bound ...
    assert re.search(rf"rollout0's heartbeat has not moved for \d+s \(placement.timeout_s={timeout_s}\)", log0), \
        log0[-3000:]
    # ... and is gone within it (plus the heartbeat's cadence and its own exit) after the kill
    killed = float(re.search(r"killing rollout rank 0 while it receives \S+ \(at wall time ([0-9.]+)\)", log1)[1])
    # (the heartbeat beats once a second: its last beat may precede the kill by up to one)
    assert timeout_s - 1.5 <= ended[0] - killed <= timeout_s + 30, ended[0] - killed
    done = sorted(x for x in os.listdir(os.path.join(k, "checkpoints")) if x.startswith("iter_"))
    assert done[-1] == "iter_000003", done

    # resumed (torchrun this time): it continues from iteration 3 and finishes within the bound
    run_to_exit(checkpointed_run_cmd(assets, k, GRPO, 2, ASYNC2))
    mk = metrics(k)
    assert [m["iteration"] for m in mk] == list(range(ITERS))
    assert mk[-1]["e2e/count/in_flight_prompts_returned"] == 8  # iterations 3 and 4, given back by the checkpoint
    assert mk[-1]["e2e/count/resumes"] == 1
    hk = staleness_audit(k, eta)
    assert hk[3] == {0: 1.0}  # after the resume: generated on the resumed version
    assert hk[4] == {1: 1.0}


def test_async_eta1_proximal_log_probs_teacher_forced_by_the_rollout_engine(assets, tmp_path):
    """``async_rl.proximal_log_probs=engine`` (1 trainer rank + 1 rollout rank, eta = 1): the old
    (proximal) log-probs of batch k are the rollout engine's, teacher-forced on v_k, the version
    trained from -- recorded as role ``engine`` on v_k, equal to v_k's export teacher-forced
    through transformers, within the parity tolerance of the actor's own forward (checked every
    iteration here) -- and every policy token is within the bound.  Negative control: a parity
    tolerance below the gap iteration 0 measured stops that run, naming the key."""
    from megarl.versions import step_of_short_id
    from tests._train_runs import hf_response_log_probs

    eta = 1
    extra = SPLIT + [f"async_rl.max_staleness={eta}", "async_rl.correction=tis", "rollout.reuse_rollout_log_probs=false",
                     "trainer.save_experience=true", "trainer.export_every=1", "async_rl.proximal_log_probs=engine",
                     "rollout.log_prob_parity_every=1"]
    d = str(tmp_path / "engine_proximal")
    run_to_exit(checkpointed_run_cmd(assets, d, GRPO, 2, extra))
    hists = staleness_audit(d, eta)
    assert [hists[k] for k in range(ITERS)] == [{min(k, eta): 1.0} for k in range(ITERS)]
    for k, b in enumerate(batches(d)):
        f = b.facts
        old = f.old_log_probs
        assert old.producer.role == "engine" and step_of_short_id(old.producer.version) == k
        _, (tf, _) = hf_response_log_probs(os.path.join(d, "export", f"iter_{k}"), f)
        # fp32: v_k's export through transformers vs the engine's forward of the same weights
        err = (tf - old.values).abs()[f.response_mask.bool()]
        assert within(err.max(), NET_FP32_LOGPROB, "split_async/engine_proximal"), (k, float(err.max()))
    ms = metrics(d)
    gaps = [m["prep/proximal_engine_actor_max_abs_err"] for m in ms]
    assert all(0 < g <= 1e-3 for g in gaps), gaps  # rollout.log_prob_parity_tol's default
    assert all(m["prep/proximal_engine_s"] > 0 for m in ms)

    bad = str(tmp_path / "parity_fails")
    done = run_to_exit(checkpointed_run_cmd(assets, bad, GRPO, 2, extra + [f"rollout.log_prob_parity_tol={gaps[0] / 2}"]),
                       expect=1)
    assert "async_rl.proximal_log_probs=engine: measured max |engine - actor| log-prob" in done.stdout + done.stderr
    assert not os.path.exists(os.path.join(bad, "checkpoints", "iter_000001"))
