"""Rule-based (verifiable) rewards: numeric match, math-verify, regex format, the arithmetic task.

Each rule returns an ok :class:`RewardRecord` with ``components={<rule name>: value}``.  A
sample the rule *cannot evaluate* -- the ground-truth field is missing or is not a number /
not parseable -- is status ``invalid`` with an error text, never 0: a broken dataset row must not
teach the policy that its (possibly correct) answer was wrong.  A response that contains no
answer at all is simply wrong (0.0): that is the policy's fault, not the data's.
"""

from __future__ import annotations

import hashlib
import math
import numbers
import re
from fractions import Fraction
from typing import Any, Mapping

from megarl.experience.schema import RewardRecord, RewardStatus
from megarl.rewards.base import RewardConfigError, RewardSample

__all__ = ["ExactNumericMatch", "MathVerify", "RegexFormat", "Arithmetic", "extract_last_number", "parse_number"]


def _ok(name: str, version: str, value: float) -> RewardRecord:
    return RewardRecord(total=float(value), components={name: float(value)}, scorer_version=version)


def _invalid(version: str, error: str) -> RewardRecord:
    return RewardRecord(total=None, scorer_version=version, status=RewardStatus.INVALID, error=error)


def _answer(sample: RewardSample, key: str, version: str) -> tuple[Any, RewardRecord | None]:
    """``(ground_truth[key], None)`` or ``(None, invalid record)`` when the field is missing."""
    gt = sample.ground_truth
    if key not in gt or gt[key] is None:
        have = sorted(gt) if isinstance(gt, Mapping) else type(gt).__name__
        return None, _invalid(version, f"ground_truth has no {key!r} field (answer_key); fields: {have}")
    return gt[key], None


# --- numbers ---------------------------------------------------------------------------------
# Spaces/tabs are allowed between digits and around '.', ',' and a leading minus because the
# built-in tiny tokenizer decodes one token per character joined by spaces ("1 2 3" for 123,
# "- 4" for -4, "1 , 2 3 4" for 1,234).  A comma is a thousands separator only when followed by
# exactly three digits, so "1, 2, 3" is three numbers and "1,234" is one.
_SP = r"[ \t]*"
_DIGITS = rf"\d(?:{_SP}\d)*"
_GROUPED = rf"\d(?:{_SP}\d){{0,2}}(?:{_SP},{_SP}\d{_SP}\d{_SP}\d)+(?!{_SP}\d)"
_NUMBER = re.compile(
    rf"(?P<sign>[-\u2212]{_SP})?(?P<int>{_GROUPED}|{_DIGITS})(?:{_SP}\.{_SP}(?P<frac>{_DIGITS}))?"
)


def _value(m: re.Match) -> Fraction:
    digits = re.sub(r"[ \t,]", "", m.group("int"))
    if m.group("frac"):
        digits += "." + re.sub(r"[ \t]", "", m.group("frac"))
    v = Fraction(digits)
    return -v if m.group("sign") else v


def extract_last_number(text: str) -> Fraction | None:
    """The last number in ``text`` (exact, as a Fraction), or None when there is none.

    A minus sign counts only when it is unary: after a digit or a closing bracket it is a
    subtraction (``10 - 3`` ends in 3, ``= - 4`` ends in -4).
    """
    last = None
    for m in _NUMBER.finditer(text):
        last = m
    if last is None:
        return None
    v = _value(last)
    if last.group("sign"):
        before = text[: last.start()].rstrip()
        if before and (before[-1].isdigit() or before[-1] in ")]}"):
            v = -v  # binary minus: undo the sign
    return v


def parse_number(value: Any) -> Fraction | None:
    """A ground-truth answer as an exact Fraction: ints, finite floats (by their shortest repr,
    so 0.1 is 1/10), or a string that is exactly one number ("42", "-1,234", "0.5", "1 2 3")."""
    if isinstance(value, bool):
        return None
    if isinstance(value, numbers.Integral):
        return Fraction(int(value))
    if isinstance(value, numbers.Real):
        f = float(value)
        return Fraction(repr(f)) if math.isfinite(f) else None
    if isinstance(value, str):
        s = value.strip()
        if s.startswith("+"):
            s = s[1:].lstrip()
        m = _NUMBER.fullmatch(s)
        return _value(m) if m else None
    return None


