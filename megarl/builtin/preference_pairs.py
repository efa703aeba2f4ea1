"""Built-in preference pairs from the arithmetic task: the right answer chosen over a near miss.

A reward model learns the rule only if the wrong answers it sees are the ones a policy makes, so
each rejected answer is one small edit away from the right one, drawn evenly from :data:`MISSES`:
off by 1 to 3, off by ten, a digit dropped, a digit added, the sign flipped, or the right answer
followed by a stray word (which the rule also scores 0).  Train pairs come from the task's train
split and held-out pairs from its held-out split, so no problem is in both; each file is a
function of (split, n, seed) and a cached file must hold exactly that (as the task files).
"""

from __future__ import annotations

import random
from typing import List

MISSES = ("off_by_small", "off_by_ten", "dropped_digit", "extra_digit", "sign", "extra_word")
SEEDS = {"train": 11, "heldout": 12}


def one_digit_replaced(digits: str, rng: random.Random) -> str:
    """``digits`` with one digit replaced by another (no new leading zero): a close, wrong guess."""
    k = rng.randrange(len(digits))
    digit = rng.choice([d for d in "0123456789" if d != digits[k] and (k or d != "0" or len(digits) == 1)])
    return digits[:k] + digit + digits[k + 1:]


def near_miss(answer: str, kind: str, rng: random.Random) -> str:
    """A wrong answer one edit from ``answer`` (an integer as digits): ``kind`` of :data:`MISSES`."""
    v = int(answer)
    if kind == "off_by_small":
        return str(v + rng.choice((-3, -2, -1, 1, 2, 3)))
    if kind == "off_by_ten":
        return str(v + rng.choice((-10, 10)))
    if kind == "dropped_digit":
        digits = str(abs(v))
        if len(digits) == 1:
            return str(v + rng.choice((-1, 1)))
        i = rng.randrange(len(digits))
        return ("-" if v < 0 else "") + digits[:i] + digits[i + 1:]
    if kind == "extra_digit":
        return str(v) + str(rng.randrange(10))
    if kind == "sign":
        return str(-v) if v != 0 else "1"
    if kind == "extra_word":
        return f"{v} {rng.choice(('plus', 'is', '?'))}"
    raise ValueError(f"near_miss: unknown kind {kind!r} (one of {MISSES})")


def arithmetic_pairs(split: str, n: int) -> List[dict]:
    """``n`` pairs ``{id, prompt, chosen, rejected, miss, answer}`` over the arithmetic task's ``split``
    (``answer``: the reference, which is also ``chosen``)."""
    from megarl.builtin.tasks import task_settings
    from megarl.data.tasks.arithmetic import make_problems, score

    s = task_settings("arithmetic", {})
    problems = make_problems(split, SEEDS[split], n, digits=s.digits, ops=s.op_tuple)
    rng = random.Random(SEEDS[split])
    out = []
    for i, p in enumerate(problems):
        kind = MISSES[i % len(MISSES)]
        rejected = near_miss(p["answer"], kind, rng)
        if score(rejected, p["answer"]) or not score(p["answer"], p["answer"]):
            raise AssertionError(f"{split} pair {i}: the rule does not prefer {p['answer']!r} to {rejected!r}")
        # the reference a reference-guided model reads (data.prompt: "{prompt} answer : {answer}")
        out.append({"id": f"arith-pair-{split}-{i}", "prompt": p["prompt"], "chosen": p["answer"],
                    "rejected": rejected, "miss": kind, "answer": p["answer"]})
    return out
