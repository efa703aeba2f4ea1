"""Launching real ``megarl.train`` runs on the tiny model and reading what they leave behind,
shared by the end-to-end, resume and fault tests.

* the tiny recipes (``GRPO``, ``PPO``) and a run directory's ``metrics`` and sealed ``batches``;
* ``hf_response_log_probs``: an export's teacher-forced log-probs, recomputed with transformers;
* ``checkpointed_run_cmd`` / ``run_to_exit``: an ``ITERS``-iteration run that checkpoints every
  iteration, run to completion in its own session (``kill_tree`` ends what it leaves behind);
* ``uninterrupted``: such a run made once per session per configuration, and ``check_same_run``:
  a second run of it ended bitwise equal (weights, optimizer state digests, metrics).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from megarl.evaluation.estimators import pass_at_k
from tests._dist import ROOT, free_port, subprocess_env
from tests._tolerance import NET_FP32_LOGPROB, within

GRPO = os.path.join(ROOT, "configs", "grpo_arith_tiny.yaml")
PPO = os.path.join(ROOT, "configs", "ppo_arith_tiny.yaml")

#: iterations of a checkpointed run
ITERS = 5
#: metric keys that differ between two runs of the same training (wall times, resume counters)
#: keys that differ between an uninterrupted run and a resumed one by nature: wall times, and
#: how often the run was resumed (every other counter, checkpoints included, is cumulative)
#: (device-hours, MFU and a checkpoint's bytes follow the wall clock: its state holds the
#: cumulative device-hours, and a resumed process reports the checkpoints it wrote itself; the
#: objects moved between ranks carry some wall times too)
TIMING = ("time", "_s", "stage_s", "stage_share", "per_s", "seconds", "e2e/count/resumes", "hours", "mfu",
          "checkpoint_bytes", "objects_moved")


# ---- what a run leaves behind ---------------------------------------------------------------------


def metrics(run_dir):
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def batches(run_dir):
    from megarl.experience.seal import load_sealed

    root = os.path.join(run_dir, "experience")
    return [load_sealed(os.path.join(root, d)) for d in sorted(os.listdir(root))]


def hf_response_log_probs(model_dir, facts):
    """Teacher-forced log-probs of every response token with transformers, row by row: returns
    (model, (padded log-probs, per-row log-probs with their graph))."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    return model, _rows_log_probs(model, facts)


def _rows_log_probs(model, facts):
    P = facts.prompt_len
    out = torch.zeros(facts.response_ids.shape, dtype=torch.float32)
    rows = []
    for b in range(facts.batch_size):
        am = facts.attention_mask[b]
        prompt = facts.prompt_ids[b][am[:P] != 0]
        n = int(am[P:].sum())  # every real response token (an agent's environment tokens are context)
        resp = facts.response_ids[b][:n]
        tokens = torch.cat([prompt, resp])[None]
        logits = model(tokens).logits[0].float()
        lp = torch.log_softmax(logits[len(prompt) - 1:len(prompt) - 1 + n], -1).gather(-1, resp[:, None])[:, 0]
        rows.append(lp)
        out[b, :n] = lp.detach()
    return out, rows


# ---- checkpointed runs ----------------------------------------------------------------------------


def checkpointed_run_cmd(assets, run_dir, recipe, nproc, extra):
    """The command of an ``ITERS``-iteration run (run id ``resume-test``) that checkpoints every
    iteration: one process, or torchrun with ``nproc``."""
    overrides = [f"model.path={assets['model']}", "model.build_tiny=false", f"data.train_path={assets['train']}",
                 f"data.heldout_path={assets['heldout']}", "data.task.build=false",
                 f"trainer.run_dir={run_dir}", "trainer.run_id=resume-test", f"trainer.iterations={ITERS}",
                 "trainer.prompts_per_iteration=4", "rollout.n=4", "algo.num_mini_batches=2",
                 "algo.micro_batch_size=2", "algo.forward_micro_batch_size=8", "eval.n=8", "eval.every=2",
                 "trainer.checkpoint_every=1", "trainer.checkpoint_keep=2",
                 "reward.fn=tests.plugins.faulty_rewards:digit_count", *extra]
    head = [sys.executable, "-m", "megarl.train"] if nproc == 1 else [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--master-addr", "127.0.0.1",
        "--master-port", str(free_port()), "-m", "megarl.train"]
    return head + ["--config", recipe] + overrides


class Finished:
    """What ``run_to_exit`` returns: the exit status and the whole output."""

    def __init__(self, returncode, stdout, stderr):
        self.returncode, self.stdout, self.stderr = returncode, stdout, stderr


