"""reward.fn: code_exec -- the program failing is a score with its reason, the sandbox failing a
status; hostile programs (loops, fork / memory bombs, writes outside the box, reading the
trainer's environment) are contained and leave nothing behind; the program's clock counts the
program, start-up has its own bound.

The isolation tests assert what this machine (and CI: Linux, root, namespaces) provides; where a
step is missing they skip saying so, they never pass without checking."""

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import psutil
import pytest

from megarl.experience.schema import RewardStatus
from megarl.rewards import CodeExec, RewardConfigError, RewardRunner, RewardSample, build_reward_function
from megarl.rewards.code_exec import extract_program
from tests._dist import ROOT

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the sandbox needs Linux rlimits")

SECRET = "trainer-secret-9c2d41"
ADD = [{"input": "1 2\n", "output": "3\n"}, {"input": "10 -4\n", "output": "6"}]


def sample(program: str, fenced: bool = True, **gt) -> RewardSample:
    text = f"Here you go:\n```python\n{program}\n```\nDone." if fenced else program
    return RewardSample(sample_id="s0", prompt_id="p0", group_id="g0", prompt_text="add two numbers",
                        response_text=text, prompt_ids=(1,), response_ids=(2,), finish_reason="eos",
                        ground_truth=gt)


def sandbox_pids() -> set[int]:
    me = psutil.Process()
    kids = {p.pid for p in me.children(recursive=True)}
    # uids is None for a process that vanished mid-iteration (or one psutil may not read)
    nobody = {p.pid for p in psutil.process_iter(["uids"]) if p.info["uids"] and p.info["uids"].real == 65534}
    return kids | nobody


@pytest.fixture
def no_leftovers():
    before = sandbox_pids()
    yield
    deadline = time.monotonic() + 3.0  # an orphaned zombie is reaped by init shortly
    while (left := sandbox_pids() - before) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not left, f"sandbox processes left behind: {left}"


@pytest.fixture(params=["auto", "unshare"])
def fn(request, monkeypatch, no_leftovers):
    """The default sandbox (bubblewrap where it runs: CI installs it) and the unshare fallback."""
    monkeypatch.setenv("MEGARL_TEST_TRAINER_SECRET", SECRET)
    return build_reward_function("code_exec", {"timeout_s": 2.0, "memory_mb": 256, "max_procs": 16,
                                                "sandbox": request.param})


def require(f: CodeExec, step: str, what: str) -> None:
    """Skip, naming what is untested, unless isolation ``step`` took effect on ``f``'s last run."""
    if f.metrics().get(f"isolation/{step}") != 1.0:
        pytest.skip(f"no {step} on this machine (needs root or CAP_SYS_ADMIN): {what} is not tested")


def slow_interpreter(directory: str, delay_s: float, real: str) -> str:
    """An executable that sleeps ``delay_s`` and then execs ``real`` with its arguments: start-up
    made slow deterministically (a loaded machine, minus the load)."""
    path = os.path.join(directory, "slow-python")
    with open(path, "w") as f:
        f.write(f'#!/bin/sh\nsleep {delay_s}\nexec {real} "$@"\n')
    os.chmod(path, 0o755)
    return path


@pytest.fixture
def shared_dir():
    """A directory outside any home that the sandbox user may read (and write), for runs without
    the mount namespace (which would hide the host's /tmp)."""
    d = tempfile.mkdtemp(prefix="megarl-test-code-")
    os.chmod(d, 0o777)
    yield d
    shutil.rmtree(d, ignore_errors=True)


def ticks(stdout: str) -> list[float]:
    """The monotonic times a tick program printed (a line cut by the kill is not one)."""
    out = []
    for line in stdout.splitlines():
        try:
            out.append(float(line))
        except ValueError:
            pass
    return out


# prints CLOCK_MONOTONIC (the test's clock too) every 20 ms until killed
TICK = "import time\nwhile True:\n    print(time.monotonic(), flush=True)\n    time.sleep(0.02)\n"


def comps(rec):
    assert rec.status is RewardStatus.OK, rec
    return dict(rec.components)