class ExactNumericMatch:
    """1.0 when the last number in the response equals ``ground_truth[answer_key]`` within
    ``tolerance`` (absolute), else 0.0.

    Comparison is exact (Fractions), so ``0.1`` matches ``"0.1"`` at tolerance 0.  A response with
    no number scores 0.0 (wrong, not invalid); a missing or non-numeric ground truth is
    ``invalid``.
    """

    name = "exact_numeric"
    checks = "answer"  # what its score says about a response (declarations.component_checks)

    def __init__(self, answer_key: str = "answer", tolerance: float = 0.0):
        if not isinstance(tolerance, numbers.Real) or isinstance(tolerance, bool) or not (
            math.isfinite(tolerance) and tolerance >= 0
        ):
            raise RewardConfigError(f"exact_numeric tolerance must be a finite number >= 0, got {tolerance!r}")
        self.answer_key = str(answer_key)
        self.tolerance = float(tolerance)
        self._tol = Fraction(repr(self.tolerance))
        self.version = f"exact_numeric/1(answer_key={self.answer_key!r},tolerance={self.tolerance!r})"
        self.required_fields = (self.answer_key,)

    def extract_answer(self, text: str) -> str | None:
        """The last number of the response, exactly (``"42"``, ``"7/2"``), as compared."""
        got = extract_last_number(text)
        return None if got is None else str(got)

    def __call__(self, sample: RewardSample) -> RewardRecord:
        raw, bad = _answer(sample, self.answer_key, self.version)
        if bad is not None:
            return bad
        want = parse_number(raw)
        if want is None:
            return _invalid(self.version, f"ground_truth[{self.answer_key!r}] = {raw!r} is not a number")
        got = extract_last_number(sample.response_text)
        hit = got is not None and abs(got - want) <= self._tol
        return _ok(self.name, self.version, 1.0 if hit else 0.0)


class MathVerify:
    """1.0 when ``math_verify.verify(gold, prediction)`` holds, else 0.0 (symbolic / numeric
    equivalence of LaTeX or plain expressions, e.g. ``\\boxed{\\frac{1}{2}}`` == ``0.5``).

    math-verify's own timeouts use ``signal.alarm``, which raises outside the main thread, so
    they are disabled here (``parsing_timeout=None``, ``timeout_seconds=None``):
    :class:`~megarl.rewards.runner.RewardRunner` enforces the per-call timeout instead.  A
    response from which nothing parses scores 0.0; a ground truth that does not parse (neither
    as is nor wrapped in ``$...$``) is ``invalid``.
    """

    name = "math_verify"
    checks = "answer"  # what its score says about a response (declarations.component_checks)

    def __init__(self, answer_key: str = "answer"):
        try:
            import math_verify
            from math_verify import parse, verify
        except ImportError as e:
            raise RewardConfigError(
                f"reward 'math_verify' needs the math-verify package: pip install math-verify ({e})"
            ) from e
        from importlib.metadata import PackageNotFoundError, version

        try:
            pkg = version("math-verify")
        except PackageNotFoundError:
            pkg = getattr(math_verify, "__version__", "unknown")
        self._parse, self._verify = parse, verify
        self.answer_key = str(answer_key)
        self.version = f"math_verify/1(answer_key={self.answer_key!r},math-verify=={pkg})"
        self.required_fields = (self.answer_key,)

    def extract_answer(self, text: str) -> str | None:
        """math-verify's parse of the response (its string form: the last ``\\boxed{}`` or
        expression it found), None when nothing parses."""
        pred = self._parse(text, parsing_timeout=None)
        return str(pred[-1]) if pred else None

    def _parse_gold(self, text: str) -> list:
        # A bare "x^{2}" or "(1,2)" only parses inside math delimiters; "0.5" parses either way.
        # LaTeX commands go inside the delimiters first: bare, "\left( 3, \frac{\pi}{2} \right)"
        # parses as just 3, and a right answer would score 0.
        if "$" not in text and "\\" in text:
            return self._parse(f"${text}$", parsing_timeout=None) or self._parse(text, parsing_timeout=None)
        gold = self._parse(text, parsing_timeout=None)
        if not gold and "$" not in text:
            gold = self._parse(f"${text}$", parsing_timeout=None)
        return gold

    def warmup(self) -> None:
        """One parse and verify, so a fresh reward worker process pays math-verify's lazy
        parser set-up before its first timed call."""
        self._verify(self._parse_gold("1"), self._parse(r"\boxed{\frac{2}{2}}", parsing_timeout=None), timeout_seconds=None)

    def __call__(self, sample: RewardSample) -> RewardRecord:
        raw, bad = _answer(sample, self.answer_key, self.version)
        if bad is not None:
            return bad
        if isinstance(raw, bool) or not isinstance(raw, (str, numbers.Real)):
            return _invalid(self.version, f"ground_truth[{self.answer_key!r}] must be a string or number, got {type(raw).__name__}")
        gold = self._parse_gold(str(raw).strip())
        if not gold:
            return _invalid(self.version, f"ground_truth[{self.answer_key!r}] = {raw!r} does not parse with math-verify")
        pred = self._parse(sample.response_text, parsing_timeout=None)
        hit = bool(pred) and bool(self._verify(gold, pred, timeout_seconds=None))
        return _ok(self.name, self.version, 1.0 if hit else 0.0)


