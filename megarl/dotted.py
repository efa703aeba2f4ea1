"""Plug-ins named by dotted path, ``"pkg.mod:attr"`` (``attr`` may be dotted): reward functions
(``reward.fn``) and environments (``rollout.agent.env``) load through :func:`import_dotted`, so
every way a path can be wrong is reported the same way, naming the key."""

from __future__ import annotations

import importlib
from typing import Any


def import_dotted(spec: str, label: str, error: type[Exception], expected: str = "a callable") -> Any:
    """The callable at ``spec`` (already checked to be ``"mod:attr"``).  An unimportable module, a
    module that raises at import, a missing attribute or a non-callable raise ``error`` with a
    message starting with ``label`` (e.g. ``"reward function 'pkg:fn'"``)."""
    mod_name, attr_path = spec.split(":")
    try:
        obj: Any = importlib.import_module(mod_name)
    except ImportError as e:
        raise error(f"{label}: cannot import module {mod_name!r}: {e}") from e
    except Exception as e:  # the user module itself crashed at import
        raise error(f"{label}: importing {mod_name!r} raised {type(e).__name__}: {e}") from e
    for part in attr_path.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise error(f"{label}: {mod_name!r} has no attribute {attr_path!r}") from None
    if not callable(obj):
        raise error(f"{label} is a {type(obj).__name__}, not {expected}")
    return obj
