"""The program's filesystem: a root built for it by bubblewrap, holding nothing but an interpreter.

Read-only: ``/usr`` (and the top-level ``/bin``, ``/lib*``, ``/sbin`` as the host has them,
links or directories), the dynamic loader's cache, and the interpreter's own prefixes when they
live elsewhere (a pyenv or venv Python).  Writable: the program's box (its cwd) and private,
size-bounded tmpfs over ``/tmp``, ``/var/tmp`` and ``/dev/shm``.  Plus a ``/proc`` of its own pid
namespace and a minimal ``/dev``.  Nothing else exists in it: no data files, run directory,
checkpoints, project, home directories or mounted volumes.  New network, pid, IPC, UTS and
cgroup namespaces; the sandbox dies with its parent.  A root trainer keeps only CAP_SETUID and
CAP_SETGID in it, which the launcher gives up when it drops to the sandbox user.
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import subprocess
from typing import Sequence

__all__ = ["BOX", "find_bwrap", "visible_roots", "bwrap_argv", "BwrapUnavailable"]

_TOP_LEVEL = ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
_ETC = ("/etc/ld.so.cache", "/etc/ld.so.conf", "/etc/ld.so.conf.d", "/etc/localtime")
_NAMESPACES = ("--unshare-net", "--unshare-pid", "--unshare-ipc", "--unshare-uts", "--unshare-cgroup-try")


class BwrapUnavailable(RuntimeError):
    """bubblewrap is missing or cannot build a sandbox on this machine (the message says which)."""


@functools.lru_cache(maxsize=None)
def find_bwrap(path: str | None = None) -> str:
    """The bwrap executable, proven able to build a sandbox here (one probe per process)."""
    exe = path or shutil.which("bwrap") or next((p for p in ("/usr/bin/bwrap", "/bin/bwrap") if os.path.exists(p)), None)
    if exe is None:
        raise BwrapUnavailable("bubblewrap (bwrap) is not installed (Debian / Ubuntu: apt-get install bubblewrap)")
    probe = [exe, *_NAMESPACES, "--die-with-parent", "--ro-bind", "/", "/", "--proc", "/proc", "--", "/bin/true"]
    try:
        out = subprocess.run(probe, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise BwrapUnavailable(f"{exe} did not run: {e}") from None
    if out.returncode != 0:
        raise BwrapUnavailable(f"{exe} cannot build a sandbox on this machine (namespaces refused?): "
                               f"{out.stderr.strip()[-300:]}")
    return exe


@functools.lru_cache(maxsize=None)
def _interpreter_prefixes(python: str) -> tuple[str, ...]:
    """The directories ``python`` reads its standard library and packages from (asked once)."""
    code = "import json, sys; print(json.dumps([sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix]))"
    try:
        out = subprocess.run([python, "-I", "-S", "-c", code], capture_output=True, text=True, timeout=60)
        found = json.loads(out.stdout) if out.returncode == 0 else []
    except (OSError, subprocess.TimeoutExpired, ValueError):
        found = []
    return tuple(sorted({os.path.realpath(p) for p in found if p}))


def _covered(path: str, roots: Sequence[str]) -> bool:
    return any(path == r or path.startswith(r.rstrip("/") + "/") for r in roots)


def _as_seen_inside(path: str) -> str:
    """``path`` with a top-level link the sandbox replicates (``/bin -> usr/bin``) followed."""
    for d in _TOP_LEVEL:
        if (path == d or path.startswith(d + "/")) and os.path.islink(d):
            return os.path.normpath(os.path.join("/", os.readlink(d), path[len(d) + 1:]))
    return path


def visible_roots(python: str) -> list[str]:
    """Host paths the program can read: ``/usr``, real top-level library directories, the
    interpreter's prefixes and the interpreter itself (its path and its real path) where they lie
    outside those, and the loader's files."""
    roots = ["/usr"]
    roots += [d for d in _TOP_LEVEL if os.path.isdir(d) and not os.path.islink(d)]
    for p in (*_interpreter_prefixes(python), os.path.abspath(python), os.path.realpath(python)):
        if p and p != "/" and not _covered(_as_seen_inside(p), roots):
            roots.append(p)
    roots += [p for p in _ETC if os.path.exists(p)]
    return roots


BOX = "/box"


def bwrap_argv(bwrap: str, python: str, box: str, *, tmpfs_size: int, drop_user: bool) -> list[str]:
    """bubblewrap's arguments for one run: the host directory ``box`` is the program's writable
    directory, seen as ``/box`` (its host path says nothing to the program); the launcher enters
    it once it is the sandbox user (the box is that user's, mode 0700)."""
    argv = [bwrap, *_NAMESPACES, "--die-with-parent", "--new-session"]
    if drop_user:  # as root: keep only what the launcher's drop to the sandbox user needs
        argv += ["--cap-drop", "ALL", "--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID"]
    for d in _TOP_LEVEL:
        if os.path.islink(d):
            argv += ["--symlink", os.readlink(d), d]
    for r in visible_roots(python):
        argv += ["--ro-bind", r, r]
    argv += ["--proc", "/proc", "--dev", "/dev"]
    for d in ("/tmp", "/var/tmp", "/dev/shm"):
        argv += ["--size", str(tmpfs_size), "--perms", "1777", "--tmpfs", d]
    argv += ["--bind", box, BOX, "--chdir", "/", "--remount-ro", "/"]
    return argv