def test_extract_program():
    assert extract_program("a\n```python\nx=1\n```\nb\n```py\nx=2\n```\n") == "x=2\n"
    assert extract_program("no code") is None
    assert extract_program("x=3", source="whole") == "x=3"


def test_correct_program_scores_one(fn):
    rec = fn(sample("a, b = map(int, input().split())\nprint(a + b)", tests=ADD))
    assert rec.total == 1.0 and comps(rec) == {"tests_passed": 2.0, "tests_total": 2.0}
    rec = fn(sample("def add(a, b):\n    return a + b", asserts=["assert add(1, 2) == 3", "assert add(2, 2) == 4"]))
    assert rec.total == 1.0, rec
    assert fn.metrics()["isolation/rlimits"] == 1.0


def test_wrong_answer_and_program_errors_are_scores(fn):
    rec = fn(sample("a, b = map(int, input().split())\nprint(a - b if a > 5 else a + b)", tests=ADD))
    assert rec.total == 0.5 and comps(rec)["fail/wrong_answer"] == 1.0 and comps(rec)["tests_passed"] == 1.0
    rec = fn(sample("def add(a, b):\n    return a - b", asserts="assert add(1, 2) == 3"))
    assert rec.total == 0.0 and comps(rec)["fail/runtime_error"] == 1.0
    rec = fn(sample("print(1 +", tests=ADD))
    assert rec.total == 0.0 and comps(rec)["fail/syntax_error"] == 2.0
    rec = fn(sample("I cannot write code.", fenced=False, tests=ADD))
    assert rec.total == 0.0 and comps(rec)["fail/no_code"] == 1.0
    # exiting before the asserts run does not pass them
    rec = fn(sample("import sys\nsys.exit(0)", asserts="assert False"))
    assert rec.total == 0.0 and comps(rec)["fail/wrong_answer"] == 1.0


def test_mode_all():
    f = CodeExec(mode="all", timeout_s=2.0)
    rec = f(sample("a, b = map(int, input().split())\nprint(a + b if a < 5 else 0)", tests=ADD))
    assert rec.total == 0.0 and rec.components["tests_passed"] == 1.0 and rec.components["fail/wrong_answer"] == 1.0


def test_infinite_loop_is_a_timeout_score(fn):
    t = time.monotonic()
    rec = fn(sample("while True:\n    pass", tests=ADD[:1]))
    assert rec.total == 0.0 and comps(rec)["fail/timeout"] == 1.0
    assert time.monotonic() - t < 20  # 2 s wall limit; generous for a loaded CI machine


def test_fork_bomb_is_contained(fn):
    bomb = ("import os, time\n"
            "for _ in range(100000):\n"
            "    try:\n        os.fork()\n    except OSError:\n        time.sleep(0.01)\n")
    rec = fn(sample(bomb, tests=ADD[:1]))
    assert rec.total == 0.0 and ("fail/timeout" in comps(rec) or "fail/runtime_error" in comps(rec)), rec
    # children that left the process group (setsid) die with the pid namespace
    escape = "import os, time\nif os.fork() == 0:\n    os.setsid()\n    time.sleep(60)\nprint(3)"
    rec = fn(sample(escape, tests=ADD[:1]))
    require(fn, "pidns", "that a setsid() child dies with the program")
    assert rec.total == 1.0


def test_memory_bomb_is_a_memory_score(fn):
    rec = fn(sample("x = bytearray(1 << 34)", tests=ADD[:1]))
    assert rec.total == 0.0 and comps(rec)["fail/memory"] == 1.0
    rec = fn(sample("a = []\nwhile True:\n    a.append(bytearray(1 << 24))", tests=ADD[:1]))
    assert rec.total == 0.0 and comps(rec)["fail/memory"] == 1.0


