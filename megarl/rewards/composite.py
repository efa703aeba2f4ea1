"""A weighted sum of reward functions (e.g. correctness + 0.1 * format).

Failure is not averaged away: if any part fails, the whole composite fails with that part's
status and an error naming the part, because a total computed without one of its terms is not
the reward the user configured.
"""

from __future__ import annotations

import math
import numbers
from typing import Sequence

from megarl.experience.schema import RewardRecord, RewardStatus
from megarl.rewards.base import RewardConfigError, RewardFunction, RewardSample

__all__ = ["WeightedComposite"]


class WeightedComposite:
    """``total = sum(weight_i * part_i.total)`` over named parts.

    Components: a part that reports a single component (or none) contributes ``{part_name:
    part_total}``; a part with several components contributes each as ``"<part_name>/<key>"``.
    Parts are called in order and the first failing part decides the status (``error`` also
    when a part raises, so the error text can name the part).  Per-step (process) rewards of
    parts are not combined and are dropped.
    """

    name = "composite"

    def __init__(self, parts: Sequence[tuple[str, float, RewardFunction]]):
        parts = list(parts)
        if not parts:
            raise RewardConfigError("composite reward needs at least one part (reward.components is empty)")
        seen: set[str] = set()
        for i, part in enumerate(parts):
            if not (isinstance(part, tuple) and len(part) == 3):
                raise RewardConfigError(f"composite part [{i}] must be (name, weight, fn), got {part!r}")
            pname, weight, fn = part
            if not isinstance(pname, str) or not pname or "/" in pname:
                raise RewardConfigError(f"composite part [{i}] name must be a non-empty string without '/', got {pname!r}")
            if pname in seen:
                raise RewardConfigError(f"composite part name {pname!r} is used twice; names must be unique")
            seen.add(pname)
            if isinstance(weight, bool) or not isinstance(weight, numbers.Real) or not math.isfinite(weight):
                raise RewardConfigError(f"composite part {pname!r} weight must be a finite number, got {weight!r}")
            if not callable(fn):
                raise RewardConfigError(f"composite part {pname!r} fn must be callable, got {type(fn).__name__}")
        self.parts = [(p, float(w), f) for p, w, f in parts]
        inner = ",".join(f"{p}*{w!r}={f.version}" for p, w, f in self.parts)
        self.version = f"composite/1[{inner}]"

    @property
    def required_fields(self):
        """The union of the parts' declared ground-truth fields (None: no part declares any)."""
        from megarl.rewards.declarations import required_fields, union_of

        return union_of([required_fields(f) for _, _, f in self.parts])

    def extract_answer(self, text: str):
        """The answer of the first part that parses answers (else the normalised text)."""
        from megarl.rewards.declarations import extract_answer, extractor, normalised_text

        for _, _, f in self.parts:
            if extractor(f) is not None:
                return extract_answer(f, text)
        return normalised_text(text)

    def __call__(self, sample: RewardSample) -> RewardRecord:
        terms: list[float] = []
        components: dict[str, float] = {}
        for pname, weight, fn in self.parts:
            try:
                rec = fn(sample)
            except Exception as e:
                return self._fail(RewardStatus.ERROR, f"part {pname!r} raised {type(e).__name__}: {e}")
            if not isinstance(rec, RewardRecord):
                return self._fail(
                    RewardStatus.ERROR, f"part {pname!r} returned {type(rec).__name__}, expected a RewardRecord"
                )
            if rec.status is not RewardStatus.OK:
                return self._fail(rec.status, f"part {pname!r} ({rec.scorer_version}) {rec.status.value}: {rec.error}")
            terms.append(weight * rec.total)
            if len(rec.components) <= 1:
                components[pname] = rec.total if not rec.components else next(iter(rec.components.values()))
            else:
                components.update({f"{pname}/{k}": v for k, v in rec.components.items()})
        return RewardRecord(total=math.fsum(terms), components=components, scorer_version=self.version)

    def _fail(self, status: RewardStatus, error: str) -> RewardRecord:
        return RewardRecord(total=None, scorer_version=self.version, status=status, error=error)