def run_to_exit(cmd, expect=0):
    """Run to completion in its own session, output to files (not pipes): a process that dies
    hard (fault injection) can leave dist_checkpointing's writer workers behind, which would
    hold pipes open; they are killed with the session.  The exit status must be ``expect``."""
    import tempfile

    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen(cmd, stdout=out, stderr=err, env=subprocess_env(), start_new_session=True)
        try:
            rc = proc.wait(timeout=900)
        finally:
            kill_tree(proc.pid)
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        out.seek(0)
        err.seek(0)
        done = Finished(rc, out.read(), err.read())
    assert done.returncode == expect, f"rc={done.returncode}\n{done.stdout[-3000:]}\n{done.stderr[-6000:]}"
    return done


def kill_tree(pid):
    """SIGKILL a process and every descendant at once (torchrun starts its workers in sessions of
    their own, so a process-group kill would leave them running)."""
    import psutil

    try:
        root = psutil.Process(pid)
        procs = root.children(recursive=True) + [root]
    except psutil.NoSuchProcess:
        return
    for p in procs:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(procs, timeout=30)


def _comparable(row, ignore=()):
    return {k: v for k, v in row.items() if not any(t in k for t in TIMING + tuple(ignore))}


def check_same_run(a_dir, b_dir, killed_at, ignore=(), resumes=1):
    """``b_dir`` ended bitwise like ``a_dir``: final weights, optimizer state digests, and every
    metric from iteration ``killed_at`` on (but wall times and the ``ignore`` keys)."""
    from safetensors.torch import load_file

    wa = load_file(os.path.join(a_dir, "export", f"iter_{ITERS}", "model.safetensors"))
    wb = load_file(os.path.join(b_dir, "export", f"iter_{ITERS}", "model.safetensors"))
    assert set(wa) == set(wb) and all(torch.equal(wa[k], wb[k]) for k in wa), "actor weights differ"
    last = f"iter_{ITERS:06d}"
    da = json.load(open(os.path.join(a_dir, "checkpoints", last, "digests.json")))
    db = json.load(open(os.path.join(b_dir, "checkpoints", last, "digests.json")))
    assert da == db, "optimizer state or weight manifests differ"
    ma, mb = metrics(a_dir), metrics(b_dir)
    assert [m["iteration"] for m in mb] == list(range(ITERS))  # rows after the checkpoint were rewritten once
    for x, y in zip(ma[killed_at:], mb[killed_at:]):
        assert _comparable(x, ignore) == _comparable(y, ignore), (
            x["iteration"], {k: (x.get(k), y.get(k)) for k in _comparable(x, ignore) if x.get(k) != y.get(k)})
    sa = json.load(open(os.path.join(b_dir, "checkpoints", last, "state.json")))
    assert sa["counters"].get("resumes") == (resumes or None) and sa["unconsumed_experience"] is None


_UNINTERRUPTED = {}


def uninterrupted(assets, tmp_path_factory, recipe, nproc, extra):
    """The run dir of an uninterrupted run of this configuration (made once per session, shared
    by the resume and fault tests that compare against it)."""
    key = (recipe, nproc, tuple(extra))
    if key not in _UNINTERRUPTED:
        d = str(tmp_path_factory.mktemp("uninterrupted") / "a")
        run_to_exit(checkpointed_run_cmd(assets, d, recipe, nproc, list(extra)))
        _UNINTERRUPTED[key] = d
    return _UNINTERRUPTED[key]


# ---- re-derivation from the record ------------------------------------------------------------------


def check_rederivation(run_dir):
    """Every saved PPO batch derives again from its sealed facts alone: at the recorded settings
    the advantages, returns and loss mask are the trainer's, bitwise (through the tool's CLI too);
    at another gamma, lambda or beta they move.  The sealed V(s_T) is what a truncated response
    bootstraps from: zeroed (the negative control), its returns change."""
    import dataclasses
    from collections import Counter

    from tools.inspect_experience import rederive

    truncated, moved, bootstrapped = 0, Counter(), 0
    for b in batches(run_dir):
        f = b.facts
        assert f.bootstrap_values is not None and f.bootstrap_values.shape == (f.batch_size,)
        assert b.derived.hyperparameters["kl_placement"] == "reward"
        _, again, _ = rederive(b)
        for name in ("advantages", "returns", "loss_mask", "shaped_rewards"):
            assert torch.equal(getattr(again, name), getattr(b.derived, name)), name
        for change in ("gamma", "lam", "kl_beta"):
            _, other, _ = rederive(b, **{change: 0.5})
            moved[change] += not torch.equal(other.returns, b.derived.returns)
        cut = ~f.terminated()
        truncated += int(cut.sum())
        if cut.any():
            zeroed = dataclasses.replace(b, facts=dataclasses.replace(f, bootstrap_values=torch.zeros_like(
                f.bootstrap_values)))
            _, wrong, _ = rederive(zeroed)
            bootstrapped += not torch.equal(wrong.returns[cut], b.derived.returns[cut])
    assert set(moved) == {"gamma", "lam", "kl_beta"} and all(moved.values()), moved
    assert truncated > 0 and bootstrapped > 0, ("no truncated response bootstrapped", truncated, bootstrapped)
    d = os.path.join(run_dir, "experience", sorted(os.listdir(os.path.join(run_dir, "experience")))[-1])
    out = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "inspect_experience.py"), d, "--rederive"],
                         capture_output=True, text=True, env=subprocess_env(), timeout=300)
    assert out.returncode == 0 and "advantages     bitwise equal" in out.stdout, out.stdout + out.stderr
    assert "returns        bitwise equal" in out.stdout
    out = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "inspect_experience.py"), d, "--rederive",
                          "gamma=0.5"], capture_output=True, text=True, env=subprocess_env(), timeout=300)
    assert out.returncode == 0 and "max |sealed - re-derived|" in out.stdout, out.stdout + out.stderr


