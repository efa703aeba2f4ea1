"""Running sums: the built-in reasoning task with a long tail of response lengths.

A problem is a list of tagged one-digit terms (``sum a 3 b 5 c 2 ?``); the answer is their
total.  A worked answer takes one step per term -- its tag, the term, the total so far and the
new total -- then the result: ``a 3 + 0 = 3 , b 5 + 3 = 8 , c 2 + 8 = 10 so 10``.  A small model
cannot add many digits at once, so it writes the chain, and the chain is as long as the problem:
one step per term.  (The tags make each step a lookup a small transformer can learn: the next
tag follows the last one, and the term follows its tag in the prompt.)

The tail is the task's own: the number of terms follows a truncated power law (``P(k) ~
k^-alpha`` for ``k_min <= k <= k_max``), and nothing pads a response.  With the defaults a worked
answer of ``k`` terms takes about ``9 k`` tokens: median 27, p99 224, max 256 (docs/tiny-model.md).

The reward reads only the final answer (:func:`score`): the integer after the last ``so``.  The
chain is how a model gets there, not what is scored.

Splits: every problem belongs to one split, by a stable hash of its terms in order (``heldout``
iff ``sha256 % 10 == 0``), as in :mod:`megarl.data.tasks.arithmetic`; generators rejection-sample
within their split.  Deterministic given the arguments.

CLI::

    python -m megarl.data.tasks.running_sum --split heldout --seed 1 --n 200 --out heldout.jsonl \\
        [--min-terms 2 --max-terms 26 --alpha 1.8] [--distinct] [--overwrite]
"""

from __future__ import annotations

import argparse
import bisect
import hashlib
import os
import random
import re
from collections.abc import Iterable, Mapping, Sequence

from megarl.data.tasks.arithmetic import write_jsonl
from megarl.errors import MegarlError, cli_main

__all__ = ["SPLITS", "TAGS", "final_answer", "make_problems", "problem_split", "prompt", "prompt_terms", "score",
           "solution", "step_checks", "length_cdf", "main"]

SPLITS = ("train", "heldout")
HELDOUT_MODULUS = 10
DEFAULT_TERMS = (2, 26)
TAGS = "abcdefghijklmnopqrstuvwxyz"  # a problem's terms are tagged a, b, c, ...
DEFAULT_ALPHA = 1.8
_MAX_REJECTIONS = 100_000


def problem_split(terms: Sequence[int]) -> str:
    """``"train"`` or ``"heldout"``: the split of the problem with these terms (stable, seedless)."""
    h = int.from_bytes(hashlib.sha256(" ".join(map(str, terms)).encode()).digest(), "big")
    return "heldout" if h % HELDOUT_MODULUS == 0 else "train"


def solution(terms: Sequence[int]) -> str:
    """The worked answer: one step per term, its tag, the term, the running total before it and
    after it, then ``so`` and the total (``[3, 5, 2]`` -> ``"a 3 + 0 = 3 , b 5 + 3 = 8 , c 2 + 8
    = 10 so 10"``)."""
    steps, s = [], 0
    for tag, t in zip(TAGS, terms, strict=False):
        steps.append(f"{tag} {t} + {s} = {s + t}")
        s += t
    return " , ".join(steps) + f" so {s}"


def prompt(terms: Sequence[int]) -> str:
    """``[3, 5, 2]`` -> ``"sum a 3 b 5 c 2 ?"``: each term after its tag."""
    return "sum " + " ".join(f"{tag} {t}" for tag, t in zip(TAGS, terms, strict=False)) + " ?"


def length_cdf(terms: tuple[int, int] = DEFAULT_TERMS, alpha: float = DEFAULT_ALPHA) -> list[float]:
    """Cumulative probabilities of ``k = terms[0] .. terms[1]`` terms, ``P(k) ~ k^-alpha``."""
    lo, hi = terms
    w = [k ** -alpha for k in range(lo, hi + 1)]
    total, acc, out = sum(w), 0.0, []
    for x in w:
        acc += x
        out.append(acc / total)
    out[-1] = 1.0
    return out


