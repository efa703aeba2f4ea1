"""Procedural multi-digit arithmetic: the built-in verifiable task of the embedded default.

Prompts use only words of the tiny tokenizer's vocabulary (``what is 12 plus 345 ?``), so a tiny
model can learn the task on CPU in minutes.

Splits: every problem ``(a, op, b)`` belongs to exactly one split, decided by a stable hash of
its canonical text (operands of ``plus``/``times`` sorted, so ``3 plus 5`` and ``5 plus 3`` land
in the same split): ``heldout`` iff ``sha256(text) % 10 == 0``, else ``train``.  Generators
rejection-sample within their split, so train and heldout never share a problem whatever the
seeds.  Within one split problems are drawn with replacement (a small digit range has few
problems), or ``distinct`` (an evaluation set: the recipes' held-out file); a call is
deterministic given ``(split, seed, n, digits, ops, distinct)``.

Scoring rule (:func:`score`): special-token markers (``<eos>``, ``<|end|>``, ``</s>``,
``<|im_end|>``, ...) and all whitespace are removed from the response; what is left must be
exactly an optional ``-`` followed by ASCII digits, and its integer value must equal the answer's
(leading zeros allowed).  Anything else (extra words, an empty response) scores 0.0.  Whitespace
is removed rather than treated as a separator because the tiny tokenizer decodes one token per
digit with spaces between them (``3 5 7 <eos>``).

CLI::

    python -m megarl.data.tasks.arithmetic --split heldout --seed 0 --n 200 --out heldout.jsonl \\
        [--min-digits 1 --max-digits 3 --ops plus,minus] [--distinct] [--overwrite]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import re
import tempfile
from collections.abc import Iterable, Mapping, Sequence

from megarl.errors import MegarlError, cli_main

__all__ = ["OPS", "SPLITS", "make_problems", "problem_split", "problem_stratum", "score", "write_jsonl", "main"]

OPS = ("plus", "minus", "times")
SPLITS = ("train", "heldout")
HELDOUT_MODULUS = 10  # heldout iff sha256(canonical text) % 10 == 0: about 10% of all problems
_MAX_REJECTIONS = 100_000  # consecutive misses before a split is declared empty for these settings


def _operands(row: Mapping) -> tuple[str, str, str]:
    """``(a, op, b)`` as written in a row's prompt (``what is 12 plus 345 ?``)."""
    _what, _is, a, op, b, _q = str(row["prompt"]).split()
    return a, op, b


def problem_key(row: Mapping) -> str:
    """The canonical problem of a row of this module (``12 plus 345`` and ``345 plus 12`` are one)."""
    a, op, b = _operands(row)
    return _canonical(int(a), op, int(b))


def _canonical(a: int, op: str, b: int) -> str:
    if op in ("plus", "times"):  # commutative: both operand orders are one problem
        a, b = max(a, b), min(a, b)
    return f"{a} {op} {b}"


def problem_stratum(row: Mapping) -> tuple[str, int, int]:
    """A row's kind of problem: its op and its operands' digit counts, fewer first
    (``("plus", 1, 2)`` for ``7 plus 45``)."""
    a, op, b = _operands(row)
    return (op, *sorted((len(a.lstrip("-")), len(b.lstrip("-")))))


def problem_split(a: int, op: str, b: int) -> str:
    """The split ``"train"`` or ``"heldout"`` that problem ``a op b`` belongs to (stable, seedless)."""
    h = int.from_bytes(hashlib.sha256(_canonical(a, op, b).encode()).digest(), "big")
    return "heldout" if h % HELDOUT_MODULUS == 0 else "train"


def _operand(rng: random.Random, lo: int, hi: int) -> int:
    d = rng.randint(lo, hi)
    return rng.randint(0 if d == 1 else 10 ** (d - 1), 10**d - 1)


def _check_args(split: str, n: int, digits: Sequence[int], ops: Sequence[str]) -> tuple[int, int]:
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; expected one of {', '.join(SPLITS)}")
    for op in ops:
        if op not in OPS:
            raise ValueError(f"unknown op {op!r}; expected some of {', '.join(OPS)}")
    if not ops:
        raise ValueError("ops is empty; expected some of " + ", ".join(OPS))
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise ValueError(f"n must be a non-negative int, got {n!r}")
    try:
        lo, hi = (int(x) for x in digits)
    except (TypeError, ValueError):
        raise ValueError(f"digits must be a (min, max) pair of ints, got {digits!r}") from None
    if not 1 <= lo <= hi:
        raise ValueError(f"digits must satisfy 1 <= min <= max, got {digits!r}")
    return lo, hi


