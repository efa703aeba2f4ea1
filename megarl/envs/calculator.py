"""The ``calculator`` environment: multi-digit arithmetic with a calculator tool.

Rows are the arithmetic task's (:mod:`megarl.data.tasks.arithmetic`, operands of 4-6 digits by
default here: :func:`make_rows`): ``{"prompt": "what is 12345 plus 678 ?", "answer": "13023"}``.

**Tool syntax.**  A policy turn *calls the calculator* by writing an expression in square
brackets, ``[ 12345 + 678 ]``; several calls in one turn are parallel calls.  The expression is
integers with ``+``, ``-``, ``*`` and parentheses, whitespace ignored (:func:`find_calls` says
why, and how it suits the tiny vocabulary).  The step answers each call with one ``tool`` message holding the integer
(``13023``), or ``not a number`` for an expression it cannot evaluate.

**Final answer.**  A turn without a call is the answer and ends the episode (terminated) with
reward component ``correct``: 1.0 iff the turn is exactly the row's integer, by the arithmetic
task's rule (:func:`megarl.data.tasks.arithmetic.score`: special-token markers and whitespace
removed).  Tool steps have no reward components unless ``call_reward`` is set (a
well-formed call's reward, on its own turn); ``info`` counts ``tool_calls`` and ``tool_errors``.  The policy may also answer at once, without the tool.

:func:`demonstration` writes the conversation of a solved row with the tool (prompt, call, tool
result, answer) as messages, for warm-start demonstrations; render it to ids with
:func:`megarl.envs.render.render_conversation` so the demonstration has exactly the tokens a
session builds.
"""

from __future__ import annotations

import math
import re
from typing import Any, Mapping

from megarl.data.tasks import arithmetic
from megarl.envs.protocol import Message, StepOutcome

__all__ = ["CalculatorEnv", "evaluate", "find_calls", "demonstration", "make_rows", "NOT_A_NUMBER", "TOOL_ROLE"]

TOOL_ROLE = "tool"
NOT_A_NUMBER = "not a number"  # the tool's answer to an expression it cannot evaluate (tiny-vocabulary words)
_CALL = re.compile(r"\[([^\[\]]*)\]")
_TOKEN = re.compile(r"\d+|[-+*()]")
_OPS = {"plus": "+", "minus": "-", "times": "*"}
_PROBLEM = re.compile(r"(\d+)\s+(plus|minus|times)\s+(\d+)")


def find_calls(text: str) -> list[str]:
    """The bracketed expressions of a policy turn, in order (``"[ 1 2 + 3 ] [ 4 * 5 ]"`` ->
    ``["1 2 + 3", "4 * 5"]``).

    Whitespace inside is ignored because the tiny tokenizer has one token per digit and decodes
    them with spaces between (``[ 1 2 3 4 5 + 6 7 8 ]``).  Every character of the syntax is one
    token of the tiny vocabulary (``[``, ``]``, digits, ``+ - * ( )``; see
    :mod:`megarl.builtin.tiny_tokenizer`), so it encodes without ``<unk>`` (but write two brackets
    apart: the tiny pre-tokenizer groups adjacent punctuation, and ``((`` or ``][`` is one unknown
    piece)."""
    return _CALL.findall(text)


def evaluate(expr: str, *, max_digits: int = 12, max_tokens: int = 32) -> int | None:
    """The integer value of ``expr`` (integers, ``+ - *``, parentheses, unary minus; whitespace
    ignored), or None when it is not such an expression or exceeds the limits (operands of more
    than ``max_digits`` digits, more than ``max_tokens`` tokens: a policy cannot make the tool
    compute for long).  Recursive descent, no ``eval``::

        expr   := term (("+" | "-") term)*
        term   := factor ("*" factor)*
        factor := integer | "(" expr ")" | "-" factor
    """
    s = "".join(expr.split())
    if not s or _TOKEN.sub("", s):
        return None
    toks = _TOKEN.findall(s)
    if len(toks) > max_tokens or any(t.isdigit() and len(t) > max_digits for t in toks):
        return None
    pos = 0

    def peek():
        return toks[pos] if pos < len(toks) else None

    def take():
        nonlocal pos
        pos += 1
        return toks[pos - 1]

    def factor():
        t = peek()
        if t is None:
            raise ValueError
        if t.isdigit():
            return int(take())
        if t == "-":
            take()
            return -factor()
        if t == "(":
            take()
            v = expr_()
            if peek() != ")":
                raise ValueError
            take()
            return v
        raise ValueError

    def term():
        v = factor()
        while peek() == "*":
            take()
            v *= factor()
        return v

    def expr_():
        v = term()
        while peek() in ("+", "-"):
            v = v + term() if take() == "+" else v - term()
        return v

    try:
        value = expr_()
    except (ValueError, RecursionError):
        return None
    return value if pos == len(toks) else None