def rewrite_checkpoint_state(ckpt_dir: str, change) -> None:
    """``change(state)`` applied to a checkpoint's state.json, its MANIFEST made to verify again:
    a checkpoint as another writer would have left it (the negative controls of exact resume)."""
    from megarl.hashing import file_sha256

    state_path = os.path.join(ckpt_dir, "state.json")
    state = json.load(open(state_path))
    change(state)
    json.dump(state, open(state_path, "w"))
    manifest = json.load(open(os.path.join(ckpt_dir, "MANIFEST.json")))
    manifest["files"]["state.json"] = file_sha256(state_path)
    json.dump(manifest, open(os.path.join(ckpt_dir, "MANIFEST.json"), "w"))


# ---- stopping a run at a known point ----------------------------------------------------------------


def latest_checkpoint(run_dir):
    p = os.path.join(run_dir, "checkpoints", "latest")
    if not os.path.isfile(p):
        return -1
    return int(open(p).read().strip().split("_")[1])


def start_and_hold(cmd, log, k, env=None):
    """Start ``cmd`` (with ``faults.hold_after_iteration`` naming ``k``) in its own session and wait
    until it holds after iteration ``k``: its metrics row written, its checkpoint not yet.  The
    stop or kill that follows lands there, whatever the machine's speed."""
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env or subprocess_env(),
                                start_new_session=True)
    marker = f"faults: holding after iteration {k} "
    t0 = time.time()
    while marker not in open(log).read():
        if proc.poll() is not None:
            raise AssertionError(f"the run ended (rc={proc.returncode}) before holding after iteration {k}: "
                                 f"{open(log).read()[-4000:]}")
        if time.time() - t0 > 600:
            kill_tree(proc.pid)
            raise AssertionError(f"no hold after iteration {k} within 600 s: {open(log).read()[-4000:]}")
        time.sleep(0.05)
    return proc


def kill_while_holding(cmd, log, k):
    """SIGKILL the run's whole process tree while it holds after iteration ``k``: checkpoint ``k``
    (written after iteration ``k - 1``) is the latest, iteration ``k``'s metrics row is already
    written and must be written again, once, by the resumed run."""
    proc = start_and_hold(cmd + [f"faults.hold_after_iteration=[{k}]"], log, k)
    kill_tree(proc.pid)
    proc.wait()


# ---- audits of what a run trained on ------------------------------------------------------------------


def token_steps(origins) -> torch.Tensor:
    """The optimizer step of the version that sampled each token, from a batch's token origins."""
    from megarl.versions import step_of_short_id

    return torch.tensor([step_of_short_id(v) for v in origins.versions])[origins.version_index.long().clamp(min=0)]


def staleness_audit(run_dir, eta):
    """Every policy token of every sealed batch: its age (trained step - generating step) is in
    [0, eta]; returns the per-iteration histograms of sample ages {age: share}."""
    from megarl.versions import step_of_short_id

    hists = {}
    for b in batches(run_dir):
        f = b.facts
        k = f.iteration
        trained = step_of_short_id(f.old_log_probs.producer.version)
        assert trained == k  # no update was skipped in these runs
        mask = f.response_mask != 0
        o = f.token_origins
        if o is None:
            steps = torch.tensor([step_of_short_id(v) for v in f.policy_version])[:, None].expand_as(mask)
        else:  # a response that spans versions: each token's own
            steps = token_steps(o)
        token_ages = torch.where(mask, trained - steps, torch.full_like(steps, -1))
        ages = token_ages[mask]
        assert int((ages > eta).sum()) == 0 and int((ages < 0).sum()) == 0, (k, ages.unique())
        per_sample = token_ages.max(dim=1).values.tolist()  # a sample is as old as its oldest token
        hists[k] = {a: per_sample.count(a) / len(per_sample) for a in set(per_sample)}
    return hists


