"""What a batch says about drift and reward hacking, as numbers a run writes every iteration.

* :func:`repetition_rate`: the share of a response's n-grams that repeat an earlier n-gram of the
  same response (degenerate loops: "the the the", a line written twice), over the batch.
* :func:`pearson`: the correlation of reward with response length (a length-hacking policy drives
  it up; a verifier that pays for padding shows here first).
* :func:`format_without_answer_share`: of the rewarded samples, the share whose format checks all
  pass while an answer check fails: reward earned by the format alone.
* :func:`distribution`: mean, spread and quantiles of one reward component (a mean hides a
  component that splits the batch in two).

Pure functions over plain sequences: no rank, no tensor of the record.
"""

from __future__ import annotations

import math
from typing import Dict, Mapping, Optional, Sequence

__all__ = ["repetition_rate", "pearson", "format_without_answer_share", "distribution"]


def repetition_rate(responses: Sequence[Sequence[int]], n: int = 4) -> float:
    """``sum_i repeated_i / sum_i total_i`` over the responses, where ``total_i`` counts the n-grams
    of response i (``len - n + 1``) and ``repeated_i`` those equal to an n-gram earlier in the same
    response; 0.0 when no response has n tokens."""
    if n < 1:
        raise ValueError(f"repetition_rate: n must be >= 1, got {n}")
    total = repeated = 0
    for ids in responses:
        seen = set()
        for i in range(len(ids) - n + 1):
            gram = tuple(ids[i:i + n])
            total += 1
            if gram in seen:
                repeated += 1
            seen.add(gram)
    return repeated / total if total else 0.0


def pearson(x: Sequence[float], y: Sequence[float]) -> Optional[float]:
    """Pearson's r of two equally long sequences; None when either is constant (undefined) or
    shorter than 2."""
    if len(x) != len(y):
        raise ValueError(f"pearson: {len(x)} and {len(y)} values")
    n = len(x)
    if n < 2:
        return None
    mx, my = math.fsum(x) / n, math.fsum(y) / n
    sxy = math.fsum((a - mx) * (b - my) for a, b in zip(x, y, strict=True))
    sxx = math.fsum((a - mx) ** 2 for a in x)
    syy = math.fsum((b - my) ** 2 for b in y)
    if sxx == 0.0 or syy == 0.0:
        return None
    return sxy / math.sqrt(sxx * syy)


def format_without_answer_share(totals: Sequence[float], components: Sequence[Mapping[str, float]],
                                format_names: Sequence[str], answer_names: Sequence[str]) -> Optional[float]:
    """Among samples with ``total > 0`` that report every named component: the share whose every
    format component is > 0 and some answer component is <= 0.  None without both kinds of
    component, or without such a sample."""
    if not format_names or not answer_names:
        return None
    names = (*format_names, *answer_names)
    rewarded = [c for t, c in zip(totals, components, strict=True) if t > 0 and all(n in c for n in names)]
    if not rewarded:
        return None
    hits = sum(all(c.get(f, 0.0) > 0 for f in format_names) and any(c.get(a, 0.0) <= 0 for a in answer_names)
               for c in rewarded)
    return hits / len(rewarded)


def distribution(values: Sequence[float]) -> Dict[str, float]:
    """``mean``, ``std`` (population), ``min``, ``max`` and the ``p10`` / ``p50`` / ``p90``
    quantiles (linear interpolation between order statistics, numpy's default)."""
    if not values:
        raise ValueError("distribution: no values")
    xs = sorted(float(v) for v in values)
    n = len(xs)
    mean = math.fsum(xs) / n
    out = {"mean": mean, "std": math.sqrt(math.fsum((v - mean) ** 2 for v in xs) / n), "min": xs[0], "max": xs[-1]}
    for q in (10, 50, 90):
        pos = (n - 1) * q / 100
        lo = int(math.floor(pos))
        hi = min(lo + 1, n - 1)
        out[f"p{q}"] = xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)
    return out
