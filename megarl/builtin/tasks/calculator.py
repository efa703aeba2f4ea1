"""The calculator task: arithmetic on long operands, solved by calling a calculator tool (the
``calculator`` environment, :mod:`megarl.envs.calculator`, scores each episode).

Its files are the arithmetic task's on ``min_digits..max_digits``-digit operands.  Its warm
start renders every sequence as a calculator conversation (:func:`tool_sequences`): a ``demos``
share solved with the tool, the rest answered at once.  The first steps are demonstrations only:
copying operands into the call and the result into the answer takes many of them, while how
often the model calls is set by the mixture.  With a target, the demonstrations run at the full
rate until the teacher-forced accuracy of tool-use conversations (the call and the answer)
reaches it -- at most ``only_steps`` steps, the onset phase --; then a tail of ``steps -
only_steps`` steps decays the rate (cosine, to lr / 10), its last ``mixture_steps`` the mixture.
Without a target: ``only_steps`` demonstration steps, then the mixture, under one cosine decay.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from megarl.builtin.tasks import arithmetic
from megarl.builtin.warmstart import SequenceSource, is_demo, training_tensors
from megarl.config.schema import COUNT, COUNT0, Range, setting

REWARD = None  # the environment scores each episode (component "correct")
DEFAULTS = {"steps": 1900, "target_accuracy": 0.0, "check_every": 4}
splits = arithmetic.splits


@dataclass(frozen=True)
class Settings:
    min_digits: int = setting(4, range=COUNT)  # fewest digits per operand: too long to add in the head
    max_digits: int = setting(6, range=COUNT)  # most digits per operand
    ops: str = "plus"  # the operators, comma-separated: plus, minus, times
    #: share of tool-use demonstrations among the warm-start sequences after only_steps (the rest
    #: answer at once, with loss on their first token: the decision not to call)
    demos: float = setting(0.15, range=Range(lo=0, hi=1, lo_open=True))
    #: the first warm-start steps that are demonstrations only (they teach copying); with a
    #: target, the most of an onset phase at the full rate that stops at it
    only_steps: int = setting(1500, range=COUNT0)
    #: with a target: the last steps of the tail (steps - only_steps) that are the mixture
    mixture_steps: int = setting(100, range=COUNT0)
    #: the role of the tool's messages (the tiny vocabulary has no <|tool|>; the recipe passes
    #: the same rollout.agent.env_args.tool_role)
    tool_role: str = "user"

    digits = arithmetic.Settings.digits
    op_tuple = arithmetic.Settings.op_tuple

    def check(self):
        from megarl.envs.calculator import CalculatorEnv

        try:
            CalculatorEnv.check_args(tool_role=self.tool_role)
        except ValueError as e:
            return "tool_role", str(e)
        return arithmetic.Settings.check(self)

    def check_run(self, run):
        """``(key, problem)`` where the onset phase and the tail do not fit ``run``'s steps."""
        if run.target_accuracy > 0 and not run.check_every <= self.only_steps <= run.steps:
            return "only_steps", (f"is {self.only_steps}: with a target the onset phase stops on it, so it must be "
                                  f"between one check ({run.check_every} steps) and the warm start's {run.steps} "
                                  "steps (the tail takes the difference)")
        if run.target_accuracy > 0 and self.mixture_steps > run.steps - self.only_steps:
            return "mixture_steps", (f"is {self.mixture_steps}, above the tail of {run.steps} - only_steps = "
                                     f"{run.steps - self.only_steps} steps it ends")
        return None


def recorded(s, targeted: bool) -> dict:
    """What ``tiny_model.json`` records of these settings (dotted key -> value)."""
    tool = {"demos": s.demos, "digits": list(s.digits), "role": s.tool_role, "only_steps": s.only_steps}
    if targeted:
        tool["mixture_steps"] = s.mixture_steps
    return {"task.name": "calculator", "tool": tool}


CONFIG_KEYS = {"tool": "data.task.args (demos, min_digits, max_digits, tool_role, only_steps, mixture_steps)"}


def tool_sequences(tok, rows, share: float, tool_role: str = "user", demos_first: int = 0, first_index: int = 0):
    """The calculator build's warm-start sequences: ``(prompts, responses, loss masks)``.

    Row ``i`` (counted from ``first_index``: a slice renders as it does in the whole) is a
    tool-use demonstration when ``i < demos_first`` or
    ``is_demo(i - demos_first, share)`` (:func:`is_demo`): prompt, call ``[ a + b ]``, the
    tool's result as a ``tool_role`` message, the answer; otherwise a direct answer.  Both are
    rendered by :func:`megarl.envs.render.render_conversation`, so a sequence holds exactly the
    ids an agent session builds for that conversation.  A demonstration's loss mask is 1 on the
    policy tokens (source 1: the call and the answer, each through ``<|end|>``) and 0 on the
    rendered tool output (source 2): the model learns to call and to copy, never to predict
    what the tool says.  A direct answer's is 1 on its first token only: the decision to answer
    at once."""
    from megarl.envs.calculator import demonstration
    from megarl.envs.render import EnvTurnRenderer, render_conversation

    renderer = EnvTurnRenderer(tok)
    prompts, responses, masks = [], [], []
    for i, row in enumerate(rows, start=first_index):
        demo = i < demos_first or is_demo(i - demos_first, share)
        conv = render_conversation(renderer, demonstration(row, use_tool=demo, tool_role=tool_role))
        prompts.append(conv.prompt_ids)
        responses.append(conv.response_ids)
        mask = [1.0 if s == 1 else 0.0 for s in conv.sources]
        if not demo:
            # a direct answer teaches the decision only (answer at once, no call): its digits
            # cannot be learnt in the head, and fitting them undoes the copying the demonstrations
            # taught (measured: bench/calc_warmstart.py)
            mask = [mask[0]] + [0.0] * (len(mask) - 1)
        masks.append(mask)
    return prompts, responses, masks


