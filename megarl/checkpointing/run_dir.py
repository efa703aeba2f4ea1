"""What a run directory holds before a run starts in it, and the command that resumes it.

One run directory holds one run.  Before any model loads, :func:`start_decision` reads the
directory (``trainer.run_dir``) and decides, with ``trainer.resume``:

=====================================  ==============================  ===========================
the directory holds                    resume=auto (default)           resume=never
=====================================  ==============================  ===========================
nothing (or only config.yaml/run.json) start                           start
a checkpoint (``checkpoints/latest``)  continue from it                refused (a second run would
                                                                       mix with its checkpoints)
a finished run (``DONE``)              "finished", exit 0; continue    refused
                                       from the last checkpoint if
                                       trainer.iterations was raised
metrics.jsonl but no checkpoint        refused: nothing to resume      start over: the interrupted
(interrupted, checkpoint_every=0)                                      attempt's files are moved to
                                                                       ``<run_dir>/attempt-<time>/``
=====================================  ==============================  ===========================

``launch/multinode.sh`` relies on ``DONE`` (a finished job is not requeued) and on resume=auto
continuing from ``checkpoints/latest`` (a requeued job); both stay as they were.

:func:`resume_command` prints the exact command that continues a stopped run (its docstring
says how it is built).
"""

from __future__ import annotations

import json
import os
import shlex
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Optional

from megarl.errors import ConfigError

DONE = "DONE"


@dataclass
class RunDirState:
    """What is in a run directory: the finished marker's content, the latest checkpoint, and
    how many metric rows an earlier attempt wrote."""

    path: str
    done: Optional[dict]
    checkpoint: Optional[str]
    metrics_rows: int

    @property
    def used(self) -> bool:
        return self.done is not None or self.checkpoint is not None or self.metrics_rows > 0


def inspect_run_dir(run_dir: str) -> RunDirState:
    from megarl.checkpointing.checkpoint import CheckpointError, find_latest

    done = None
    done_path = os.path.join(run_dir, DONE)
    if os.path.isfile(done_path):
        try:
            with open(done_path) as f:
                done = json.load(f)
        except (OSError, ValueError):
            done = {}  # an empty or foreign marker still says "finished"
    ckpt_root = os.path.join(run_dir, "checkpoints")
    try:
        checkpoint = find_latest(ckpt_root) if os.path.isdir(ckpt_root) else None
    except CheckpointError as e:
        raise ConfigError(f"trainer.run_dir: {e}") from None
    rows = 0
    metrics = os.path.join(run_dir, "metrics.jsonl")
    try:
        with open(metrics) as f:
            rows = sum(1 for line in f if line.strip())
    except FileNotFoundError:  # none, or rank 0 just moved it aside (resume=never)
        pass
    return RunDirState(run_dir, done, checkpoint, rows)


def check_writable(key: str, path: str) -> None:
    """``path`` is, or can be created as, a writable directory: else one error naming ``key``
    (checked before any model loads, instead of a FileNotFoundError deep in the run)."""
    path = os.path.abspath(path)
    if os.path.exists(path) and not os.path.isdir(path):
        raise ConfigError(f"{key}: {path} exists and is not a directory")
    probe = path
    while not os.path.exists(probe):
        probe = os.path.dirname(probe)
    if not os.path.isdir(probe):
        raise ConfigError(f"{key}: cannot create {path}: {probe} is a file, not a directory")
    # try it rather than ask os.access, which says yes to root on read-only or virtual file
    # systems (/proc, a read-only mount); the probe directory is removed at once
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".megarl-write-probe-", dir=probe))
    except OSError as e:
        what = "is not writable" if probe == path else f"cannot be created: {probe} is not writable"
        raise ConfigError(f"{key}: {path} {what} ({e.strerror or e})") from None


