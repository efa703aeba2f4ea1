"""Training-position checkpoints: exact resume after a real kill, a crash mid-checkpoint, a
tampered file, and a resume that would change the contract (refused, naming the field)."""

import json
import os
import shlex
import shutil
import signal
import sys

import pytest

from tests._dist import subprocess_env
from tests._trackers import LOGGERS, check_trackers
from tests._train_runs import (
    GRPO,
    ITERS,
    PPO,
    batches,
    check_rederivation,
    check_same_run,
    checkpointed_run_cmd,
    kill_tree,
    kill_while_holding,
    latest_checkpoint,
    metrics,
    rewrite_checkpoint_state,
    run_to_exit,
    start_and_hold,
    uninterrupted,
)


PPO_EXTRA = ["critic.micro_batch_size=2", "critic.warmup_iters=1", "trainer.save_experience=true"]
DISTOPT = ["parallel.distributed_optimizer=true"]


@pytest.mark.parametrize("recipe,nproc,extra", [
    (GRPO, 1, []),
    (PPO, 1, PPO_EXTRA),
    (GRPO, 2, []),  # DP=2
    (PPO, 2, PPO_EXTRA + ["reference.refresh_every=2"]),  # DP=2; the checkpoint holds a refreshed reference
    (GRPO, 2, DISTOPT),  # DP=2, megatron's distributed optimizer (ZeRO-1): its checkpoint format too
    (GRPO, 1, ["actor.lora.rank=4", "actor.lora.alpha=8"]),  # the checkpoint holds the adapters only
], ids=["grpo-1proc", "ppo-1proc", "grpo-dp2", "ppo-dp2-refreshed-ref", "grpo-dp2-distopt", "grpo-lora"])
def test_exact_resume_after_kill(assets, tmp_path, tmp_path_factory, recipe, nproc, extra):
    """Killed while holding after iteration 2, resumed from checkpoint 2: the rest of the run is
    bitwise the uninterrupted one's.  With reference.refresh_every=2 the checkpoint holds a
    reference refreshed after iteration 1: it is restored bitwise (hashed against what was saved
    at load, and the reference KL of every later iteration is the uninterrupted run's)."""
    a_dir, b_dir = uninterrupted(assets, tmp_path_factory, recipe, nproc, extra), str(tmp_path / "b")
    kill_while_holding(checkpointed_run_cmd(assets, b_dir, recipe, nproc, extra), str(tmp_path / "killed.log"), 2)
    killed_at = latest_checkpoint(b_dir)
    assert killed_at == 2 and [m["iteration"] for m in metrics(b_dir)] == [0, 1, 2], killed_at
    if recipe == GRPO and nproc == 1:
        # negative control: the same kill resumed from a checkpoint whose prompt cursor is one
        # iteration behind (B = 4 prompts) is another run, which check_same_run tells apart
        c_dir = str(tmp_path / "c")
        shutil.copytree(b_dir, c_dir)
        rewrite_checkpoint_state(os.path.join(c_dir, "checkpoints", f"iter_{killed_at:06d}"),
                                 lambda st: st["sampler"].__setitem__("cursor", st["sampler"]["cursor"] - 4))
        run_to_exit(checkpointed_run_cmd(assets, c_dir, recipe, nproc, extra))
        with pytest.raises(AssertionError):
            check_same_run(a_dir, c_dir, killed_at)
    out = run_to_exit(checkpointed_run_cmd(assets, b_dir, recipe, nproc, extra))
    assert f"resumed from {os.path.join(b_dir, 'checkpoints', f'iter_{killed_at:06d}')}" in out.stdout
    check_same_run(a_dir, b_dir, killed_at)
    # the recovery a resume took is measured once, on the first row it wrote
    assert [k for k, m in enumerate(metrics(b_dir)) if "e2e/resume_s" in m] == [killed_at], killed_at
    assert not any("e2e/resume_s" in m for m in metrics(a_dir))
    if recipe == PPO and nproc == 1:  # the record re-derives its advantages and returns alone
        check_rederivation(a_dir)
    if "reference.refresh_every=2" in extra:  # refreshed after iterations 1 and 3, the same both ways
        ref_a, ref_b = (json.load(open(os.path.join(d, "checkpoints", f"iter_{ITERS:06d}", "state.json")))["reference"]
                        for d in (a_dir, b_dir))
        assert ref_a["refreshes"] == 2 and ref_a == ref_b and ref_a["weights"].startswith("sha256:"), (ref_a, ref_b)


