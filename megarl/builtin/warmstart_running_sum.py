"""The tiny model of the long-tail reasoning task (megarl/data/tasks/running_sum.py), warm-started.

    python -m megarl.builtin.warmstart_running_sum --out DIR [--target-accuracy 0.35 --steps 3000 ...]

The same recipe as the arithmetic build (megarl/builtin/warmstart.py), on the running-sum task:
the built-in word-level tokenizer, a random tiny Llama, a supervised warm start *through the
megatron actor* (megatron model, DDP and optimizer: the code path RL trains with) on worked
answers -- chat-templated prompt, then the chain of steps, ``so``, the total and EOS, loss on the
answer -- then an HF export with ``tiny_model.json`` (how it was made, its held-out accuracy and
its answers' lengths), written last.

It stops part-way, measured: every ``--check-every`` steps the teacher-forced accuracy (every
answer token the argmax: what greedy decoding writes) on distinct held-out problems outside the
evaluation set; the first check at ``--target-accuracy`` ends it.  What a model knows then is a
matter of chain length, which is what RL has to work on: short chains right, long ones wrong
somewhere.  Measured with transformers on this machine's CPU (hidden 128, 4 layers, batches of
64, lr 2e-3): after 800 steps the teacher-forced accuracy was 0.96 on 2-3 terms, 0.46 on 4-7 and
0 on 8 or more (0.40 over the mix).  A wrong chain is still a chain: long problems get long
answers whether right or not, so the tail of response lengths is there from the first iteration.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import time

from megarl.builtin.warmstart import MARKER, publish_build, teacher_forced_accuracy, training_tensors
from megarl.errors import MegarlError, cli_main

#: the seeds of the held-out draws: the evaluation set (a recipe's held-out file) and the validation set
EVALUATION_SEED, VALIDATION_SEED = 1, 2


def _sequences(tok, rows):
    """Chat-templated prompts and worked answers (the solution, then EOS)."""
    prompts = [tok.encode_prompt([{"role": "user", "content": r["prompt"]}]) for r in rows]
    answers = [list(tok.tokenizer.encode(r["solution"], add_special_tokens=False)) + [tok.eos_token_id] for r in rows]
    return prompts, answers


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
        prompts, _ = _sequences(tok, [rows[i] for i in part])
        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), tok.pad_token_id, dtype=torch.long)
        att = torch.zeros_like(ids)
        for j, p in enumerate(prompts):
            ids[j, width - len(p):] = torch.tensor(p)
            att[j, width - len(p):] = 1
        with torch.no_grad():
            out = model.generate(input_ids=ids, attention_mask=att, do_sample=False, max_new_tokens=max_new_tokens,
                                 eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
        for j, i in enumerate(part):
            toks = out[j, width:].tolist()
            n = toks.index(tok.eos_token_id) + 1 if tok.eos_token_id in toks else len(toks)
            lengths[i] = n
            right[i] = score(tok.decode(toks[:n], skip_special_tokens=True), rows[i]["answer"]) == 1.0
    return right, lengths


def build(out_dir: str, *, hidden_size: int = 128, num_layers: int = 4, num_heads: int = 4, num_kv_heads: int = 2,
          intermediate_size: int = 256, steps: int = 3000, lr: float = 2e-3, batch: int = 64, seed: int = 0,
          terms=(2, 26), alpha: float = 1.8, target_accuracy: float = 0.35, check_every: int = 20,
          validation_n: int = 256, heldout_n: int = 200, log_every: int = 50) -> dict:
    """Build the running-sum tiny model into ``out_dir``; return its info (``tiny_model.json``).

    ``target_accuracy > 0``: stop at the first check where the teacher-forced validation accuracy
    reaches it (``steps`` is then the most); 0: exactly ``steps`` steps."""
    from megarl.builtin.tiny_checkpoint import make_tiny_hf_checkpoint
    from megarl.builtin.tiny_tokenizer import build_tiny_tokenizer
    from megarl.config.schema import OptimSettings
    from megarl.data.tasks.running_sum import make_problems
    from megarl.data.tokenizer import TokenizerContract
    from megarl.models.forward import token_log_probs_from_logits
    from megarl.models.megatron_ckpt import load_model
    from megarl.models.optim import train_step, wrap_for_training
    from megarl.models.weights import export_hf
    from megarl.runtime import distributed as rt

    t_start = time.time()
    work = out_dir.rstrip("/") + ".build"
    shutil.rmtree(work, ignore_errors=True)
    tok_dir, random_dir = os.path.join(work, "tokenizer"), os.path.join(work, "random")
    hf_tok = build_tiny_tokenizer(tok_dir)
    vocab = -(-len(hf_tok) // 16) * 16
    make_tiny_hf_checkpoint(random_dir, "llama", seed=seed, vocab_size=vocab, hidden_size=hidden_size,
                            num_layers=num_layers, num_heads=num_heads, num_kv_heads=num_kv_heads,
                            intermediate_size=intermediate_size, tokenizer_dir=tok_dir)
    cfg_path = os.path.join(random_dir, "config.json")
    with open(cfg_path) as f:
        hf_cfg = json.load(f)
    hf_cfg.update(bos_token_id=hf_tok.bos_token_id, eos_token_id=hf_tok.eos_token_id, pad_token_id=hf_tok.pad_token_id)
    with open(cfg_path, "w") as f:
        json.dump(hf_cfg, f, indent=2)
    tok = TokenizerContract.from_pretrained(tok_dir)

    evaluation = make_problems("heldout", EVALUATION_SEED, heldout_n, terms=tuple(terms), alpha=alpha, distinct=True)
    validation_rows = make_problems("heldout", VALIDATION_SEED, validation_n, terms=tuple(terms), alpha=alpha,
                                    distinct=True, exclude=evaluation)
    validation = training_tensors(tok.pad_token_id, *_sequences(tok, validation_rows)) if target_accuracy > 0 else None
    problems = make_problems("train", seed, steps * batch, terms=tuple(terms), alpha=alpha)

    rt.initialize(tp=1, pp=1, seed=seed)
    model = load_model(random_dir)
    settings = OptimSettings(optimizer="adam", lr=lr, min_lr=0.0, lr_decay_style="constant", clip_grad=1.0,
                             weight_decay=0.0)
    ddp, opt = wrap_for_training(model, settings)
    V = model.megarl_spec.vocab_size
    losses, checks, reached = [], [], None
    for step in range(steps):
        tokens, mask = training_tensors(tok.pad_token_id, *_sequences(tok, problems[step * batch:(step + 1) * batch]))
        n = float(mask.sum())

        def loss_fn(output, mb):
            lp = token_log_probs_from_logits(output[:, :-1], mb["tokens"][:, 1:], V)
            loss = -(lp * mb["mask"]).sum() / n
            return loss, {"nll": float(loss.detach())}

        res = train_step(ddp, opt, [{"tokens": tokens, "mask": mask}], loss_fn)
        losses.append(res.metrics[0]["nll"])
        if validation is not None and (step + 1) % check_every == 0:
            checks.append((step + 1, teacher_forced_accuracy(ddp, *validation, V)))
            if checks[-1][1] >= target_accuracy:
                reached = step + 1
        if log_every and (step + 1) % log_every == 0:
            note = f", validation accuracy {checks[-1][1]:.3f}" if checks else ""
            print(f"  warm start step {step + 1}/{steps}: answer nll {sum(losses[-log_every:]) / log_every:.4f}"
                  f"{note} ({time.time() - t_start:.0f}s)", flush=True)
        if reached:
            print(f"  warm start: validation accuracy {checks[-1][1]:.3f} >= target {target_accuracy:g} at step "
                  f"{reached}", flush=True)
            break
    if validation is not None and reached is None:
        rt.shutdown()
        shutil.rmtree(work, ignore_errors=True)
        best = max(checks, key=lambda c: c[1]) if checks else (0, 0.0)
        raise MegarlError(f"the warm start did not reach --target-accuracy {target_accuracy:g} within --steps {steps}; "
                          f"its best validation accuracy was {best[1]:.3f} at step {best[0]}: raise --steps or lower "
                          "the target")
    staged = os.path.join(work, "model")
    export_hf(ddp, staged, tokenizer_dir=tok_dir)
    rt.shutdown()
    right, lengths = greedy_answers(staged, evaluation)
    acc = sum(right) / len(right)
    by_terms = {}
    for lo, hi in ((2, 3), (4, 7), (8, 15), (16, 26)):
        idx = [i for i, r in enumerate(evaluation) if lo <= r["terms"] <= hi]
        if idx:
            by_terms[f"{lo}-{hi}"] = {"n": len(idx), "accuracy": sum(right[i] for i in idx) / len(idx)}
    srt = sorted(lengths)
    info = {"family": "llama", "hidden_size": hidden_size, "num_layers": num_layers, "num_heads": num_heads,
            "num_kv_heads": num_kv_heads, "intermediate_size": intermediate_size, "vocab_size": vocab,
            "warmstart": {"steps": len(losses), "max_steps": steps, "lr": lr, "batch": batch, "seed": seed,
                          "first_nll": losses[0] if losses else None, "final_nll": losses[-1] if losses else None, "target_accuracy": target_accuracy or None,
                          "validation_accuracy": checks[-1][1] if checks else None, "heldout_n": heldout_n},
            "task": {"name": "running_sum", "terms": list(terms), "alpha": alpha},
            "heldout_accuracy_greedy": acc, "heldout_accuracy_by_terms": by_terms,
            "heldout_answer_tokens": {"median": srt[len(srt) // 2], "p99": srt[min(len(srt) - 1, int(0.99 * len(srt)))],
                                      "max": srt[-1], "mean": sum(srt) / len(srt)},
            "seconds": time.time() - t_start, "tokenizer_hash": tok.hash}
    return publish_build(info, staged, out_dir, work)


@cli_main
def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m megarl.builtin.warmstart_running_sum",
                                description="Build the tiny model of the running-sum task (warm-started part-way).")
    p.add_argument("--out", required=True)
    p.add_argument("--hidden-size", type=int, default=128)
    p.add_argument("--num-layers", type=int, default=4)
    p.add_argument("--num-heads", type=int, default=4)
    p.add_argument("--num-kv-heads", type=int, default=2)
    p.add_argument("--intermediate-size", type=int, default=256)
    p.add_argument("--steps", type=int, default=3000, help="the most warm-start steps (exactly these with target 0)")
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--min-terms", type=int, default=2)
    p.add_argument("--max-terms", type=int, default=26)
    p.add_argument("--alpha", type=float, default=1.8)
    p.add_argument("--target-accuracy", type=float, default=0.35)
    p.add_argument("--check-every", type=int, default=20)
    p.add_argument("--heldout-n", type=int, default=200)
    p.add_argument("--overwrite", action="store_true")
    a = p.parse_args(argv)
    if os.path.exists(os.path.join(a.out, MARKER)) and not a.overwrite:
        raise MegarlError(f"--out {a.out} already holds a built model; pass --overwrite to build it again")
    info = build(a.out, hidden_size=a.hidden_size, num_layers=a.num_layers, num_heads=a.num_heads,
                 num_kv_heads=a.num_kv_heads, intermediate_size=a.intermediate_size,
                 steps=a.steps, lr=a.lr, batch=a.batch, seed=a.seed, terms=(a.min_terms, a.max_terms), alpha=a.alpha,
                 target_accuracy=a.target_accuracy, check_every=a.check_every, heldout_n=a.heldout_n)
    print(f"running-sum tiny model ready in {a.out}: held-out greedy accuracy {info['heldout_accuracy_greedy']:.3f} "
          f"after {info['warmstart']['steps']} warm-start steps ({info['seconds']:.0f}s); by terms "
          + ", ".join(f"{k}: {v['accuracy']:.2f} (n={v['n']})" for k, v in info["heldout_accuracy_by_terms"].items()),
          flush=True)


if __name__ == "__main__":
    main()
