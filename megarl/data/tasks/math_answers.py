"""Final answers of math datasets and responses: GSM8K's ``#### 72`` line and the last
``\\boxed{...}`` of a MATH solution (balanced braces, so ``\\boxed{\\frac{1}{2}}`` gives
``\\frac{1}{2}``).  Used by ``tools/prep_gsm8k.py``, ``tools/prep_math.py`` and the example
reward plug-in (``examples/reward_plugin.py``).
"""

from __future__ import annotations

import re
from typing import Optional

__all__ = ["last_boxed", "gsm8k_final_answer"]

_BOX_COMMANDS = ("\\boxed", "\\fbox")


def _braced(text: str, open_at: int) -> Optional[str]:
    """The content of the ``{...}`` group opening at ``text[open_at]``, braces balanced (an
    escaped ``\\{`` / ``\\}`` does not count); None when it never closes."""
    depth, i = 0, open_at
    while i < len(text):
        c = text[i]
        if c == "\\":
            i += 2  # skip the escaped character: \{ and \} are literal braces
            continue
        if c == "{":
            depth += 1
        elif c == "}":
            depth -= 1
            if depth == 0:
                return text[open_at + 1:i]
        i += 1
    return None


def last_boxed(text: str) -> Optional[str]:
    """The content of the last ``\\boxed{...}`` (or ``\\fbox{...}``, or ``\\boxed 5``) in
    ``text``, stripped; None when there is none or its braces never close."""
    if not isinstance(text, str):
        return None
    best, best_at = None, -1
    for cmd in _BOX_COMMANDS:
        at = text.rfind(cmd)
        while at != -1:
            rest = at + len(cmd)
            if rest < len(text) and (text[rest].isalpha()):  # \boxedfoo is another macro
                at = text.rfind(cmd, 0, at)
                continue
            if at > best_at:
                j = rest
                while j < len(text) and text[j] == " ":
                    j += 1
                if j < len(text) and text[j] == "{":
                    content = _braced(text, j)
                elif j > rest:  # "\boxed 5": the next token up to a space or '$'
                    m = re.match(r"[^\s$]+", text[j:])
                    content = m.group(0) if m else None
                else:
                    content = None
                if content is not None:
                    best, best_at = content.strip(), at
            break
    return best


def gsm8k_final_answer(answer: str) -> Optional[str]:
    """The number after GSM8K's ``####`` marker, thousands separators removed (``1,000`` ->
    ``1000``); None when the text has no marker or nothing after it."""
    if not isinstance(answer, str) or "####" not in answer:
        return None
    final = answer.rsplit("####", 1)[1].strip()
    final = final.replace(",", "").rstrip(".").strip()
    return final or None
