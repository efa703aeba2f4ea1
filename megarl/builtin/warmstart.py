"""The built-in tiny model of the embedded default: tokenizer, Llama-family model, warm start.

    python -m megarl.tinymodel --out DIR [--target-accuracy 0.3 --steps 2000 --lr 2e-3 --batch 64 --max-digits 2 ...]
    python -m megarl.tinymodel --out DIR --family qwen3_moe --num-experts 8 --top-k 2 ...
    python -m megarl.tinymodel --out DIR --tool-demos 0.15 --target-accuracy 0.25 --tool-only-steps 1500 --steps 1900 ... (the calculator build)
    (or tools/make_tiny_model.py, the same program)

1. writes the built-in word-level tokenizer (digits are single tokens) with its chat template;
2. builds a small random ``LlamaForCausalLM`` with transformers (``--family qwen3_moe``: a
   ``Qwen3MoeForCausalLM`` whose every layer routes each token to ``top_k`` of ``num_experts``
   SwiGLU experts of width ``moe_intermediate_size``, the tiny model of ``grpo_moe_tiny``);
3. warm-starts it with a short supervised run *through the megatron actor* (megatron model +
   megatron DDP + optimizer, the same code path RL training uses) on the arithmetic task's
   train split: chat-templated prompt, then the answer digits and EOS, loss on the answer;
4. exports an HF checkpoint (config, safetensors, tokenizer, chat template) that recipes load
   like any other, and ``tiny_model.json`` with how it was made and its held-out accuracy
   (greedy, transformers ``generate``) -- written last, so a directory with it is complete.

RL has room to improve it: the warm start stops part-way.  **Where it stops** is measured, not
a step count (``--target-accuracy``; ``model.tiny.warmstart_target_accuracy``).  When a tiny
transformer generalises two-digit addition is a phase transition whose onset is random: the same
470 steps left one seed at 41% held-out and another at 15%, and a CPU whose reduction order
differs moves a seed from one side to the other.  So the warm start is early-stopped on a
**validation set**: distinct problems of the held-out split that the evaluation set (the
recipe's held-out file, its first ``--heldout-n`` distinct problems) does not hold, and that no
training ever sees.  Every ``--check-every`` steps the model's teacher-forced validation accuracy
is measured (every answer token and the EOS the argmax: what greedy decoding answers); the first
check that reaches the target ends the warm start, and that model is exported.

What that validation set measures is not the evaluation set's mix: the 1-2-digit held-out split
is small (515 sums), the evaluation set takes nearly all of its one-by-two-digit sums (about
half of the evaluation set), and what is left is ~97% two-by-two-digit sums.  A stop there
says how far the model is on the hard sums; its evaluation accuracy then lands between 0.275
and 0.335 on the AMD EPYC this was tuned on, and between 0.39 and 0.47 on an AVX-512 Xeon.
``--validation train-mix`` measures the evaluation set's mix instead (train problems the warm
start never draws): builds stopped there at 0.3 scored 0.29-0.33 on the Xeon, but at that
point they know less, and 400 GRPO steps gained only +17 to +22 from them (the default's
stop leaves a model that knows more than its greedy decoding shows, which RL recovers).  ``--steps`` is
then the most it may take: a build that has not reached the target by then fails, naming it.
The exported model is the last iterate of a constant learning rate, with its noise: its greedy
decoding is behind what it has learnt, which is what RL recovers and builds on.  (Measured on
this CPU: exporting an exponential moving average of the weights instead -- smoother, its greedy
decoding at what it knows -- left RL +7.5 to +9.5 points in 200 iterations, against +21 to +31
from the last iterate; bench/warmstart.py measures this build.)
``--target-accuracy 0`` runs exactly ``--steps`` steps, as the tests' small builds do.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import time

from megarl.errors import MegarlError, cli_main

MARKER = "tiny_model.json"


def is_built(out_dir: str) -> bool:
    return os.path.isfile(os.path.join(out_dir, MARKER))


def _sequences(tok, problems):
    prompts, answers = [], []
    for p in problems:
        prompts.append(tok.encode_prompt([{"role": "user", "content": p["prompt"]}]))
        answers.append(list(tok.tokenizer.encode(p["answer"], add_special_tokens=False)) + [tok.eos_token_id])
    return prompts, answers


def is_demo(i: int, share: float) -> bool:
    """Whether warm-start sequence ``i`` is a tool-use demonstration: evenly spaced, so every
    batch holds the same share (``floor((i + 1) * share) > floor(i * share)``)."""
    return int((i + 1) * share) > int(i * share)


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


def _near_miss(answer: str, rng) -> str:
    """``answer`` with one digit replaced by another (a guess that is close but wrong)."""
    k = rng.randrange(len(answer))
    digit = rng.choice([d for d in "0123456789" if d != answer[k] and (k or d != "0" or len(answer) == 1)])
    return answer[:k] + digit + answer[k + 1:]


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
    prompts, answers = _sequences(tok, problems)
    masks = [[1.0] * len(a) for a in answers]
    for i, row in enumerate(problems):
        if not is_demo(i, share):
            continue
        answer = str(row["answer"]).strip()
        guess = answer if rng.random() < 0.5 else _near_miss(answer, rng)
        conv = render_conversation(renderer, demonstration(row, " ".join(guess), restate=True))
        prompts[i], answers[i] = conv.prompt_ids, conv.response_ids
        masks[i] = [1.0 if s == 1 else 0.0 for s in conv.sources]
        _, _, start, end = conv.spans[0]  # the guess: only its <|end|> is taught (a wrong guess is
        for t in range(start - len(conv.prompt_ids), end - len(conv.prompt_ids) - 1):  # no lesson)
            masks[i][t] = 0.0
    return prompts, answers, masks


def warmstart_sequences(tok, *, steps: int, batch: int, seed: int, digits=(1, 2), ops=("plus",),
                        two_turn_demos: float = 0.0):
    """All ``steps * batch`` warm-start sequences of the arithmetic builds, in step order:
    ``(prompts, responses, loss masks)``; masks None means loss on every response token.  (The
    calculator build renders its conversations a step at a time, :func:`tool_sequences`: where
    its mixture starts is known only when its onset phase ends.)"""
    from megarl.data.tasks.arithmetic import make_problems

    # the default build: exactly the sequences it always had
    problems = make_problems("train", seed, steps * batch, digits=tuple(digits), ops=tuple(ops))
    if two_turn_demos > 0:
        return two_turn_sequences(tok, problems, two_turn_demos, seed)
    prompts, answers = _sequences(tok, problems)
    return prompts, answers, None


def training_tensors(pad_id: int, prompts, responses, masks=None):
    """One warm-start batch: ``tokens`` (B, L) right-padded with ``pad_id`` and ``mask``
    (B, L - 1), where ``mask[i, t]`` weighs the prediction of ``tokens[i, t + 1]``: the
    response's loss mask (``masks[i]``; None: every response token), 0 on the prompt and
    padding."""
    import torch

    rows = [p + r for p, r in zip(prompts, responses, strict=True)]
    L = max(len(r) for r in rows)
    tokens = torch.full((len(rows), L), pad_id, dtype=torch.long)
    mask = torch.zeros(len(rows), L - 1)
    for i, (p, r) in enumerate(zip(prompts, responses, strict=True)):
        tokens[i, :len(p) + len(r)] = torch.tensor(p + r)
        if masks is None:
            mask[i, len(p) - 1:len(p) + len(r) - 1] = 1  # positions that predict the answer
        else:
            mask[i, len(p) - 1:len(p) + len(r) - 1] = torch.tensor(masks[i], dtype=mask.dtype)
    return tokens, mask


#: the seed of the validation draw (distinct held-out-split problems outside the evaluation set,
#: which is the recipe's held-out file: seed 1, megarl/train.py)
VALIDATION_SEED, EVALUATION_SEED = 2, 1


def validation_problems(n: int, eval_n: int, digits, ops):
    """``n`` distinct problems of the held-out split that the evaluation set (the first ``eval_n``
    distinct held-out problems of seed 1, the recipes' held-out file) does not hold (the
    calculator build's validation: its 4-6-digit held-out split is large)."""
    from megarl.data.tasks.arithmetic import make_problems

    evaluation = make_problems("heldout", EVALUATION_SEED, eval_n, digits=tuple(digits), ops=tuple(ops), distinct=True)
    return make_problems("heldout", VALIDATION_SEED, n, digits=tuple(digits), ops=tuple(ops), exclude=evaluation)


def arithmetic_validation_problems(n: int, eval_n: int, digits, ops):
    """The arithmetic build's ``train-mix`` validation set: ``n`` distinct problems of the **train** split with
    the evaluation set's mix of kinds (op and operand digit counts,
    :func:`~megarl.data.tasks.arithmetic.problem_stratum`), apportioned to ``n`` by largest
    remainders.  The build never trains on them (its draws exclude them).

    Why not held-out problems (the default's): the 1-2-digit held-out split is small (515 sums) and the
    evaluation set's 200 take nearly all of its one-by-two-digit sums, so what is left of it is
    ~97% two-by-two-digit sums, against ~50% in the evaluation set.  A stop measured there says
    little about the evaluation set: builds stopped at the same validation accuracy scored
    0.26 to 0.55 on it (measured on an AVX-512 Xeon, seeds 0-2)."""
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


def teacher_forced_accuracy(model, tokens, mask, vocab_size: int) -> float:
    """Teacher-forced exact-match accuracy: the share of rows whose every weighted position
    (``mask`` over ``tokens[:, 1:]``: the answer digits and the EOS) is the model's argmax --
    exactly the rows that greedy decoding answers token for token."""
    import torch

    from megarl.models.micro_batches import position_ids_for

    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            logits = model(tokens, position_ids_for(tokens), None)
    finally:
        model.train(was_training)
    pred = logits[:, :-1, :vocab_size].argmax(-1)
    ok = (pred == tokens[:, 1:]) | (mask == 0)
    return float(ok.all(-1).float().mean())


def heldout_accuracy(model_dir: str, n: int = 200, seed: int = 1, digits=(1, 2), ops=("plus",),
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
    prompts, _ = _sequences(tok, probs)
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), tok.pad_token_id, dtype=torch.long)
    att = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = torch.tensor(p)
        att[i, width - len(p):] = 1
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=att, do_sample=False, max_new_tokens=max_new_tokens,
                             eos_token_id=tok.eos_token_id if stop_ids is None else list(stop_ids),
                             pad_token_id=tok.pad_token_id)
    good = 0
    for i, pr in enumerate(probs):
        text = tok.decode(out[i, width:].tolist(), skip_special_tokens=True)
        good += score(text, pr["answer"]) == 1.0
    return good / len(probs)