def test_writes_outside_the_box_are_contained(fn, tmp_path):
    repo_file = os.path.join(ROOT, "pwned_by_sandbox.txt")
    host_tmp = "/tmp/megarl_sandbox_escape_x"
    for p in (repo_file, host_tmp):
        if os.path.exists(p):
            os.remove(p)
    prog = (f"open({host_tmp!r}, 'w').write('x')\n"   # a private tmpfs (or denied): never the host's /tmp
            "open('inside.txt', 'w').write('ok')\n"      # its own box is writable
            f"open({repo_file!r}, 'w').write('x')\n")    # the repo is not (PermissionError)
    try:
        rec = fn(sample(prog, tests=[{"input": "", "output": ""}]))
        assert rec.total == 0.0 and comps(rec)["fail/runtime_error"] == 1.0
        assert not os.path.exists(repo_file)
        # a file past RLIMIT_FSIZE
        f = CodeExec(timeout_s=2.0, max_file_bytes=1 << 16)
        rec = f(sample("open('big', 'wb').write(b'x' * (1 << 20))", tests=[{"input": "", "output": ""}]))
        assert rec.total == 0.0 and rec.components["fail/output_limit"] == 1.0
        require(fn, "tmpfs", "that the host's /tmp stays untouched")
        assert not os.path.exists(host_tmp)
    finally:  # a degraded machine, or a failure: the host is left as it was
        for p in (repo_file, host_tmp):
            if os.path.exists(p):
                os.remove(p)


def test_environment_is_not_inherited(fn):
    prog = "import os\nprint(sorted(os.environ.items()))\nprint(open('/proc/self/environ').read())\n"
    run = fn._run(prog, "")
    assert run["rc"] == 0, run
    assert SECRET not in run["stdout"] + run["stderr"]
    assert "MEGARL_TEST_TRAINER_SECRET" not in run["stdout"]
    assert "PATH" in run["stdout"]
    rec = fn(sample("import os\nprint(os.environ)", tests=ADD[:1]))
    assert SECRET not in str(rec.to_json())


def test_network_is_unreachable(fn):
    run = fn._run("import socket\nsocket.create_connection(('127.0.0.1', 22), timeout=1)\n", "")
    require(fn, "netns", "that the program has no network")
    assert run["rc"] == 1 and ("Network is unreachable" in run["stderr"] or "Connection refused" in run["stderr"]), run


def test_program_runs_as_the_sandbox_user(fn):
    if os.geteuid() != 0:
        pytest.skip("the trainer is not root: no user drop to test (the program runs as the trainer's user)")
    run = fn._run("import os\nprint(os.getuid(), os.getgid(), os.getgroups())", "")
    assert fn.metrics()["isolation/user"] == 1.0
    assert run["stdout"].split() == ["65534", "65534", "[]"], run


def test_sandbox_failure_is_a_status_and_bad_rows_invalid():
    f = CodeExec(timeout_s=2.0, python="/usr/bin/python3" if os.path.exists("/usr/bin/python3") else sys.executable)
    f.python = "/nonexistent/python"  # the launcher cannot exec it: a sandbox failure, not a score
    rec = f(sample("print(3)", tests=ADD))
    assert rec.status is RewardStatus.ERROR and rec.total is None and rec.error.startswith("[sandbox]"), rec
    assert f.metrics()["sandbox_errors"] == 1
    f.python = "/bin/false"  # an interpreter that never comes up: none of the candidate's code ran
    rec = f(sample("print(3)", tests=ADD))
    # with bubblewrap the launcher runs on the program's interpreter too (the only one in the root)
    said = ("exited with 1 before starting the program" if f.sandbox == "bwrap"
            else "ended before the program started (exit code 1)")
    assert rec.status is RewardStatus.ERROR and said in rec.error, rec
    rec = f(sample("print(3)"))
    assert rec.status is RewardStatus.INVALID and rec.total is None
    rec = f(sample("print(3)", tests=[{"input": 1}]))
    assert rec.status is RewardStatus.INVALID
    with pytest.raises(RewardConfigError, match="mode"):
        CodeExec(mode="most")


def test_through_the_runner(fn):
    with RewardRunner(fn, timeout_s=20.0, max_workers=2) as runner:
        recs = runner.score([sample("a, b = map(int, input().split())\nprint(a + b)", tests=ADD),
                             sample("while True: pass", tests=ADD[:1])])
    assert [r.total for r in recs] == [1.0, 0.0]
    assert runner.counters["ok"] == 2 and runner.counters["failed"] == 0


