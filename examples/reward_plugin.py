"""An example reward plug-in: a format reward and an answer reward, as two components.

Use it from the repository root (the directory ``python -m megarl.train`` runs in is importable)::

    reward:
      fn: examples.reward_plugin:boxed_answer
      kwargs: {format_weight: 0.2}      # optional; passed on every call

or copy this file into your own package and name it ``your_pkg.your_module:boxed_answer``.

What megarl expects of a plug-in (megarl/rewards/plugin.py):

* it is called with one :class:`megarl.rewards.RewardSample` (``response_text``,
  ``ground_truth`` -- the dataset row minus its prompt --, ``prompt_text``, ``finish_reason``,
  token ids ...), possibly from several threads or worker processes at once, so it keeps no
  mutable state;
* it returns a number, or ``{"total": x, "components": {name: value}}`` (the components are
  logged as ``prep/reward_component/<name>`` metrics and in the sample tables), or a full ``RewardRecord``;
* it raises for a sample it cannot score (the sample is counted as a scorer failure, never as
  a wrong answer);
* ``required_fields`` names the ground-truth fields it reads: megarl checks every train and
  held-out row for them at start-up and refuses a file that lacks them, naming the line;
* ``extract_answer(text)`` (optional) is the answer ``python -m megarl.eval`` votes over for
  maj@k.
"""

from __future__ import annotations

import re

from megarl.data.tasks.math_answers import last_boxed

_NUMBER = re.compile(r"^[-+]?\d+(?:\.\d+)?$")


def _normalise(answer: str) -> str:
    """``" \\$1,000 "`` -> ``"1000"``; ``"\\left( 3, \\frac{\\pi}{2} \\right)"`` ->
    ``"(3,\\frac{\\pi}{2})"``: spacing, dollar signs, thousands separators and ``\\left``/
    ``\\right`` do not change an answer."""
    text = answer.strip().strip("$").replace("\\left", "").replace("\\right", "").replace("\\!", "")
    text = re.sub(r"\s+", "", text).replace("\\$", "").rstrip(".")
    if _NUMBER.match(text.replace(",", "")):
        text = text.replace(",", "")
        value = float(text)
        return str(int(value)) if value == int(value) else repr(value)
    return text


def extract_answer(text: str) -> str | None:
    """The response's final answer: its last ``\\boxed{...}``, normalised (None: no box)."""
    boxed = last_boxed(text)
    return None if boxed is None else _normalise(boxed)


def boxed_answer(sample, format_weight: float = 0.2) -> dict:
    """``format``: 1 when the response puts a final answer in ``\\boxed{}``; ``correct``: 1 when
    that answer equals ``ground_truth["answer"]`` (after :func:`_normalise`).  The total is
    ``(1 - format_weight) * correct + format_weight * format``, in [0, 1]."""
    if not 0.0 <= format_weight <= 1.0:
        raise ValueError(f"format_weight must be in [0, 1], got {format_weight}")
    gold = sample.ground_truth.get("answer")
    if not isinstance(gold, (str, int, float)) or isinstance(gold, bool) or str(gold).strip() == "":
        raise ValueError(f"ground_truth['answer'] must be a non-empty string or number, got {gold!r}")
    predicted = extract_answer(sample.response_text)
    fmt = 0.0 if predicted is None else 1.0
    correct = 1.0 if predicted is not None and predicted == _normalise(str(gold)) else 0.0
    return {"total": (1.0 - format_weight) * correct + format_weight * fmt,
            "components": {"format": fmt, "correct": correct}}


# declarations megarl reads off the function (megarl/rewards/declarations.py)
boxed_answer.required_fields = ("answer",)
boxed_answer.extract_answer = extract_answer
