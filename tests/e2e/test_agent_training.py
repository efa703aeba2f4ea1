"""megarl.train with agent rollouts on the calculator, end to end under torchrun: DP=2, and TP=2
with a calculator service that fails on some rows.  Checked from what the runs leave behind.

The tiny model here is warm-started by ``megarl.tinymodel`` with calculator tool-use
demonstrations (``--task calculator``), so its sampled trajectories do call the tool: environment
tokens are present in the sealed experience and every rule about them is exercised.

Proven per run, on every sealed sample of every iteration:
* zero environment tokens with loss mask 1 (response mask and the estimator's loss mask), zero
  rollout log-prob on them, no policy version on them;
* every policy token carries the version the iteration generated on (and the sample's version is
  its last token's);
* the actor's teacher-forced log-probs over the whole trajectory (environment tokens as context)
  equal the engine's per-turn log-probs: the trajectory is exactly the token list the engine
  continued from, turn after turn (no re-tokenization: any re-encoded turn would shift them);
* groups are whole trajectories, complete (G per group), on one version;
and a failing environment (raise / hang / garbage) is a status, counted and quarantined, its
group dropped (the group rule), never a reward.
"""

import json
import os
import subprocess
import sys

import torch

from tests._agent_runs import B, CALC, G, calc_assets, check_agent_run  # noqa: F401 - a fixture
from tests._dist import free_port, subprocess_env
from tests._train_runs import batches, metrics
from tests.plugins.faulty_envs import FlakyCalculator


def run_agent_train(assets, run_dir, nproc, extra=()):
    overrides = [f"model.path={assets['model']}", "model.build_tiny=false", f"data.train_path={assets['train']}",
                 f"data.heldout_path={assets['heldout']}", "data.task.build=false", f"trainer.run_dir={run_dir}",
                 "trainer.iterations=2", f"trainer.prompts_per_iteration={B}", f"rollout.n={G}", "eval.n=8",
                 "eval.every=1", "eval.save_results=true", "trainer.save_experience=true", "algo.micro_batch_size=2",
                 "algo.forward_micro_batch_size=4", "rollout.reuse_rollout_log_probs=false", *extra]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--master-addr",
           "127.0.0.1", "--master-port", str(free_port()), "-m", "megarl.train", "--config", CALC, *overrides]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=subprocess_env(), timeout=900)
    assert proc.returncode == 0, f"{' '.join(cmd)}\n--- stdout ---\n{proc.stdout[-5000:]}\n--- stderr ---\n{proc.stderr[-8000:]}"
    return proc


def test_calculator_agent_torchrun_dp2(calc_assets, tmp_path):
    """With ``algo.advantage=grpo_process`` the environment's reward of each turn (here 0.5 for a
    well-formed tool call on its own turn, ``call_reward``, and 1 for a right answer) is a step: every
    sealed advantage equals DeepSeekMath's process supervision computed here by hand from the
    records' turn spans (pooled over the group's turns, each token the sum of the normalised
    rewards of the turns at or after it), which an estimator reading only the total cannot give:
    the tool call's tokens get a different advantage than the answer's."""
    import math

    from tests._tolerance import formula_tol

    run_dir = str(tmp_path / "calc_dp2")
    run_agent_train(calc_assets, run_dir, 2, ["algo.advantage=grpo_process",
                                             "rollout.agent.env_args={tool_role: user, call_reward: 0.5}"])
    env_tokens, rate = check_agent_run(run_dir)
    assert env_tokens > 0 and rate > 0, (env_tokens, rate)  # the tool was called: the audit had something to audit
    turn_credit = 0
    for b in batches(run_dir):
        f, adv = b.facts, b.derived.advantages
        pooled = {}
        for g, r in zip(f.group_id, f.rewards, strict=True):
            pooled.setdefault(g, []).extend([x.value for x in r.applies_to] if r.applies_to else [r.total])
        for i, (g, r) in enumerate(zip(f.group_id, f.rewards, strict=True)):
            vals = pooled[g]
            mean = sum(vals) / len(vals)
            std = math.sqrt(sum((v - mean) ** 2 for v in vals) / (len(vals) - 1)) if len(vals) > 1 else 0.0
            # a record without spans (no turn answered) is one step, its total, on its last action
            parts = [(x.last, x.value) for x in r.applies_to] if r.applies_to else \
                [(int(f.response_mask[i].nonzero().max()), r.total)]
            norm = [(last, 0.0 if std <= 1e-6 else (v - mean) / std) for last, v in parts]
            for t in f.response_mask[i].nonzero().flatten().tolist():
                want = sum(a for last, a in norm if last >= t)
                got = float(adv[i, t])
                assert abs(got - want) <= formula_tol(torch.float32, 1, max(1.0, abs(want))), (f.sample_id[i], t, got, want)
            firsts = {float(adv[i, x.first]) for x in r.applies_to or ()}
            turn_credit += len(firsts) > 1
    assert turn_credit > 0  # some trajectory's turns were credited differently


