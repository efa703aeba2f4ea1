"""The two-turn task: the arithmetic problems, answered over two turns with feedback between them
(the ``two_turn`` environment, :mod:`megarl.envs.two_turn`, scores each episode).

Its files are the arithmetic task's.  Its warm start is the arithmetic one with a ``demos`` share
of the sequences (:func:`~megarl.builtin.warmstart.is_demo`) replaced by a demonstration of
the environment: a guess -- right or, half the time, one digit off --, the feedback that restates
the question, the right answer; loss on the policy tokens only, and of the guess on its
``<|end|>`` only (:func:`two_turn_sequences`).
"""

from __future__ import annotations

from dataclasses import dataclass

from megarl.builtin.preference_pairs import one_digit_replaced
from megarl.builtin.tasks import arithmetic
from megarl.builtin.warmstart import SequenceSource, is_demo, prompt_answer_sequences, training_tensors
from megarl.config.schema import COUNT, Range, setting

REWARD = None  # the environment scores each episode
DEFAULTS = {"steps": 470, "target_accuracy": 0.0, "check_every": 4}
splits = arithmetic.splits


@dataclass(frozen=True)
class Settings:
    min_digits: int = setting(1, range=COUNT)  # fewest digits per operand
    max_digits: int = setting(2, range=COUNT)  # most digits per operand
    ops: str = "plus"  # the operators, comma-separated: plus, minus, times
    #: share of warm-start sequences that are two_turn demonstrations (guess, feedback, answer)
    demos: float = setting(0.2, range=Range(lo=0, hi=1))

    digits = arithmetic.Settings.digits
    op_tuple = arithmetic.Settings.op_tuple
    check = arithmetic.Settings.check


def recorded(s, targeted: bool) -> dict:
    """What ``tiny_model.json`` records of these settings (dotted key -> value).  Not the task's
    name: builds before the task registry recorded ``arithmetic`` with ``two_turn_demos``."""
    return {"task.digits": list(s.digits), "two_turn_demos": s.demos}


CONFIG_KEYS = {"task.digits": "data.task.args.min_digits / max_digits", "two_turn_demos": "data.task.args.demos"}


def two_turn_sequences(tok, problems, share: float, seed: int):
    """The two-turn build's warm-start sequences: ``(prompts, responses, loss masks)``.

    The arithmetic build's sequences (answer and EOS, loss on all of it), with a ``share`` of the
    rows (:func:`is_demo`) replaced by a demonstration of the ``two_turn`` environment
    (:func:`megarl.envs.two_turn.demonstration`, feedback that restates the question): a guess
    -- the right answer or, half the time, one digit off --, the environment's feedback for it,
    the right answer; rendered by :func:`megarl.envs.render.render_conversation` (each turn ends
    at the template's ``<|end|>``), loss on the policy tokens only, never on the feedback, and of
    the guess on its ``<|end|>`` only: the guess's digits are the arithmetic rows' to teach (half
    the demonstrations' guesses are wrong on purpose)."""
    import random

    from megarl.envs.render import EnvTurnRenderer, render_conversation
    from megarl.envs.two_turn import demonstration

    renderer = EnvTurnRenderer(tok)
    rng = random.Random(seed)
    prompts, answers = prompt_answer_sequences(tok, problems)
    masks = [[1.0] * len(a) for a in answers]
    for i, row in enumerate(problems):
        if not is_demo(i, share):
            continue
        answer = str(row["answer"]).strip()
        guess = answer if rng.random() < 0.5 else one_digit_replaced(answer, rng)
        conv = render_conversation(renderer, demonstration(row, " ".join(guess), restate=True))
        prompts[i], answers[i] = conv.prompt_ids, conv.response_ids
        masks[i] = [1.0 if s == 1 else 0.0 for s in conv.sources]
        _, _, start, end = conv.spans[0]  # the guess: only its <|end|> is taught (a wrong guess is
        for t in range(start - len(conv.prompt_ids), end - len(conv.prompt_ids) - 1):  # no lesson)
            masks[i][t] = 0.0
    return prompts, answers, masks


class WarmStart(SequenceSource):
    """All ``steps * batch`` sequences made up front (the demonstrations' guesses are drawn in order)."""

    @staticmethod
    def eos_token_ids(hf_tok):
        return [hf_tok.eos_token_id, int(hf_tok.convert_tokens_to_ids("<|end|>"))]

    def __init__(self, tok, settings, run):
        from megarl.data.tasks.arithmetic import make_problems

        super().__init__(tok, settings, run)
        s = settings
        self.held_apart = (arithmetic.validation_problems(run.validation_n, run.heldout_n, s.digits, s.op_tuple)
                           if run.target_accuracy > 0 else ())
        problems = make_problems("train", run.seed, run.steps * run.batch, digits=s.digits, ops=s.op_tuple)
        self.prompts, self.answers, self.masks = two_turn_sequences(tok, problems, s.demos, run.seed)

    def validation(self):
        return training_tensors(self.tok.pad_token_id, *prompt_answer_sequences(self.tok, self.held_apart))

    def batch(self, step: int):
        sl = slice(step * self.run.batch, (step + 1) * self.run.batch)
        return training_tensors(self.tok.pad_token_id, self.prompts[sl], self.answers[sl], self.masks[sl])

    def evaluate(self, model_dir: str) -> dict:
        s = self.settings
        return {"heldout_accuracy_greedy": arithmetic.heldout_accuracy(model_dir, n=self.run.heldout_n,
                                                                       digits=s.digits, ops=s.op_tuple)}

    def info(self, warmstart: dict) -> dict:
        s = self.settings
        warmstart["validation"] = "heldout" if self.run.target_accuracy > 0 else None
        return {"task": {"name": "two_turn", "digits": list(s.digits), "ops": list(s.op_tuple)},
                "two_turn_demos": s.demos}
