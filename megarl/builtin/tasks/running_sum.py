"""The running-sum task: the long-tail reasoning task (:mod:`megarl.data.tasks.running_sum`).

A problem is a list of tagged one-digit terms; a worked answer takes one step per term, so the
response lengths have the task's own long tail.  The warm start trains on worked answers (the
chain of steps, ``so``, the total and EOS, loss on the answer) and stops part-way, measured on
held-out problems outside the evaluation set (checked every 20 steps by default): short chains
right, long ones wrong somewhere -- what RL has to work on.  ``tiny_model.json`` also records the
greedy accuracy by chain length and the answers' lengths.
"""

from __future__ import annotations

from dataclasses import dataclass

from megarl.builtin.warmstart import (
    EVALUATION_SEED, VALIDATION_SEED, SequenceSource, left_padded, prompt_answer_sequences, training_tensors,
)
from megarl.config.schema import Range, setting

REWARD = "running_sum"  # megarl.data.tasks.running_sum.score: the total after the final "so"
DEFAULTS = {"steps": 3000, "target_accuracy": 0.35, "check_every": 20}


@dataclass(frozen=True)
class Settings:
    min_terms: int = setting(2, range=Range(lo=1, hi=26))  # fewest terms of a problem (one worked step each)
    max_terms: int = setting(26, range=Range(lo=1, hi=26))  # most terms (26 tags: a-z)
    alpha: float = setting(1.8, range=Range(lo=0))  # P(k terms) ~ k^-alpha: the tail of chain lengths

    @property
    def terms(self) -> tuple:
        return (self.min_terms, self.max_terms)

    def check(self):
        if self.min_terms > self.max_terms:
            return "min_terms", f"{self.min_terms} is above max_terms={self.max_terms}"
        return None


def splits(s, train_n: int, heldout_n: int) -> dict:
    """The task files; the held-out file is the warm start's evaluation set (the same draw)."""
    from megarl.data.tasks.running_sum import make_problems

    return {"train": lambda: make_problems("train", 0, train_n, s.terms, s.alpha),
            "heldout": lambda: make_problems("heldout", EVALUATION_SEED, heldout_n, s.terms, s.alpha, distinct=True)}


def recorded(s, targeted: bool) -> dict:
    """What ``tiny_model.json`` records of these settings (dotted key -> value)."""
    return {"task.name": "running_sum", "task.terms": list(s.terms), "task.alpha": s.alpha}


CONFIG_KEYS = {"task.terms": "data.task.args.min_terms / max_terms", "task.alpha": "data.task.args.alpha"}


def greedy_answers(model_dir: str, rows, max_new_tokens: int = 320, batch: int = 64) -> tuple[list, list]:
    """Greedy answers of an HF checkpoint to ``rows`` with transformers ``generate``: per row,
    whether the task's :func:`score` says right, and the answer's length in tokens.  Rows are
    batched by their number of terms, so a batch waits for answers of about one length."""
    import torch
    import transformers

    from megarl.data.tasks.running_sum import score
    from megarl.data.tokenizer import TokenizerContract

    tok = TokenizerContract.from_pretrained(model_dir)
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir).eval()
    order = sorted(range(len(rows)), key=lambda i: rows[i]["terms"])
    right, lengths = [False] * len(rows), [0] * len(rows)
    for start in range(0, len(order), batch):
        part = order[start:start + batch]
        ids, att = left_padded(prompt_answer_sequences(tok, [rows[i] for i in part], "solution")[0], tok.pad_token_id)
        width = ids.shape[1]
        with torch.no_grad():
            out = model.generate(input_ids=ids, attention_mask=att, do_sample=False, max_new_tokens=max_new_tokens,
                                 eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
        for j, i in enumerate(part):
            toks = out[j, width:].tolist()
            n = toks.index(tok.eos_token_id) + 1 if tok.eos_token_id in toks else len(toks)
            lengths[i] = n
            right[i] = score(tok.decode(toks[:n], skip_special_tokens=True), rows[i]["answer"]) == 1.0
    return right, lengths


class WarmStart(SequenceSource):
    def __init__(self, tok, settings, run):
        from megarl.data.tasks.running_sum import make_problems

        super().__init__(tok, settings, run)
        s = settings
        self.evaluation = make_problems("heldout", EVALUATION_SEED, run.heldout_n, terms=s.terms, alpha=s.alpha,
                                        distinct=True)
        self.held_apart = make_problems("heldout", VALIDATION_SEED, run.validation_n, terms=s.terms, alpha=s.alpha,
                                        distinct=True, exclude=self.evaluation)
        self.problems = make_problems("train", run.seed, run.steps * run.batch, terms=s.terms, alpha=s.alpha)

    def validation(self):
        return training_tensors(self.tok.pad_token_id,
                                *prompt_answer_sequences(self.tok, self.held_apart, "solution"))

    def batch(self, step: int):
        rows = self.problems[step * self.run.batch:(step + 1) * self.run.batch]
        return training_tensors(self.tok.pad_token_id, *prompt_answer_sequences(self.tok, rows, "solution"))

    def evaluate(self, model_dir: str) -> dict:
        right, lengths = greedy_answers(model_dir, self.evaluation)
        by_terms = {}
        for lo, hi in ((2, 3), (4, 7), (8, 15), (16, 26)):
            idx = [i for i, r in enumerate(self.evaluation) if lo <= r["terms"] <= hi]
            if idx:
                by_terms[f"{lo}-{hi}"] = {"n": len(idx), "accuracy": sum(right[i] for i in idx) / len(idx)}
        srt = sorted(lengths)
        return {"heldout_accuracy_greedy": sum(right) / len(right), "heldout_accuracy_by_terms": by_terms,
                "heldout_answer_tokens": {"median": srt[len(srt) // 2],
                                          "p99": srt[min(len(srt) - 1, int(0.99 * len(srt)))],
                                          "max": srt[-1], "mean": sum(srt) / len(srt)}}

    def info(self, warmstart: dict) -> dict:
        s = self.settings
        return {"task": {"name": "running_sum", "terms": list(s.terms), "alpha": s.alpha}}