class WarmStart(SequenceSource):
    """Calculator conversations on ``rows`` drawn up front, rendered a step at a time: where the
    mixture starts is known only when the onset phase ends."""

    measured = "tool-use "

    @staticmethod
    def eos_token_ids(hf_tok):
        return [hf_tok.eos_token_id, int(hf_tok.convert_tokens_to_ids("<|end|>"))]

    def __init__(self, tok, settings, run):
        from megarl.envs.calculator import make_rows

        super().__init__(tok, settings, run)
        self.targeted = run.target_accuracy > 0
        self.rows = make_rows("train", run.seed, run.steps * run.batch, digits=settings.digits, ops=settings.op_tuple)
        # the step the mixture starts at: with a target, known when the onset phase ends
        self.mixed_from = None if self.targeted else min(settings.only_steps, run.steps)

    def optim_settings(self):
        # copying a 6-digit operand right at temperature 1 needs a precise fit, and the mixture that
        # sets how often the model calls must not undo it: the rate decays (cosine, to lr / 10) --
        # over all the steps without a target, over the tail after the onset with one (megatron's
        # scheduler reads min_lr from the param groups, so they carry it from the start)
        return dataclasses.replace(super().optim_settings(), min_lr=self.run.lr / 10,
                                   lr_decay_style="constant" if self.targeted else "cosine")

    def start(self, opt, settings) -> None:
        from megarl.roles.common import lr_scheduler

        if not self.targeted:
            self.scheduler = lr_scheduler(opt, settings, self.run.steps)

    def validation(self):
        s, r = self.settings, self.run
        rows = arithmetic.validation_problems(r.validation_n, r.heldout_n, s.digits, s.op_tuple)
        return training_tensors(self.tok.pad_token_id, *tool_sequences(self.tok, rows, 1.0, s.tool_role))

    def last_step(self) -> int:
        return self.settings.only_steps if self.targeted else self.run.steps

    def batch(self, step: int):
        s, b = self.settings, self.run.batch
        demos_first = (step + 1 if self.mixed_from is None else self.mixed_from) * b
        return training_tensors(self.tok.pad_token_id, *tool_sequences(
            self.tok, self.rows[step * b:(step + 1) * b], s.demos, s.tool_role, demos_first=demos_first,
            first_index=step * b))

    def on_target(self, reached: int, opt, settings):
        # copying has set in; the tail fits it precisely at a decaying rate, and its mixture --
        # which sets how often the model calls -- runs at the lowest rates, so it cannot undo it
        from megarl.roles.common import lr_scheduler

        self.onset = reached
        tail = self.run.steps - self.settings.only_steps
        self.mixed_from, end = reached + tail - self.settings.mixture_steps, reached + tail
        self.scheduler = lr_scheduler(opt, dataclasses.replace(settings, lr_decay_style="cosine"), tail)
        return end

    def within(self) -> str:
        return f"only_steps {self.settings.only_steps} (data.task.args.only_steps), its onset phase"

    def evaluate(self, model_dir: str) -> dict:
        # the no-tool baseline on the calculator's operands: answered at once, never calling
        from megarl.envs.render import EnvTurnRenderer

        s = self.settings
        return {"heldout_accuracy_greedy": arithmetic.heldout_accuracy(
            model_dir, n=self.run.heldout_n, digits=s.digits, ops=s.op_tuple, max_new_tokens=s.max_digits + 3,
            stop_ids=EnvTurnRenderer(self.tok).assistant_end_ids)}

    def info(self, warmstart: dict) -> dict:
        s = self.settings
        warmstart["validation"] = "heldout" if self.targeted else None
        tool = {"demos": s.demos, "digits": list(s.digits), "role": s.tool_role, "only_steps": s.only_steps}
        if self.targeted:  # where the onset phase ended (only_steps is then its most), and the mixture
            tool["mixture_steps"] = s.mixture_steps
            warmstart["tool_onset_steps"] = self.onset
        return {"task": {"name": "calculator", "digits": list(s.digits), "ops": list(s.op_tuple)}, "tool": tool}
