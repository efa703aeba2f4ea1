"""What an evaluation reports, from every candidate's outcome: accuracy over scored samples,
pass@k, maj@k, per source, and the per-row results.

Definitions (one prompt has candidates ``0 .. n-1``; candidate 0 of the greedy pass is the
greedy answer):

* a candidate is *scored* when its reward record has status ``ok``; it is *correct* when its
  total reaches ``success_threshold``.  A lost generation (``lost``) or a failed scorer
  (``error`` / ``timeout`` / ``invalid``) is unscored: counted, never wrong.
* **accuracy** -- correct / scored over the prompts' greedy candidates; NaN when none was scored.
* **pass@k** -- the unbiased estimator of Chen et al. 2021 ("Evaluating Large Language Models
  Trained on Code", eq. 1): with ``n`` scored samples of which ``c`` are correct,
  ``pass@k = 1 - C(n - c, k) / C(n, k)``, averaged over the prompts with ``n >= k`` scored samples.
* **maj@k** -- majority vote over the extracted answers of a prompt's first ``k`` scored samples
  (answers: :func:`megarl.rewards.declarations.extract_answer`; a sample without an answer does
  not vote); the prompt counts as correct when the winning answer's first sample is correct (a
  tie goes to the answer seen first; no answer at all is wrong).  Averaged over the prompts with
  at least ``k`` scored samples.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Callable, Dict, List, Optional, Sequence

__all__ = ["Candidate", "PromptOutcome", "pass_at_k", "maj_at_k", "accuracy_metrics", "sampled_metrics",
           "per_source_metrics", "result_row", "episode_metrics"]

LOST = "lost"


@dataclass
class Candidate:
    """One candidate's outcome.  ``status`` is the reward status (``ok``, ``error``, ``timeout``,
    ``invalid``) or ``lost`` (no generation after every retry)."""

    index: int
    status: str
    reward: Optional[float] = None
    response_text: Optional[str] = None
    response_len: Optional[int] = None
    finish_reason: Optional[str] = None
    error: Optional[str] = None
    components: Dict[str, float] = field(default_factory=dict)
    turns: Optional[int] = None  # an agent episode's policy turns (None: single-turn)
    tool_calls: Optional[int] = None  # ... and the tool messages it got

    @property
    def scored(self) -> bool:
        return self.status == "ok"

    def correct(self, threshold: float) -> Optional[bool]:
        """True / False for a scored candidate; None when unscored."""
        return (self.reward >= threshold) if self.scored else None


@dataclass
class PromptOutcome:
    """One prompt and its candidates (in candidate order)."""

    index: int
    prompt_id: str
    prompt: object  # the prompt text, or the chat messages
    source: Optional[str]
    candidates: List[Candidate]


def pass_at_k(n: int, c: int, k: int) -> float:
    """``1 - C(n-c, k) / C(n, k)`` (Chen et al. 2021), exactly (integer binomials, one rounding)."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n, got n={n} c={c} k={k}")
    if n - c < k:
        return 1.0
    return float(1 - Fraction(math.comb(n - c, k), math.comb(n, k)))


def maj_at_k(answers: Sequence[Optional[str]], correct: Sequence[bool], k: int) -> float:
    """1.0 / 0.0: whether the majority answer of the first ``k`` (answer, correct) pairs is correct
    (see the module docstring for ties and missing answers)."""
    votes: Counter = Counter()
    first: Dict[str, int] = {}
    for i, a in enumerate(answers[:k]):
        if a is None:
            continue
        votes[a] += 1
        first.setdefault(a, i)
    if not votes:
        return 0.0
    winner = min(votes, key=lambda a: (-votes[a], first[a]))
    return 1.0 if correct[first[winner]] else 0.0


def _mean(xs: Sequence[float]) -> float:
    return sum(xs) / len(xs) if xs else float("nan")


def accuracy_metrics(prompts: Sequence[PromptOutcome], threshold: float, prefix: str = "eval/") -> Dict[str, float]:
    """Greedy accuracy over the prompts' candidate 0, with what went unscored."""
    first = [p.candidates[0] for p in prompts]
    generated = [c for c in first if c.status != LOST]
    ok = [c for c in generated if c.scored]
    succ = sum(1 for c in ok if c.reward >= threshold)
    return {f"{prefix}accuracy": succ / len(ok) if ok else float("nan"), f"{prefix}n": len(prompts),
            f"{prefix}scored": len(ok), f"{prefix}generation_failures": len(first) - len(generated),
            f"{prefix}reward_mean": sum(c.reward for c in ok) / max(len(ok), 1),
            f"{prefix}scorer_failures": len(generated) - len(ok),
            f"{prefix}response_len_mean": sum(c.response_len for c in generated) / max(len(generated), 1)}


