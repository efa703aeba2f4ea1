"""The sandbox launcher: a standalone program, run as ``python -I -S -c <this file's source> CFG``.

It imports nothing of megarl (it runs before any site-packages, maybe inside a private root that
holds no megarl).  CFG is JSON; reports go to the inherited pipe ``report_fd`` as JSON lines:
``{"pid": n}`` after the fork, ``{"child": {...what took effect}}`` just before the exec,
``{"started": t}`` when the program's interpreter is about to compile ``main.py`` (t on
CLOCK_MONOTONIC, the trainer's clock too: no time namespace), then ``{"wait": status}`` when
the program ended; or ``{"setup_error": "..."}``.

Where the isolation is already in place (``provided``: bubblewrap built the namespaces and the
root), it only forks, sets the rlimits, drops to the sandbox user and execs the prelude; the
``unshare`` path builds the namespaces and private mounts itself first.  The parent stays to
time the program (``startup_limit_s``, then ``hard_limit_s`` from the program's start) should
the trainer be gone, and reports its wait status.
"""

import ctypes
import json
import math
import os
import resource
import signal
import sys
import time

SETUP_FAILED = 121
PR_SET_PDEATHSIG, PR_SET_NO_NEW_PRIVS = 1, 38
CLONE = {"netns": 0x40000000, "mountns": 0x00020000, "pidns": 0x20000000}
MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_BIND, MS_REC, MS_PRIVATE = 2, 4, 8, 4096, 16384, 1 << 18
STEPS = ("netns", "mountns", "pidns", "tmpfs", "proc", "rootfs", "user", "rlimits")


def main(cfg):
    fd = cfg["report_fd"]

    def report(obj):
        os.write(fd, (json.dumps(obj) + "\n").encode())

    def fail(msg):
        report({"setup_error": msg})
        os._exit(SETUP_FAILED)

    rep = {k: bool(cfg.get("provided", {}).get(k, False)) for k in STEPS}
    try:
        libc = ctypes.CDLL(None, use_errno=True)
    except OSError as e:
        libc = None
        if cfg["strict"]:
            fail("no libc for prctl / unshare: %s" % e)
    if libc is not None:
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)  # the launcher dies with the trainer

    def errno_msg(what):
        return "%s: %s" % (what, os.strerror(ctypes.get_errno()))

    if libc is not None and cfg["unshare"]:
        private_mounts(cfg, libc, rep, fail, errno_msg)
    # the start pipe: the program's interpreter writes its start time on it (the prelude) and
    # closes it before the program runs; EOF without a time means it died first
    start_r, start_w = os.pipe()
    pid = os.fork()
    if pid:
        os.close(start_w)
        report({"pid": pid})
        wait_for(pid, start_r, cfg, report)
    try:
        os.close(start_r)
        if cfg["unshare"] and rep["pidns"] and rep["mountns"] and libc is not None:
            rep["proc"] = libc.mount(b"proc", b"/proc", b"proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, None) == 0
        R = resource
        for lim, val in ((R.RLIMIT_CPU, (cfg["cpu_s"], cfg["cpu_s"] + 1)), (R.RLIMIT_AS, (cfg["as"], cfg["as"])),
                         (R.RLIMIT_FSIZE, (cfg["fsize"], cfg["fsize"])), (R.RLIMIT_NPROC, (cfg["nproc"], cfg["nproc"])),
                         (R.RLIMIT_NOFILE, (cfg["nofile"], cfg["nofile"])), (R.RLIMIT_CORE, (0, 0))):
            R.setrlimit(lim, val)
        rep["rlimits"] = True
        if os.getuid() == 0 and cfg["uid"] is not None:
            os.setgroups([])
            os.setgid(cfg["gid"])
            os.setuid(cfg["uid"])
            rep["user"] = os.getuid() == cfg["uid"] and os.geteuid() == cfg["uid"]
        elif cfg["strict"]:
            fail("not root: cannot drop to an unprivileged user")
        if cfg.get("chdir"):  # as the sandbox user: its box is its own (0700)
            os.chdir(cfg["chdir"])
        if libc is not None:
            libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)  # again: the uid change cleared it
            libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0)  # no set-uid program regains privileges
        if cfg["strict"] and not all(rep.values()):
            fail("isolation incomplete: %s" % rep)
        os.set_inheritable(fd, False)  # FD_CLOEXEC: the program never holds the report pipe
        os.set_inheritable(start_w, True)  # the prelude's, closed by it before the program runs
        report({"child": rep})
        os.execve(cfg["argv"][0], cfg["argv"] + [str(start_w)], cfg["env"])
    except BaseException as e:
        fail("%s: %s" % (type(e).__name__, e))


def private_mounts(cfg, libc, rep, fail, errno_msg):
    """The ``unshare`` path: new network, mount and pid namespaces, private tmpfs over the
    world-writable directories (the work dir, when under one, bound back at its path)."""
    for name in ("netns", "mountns", "pidns"):
        if libc.unshare(CLONE[name]) == 0:
            rep[name] = True
        elif cfg["strict"]:
            fail(errno_msg("unshare " + name))
    if not rep["mountns"]:
        return
    if libc.mount(b"none", b"/", None, MS_REC | MS_PRIVATE, None) != 0:
        fail(errno_msg("make mounts private"))
    ok = True
    cwd = os.getcwd()
    box_fd = os.open(".", os.O_RDONLY)
    for d in ("/tmp", "/var/tmp", "/dev/shm"):
        if os.path.isdir(d) and not os.path.islink(d):
            opts = ("size=%d,mode=1777" % cfg["tmpfs_size"]).encode()
            if libc.mount(b"tmpfs", d.encode(), b"tmpfs", MS_NOSUID | MS_NODEV, opts) != 0:
                ok = False
                if cfg["strict"]:
                    fail(errno_msg("mount tmpfs on " + d))
            elif cwd.startswith(d + "/"):
                os.makedirs(cwd, 0o711)  # the work dir was under d: bound back at its path
                if libc.mount(("/proc/self/fd/%d" % box_fd).encode(), cwd.encode(), None, MS_BIND, None) != 0:
                    fail(errno_msg("bind the work dir into the private " + d))
    os.chdir(cwd)
    os.close(box_fd)
    rep["tmpfs"] = ok


def wait_for(pid, start_r, cfg, report):
    """The parent: the program's start time, then its end; its own limits should the trainer
    be gone (``startup_limit_s`` from the fork, ``hard_limit_s`` from the program's start)."""
    def expire(*_):
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass

    signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, cfg["startup_limit_s"])
    line = b""
    while not line.endswith(b"\n"):
        chunk = os.read(start_r, 64)
        if not chunk:
            break
        line += chunk
    os.close(start_r)
    try:
        t = float(line.decode())
    except ValueError:
        t = None
    if t is not None and math.isfinite(t):
        report({"started": t})
        signal.setitimer(signal.ITIMER_REAL, max(cfg["hard_limit_s"] - (time.monotonic() - t), 1e-3))
    while True:
        try:
            _, status = os.waitpid(pid, 0)
            break
        except InterruptedError:
            continue
    report({"wait": status})
    os._exit(0)


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