#: where an arithmetic build's early stop is measured (build's ``validation``)
VALIDATIONS = ("heldout", "train-mix")

#: the families the tiny model can be built in: the dense default and one mixture-of-experts
FAMILIES = ("llama", "qwen3_moe")


def build(out_dir: str, *, hidden_size: int = 128, num_layers: int = 4, num_heads: int = 4, num_kv_heads: int = 2,
          intermediate_size: int = 256, steps: int = 470, lr: float = 2e-3, batch: int = 64, seed: int = 0,
          digits=(1, 2), ops=("plus",), log_every: int = 50, family: str = "llama", num_experts: int = 8,
          top_k: int = 2, moe_intermediate_size: int = 128, tool_demos: float = 0.0, tool_digits=(4, 6),
          tool_role: str = "user", tool_only_steps: int = 0, tool_mixture_steps: int = 0,
          two_turn_demos: float = 0.0, target_accuracy: float = 0.0, check_every: int = 4, validation_n: int = 256,
          heldout_n: int = 200, adam_beta2: float = 0.999, validation: str = "heldout") -> dict:
    """Build the tiny model into ``out_dir`` (must not hold a finished build); return its info.

    ``target_accuracy > 0``: stop at the first check (every ``check_every`` steps) where the
    model's teacher-forced accuracy on ``validation_n`` validation problems reaches it; ``steps``
    is then the most the warm start may take.  ``validation``: ``"heldout"`` (the default) draws
    them from the held-out split outside the evaluation set (:func:`validation_problems`);
    ``"train-mix"`` from the train split in the evaluation set's mix of kinds, kept out of the
    warm start's draws (:func:`arithmetic_validation_problems`; the module docstring says what
    each measures).  ``heldout_n``: the evaluation set's size (the reported accuracy).
    ``adam_beta2``: Adam's second-moment decay.

    ``two_turn_demos > 0`` builds the two-turn recipe's model: the arithmetic build with that
    share of its sequences replaced by guess-feedback-answer demonstrations of the ``two_turn``
    environment (:func:`two_turn_sequences`).

    ``tool_demos > 0`` builds the calculator recipe's model: every warm-start sequence is a
    calculator conversation on ``tool_digits``-digit operands (:func:`tool_sequences`), a
    ``tool_demos`` share of them solved with the tool (tool results as ``tool_role`` messages),
    the rest answered at once; ``digits`` is then unused.  The first steps are demonstrations
    only: copying operands into the call and the result into the answer takes many
    demonstrations to learn, while how often the model calls is set by the share of the
    mixture's steps.  When copying sets in is as random as the arithmetic onset, so with
    ``target_accuracy > 0`` the demonstrations run at the full rate until the teacher-forced
    accuracy of tool-use conversations on ``validation_n`` validation rows (the call and the
    answer) reaches it -- at most ``tool_only_steps`` steps, the onset phase --; then a tail of
    ``steps - tool_only_steps`` steps decays the rate (cosine, to lr / 10), its last
    ``tool_mixture_steps`` the mixture.  Without a target: ``tool_only_steps`` demonstration
    steps, then the mixture, under one cosine decay over ``steps``.  ``tool_demos == 0`` (the
    default) is the arithmetic build, unchanged.

    ``family="qwen3_moe"`` builds a Qwen3-MoE instead (``num_experts``, ``top_k``,
    ``moe_intermediate_size``; ``intermediate_size`` unused there: every layer is an MoE layer);
    the warm start is the same code (megatron's MoE layer with aux and z losses off)."""
    if family not in FAMILIES:
        raise MegarlError(f"tiny model family {family!r}: choose from {', '.join(FAMILIES)}")
    if validation not in VALIDATIONS:
        raise MegarlError(f"validation {validation!r}: choose from {', '.join(VALIDATIONS)}")
    from megarl.builtin.tiny_checkpoint import make_tiny_hf_checkpoint
    from megarl.builtin.tiny_tokenizer import build_tiny_tokenizer
    from megarl.config.schema import OptimSettings
    from megarl.data.tokenizer import TokenizerContract
    from megarl.envs.render import EnvTurnRenderer
    from megarl.models.forward import token_log_probs_from_logits
    from megarl.models.megatron_ckpt import load_model
    from megarl.models.optim import train_step, wrap_for_training
    from megarl.models.weights import export_hf
    from megarl.roles.common import lr_scheduler
    from megarl.runtime import distributed as rt

    t_start = time.time()
    work = out_dir.rstrip("/") + ".build"
    shutil.rmtree(work, ignore_errors=True)
    tok_dir, random_dir = os.path.join(work, "tokenizer"), os.path.join(work, "random")
    hf_tok = build_tiny_tokenizer(tok_dir)
    vocab = -(-len(hf_tok) // 16) * 16
    # the dense build's call is exactly what it was before the MoE family existed (its cached
    # model and numbers must not move); the MoE one only adds the expert sizes
    moe = (dict(num_experts=num_experts, num_experts_per_tok=top_k, moe_intermediate_size=moe_intermediate_size)
           if family != "llama" else {})
    make_tiny_hf_checkpoint(random_dir, family, seed=seed, vocab_size=vocab, hidden_size=hidden_size,
                            num_layers=num_layers, num_heads=num_heads, num_kv_heads=num_kv_heads,
                            intermediate_size=intermediate_size, tokenizer_dir=tok_dir, **moe)
    cfg_path = os.path.join(random_dir, "config.json")
    with open(cfg_path) as f:
        hf_cfg = json.load(f)
    hf_cfg.update(bos_token_id=hf_tok.bos_token_id, eos_token_id=hf_tok.eos_token_id,
                  pad_token_id=hf_tok.pad_token_id)
    if tool_demos > 0 or two_turn_demos > 0:
        # its turns end at the template's <|end|> (as a chat model's at <|im_end|>): every engine,
        # single-turn ones too (the no-tool baseline), stops there
        hf_cfg["eos_token_id"] = [hf_tok.eos_token_id, int(hf_tok.convert_tokens_to_ids("<|end|>"))]
    with open(cfg_path, "w") as f:
        json.dump(hf_cfg, f, indent=2)
    tok = TokenizerContract.from_pretrained(tok_dir)

    rt.initialize(tp=1, pp=1, seed=seed)
    model = load_model(random_dir)
    # the calculator build with a target: its tool-only phase early-stops on tool-use validation
    tool_target = tool_demos > 0 and target_accuracy > 0
    # The default build: a constant rate, as it always had.  The calculator build decays it
    # (cosine, to lr / 10): copying a 6-digit operand right at temperature 1 needs a precise fit,
    # and the mixture that sets how often the model calls must not undo it -- over all `steps`
    # without a target, over the tail after the onset with one (a constant rate until then;
    # megatron's scheduler reads min_lr from the param groups, so they carry it from the start).
    settings = OptimSettings(optimizer="adam", lr=lr, min_lr=lr / 10 if tool_demos > 0 else 0.0,
                             lr_decay_style="cosine" if tool_demos > 0 and not tool_target else "constant",
                             clip_grad=1.0, weight_decay=0.0, adam_beta2=adam_beta2)
    ddp, opt = wrap_for_training(model, settings)
    sched = lr_scheduler(opt, settings, steps) if tool_demos > 0 and not tool_target else None
    V = model.megarl_spec.vocab_size
    problems = rows = None
    # the validation problems of an arithmetic build with a target: held-out problems, or with
    # "train-mix" (not the two-turn build) train problems of the evaluation set's mix, excluded
    # from the draws below
    held_apart = ()
    if target_accuracy > 0 and tool_demos == 0:
        held_apart = (arithmetic_validation_problems if validation == "train-mix" and two_turn_demos == 0
                      else validation_problems)(validation_n, heldout_n, digits, ops)
    if tool_demos > 0:  # every sequence a calculator conversation on tool_digits operands, rendered a step at a time
        from megarl.envs.calculator import make_rows

        rows = make_rows("train", seed, steps * batch, digits=tuple(tool_digits), ops=tuple(ops))
    elif two_turn_demos > 0:
        prompts, answers, masks = warmstart_sequences(tok, steps=steps, batch=batch, seed=seed, digits=digits, ops=ops,
                                                      two_turn_demos=two_turn_demos)
    else:  # the arithmetic build, tokenised a step at a time (a build may stop early); with a
        # target, its draws never hold a validation problem
        from megarl.data.tasks.arithmetic import make_problems

        problems = make_problems("train", seed, steps * batch, digits=tuple(digits), ops=tuple(ops), distinct=False,
                                 exclude=held_apart)
    validation = None
    if tool_target:  # tool-use demonstrations on distinct held-out rows: the call and the answer teacher-forced
        validation = training_tensors(tok.pad_token_id, *tool_sequences(
            tok, validation_problems(validation_n, heldout_n, tool_digits, ops), 1.0, tool_role))
    elif target_accuracy > 0:
        validation = training_tensors(tok.pad_token_id, *_sequences(tok, held_apart))
    # the step where the calculator build's mixture starts, and the step count.  With a target: an
    # onset phase of demonstrations at the full rate, at most tool_only_steps, that ends at the
    # first check reaching it; then a tail of steps - tool_only_steps steps decaying the rate
    # (cosine, to lr / 10), demonstrations first, its last tool_mixture_steps the mixture
    mixed_from = None if tool_target else min(tool_only_steps, steps)
    end = tool_only_steps if tool_target else steps
    losses, checks, reached = [], [], None
    step = 0
    while step < end:
        sl = slice(step * batch, (step + 1) * batch)
        if problems is not None:
            prompts, answers = _sequences(tok, problems[sl])
            tokens, mask = training_tensors(tok.pad_token_id, prompts, answers)
        elif rows is not None:
            demos_first = (step + 1 if mixed_from is None else mixed_from) * batch
            tokens, mask = training_tensors(tok.pad_token_id, *tool_sequences(
                tok, rows[sl], tool_demos, tool_role, demos_first=demos_first, first_index=step * batch))
        else:
            tokens, mask = training_tensors(tok.pad_token_id, prompts[sl], answers[sl], masks[sl])
        n = float(mask.sum())

        def loss_fn(output, mb):
            lp = token_log_probs_from_logits(output[:, :-1], mb["tokens"][:, 1:], V)
            loss = -(lp * mb["mask"]).sum() / n
            return loss, {"nll": float(loss.detach())}

        res = train_step(ddp, opt, [{"tokens": tokens, "mask": mask}], loss_fn)
        if sched is not None:
            sched.step(increment=1)
        losses.append(res.metrics[0]["nll"])
        if validation is not None and reached is None and (step + 1) % check_every == 0:
            acc = teacher_forced_accuracy(ddp, *validation, V)
            checks.append((step + 1, acc))
            if acc >= target_accuracy:
                reached = step + 1
        if log_every and (step + 1) % log_every == 0:
            # (a tool build's tail measures nothing: its last check is the onset's)
            note = f", validation accuracy {checks[-1][1]:.3f}" if checks and reached in (None, step + 1) else ""
            print(f"  warm start step {step + 1}/{end}: answer nll {sum(losses[-log_every:]) / log_every:.4f}"
                  f"{note}", flush=True)
        step += 1
        if reached == step:
            print(f"  warm start: {'tool-use ' if tool_target else ''}validation accuracy {checks[-1][1]:.3f} >= "
                  f"target {target_accuracy:g} at step {reached}", flush=True)
            if not tool_target:
                break
            # copying has set in; the tail fits it precisely at a decaying rate, and its mixture --
            # which sets how often the model calls -- runs at the lowest rates, so it cannot undo it
            tail = steps - tool_only_steps
            mixed_from, end = reached + tail - tool_mixture_steps, reached + tail
            sched = lr_scheduler(opt, dataclasses.replace(settings, lr_decay_style="cosine"), tail)
    if validation is not None and reached is None:
        rt.shutdown()
        shutil.rmtree(work, ignore_errors=True)
        best = max(checks, key=lambda c: c[1]) if checks else (0, 0.0)
        within = (f"--tool-only-steps {tool_only_steps} (model.tiny.tool_only_steps), its onset phase"
                  if tool_target else f"--steps {steps} (model.tiny.warmstart_steps)")
        raise MegarlError(f"the warm start did not reach --target-accuracy {target_accuracy:g} "
                          f"(model.tiny.warmstart_target_accuracy) within {within}; its best "
                          f"{'tool-use ' if tool_target else ''}validation accuracy was {best[1]:.3f} at step {best[0]}: "
                          "raise the steps or the learning rate, or lower the target")
    staged = os.path.join(work, "model")
    export_hf(ddp, staged, tokenizer_dir=tok_dir)
    rt.shutdown()
    if tool_demos > 0:  # the no-tool baseline on the calculator's operands (answers end at <|end|>)
        acc = heldout_accuracy(staged, digits=tool_digits, ops=ops, max_new_tokens=tool_digits[1] + 3,
                               stop_ids=EnvTurnRenderer(tok).assistant_end_ids)
    else:
        acc = heldout_accuracy(staged, n=heldout_n, digits=digits, ops=ops)
    info = {"family": family, "hidden_size": hidden_size, "num_layers": num_layers, "num_heads": num_heads,
            "num_kv_heads": num_kv_heads, "intermediate_size": intermediate_size, "vocab_size": vocab,
            "warmstart": {"steps": len(losses), "max_steps": steps, "lr": lr, "batch": batch, "seed": seed,
                          "final_nll": losses[-1] if losses else None, "target_accuracy": target_accuracy or None,
                          "validation_accuracy": checks[-1][1] if checks else None,
                          "heldout_n": heldout_n, "adam_beta2": adam_beta2,
                          "validation": ("train-mix" if validation == "train-mix" and not tool_demos and not
                                         two_turn_demos else "heldout") if target_accuracy > 0 else None},
            "task": {"name": "arithmetic", "digits": list(digits), "ops": list(ops)},
            "heldout_accuracy_greedy": acc, "seconds": time.time() - t_start,
            "tokenizer_hash": tok.hash}
    if tool_demos > 0:  # the default build's info is what it was
        info["task"] = {"name": "calculator", "digits": list(tool_digits), "ops": list(ops)}
        # heldout_accuracy_greedy is then the no-tool baseline: answered at once, never calling
        info["tool"] = {"demos": tool_demos, "digits": list(tool_digits), "role": tool_role,
                        "only_steps": tool_only_steps}
        if tool_target:  # where the onset phase ended (tool_only_steps is then its most), and the mixture
            info["tool"]["mixture_steps"] = tool_mixture_steps
            info["warmstart"]["tool_onset_steps"] = reached
    if two_turn_demos > 0:
        info["two_turn_demos"] = two_turn_demos
    if moe:
        info["moe"] = {"num_experts": num_experts, "top_k": top_k, "moe_intermediate_size": moe_intermediate_size}
    return publish_build(info, staged, out_dir, work)


def publish_build(info: dict, staged: str, out_dir: str, work: str) -> dict:
    """Finish a build: ``tiny_model.json`` written last into the staged export, which then replaces
    ``out_dir``; the work directory is removed.  Returns ``info``."""
    with open(os.path.join(staged, MARKER), "w") as f:
        json.dump(info, f, indent=1)
    if os.path.exists(out_dir):
        shutil.rmtree(out_dir)
    os.makedirs(os.path.dirname(os.path.abspath(out_dir)), exist_ok=True)
    os.replace(staged, out_dir)
    shutil.rmtree(work, ignore_errors=True)
    return info


@cli_main
def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--hidden-size", type=int, default=128)
    p.add_argument("--num-layers", type=int, default=4)
    p.add_argument("--num-heads", type=int, default=4)
    p.add_argument("--num-kv-heads", type=int, default=2)
    p.add_argument("--intermediate-size", type=int, default=256)
    p.add_argument("--steps", type=int, default=2000,
                   help="the most warm-start steps (exactly this many with --target-accuracy 0)")
    p.add_argument("--target-accuracy", type=float, default=None,
                   help="stop at the first check where the model's teacher-forced accuracy on distinct "
                        "held-out problems outside the evaluation set reaches this (0: run --steps steps; default "
                        "0.3, and 0 for the calculator build). The calculator build's tool-only phase stops on it, "
                        "measured on tool-use demonstrations of such problems (the call and the answer), and its "
                        "mixture follows")
    p.add_argument("--check-every", type=int, default=4, help="steps between two validation checks")
    p.add_argument("--validation-n", type=int, default=256, help="problems in the validation set")
    p.add_argument("--heldout-n", type=int, default=200,
                   help="problems in the evaluation set (the recipe's held-out file: data.arithmetic_heldout_n), kept "
                        "apart from validation; the reported held-out accuracy is on it")
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--adam-beta2", type=float, default=0.999, help="Adam's second-moment decay")
    p.add_argument("--validation", default="heldout", choices=VALIDATIONS,
                   help="where the early stop is measured (arithmetic builds): held-out problems outside the "
                        "evaluation set, or train problems in the evaluation set's mix that the warm start never "
                        "draws (train-mix)")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--min-digits", type=int, default=1)
    p.add_argument("--max-digits", type=int, default=2)
    p.add_argument("--ops", default="plus")
    p.add_argument("--family", default="llama", choices=FAMILIES)
    p.add_argument("--num-experts", type=int, default=8, help="qwen3_moe: routed experts per layer")
    p.add_argument("--top-k", type=int, default=2, help="qwen3_moe: experts per token")
    p.add_argument("--moe-intermediate-size", type=int, default=128, help="qwen3_moe: each expert's SwiGLU width")
    p.add_argument("--tool-demos", type=float, default=0.0,
                   help="share of calculator tool-use demonstrations among the warm-start sequences after "
                        "--tool-only-steps (0: the arithmetic build; > 0: the calculator build, operands of "
                        "--tool-*-digits)")
    p.add_argument("--tool-min-digits", type=int, default=4, help="calculator build: fewest digits per operand")
    p.add_argument("--tool-max-digits", type=int, default=6, help="calculator build: most digits per operand")
    p.add_argument("--tool-only-steps", type=int, default=0,
                   help="calculator build: the first warm-start steps that are demonstrations only")
    p.add_argument("--tool-mixture-steps", type=int, default=100,
                   help="calculator build with --target-accuracy: the last steps, those of the mixture (of the "
                        "--steps - --tool-only-steps that follow the onset phase)")
    p.add_argument("--tool-role", default="user",
                   help="calculator build: the role of the tool's messages (the tiny vocabulary has no <|tool|>)")
    p.add_argument("--two-turn-demos", type=float, default=0.0,
                   help="share of warm-start sequences that are two_turn demonstrations (guess, feedback, answer; "
                        "0: none)")
    p.add_argument("--overwrite", action="store_true")
    a = p.parse_args(argv)
    if is_built(a.out) and not a.overwrite:
        raise MegarlError(f"--out {a.out}: already holds a tiny model ({MARKER}); pass --overwrite to rebuild")
    if os.path.exists(a.out) and not is_built(a.out) and os.listdir(a.out) and not a.overwrite:
        raise MegarlError(f"--out {a.out}: exists and is not a tiny model build; refusing to overwrite")
    if a.steps < 0 or a.batch < 1:
        raise MegarlError("--steps must be >= 0 and --batch >= 1")
    if not 0.0 <= a.adam_beta2 < 1.0:
        raise MegarlError(f"--adam-beta2 {a.adam_beta2}: must be in [0, 1)")
    if a.target_accuracy is None:
        a.target_accuracy = 0.0 if a.tool_demos > 0 else 0.3
    if not 0.0 <= a.target_accuracy <= 1.0 or a.check_every < 1 or a.validation_n < 1 or a.heldout_n < 1:
        raise MegarlError(f"--target-accuracy {a.target_accuracy} must be in [0, 1], "
                          f"--check-every {a.check_every}, --validation-n {a.validation_n} and --heldout-n "
                          f"{a.heldout_n} >= 1")
    if a.target_accuracy > 0 and a.tool_demos > 0 and not (
            a.check_every <= a.tool_only_steps and 0 <= a.tool_mixture_steps <= a.steps - a.tool_only_steps):
        raise MegarlError(f"--tool-only-steps {a.tool_only_steps} / --tool-mixture-steps {a.tool_mixture_steps}: with "
                          "--target-accuracy the calculator build's onset phase (at most --tool-only-steps) stops on "
                          f"it and a tail of --steps {a.steps} - --tool-only-steps follows, its last "
                          f"--tool-mixture-steps the mixture: need --check-every {a.check_every} <= --tool-only-steps "
                          "and 0 <= --tool-mixture-steps <= --steps - --tool-only-steps")
    if not 0.0 <= a.tool_demos <= 1.0:
        raise MegarlError(f"--tool-demos {a.tool_demos}: must be in [0, 1]")
    if not 0.0 <= a.two_turn_demos <= 1.0 or (a.two_turn_demos and a.tool_demos):
        raise MegarlError(f"--two-turn-demos {a.two_turn_demos}: must be in [0, 1], and 0 with --tool-demos")
    try:
        from megarl.envs.calculator import CalculatorEnv

        CalculatorEnv.check_args(tool_role=a.tool_role)
    except ValueError as e:
        raise MegarlError(f"--tool-role: {e}") from None
    if not 1 <= a.tool_min_digits <= a.tool_max_digits:
        raise MegarlError(f"--tool-min-digits {a.tool_min_digits} / --tool-max-digits {a.tool_max_digits}: need "
                          "1 <= min <= max")
    if a.family != "llama" and not 1 <= a.top_k <= a.num_experts:
        raise MegarlError(f"--top-k {a.top_k}: must be between 1 and --num-experts {a.num_experts}")
    if a.target_accuracy > 0 and a.tool_demos > 0:
        tail = a.steps - a.tool_only_steps
        plan = (f"tool-use demonstrations through the megatron actor until {a.target_accuracy:g} tool-use validation "
                f"accuracy (at most {a.tool_only_steps} steps), then {tail - a.tool_mixture_steps} more and "
                f"{a.tool_mixture_steps} of the mixture at a decaying rate")
    elif a.target_accuracy > 0:
        plan = f"up to {a.steps} steps through the megatron actor, stopping at {a.target_accuracy:g} validation accuracy"
    else:
        plan = f"{a.steps} steps through the megatron actor"
    print(f"building the tiny model in {a.out} (warm start: {plan})", flush=True)
    info = build(a.out, hidden_size=a.hidden_size, num_layers=a.num_layers, num_heads=a.num_heads,
                 num_kv_heads=a.num_kv_heads, intermediate_size=a.intermediate_size, steps=a.steps, lr=a.lr,
                 batch=a.batch, seed=a.seed, digits=(a.min_digits, a.max_digits), ops=tuple(a.ops.split(",")),
                 family=a.family, num_experts=a.num_experts, top_k=a.top_k,
                 moe_intermediate_size=a.moe_intermediate_size, tool_demos=a.tool_demos,
                 tool_digits=(a.tool_min_digits, a.tool_max_digits), tool_role=a.tool_role,
                 tool_only_steps=a.tool_only_steps, tool_mixture_steps=a.tool_mixture_steps,
                 two_turn_demos=a.two_turn_demos,
                 target_accuracy=a.target_accuracy, check_every=a.check_every,
                 validation_n=a.validation_n, heldout_n=a.heldout_n, adam_beta2=a.adam_beta2,
                 validation=a.validation)
    print(f"tiny model ready in {a.out}: held-out greedy accuracy {info['heldout_accuracy_greedy']:.3f} "
          f"after {info['warmstart']['steps']} warm-start steps ({info['seconds']:.0f}s)", flush=True)


if __name__ == "__main__":
    main()
