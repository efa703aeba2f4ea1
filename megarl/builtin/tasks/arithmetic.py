"""The arithmetic task: ``what is 12 plus 7 ?``, answered with the integer (the embedded default).

Problems and their exact score are :mod:`megarl.data.tasks.arithmetic`; this module adds the
task's settings, its files and the tiny model's warm start on it: the chat-templated prompt,
the answer's digits and EOS, loss on the answer, early-stopped on a validation set of held-out
problems the evaluation set does not hold (or, ``validation: train-mix``, train problems in the
evaluation set's mix that the warm start never draws; docs/tiny-model.md compares them).
"""

from __future__ import annotations

from dataclasses import dataclass

from megarl.builtin.warmstart import (
    EVALUATION_SEED, VALIDATION_SEED, SequenceSource, left_padded, prompt_answer_sequences, training_tensors,
)
from megarl.config.schema import COUNT, setting
from megarl.errors import MegarlError

#: where the early stop is measured (``validation``)
VALIDATIONS = ("heldout", "train-mix")
REWARD = "arithmetic"  # megarl.data.tasks.arithmetic.score: the exact integer answer
DEFAULTS = {"steps": 2000, "target_accuracy": 0.3, "check_every": 4}


@dataclass(frozen=True)
class Settings:
    min_digits: int = setting(1, range=COUNT)  # fewest digits per operand
    max_digits: int = setting(2, range=COUNT)  # most digits per operand
    ops: str = "plus"  # the operators, comma-separated: plus, minus, times
    #: where the warm start's early stop is measured: heldout | train-mix
    validation: str = setting("heldout", choices=VALIDATIONS)

    @property
    def digits(self) -> tuple:
        return (self.min_digits, self.max_digits)

    @property
    def op_tuple(self) -> tuple:
        return tuple(self.ops.split(","))

    def check(self):
        """``(key, problem)`` of the first setting that contradicts another, or None."""
        from megarl.data.tasks.arithmetic import OPS

        if self.min_digits > self.max_digits:
            return "min_digits", f"{self.min_digits} is above max_digits={self.max_digits}"
        bad = [o for o in self.op_tuple if o not in OPS]
        if bad:
            return "ops", f"{','.join(bad)} is not an operator; choose from {', '.join(OPS)}"
        return None


def splits(s, train_n: int, heldout_n: int) -> dict:
    """The task files: ``{"train": make_rows, "heldout": make_rows}`` (the held-out file is the
    evaluation set: distinct problems of the warm start's evaluation seed)."""
    from megarl.data.tasks.arithmetic import make_problems

    return {"train": lambda: make_problems("train", 0, train_n, digits=s.digits, ops=s.op_tuple),
            "heldout": lambda: make_problems("heldout", EVALUATION_SEED, heldout_n, digits=s.digits, ops=s.op_tuple,
                                             distinct=True)}


def recorded(s, targeted: bool) -> dict:
    """What ``tiny_model.json`` records of these settings (dotted key -> value)."""
    # no two_turn_demos: a two-turn build (older ones recorded the name arithmetic) is not this task's
    want = {"task.name": "arithmetic", "task.digits": list(s.digits), "two_turn_demos": None}
    if s.validation != "heldout" and targeted:
        want["warmstart.validation"] = s.validation
    return want


CONFIG_KEYS = {"task.digits": "data.task.args.min_digits / max_digits", "warmstart.validation":
               "data.task.args.validation", "two_turn_demos": "data.task.name"}


def validation_problems(n: int, eval_n: int, digits, ops):
    """``n`` distinct problems of the held-out split that the evaluation set (the first ``eval_n``
    distinct held-out problems of :data:`EVALUATION_SEED`, the recipes' held-out file) does not hold."""
    from megarl.data.tasks.arithmetic import make_problems

    evaluation = make_problems("heldout", EVALUATION_SEED, eval_n, digits=tuple(digits), ops=tuple(ops), distinct=True)
    return make_problems("heldout", VALIDATION_SEED, n, digits=tuple(digits), ops=tuple(ops), exclude=evaluation)