def _check_args(split: str, n: int, terms, alpha: float) -> tuple[int, int]:
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; expected one of {', '.join(SPLITS)}")
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise ValueError(f"n must be a non-negative int, got {n!r}")
    try:
        lo, hi = (int(x) for x in terms)
    except (TypeError, ValueError):
        raise ValueError(f"terms must be a (min, max) pair of ints, got {terms!r}") from None
    if not 1 <= lo <= hi <= len(TAGS):
        raise ValueError(f"terms must satisfy 1 <= min <= max <= {len(TAGS)} (one tag a-z per term), got {terms!r}")
    if not alpha >= 0:
        raise ValueError(f"alpha must be >= 0, got {alpha!r}")
    return lo, hi


def _key(row: Mapping) -> str:
    return " ".join(str(row["prompt"]).split()[2:-1:2])


def make_problems(split: str, seed: int, n: int, terms: tuple[int, int] = DEFAULT_TERMS,
                  alpha: float = DEFAULT_ALPHA, distinct: bool = False, exclude: Iterable[Mapping] = ()) -> list[dict]:
    """``n`` problems of ``split``: ``{"id": "rsum-<split>-<seed>-<i>", "prompt": "sum a 3 b 5 c 2 ?",
    "answer": "10", "solution": "a 3 + 0 = 3 , b 5 + 3 = 8 , c 2 + 8 = 10 so 10", "terms": 3}``.

    The number of terms is drawn from the truncated power law (:func:`length_cdf`), each term
    uniformly from 1-9; ``random.Random(seed)`` only.  ``distinct``: no problem twice (an
    evaluation set); ``exclude``: rows whose problems are never drawn (a validation set).
    """
    lo, hi = _check_args(split, n, terms, alpha)
    cdf = length_cdf((lo, hi), alpha)
    rng = random.Random(seed)
    excluded = frozenset(_key(r) for r in exclude)
    seen = set(excluded)
    rows = []
    for i in range(n):
        for _ in range(_MAX_REJECTIONS):
            k = lo + bisect.bisect_left(cdf, rng.random())
            ts = [rng.randint(1, 9) for _ in range(k)]
            key = " ".join(map(str, ts))
            if problem_split(ts) == split and key not in (seen if distinct else excluded):
                break
        else:
            raise ValueError(f"no {'new ' if distinct else ''}{split} problem found for terms={lo, hi} after "
                             f"{_MAX_REJECTIONS} draws; widen the term range")
        if distinct:
            seen.add(key)
        rows.append({"id": f"rsum-{split}-{seed}-{i}", "prompt": prompt(ts), "answer": str(sum(ts)),
                     "solution": solution(ts), "terms": k})
    return rows


# special-token markers (<eos>, <|end|>, </s>, ...), as the arithmetic task strips them
_SPECIAL = re.compile(r"<\|[^<>|\s]*\|>|<｜[^<>｜\s]*｜>|</?[A-Za-z_][A-Za-z0-9_.-]*>")
_FINAL = re.compile(r"(?:^|\s)so\s+((?:[0-9]\s*)+)$")


def final_answer(response_text) -> str | None:
    """The integer a response ends with after ``so`` (digits may be spaced, as the tiny tokenizer
    decodes them), without leading zeros; None when it does not end so."""
    if not isinstance(response_text, str):
        return None
    m = _FINAL.search(_SPECIAL.sub(" ", response_text).strip())
    return None if m is None else ("".join(m.group(1).split()).lstrip("0") or "0")


def score(response_text: str, answer: str | int) -> float:
    """1.0 iff the response ends with ``so`` and the integer ``answer`` (:func:`final_answer`),
    else 0.0.  Only the final answer counts.

    >>> score("a 3 + 0 = 3 , b 5 + 3 = 8 so 8 <eos>", "8"), score("so 1 8", "18"), score("18", "18"), score("so 17", "18")
    (1.0, 1.0, 0.0, 0.0)
    """
    want = str(answer).strip()
    if not want.isdigit():
        raise ValueError(f"answer must be a non-negative integer, got {answer!r}")
    return 1.0 if final_answer(response_text) == (want.lstrip("0") or "0") else 0.0