def test_degraded_platform_still_limits_and_says_so():
    """Without namespaces and the user drop (what a non-root Linux gets) the rlimits and the wall
    kill still apply, metrics say what is missing, and strict mode refuses to run."""
    f = CodeExec(timeout_s=2.0, namespaces=False, uid=None, gid=None, memory_mb=256)
    rec = f(sample("a, b = map(int, input().split())\nprint(a + b)", tests=ADD))
    assert rec.total == 1.0
    m = f.metrics()
    assert m["isolation/netns"] == 0.0 and m["isolation/pidns"] == 0.0 and m["isolation/user"] == 0.0
    assert m["isolation/rlimits"] == 1.0 and m["isolation/rootfs"] == 0.0 and f.visible_paths() is None
    rec = f(sample("x = bytearray(1 << 34)", tests=ADD[:1]))
    assert rec.components["fail/memory"] == 1.0
    # strict refuses to run at all, naming what is missing
    with pytest.raises(RewardConfigError, match="strict: true needs namespaces"):
        CodeExec(timeout_s=2.0, namespaces=False, strict=True)
    with pytest.raises(RewardConfigError, match="strict: true needs sandbox: bwrap or auto"):
        CodeExec(timeout_s=2.0, sandbox="unshare", strict=True)
    with pytest.raises(RewardConfigError, match="uid/gid"):
        CodeExec(timeout_s=2.0, uid=None, gid=None, strict=True)
    with pytest.raises(RewardConfigError, match="sandbox must be one of"):
        CodeExec(sandbox="docker")


def test_trainer_death_takes_the_sandbox_along(shared_dir):
    """The scoring process is SIGKILLed mid-run (a reward worker killed on its timeout, the trainer
    crashing): the launcher dies with it, the program and everything it forked with the launcher."""
    code = ("import sys\nsys.path.insert(0, %r)\nfrom megarl.rewards.code_exec import CodeExec\n"
            "c = CodeExec(timeout_s=60)\nprint('start', flush=True)\n"
            "c._run('import os, time\\nos.fork()\\ntime.sleep(1000)', '')\n"
            % ROOT)
    # its work directory, which it has no chance to remove, goes where the fixture removes it
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True,
                            env=dict(os.environ, TMPDIR=shared_dir))
    try:
        assert proc.stdout.readline().strip() == "start"
        deadline = time.monotonic() + 30
        while len(psutil.Process(proc.pid).children(recursive=True)) < 3 and time.monotonic() < deadline:
            time.sleep(0.05)
        kids = psutil.Process(proc.pid).children(recursive=True)
        assert len(kids) >= 3, kids  # launcher, program, its fork
    finally:
        proc.kill()
        proc.wait()
    deadline = time.monotonic() + 15
    alive = kids
    while alive and time.monotonic() < deadline:
        time.sleep(0.05)
        alive = [k for k in kids if k.is_running() and k.status() != psutil.STATUS_ZOMBIE]
    assert not alive, alive


# --- the program's clock and start-up's bound ----------------------------------------------------
# Start-up is made slow by wrapping an executable in `sleep; exec`: the one that spawns the sandbox
# (bubblewrap, or the unshare launcher's interpreter, sys.executable: the sandbox's whole start-up,
# namespaces and user drop included, comes after it) or the program's (`python=`: between the
# launcher's exec and the prelude's report).

def slow_spawn(f: CodeExec, monkeypatch, directory: str, delay_s: float) -> None:
    """Make the executable that spawns ``f``'s sandbox take ``delay_s`` to start."""
    if f.sandbox == "bwrap":
        monkeypatch.setattr(f, "bwrap", slow_interpreter(directory, delay_s, f.bwrap))
    else:
        monkeypatch.setattr(sys, "executable", slow_interpreter(directory, delay_s, sys.executable))