def audit_labels(run_dir):
    """Every policy token of a response that spans versions was sampled by the version it is
    labelled with: its rollout log-prob equals the teacher-forced log-prob under that version's
    export (``export/iter_<step>``), and versions never go backwards along a response.  Returns
    how many such responses there were."""
    mixed = 0
    for b in batches(run_dir):
        f, o = b.facts, b.facts.token_origins
        if o is None:
            continue
        steps = token_steps(o)
        pol = o.policy_mask()
        for row in range(f.batch_size):
            s = steps[row][pol[row]]
            assert bool((s[1:] >= s[:-1]).all()), (f.sample_id[row], s.tolist())
            mixed += int(len(set(s.tolist())) > 1)
        for step in sorted(set(steps[pol].tolist())):
            _, (tf, _) = hf_response_log_probs(os.path.join(run_dir, "export", f"iter_{step}"), f)
            on = pol & (steps == step)
            # fp32, each version's export through transformers vs the engine's sampling pass
            err = (tf - f.rollout_log_probs.values).abs()[on]
            assert within(err.max(), NET_FP32_LOGPROB, "split_async/token_version_log_probs"), \
                (f.iteration, step, float(err.max()))
    return mixed


def check_eval_reproduces_training(run_dir, heldout, reward, tmp_path):
    """``python -m megarl.eval`` with the run's own config on ``export/iter_0`` and on the final
    export: each greedy evaluation is the training's own evaluation of that version exactly
    (accuracy, reward mean, every response, reward and status of ``<run_dir>/eval/iter_<k>.jsonl``;
    the two versions answer differently, so the command evaluates the model it is given); with
    ``--n 4`` its pass@k / maj@k are those of its own per-row results."""
    from megarl.evaluation.estimators import maj_at_k

    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        rows_m = [json.loads(x) for x in f]
    final = len(rows_m)  # the last row carries the final evaluation, of export/iter_<iterations>
    responses = {}
    for k, m_train in ((0, rows_m[0]), (final, rows_m[-1])):
        assert m_train["eval/policy_version_step"] == k
        train_rows = [json.loads(x) for x in open(os.path.join(run_dir, "eval", f"iter_{k}.jsonl"))]
        out, mout = str(tmp_path / f"eval_rows_{k}.jsonl"), str(tmp_path / f"eval_metrics_{k}.json")
        sampled = ["eval.temperature=1.0", "--n", "4", "--k", "1", "2", "4"] if k else []
        # (the scorer on threads: the same scores as training's worker processes, without their start-up)
        cmd = [sys.executable, "-m", "megarl.eval", "--model", os.path.join(run_dir, "export", f"iter_{k}"),
               "--data", heldout, "--config", os.path.join(run_dir, "config.yaml"), "--reward", reward,
               "--limit", str(m_train["eval/n"]), "--out", out, "--metrics-out", mout, "reward.isolation=thread",
               *sampled]
        proc = subprocess.run(cmd, capture_output=True, text=True, env=subprocess_env(), timeout=600)
        assert proc.returncode == 0, proc.stderr[-4000:]
        m = json.load(open(mout))
        for key in ("eval/accuracy", "eval/reward_mean", "eval/n", "eval/scored", "eval/response_len_mean"):
            assert m[key] == m_train[key], (k, key, m[key], m_train[key])
        rows = [json.loads(x) for x in open(out)]
        assert [r["prompt_id"] for r in rows] == [r["prompt_id"] for r in train_rows]
        for key in ("prompt", "responses", "rewards", "statuses", "correct", "finish_reasons"):
            assert [r[key] for r in rows] == [r[key] for r in train_rows], (k, key)
        responses[k] = [r["responses"] for r in rows]
    assert responses[0] != responses[final]
    # the sampled pass: 4 scored samples per prompt, pass@k / maj@k from the rows' own flags
    flags = [r["samples"]["correct"] for r in rows]
    assert all(len(f) == 4 and None not in f for f in flags)
    for k in (1, 2, 4):
        want = sum(pass_at_k(4, sum(f), k) for f in flags) / len(flags)
        assert m[f"eval/pass@{k}"] == pytest.approx(want, abs=1e-12)
        votes = sum(maj_at_k(r["samples"]["answers"], r["samples"]["correct"], k) for r in rows) / len(rows)
        assert m[f"eval/maj@{k}"] == pytest.approx(votes, abs=1e-12)
    assert m["eval/pass@4"] >= m["eval/pass@1"]
