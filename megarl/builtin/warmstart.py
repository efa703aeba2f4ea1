"""The built-in tiny model: tokenizer, a small random model, a warm start on a built-in task.

    python -m megarl.tinymodel --out DIR [--task arithmetic --task-arg max_digits=2 --target-accuracy 0.3 ...]
    python -m megarl.tinymodel --out DIR --task calculator --task-arg demos=0.15 --task-arg only_steps=1500 ...
    python -m megarl.tinymodel --out DIR --family qwen3_moe --num-experts 8 --top-k 2 ...

1. writes the built-in word-level tokenizer (digits are single tokens) with its chat template;
2. builds a small random HF model (``--family``: a Llama, or a Qwen3-MoE);
3. warm-starts it with a supervised run *through the megatron actor* (megatron model, DDP and
   optimizer: the code path RL trains with) on the sequences its task gives
   (:mod:`megarl.builtin.tasks`, one :class:`SequenceSource` each), in one loop (:func:`build`);
4. exports an HF checkpoint and, last, ``tiny_model.json``: how it was made and its held-out
   accuracy (greedy, transformers ``generate``), so a directory with it is complete.

The warm start stops part-way, measured: every ``--check-every`` steps the teacher-forced accuracy
on a validation set the evaluation set does not hold; the first check at ``--target-accuracy``
ends it (``--steps`` is then the most; a build that has not reached it fails, naming it).  Why a
measured stop and not a step count, and what each task's validation measures: docs/tiny-model.md.
``--target-accuracy 0`` runs exactly ``--steps`` steps, as the tests' small builds do.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import time
from typing import Optional

from megarl.errors import MegarlError

MARKER = "tiny_model.json"


def is_built(out_dir: str) -> bool:
    return os.path.isfile(os.path.join(out_dir, MARKER))


def prompt_answer_sequences(tok, rows, field: str = "answer"):
    """Chat-templated prompts and answers (``row[field]``, then EOS) of ``rows``."""
    prompts, answers = [], []
    for r in rows:
        prompts.append(tok.encode_prompt([{"role": "user", "content": r["prompt"]}]))
        answers.append(list(tok.tokenizer.encode(r[field], add_special_tokens=False)) + [tok.eos_token_id])
    return prompts, answers


def left_padded(prompts, pad_id: int):
    """Prompts left-padded to one width for a batched greedy ``generate``: ``(ids, attention_mask)``;
    each row's answer starts at column ``ids.shape[1]`` of the output."""
    import torch

    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    att = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = torch.tensor(p)
        att[i, width - len(p):] = 1
    return ids, att


def is_demo(i: int, share: float) -> bool:
    """Whether warm-start sequence ``i`` is a tool-use demonstration: evenly spaced, so every
    batch holds the same share (``floor((i + 1) * share) > floor(i * share)``)."""
    return int((i + 1) * share) > int(i * share)


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


#: the seeds of the held-out draws: the evaluation set (a recipe's held-out file) and the
#: validation set the early stop is measured on (distinct problems the evaluation set does not hold)
EVALUATION_SEED, VALIDATION_SEED = 1, 2


@dataclasses.dataclass(frozen=True)
class WarmStartRun:
    """The task-independent settings of a warm start (``model.tiny.warmstart_*``)."""

    steps: int
    batch: int
    seed: int
    lr: float
    adam_beta2: float = 0.999
    target_accuracy: float = 0.0
    check_every: int = 4
    validation_n: int = 256
    heldout_n: int = 200  # the evaluation set's size (a recipe's data.task.heldout_n)