def test_slow_startup_is_not_charged_to_the_program(monkeypatch, tmp_path, no_leftovers):
    """3 s of start-up before a 0.1 s program under timeout_s=2: it passes, and a program that
    loops still gets its whole timeout_s from its own start and is fail/timeout.  Negative
    control: with the clock started at the spawn (code_exec/1) the passing program was a
    sandbox error ("did not start the program within timeout_s") and the looping one never ran.
    (timeout_s is the other tests' 2 s, not tighter: on a 2-core machine at load 8 a 0.1 s sleep
    was seen to end 0.6 s after the program's start -- the machine slowing the program itself,
    which a wall clock cannot tell from the program being slow.)"""
    f = CodeExec(timeout_s=2.0)
    delay_s = 3.0
    slow_spawn(f, monkeypatch, str(tmp_path), delay_s)
    t = time.monotonic()
    rec = f(sample("import time\ntime.sleep(0.1)\na, b = map(int, input().split())\nprint(a + b)", tests=ADD[:1]))
    assert rec.status is RewardStatus.OK and rec.total == 1.0, rec
    assert time.monotonic() - t >= delay_s
    assert f.metrics()["isolation/rlimits"] == 1.0
    t = time.monotonic()
    run = f._run(TICK, "")
    assert run["timed_out"] and run["startup_s"] >= delay_s, run
    # the program's wall from its start: the trainer's measure, and the program's own ticks
    assert f.timeout_s <= run["wall_s"] < f.timeout_s + 10, run
    ts = ticks(run["stdout"])
    assert ts and ts[0] - t >= delay_s, (t, ts[:1])  # it started after the start-up
    # and ran for its limit, less its first and last tick's lag (half of it on a loaded machine)
    assert ts[-1] - ts[0] >= f.timeout_s / 2, ts
    assert f._verdict(run, "", None) == "timeout"  # fail/timeout (test_infinite_loop_is_a_timeout_score)


def test_slow_interpreter_start_is_not_charged_to_the_program(shared_dir, no_leftovers):
    """The program's own interpreter takes 3 s to come up (after the launcher's exec, before
    main.py): not the program's time either.  Negative control: the clock started at the
    launcher's exec report ("child") or at the spawn made this fail/timeout.  Without the mount
    namespace: it would hide the wrapper, which lives in the host's /tmp."""
    f = CodeExec(timeout_s=2.0, namespaces=False, python=slow_interpreter(shared_dir, 3.0, CodeExec().python))
    rec = f(sample("import time\ntime.sleep(0.1)\na, b = map(int, input().split())\nprint(a + b)", tests=ADD[:1]))
    assert rec.status is RewardStatus.OK and rec.total == 1.0, rec
    run = f._run("import sys\nprint(sys.argv, __name__)", "")
    assert run["startup_s"] >= 3.0 and run["stdout"].split() == ["['main.py']", "__main__"], run


def test_startup_past_its_bound_is_a_sandbox_status(monkeypatch, tmp_path, shared_dir, no_leftovers):
    """Start-up longer than startup_timeout_s is status error naming the bound, never a score with
    fail/timeout, and it is cut at the bound.  Negative control: code_exec/1 scored a slow
    interpreter start-up (after the launcher's "child" report) as fail/timeout."""
    f = CodeExec(timeout_s=5.0, startup_timeout_s=0.5)
    with monkeypatch.context() as m:  # a slow spawn
        slow_spawn(f, m, str(tmp_path), 6)
        t = time.monotonic()
        rec = f(sample("print(3)", tests=ADD[:1]))
        took = time.monotonic() - t
    assert rec.status is RewardStatus.ERROR and rec.total is None and not rec.components, rec
    assert rec.error.startswith("[sandbox]") and "startup_timeout_s=0.5" in rec.error, rec
    assert took < 5.0, took  # killed at the bound, not when the 6 s start-up ended
    got = f.metrics()
    assert got["startup_timeouts"] == 1 and got["sandbox_errors"] == 1 and got["timeouts"] == 0 and got["runs"] == 0, got
    # a slow program interpreter
    g = CodeExec(timeout_s=5.0, startup_timeout_s=0.5, namespaces=False,
                 python=slow_interpreter(shared_dir, 6, CodeExec().python))
    rec = g(sample("print(3)", tests=ADD[:1]))
    assert rec.status is RewardStatus.ERROR and "startup_timeout_s=0.5" in rec.error and not rec.components, rec
    assert g.metrics()["startup_timeouts"] == 1 and g.metrics()["timeouts"] == 0


