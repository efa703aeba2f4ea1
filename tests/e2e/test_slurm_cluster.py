"""``sbatch launch/multinode.sh`` through a real Slurm: a two-node cluster on this one machine.

``tools/slurm_cluster.sh up`` starts munge and slurmctld on the host and one slurmd per compute
node, each in its own network namespace with its own address (Debian's Slurm 22.05), so the job's
two torchruns meet over a real network, rendezvous on the first node's address as the script
finds it (``scontrol show hostnames`` on the real node list, ``srun hostname`` on that node), and
Slurm's own requeue keeps the job id and counts ``SLURM_RESTART_COUNT``.

The tests skip, saying why, only where the machine cannot host the cluster (not root, no network
namespaces); on this machine kind they run.  The last test takes the cluster down and checks
that nothing is left: no daemon, no job process, no namespace, no bridge.
"""

import importlib.util
import os
import re
import subprocess
import sys
import time

import pytest

from tests._dist import ROOT, free_port, subprocess_env

CLUSTER = os.path.join(ROOT, "tools", "slurm_cluster.sh")
SCRIPT = os.path.join(ROOT, "launch", "multinode.sh")
RECIPE = os.path.join(ROOT, "configs", "grpo_arith_tiny.yaml")
NODES = ("mrlnode1", "mrlnode2")
DAEMONS = ("slurmctld", "slurmd", "munged")


