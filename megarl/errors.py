"""The root of megarl's user-facing errors.

Every error raised for bad input (config, checkpoint, dataset, tokenizer, layout) derives from
:class:`MegarlError` and carries a message naming the file or key and what was expected.
Command-line entry points print that message alone (no traceback) and exit with status 2.
"""

from __future__ import annotations

import functools
import os
import sys


class MegarlError(Exception):
    """Bad input that the user can fix; the message says what and where."""


class ConfigError(MegarlError, ValueError):
    """A config key with a value that cannot run; the message names the key.  Lives here, in the
    leaf every layer may import, and is re-exported by :mod:`megarl.config`."""


def cli_main(fn):
    """Decorate a ``main()``: a :class:`MegarlError` becomes one line on stderr and exit 2."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except MegarlError as e:
            rank = os.environ.get("RANK")
            prefix = f"[rank {rank}] " if rank not in (None, "0") else ""
            print(f"{prefix}error: {e}", file=sys.stderr, flush=True)
            sys.exit(2)

    return wrapper


def require(ok: bool, key: str, msg: str) -> None:
    """A config check: unless ``ok``, a :class:`ConfigError` ``"<key>: <msg>"``."""
    if not ok:
        raise ConfigError(f"{key}: {msg}")


def require_choice(value, key: str, choices) -> None:
    """A config check: ``value`` is one of ``choices``."""
    require(value in choices, key, f"{value!r} is not one of {list(choices)}")
