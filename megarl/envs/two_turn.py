"""The ``two_turn`` environment: guess, get feedback, answer -- a reward that depends on both turns.

Rows are arithmetic rows (``{"prompt": "what is 12 plus 345 ?", "answer": "357"}``).  Turn 1 is
a *guess*; the environment answers with a ``user`` message of per-digit feedback, Wordle-style:
each digit of the answer the guess got right in its place is shown, the others are ``_``
(answer ``357``, guess ``351`` -> ``3 5 _``; a guess of the wrong length shows only ``_``).
Turn 2 is the *answer*; the episode then ends (terminated).

Reward components: step 1 ``guess`` = ``guess_weight`` x the fraction of the answer's digits
the guess placed right; step 2 ``correct`` = 1.0 iff the answer is exactly right (the
arithmetic task's rule).  The second turn's success depends on the first (a better guess reveals
more digits), so a trajectory return credits both turns: the task for credit assignment across
turns (per-turn rewards placed at each turn's last policy token, or the summed outcome at the
last one).  Every symbol of the feedback is one token of the tiny vocabulary.
"""

from __future__ import annotations

import math
from typing import Any, Mapping

from megarl.data.tasks import arithmetic
from megarl.envs.protocol import Message, StepOutcome

__all__ = ["TwoTurnEnv", "digit_feedback", "demonstration"]


def _digits(text: str) -> str | None:
    """The integer a turn states (the arithmetic rule: markers and whitespace removed), or None."""
    return arithmetic._normalize_int("".join(arithmetic._SPECIAL.sub(" ", text).split()))


def digit_feedback(guess: str | None, answer: str) -> tuple[str, float]:
    """``("3 5 _", 2/3)``: the answer's digits the guess has in the same place, ``_`` elsewhere,
    and the fraction right.  A guess that is no integer, or of another length, gets all ``_``."""
    ok = [guess is not None and len(guess) == len(answer) and g == a for g, a in zip(guess or "", answer, strict=False)]
    ok += [False] * (len(answer) - len(ok))
    return " ".join(a if hit else "_" for a, hit in zip(answer, ok, strict=False)), sum(ok) / len(answer)


class TwoTurnEnv:
    """One guess-feedback-answer episode (module docstring).

    Args:
        guess_weight: the weight of the first turn's ``guess`` component (0 turns it off).
        feedback_role: the role of the feedback message (default ``"user"``).
        restate: the feedback message also repeats the question (the row's ``prompt`` text:
            ``3 5 _ what is 12 plus 345 ?``), so the second turn is asked the way the first
            was -- what a model warm-started on single questions can answer at all.
    """

    version = "two_turn/1"

    def __init__(self, guess_weight: float = 0.5, feedback_role: str = "user", restate: bool = False):
        self.check_args(guess_weight=guess_weight, feedback_role=feedback_role, restate=restate)
        self.guess_weight, self.feedback_role, self.restate = float(guess_weight), feedback_role, restate
        self.answer: str | None = None
        self.question = ""
        self.turn = 0

    @staticmethod
    def check_args(guess_weight: float = 0.5, feedback_role: str = "user", restate: bool = False) -> None:
        if not isinstance(restate, bool):
            raise ValueError(f"two_turn: restate must be true or false, got {restate!r}")
        if isinstance(guess_weight, bool) or not isinstance(guess_weight, (int, float)) \
                or not math.isfinite(guess_weight) or guess_weight < 0:
            raise ValueError(f"two_turn: guess_weight must be a finite number >= 0, got {guess_weight!r}")
        if not isinstance(feedback_role, str) or not feedback_role or feedback_role == "assistant":
            raise ValueError(f"two_turn: feedback_role must be a role name other than 'assistant', got {feedback_role!r}")

    def reset(self, row: Mapping[str, Any]) -> tuple[Message, ...]:
        answer = row.get("answer") if isinstance(row, Mapping) else None
        norm = arithmetic._normalize_int(str(answer).strip())
        if norm is None or norm.startswith("-"):
            raise ValueError(f"two_turn: the row needs a non-negative integer 'answer', got {answer!r}")
        question = row.get("prompt")
        if self.restate and not (isinstance(question, str) and question.strip()):
            raise ValueError(f"two_turn: restate needs the row's prompt text, got {question!r}")
        self.answer, self.turn, self.question = norm, 0, question.strip() if self.restate else ""
        return ()

    def step(self, action: str) -> StepOutcome:
        if self.answer is None:
            raise RuntimeError("two_turn: step before reset")
        self.turn += 1
        if self.turn == 1:
            feedback, frac = digit_feedback(_digits(action), self.answer)
            text = f"{feedback} {self.question}" if self.restate else feedback
            return StepOutcome((Message(self.feedback_role, text),), {"guess": self.guess_weight * frac},
                               terminated=False, truncated=False)
        if self.turn == 2:
            return StepOutcome((), {"correct": arithmetic.score(action, self.answer)}, terminated=True, truncated=False)
        raise RuntimeError("two_turn: the episode has ended")


def demonstration(row: Mapping[str, Any], guess: str, *, feedback_role: str = "user",
                  restate: bool = False) -> tuple[Message, ...]:
    """The conversation of one episode as messages, for warm-start demonstrations: ``user``
    prompt, ``assistant`` ``guess``, the feedback :class:`TwoTurnEnv` gives for it (the same
    text), ``assistant`` the right answer.  Render it to ids with
    :func:`megarl.envs.render.render_conversation`: the demonstration then has exactly the
    tokens a session builds."""
    env = TwoTurnEnv(feedback_role=feedback_role, restate=restate)
    env.reset(row)
    (feedback,) = env.step(guess).observation
    return (Message("user", str(row["prompt"])), Message("assistant", guess), feedback,
            Message("assistant", env.answer))