class CalculatorEnv:
    """One episode of the calculator task (module docstring).

    Args:
        tool_role: the role of the tool's messages (default ``"tool"``).  The tiny chat
            template renders a role as ``<|role|>``, and ``<|tool|>`` is not in the tiny
            vocabulary (three ``<unk>`` ids); ``"user"`` renders tool results with a known role
            marker (as Qwen's templates do, inside the user turn).
        max_calls: tool calls per episode; a turn calling beyond it gets ``not a number``.
        call_reward: earned by a tool turn whose every call evaluates (component ``tool_call``,
            that turn's reward: with ``algo.advantage=grpo_process`` or
            ``algo.reward_placement=recorded`` it credits the call, not the answer); 0 (the
            default): tool steps have no reward components.
    """

    version = "calculator/1"

    def __init__(self, tool_role: str = TOOL_ROLE, max_calls: int = 8, call_reward: float = 0.0):
        self.check_args(tool_role=tool_role, max_calls=max_calls, call_reward=call_reward)
        self.tool_role, self.max_calls, self.call_reward = tool_role, max_calls, float(call_reward)
        self.answer: str | None = None
        self.calls = 0

    @staticmethod
    def check_args(tool_role: str = TOOL_ROLE, max_calls: int = 8, call_reward: float = 0.0) -> None:
        if not isinstance(tool_role, str) or not tool_role or tool_role == "assistant":
            raise ValueError(f"calculator: tool_role must be a role name other than 'assistant', got {tool_role!r}")
        if isinstance(max_calls, bool) or not isinstance(max_calls, int) or max_calls < 1:
            raise ValueError(f"calculator: max_calls must be an int >= 1, got {max_calls!r}")
        if isinstance(call_reward, bool) or not isinstance(call_reward, (int, float)) or not math.isfinite(call_reward):
            raise ValueError(f"calculator: call_reward must be a finite number, got {call_reward!r}")

    def reset(self, row: Mapping[str, Any]) -> tuple[Message, ...]:
        answer = row.get("answer") if isinstance(row, Mapping) else None
        if arithmetic._normalize_int(str(answer).strip()) is None:  # the task's own integer rule
            raise ValueError(f"calculator: the row needs an integer 'answer', got {answer!r}")
        self.answer, self.calls = str(answer).strip(), 0
        return ()

    def step(self, action: str) -> StepOutcome:
        if self.answer is None:
            raise RuntimeError("calculator: step before reset")
        calls = find_calls(action)
        if not calls:
            correct = arithmetic.score(action, self.answer)
            return StepOutcome((), {"correct": correct}, terminated=True, truncated=False)
        results, errors = [], 0
        for expr in calls:
            self.calls += 1
            value = evaluate(expr) if self.calls <= self.max_calls else None
            errors += value is None
            results.append(Message(self.tool_role, NOT_A_NUMBER if value is None else str(value)))
        earned = {"tool_call": self.call_reward} if self.call_reward and not errors else {}
        return StepOutcome(tuple(results), earned, terminated=False, truncated=False,
                           info={"tool_calls": float(len(calls)), "tool_errors": float(errors)})


def demonstration(row: Mapping[str, Any], *, use_tool: bool = True, tool_role: str = TOOL_ROLE) -> tuple[Message, ...]:
    """The solved conversation of an arithmetic row as messages: ``user`` prompt, ``assistant``
    call ``[ a + b ]``, ``tool`` result, ``assistant`` answer (``use_tool=False``: prompt and
    answer only).  The operands and operator are read from the prompt (``what is 12345 plus 678
    ?``); the tool result is what :class:`CalculatorEnv` answers, checked against the row."""
    prompt, answer = str(row["prompt"]), str(row["answer"]).strip()
    m = _PROBLEM.search(prompt)
    if m is None:
        raise ValueError(f"demonstration: no 'A plus|minus|times B' in the prompt {prompt!r}")
    a, op, b = m.groups()
    call = f"[ {a} {_OPS[op]} {b} ]"
    result = str(evaluate(call[1:-1]))
    if arithmetic.score(result, answer) != 1.0:
        raise ValueError(f"demonstration: {call} is {result}, but the row's answer is {answer!r}")
    if not use_tool:
        return Message("user", prompt), Message("assistant", answer)
    return (Message("user", prompt), Message("assistant", call), Message(tool_role, result),
            Message("assistant", answer))


def make_rows(split: str, seed: int, n: int, digits: tuple[int, int] = (4, 6), ops: tuple[str, ...] = ("plus",)) -> list[dict]:
    """Arithmetic rows for the calculator (:func:`megarl.data.tasks.arithmetic.make_problems`),
    with operands of 4-6 digits by default: too long for the tiny model to add in its head."""
    return arithmetic.make_problems(split, seed, n, digits=digits, ops=ops)