def sampled_metrics(prompts: Sequence[PromptOutcome], threshold: float, ks: Sequence[int],
                    answer_of: Callable[[str], Optional[str]], prefix: str = "eval/") -> Dict[str, float]:
    """pass@k and maj@k for each k over the prompts' sampled candidates, the mean sample
    accuracy, and how many prompts had enough scored samples for each k."""
    out: Dict[str, float] = {}
    scored = [[c for c in p.candidates if c.scored] for p in prompts]
    every = [c.correct(threshold) for s in scored for c in s]
    out[f"{prefix}sample_accuracy"] = _mean([float(x) for x in every])
    out[f"{prefix}samples_scored"] = len(every)
    out[f"{prefix}samples_unscored"] = sum(len(p.candidates) for p in prompts) - len(every)
    answers = [[answer_of(c.response_text) for c in s] for s in scored]
    for k in ks:
        eligible = [i for i, s in enumerate(scored) if len(s) >= k]
        out[f"{prefix}pass@{k}"] = _mean([pass_at_k(len(scored[i]), sum(c.correct(threshold) for c in scored[i]), k)
                                          for i in eligible])
        out[f"{prefix}maj@{k}"] = _mean([maj_at_k(answers[i], [c.correct(threshold) for c in scored[i]], k)
                                         for i in eligible])
        out[f"{prefix}prompts@{k}"] = len(eligible)
    return out


def per_source_metrics(prompts: Sequence[PromptOutcome], metrics_of: Callable[[Sequence[PromptOutcome], str], dict],
                       prefix: str = "eval/") -> Dict[str, float]:
    """``metrics_of(prompts of one source, prefix "eval/source/<source>/")`` for every source, when
    any prompt has one (prompts without a source are grouped under ``none``)."""
    if all(p.source is None for p in prompts):
        return {}
    groups: Dict[str, List[PromptOutcome]] = {}
    for p in prompts:
        groups.setdefault("none" if p.source is None else str(p.source).replace("/", "_"), []).append(p)
    out: Dict[str, float] = {}
    for src in sorted(groups):
        out.update(metrics_of(groups[src], f"{prefix}source/{src}/"))
    return out


def result_row(p: PromptOutcome, threshold: float, answer_of: Optional[Callable[[str], Optional[str]]] = None,
               **extra) -> dict:
    """One JSONL row: the prompt and every candidate's response, reward, status and correctness."""
    row = {"index": p.index, "prompt_id": p.prompt_id, "prompt": p.prompt}
    if p.source is not None:
        row["source"] = p.source
    row.update(extra)
    cs = p.candidates
    row.update(responses=[c.response_text for c in cs], rewards=[c.reward for c in cs],
               statuses=[c.status for c in cs], correct=[c.correct(threshold) for c in cs],
               finish_reasons=[c.finish_reason for c in cs], errors=[c.error for c in cs],
               components=[c.components for c in cs])
    if any(c.turns is not None for c in cs):
        row.update(turns=[c.turns for c in cs], tool_calls=[c.tool_calls for c in cs])
    if answer_of is not None:
        row["answers"] = [None if c.response_text is None else answer_of(c.response_text) for c in cs]
    return row


def episode_metrics(prompts: Sequence[PromptOutcome], threshold: float, prefix: str = "eval/") -> Dict[str, float]:
    """Agent episodes over the scored candidates: mean turns, the share that called a tool, and
    the accuracy of those that did and of those that did not (NaN where there are none); empty
    for single-turn outcomes."""
    cs = [c for p in prompts for c in p.candidates if c.scored and c.turns is not None]
    if not cs:
        return {}
    called = [c for c in cs if c.tool_calls]
    plain = [c for c in cs if not c.tool_calls]
    acc = lambda xs: _mean([float(c.correct(threshold)) for c in xs])  # noqa: E731
    return {f"{prefix}turns_mean": _mean([float(c.turns) for c in cs]),
            f"{prefix}tool_call_rate": len(called) / len(cs),
            f"{prefix}accuracy_with_tool_call": acc(called), f"{prefix}accuracy_without_tool_call": acc(plain)}