_FLAGS = {"i": re.IGNORECASE, "m": re.MULTILINE, "s": re.DOTALL, "x": re.VERBOSE, "a": re.ASCII}


class RegexFormat:
    """1.0 when the response matches ``pattern`` (``re.search``, or ``re.fullmatch`` with
    ``full_match=True``), else 0.0 -- a format reward (e.g. "has a \\boxed{} answer").

    The response is matched as is (no stripping): write ``\\s*`` for optional trailing space.
    ``flags`` is a string of ``i m s x a`` (ignorecase, multiline, dotall, verbose, ascii).
    """

    name = "regex"
    checks = "format"  # what its score says about a response (declarations.component_checks)

    def __init__(self, pattern: str, full_match: bool = False, flags: str = ""):
        if not isinstance(pattern, str):
            raise RewardConfigError(f"regex pattern must be a string, got {type(pattern).__name__} {pattern!r}")
        bad = sorted(set(str(flags)) - set(_FLAGS))
        if bad:
            raise RewardConfigError(f"regex flags {flags!r}: unknown flag(s) {bad}; use any of {''.join(_FLAGS)!r}")
        f = 0
        for c in str(flags):
            f |= _FLAGS[c]
        try:
            self._re = re.compile(pattern, f)
        except re.error as e:
            raise RewardConfigError(f"regex pattern {pattern!r} does not compile: {e}") from e
        self.pattern, self.full_match, self.flags = pattern, bool(full_match), "".join(sorted(set(str(flags))))
        digest = hashlib.sha256(pattern.encode()).hexdigest()[:12]
        self.version = f"regex/1(sha256={digest},full_match={self.full_match},flags={self.flags!r})"
        self.required_fields = ()  # reads the response only

    def __call__(self, sample: RewardSample) -> RewardRecord:
        text = sample.response_text
        m = self._re.fullmatch(text) if self.full_match else self._re.search(text)
        return _ok(self.name, self.version, 1.0 if m else 0.0)


class Arithmetic:
    """The built-in arithmetic task's rule (:func:`megarl.data.tasks.arithmetic.score`): 1.0 iff
    the response is exactly the integer answer.  A non-integer ground truth is ``invalid``."""

    name = "arithmetic"
    checks = "answer"  # what its score says about a response (declarations.component_checks)

    def __init__(self, answer_key: str = "answer"):
        # Imported here, not at module level, so the rewards package does not depend on the data
        # package at import time.
        from megarl.data.tasks.arithmetic import score

        self._score = score
        self.answer_key = str(answer_key)
        self.version = f"arithmetic/1(answer_key={self.answer_key!r})"
        self.required_fields = (self.answer_key,)

    def extract_answer(self, text: str) -> str | None:
        """The integer the response spells, normalised exactly as :func:`score` reads it (None
        when the response is not one integer)."""
        # score()'s own two steps (the task module keeps them private): drop special tokens and
        # all whitespace, then read one integer without leading zeros
        from megarl.data.tasks.arithmetic import _SPECIAL, _normalize_int

        return _normalize_int("".join(_SPECIAL.sub(" ", text).split())) if isinstance(text, str) else None

    def __call__(self, sample: RewardSample) -> RewardRecord:
        raw, bad = _answer(sample, self.answer_key, self.version)
        if bad is not None:
            return bad
        if isinstance(raw, bool) or not isinstance(raw, (str, numbers.Integral)):
            return _invalid(self.version, f"ground_truth[{self.answer_key!r}] = {raw!r} is not an integer")
        try:
            value = self._score(sample.response_text, raw)
        except ValueError as e:  # score() raises ValueError only for a non-integer answer
            return _invalid(self.version, f"ground_truth[{self.answer_key!r}] = {raw!r}: {e}")
        return _ok(self.name, self.version, float(value))