class SequenceSource:
    """What the warm-start loop asks of a task: its batches, its validation set, its learning
    rate schedule and what it records.  The defaults are a constant rate over ``run.steps`` steps
    that stops at the first check reaching the target; a task overrides what differs."""

    #: "tool-use " where the early stop is measured on a kind of sequence, for the messages
    measured = ""

    def __init__(self, tok, settings, run: WarmStartRun):
        self.tok, self.settings, self.run = tok, settings, run
        self.scheduler = None

    @staticmethod
    def eos_token_ids(hf_tok) -> Optional[list]:
        """The ids that end a turn, when more than EOS (None: EOS)."""
        return None

    def optim_settings(self):
        from megarl.config.schema import OptimSettings

        r = self.run
        return OptimSettings(optimizer="adam", lr=r.lr, min_lr=0.0, lr_decay_style="constant", clip_grad=1.0,
                             weight_decay=0.0, adam_beta2=r.adam_beta2)

    def start(self, opt, settings) -> None:
        """Called once the optimizer exists (a task with a schedule makes it here)."""

    def validation(self):
        """``(tokens, mask)`` of the validation set, or None without a target."""
        raise NotImplementedError

    def last_step(self) -> int:
        """The step count the loop runs to, unless a check stops it earlier."""
        return self.run.steps

    def batch(self, step: int):
        """``(tokens, mask)`` of warm-start step ``step`` (:func:`training_tensors`)."""
        raise NotImplementedError

    def on_target(self, reached: int, opt, settings) -> Optional[int]:
        """The target was reached at step ``reached``: the new last step, or None to stop."""
        return None

    def within(self) -> str:
        """The limit a build that never reached its target ran into, for the error."""
        return f"--steps {self.run.steps} (model.tiny.warmstart_steps)"

    def evaluate(self, model_dir: str) -> dict:
        """``tiny_model.json`` entries measured on the exported model (``heldout_accuracy_greedy``, ...)."""
        raise NotImplementedError

    def info(self, warmstart: dict) -> dict:
        """``tiny_model.json``'s task entries (``task``, ...); may add to ``warmstart``."""
        raise NotImplementedError


#: the families the tiny model can be built in: the dense default and one mixture-of-experts
FAMILIES = ("llama", "qwen3_moe")


@dataclasses.dataclass(frozen=True)
class ModelShape:
    """The random model a build starts from (``model.tiny.*``)."""

    hidden_size: int = 128
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int = 2
    intermediate_size: int = 256
    family: str = "llama"
    num_experts: int = 8  # qwen3_moe: routed experts per layer
    top_k: int = 2  # qwen3_moe: experts per token
    moe_intermediate_size: int = 128  # qwen3_moe: each expert's SwiGLU width

    def moe(self) -> dict:
        return (dict(num_experts=self.num_experts, num_experts_per_tok=self.top_k,
                     moe_intermediate_size=self.moe_intermediate_size) if self.family != "llama" else {})


