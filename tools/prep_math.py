#!/usr/bin/env python
"""The MATH dataset (Hendrycks et al.), from a local copy of its files, as megarl prompt rows.

    tools/prep_math.py --in MATH/train --out data/math_train.jsonl
    tools/prep_math.py --in MATH/test --out data/math_test_hard.jsonl --levels 4 5
    tools/prep_math.py --in competition_math/test.parquet math500/test.jsonl --out data/math_test.jsonl

Input: the original release's directory tree (``<split>/<subject>/<n>.json``, one
``{"problem", "level", "type", "solution"}`` per file, read in path order), or ``.jsonl`` /
``.json`` / ``.parquet`` files of such records (the Hub copies; MATH-500's ``answer``,
``subject`` and ``unique_id`` columns are used when present).  The final answer is the record's
``answer``, else the content of the solution's last ``\\boxed{...}`` (balanced braces); a LaTeX
answer is written between ``$...$`` (a plain number as it is): that is how math-verify parses it
right.  Output: ``{"id", "prompt" (or "messages" with --chat), "answer", "source": "math", "level",
"type", "solution"}`` -- ``answer`` is what ``reward.fn: math_verify`` reads.
"""

from __future__ import annotations

import argparse
import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megarl.data.tasks.math_answers import last_boxed  # noqa: E402
from megarl.data.tasks.prep import PrepError, add_output_args, prompt_row, read_records, write_rows  # noqa: E402
from megarl.errors import cli_main  # noqa: E402


def _tree_records(root: str):
    """``(where, record, id)`` for every ``*.json`` problem file under ``root``, in path order."""
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames.sort()
        for name in sorted(filenames):
            if name.endswith(".json"):
                path = os.path.join(dirpath, name)
                rel = os.path.relpath(path, os.path.dirname(os.path.normpath(root)))
                for where, rec in read_records(path):
                    yield where, rec, "math/" + rel[: -len(".json")].replace(os.sep, "/")


def gold_answer(answer: str) -> str:
    """The ``answer`` field for a MATH final answer: a plain number as is, LaTeX inside ``$...$``.
    math-verify reads a bare ``\\left( 3, \\frac{\\pi}{2} \\right)`` as just ``3``; between
    math delimiters it is the tuple ``(3, pi/2)``."""
    answer = answer.strip()
    if "$" in answer or re.fullmatch(r"[-+]?\d+(?:\.\d+)?", answer):
        return answer
    return f"${answer}$"


def _level(value) -> int | None:
    """``"Level 5"`` / ``5`` -> 5 (MATH's ``"Level ?"`` -> None)."""
    text = str(value).replace("Level", "").strip()
    return int(text) if text.isdigit() else None


def math_rows(inputs, *, suffix: str, chat: bool, system=None, limit=None, levels=None):
    """megarl rows for the MATH problems in ``inputs`` (directories and files), in order."""
    n = 0
    for src in inputs:
        if os.path.isdir(src):
            records = _tree_records(src)
        else:
            split = os.path.basename(src).split(".")[0].split("-")[0]
            records = ((w, r, None) for w, r in read_records(src))
        for where, rec, tree_id in records:
            if limit is not None and n >= limit:
                return
            problem, solution = rec.get("problem"), rec.get("solution")
            if not isinstance(problem, str) or not problem.strip():
                raise PrepError(f"{where}: expected MATH's 'problem' string, found {sorted(rec)}")
            answer = rec.get("answer")
            if not isinstance(answer, str) or not answer.strip():
                answer = last_boxed(solution) if isinstance(solution, str) else None
            if not answer:
                raise PrepError(f"{where}: no final answer: no 'answer' field and no \\boxed{{...}} in the solution")
            level = _level(rec.get("level"))
            if levels and level not in levels:
                continue
            row_id = str(rec.get("unique_id") or tree_id or f"math-{split}-{n}")
            yield prompt_row(row_id, problem, gold_answer(answer), "math", suffix=suffix, chat=chat, system=system,
                             level=level, type=rec.get("type") or rec.get("subject"), solution=solution)
            n += 1


@cli_main
def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--in", dest="inputs", nargs="+", required=True,
                   help="MATH split directories (<split>/<subject>/<n>.json) or .jsonl/.json/.parquet files")
    p.add_argument("--levels", type=int, nargs="+", default=None, help="keep only these difficulty levels (1-5)")
    add_output_args(p)
    args = p.parse_args(argv)
    for src in args.inputs:
        if not os.path.exists(src):
            raise PrepError(f"{src}: input not found")
    n = write_rows(math_rows(args.inputs, suffix=args.suffix, chat=args.chat, system=args.system, limit=args.limit,
                             levels=set(args.levels) if args.levels else None), args.out)
    print(f"wrote {n} MATH problems to {args.out}")
    return 0


if __name__ == "__main__":
    main()