_PROMPT_TERM = re.compile(r"\b([a-z])\s+([0-9])\b")
_STEP = re.compile(r"([a-z])\s+((?:[0-9]\s*)+?)\s*\+\s*((?:[0-9]\s*)+?)\s*=\s*((?:[0-9]\s?)*[0-9])")


def prompt_terms(prompt_text: str) -> list:
    """The terms of a problem's prompt, in order (``"sum a 3 b 5 c 2 ?"`` -> ``[3, 5, 2]``)."""
    body = prompt_text.split("sum", 1)[-1]
    return [int(t) for _, t in _PROMPT_TERM.findall(body)]


def step_checks(prompt_text: str, response_text: str) -> list:
    """Each worked step of a response checked against its problem: ``[(end, right)]``, ``end`` the
    character offset in ``response_text`` just past the step's last digit, ``right`` whether the
    step is the problem's step k -- its k-th tag and term, the true running total before it and
    after it -- then the final answer as one more step (``so`` and the total), right iff
    :func:`score` says so.  A step written after the problem's last term is wrong; steps the
    response leaves out are not scored (its final answer is then wrong, or right by luck).

    >>> step_checks("sum a 3 b 5 ?", "a 3 + 0 = 3 , b 5 + 3 = 9 so 9")
    [(11, True), (25, False), (30, False)]
    """
    terms = prompt_terms(prompt_text)
    out, total = [], 0
    text = _SPECIAL.sub(lambda m: " " * len(m.group(0)), response_text)  # offsets stay the response's
    final = _FINAL.search(text.rstrip())
    body_end = final.start() if final is not None else len(text)
    for k, m in enumerate(_STEP.finditer(text[:body_end])):
        tag, term, before, after = m.group(1), *("".join(g.split()) for g in m.group(2, 3, 4))
        right = (k < len(terms) and tag == TAGS[k] and int(term) == terms[k] and int(before) == total
                 and int(after) == total + terms[k])
        if k < len(terms):
            total += terms[k]
        out.append((m.end(4), right))
    if final is not None:
        out.append((final.end(1) if text[final.end(1) - 1:final.end(1)].strip() else len(text.rstrip()),
                    score(response_text, sum(terms)) == 1.0))
    elif text.strip():  # no final answer: a wrong last step at the response's end (a chain cut short is not right)
        out.append((max(len(text.rstrip()), out[-1][0] + 1 if out else 0), False))
    return out


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m megarl.data.tasks.running_sum",
                                description="Write running-sum problems (a long tail of chain lengths) as JSON lines.")
    p.add_argument("--split", required=True, help="train or heldout (disjoint whatever the seeds)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--n", type=int, required=True, help="number of problems")
    p.add_argument("--out", required=True, help="output .jsonl file")
    p.add_argument("--min-terms", type=int, default=DEFAULT_TERMS[0])
    p.add_argument("--max-terms", type=int, default=DEFAULT_TERMS[1])
    p.add_argument("--alpha", type=float, default=DEFAULT_ALPHA, help="P(k terms) ~ k^-alpha")
    p.add_argument("--distinct", action="store_true", help="no problem twice (an evaluation set)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing --out file")
    return p


@cli_main
def main(argv: Sequence[str] | None = None) -> None:
    args = _parser().parse_args(argv)
    if args.n < 1:
        raise MegarlError(f"--n must be at least 1, got {args.n}")
    if os.path.isdir(args.out):
        raise MegarlError(f"--out {args.out} is a directory; give a .jsonl file path")
    if os.path.exists(args.out) and not args.overwrite:
        raise MegarlError(f"--out {args.out} already exists; pass --overwrite to replace it or choose another file")
    try:
        rows = make_problems(args.split, args.seed, args.n, (args.min_terms, args.max_terms), args.alpha,
                             distinct=args.distinct)
    except ValueError as e:
        raise MegarlError(f"{e} (--split/--min-terms/--max-terms/--alpha)") from e
    write_jsonl(args.out, rows)
    print(f"wrote {len(rows)} {args.split} problems to {args.out}", flush=True)


if __name__ == "__main__":
    main()