def start_decision(cfg, state: RunDirState, dry: bool = False) -> Optional[str]:
    """None: start (or resume) the run.  A string: the run is finished; print it and exit 0.
    A refusal raises :class:`ConfigError` naming the key to change.  May move an interrupted
    attempt aside (resume=never, see the module docstring), unless ``dry``."""
    t, d = cfg.trainer, state.path
    if t.resume == "never":
        if state.done is not None or state.checkpoint is not None:
            what = "a finished run (DONE)" if state.done is not None else f"checkpoints ({state.checkpoint})"
            raise ConfigError(f"trainer.run_dir: {d} holds {what}; trainer.resume=never would start a second run "
                              "among its files: use a new trainer.run_dir (or trainer.resume=auto to continue it)")
        if state.metrics_rows and not dry:
            aside = os.path.join(d, "attempt-" + time.strftime("%Y%m%d-%H%M%S"))
            if int(os.environ.get("RANK", "0")) == 0:
                os.makedirs(aside)
                for name in sorted(os.listdir(d)):
                    if not name.startswith("attempt-"):
                        os.replace(os.path.join(d, name), os.path.join(aside, name))
                print(f"trainer.resume=never: starting over in {d}; the interrupted attempt's files "
                      f"({state.metrics_rows} metric rows) were moved to {aside}", flush=True)
        return None
    if state.done is not None:
        finished_at = state.done.get("iterations")
        if finished_at is None or t.iterations <= finished_at:
            acc = state.done.get("heldout_accuracy")
            return (f"{d} holds a finished run ({finished_at if finished_at is not None else '?'} iterations"
                    f"{'' if acc is None else f', final held-out accuracy {acc:.3f}'}); nothing to do "
                    f"(raise trainer.iterations to continue it, or use a new trainer.run_dir)")
        if state.checkpoint is None:
            raise ConfigError(
                f"trainer.iterations: raised to {t.iterations}, but the finished run in {d} ({finished_at} "
                f"iterations) left no checkpoint to continue from (trainer.checkpoint_every={t.checkpoint_every} "
                "keeps none at the end); use a new trainer.run_dir, or next time set trainer.checkpoint_every")
        return None  # the trainer resumes from the checkpoint and removes DONE once it has
    if state.checkpoint is None and state.metrics_rows:
        raise ConfigError(
            f"trainer.run_dir: {d} holds an interrupted run with {state.metrics_rows} metric rows and no checkpoint "
            f"to resume from (trainer.checkpoint_every={t.checkpoint_every}); use a new trainer.run_dir, or add "
            "trainer.resume=never to start over in it (the attempt's files are moved aside)")
    return None


def resume_command(run_dir: str, argv: Optional[list] = None, env: Optional[dict] = None) -> str:
    """The command that continues this run: the launcher, the config and the overrides of this
    process, with ``trainer.run_dir=<run_dir>`` replacing any given one, so a default timestamped
    directory is named, not generated anew."""
    argv = list(sys.argv if argv is None else argv)
    env = os.environ if env is None else env
    args = [a for a in argv[1:] if not a.startswith("trainer.run_dir=")]
    args = [a for a in args if a != "trainer.resume=never"]  # continuing needs resume=auto (the default)
    args.append(f"trainer.run_dir={run_dir}")
    if "TORCHELASTIC_RUN_ID" in env or "LOCAL_WORLD_SIZE" in env:
        launcher = ["torchrun"]
        nnodes = int(env.get("GROUP_WORLD_SIZE", "1") or 1)
        if nnodes > 1:
            launcher += ["--nnodes", str(nnodes)]
        launcher += ["--nproc-per-node", env.get("LOCAL_WORLD_SIZE", "1"), "-m", "megarl.train"]
    else:
        launcher = ["python", "-m", "megarl.train"]
    cmd = shlex.join(launcher + args)
    if env.get("SLURM_JOB_ID"):
        cmd += (f"   (a requeued Slurm job resumes by itself; launch/multinode.sh: "
                f"MEGARL_RUN_DIR={shlex.quote(run_dir)})")
    return cmd
