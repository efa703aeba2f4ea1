#!/usr/bin/env python
"""GSM8K, from a local copy of its files, as megarl prompt rows.

    tools/prep_gsm8k.py --in grade-school-math/grade_school_math/data/train.jsonl --out data/gsm8k_train.jsonl
    tools/prep_gsm8k.py --in gsm8k/main/test-00000-of-00001.parquet --out data/gsm8k_test.jsonl --chat

Input: the GSM8K JSON lines (or the Hub copy's Parquet), one ``{"question", "answer"}`` per
problem, the final answer after ``####`` on the answer's last line.  Output: one row per
problem, ``{"id": "gsm8k-<split>-<n>", "prompt" (or "messages" with --chat), "answer": "72",
"source": "gsm8k", "solution": <the worked answer>}`` -- ``answer`` is what ``reward.fn:
math_verify`` (or ``exact_numeric``) reads.  A record without a ``####`` answer is an error
naming its line.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megarl.data.tasks.math_answers import gsm8k_final_answer  # noqa: E402
from megarl.data.tasks.prep import PrepError, add_output_args, prompt_row, read_records, write_rows  # noqa: E402
from megarl.errors import cli_main  # noqa: E402


def gsm8k_rows(paths, split: str, *, suffix: str, chat: bool, system=None, limit=None):
    """megarl rows for the GSM8K records in ``paths``, in order."""
    n = 0
    for path in paths:
        for where, rec in read_records(path):
            if limit is not None and n >= limit:
                return
            q, a = rec.get("question"), rec.get("answer")
            if not isinstance(q, str) or not q.strip() or not isinstance(a, str):
                raise PrepError(f"{where}: expected GSM8K's 'question' and 'answer' strings, found {sorted(rec)}")
            final = gsm8k_final_answer(a)
            if final is None:
                raise PrepError(f"{where}: the answer has no '#### <final answer>' line")
            yield prompt_row(f"gsm8k-{split}-{n}", q, final, "gsm8k", suffix=suffix, chat=chat, system=system,
                             solution=a.rsplit("####", 1)[0].strip())
            n += 1


@cli_main
def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--in", dest="inputs", nargs="+", required=True, help="GSM8K .jsonl / .parquet file(s)")
    p.add_argument("--split", default=None, help="the split name in the ids (default: from the first file's name)")
    add_output_args(p)
    args = p.parse_args(argv)
    split = args.split or os.path.basename(args.inputs[0]).split(".")[0].split("-")[0]
    n = write_rows(gsm8k_rows(args.inputs, split, suffix=args.suffix, chat=args.chat, system=args.system,
                              limit=args.limit), args.out)
    print(f"wrote {n} GSM8K problems to {args.out}")
    return 0


if __name__ == "__main__":
    main()
