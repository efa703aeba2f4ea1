"""Preference pairs: what a Bradley-Terry reward model is trained and judged on.

A pair file is JSONL, one pair per line, in either of the two layouts preference data is
published in:

* texts: ``{"prompt": ..., "chosen": "<response>", "rejected": "<response>"}``, the prompt a text
  or a list of chat messages;
* chats: ``{"chosen": [messages...], "rejected": [messages...]}``, each a whole conversation
  whose last message is the assistant's answer (a ``prompt`` is then not allowed).

Each side is rendered by the reward model's own tokenizer and chat template through the same
function the trainer's scorer uses (:func:`megarl.data.scorer_input.render_for_scorer`), so a
model trained here reads at scoring time exactly what it was trained on.  A bad row is refused
with its file, line and key; nothing is skipped silently.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import List, Optional, Sequence

from megarl.errors import MegarlError


class PreferenceDataError(MegarlError, ValueError):
    """A preference file that is not what the trainer expects (names file, line and key)."""


@dataclass(frozen=True)
class PreferencePair:
    """One pair: the context (the prompt's messages, or its text) and the two answers.  A chat
    row keeps its shared context in ``messages`` and each side's last turn as the response."""

    prompt_text: str
    messages: Optional[tuple]  # the chat before the answer (None: ``prompt_text`` is one user turn)
    chosen: str
    rejected: str
    where: str  # ``file:line``, for messages
    #: the row's other fields (a reference-guided model's template reads them: ``{answer}``)
    ground_truth: Optional[dict] = None


def _is_messages(v) -> bool:
    return isinstance(v, list) and bool(v) and all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in v)


def _from_chats(row: dict, where: str) -> PreferencePair:
    c, r = row["chosen"], row["rejected"]
    for key, side in (("chosen", c), ("rejected", r)):
        if side[-1]["role"] != "assistant":
            raise PreferenceDataError(f"{where}: {key}: the last message must be the assistant's answer, "
                                      f"got role {side[-1]['role']!r}")
    if c[:-1] != r[:-1]:
        raise PreferenceDataError(f"{where}: chosen and rejected must share the conversation before their "
                                  "last (assistant) message")
    context = tuple(dict(m) for m in c[:-1])
    if not context:
        raise PreferenceDataError(f"{where}: chosen / rejected hold only the answer; the conversation before it "
                                  "(at least the user's turn) is missing")
    return PreferencePair(prompt_text=context[-1]["content"], messages=context, chosen=c[-1]["content"],
                          rejected=r[-1]["content"], where=where)


def parse_pair(row, where: str) -> PreferencePair:
    """One JSON row as a :class:`PreferencePair` (the layouts in the module docstring), its
    other fields kept as the pair's ground truth."""
    import dataclasses

    pair = _parse_pair(row, where)
    truth = {k: v for k, v in row.items() if k not in ("prompt", "chosen", "rejected")}
    return dataclasses.replace(pair, ground_truth=truth)


def _parse_pair(row, where: str) -> PreferencePair:
    if not isinstance(row, dict):
        raise PreferenceDataError(f"{where}: expected a JSON object with chosen and rejected, got {type(row).__name__}")
    missing = [k for k in ("chosen", "rejected") if k not in row]
    if missing:
        raise PreferenceDataError(f"{where}: no {' / '.join(missing)} key (a preference row holds chosen and "
                                  f"rejected; it has {sorted(row)})")
    c, r = row["chosen"], row["rejected"]
    if _is_messages(c) and _is_messages(r):
        if "prompt" in row:
            raise PreferenceDataError(f"{where}: chosen and rejected are whole chats; a prompt key is not allowed "
                                      "with them (put it in the chats)")
        return _from_chats(row, where)
    for key, side in (("chosen", c), ("rejected", r)):
        if not isinstance(side, str):
            raise PreferenceDataError(f"{where}: {key}: expected a response text or a list of chat messages "
                                      f"({{role, content}}), got {type(side).__name__}")
    prompt = row.get("prompt")
    if _is_messages(prompt):
        return PreferencePair(prompt_text=prompt[-1]["content"], messages=tuple(dict(m) for m in prompt),
                              chosen=c, rejected=r, where=where)
    if not isinstance(prompt, str):
        raise PreferenceDataError(f"{where}: prompt: expected a text or a list of chat messages with text "
                                  f"chosen / rejected, got {type(prompt).__name__}")
    return PreferencePair(prompt_text=prompt, messages=None, chosen=c, rejected=r, where=where)


def read_pairs(path: str, key: str) -> List[PreferencePair]:
    """Every pair of the JSONL file ``path`` (``key``: the config key that named it, for messages)."""
    import os

    if not os.path.isfile(path):
        raise PreferenceDataError(f"{key}: {path}: no such file (a JSONL of preference pairs)")
    out = []
    with open(path) as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"{path}:{n}"
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise PreferenceDataError(f"{where}: not JSON ({e.msg})") from None
            out.append(parse_pair(row, where))
    if not out:
        raise PreferenceDataError(f"{key}: {path}: holds no pairs")
    return out


def render_pairs(contract, pairs: Sequence[PreferencePair], max_tokens: int, key: str,
                 context: Optional[str] = None, context_key: str = "data.prompt") -> List[tuple]:
    """``[(chosen ids, rejected ids)]`` through the reward model's tokenizer ``contract`` and
    template (and, for a reference-guided model, its user-turn ``context`` filled with the row's
    fields); a side longer than ``max_tokens`` is refused naming its line (``key``: the limit's
    key), a row without a field ``context`` names too."""
    from megarl.data.scorer_input import render_for_scorer

    out = []
    for p in pairs:
        try:
            sides = tuple(render_for_scorer(contract, p.messages, p.prompt_text, text, context, p.ground_truth,
                                            key=context_key) for text in (p.chosen, p.rejected))
        except KeyError as e:
            raise PreferenceDataError(f"{p.where}: {e.args[0]}") from None
        longest = max(len(s) for s in sides)
        if longest > max_tokens:
            raise PreferenceDataError(f"{p.where}: renders to {longest} tokens, over {key}={max_tokens}")
        if sides[0] == sides[1]:
            raise PreferenceDataError(f"{p.where}: chosen and rejected render to the same tokens; the pair "
                                      "carries no preference")
        out.append(sides)
    return out
