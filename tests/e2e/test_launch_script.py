"""launch/multinode.sh builds the right srun/torchrun line (Slurm commands faked on PATH)."""

import os
import stat
import subprocess

from tests._dist import ROOT

SCRIPT = os.path.join(ROOT, "launch", "multinode.sh")


def _fake(bin_dir, name, body):
    p = bin_dir / name
    p.write_text("#!/bin/bash\n" + body)
    p.chmod(p.stat().st_mode | stat.S_IEXEC)


def test_multinode_passes_config_and_overrides(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    log = tmp_path / "srun.log"
    _fake(bin_dir, "scontrol", 'printf "node-a\\nnode-b\\n"\n')
    _fake(bin_dir, "srun", f'if [[ "$*" == *hostname* ]]; then echo 10.9.8.7; else echo "$@" >> {log}; fi\n')
    cfg = tmp_path / "job.yaml"
    cfg.write_text("a: 1\n")
    env = dict(os.environ, PATH=f"{bin_dir}:{os.environ['PATH']}", SLURM_NNODES="2",
               SLURM_JOB_NODELIST="node-[a-b]", SLURM_JOB_ID="77", GPUS_PER_NODE="4")
    proc = subprocess.run(["bash", SCRIPT, str(cfg), "actor.tp=4", "algo.name=grpo"], env=env,
                          capture_output=True, text=True, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    line = log.read_text().strip()
    for part in ("torchrun", "--nnodes 2", "--nproc-per-node 4", "--rdzv-id 77", "--rdzv-backend c10d",
                 "--rdzv-endpoint 10.9.8.7:29500", "-m megarl.train", f"--config {cfg}",
                 # a requeued job (same id) finds its run dir and resumes; the user's overrides come last
                 "trainer.run_dir=runs/megarl-77 trainer.resume=auto actor.tp=4 algo.name=grpo"):
        assert part in line, (part, line)


def _slurm(tmp_path, srun_body):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    _fake(bin_dir, "scontrol", f'if [ "$1" = requeue ]; then echo "$@" >> {tmp_path / "scontrol.log"}; '
                               'else printf "node-a\\n"; fi\n')
    _fake(bin_dir, "srun", f'if [[ "$*" == *hostname* ]]; then echo 10.9.8.7; exit 0; fi\n{srun_body}')
    cfg = tmp_path / "job.yaml"
    cfg.write_text("a: 1\n")
    env = dict(os.environ, PATH=f"{bin_dir}:{os.environ['PATH']}", SLURM_NNODES="1", SLURM_JOB_NODELIST="node-a",
               SLURM_JOB_ID="77", SLURM_JOB_NAME="job", MEGARL_RUN_DIR=str(tmp_path / "run"))
    return [os.environ.get("BASH", "bash"), SCRIPT, str(cfg)], env


def test_time_limit_signal_asks_for_a_checkpoint_and_requeues(tmp_path):
    """Slurm's USR1 before the limit: the script writes <run dir>/STOP (the trainer checkpoints at
    its next commit and exits 0) and requeues the job, which resumes in the same run dir."""
    import signal
    import time

    run = tmp_path / "run"
    started = tmp_path / "started"
    # the stand-in trainer: runs until the STOP file appears, then exits 0 like the real one
    cmd, env = _slurm(tmp_path, f'touch {started}; while [ ! -f {run}/STOP ]; do sleep 0.05; done; exit 0\n')
    proc = subprocess.Popen(cmd, env=env, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    t0 = time.time()
    while not started.exists():
        assert proc.poll() is None and time.time() - t0 < 30, proc.communicate()
        time.sleep(0.05)
    proc.send_signal(signal.SIGUSR1)
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err
    assert (run / "STOP").exists() and "requeueing job 77" in out
    assert (tmp_path / "scontrol.log").read_text().split() == ["requeue", "77"]


def test_finished_run_is_not_requeued_and_crashes_only_up_to_the_limit(tmp_path):
    run = tmp_path / "run"
    cmd, env = _slurm(tmp_path, f'mkdir -p {run}; [ -n "$MAKE_DONE" ] && touch {run}/DONE; exit ${{RC:-0}}\n')
    done = subprocess.run(cmd, env=dict(env, MAKE_DONE="1"), cwd=tmp_path, capture_output=True, text=True)
    assert done.returncode == 0 and "run finished" in done.stdout and not (tmp_path / "scontrol.log").exists()
    (run / "DONE").unlink()
    crash = subprocess.run(cmd, env=dict(env, RC="3", SLURM_RESTART_COUNT="1"), cwd=tmp_path, capture_output=True,
                           text=True)
    assert crash.returncode == 3 and (tmp_path / "scontrol.log").read_text().split() == ["requeue", "77"]
    again = subprocess.run(cmd, env=dict(env, RC="3", SLURM_RESTART_COUNT="3"), cwd=tmp_path, capture_output=True,
                           text=True)
    assert again.returncode == 3 and "requeueing" not in again.stdout  # MEGARL_MAX_REQUEUES (3) reached


def test_multinode_rejects_missing_config(tmp_path):
    proc = subprocess.run(["bash", SCRIPT, str(tmp_path / "nope.yaml")], capture_output=True, text=True)
    assert proc.returncode == 2 and "nope.yaml" in proc.stderr


def _sbatch_directives(path):
    """The #SBATCH options as sbatch reads them: from the lines after the shebang up to the first
    line that is neither a comment nor blank (sbatch ignores any #SBATCH after that)."""
    opts = {}
    with open(path) as f:
        lines = f.read().splitlines()[1:]
    for line in lines:
        stripped = line.strip()
        if stripped and not stripped.startswith("#"):
            break
        if stripped.startswith("#SBATCH"):
            key, _, value = stripped[len("#SBATCH"):].strip().partition("=")
            opts[key] = value
    return opts


def test_slurm_log_opens_in_a_fresh_submit_directory(tmp_path):
    """Slurm opens --output before the script runs: in a submit directory holding nothing, the
    log's directory must already exist (a job whose log directory is missing fails with no log),
    a requeued job (same id) appends to its log, and the script itself creates no log directory."""
    opts = _sbatch_directives(SCRIPT)
    assert opts.get("--requeue") == "" and opts.get("--open-mode") == "append", opts
    submit = tmp_path / "submit"
    submit.mkdir()
    log = submit / opts["--output"].replace("%x", opts["--job-name"]).replace("%j", "77")
    assert log.parent.is_dir(), f"--output={opts['--output']} needs {log.parent} before sbatch"
    with open(log, "a"):                      # what slurmstepd does, then the script runs
        pass

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    _fake(bin_dir, "scontrol", 'printf "node-a\\n"\n')
    _fake(bin_dir, "srun", 'if [[ "$*" == *hostname* ]]; then echo 10.9.8.7; fi\n')
    cfg = tmp_path / "job.yaml"
    cfg.write_text("a: 1\n")
    env = dict(os.environ, PATH=f"{bin_dir}:{os.environ['PATH']}", SLURM_NNODES="1",
               SLURM_JOB_NODELIST="node-a", SLURM_JOB_ID="77")
    proc = subprocess.run(["bash", SCRIPT, str(cfg)], env=env, capture_output=True, text=True, cwd=submit)
    assert proc.returncode == 0, proc.stderr
    assert sorted(os.listdir(submit)) == [log.name], os.listdir(submit)   # no logs/ of its own


def test_stop_file_written_since_the_launch_is_honoured(tmp_path, monkeypatch):
    """A STOP found at start-up is the last stop's (removed) unless it was written after the launch
    script's stamp: Slurm's time-limit warning arriving while the trainer starts is not lost."""
    import pytest

    from megarl.control.trainer import stop_file_is_stale
    from megarl.errors import MegarlError

    stop = tmp_path / "STOP"
    stop.touch()
    os.utime(stop, (1000.0, 1000.0))
    monkeypatch.delenv("MEGARL_LAUNCH_TIME", raising=False)
    assert stop_file_is_stale(str(stop))  # no stamp (not launched by the script): stale, as before
    monkeypatch.setenv("MEGARL_LAUNCH_TIME", "2000.25")
    assert stop_file_is_stale(str(stop))  # written before this launch
    os.utime(stop, (2000.5, 2000.5))
    assert not stop_file_is_stale(str(stop))  # the warning came while the trainer started
    monkeypatch.setenv("MEGARL_LAUNCH_TIME", "yesterday")
    with pytest.raises(MegarlError, match="MEGARL_LAUNCH_TIME"):
        stop_file_is_stale(str(stop))