def test_calculator_agent_split_async(calc_assets, tmp_path):
    """Split placement with eta = 1: the sessions run on the rollout rank (engine and
    environment there), batch k + 1's trajectories are generated while batch k trains, and the
    same audit holds with every trajectory one step old (after the first)."""
    run_dir = str(tmp_path / "calc_async")
    run_agent_train(calc_assets, run_dir, 2, ["placement.mode=split", "async_rl.max_staleness=1",
                                             "async_rl.correction=tis"])
    env_tokens, rate = check_agent_run(run_dir, eta=1)
    assert env_tokens > 0 and rate > 0, (env_tokens, rate)
    assert all("prep/offpolicy/ess" in m for m in metrics(run_dir))


def test_calculator_agent_split_inflight_updates_between_turns(calc_assets, tmp_path):
    """Split placement, eta = 2, in-flight weight updates inside sessions (async_rl.segment_tokens
    > 0: a version published while the rollout rank runs sessions is applied between turns; a
    rollout rank that waits for the trainer's next command at each job's first boundary makes that
    certain): every policy token of every trained trajectory is
    audited against the version that trained it (none older than 2 steps, none from the future;
    a trajectory is as old as its oldest policy token), and every policy token of a trajectory
    that spans versions was sampled by the version it is labelled with (its rollout log-prob is
    that version's export's, teacher-forced over the whole trajectory, environment tokens as
    context)."""
    from tests._train_runs import audit_labels, staleness_audit

    eta, iterations = 2, 4
    run_dir = str(tmp_path / "calc_inflight")
    run_agent_train(calc_assets, run_dir, 2, ["placement.mode=split", f"async_rl.max_staleness={eta}",
                                             "async_rl.correction=tis", "async_rl.segment_tokens=1",
                                             "faults.rollout_segment_await_s=60", "trainer.export_every=1",
                                             f"trainer.iterations={iterations}"])
    env_tokens, rate = check_agent_run(run_dir, eta=eta, inflight=True, iterations=iterations)
    assert env_tokens > 0 and rate > 0, (env_tokens, rate)
    hists = staleness_audit(run_dir, eta)
    for k, m in enumerate(metrics(run_dir)):
        written = {int(key.rsplit("_", 1)[1]): v for key, v in m.items() if key.startswith("prep/staleness/samples_age_")}
        assert written == hists[k]
    # some sessions took a newer version between two of their turns (without the wait for the
    # activation after an in-flight load, the next turn ran on the old version: 0 here)
    assert audit_labels(run_dir) > 0
    assert sum(m["rollout/mixed_version_share"] for m in metrics(run_dir)) > 0