def test_cpu_limit_is_the_programs():
    """RLIMIT_CPU counts the program's process from the launcher's fork; what start-up (the
    interpreter, the prelude) has used of it when main.py's first line runs is a sliver of the
    smallest cpu_s (1 s)."""
    f = CodeExec(timeout_s=30.0, cpu_s=1)
    run = f._run("import time\nprint(time.process_time(), flush=True)\nwhile True:\n    pass\n", "")
    # the kernel does not deliver SIGXCPU (soft limit) to a pid namespace's init, only the hard
    # limit's SIGKILL; either way RLIMIT_CPU ended it, not the 30 s wall clock.  The unshare
    # launcher's program is its namespace's init; under bubblewrap it is not (bwrap's reaper is)
    init = f.sandbox == "unshare" and f.metrics()["isolation/pidns"] == 1.0
    cpu_kill = signal.SIGKILL if init else signal.SIGXCPU
    assert run["signal"] == cpu_kill and not run["timed_out"] and run["wall_s"] < f.timeout_s, run
    assert float(run["stdout"].split()[0]) < 0.2, run["stdout"]
    assert f._verdict(run, "", None) == "timeout"


def test_launcher_hard_limit_counts_from_the_program_start(shared_dir):
    """The trainer hangs (SIGSTOPped) after spawning the sandbox: the launcher kills the program by
    itself timeout_s + 2 after the program's start.  Negative control: counted from the launcher's
    fork (code_exec/1), 3 s of interpreter start-up left the program 1 s of its 4."""
    timeout_s = 2.0
    hard_limit_s = timeout_s + 2.0  # the launcher's margin over the trainer's kill (module docstring)
    tick_file = os.path.join(shared_dir, "ticks")
    with open(tick_file, "w"):
        pass
    os.chmod(tick_file, 0o666)
    prog = (f"import time\nf = open({tick_file!r}, 'a')\nwhile True:\n"
            "    f.write('%r\\n' % time.monotonic()); f.flush(); time.sleep(0.02)\n")
    code = ("import json, sys\nsys.path.insert(0, %r)\nfrom megarl.rewards.code_exec import CodeExec\n"
            "c = CodeExec(timeout_s=%r, namespaces=False, python=%r)\nprint('start', flush=True)\n"
            "r = c._run(%r, '')\nprint(json.dumps({k: r[k] for k in ('rc', 'signal', 'timed_out')}), flush=True)\n"
            % (ROOT, timeout_s,
               slow_interpreter(shared_dir, 3.0, CodeExec().python), prog))
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True,
                            env=dict(os.environ, TMPDIR=shared_dir))  # its work dir, should it be killed
    try:
        assert proc.stdout.readline().strip() == "start"
        deadline = time.monotonic() + 30
        while not psutil.Process(proc.pid).children() and time.monotonic() < deadline:
            time.sleep(0.01)
        launcher = psutil.Process(proc.pid).children()[0]
        os.kill(proc.pid, signal.SIGSTOP)  # long before its own deadline: 3 s + timeout_s after the spawn
        deadline = time.monotonic() + 30
        while launcher.status() != psutil.STATUS_ZOMBIE and time.monotonic() < deadline:
            time.sleep(0.05)
        assert launcher.status() == psutil.STATUS_ZOMBIE, "the launcher did not end the program by itself"
        with open(tick_file) as f:
            ts = ticks(f.read())
        # its first and last tick lag its start and kill (a loaded machine: up to ~0.5 s each);
        # a limit from the fork would have left it hard_limit_s - 3 = 1 s
        assert ts and hard_limit_s - 1.5 <= ts[-1] - ts[0] < hard_limit_s + 5, (ts[:1], ts[-1:])
        os.kill(proc.pid, signal.SIGCONT)
        out, _ = proc.communicate(timeout=30)
        assert json.loads(out)["signal"] == signal.SIGKILL, out  # a timeout score, by the launcher's kill
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGCONT)
            proc.kill()
            proc.wait()


def test_startup_timeout_s_is_a_kwarg_outside_the_version():
    f = build_reward_function("code_exec", {"timeout_s": 3, "startup_timeout_s": 7})
    assert f.startup_timeout_s == 7.0 and f.timeout_s == 3.0
    assert f.version == CodeExec(timeout_s=3).version and f.version.startswith("code_exec/3(")
    for bad in (0, -1, float("inf"), "10", True):
        with pytest.raises(RewardConfigError, match="startup_timeout_s"):
            build_reward_function("code_exec", {"startup_timeout_s": bad})


