"""Training-position checkpoints: exact resume after a real kill, a crash mid-checkpoint, a
tampered file, and a resume that would change the contract (refused, naming the field)."""

import json
import os
import shlex
import signal
import subprocess
import sys
import time

import pytest

from tests._dist import subprocess_env
from tests._train_runs import (
    GRPO,
    ITERS,
    PPO,
    batches,
    check_same_run,
    checkpointed_run_cmd,
    kill_tree,
    run_to_exit,
    uninterrupted,
)


def _latest(run_dir):
    p = os.path.join(run_dir, "checkpoints", "latest")
    if not os.path.isfile(p):
        return -1
    return int(open(p).read().strip().split("_")[1])


def _kill_after_checkpoint(cmd, run_dir, at_least):
    """Start the run, SIGKILL its whole process group as soon as checkpoint ``at_least`` is published."""
    import tempfile

    err = tempfile.TemporaryFile("w+")
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=err, env=subprocess_env(), start_new_session=True)
    t0 = time.time()
    while _latest(run_dir) < at_least:
        if proc.poll() is not None:
            err.seek(0)
            raise AssertionError(f"the run ended (rc={proc.returncode}) before checkpoint {at_least}: "
                                 f"{err.read()[-4000:]}")
        if time.time() - t0 > 600:
            kill_tree(proc.pid)
            raise AssertionError("no checkpoint within 600 s")
        time.sleep(0.02)
    kill_tree(proc.pid)
    proc.wait()
    return _latest(run_dir)


PPO_EXTRA = ["critic.micro_batch_size=2", "critic.warmup_iters=1"]


@pytest.mark.parametrize("recipe,nproc,extra", [
    (GRPO, 1, []),
    (PPO, 1, PPO_EXTRA),
    (GRPO, 2, []),  # DP=2
    (PPO, 2, PPO_EXTRA),  # DP=2
], ids=["grpo-1proc", "ppo-1proc", "grpo-dp2", "ppo-dp2"])
def test_exact_resume_after_kill(assets, tmp_path, tmp_path_factory, recipe, nproc, extra):
    a_dir, b_dir = uninterrupted(assets, tmp_path_factory, recipe, nproc, extra), str(tmp_path / "b")
    killed_at = _kill_after_checkpoint(checkpointed_run_cmd(assets, b_dir, recipe, nproc, extra), b_dir, at_least=2)
    assert 2 <= killed_at < ITERS, killed_at
    out = run_to_exit(checkpointed_run_cmd(assets, b_dir, recipe, nproc, extra))
    assert f"resumed from {os.path.join(b_dir, 'checkpoints', f'iter_{killed_at:06d}')}" in out.stdout
    check_same_run(a_dir, b_dir, killed_at)


def test_crash_mid_checkpoint_keeps_previous(assets, tmp_path):
    d = str(tmp_path / "crash")
    out = run_to_exit(checkpointed_run_cmd(assets, d, GRPO, 1, ["faults.crash_during_checkpoint_at=3"]), expect=86)
    assert _latest(d) == 2
    leftovers = [x for x in os.listdir(os.path.join(d, "checkpoints")) if x.startswith(".tmp-")]
    assert leftovers, "the half-written checkpoint should still be there (never published)"
    out = run_to_exit(checkpointed_run_cmd(assets, d, GRPO, 1, []))
    assert "resumed from" in out.stdout and "iter_000002" in out.stdout
    assert not [x for x in os.listdir(os.path.join(d, "checkpoints")) if x.startswith(".tmp-")]
    assert _latest(d) == ITERS


