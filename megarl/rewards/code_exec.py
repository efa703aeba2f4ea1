"""Sandboxed code execution (``reward.fn: code_exec``): run the response's program against tests.

The program is the last fenced ```python block of the response (or the whole response with
``source: whole``); the tests come from the row's ground truth (``tests``: stdin / stdout pairs;
``asserts``: code appended to the program).  Reward: the fraction of tests passed (``mode:
fraction``) or 1.0 iff all pass (``all``), with ``tests_passed``, ``tests_total`` and
``fail/<reason>`` components.  The program failing is a score; the sandbox failing (start-up
past ``startup_timeout_s`` included) is status ``error``; a row without tests is ``invalid``.

Each run is one sandbox (:mod:`megarl.rewards.sandbox`): with bubblewrap (``sandbox: auto`` where
it runs, or ``bwrap``) a private root that holds an interpreter and the program's box and
nothing else; without it the hand-written ``unshare`` launcher, whose program can read the
host's files.  Both: no network, private ``/tmp``, own pid namespace, rlimits, an unprivileged
user, an empty environment, two clocks (start-up bounded by ``startup_timeout_s``, the program's
``timeout_s`` from its own start).  ``docs/rewards.md`` has the whole contract.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import secrets
import select
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any

from megarl.experience.schema import RewardRecord, RewardStatus
from megarl.rewards import sandbox as sb
from megarl.rewards.base import RewardConfigError, RewardSample

__all__ = ["CodeExec", "extract_program"]

log = logging.getLogger(__name__)

_FENCE = re.compile(r"```[ \t]*(?:python3?|py)[ \t]*\r?\n(.*?)```", re.DOTALL | re.IGNORECASE)
_MIN_ENV = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"}
_FAIL_REASONS = ("wrong_answer", "timeout", "memory", "runtime_error", "syntax_error", "output_limit", "no_code")
_SANDBOXES = ("auto", "bwrap", "unshare")

class _SandboxError(Exception):
    """The sandbox itself failed (not the program): becomes status error."""


def extract_program(text: str, source: str = "fenced") -> str | None:
    """The last fenced python block (``source="fenced"``) or the whole text (``"whole"``)."""
    if source == "whole":
        return text
    blocks = _FENCE.findall(text)
    return blocks[-1] if blocks else None


def _world_runnable(path: str) -> bool:
    """Can any user run ``path``: every directory on the way o+x, the file o+rx."""
    path = os.path.realpath(path)
    try:
        st = os.stat(path)
        if not (st.st_mode & stat.S_IROTH and st.st_mode & stat.S_IXOTH):
            return False
        d = os.path.dirname(path)
        while True:
            if not os.stat(d).st_mode & stat.S_IXOTH:
                return False
            if d == "/":
                return True
            d = os.path.dirname(d)
    except OSError:
        return False


def _norm(text: str) -> str:
    lines = [ln.rstrip() for ln in text.replace("\r\n", "\n").split("\n")]
    while lines and not lines[-1]:
        lines.pop()
    return "\n".join(lines)


def _read_capped(path: str, cap: int) -> tuple[str, bool]:
    with open(path, "rb") as f:
        data = f.read(cap + 1)
    return data[:cap].decode("utf-8", errors="replace"), len(data) > cap


class CodeExec:
    """Fraction (or all-or-nothing) of the row's tests the response's program passes, run in a
    sandbox; see the module docstring for the limits and what each failure becomes."""

    name = "code_exec"
    checks = "answer"  # what its score says about a response (declarations.component_checks)

    def __init__(
        self,
        mode: str = "fraction",
        source: str = "fenced",
        timeout_s: float = 5.0,
        startup_timeout_s: float = 30.0,
        cpu_s: int | None = None,
        memory_mb: int = 512,
        max_output_bytes: int = 64 << 10,
        max_file_bytes: int = 4 << 20,
        max_procs: int = 32,
        max_open_files: int = 64,
        tmpfs_size: int = 16 << 20,
        uid: int | None = 65534,
        gid: int | None = 65534,
        python: str | None = None,
        namespaces: bool = True,
        sandbox: str = "auto",
        bwrap: str | None = None,
        strict: bool = False,
        tests_key: str = "tests",
        asserts_key: str = "asserts",
    ):
        if mode not in ("fraction", "all"):
            raise RewardConfigError(f"code_exec mode must be 'fraction' or 'all', got {mode!r}")
        if source not in ("fenced", "whole"):
            raise RewardConfigError(f"code_exec source must be 'fenced' or 'whole', got {source!r}")

        def pos(name, v, integer=False):
            ok = isinstance(v, int) if integer else isinstance(v, (int, float))
            if isinstance(v, bool) or not ok or not math.isfinite(v) or v <= 0:
                raise RewardConfigError(f"code_exec {name} must be a positive {'integer' if integer else 'number'}, got {v!r}")
            return v

        self.mode, self.source = mode, source
        self.timeout_s = float(pos("timeout_s", timeout_s))
        self.startup_timeout_s = float(pos("startup_timeout_s", startup_timeout_s))
        self.cpu_s = int(pos("cpu_s", cpu_s, True)) if cpu_s is not None else max(1, math.ceil(self.timeout_s))
        self.memory_mb = int(pos("memory_mb", memory_mb, True))
        self.max_output_bytes = int(pos("max_output_bytes", max_output_bytes, True))
        self.max_file_bytes = int(pos("max_file_bytes", max_file_bytes, True))
        self.max_procs = int(pos("max_procs", max_procs, True))
        self.max_open_files = int(pos("max_open_files", max_open_files, True))
        self.tmpfs_size = int(pos("tmpfs_size", tmpfs_size, True))
        if (uid is None) != (gid is None):
            raise RewardConfigError("code_exec uid and gid must be given together (or both null: no user drop)")
        self.uid, self.gid = (None, None) if uid is None else (int(uid), int(gid))
        self.namespaces, self.strict = bool(namespaces), bool(strict)
        self.tests_key, self.asserts_key = str(tests_key), str(asserts_key)
        self.required_fields = ((self.tests_key, self.asserts_key),)  # at least one of them
        if python is None:
            dropping = self.uid is not None and os.geteuid() == 0
            cands = [sys.executable] + [p for p in ("/usr/bin/python3", "/usr/local/bin/python3", "/bin/python3")]
            python = next((p for p in cands if p and os.path.exists(p) and (not dropping or _world_runnable(p))), None)
            if python is None:
                raise RewardConfigError(
                    "code_exec: no Python the sandbox user can run (the trainer's may sit under a private home); "
                    "set reward.kwargs.python")
        elif not (os.path.isabs(python) and os.path.exists(python)):
            raise RewardConfigError(f"code_exec python must be an absolute path to an interpreter, got {python!r}")
        self.python = python
        self.sandbox, self.bwrap = self._resolve_sandbox(sandbox, bwrap)
        self._mlock = threading.Lock()
        self._m: dict[str, float] = {"runs": 0, "sandbox_errors": 0, "startup_timeouts": 0, "timeouts": 0, "samples": 0}
        self._isolation: dict[str, bool] = {}
        self._warned = False
        # /2: timeout_s counts from the program's start (/1 counted the sandbox's start-up too).
        # /3: the sandbox is named: a program that can read the host's files (the task's answers
        # among them) is scored under other rules than one that cannot.  startup_timeout_s is not
        # in it: it decides whether a run is scored at all (a status), never the score of one that is.
        self.version = (
            f"code_exec/3(mode={mode},source={source},timeout_s={self.timeout_s},cpu_s={self.cpu_s},"
            f"memory_mb={self.memory_mb},python={self.python},sandbox={self.sandbox})"
        )

    def _resolve_sandbox(self, sandbox: str, bwrap: str | None) -> tuple[str, str | None]:
        """``("bwrap", path)``, ``("unshare", None)`` or ``("none", None)`` (no namespaces).
        ``auto`` takes bubblewrap where it runs and says loudly what is lost where it does not;
        ``strict`` refuses to run without the private root and the user drop."""
        if sandbox not in _SANDBOXES:
            raise RewardConfigError(f"code_exec sandbox must be one of {list(_SANDBOXES)}, got {sandbox!r}")
        if self.strict:
            missing = [what for what, ok in (("namespaces", self.namespaces), ("sandbox: bwrap or auto", sandbox != "unshare"),
                                             ("root (for the drop to uid/gid)", os.geteuid() == 0),
                                             ("uid/gid", self.uid is not None)) if not ok]
            if missing:
                raise RewardConfigError(f"code_exec strict: true needs {', '.join(missing)}; "
                                        "or set strict: false to run with less isolation")
        if not self.namespaces:
            return "none", None
        if sandbox == "unshare":
            return "unshare", None
        try:
            return "bwrap", sb.find_bwrap(bwrap)
        except sb.BwrapUnavailable as e:
            if sandbox == "bwrap" or self.strict:
                raise RewardConfigError(f"code_exec sandbox: {sandbox}{' (strict)' if self.strict else ''}: {e}") from None
            log.warning("code_exec: %s; falling back to the unshare launcher: THE PROGRAM CAN READ THE HOST'S FILES, "
                        "the task's data and answers included (install bubblewrap, or set reward.kwargs.strict=true "
                        "to refuse to run without it)", e)
            return "unshare", None

    def visible_paths(self) -> list[str] | None:
        """Host paths a program can read (None: the whole filesystem, short of permissions)."""
        return sb.visible_roots(self.python) if self.sandbox == "bwrap" else None

    def metrics(self) -> dict[str, float]:
        """Runs, sandbox errors (of which ``startup_timeouts``: start-up past ``startup_timeout_s``),
        timeouts of programs, and ``isolation/<step>`` (1.0 / 0.0) of the last run."""
        with self._mlock:
            out = dict(self._m)
            out.update({f"isolation/{k}": float(v) for k, v in self._isolation.items()})
        return out

    # --- one run -------------------------------------------------------------------------------
    def _run(self, program: str, stdin: str) -> dict[str, Any]:
        """Run ``program`` once; {"rc", "signal", "timed_out", "stdout", "stderr", "stdout_truncated",
        "wall_s" (from the program's start), "startup_s" (spawn to the program's start)}.  Raises
        :class:`_SandboxError` when the sandbox (not the program) fails, start-up past
        ``startup_timeout_s`` included."""
        try:
            root = tempfile.mkdtemp(prefix="megarl-code-")
        except OSError as e:
            raise _SandboxError(f"cannot create a work directory: {e}") from None
        proc = None
        rfd = wfd = None
        try:
            box, drop, (fin, fout, ferr) = self._prepare_box(root, program, stdin)
            rfd, wfd = os.pipe()
            argv = self._launcher_argv(box, drop, wfd)
            t0 = time.monotonic()
            try:
                with fin, fout, ferr:
                    proc = subprocess.Popen(argv, stdin=fin, stdout=fout, stderr=ferr, cwd=box, env=dict(_MIN_ENV),
                                            start_new_session=True, pass_fds=(wfd,), close_fds=True)
            except OSError as e:
                raise _SandboxError(f"cannot spawn the sandbox: {e}") from None
            finally:
                os.close(wfd)
                wfd = None
            buf = bytearray()
            started, eof = self._await_start(rfd, buf, t0 + self.startup_timeout_s)
            t_start, timed_out = self._await_end(proc, buf, started, eof, t0)
            self._kill(proc)
            t_end = time.monotonic()
            self._drain(rfd, buf, 5.0)
            reports = self._parse(buf)
            if any("setup_error" in r for r in reports):
                err = next(r["setup_error"] for r in reports if "setup_error" in r)
                raise _SandboxError(f"sandbox setup failed: {err}")
            if started is None and not eof:
                with self._mlock:
                    self._m["startup_timeouts"] += 1
                raise _SandboxError(
                    f"sandbox did not start the program within startup_timeout_s={self.startup_timeout_s} "
                    "(spawning the launcher, namespaces, user drop, the interpreter's start-up)")
            child = next((r["child"] for r in reports if "child" in r), None)
            if child is None:
                err, _ = _read_capped(os.path.join(root, "stderr"), self.max_output_bytes)
                raise _SandboxError(f"sandbox launcher exited with {proc.returncode} before starting the program: "
                                    f"{err.strip()[-300:]!r}")
            with self._mlock:
                self._isolation = dict(child)
            if not self._warned and not all(child.values()):
                self._warned = True
                log.warning("code_exec: sandbox isolation incomplete on this machine: %s", child)
            status = next((r["wait"] for r in reports if "wait" in r), None)
            out, out_cut = _read_capped(os.path.join(root, "stdout"), self.max_output_bytes)
            err, _ = _read_capped(os.path.join(root, "stderr"), self.max_output_bytes)
            if started is None:  # none of the candidate's code ran: the interpreter did not come up
                how = ("no status" if status is None else f"signal {os.WTERMSIG(status)}" if os.WIFSIGNALED(status)
                       else f"exit code {os.WEXITSTATUS(status)}")
                raise _SandboxError(
                    f"the program's interpreter {self.python} ended before the program started ({how}): "
                    f"{err.strip()[-300:]!r}")
            rc = sig = None
            if status is not None:
                if os.WIFSIGNALED(status):
                    sig = os.WTERMSIG(status)
                elif os.WIFEXITED(status):
                    rc = os.WEXITSTATUS(status)
            elif not timed_out:
                raise _SandboxError(f"sandbox launcher exited with {proc.returncode} without the program's status")
            return {"rc": rc, "signal": sig, "timed_out": timed_out, "stdout": out, "stderr": err,
                    "stdout_truncated": out_cut, "wall_s": t_end - t_start, "startup_s": t_start - t0}
        finally:
            if proc is not None and proc.returncode is None:
                self._kill(proc)
            for fd in (rfd, wfd):
                if fd is not None:
                    os.close(fd)
            shutil.rmtree(root, ignore_errors=True)

    def _prepare_box(self, root: str, program: str, stdin: str):
        """``(box, drop, (stdin, stdout, stderr files))``: the program written into ``root/box``
        (owned by the sandbox user when ``drop``), its stdin beside it, its output files opened."""
        try:
            box = os.path.join(root, "box")
            os.mkdir(box, 0o700)
            drop = self.uid is not None and os.geteuid() == 0
            if drop:
                os.chmod(root, 0o711)  # the sandbox user may traverse to its box, not list root
                os.chown(box, self.uid, self.gid)
            with open(os.path.join(box, "main.py"), "w", encoding="utf-8") as f:
                f.write(program)
            with open(os.path.join(root, "stdin"), "w", encoding="utf-8") as f:
                f.write(stdin)
            if drop:
                os.chown(os.path.join(box, "main.py"), self.uid, self.gid)
            fin = open(os.path.join(root, "stdin"), "rb")
            fout = open(os.path.join(root, "stdout"), "wb")
            ferr = open(os.path.join(root, "stderr"), "wb")
        except OSError as e:
            raise _SandboxError(f"cannot prepare the work directory: {e}") from None
        return box, drop, (fin, fout, ferr)

    def _launcher_argv(self, box: str, drop: bool, wfd: int) -> list[str]:
        """The command that starts the launcher (inside bubblewrap for ``sandbox="bwrap"``) with
        its configuration: limits, user, environment, the report pipe ``wfd``."""
        cfg = {
            "report_fd": wfd, "strict": self.strict, "unshare": self.sandbox == "unshare", "tmpfs_size": self.tmpfs_size,
            "cpu_s": self.cpu_s, "as": self.memory_mb << 20, "fsize": self.max_file_bytes,
            "nproc": self.max_procs, "nofile": self.max_open_files,
            "uid": self.uid, "gid": self.gid, "env": _MIN_ENV,
            "startup_limit_s": self.startup_timeout_s + 2.0, "hard_limit_s": self.timeout_s + 2.0,
            "argv": [self.python, "-I", "-B", "-c", sb.PRELUDE],
        }
        if self.sandbox == "bwrap":  # the namespaces and the root are bubblewrap's; the launcher runs inside
            cfg["provided"] = dict.fromkeys(("netns", "mountns", "pidns", "tmpfs", "proc", "rootfs"), True)
            cfg["chdir"] = sb.BOX
            return sb.bwrap_argv(self.bwrap, self.python, box, tmpfs_size=self.tmpfs_size, drop_user=drop) + [
                "--", self.python, "-I", "-S", "-c", sb.LAUNCHER, json.dumps(cfg)]
        return [sys.executable, "-I", "-S", "-c", sb.LAUNCHER, json.dumps(cfg)]

    def _await_end(self, proc, buf: bytearray, started: float | None, eof: bool, t0: float
                   ) -> tuple[float | None, bool]:
        """``(t_start, timed_out)``: wait for a started program until ``timeout_s`` after its
        start (killing it past that), or briefly for a launcher that ended without starting it
        (``t_start`` None)."""
        t_start, timed_out = None, False
        if started is not None:
            # the prelude's CLOCK_MONOTONIC is ours; the clamp only guards against a clock that is not
            t_start = min(max(started, t0), time.monotonic())
            try:
                proc.wait(timeout=max(0.0, t_start + self.timeout_s - time.monotonic()))
            except subprocess.TimeoutExpired:
                timed_out = True
                # unshare / none: kill the program first (pid 1 of its namespace: all it forked dies
                # with it) so the launcher reaps it and reports; then the launcher's process group.
                # bwrap: the reported pid is the sandbox's own; killing bubblewrap ends the sandbox
                pid = next((r["pid"] for r in self._parse(buf) if "pid" in r), None)
                if pid is not None and self.sandbox != "bwrap" and proc.poll() is None:
                    try:
                        os.kill(pid, signal.SIGKILL)
                        proc.wait(timeout=2.0)
                    except (ProcessLookupError, PermissionError, subprocess.TimeoutExpired):
                        pass
        elif eof:  # the launcher ended without starting the program: its reports say why
            try:
                proc.wait(timeout=5.0)
            except subprocess.TimeoutExpired:
                pass
        return t_start, timed_out

    @classmethod
    def _await_start(cls, rfd: int, buf: bytearray, deadline: float) -> tuple[float | None, bool]:
        """Read the report pipe into ``buf`` until the program's start time arrives: (time, False);
        or EOF, the launcher gone: (None, True); or ``deadline``: (None, False)."""
        while True:
            t = next((r["started"] for r in cls._parse(buf) if "started" in r), None)
            if isinstance(t, (int, float)) and not isinstance(t, bool):
                return float(t), False
            left = deadline - time.monotonic()
            if left <= 0:
                return None, False
            ready, _, _ = select.select([rfd], [], [], left)
            if not ready:
                continue
            chunk = os.read(rfd, 65536)
            if not chunk:
                return None, True
            buf += chunk

    @staticmethod
    def _kill(proc: subprocess.Popen) -> None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # the launcher's session: launcher, program, children
        except (ProcessLookupError, PermissionError):
            pass
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:  # pragma: no cover - SIGKILL does not wait for this long
            pass

    @staticmethod
    def _drain(rfd: int, buf: bytearray, wait_s: float) -> None:
        """Read the report pipe into ``buf`` until EOF, or until nothing arrives for ``wait_s``."""
        deadline = time.monotonic() + wait_s
        while True:
            ready, _, _ = select.select([rfd], [], [], max(0.0, deadline - time.monotonic()))
            if not ready:
                return
            chunk = os.read(rfd, 65536)
            if not chunk:
                return
            buf += chunk

    @staticmethod
    def _parse(buf: bytearray) -> list[dict]:
        """The reports in ``buf``'s complete lines (a line still being written is not one yet)."""
        data = bytes(buf)
        out = []
        for line in data[:data.rfind(b"\n") + 1].decode(errors="replace").splitlines():
            try:
                obj = json.loads(line)
            except ValueError:
                continue
            if isinstance(obj, dict):
                out.append(obj)
        return out

    def _verdict(self, run: dict, expected: str | None, marker: str | None) -> str | None:
        """None when the run passed, else the failure reason."""
        if run["timed_out"] or run["signal"] in (signal.SIGXCPU, signal.SIGKILL):
            return "timeout"
        if run["signal"] == signal.SIGXFSZ:
            return "output_limit"
        err_tail = run["stderr"].strip().splitlines()[-1:] or [""]
        if run["signal"] is not None or run["rc"] != 0:
            if "[Errno 27]" in err_tail[0]:  # EFBIG: Python ignores SIGXFSZ, the write fails instead
                return "output_limit"
            if err_tail[0].startswith("MemoryError"):
                return "memory"
            if err_tail[0].startswith(("SyntaxError", "IndentationError", "TabError")):
                return "syntax_error"
            return "runtime_error"
        if run["stdout_truncated"]:
            return "output_limit"
        if marker is not None:
            lines = _norm(run["stdout"]).split("\n")
            return None if lines and lines[-1] == marker else "wrong_answer"
        return None if _norm(run["stdout"]) == _norm(expected or "") else "wrong_answer"

    # --- one sample ----------------------------------------------------------------------------
    def _tests(self, gt: Any) -> tuple[list[tuple[str, str | None, str | None]] | None, str | None]:
        """[(program suffix, stdin, expected stdout)] or (None, why invalid)."""
        if not isinstance(gt, dict):
            return None, f"ground_truth is {type(gt).__name__}, expected a mapping"
        tests, asserts = gt.get(self.tests_key), gt.get(self.asserts_key)
        if tests is None and asserts is None:
            return None, f"ground_truth has neither {self.tests_key!r} nor {self.asserts_key!r}; fields: {sorted(gt)}"
        out = []
        if tests is not None:
            if not isinstance(tests, (list, tuple)):
                return None, f"ground_truth[{self.tests_key!r}] must be a list of {{input, output}}"
            for i, t in enumerate(tests):
                if not isinstance(t, dict) or not isinstance(t.get("output"), str) or not isinstance(t.get("input", ""), str):
                    return None, f"ground_truth[{self.tests_key!r}][{i}] must be {{'input': str, 'output': str}}"
                out.append(("", t.get("input", ""), t["output"]))
        if asserts is not None:
            items = [asserts] if isinstance(asserts, str) else asserts
            if not isinstance(items, (list, tuple)) or not all(isinstance(a, str) for a in items):
                return None, f"ground_truth[{self.asserts_key!r}] must be a string or a list of strings"
            out.extend((a, "", None) for a in items)
        if not out:
            return None, "no tests in ground_truth"
        return out, None

    def _failure(self, status: RewardStatus, error: str) -> RewardRecord:
        return RewardRecord(total=None, scorer_version=self.version, status=status, error=error)

    def __call__(self, sample: RewardSample) -> RewardRecord:
        tests, why = self._tests(sample.ground_truth)
        with self._mlock:
            self._m["samples"] += 1
        if tests is None:
            return self._failure(RewardStatus.INVALID, why)
        n = len(tests)
        comps: dict[str, float] = {"tests_passed": 0.0, "tests_total": float(n)}
        program = extract_program(sample.response_text, self.source)
        if program is None:
            comps["fail/no_code"] = 1.0
            return RewardRecord(total=0.0, components=comps, scorer_version=self.version)
        passed = 0
        for suffix, stdin, expected in tests:
            marker = None
            source = program
            if suffix:
                marker = f"megarl-asserts-passed-{secrets.token_hex(8)}"
                source = f"{program}\n\n{suffix}\n\nimport sys as _megarl_sys\n_megarl_sys.stdout.write('\\n{marker}\\n')\n"
            try:
                run = self._run(source, stdin or "")
            except _SandboxError as e:
                with self._mlock:
                    self._m["sandbox_errors"] += 1
                return self._failure(RewardStatus.ERROR, f"[sandbox] {e}")
            with self._mlock:
                self._m["runs"] += 1
                self._m["timeouts"] += run["timed_out"]
            reason = self._verdict(run, expected, marker)
            if reason is None:
                passed += 1
            else:
                comps[f"fail/{reason}"] = comps.get(f"fail/{reason}", 0.0) + 1
                if self.mode == "all":
                    break
        comps["tests_passed"] = float(passed)
        total = passed / n if self.mode == "fraction" else float(passed == n)
        return RewardRecord(total=float(total), components=comps, scorer_version=self.version)
