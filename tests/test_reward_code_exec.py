"""reward.fn: code_exec -- the program failing is a score with its reason, the sandbox failing a
status; hostile programs (loops, fork / memory bombs, writes outside the box, reading the
trainer's environment) are contained and leave nothing behind."""

import os
import sys
import time

import psutil
import pytest

from megarl.experience.schema import RewardStatus
from megarl.rewards import CodeExec, RewardConfigError, RewardRunner, RewardSample, build_reward_function
from megarl.rewards.code_exec import extract_program

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
    try:
        nobody = {p.pid for p in psutil.process_iter(["uids"]) if p.info["uids"] and p.info["uids"].real == 65534}
    except psutil.Error:
        nobody = set()
    return kids | nobody


@pytest.fixture
def fn(monkeypatch):
    monkeypatch.setenv("MEGARL_TEST_TRAINER_SECRET", SECRET)
    before = sandbox_pids()
    f = build_reward_function("code_exec", {"timeout_s": 2.0, "memory_mb": 256, "max_procs": 16})
    yield f
    deadline = time.monotonic() + 3.0  # an orphaned zombie is reaped by init shortly
    while (left := sandbox_pids() - before) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not left, f"sandbox processes left behind: {left}"


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
    if fn.metrics()["isolation/pidns"] != 1.0:
        pytest.skip("no pid namespace here: a setsid() child escapes the process-group kill")
    assert rec.total == 1.0


def test_memory_bomb_is_a_memory_score(fn):
    rec = fn(sample("x = bytearray(1 << 34)", tests=ADD[:1]))
    assert rec.total == 0.0 and comps(rec)["fail/memory"] == 1.0
    rec = fn(sample("a = []\nwhile True:\n    a.append(bytearray(1 << 24))", tests=ADD[:1]))
    assert rec.total == 0.0 and comps(rec)["fail/memory"] == 1.0


def test_writes_outside_the_box_are_contained(fn, tmp_path):
    repo_file = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "pwned_by_sandbox.txt")
    host_tmp = "/tmp/megarl_sandbox_escape_x"
    for p in (repo_file, host_tmp):
        if os.path.exists(p):
            os.remove(p)
    prog = (f"open({host_tmp!r}, 'w').write('x')\n"   # a private tmpfs (or denied): never the host's /tmp
            "open('inside.txt', 'w').write('ok')\n"      # its own box is writable
            f"open({repo_file!r}, 'w').write('x')\n")    # the repo is not (PermissionError)
    rec = fn(sample(prog, tests=[{"input": "", "output": ""}]))
    assert rec.total == 0.0 and comps(rec)["fail/runtime_error"] == 1.0
    assert not os.path.exists(repo_file)
    if fn.metrics().get("isolation/tmpfs") == 1.0:
        assert not os.path.exists(host_tmp)
    # a file past RLIMIT_FSIZE
    f = CodeExec(timeout_s=2.0, max_file_bytes=1 << 16)
    rec = f(sample("open('big', 'wb').write(b'x' * (1 << 20))", tests=[{"input": "", "output": ""}]))
    assert rec.total == 0.0 and rec.components["fail/output_limit"] == 1.0


def test_environment_and_network_are_not_inherited(fn):
    prog = ("import os, socket\nprint(sorted(os.environ.items()))\n"
            "print(open('/proc/self/environ').read())\n"
            "socket.create_connection(('127.0.0.1', 22), timeout=1)\n")
    f = fn
    run = f._run(prog.replace("```", ""), "")
    assert SECRET not in run["stdout"] + run["stderr"]
    assert "MEGARL_TEST_TRAINER_SECRET" not in run["stdout"]
    assert "PATH" in run["stdout"]
    if f.metrics()["isolation/netns"] == 1.0:
        assert "Network is unreachable" in run["stderr"] or "Connection refused" in run["stderr"], run["stderr"]
    if os.geteuid() == 0:
        assert f.metrics()["isolation/user"] == 1.0
        uid = f._run("import os\nprint(os.getuid(), os.getgid(), os.getgroups())", "")["stdout"]
        assert uid.split()[:2] == ["65534", "65534"], uid
    rec = f(sample("import os\nprint(os.environ)", tests=ADD[:1]))
    assert SECRET not in str(rec.to_json())


def test_sandbox_failure_is_a_status_and_bad_rows_invalid():
    f = CodeExec(timeout_s=2.0, python="/usr/bin/python3" if os.path.exists("/usr/bin/python3") else sys.executable)
    f.python = "/nonexistent/python"  # the launcher cannot exec it: a sandbox failure, not a score
    rec = f(sample("print(3)", tests=ADD))
    assert rec.status is RewardStatus.ERROR and rec.total is None and rec.error.startswith("[sandbox]"), rec
    assert f.metrics()["sandbox_errors"] == 1
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
    assert m["isolation/rlimits"] == 1.0
    rec = f(sample("x = bytearray(1 << 34)", tests=ADD[:1]))
    assert rec.components["fail/memory"] == 1.0
    strict = CodeExec(timeout_s=2.0, namespaces=False, strict=True)
    rec = strict(sample("print(3)", tests=ADD[:1]))
    assert rec.status is RewardStatus.ERROR and "isolation incomplete" in rec.error, rec


def test_trainer_death_takes_the_sandbox_along():
    """The scoring process is SIGKILLed mid-run (a reward worker killed on its timeout, the trainer
    crashing): the launcher dies with it, the program and everything it forked with the launcher."""
    import subprocess

    code = ("import sys\nsys.path.insert(0, %r)\nfrom megarl.rewards.code_exec import CodeExec\n"
            "c = CodeExec(timeout_s=60)\nprint('start', flush=True)\n"
            "c._run('import os, time\\nos.fork()\\ntime.sleep(1000)', '')\n"
            % os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
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