def train_mix_validation_problems(n: int, eval_n: int, digits, ops):
    """``n`` distinct problems of the **train** split with the evaluation set's mix of kinds (op
    and operand digit counts, :func:`~megarl.data.tasks.arithmetic.problem_stratum`), apportioned
    to ``n`` by largest remainders; the warm start's draws exclude them.  (The 1-2-digit held-out
    split is small: what the evaluation set leaves of it is ~97% two-by-two-digit sums.)"""
    from collections import Counter

    from megarl.data.tasks.arithmetic import make_problems, problem_stratum

    evaluation = make_problems("heldout", EVALUATION_SEED, eval_n, digits=tuple(digits), ops=tuple(ops), distinct=True)
    counts = Counter(problem_stratum(r) for r in evaluation)
    quota = {k: n * c / eval_n for k, c in counts.items()}
    take = {k: int(q) for k, q in quota.items()}
    for k in sorted(quota, key=lambda k: (take[k] - quota[k], k))[: n - sum(take.values())]:
        take[k] += 1
    pool = make_problems("train", VALIDATION_SEED, 4 * n, digits=tuple(digits), ops=tuple(ops), distinct=True)
    rows = []
    for k in sorted(take):
        kind = [r for r in pool if problem_stratum(r) == k][: take[k]]
        if len(kind) < take[k]:
            raise MegarlError(f"the arithmetic validation set needs {take[k]} distinct train problems of kind {k}; "
                              f"the split holds {len(kind)} among its first {len(pool)}: lower --validation-n")
        rows += kind
    return rows


def heldout_accuracy(model_dir: str, n: int = 200, seed: int = EVALUATION_SEED, digits=(1, 2), ops=("plus",),
                     max_new_tokens: int = 8, stop_ids=None) -> float:
    """Greedy held-out accuracy of an HF checkpoint with transformers ``generate``, answering at
    once (no tool), on the ``n`` distinct problems the recipes' held-out file holds (the same
    seed); ``stop_ids``: the ids that end an answer (default: EOS)."""
    import torch
    import transformers

    from megarl.data.tasks.arithmetic import make_problems, score
    from megarl.data.tokenizer import TokenizerContract

    tok = TokenizerContract.from_pretrained(model_dir)
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir).eval()
    probs = make_problems("heldout", seed, n, digits=tuple(digits), ops=tuple(ops), distinct=True)
    ids, att = left_padded(prompt_answer_sequences(tok, probs)[0], tok.pad_token_id)
    width = ids.shape[1]
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=att, do_sample=False, max_new_tokens=max_new_tokens,
                             eos_token_id=tok.eos_token_id if stop_ids is None else list(stop_ids),
                             pad_token_id=tok.pad_token_id)
    good = 0
    for i, pr in enumerate(probs):
        text = tok.decode(out[i, width:].tolist(), skip_special_tokens=True)
        good += score(text, pr["answer"]) == 1.0
    return good / len(probs)


class WarmStart(SequenceSource):
    """Prompt, answer and EOS, loss on the answer, tokenised a step at a time (a build may stop
    early); with a target, the draws never hold a validation problem."""

    def __init__(self, tok, settings, run):
        from megarl.data.tasks.arithmetic import make_problems

        super().__init__(tok, settings, run)
        s = settings
        self.held_apart = ()
        if run.target_accuracy > 0:
            pick = train_mix_validation_problems if s.validation == "train-mix" else validation_problems
            self.held_apart = pick(run.validation_n, run.heldout_n, s.digits, s.op_tuple)
        self.problems = make_problems("train", run.seed, run.steps * run.batch, digits=s.digits, ops=s.op_tuple,
                                      distinct=False, exclude=self.held_apart)

    def validation(self):
        return training_tensors(self.tok.pad_token_id, *prompt_answer_sequences(self.tok, self.held_apart))

    def batch(self, step: int):
        rows = self.problems[step * self.run.batch:(step + 1) * self.run.batch]
        return training_tensors(self.tok.pad_token_id, *prompt_answer_sequences(self.tok, rows))

    def evaluate(self, model_dir: str) -> dict:
        s = self.settings
        return {"heldout_accuracy_greedy": heldout_accuracy(model_dir, n=self.run.heldout_n, digits=s.digits,
                                                            ops=s.op_tuple)}

    def info(self, warmstart: dict) -> dict:
        s = self.settings
        warmstart["validation"] = s.validation if self.run.target_accuracy > 0 else None
        return {"task": {"name": "arithmetic", "digits": list(s.digits), "ops": list(s.op_tuple)}}
