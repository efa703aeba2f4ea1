"""User reward functions loaded by dotted path (``"pkg.mod:callable"``).

A user callable may return a :class:`RewardRecord`, a plain number, or a mapping with
``"total"`` (and optional ``"components"``); :class:`UserFunction` normalises that into a
record.  Anything it cannot interpret -- another type, a non-finite number, a mapping without a
total -- is status ``error`` with a text saying what came back, never a 0, so a buggy plug-in
shows up in the reward counters instead of quietly training the policy on zeros.
"""

from __future__ import annotations

import math
import numbers
from typing import Any, Callable, Mapping

from megarl.dotted import import_dotted
from megarl.experience.schema import RewardRecord, RewardStatus
from megarl.rewards.base import RewardConfigError, RewardSample

__all__ = ["load_user_function", "UserFunction"]


def load_user_function(spec: str) -> Any:
    """Import ``"pkg.mod:attr"`` (``attr`` may be dotted, ``"pkg.mod:Class.method"``) and return
    the attribute.  Any failure is a :class:`RewardConfigError` naming ``spec``."""
    if not isinstance(spec, str) or spec.count(":") != 1 or not all(spec.split(":")):
        raise RewardConfigError(f"reward function path {spec!r} must look like 'pkg.mod:callable'")
    return import_dotted(spec, f"reward function {spec!r}", RewardConfigError)


def _finite(x: Any) -> bool:
    return isinstance(x, numbers.Real) and math.isfinite(float(x))


class UserFunction:
    """Wraps a user callable ``fn(sample) -> RewardRecord | float | Mapping`` as a RewardFunction.

    - a RewardRecord is returned unchanged (the user owns its status and version);
    - a real number ``v`` (bools count as 1.0 / 0.0) becomes ``total=v, components={name: v}``;
    - a mapping ``{"total": v, "components": {...}}`` becomes that record (components default to
      ``{name: v}``);
    - anything else, a non-finite number or unknown mapping keys: status ``error``.
    Exceptions from ``fn`` propagate (the runner records them as ``error`` and retries).
    """

    def __init__(self, fn: Callable[[RewardSample], Any], name: str, version: str | None = None,
                 declared_by: Any = None):
        if not callable(fn):
            raise RewardConfigError(f"user reward {name!r} is a {type(fn).__name__}, not a callable")
        self.fn, self.name = fn, str(name)
        # what the plug-in declares about itself (megarl/rewards/declarations.py): the ground-truth
        # fields it reads and its answer parser, read from ``declared_by`` (default: ``fn``)
        owner = fn if declared_by is None else declared_by
        self.required_fields = getattr(owner, "required_fields", None)
        answer = getattr(owner, "extract_answer", None)
        if callable(answer):
            self.extract_answer = answer
        where = f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', type(fn).__qualname__)}"
        self.version = version or str(getattr(fn, "version", "") or f"user/{self.name}({where})")

    def __call__(self, sample: RewardSample) -> RewardRecord:
        out = self.fn(sample)
        if isinstance(out, RewardRecord):
            return out
        if isinstance(out, numbers.Real):
            if not _finite(out):
                return self._error(f"returned non-finite value {out!r}")
            return RewardRecord(total=float(out), components={self.name: float(out)}, scorer_version=self.version)
        if isinstance(out, Mapping):
            return self._from_mapping(out)
        return self._error(
            f"returned {type(out).__name__} {out!r:.80}; expected a RewardRecord, a float or a mapping with 'total'"
        )

    def _from_mapping(self, out: Mapping) -> RewardRecord:
        unknown = sorted(str(k) for k in out if k not in ("total", "components"))
        if unknown:
            return self._error(f"returned a mapping with unknown keys {unknown}; allowed: 'total', 'components'")
        if "total" not in out:
            return self._error("returned a mapping without 'total'")
        total = out["total"]
        if not _finite(total):
            return self._error(f"returned total {total!r}; expected a finite number")
        comps = out.get("components")
        if comps is None:
            comps = {self.name: float(total)}
        if not isinstance(comps, Mapping):
            return self._error(f"returned components of type {type(comps).__name__}; expected a mapping")
        for k, v in comps.items():
            if not isinstance(k, str) or not _finite(v):
                return self._error(f"returned components[{k!r}] = {v!r}; expected str keys and finite numbers")
        return RewardRecord(
            total=float(total), components={k: float(v) for k, v in comps.items()}, scorer_version=self.version
        )

    def _error(self, what: str) -> RewardRecord:
        return RewardRecord(
            total=None, scorer_version=self.version, status=RewardStatus.ERROR, error=f"user reward {self.name!r} {what}"
        )
