"""What the dataset prep tools (``tools/prep_gsm8k.py``, ``tools/prep_math.py``) share: reading
a local copy of a dataset's files, and writing megarl's prompt rows.

An output row is ``{"id", "prompt" | "messages", "answer", "source", ...}``: ``answer`` is the
field the ``math_verify`` (and ``exact_numeric``) rewards read, ``source`` names the dataset
(per-source metrics in ``python -m megarl.eval``), and the problem text gets the instruction
suffix (default: reason step by step and put the final answer in ``\\boxed{}``, which is what
math-verify parses in a response).
"""

from __future__ import annotations

import argparse
import json
import os
from typing import Iterator, Optional

from megarl.errors import MegarlError

__all__ = ["PrepError", "DEFAULT_SUFFIX", "read_records", "prompt_row", "write_rows", "add_output_args"]

DEFAULT_SUFFIX = "\n\nPlease reason step by step, and put your final answer within \\boxed{}."


class PrepError(MegarlError, ValueError):
    """An input file a prep tool cannot read; the message names the file and line."""


def read_records(path: str) -> Iterator[tuple[str, dict]]:
    """``(where, record)`` from a ``.jsonl`` file (one object per line), a ``.json`` file (one
    object, or a list of them) or a ``.parquet`` file."""
    if not os.path.isfile(path):
        raise PrepError(f"{path}: input file not found")
    lower = path.lower()
    if lower.endswith(".parquet"):
        import pyarrow.parquet as pq

        for i, rec in enumerate(pq.read_table(path).to_pylist(), start=1):
            yield f"{path}:{i}", rec
        return
    with open(path, encoding="utf-8") as f:
        text = f.read()
    if lower.endswith(".json"):
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise PrepError(f"{path}: not valid JSON ({e.msg} at line {e.lineno})") from None
        for i, rec in enumerate(data if isinstance(data, list) else [data], start=1):
            if not isinstance(rec, dict):
                raise PrepError(f"{path}: item {i} is a {type(rec).__name__}, expected an object")
            yield (f"{path}:{i}" if isinstance(data, list) else path), rec
        return
    for line_no, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as e:
            raise PrepError(f"{path}:{line_no}: not valid JSON ({e.msg})") from None
        if not isinstance(rec, dict):
            raise PrepError(f"{path}:{line_no}: expected a JSON object, got {type(rec).__name__}")
        yield f"{path}:{line_no}", rec


def prompt_row(row_id: str, problem: str, answer: str, source: str, *, suffix: str, chat: bool,
               system: Optional[str] = None, **extra) -> dict:
    """One megarl prompt row: ``prompt`` text (or a ``messages`` chat with ``chat``), the
    ``answer`` the math rewards read, ``source``, and any ``extra`` ground-truth fields."""
    text = problem.strip() + suffix
    row: dict = {"id": row_id}
    if chat:
        row["messages"] = ([{"role": "system", "content": system}] if system else []) + [
            {"role": "user", "content": text}]
    else:
        if system:
            raise PrepError("--system needs --chat (a plain prompt has no system turn; or use data.system_prompt)")
        row["prompt"] = text
    row.update(answer=answer, source=source, **extra)
    return row


def write_rows(rows, out: str) -> int:
    """Write ``rows`` as JSON lines to ``out`` (atomically); return how many."""
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    tmp, n = f"{out}.tmp", 0
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            for row in rows:
                f.write(json.dumps(row, ensure_ascii=False) + "\n")
                n += 1
    except BaseException:  # a bad input record: leave no half-written file behind
        os.unlink(tmp)
        raise
    if n == 0:
        os.unlink(tmp)
        raise PrepError(f"{out}: no rows to write (empty input?)")
    os.replace(tmp, out)
    return n


def add_output_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", required=True, help="the megarl prompt file to write (.jsonl)")
    p.add_argument("--suffix", default=DEFAULT_SUFFIX,
                   help="instruction appended to every problem (default: step by step, answer in \\boxed{}); "
                        "'' for none")
    p.add_argument("--chat", action="store_true", help="write 'messages' (a one-turn chat) instead of 'prompt'")
    p.add_argument("--system", default=None, help="a system message (with --chat)")
    p.add_argument("--limit", type=int, default=None, help="write at most this many rows")