def _digest():
    spec = importlib.util.spec_from_file_location("run_digest", os.path.join(ROOT, "tools", "run_digest.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _cluster(cmd: str, timeout: int = 300):
    return subprocess.run(["bash", CLUSTER, cmd], capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def cluster():
    can = _cluster("can-host")
    if can.returncode == 3:
        pytest.skip(f"this machine cannot host the two-node Slurm cluster: {can.stdout.strip()}")
    assert can.returncode == 0, can.stderr
    t0 = time.monotonic()
    up = _cluster("up")
    assert up.returncode == 0, f"tools/slurm_cluster.sh up failed:\n{up.stderr}"
    print(f"cluster up in {time.monotonic() - t0:.1f} s")
    conf = _cluster("env").stdout.strip().split("=", 1)[1]
    env = dict(subprocess_env(), SLURM_CONF=conf,
               PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"])  # torchrun on the nodes
    yield env
    _cluster("down")


def _overrides(assets, run_dir, iterations):
    return [f"model.path={assets['model']}", "model.build_tiny=false", f"data.train_path={assets['train']}",
            f"data.heldout_path={assets['heldout']}", "data.task.build=false", "trainer.run_id=slurm",
            f"trainer.iterations={iterations}", "trainer.prompts_per_iteration=4", "rollout.n=4",
            "algo.micro_batch_size=4", "eval.n=8", "eval.every=1", "trainer.export_every=1",
            "trainer.loggers=[jsonl]"]


def _submit(env, tmp_path, nodes, job_env, args, wait=True, extra=()):
    """sbatch the real launch script on CPU nodes; return the job id."""
    cmd = ["sbatch", "--parsable", f"--nodes={nodes}", "--gpus-per-node=0", "--cpus-per-task=1",
           f"--output={tmp_path}/%x-%j.out", f"--chdir={tmp_path}", "--job-name=mrltest", *extra]
    if wait:
        cmd.append("--wait")
    proc = subprocess.run(cmd + [SCRIPT, RECIPE, *args], env=dict(env, GPUS_PER_NODE="0", **job_env),
                          capture_output=True, text=True, timeout=900)
    job = proc.stdout.strip().split(";")[0]
    assert job.isdigit(), f"sbatch gave no job id: {proc.stdout!r} {proc.stderr!r}"
    return job, proc


def _job(env, job) -> dict:
    out = subprocess.run(["scontrol", "show", "job", job], env=env, capture_output=True, text=True, timeout=30).stdout
    return dict(re.findall(r"(\w+)=(\S+)", out))


def test_two_nodes_equal_one_machine(cluster, assets, tmp_path):
    """GRPO with DP across two Slurm nodes (one gloo process each, torchrun's c10d rendezvous on
    the first node's address) completes, writes DONE, and its metrics and exports equal the same
    run as one machine's two processes, bitwise: the same gloo reductions over the same ranks."""
    run2n, run1m = tmp_path / "run2n", tmp_path / "run1m"
    job, proc = _submit(cluster, tmp_path, 2, {"MEGARL_RUN_DIR": str(run2n)}, _overrides(assets, run2n, 3))
    log = (tmp_path / f"mrltest-{job}.out").read_text()
    assert proc.returncode == 0, f"job {job} failed:\n{log[-6000:]}"
    info = _job(cluster, job)
    assert (info["JobState"], info["NumNodes"], info["NodeList"]) == ("COMPLETED", "2", "mrlnode[1-2]"), info
    assert "megarl: 2 nodes x 1 CPU processes (gloo), rendezvous 10.77.0.11:" in log, log[-3000:]
    assert "world 2 = tp 1 x pp 1 x dp 2" in log and "megarl: run finished" in log
    assert (run2n / "DONE").exists()

    one = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr",
                          "127.0.0.1", "--master-port", str(free_port()), "-m", "megarl.train", "--config", RECIPE,
                          *_overrides(assets, run1m, 3), f"trainer.run_dir={run1m}"],
                         env=subprocess_env(), capture_output=True, text=True, timeout=900)
    assert one.returncode == 0, one.stderr[-6000:]
    d = _digest()
    a, b = d.values(str(run2n)), d.values(str(run1m))
    assert len(a) > 100 and a.keys() == b.keys()
    differ = {k: (a[k], b[k]) for k in a if a[k] != b[k]}
    assert not differ, f"{len(differ)} of {len(a)} metric values differ between two nodes and one machine: {differ}"
    ea, eb = d.exports(str(run2n)), d.exports(str(run1m))
    assert len(ea) >= 8 and ea == eb


def test_crash_requeues_then_stops_with_the_reason(cluster, assets, tmp_path):
    """A trainer that dies in iteration 1's update (faults.crash_during_update_at=1, every attempt)
    is requeued by the script through Slurm (same job id, SLURM_RESTART_COUNT 1), resumes from the
    iteration-0 checkpoint, dies again, and is not requeued past MEGARL_MAX_REQUEUES=1: the job
    ends FAILED with the reason in its log."""
    run = tmp_path / "run"
    args = _overrides(assets, run, 3) + ["trainer.checkpoint_every=1", "faults.crash_during_update_at=1"]
    job, _ = _submit(cluster, tmp_path, 1, {"MEGARL_RUN_DIR": str(run), "MEGARL_MAX_REQUEUES": "1"}, args,
                     wait=False)
    logf = tmp_path / f"mrltest-{job}.out"
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        info = _job(cluster, job)
        if info.get("JobState") in ("FAILED", "COMPLETED", "CANCELLED", "TIMEOUT", "NODE_FAIL") \
                and info.get("Restarts") == "1":
            break
        time.sleep(2)
    log = logf.read_text()
    assert info["JobState"] == "FAILED" and info["Restarts"] == "1", (info, log[-4000:])
    assert "(restart 0)" in log and "(restart 1)" in log
    assert log.count(f"megarl: requeueing job {job}") == 1
    assert "megarl: not requeued: the trainer failed" in log and "after 1 requeues (MEGARL_MAX_REQUEUES=1)" in log
    assert not (run / "DONE").exists()
    assert os.path.isdir(run / "checkpoints"), sorted(os.listdir(run))


TERMINAL = ("COMPLETED", "FAILED", "TIMEOUT", "CANCELLED", "NODE_FAIL", "OUT_OF_MEMORY", "PREEMPTED")


def _wait_for(env, job, done, what, timeout=600):
    """Poll ``scontrol show job`` until ``done(info)``; a job that ends otherwise fails at once."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        info = _job(env, job)
        if done(info):
            return info
        if info.get("JobState") in TERMINAL:
            raise AssertionError(f"job {job} ended {info.get('JobState')} (restarts {info.get('Restarts')}) "
                                 f"before: {what}")
        time.sleep(1)
    raise AssertionError(f"job {job}: {what} within {timeout} s; last state {info}")


def test_time_limit_checkpoints_requeues_and_resumes_exactly(cluster, assets, tmp_path):
    """A job whose time limit falls mid-run: the trainer waits after iteration 2
    (``faults.hold_after_iteration``) until Slurm's USR1 (``--signal=B:USR1@60`` under a 2-minute
    limit) reaches the batch script, which writes STOP; the trainer checkpoints (iter_000003, the
    only checkpoint: ``checkpoint_every=0``) and exits 0; the script requeues the job, which restarts
    under the same id and run directory (SLURM_RESTART_COUNT 1), resumes from that checkpoint and
    finishes (given a longer limit once it is back, as an operator would).  Every metric and
    export equals the uninterrupted run's."""
    run, ref = tmp_path / "run", tmp_path / "ref"
    iterations = 6
    common = _overrides(assets, run, iterations) + ["trainer.checkpoint_every=0"]
    job, _ = _submit(cluster, tmp_path, 1, {"MEGARL_RUN_DIR": str(run)}, common + ["faults.hold_after_iteration=[2]"],
                     wait=False, extra=["--time=2", "--signal=B:USR1@60"])
    plain = subprocess.run([sys.executable, "-m", "megarl.train", "--config", RECIPE, *common,
                            f"trainer.run_dir={ref}"], env=subprocess_env(), capture_output=True, text=True,
                           timeout=900)
    assert plain.returncode == 0, plain.stderr[-4000:]
    _wait_for(cluster, job, lambda i: i.get("Restarts") == "1", "requeued after the time-limit warning")
    # the restarted job would be warned again ~40 s in: lengthen its limit, unless it has finished already
    subprocess.run(["scontrol", "update", f"JobId={job}", "TimeLimit=20"], env=cluster, timeout=30,
                   capture_output=True)
    info = _wait_for(cluster, job, lambda i: i.get("JobState") in TERMINAL, "finished")
    log = (tmp_path / f"mrltest-{job}.out").read_text()
    assert info["JobState"] == "COMPLETED" and info["Restarts"] == "1", (info, log[-4000:])
    assert "faults: holding after iteration 2" in log
    assert "megarl: time limit near; asked the trainer to checkpoint and stop" in log, log[-4000:]
    assert log.count(f"megarl: requeueing job {job} (exit status 0)") == 1, log[-4000:]
    assert re.search(r"resumed from \S+iter_000003: iteration 3", log), log[-4000:]
    assert "(restart 1)" in log and (run / "DONE").exists()
    d = _digest()
    a, b = d.values(str(run)), d.values(str(ref))
    # the one count that must differ: the stop's checkpoint, which the uninterrupted run never wrote
    stop_ckpt = {k: a.pop(k) for k in list(a) if k[1] == "e2e/count/checkpoints"}
    assert stop_ckpt == {(k, "e2e/count/checkpoints"): 1 for k in range(3, iterations)}, stop_ckpt
    assert len(a) > 100 and a.keys() == b.keys()
    differ = {k: (a[k], b[k]) for k in a if a[k] != b[k]}
    assert not differ, f"{len(differ)} of {len(a)} values differ from the uninterrupted run: {list(differ.items())[:5]}"
    ea, eb = d.exports(str(run)), d.exports(str(ref))
    assert len(ea) >= 5 and ea == eb


def _sinfo_state(env, node) -> str:
    return subprocess.run(["sinfo", "-h", "-N", "-n", node, "-o", "%T"], env=env, capture_output=True, text=True,
                          timeout=30).stdout.strip()


def _reference(assets, run_dir, overrides):
    """The same run, uninterrupted, as one machine's two processes (bitwise equal to two nodes)."""
    return subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr",
                             "127.0.0.1", "--master-port", str(free_port()), "-m", "megarl.train", "--config", RECIPE,
                             *overrides, f"trainer.run_dir={run_dir}"],
                            env=subprocess_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def test_a_lost_node_is_named_and_the_job_resumes(cluster, assets, tmp_path):
    """Mid-run, node 2 fails whole (``tools/slurm_cluster.sh lose``: its link cut, then slurmd and
    the job's processes in it killed, so nothing it sends reaches node 1: no closed connection to
    notice).  Rank 0 on node 1, blocked in a collective, names rank 1 on mrlnode2 as lost within
    ``parallel.peer_timeout_s`` (its heartbeat watch) and exits rather than wait out the process
    group's 30 minutes; Slurm marks the node down and the job is requeued; the node comes back
    (``revive``) and the job resumes under the same id from the last checkpoint and finishes, with
    every metric and export equal to the uninterrupted run's."""
    run, ref = tmp_path / "run", tmp_path / "ref"
    iterations, timeout_s = 120, 20
    common = _overrides(assets, run, iterations) + ["trainer.checkpoint_every=5", "eval.every=40",
                                                   "trainer.export_every=0", f"parallel.peer_timeout_s={timeout_s}"]
    job, _ = _submit(cluster, tmp_path, 2, {"MEGARL_RUN_DIR": str(run)}, common, wait=False)
    logf = tmp_path / f"mrltest-{job}.out"
    plain = _reference(assets, ref, common)
    revived = False
    try:
        _wait_for(cluster, job, lambda i: (run / "checkpoints" / "iter_000010").exists(), "checkpoint 10 written")
        t_cut = time.monotonic()
        lose = subprocess.run(["bash", CLUSTER, "lose", "mrlnode2"], capture_output=True, text=True, timeout=60)
        assert lose.returncode == 0, lose.stderr
        named = None
        while time.monotonic() - t_cut < timeout_s + 60:
            m = re.search(r"megarl: rank 0 \(mrlnode1\) stops: rank 1 \(mrlnode2\) lost: .*", logf.read_text())
            if m:
                named = time.monotonic() - t_cut
                break
            time.sleep(0.2)
        log = logf.read_text()
        assert named is not None, f"rank 1's loss not named within {timeout_s + 60} s:\n{log[-4000:]}"
        print(f"lost node named after {named:.1f} s (parallel.peer_timeout_s={timeout_s}): {m.group(0)}")
        # not before the time-out: the heartbeat (one a second) last moved up to a period before the cut
        assert named >= timeout_s - 2.0, named
        assert f"parallel.peer_timeout_s={timeout_s}" in m.group(0)
        # Slurm's view: the node stops answering and is set down; then it comes back
        _wait_for(cluster, job, lambda i: _sinfo_state(cluster, "mrlnode2").startswith("down"),
                  "mrlnode2 set down by slurmctld", timeout=180)
        t_down = time.monotonic() - t_cut
        revive = subprocess.run(["bash", CLUSTER, "revive", "mrlnode2"], capture_output=True, text=True, timeout=60)
        assert revive.returncode == 0, revive.stderr
        revived = True
        info = _wait_for(cluster, job, lambda i: i.get("JobState") == "COMPLETED", "finished after the requeue",
                         timeout=900)
        out, _ = plain.communicate(timeout=900)
    finally:
        if not revived:
            subprocess.run(["bash", CLUSTER, "revive", "mrlnode2"], capture_output=True, timeout=60)
        if plain.poll() is None:
            plain.kill()
    log = logf.read_text()
    print(f"job {job}: named at {named:.1f} s, node down at {t_down:.1f} s, restarts {info['Restarts']}")
    assert info["Restarts"] == "1" and info["NodeList"] == "mrlnode[1-2]", (info, log[-4000:])
    assert plain.returncode == 0, out[-4000:]
    resumed = re.search(r"resumed from \S+iter_(\d+): iteration (\d+)", log)
    assert resumed and int(resumed.group(1)) >= 10, log[-4000:]  # the last checkpoint before the loss, or later
    assert "(restart 1)" in log and (run / "DONE").exists()
    d = _digest()
    a, b = d.values(str(run)), d.values(str(ref))
    assert len(a) > iterations and a.keys() == b.keys()
    differ = {k: (a[k], b[k]) for k in a if a[k] != b[k]}
    assert not differ, f"{len(differ)} of {len(a)} values differ from the uninterrupted run: {list(differ.items())[:5]}"
    assert d.exports(str(run)) == d.exports(str(ref))


def test_down_leaves_nothing_running(cluster):
    """The teardown the fixture also runs: afterwards no Slurm or munge daemon, no process in a
    node's namespace, no namespace and no bridge remain."""
    down = _cluster("down")
    assert down.returncode == 0, down.stderr
    ps = subprocess.run(["ps", "-eo", "comm="], capture_output=True, text=True).stdout.split()
    assert not [p for p in ps if p in DAEMONS], ps
    netns = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert not [n for n in NODES if f"mrl-{n}" in netns], netns
    assert subprocess.run(["ip", "link", "show", "mrlbr0"], capture_output=True).returncode != 0
    assert _cluster("status").returncode != 0
    # and it comes back: up after down is a working cluster again, and down is idempotent
    assert _cluster("up").returncode == 0 and _cluster("status").returncode == 0
    assert _cluster("down").returncode == 0 and _cluster("down").returncode == 0
