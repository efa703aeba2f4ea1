"""A generative judge's verdict, parsed by a declared rule -- pure text, no model.

* ``yes_no``: the first of the words ``yes`` / ``no`` (the rule's own words, case-insensitive,
  as whole words) in the judge's text is the verdict, scored 1.0 / 0.0 (or, with the judge's
  ``probability``, ``P(yes) / (P(yes) + P(no))`` at that position, computed by the judge).
* ``score``: the first match of a regular expression with one group, read as a float.

No verdict is a status, never a 0: a text that ended at ``max_new_tokens`` before one is
*truncated*, any other *unparseable*; both are status ``invalid`` with the text quoted.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Optional, Tuple

VERDICTS = ("yes_no", "score")


@dataclass(frozen=True)
class VerdictRule:
    kind: str = "yes_no"
    yes: str = "yes"
    no: str = "no"
    pattern: Optional[str] = None  # kind=score: a regular expression with exactly one group

    def __post_init__(self):
        if self.kind not in VERDICTS:
            raise ValueError(f"verdict {self.kind!r} is not one of {list(VERDICTS)}")
        if self.kind == "yes_no" and (not self.yes.strip() or not self.no.strip()
                                      or self.yes.strip().lower() == self.no.strip().lower()):
            raise ValueError(f"yes / no must be two different words, got {self.yes!r} / {self.no!r}")
        if self.kind == "score":
            if not self.pattern:
                raise ValueError("verdict score needs a pattern: a regular expression with one group")
            if re.compile(self.pattern).groups != 1:
                raise ValueError(f"pattern {self.pattern!r} must have exactly one group (the score)")


@dataclass(frozen=True)
class Verdict:
    """``score`` (None when there is none) or ``error``; ``at``: where in the text the verdict
    starts (yes_no: the word), for a probability read at that position."""

    score: Optional[float]
    error: Optional[str] = None
    at: Optional[int] = None
    word: Optional[str] = None  # yes_no: which of the two words


def _quoted(text: str) -> str:
    return repr(text if len(text) <= 80 else text[:77] + "...")


def parse_verdict(text: str, truncated: bool, rule: VerdictRule) -> Verdict:
    """The verdict of a judge's generated ``text`` (``truncated``: it stopped at max_new_tokens)."""
    if rule.kind == "yes_no":
        words = {rule.yes.strip().lower(): 1.0, rule.no.strip().lower(): 0.0}
        alternatives = "|".join(re.escape(w) for w in words)
        m = re.search(rf"(?<![\w])({alternatives})(?![\w])", text, flags=re.IGNORECASE)
        if m is not None:
            word = m.group(1).lower()
            return Verdict(words[word], at=m.start(1), word=word)
        want = f"{rule.yes!r} or {rule.no!r}"
    else:
        m = re.search(rule.pattern, text)
        if m is not None:
            try:
                value = float(m.group(1))
            except (TypeError, ValueError):
                value = float("nan")
            if math.isfinite(value):
                return Verdict(value, at=m.start(1))
            return Verdict(None, error=f"judge verdict {m.group(1)!r} is not a finite number (text {_quoted(text)})")
        want = f"a match of {rule.pattern!r}"
    if truncated:
        return Verdict(None, error=f"judge verdict truncated: max_new_tokens reached before {want} "
                                   f"(text {_quoted(text)})")
    return Verdict(None, error=f"judge verdict unparseable: no {want} in {_quoted(text)}")


def yes_probability(log_p_yes: float, log_p_no: float) -> float:
    """``P(yes) / (P(yes) + P(no))`` from the two words' log-probabilities at the verdict position."""
    return 1.0 / (1.0 + math.exp(log_p_no - log_p_yes))


def _named_fields(template: str, key: str, own: str) -> Tuple[str, ...]:
    """The fields of a scorer's format ``template``, each a plain name; raises ValueError naming
    ``key`` (``own``: the sample's fields the template may use, for the message)."""
    import string

    try:
        fields = tuple(f for _, f, _, _ in string.Formatter().parse(template) if f is not None)
    except ValueError as e:
        raise ValueError(f"{key}: not a format template ({e})") from None
    odd = [f for f in fields if not f.isidentifier()]
    if odd:
        raise ValueError(f"{key}: field(s) {odd} are not names; the template may use {own} and the row's "
                         "ground-truth fields by name (e.g. {answer})")
    return fields


def check_template(template: str, key: str) -> Tuple[str, ...]:
    """The fields the judge's prompt template fills: ``{response}`` (required), ``{prompt}``, and
    any other name is a ground-truth field of the sample's row (``{answer}``: a reference-guided
    judge), which every train and held-out row must then carry
    (:func:`template_ground_truth_fields`).  Raises ValueError naming ``key``."""
    fields = _named_fields(template, key, "{prompt}, {response}")
    if "response" not in fields:
        raise ValueError(f"{key}: the judge's prompt has no {{response}}: it would judge without reading the answer")
    return fields


#: the fields a judge's prompt fills from the sample itself; any other is the row's ground truth
SAMPLE_FIELDS = ("prompt", "response")


def template_ground_truth_fields(template: str, own: Tuple[str, ...] = SAMPLE_FIELDS) -> Tuple[str, ...]:
    """The ground-truth fields a (checked) scorer template reads, in order, each once: every
    field but the sample's own (``own``)."""
    import string

    fields = (f for _, f, _, _ in string.Formatter().parse(template) if f is not None)
    return tuple(dict.fromkeys(f for f in fields if f not in own))


def check_context_template(template: str, key: str) -> Tuple[str, ...]:
    """A reference-guided reward model's user turn (``reward.models[i].prompt``, ``megarl.train_rm``'s
    ``data.prompt``): a format template of ``{prompt}`` and the row's ground-truth fields, never
    ``{response}`` (the response is the assistant's turn).  Returns the ground-truth fields;
    raises ValueError naming ``key``."""
    fields = _named_fields(template, key, "{prompt}")
    if "response" in fields:
        raise ValueError(f"{key}: {{response}} is not the user turn's; the response is the assistant's turn after it")
    return template_ground_truth_fields(template, own=("prompt",))