def test_calculator_agent_torchrun_tp2_with_a_failing_service(calc_assets, tmp_path):
    """A calculator service that raises, hangs past rollout.agent.step_timeout_s or returns
    garbage on some rows: those candidates are statuses (counted, quarantined), their groups
    dropped by algo.partial_groups=drop, and no such sample reaches the sealed experience."""
    run_dir = str(tmp_path / "calc_tp2")
    # a hung step sleeps 60 s, far past the 3 s limit; a healthy calculator step takes
    # microseconds, so the limit never fires on one, however busy the machine
    run_agent_train(calc_assets, run_dir, 2, ["parallel.tp=2", "rollout.agent.env=tests.plugins.faulty_envs:FlakyCalculator",
                                             "rollout.agent.env_args={tool_role: user, hang_s: 60.0}",
                                             "rollout.agent.step_timeout_s=3.0", "reward.on_failure=quarantine"])
    env_tokens, _ = check_agent_run(run_dir)
    ms = metrics(run_dir)
    answers = {}
    for line in open(os.path.join(calc_assets["train"])):
        row = json.loads(line)
        answers[row["id"]] = row["answer"]
    quarantined = [json.loads(x) for x in open(os.path.join(run_dir, "quarantine.jsonl"))]
    # every quarantined training episode is one of a failing row's (the eval's rows are not in the
    # train file) ...
    trained_q = [q for q in quarantined if "/eval" not in q["sample_id"]]
    assert trained_q and all(FlakyCalculator.failure(answers[q["prompt_id"]]) is not None for q in trained_q)
    # ... and a failing row reaches training only if none of its candidates ever stepped it
    failing = [(b.facts, i) for b in batches(run_dir) for i, p in enumerate(b.facts.prompt_id)
               if FlakyCalculator.failure(answers[p]) is not None]
    assert all(f.finish_reason[i].value == "length" and not bool(f.token_origins.environment_mask()[i].any())
               for f, i in failing), [(f.sample_id[i], f.finish_reason[i].value) for f, i in failing]
    statuses = {q["reward"]["status"] for q in quarantined}
    assert quarantined and statuses <= {"error", "timeout", "invalid"}
    assert all(q["reward"]["total"] is None and q["reward"]["error"].startswith("environment: ") for q in quarantined)
    last = ms[-1]
    # the last metrics row counts up to its iteration: the final evaluation (eval2) comes after it
    assert last["e2e/count/groups_dropped"] > 0
    assert last["e2e/count/reward_failures"] == sum("/eval2/" not in q["sample_id"] for q in quarantined)
    # the held-out evaluation with the environment: a failed episode is unscored, never wrong
    failed_eval0 = sum("/eval0/" in q["sample_id"] for q in quarantined)
    assert failed_eval0 > 0 and ms[0]["eval/scored"] == 8 - failed_eval0
    # the rollout metrics count the failures of dropped groups too; the trained ones have none
    failures = sum(m[f"rollout/agent/{key}"] for m in ms for key in ("env_errors", "env_timeouts", "env_invalid"))
    assert failures > 0 and all(m["rollout/agent/accepted/env_errors"] == 0 for m in ms)


def test_eval_with_the_environment_and_without(calc_assets, tmp_path):
    """``python -m megarl.eval --env calculator``: greedy sessions with the tool available, scored
    by the environment, per-row turns and tool calls; the same model and rows with ``--reward``
    on the agent recipe answer single-turn (the no-tool baseline).  Both through the code of
    training's held-out evaluation."""
    from megarl.commands.evaluate import main

    out = tmp_path / "with_tool.jsonl"
    common = ["--model", calc_assets["model"], "--data", calc_assets["heldout"], "--config", CALC]
    m = main(common + ["--env", "calculator", "--out", str(out), "rollout.agent.env_args.tool_role=user"])
    rows = [json.loads(x) for x in out.read_text().splitlines()]
    assert len(rows) == 8 and m["eval/n"] == 8
    calls = [r["tool_calls"][0] for r in rows]
    assert m["eval/tool_call_rate"] == sum(c > 0 for c in calls) / 8
    # an answer without a call is one turn; a call is answered by the tool and followed by a turn
    assert all(r["turns"][0] == 1 for r, c in zip(rows, calls) if not c and r["finish_reasons"][0] == "environment")
    assert all(r["turns"][0] >= 2 for r, c in zip(rows, calls) if c and r["finish_reasons"][0] == "environment")
    assert all(set(r["components"][0]) <= {"correct"} for r in rows)
    plain = main(common + ["--reward", "arithmetic", "--out", str(tmp_path / "no_tool.jsonl")])
    assert "eval/tool_call_rate" not in plain and plain["eval/n"] == 8
    no_tool = [json.loads(x) for x in (tmp_path / "no_tool.jsonl").read_text().splitlines()]
    assert all("turns" not in r for r in no_tool)