def _changed_tokenizer(model_dir, out_dir):
    """A copy of ``model_dir``'s tokenizer whose ids are the same for these prompts but whose
    contract is not: an NFC normalizer added after its own (the backend JSON the contract
    hashes; ASCII prompts normalise to themselves)."""
    import shutil

    os.makedirs(out_dir)
    for f in os.listdir(model_dir):
        if f.startswith(("tokenizer", "special_tokens", "chat_template")):
            shutil.copy(os.path.join(model_dir, f), out_dir)
    spec = json.load(open(os.path.join(out_dir, "tokenizer.json")))
    own = spec.get("normalizer")
    spec["normalizer"] = {"type": "Sequence", "normalizers": ([own] if own else []) + [{"type": "NFC"}]}
    json.dump(spec, open(os.path.join(out_dir, "tokenizer.json"), "w"))
    return out_dir


def test_crash_mid_checkpoint_keeps_previous_and_a_changed_contract_is_refused(assets, tmp_path):
    """A run that dies after writing checkpoint 3 but before publishing it keeps checkpoint 2
    selected, with the half-written one left aside.  That run, as the crash left it, is the base
    of every refusal: a changed reward, chat template or tokenizer is refused naming the field
    (exit 2, nothing trained); the unchanged command resumes it from checkpoint 2, cleans the
    leftover and finishes; another reference.path or model.path (its own final export) is refused
    naming the key; a forced resume continues under a new run id; one flipped byte in a
    checkpoint file is refused naming the file."""
    d = str(tmp_path / "crash")
    base = checkpointed_run_cmd(assets, d, GRPO, 1, ["trainer.save_experience=true"])
    run_to_exit(base + ["faults.crash_during_checkpoint_at=3"], expect=86)
    assert latest_checkpoint(d) == 2
    leftovers = [x for x in os.listdir(os.path.join(d, "checkpoints")) if x.startswith(".tmp-")]
    assert leftovers, "the half-written checkpoint should still be there (never published)"
    rows_before = open(os.path.join(d, "metrics.jsonl")).read()
    # a changed reward config: refused with the field named, exit 2, nothing trained
    bad = run_to_exit(base + ["reward.fn=tests.plugins.faulty_rewards:flat_even_prompts"], expect=2)
    assert "reward changed" in bad.stderr and "resume_force" in bad.stderr, bad.stderr[-2000:]
    # a changed chat template (the tokenizer contract): both fields named
    tpl = tmp_path / "template.jinja"
    tpl.write_text("{{ bos_token }}{% for m in messages %}{{ m['content'] }} {% endfor %}<|assistant|> ")
    bad = run_to_exit(base + [f"model.chat_template={tpl}"], expect=2)
    assert "chat_template" in bad.stderr and "tokenizer" in bad.stderr, bad.stderr[-2000:]
    # a changed tokenizer (the same template and vocabulary, another normalizer): the tokenizer named
    other = _changed_tokenizer(assets["model"], str(tmp_path / "other_tokenizer"))
    bad = run_to_exit(base + [f"model.tokenizer={other}"], expect=2)
    assert "tokenizer changed since the checkpoint" in bad.stderr and "chat_template" not in bad.stderr, \
        bad.stderr[-2000:]
    assert open(os.path.join(d, "metrics.jsonl")).read() == rows_before  # nothing was trained or written
    # the unchanged command resumes from checkpoint 2 and finishes
    out = run_to_exit(base)
    assert "resumed from" in out.stdout and "iter_000002" in out.stdout
    assert not [x for x in os.listdir(os.path.join(d, "checkpoints")) if x.startswith(".tmp-")]
    assert latest_checkpoint(d) == ITERS
    # the trained export as the KL anchor, or as the model (the same architecture, other weights):
    # each refused on one error line naming the key and both weight identities (was: resumed
    # without a word, and the reference KL read 0.0000)
    other_export = os.path.join(d, "export", f"iter_{ITERS}")
    for key in ("reference.path", "model.path"):
        bad = run_to_exit(base + [f"{key}={other_export}", f"trainer.iterations={ITERS + 1}"], expect=2)
        line = [x for x in bad.stderr.splitlines() if x.startswith("error:")]
        assert len(line) == 1 and f": {key}: the checkpoint's" in line[0], bad.stderr[-2000:]
        # model.path is where both the model and (reference.path null) the reference come from
        roles = ["reference"] if key == "reference.path" else ["model", "reference"]
        assert [r for r in ("model", "reference") if f"the checkpoint's {r} is" in line[0]] == roles, line
        assert line[0].count("sha256:") == 2 * len(roles), line
        assert other_export in line[0] and "new trainer.run_dir" in line[0], line
    # forced: continues as a new run id
    ok = run_to_exit(base + ["reward.fn=tests.plugins.faulty_rewards:flat_even_prompts",
                             f"trainer.iterations={ITERS + 1}", "trainer.resume_force=true"])
    assert "resumed from" in ok.stdout
    assert batches(d)[-1].facts.run_id == f"resume-test-forced{ITERS}"
    # one flipped byte in a checkpoint file: refused, naming the file
    latest = os.path.join(d, "checkpoints", f"iter_{latest_checkpoint(d):06d}")
    victim = next(os.path.join(r, f) for r, _, fs in os.walk(os.path.join(latest, "actor_optim")) for f in fs
                  if f.endswith(".distcp"))
    data = bytearray(open(victim, "rb").read())
    data[len(data) // 2] ^= 0x01
    open(victim, "wb").write(bytes(data))
    bad = run_to_exit(base + [f"trainer.iterations={ITERS + 2}"], expect=2)
    assert os.path.basename(victim) in bad.stderr and "sha256" in bad.stderr, bad.stderr[-2000:]


def test_resume_at_another_layout(assets, tmp_path, tmp_path_factory):
    """Saved by 2 processes at DP=2, resumed by one: the loaded actor's logical weights hash to
    the checkpointed version's manifest (a bitwise check the trainer makes before it continues),
    the optimizer state reshards (the distributed optimizer's too; resuming it with the plain one
    is refused), and the run goes on.  (TP=2 -> TP=1: the TP=2 end-to-end run of
    tests/e2e/test_train_e2e.py, resumed.)"""
    import shutil

    for extra in ([], DISTOPT):  # the plain optimizer, and the distributed one's state resliced
        d = str(tmp_path / f"run{len(extra)}")
        shutil.copytree(uninterrupted(assets, tmp_path_factory, GRPO, 2, extra), d)  # the exact-resume test's run
        k = latest_checkpoint(d)
        if extra:  # the other optimizer's state does not load: refused, naming the key
            bad = run_to_exit(checkpointed_run_cmd(assets, d, GRPO, 1, [f"trainer.iterations={k + 1}"]), expect=2)
            assert "parallel.distributed_optimizer=True" in bad.stderr, bad.stderr[-2000:]
        out = run_to_exit(checkpointed_run_cmd(assets, d, GRPO, 1, [*extra, f"trainer.iterations={k + 1}"]))
        assert "at a different layout" in out.stdout and f"iter_{k:06d}" in out.stdout, out.stdout[-2000:]
        assert latest_checkpoint(d) == k + 1
        state = json.load(open(os.path.join(d, "checkpoints", f"iter_{k + 1:06d}", "state.json")))
        assert state["layout"]["world"] == 1 and state["policy_version"]["optimizer_step"] == k + 1
        assert state["layout"]["distributed_optimizer"] is bool(extra)


def test_every_way_a_run_is_stopped_checkpoints_and_resumes_the_same_run(assets, tmp_path, tmp_path_factory,
                                                                         monkeypatch):
    """The ways a scheduler ends a job on time, one after another in one run: <run_dir>/STOP
    (written by launch/multinode.sh on Slurm's warning), SIGTERM, SIGUSR1 (Slurm's --signal), and
    trainer.max_wall_minutes.  Each stops at the next commit with a checkpoint and exit 0 and
    prints the command that continues the run; the last start runs the printed command as
    printed and finishes (DONE), bitwise the uninterrupted run.  The run logs to every tracker:
    across the five starts each tracker keeps one run, holding exactly what metrics.jsonl holds,
    and samples.jsonl decodes the sealed experience (tests/_trackers.py)."""
    ref = uninterrupted(assets, tmp_path_factory, GRPO, 1, [])
    d = str(tmp_path / "run")
    wandb_dir = str(tmp_path / "wandb")
    os.makedirs(wandb_dir)
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", wandb_dir)
    env = subprocess_env()
    cmd = checkpointed_run_cmd(assets, d, GRPO, 1, [
        LOGGERS, "trainer.log_samples_every=1", "trainer.log_samples_n=3", "trainer.log_samples_console=1",
        "trainer.save_experience=true", "faults.hold_after_iteration=[0,1,2]"])
    first_trackers = None
    for k, how in enumerate(("stop_file", "sigterm", "sigusr1")):
        log = tmp_path / f"{how}.log"
        proc = start_and_hold(cmd, str(log), k, env=env)
        try:
            if how == "stop_file":
                open(os.path.join(d, "STOP"), "w").close()
            else:
                proc.send_signal(signal.SIGTERM if how == "sigterm" else signal.SIGUSR1)
            rc = proc.wait(timeout=600)
        finally:
            kill_tree(proc.pid)
        text = log.read_text()
        assert rc == 0 and f"stopping after {k + 1} iterations on a signal" in text, text[-2000:]
        assert latest_checkpoint(d) == k + 1 and not os.path.exists(os.path.join(d, "DONE"))
        assert ("resumed from" in text) == (k > 0)
        if k == 0:
            assert "sample it0 p000/c00 | reward" in text, text[-2000:]  # trainer.log_samples_console
            first_trackers = json.load(open(os.path.join(d, "trackers.json")))
            assert first_trackers["run_id"] == "resume-test" and set(first_trackers) == {"run_id", "wandb", "mlflow"}
    # trainer.max_wall_minutes: past the limit after iteration 3, it checkpoints and stops
    wall = run_to_exit(cmd + ["trainer.max_wall_minutes=1e-6"])
    assert "stopping after 4 iterations: trainer.max_wall_minutes reached" in wall.stdout, wall.stdout[-2000:]
    assert latest_checkpoint(d) == 4 and not os.path.exists(os.path.join(d, "DONE"))
    # the stop line prints the exact command that continues the run (trainer.run_dir named last)
    printed = wall.stdout.split("resume with: ", 1)[1].splitlines()[0]
    args = shlex.split(printed)
    run_dir_arg = f"trainer.run_dir={d}"
    assert args[:3] == ["python", "-m", "megarl.train"] and args[-1] == run_dir_arg, printed
    assert args[3:-1] == [a for a in cmd[3:] if a != run_dir_arg] + ["trainer.max_wall_minutes=1e-6"], printed
    run_to_exit([sys.executable] + args[1:])  # the last start: the printed command, as printed
    assert os.path.isfile(os.path.join(d, "DONE"))
    # bitwise, but for one counter: the wall-clock stop evaluates the policy it stops at, so it
    # published once more (one more KV flush) than the uninterrupted run
    check_same_run(ref, d, killed_at=4, resumes=4, ignore=("e2e/count/kv_flushes",))
    assert metrics(d)[-1]["e2e/count/kv_flushes"] == metrics(ref)[-1]["e2e/count/kv_flushes"] + 1
    check_trackers(d, wandb_dir, tmp_path, assets["model"], first_trackers, starts=[0, 1, 2, 3, 4],
                   samples_per_iteration=3)
    # a finished run started again says so in one line, exits 0, and leaves the run as it is
    before = open(os.path.join(d, "metrics.jsonl")).read()
    again = run_to_exit(cmd)
    assert "holds a finished run" in again.stdout and "resumed from" not in again.stdout, again.stdout[-2000:]
    assert open(os.path.join(d, "metrics.jsonl")).read() == before