def test_resume_refuses_changed_contract_and_tampered_files(assets, tmp_path):
    d = str(tmp_path / "run")
    base = checkpointed_run_cmd(assets, d, GRPO, 1, ["trainer.iterations=2", "trainer.save_experience=true"])
    run_to_exit(base)
    # a changed reward config: refused with the field named, exit 2, nothing trained
    bad = run_to_exit(base + ["reward.fn=tests.plugins.faulty_rewards:flat_even_prompts", "trainer.iterations=3"],
                      expect=2)
    assert "reward changed" in bad.stderr and "resume_force" in bad.stderr, bad.stderr[-2000:]
    # a changed chat template (the tokenizer contract): both fields named
    tpl = tmp_path / "template.jinja"
    tpl.write_text("{{ bos_token }}{% for m in messages %}{{ m['content'] }} {% endfor %}<|assistant|> ")
    bad = run_to_exit(base + [f"model.chat_template={tpl}", "trainer.iterations=3"], expect=2)
    assert "chat_template" in bad.stderr and "tokenizer" in bad.stderr, bad.stderr[-2000:]
    # forced: continues as a new run id
    ok = run_to_exit(base + ["reward.fn=tests.plugins.faulty_rewards:flat_even_prompts", "trainer.iterations=3",
                      "trainer.resume_force=true"])
    assert "resumed from" in ok.stdout
    assert batches(d)[-1].facts.run_id == "resume-test-forced2"
    # one flipped byte in a checkpoint file: refused, naming the file
    latest = os.path.join(d, "checkpoints", f"iter_{_latest(d):06d}")
    victim = next(os.path.join(r, f) for r, _, fs in os.walk(os.path.join(latest, "actor_optim")) for f in fs
                  if f.endswith(".distcp"))
    data = bytearray(open(victim, "rb").read())
    data[len(data) // 2] ^= 0x01
    open(victim, "wb").write(bytes(data))
    bad = run_to_exit(base + ["trainer.iterations=4"], expect=2)
    assert os.path.basename(victim) in bad.stderr and "sha256" in bad.stderr, bad.stderr[-2000:]


@pytest.mark.parametrize("saved", [["parallel.tp=2"], []], ids=["tp2_to_tp1", "dp2_to_dp1"])
def test_resume_at_another_layout(assets, tmp_path, tmp_path_factory, saved):
    """Saved by 2 processes (TP=2, or DP=2), resumed by one: the loaded actor's logical weights
    hash to the checkpointed version's manifest (a bitwise check the trainer makes before it
    continues), the optimizer state reshards, and the run goes on."""
    import shutil

    d = str(tmp_path / "run")
    if saved:
        run_to_exit(checkpointed_run_cmd(assets, d, GRPO, 2, ["trainer.iterations=2", *saved]))
    else:  # a copy of the uninterrupted DP=2 run the exact-resume test made
        shutil.copytree(uninterrupted(assets, tmp_path_factory, GRPO, 2, []), d)
    k = _latest(d)
    out = run_to_exit(checkpointed_run_cmd(assets, d, GRPO, 1, [f"trainer.iterations={k + 1}"]))
    assert "at a different layout" in out.stdout and f"iter_{k:06d}" in out.stdout, out.stdout[-2000:]
    assert _latest(d) == k + 1
    state = json.load(open(os.path.join(d, "checkpoints", f"iter_{k + 1:06d}", "state.json")))
    assert state["layout"]["world"] == 1 and state["policy_version"]["optimizer_step"] == k + 1


def test_sigterm_and_stop_file_checkpoint_then_resume_the_same_run(assets, tmp_path, tmp_path_factory):
    """The two ways a scheduler ends a job on time: SIGTERM to the trainer, or <run_dir>/STOP
    (written by launch/multinode.sh on Slurm's warning).  Each stops at the next commit with a
    checkpoint and exit 0; the third start finishes (DONE), bitwise the uninterrupted run."""
    ref = uninterrupted(assets, tmp_path_factory, GRPO, 1, [])
    d = str(tmp_path / "run")
    cmd = checkpointed_run_cmd(assets, d, GRPO, 1, [])
    for how in ("stop_file", "sigterm"):
        start = _latest(d)
        log = tmp_path / f"{how}.log"
        with open(log, "w") as out:
            proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.DEVNULL, env=subprocess_env(),
                                    start_new_session=True)
        t0 = time.time()
        # fresh: once a checkpoint exists; resumed: as soon as it says so (before its first iteration)
        while _latest(d) < 1 if start < 0 else "resumed from" not in log.read_text():
            assert proc.poll() is None and time.time() - t0 < 600, "the run ended before it could be stopped"
            time.sleep(0.02)
        if how == "sigterm":
            proc.send_signal(signal.SIGTERM)
        else:
            open(os.path.join(d, "STOP"), "w").close()
        rc = proc.wait(timeout=600)
        text = log.read_text()
        assert rc == 0 and "stopping after" in text and "on a signal" in text, text[-2000:]
        assert start < _latest(d) < ITERS and not os.path.exists(os.path.join(d, "DONE"))
    stopped_at = _latest(d)
    # the stop line prints the exact command that continues the run (trainer.run_dir named last)
    printed = text.split("resume with: ", 1)[1].splitlines()[0]
    args = shlex.split(printed)
    run_dir_arg = f"trainer.run_dir={d}"
    assert args[:3] == ["python", "-m", "megarl.train"] and args[-1] == run_dir_arg, printed
    assert args[3:-1] == [a for a in cmd[3:] if a != run_dir_arg], printed
    run_to_exit([sys.executable] + args[1:])  # the third start: the printed command, as printed
    assert os.path.isfile(os.path.join(d, "DONE"))
    check_same_run(ref, d, killed_at=stopped_at, resumes=2)
    # a finished run started again says so in one line, exits 0, and leaves the run as it is
    before = open(os.path.join(d, "metrics.jsonl")).read()
    again = run_to_exit(cmd)
    assert "holds a finished run" in again.stdout and "resumed from" not in again.stdout, again.stdout[-2000:]
    assert open(os.path.join(d, "metrics.jsonl")).read() == before