# --- the private root: the program sees its box and an interpreter, nothing of the task ----------

REPO = ROOT
MARKER = "answer-key-5f0e7d"


def _outside_tmp() -> str:
    """A world-traversable directory outside every tmpfs the unshare launcher makes private (/tmp,
    /var/tmp, /dev/shm), where a real run keeps its data: the project's directory when it is not
    under one of them (a clone in /tmp is), else the first of /var/lib, /srv, /opt."""
    for d in (REPO, "/var/lib", "/srv", "/opt"):
        if not d.startswith(("/tmp/", "/var/tmp/", "/dev/shm/")) and os.path.isdir(d) and os.access(d, os.W_OK) \
                and os.stat(d).st_mode & 0o001:
            return d
    pytest.skip("no world-traversable writable directory outside /tmp for the probe's files")


@pytest.fixture
def task_files():
    """A task's data and another run's checkpoint where a real run keeps them: world-readable
    files in a directory outside /tmp (beside the project) and one in the host's /tmp."""
    outside = tempfile.mkdtemp(prefix=".sandbox-probe-", dir=_outside_tmp())
    inside_tmp = tempfile.mkdtemp(prefix="megarl-probe-")
    paths = {"data": os.path.join(outside, "data", "train.jsonl"),
             "run": os.path.join(outside, "runs", "other", "checkpoints", "latest", "state.json"),
             "tmp": os.path.join(inside_tmp, "heldout.jsonl")}
    for d in (outside, inside_tmp):
        os.chmod(d, 0o755)
    for p in paths.values():
        os.makedirs(os.path.dirname(p), mode=0o755, exist_ok=True)
        with open(p, "w") as f:
            f.write(json.dumps({"prompt": "1 2", "answer": MARKER}) + "\n")
        os.chmod(p, 0o644)
        d = os.path.dirname(p)
        while d not in (outside, inside_tmp):
            os.chmod(d, 0o755)
            d = os.path.dirname(d)
    yield paths
    shutil.rmtree(outside, ignore_errors=True)
    shutil.rmtree(inside_tmp, ignore_errors=True)


# reads each path, then walks the whole disk for *.jsonl and state.json files and greps them
PROBE = """import os, sys
for p in sys.stdin.read().split():
    try:
        print("READ", p, open(p).read().strip())
    except OSError as e:
        print("DENIED", p, type(e).__name__)
for d, dirs, files in os.walk("/"):
    if d == "/proc":
        dirs[:] = []
        continue
    for name in files:
        if name.endswith(".jsonl") or name == "state.json":
            try:
                text = open(os.path.join(d, name), errors="replace").read(4096)
            except OSError:
                continue
            print("FOUND", os.path.join(d, name), "%s" in text)
""" % MARKER


def probe(f: CodeExec, paths) -> dict:
    run = f._run(PROBE, " ".join(paths.values()))
    assert run["rc"] == 0 and not run["timed_out"], run
    return run


def test_private_root_hides_the_task(task_files, no_leftovers):
    """Three probes a reward hacker would write -- open the task's data by its path, walk the disk
    for *.jsonl, read another run's checkpoint -- each finds nothing under bubblewrap.  Negative
    control: the same probe under the unshare launcher reads the data file and the other run's
    state by path and finds them on the walk (and the /tmp one only by path is hidden there too)."""
    f = CodeExec(timeout_s=60.0, memory_mb=256)
    if f.sandbox != "bwrap":
        pytest.skip("bubblewrap is not available here: the private root is not tested (.ci/run installs it)")
    run = probe(f, task_files)
    print(run["stdout"])  # the program's own report, for the record
    assert MARKER not in run["stdout"], run["stdout"]
    assert "READ" not in run["stdout"]
    for p in task_files.values():
        assert f"DENIED {p} FileNotFoundError" in run["stdout"], run["stdout"]
    assert f.metrics()["isolation/rootfs"] == 1.0
    found = [ln for ln in run["stdout"].splitlines() if ln.startswith("FOUND")]
    assert not any(ln.endswith("True") for ln in found), found
    # what it sees is what visible_paths() declares: the project and the run's files are not in it
    assert not any(REPO.startswith(r.rstrip("/") + "/") or REPO == r for r in f.visible_paths())

    ctl = CodeExec(timeout_s=60.0, memory_mb=256, sandbox="unshare")
    out = probe(ctl, task_files)["stdout"]
    assert f"READ {task_files['data']}" in out and f"READ {task_files['run']}" in out, out
    assert f"FOUND {task_files['data']} True" in out, out


