"""What a candidate program runs in (``reward.fn: code_exec``): the launcher and the prelude, two
standalone programs handed to an interpreter as source (they import nothing of megarl), and
the private root bubblewrap builds for them (:mod:`.private_root`)."""

from __future__ import annotations

import os

from megarl.rewards.sandbox.private_root import BOX, BwrapUnavailable, bwrap_argv, find_bwrap, visible_roots

__all__ = ["BOX", "BwrapUnavailable", "bwrap_argv", "find_bwrap", "visible_roots", "LAUNCHER", "PRELUDE"]


def _source(name: str) -> str:
    with open(os.path.join(os.path.dirname(__file__), name), encoding="utf-8") as f:
        return f.read()


LAUNCHER = _source("launcher.py")  # run as python -I -S -c LAUNCHER CFG
PRELUDE = _source("prelude.py")  # run as python -I -B -c PRELUDE START_FD
