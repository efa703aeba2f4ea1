"""The arithmetic judge's task: a candidate answer to an arithmetic problem and the reference answer
in, ``yes`` or ``no`` out -- the warm start of the built-in generative judge (``reward.judges``).

    python -m megarl.tinymodel --task arithmetic_judge --out .cache/megarl/tiny_arith_judge

A judge reads what :class:`megarl.roles.judge.GenerativeJudge` renders: its prompt (:data:`PROMPT`,
the ``prompt`` setting) filled with the candidate (``{response}``) and the row's ground truth
(``{answer}``: a reference-guided judge, as verifier models that grade against a reference are),
one user turn through the tiny chat template.  The warm start trains on exactly that rendering
(``render_judge_prompt``), loss on the verdict word and EOS.  Half the candidates are the right
answer; the other half are wrong answers of the kinds a policy writes: the near misses of the
reward-model pairs (:data:`megarl.builtin.preference_pairs.MISSES`: off by 1-3 or by ten, a digit
dropped or added, the sign, a stray word), one digit replaced, and an unrelated number of the same
size -- those as long as the reference twice as often as the rest (only reading digit by digit
tells them apart).  Problems come
from the arithmetic task's own splits, so the judge's evaluation rows share no problem with its
training rows, and neither with the policy recipes' held-out file.

This is a judge's task, not a policy's: ``data.task.name`` refuses it (there is no rule scoring a
verdict as a policy's answer).
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from megarl.builtin import preference_pairs
from megarl.builtin.tasks import arithmetic
from megarl.builtin.warmstart import EVALUATION_SEED, VALIDATION_SEED, SequenceSource, left_padded, training_tensors
from megarl.config.schema import COUNT, setting

REWARD = None  # a judge's task (megarl.builtin.tasks.JUDGE_TASKS): data.task.name refuses it
#: 2500 steps at 1e-3, no early stop (measured: 0.99 of the held-out verdicts right, 0.98 of the
#: wrong candidates refused; at 2e-3 the verdicts stall near 0.85, answering yes to every
#: candidate as long as the reference)
DEFAULTS = {"steps": 2500, "target_accuracy": 0.0, "check_every": 50, "lr": 1e-3}

#: the judge's question (the words are the tiny tokenizer's): configs/grpo_arith_judge_tiny.yaml
#: asks its judge exactly this (reward.judges[0].prompt)
PROMPT = "answer : {answer} result : {response} . is the result the answer ?"
YES, NO = "yes", "no"
#: the wrong candidates: the reward-model pairs' near misses, one digit replaced, an unrelated number
WRONG = preference_pairs.MISSES + ("one_digit", "unrelated")
#: the order the wrong rows cycle through: the misses as long as the reference (which only a digit
#: by digit comparison tells apart) twice as often as those a length or a symbol gives away
CYCLE = ("off_by_small", "one_digit", "off_by_ten", "unrelated", "dropped_digit", "off_by_small", "one_digit",
         "extra_digit", "unrelated", "sign", "off_by_ten", "extra_word")


@dataclass(frozen=True)
class Settings:
    min_digits: int = setting(1, range=COUNT)  # fewest digits per operand
    max_digits: int = setting(2, range=COUNT)  # most digits per operand
    ops: str = "plus"  # the operators, comma-separated: plus, minus, times
    #: the judge's prompt: {response} and {answer}, as reward.judges[i].prompt
    prompt: str = PROMPT

    digits = arithmetic.Settings.digits
    op_tuple = arithmetic.Settings.op_tuple

    def check(self):
        from megarl.rewards.verdicts import check_template, template_ground_truth_fields

        try:
            check_template(self.prompt, "prompt")
        except ValueError as e:
            return "prompt", str(e).split(": ", 1)[1]
        if set(template_ground_truth_fields(self.prompt)) - {"answer"}:
            return "prompt", (f"{self.prompt!r}: the judge's rows carry only {{answer}} (the reference) beside "
                              "{prompt} and {response}")
        return arithmetic.Settings.check(self)


def wrong_answer(answer: str, kind: str, rng: random.Random) -> str:
    """A wrong candidate for the integer ``answer``: a near miss of ``kind`` or, ``unrelated`` (or
    a near miss that cannot be wrong here), another integer with as many digits."""
    from megarl.data.tasks.arithmetic import score

    if kind == "one_digit":
        digits = answer.lstrip("-")
        return answer[:len(answer) - len(digits)] + preference_pairs.one_digit_replaced(digits, rng)
    if kind != "unrelated":
        for _ in range(8):  # a near miss the rule still grades right ("00" for "0") is drawn again
            miss = preference_pairs.near_miss(answer, kind, rng)
            if score(miss, answer) != 1.0:
                return miss
        kind = "unrelated"
    v, n = int(answer), len(str(abs(int(answer))))
    while True:
        other = rng.randrange(10 ** (n - 1) if n > 1 else 0, 10 ** n) * (-1 if v < 0 else 1)
        if other != v:
            return str(other)


def judge_rows(problems, seed: int) -> list:
    """One judge row per arithmetic problem: ``{id, problem, candidate, reference, kind, answer}``
    (rendered by :func:`render_judge_prompt`), ``answer`` the verdict; every other row's
    candidate is right, the others cycle through :data:`CYCLE`."""
    from megarl.data.tasks.arithmetic import score

    rng = random.Random(seed)
    rows = []
    for i, p in enumerate(problems):
        ref = str(p["answer"]).strip()
        kind = "right" if i % 2 == 0 else CYCLE[(i // 2) % len(CYCLE)]
        cand = ref if kind == "right" else wrong_answer(ref, kind, rng)
        verdict = YES if score(cand, ref) == 1.0 else NO
        if (verdict == YES) != (kind == "right"):
            raise AssertionError(f"judge row {i}: candidate {cand!r} for {ref!r} ({kind}) is graded {verdict}")
        rows.append({"id": f"{p['id']}-judge", "problem": p["prompt"], "candidate": cand, "reference": ref,
                     "kind": kind, "answer": verdict})
    return rows


def render_judge_prompt(tok, template: str, row: dict) -> list:
    """The judge's input for ``row``: what :class:`~megarl.roles.judge.GenerativeJudge` renders for
    a sample whose response is the candidate and whose ground truth holds the reference."""
    from megarl.roles.judge import judge_input

    return judge_input(tok, template, row["problem"], row["candidate"], {"answer": row["reference"]})


def judge_sequences(tok, template: str, rows):
    """Prompts (the judge's rendering) and verdicts (the word, then EOS) of ``rows``."""
    prompts = [render_judge_prompt(tok, template, r) for r in rows]
    answers = [list(tok.tokenizer.encode(r["answer"], add_special_tokens=False)) + [tok.eos_token_id] for r in rows]
    return prompts, answers


def splits(s, train_n: int, heldout_n: int) -> dict:
    """The judge's rows over the arithmetic task's splits (the held-out rows: its evaluation set)."""
    from megarl.data.tasks.arithmetic import make_problems

    return {"train": lambda: judge_rows(make_problems("train", 0, train_n, digits=s.digits, ops=s.op_tuple), 0),
            "heldout": lambda: judge_rows(make_problems("heldout", EVALUATION_SEED, heldout_n, digits=s.digits,
                                                        ops=s.op_tuple, distinct=True), EVALUATION_SEED)}


def recorded(s, targeted: bool) -> dict:
    return {"task.name": "arithmetic_judge", "task.digits": list(s.digits), "task.prompt": s.prompt}


CONFIG_KEYS = {"task.digits": "--task-arg min_digits / max_digits", "task.prompt": "--task-arg prompt"}


def verdict_accuracy(model_dir: str, rows, template: str, batch: int = 128) -> dict:
    """Greedy verdicts of an HF checkpoint (transformers ``generate``) on ``rows``: the share
    right overall, on right candidates (``yes_when_right``) and on wrong ones (``no_when_wrong``:
    what a policy could exploit), and by kind of candidate."""
    import torch
    import transformers

    from megarl.data.tokenizer import TokenizerContract
    from megarl.rewards.verdicts import VerdictRule, parse_verdict

    tok = TokenizerContract.from_pretrained(model_dir)
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir).eval()
    rule = VerdictRule("yes_no", YES, NO)
    ok = []
    for lo in range(0, len(rows), batch):
        part = rows[lo:lo + batch]
        ids, att = left_padded([render_judge_prompt(tok, template, r) for r in part], tok.pad_token_id)
        with torch.no_grad():
            out = model.generate(input_ids=ids, attention_mask=att, do_sample=False, max_new_tokens=2,
                                 eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
        for j, r in enumerate(part):
            v = parse_verdict(tok.decode(out[j, ids.shape[1]:].tolist(), skip_special_tokens=True), False, rule)
            ok.append(v.word == r["answer"])
    share = lambda idx: sum(ok[i] for i in idx) / len(idx) if idx else None  # noqa: E731
    kinds = sorted({r["kind"] for r in rows})
    return {"accuracy": share(range(len(rows))),
            "yes_when_right": share([i for i, r in enumerate(rows) if r["answer"] == YES]),
            "no_when_wrong": share([i for i, r in enumerate(rows) if r["answer"] == NO]),
            "by_kind": {k: share([i for i, r in enumerate(rows) if r["kind"] == k]) for k in kinds}}


class WarmStart(SequenceSource):
    """The judge's rows, loss on the verdict; validated on held-out problems the evaluation set
    does not hold."""

    def __init__(self, tok, settings, run):
        from megarl.data.tasks.arithmetic import make_problems

        super().__init__(tok, settings, run)
        s = settings
        self.evaluation = splits(s, 0, run.heldout_n)["heldout"]()
        self.held_apart = ()
        if run.target_accuracy > 0:
            self.held_apart = judge_rows(arithmetic.validation_problems(run.validation_n, run.heldout_n, s.digits,
                                                                        s.op_tuple), VALIDATION_SEED)
        problems = make_problems("train", run.seed, run.steps * run.batch, digits=s.digits, ops=s.op_tuple)
        self.rows = judge_rows(problems, run.seed)

    def validation(self):
        return training_tensors(self.tok.pad_token_id, *judge_sequences(self.tok, self.settings.prompt,
                                                                        self.held_apart))

    def batch(self, step: int):
        rows = self.rows[step * self.run.batch:(step + 1) * self.run.batch]
        return training_tensors(self.tok.pad_token_id, *judge_sequences(self.tok, self.settings.prompt, rows))

    def evaluate(self, model_dir: str) -> dict:
        v = verdict_accuracy(model_dir, self.evaluation, self.settings.prompt)
        return {"heldout_accuracy_greedy": v["accuracy"], "heldout_verdicts": v}

    def info(self, warmstart: dict) -> dict:
        s = self.settings
        return {"task": {"name": "arithmetic_judge", "digits": list(s.digits), "ops": list(s.op_tuple),
                         "prompt": s.prompt}}