def test_private_root_keeps_an_interpreter_and_contains_the_rest(no_leftovers):
    """What the program still has: the standard library, its box (writable), a private /tmp bounded
    by tmpfs_size, its own /proc; what it cannot: write the root, /usr or /dev/shm past its size,
    see host processes, reach the network."""
    f = CodeExec(timeout_s=20.0, memory_mb=256, tmpfs_size=1 << 20)
    if f.sandbox != "bwrap":
        pytest.skip("bubblewrap is not available here: the private root is not tested (.ci/run installs it)")
    prog = """import json, os, socket
out = {"cwd": os.getcwd(), "pids": sorted(int(p) for p in os.listdir("/proc") if p.isdigit())}
open("box.txt", "w").write("ok")
out["box"] = open("box.txt").read()
for path in ("/root_file", "/usr/x", "/etc/x"):
    try:
        open(path, "w")
        out[path] = "written"
    except OSError as e:
        out[path] = type(e).__name__
try:
    with open("/tmp/big", "wb") as fh:
        for _ in range(4):
            fh.write(b"x" * (1 << 19))
    out["tmp"] = "written"
except OSError as e:
    out["tmp"] = e.errno
try:
    socket.create_connection(("1.1.1.1", 53), timeout=1)
    out["net"] = "connected"
except OSError as e:
    out["net"] = type(e).__name__
import decimal, fractions, json as j2  # the standard library is there
print(json.dumps(out))
"""
    run = f._run(prog, "")
    assert run["rc"] == 0, run
    out = json.loads(run["stdout"])
    assert out["cwd"] == "/box" and out["box"] == "ok", out
    assert all(out[p] in ("PermissionError", "OSError") for p in ("/root_file", "/usr/x", "/etc/x")), out
    assert out["tmp"] == 28, out  # ENOSPC: the private /tmp holds tmpfs_size bytes
    assert out["net"] != "connected", out
    assert max(out["pids"]) <= 8, out  # bwrap's reaper, the launcher, the program: no host process


def test_data_paths_a_program_can_see_are_refused_at_start_up(tmp_path):
    """A data file inside what the sandbox shows (an interpreter's prefix, /usr) is refused at
    start-up naming the key; one outside passes."""
    from omegaconf import OmegaConf

    from megarl.errors import ConfigError
    from megarl.rewards.config_checks import check_sandbox_hides_data

    class Shows:
        def visible_paths(self):
            return ["/usr", str(tmp_path / "prefix")]

    inside = tmp_path / "prefix" / "data" / "train.jsonl"
    cfg = OmegaConf.create({"data": {"train_path": str(inside), "heldout_path": str(tmp_path / "heldout.jsonl")},
                            "trainer": {"run_dir": str(tmp_path / "run")}})
    with pytest.raises(ConfigError, match=r"data.train_path: .*visible to the sandboxed program"):
        check_sandbox_hides_data(cfg, Shows())
    cfg.data.train_path = str(tmp_path / "train.jsonl")
    check_sandbox_hides_data(cfg, Shows())
    cfg.trainer.run_dir = "/usr/share/megarl-run"
    with pytest.raises(ConfigError, match="trainer.run_dir"):
        check_sandbox_hides_data(cfg, Shows())
    check_sandbox_hides_data(cfg, object())  # a reward that runs no program: nothing to check

    class Composite:  # a composite's parts are checked too
        parts = [("style", 1.0, object()), ("tests", 1.0, Shows())]

    with pytest.raises(ConfigError, match="trainer.run_dir"):
        check_sandbox_hides_data(cfg, Composite())