def _random_model(work: str, shape: ModelShape, seed: int, source_eos):
    """The tokenizer and the random HF checkpoint under ``work``: ``(tok_dir, random_dir, vocab)``."""
    from megarl.builtin.tiny_checkpoint import make_tiny_hf_checkpoint
    from megarl.builtin.tiny_tokenizer import build_tiny_tokenizer

    tok_dir, random_dir = os.path.join(work, "tokenizer"), os.path.join(work, "random")
    hf_tok = build_tiny_tokenizer(tok_dir)
    vocab = -(-len(hf_tok) // 16) * 16
    make_tiny_hf_checkpoint(random_dir, shape.family, seed=seed, vocab_size=vocab, hidden_size=shape.hidden_size,
                            num_layers=shape.num_layers, num_heads=shape.num_heads, num_kv_heads=shape.num_kv_heads,
                            intermediate_size=shape.intermediate_size, tokenizer_dir=tok_dir, **shape.moe())
    cfg_path = os.path.join(random_dir, "config.json")
    with open(cfg_path) as f:
        hf_cfg = json.load(f)
    hf_cfg.update(bos_token_id=hf_tok.bos_token_id, eos_token_id=hf_tok.eos_token_id,
                  pad_token_id=hf_tok.pad_token_id)
    eos = source_eos(hf_tok)
    if eos is not None:  # turns end at the template's <|end|>: every engine stops there
        hf_cfg["eos_token_id"] = eos
    with open(cfg_path, "w") as f:
        json.dump(hf_cfg, f, indent=2)
    return tok_dir, random_dir, vocab


def build(out_dir: str, source_cls: type, settings, run: WarmStartRun, shape: ModelShape = ModelShape(),
          log_every: int = 50) -> dict:
    """Build the tiny model warm-started on the sequences of ``source_cls`` (a task's
    ``WarmStart``, its ``settings``) into ``out_dir``; return its info (``tiny_model.json``)."""
    from megarl.data.tokenizer import TokenizerContract
    from megarl.models.vocab_parallel import token_log_probs_from_logits
    from megarl.models.megatron_ckpt import load_model
    from megarl.models.optim import train_step, wrap_for_training
    from megarl.models.weights import export_hf
    from megarl.runtime import distributed as rt

    if shape.family not in FAMILIES:
        raise MegarlError(f"tiny model family {shape.family!r}: choose from {', '.join(FAMILIES)}")
    t_start = time.time()
    work = out_dir.rstrip("/") + ".build"
    shutil.rmtree(work, ignore_errors=True)
    tok_dir, random_dir, vocab = _random_model(work, shape, run.seed, source_cls.eos_token_ids)
    tok = TokenizerContract.from_pretrained(tok_dir)
    source = source_cls(tok, settings, run)

    rt.initialize(tp=1, pp=1, seed=run.seed)
    model = load_model(random_dir)
    optim = source.optim_settings()
    ddp, opt = wrap_for_training(model, optim)
    source.start(opt, optim)
    V = model.megarl_spec.vocab_size
    validation = source.validation() if run.target_accuracy > 0 else None
    end = source.last_step()
    losses, checks, reached = [], [], None
    step = 0
    while step < end:
        tokens, mask = source.batch(step)
        n = float(mask.sum())

        def loss_fn(output, mb):
            lp = token_log_probs_from_logits(output[:, :-1], mb["tokens"][:, 1:], V)
            loss = -(lp * mb["mask"]).sum() / n
            return loss, {"nll": float(loss.detach())}

        res = train_step(ddp, opt, [{"tokens": tokens, "mask": mask}], loss_fn)
        if source.scheduler is not None:
            source.scheduler.step(increment=1)
        losses.append(res.metrics[0]["nll"])
        if validation is not None and reached is None and (step + 1) % run.check_every == 0:
            acc = teacher_forced_accuracy(ddp, *validation, V)
            checks.append((step + 1, acc))
            if acc >= run.target_accuracy:
                reached = step + 1
        if log_every and (step + 1) % log_every == 0:
            # (after the target, a tail measures nothing: its last check is the target's)
            note = f", validation accuracy {checks[-1][1]:.3f}" if checks and reached in (None, step + 1) else ""
            print(f"  warm start step {step + 1}/{end}: answer nll {sum(losses[-log_every:]) / log_every:.4f}"
                  f"{note} ({time.time() - t_start:.0f}s)", flush=True)
        step += 1
        if reached == step:
            print(f"  warm start: {source.measured}validation accuracy {checks[-1][1]:.3f} >= "
                  f"target {run.target_accuracy:g} at step {reached}", flush=True)
            end = source.on_target(reached, opt, optim)
            if end is None:
                break
    if validation is not None and reached is None:
        rt.shutdown()
        shutil.rmtree(work, ignore_errors=True)
        best = max(checks, key=lambda c: c[1]) if checks else (0, 0.0)
        raise MegarlError(f"the warm start did not reach --target-accuracy {run.target_accuracy:g} "
                          f"(model.tiny.warmstart_target_accuracy) within {source.within()}; its best "
                          f"{source.measured}validation accuracy was {best[1]:.3f} at step {best[0]}: "
                          "raise the steps or the learning rate, or lower the target")
    staged = os.path.join(work, "model")
    export_hf(ddp, staged, tokenizer_dir=tok_dir)
    rt.shutdown()
    measured = source.evaluate(staged)
    warmstart = {"steps": len(losses), "max_steps": run.steps, "lr": run.lr, "batch": run.batch, "seed": run.seed,
                 "first_nll": losses[0] if losses else None, "final_nll": losses[-1] if losses else None,
                 "target_accuracy": run.target_accuracy or None,
                 "validation_accuracy": checks[-1][1] if checks else None,
                 "heldout_n": run.heldout_n, "adam_beta2": run.adam_beta2}
    info = {"family": shape.family, "hidden_size": shape.hidden_size, "num_layers": shape.num_layers,
            "num_heads": shape.num_heads, "num_kv_heads": shape.num_kv_heads,
            "intermediate_size": shape.intermediate_size, "vocab_size": vocab, "warmstart": warmstart}
    info.update(source.info(warmstart))
    info.update(measured)
    info.update(seconds=time.time() - t_start, tokenizer_hash=tok.hash)
    if shape.family != "llama":
        info["moe"] = {"num_experts": shape.num_experts, "top_k": shape.top_k,
                       "moe_intermediate_size": shape.moe_intermediate_size}
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
