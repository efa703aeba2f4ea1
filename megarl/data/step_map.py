"""Where a process reward model reads each step, and which actor token each step lands on.

A response's steps end at each occurrence of the PRM's step separator (the separator included)
and, if anything follows the last one, at the response's end.  The PRM reads its head at the
token of *its own* rendering that holds a step's last character -- found through its
tokenizer's character offsets into the rendered text -- and the step's score is placed on the
actor token whose text ends at or past that character of the response (the actor's own
offsets, ``RewardSample.response_char_ends``).  Two tokenizers, one text: the map goes through
characters, never through ids.
"""

from __future__ import annotations

from typing import List, Optional, Sequence, Tuple


def step_char_ends(response_text: str, separator: str) -> List[int]:
    """Character offsets (exclusive ends) in ``response_text`` where its steps end: after each
    separator (trailing whitespace not counted: it belongs to no token), and at the end when
    text (not only whitespace) follows the last one."""
    if not separator:
        raise ValueError("a process reward model needs a non-empty step separator")
    ends, start = [], 0
    while True:
        i = response_text.find(separator, start)
        if i < 0:
            break
        start = i + len(separator)
        end = len(response_text[:start].rstrip())
        if response_text[:end].strip() and (not ends or end > ends[-1]):
            ends.append(end)
    if response_text[start:].strip():
        ends.append(len(response_text.rstrip()))
    return ends


def token_at_char(offsets: Sequence[Tuple[int, int]], char: int) -> Optional[int]:
    """The index of the token whose character span holds position ``char`` (of the rendered
    text), or of the last token that starts before it (a character a tokenizer dropped, such as
    whitespace); None when no token starts at or before it."""
    best = None
    for t, (a, b) in enumerate(offsets):
        if a <= char < b:
            return t
        if a <= char and b > a:
            best = t
    return best


def prm_read_positions(rendered: str, offsets: Sequence[Tuple[int, int]], response_text: str,
                       ends: Sequence[int]) -> List[int]:
    """For each step end (a character offset in ``response_text``), the PRM token to read: the
    one holding the step's last character in ``rendered`` (the response is the last occurrence
    of its text in the rendering: the assistant's turn comes last)."""
    start = rendered.rfind(response_text)
    if start < 0:
        raise ValueError("the response does not appear in the PRM's rendering (its template changes the text)")
    out = []
    for e in ends:
        t = token_at_char(offsets, start + max(e - 1, 0))
        if t is None:
            raise ValueError(f"no PRM token holds character {start + e - 1} of its rendering")
        out.append(t)
    return out