class RunningSum:
    """The running-sum task's rule (:func:`megarl.data.tasks.running_sum.score`): 1.0 iff the
    response ends with ``so`` and the integer answer; the chain before it is not scored.  A
    ground truth that is not a non-negative integer is ``invalid``."""

    name = "running_sum"
    checks = "answer"  # what its score says about a response (declarations.component_checks)

    def __init__(self, answer_key: str = "answer"):
        from megarl.data.tasks.running_sum import score  # not at import time (as Arithmetic)

        self._score = score
        self.answer_key = str(answer_key)
        self.version = f"running_sum/1(answer_key={self.answer_key!r})"
        self.required_fields = (self.answer_key,)

    def extract_answer(self, text: str) -> str | None:
        """The integer after the response's final ``so`` (what :func:`score` compares)."""
        from megarl.data.tasks.running_sum import final_answer

        return final_answer(text)

    __call__ = Arithmetic.__call__  # the same checks of the ground truth, this task's score()


def step_token_ends(char_ends, token_char_ends) -> list:
    """Each step's last response token: the first token whose text ends at or past the step's
    character offset (``token_char_ends``: where each token's text ends in the response)."""
    import bisect

    return [min(bisect.bisect_left(token_char_ends, c), len(token_char_ends) - 1) for c in char_ends]


class RunningSumSteps(RunningSum):
    """The running-sum task's process reward: the final answer's rule (:class:`RunningSum`) as the
    outcome, and each worked step checked against the problem
    (:func:`megarl.data.tasks.running_sum.step_checks`), 1.0 right and 0.0 wrong, placed on the
    step's last response token (``step_rewards`` / ``step_token_ends``; the final answer is the
    last step).  Components: ``correct`` (the outcome) and ``step_accuracy``.  Steps that end on
    one token (a tokenizer that joins them) are one step, right iff all of them are."""

    name = "running_sum_steps"
    places_steps = True  # the scorer gives it response_char_ends; grpo_process reads its steps

    def __init__(self, answer_key: str = "answer"):
        super().__init__(answer_key)
        self.version = f"running_sum_steps/1(answer_key={self.answer_key!r})"

    def __call__(self, sample: RewardSample) -> RewardRecord:
        from megarl.data.tasks.running_sum import step_checks

        outcome = RunningSum.__call__(self, sample)
        if outcome.status is not RewardStatus.OK:
            return outcome
        if not sample.response_char_ends:
            return RewardRecord(total=None, scorer_version=self.version, status=RewardStatus.ERROR,
                                error="running_sum_steps: the sample carries no response_char_ends (the scorer "
                                      "fills them for a reward that places steps)")
        checks = step_checks(sample.prompt_text, sample.response_text)
        if not checks:  # nothing worked and no final answer: the outcome is the one step, on the last token
            checks = [(len(sample.response_text), outcome.total == 1.0)]
        ends = step_token_ends([c for c, _ in checks], list(sample.response_char_ends))
        merged: dict = {}
        for end, (_, right) in zip(ends, checks, strict=True):
            merged[end] = merged.get(end, True) and right
        steps = sorted(merged.items())
        rewards = tuple(1.0 if right else 0.0 for _, right in steps)
        return RewardRecord(total=outcome.total, components={"correct": outcome.total,
                                                             "step_accuracy": sum(rewards) / len(rewards)},
                            scorer_version=self.version, step_rewards=rewards,
                            step_token_ends=tuple(e for e, _ in steps))