def make_problems(
    split: str,
    seed: int,
    n: int,
    digits: tuple[int, int] = (1, 3),
    ops: tuple[str, ...] = ("plus",),
    distinct: bool | None = None,
    exclude: Iterable[Mapping] = (),
) -> list[dict]:
    """``n`` problems of ``split``: ``{"id": "arith-<split>-<seed>-<i>", "prompt": "what is 12 plus
    345 ?", "answer": "357"}``.

    Each operand has a number of digits drawn uniformly from ``digits`` (inclusive); the op is
    drawn uniformly from ``ops``; for ``minus`` the larger operand comes first, so answers are
    never negative.  Uses ``random.Random(seed)`` only.

    ``distinct``: no problem twice (``3 plus 5`` and ``5 plus 3`` are one problem), as an
    evaluation set needs.  Drawn with replacement, a digit range of ``(1, 2)`` puts a quarter of
    the draws on the 55 one-digit sums, of which the held-out split holds five or six: one of
    them right or wrong then moves a 200-problem accuracy by up to 7.5 points.

    ``exclude``: rows (of this module) whose problems are never drawn -- a validation set kept
    apart from the evaluation set of the same split, or from the draws a model trains on.  With
    ``exclude``, ``distinct`` defaults to True (a validation set); ``distinct=False`` draws with
    replacement around the excluded problems (a training stream).
    """
    ops = (ops,) if isinstance(ops, str) else tuple(ops)
    lo, hi = _check_args(split, n, digits, ops)
    rng = random.Random(seed)
    rows, seen = [], {problem_key(r) for r in exclude}
    excluded = frozenset(seen)
    distinct = bool(seen) if distinct is None else distinct
    for i in range(n):
        for _ in range(_MAX_REJECTIONS):
            op = ops[rng.randrange(len(ops))]
            a, b = _operand(rng, lo, hi), _operand(rng, lo, hi)
            if op == "minus" and a < b:
                a, b = b, a
            key = _canonical(a, op, b)
            if problem_split(a, op, b) == split and key not in (seen if distinct else excluded):
                break
        else:
            raise ValueError(f"no {'new ' if distinct else ''}{split} problem found for digits={lo, hi} ops={ops} "
                             f"after {_MAX_REJECTIONS} draws; widen the digit range"
                             + (f" or ask for fewer than {n} distinct problems" if distinct else ""))
        if distinct:
            seen.add(_canonical(a, op, b))
        answer = a + b if op == "plus" else a - b if op == "minus" else a * b
        rows.append({"id": f"arith-{split}-{seed}-{i}", "prompt": f"what is {a} {op} {b} ?", "answer": str(answer)})
    return rows


# <eos>, <pad>, </s>, <s>, <|end|>, <|im_end|>, <|endoftext|>, <｜end▁of▁sentence｜> ...
_SPECIAL = re.compile(r"<\|[^<>|\s]*\|>|<｜[^<>｜\s]*｜>|</?[A-Za-z_][A-Za-z0-9_.-]*>")
_INT = re.compile(r"-?[0-9]+")


def _normalize_int(s: str) -> str | None:
    if not _INT.fullmatch(s):
        return None
    neg, digits = s.startswith("-"), s.lstrip("-").lstrip("0") or "0"
    return "-" + digits if neg and digits != "0" else digits


def score(response_text: str, answer: str | int) -> float:
    """1.0 iff the response is exactly the integer ``answer`` (rule in the module docstring), else 0.0.

    >>> score("3 5 7 <eos>", "357"), score("357 apples", "357"), score("", "357")
    (1.0, 0.0, 0.0)
    """
    want = _normalize_int(str(answer).strip())
    if want is None:
        raise ValueError(f"answer must be an integer, got {answer!r}")
    if not isinstance(response_text, str):
        return 0.0
    got = _normalize_int("".join(_SPECIAL.sub(" ", response_text).split()))
    return 1.0 if got == want else 0.0


def write_jsonl(path: str | os.PathLike, rows: Iterable[Mapping]) -> int:
    """Write ``rows`` as JSON lines to ``path`` (atomically: a temp file then a rename); return the count."""
    path = os.fspath(path)
    parent = os.path.dirname(os.path.abspath(path))
    os.makedirs(parent, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=".jsonl", dir=parent)
    count = 0
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            for row in rows:
                f.write(json.dumps(dict(row), ensure_ascii=False) + "\n")
                count += 1
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return count


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m megarl.data.tasks.arithmetic",
                                description="Write procedural arithmetic problems as JSON lines.")
    p.add_argument("--split", required=True, help="train or heldout (disjoint whatever the seeds)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--n", type=int, required=True, help="number of problems")
    p.add_argument("--out", required=True, help="output .jsonl file")
    p.add_argument("--min-digits", type=int, default=1)
    p.add_argument("--max-digits", type=int, default=3)
    p.add_argument("--ops", default="plus", help="comma-separated, among " + ",".join(OPS))
    p.add_argument("--distinct", action="store_true", help="no problem twice (an evaluation set)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing --out file")
    return p


@cli_main
def main(argv: Sequence[str] | None = None) -> None:
    args = _parser().parse_args(argv)
    ops = tuple(o.strip() for o in args.ops.split(",") if o.strip())
    if args.n < 1:
        raise MegarlError(f"--n must be at least 1, got {args.n}")
    if os.path.isdir(args.out):
        raise MegarlError(f"--out {args.out} is a directory; give a .jsonl file path")
    if os.path.exists(args.out) and not args.overwrite:
        raise MegarlError(f"--out {args.out} already exists; pass --overwrite to replace it or choose another file")
    try:
        rows = make_problems(args.split, args.seed, args.n, (args.min_digits, args.max_digits), ops,
                             distinct=args.distinct)
    except ValueError as e:
        raise MegarlError(f"{e} (--split/--ops/--min-digits/--max-digits)") from e
    try:
        write_jsonl(args.out, rows)
    except OSError as e:
        raise MegarlError(f"cannot write --out {args.out}: {e}") from e
    print(f"wrote {len(rows)} {args.split} problems to {args.out}", flush=True)


if __name__ == "__main__":
    main()
