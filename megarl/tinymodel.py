"""The built-in tiny model of the embedded default: tokenizer, Llama-family model, warm start.

    python -m megarl.tinymodel --out DIR [--steps 470 --lr 2e-3 --batch 64 --max-digits 2 ...]
    python -m megarl.tinymodel --out DIR --family qwen3_moe --num-experts 8 --top-k 2 ...
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

RL has room to improve it: the warm start is deliberately short.
"""

from __future__ import annotations

import argparse
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


def heldout_accuracy(model_dir: str, n: int = 200, seed: int = 1, digits=(1, 2), ops=("plus",),
                     max_new_tokens: int = 8) -> float:
    """Greedy held-out accuracy of an HF checkpoint with transformers ``generate``."""
    import torch
    import transformers

    from megarl.data.tasks.arithmetic import make_problems, score
    from megarl.data.tokenizer import TokenizerContract

    tok = TokenizerContract.from_pretrained(model_dir)
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir).eval()
    probs = make_problems("heldout", seed, n, digits=tuple(digits), ops=tuple(ops))
    prompts, _ = _sequences(tok, probs)
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), tok.pad_token_id, dtype=torch.long)
    att = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = torch.tensor(p)
        att[i, width - len(p):] = 1
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=att, do_sample=False, max_new_tokens=max_new_tokens,
                             eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    good = 0
    for i, pr in enumerate(probs):
        text = tok.decode(out[i, width:].tolist(), skip_special_tokens=True)
        good += score(text, pr["answer"]) == 1.0
    return good / len(probs)


#: the families the tiny model can be built in: the dense default and one mixture-of-experts
FAMILIES = ("llama", "qwen3_moe")


def build(out_dir: str, *, hidden_size: int = 128, num_layers: int = 4, num_heads: int = 4, num_kv_heads: int = 2,
          intermediate_size: int = 256, steps: int = 470, lr: float = 2e-3, batch: int = 64, seed: int = 0,
          digits=(1, 2), ops=("plus",), log_every: int = 50, family: str = "llama", num_experts: int = 8,
          top_k: int = 2, moe_intermediate_size: int = 128) -> dict:
    """Build the tiny model into ``out_dir`` (must not hold a finished build); return its info.

    ``family="qwen3_moe"`` builds a Qwen3-MoE instead (``num_experts``, ``top_k``,
    ``moe_intermediate_size``; ``intermediate_size`` unused there: every layer is an MoE layer);
    the warm start is the same code (megatron's MoE layer with aux and z losses off)."""
    if family not in FAMILIES:
        raise MegarlError(f"tiny model family {family!r}: choose from {', '.join(FAMILIES)}")
    import torch

    from megarl.config import OptimSettings
    from megarl.data.tasks.arithmetic import make_problems
    from megarl.data.tiny_tokenizer import build_tiny_tokenizer
    from megarl.data.tokenizer import TokenizerContract
    from megarl.models.forward import token_log_probs_from_logits
    from megarl.models.megatron_ckpt import load_model
    from megarl.models.optim import train_step, wrap_for_training
    from megarl.models.tiny import make_tiny_hf_checkpoint
    from megarl.models.weights import export_hf
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
    with open(cfg_path, "w") as f:
        json.dump(hf_cfg, f, indent=2)
    tok = TokenizerContract.from_pretrained(tok_dir)

    rt.initialize(tp=1, pp=1, seed=seed)
    model = load_model(random_dir)
    ddp, opt = wrap_for_training(model, OptimSettings(optimizer="adam", lr=lr, clip_grad=1.0, weight_decay=0.0))
    V = model.megarl_spec.vocab_size
    problems = make_problems("train", seed, steps * batch, digits=tuple(digits), ops=tuple(ops))
    prompts, answers = _sequences(tok, problems)
    losses = []
    for step in range(steps):
        sl = slice(step * batch, (step + 1) * batch)
        rows = [p + a for p, a in zip(prompts[sl], answers[sl])]
        L = max(len(r) for r in rows)
        tokens = torch.full((len(rows), L), tok.pad_token_id, dtype=torch.long)
        mask = torch.zeros(len(rows), L - 1)
        for i, (p, a) in enumerate(zip(prompts[sl], answers[sl])):
            tokens[i, :len(p) + len(a)] = torch.tensor(p + a)
            mask[i, len(p) - 1:len(p) + len(a) - 1] = 1  # positions that predict the answer
        n = float(mask.sum())

        def loss_fn(output, mb):
            lp = token_log_probs_from_logits(output[:, :-1], mb["tokens"][:, 1:], V)
            loss = -(lp * mb["mask"]).sum() / n
            return loss, {"nll": float(loss.detach())}

        res = train_step(ddp, opt, [{"tokens": tokens, "mask": mask}], loss_fn)
        losses.append(res.metrics[0]["nll"])
        if log_every and (step + 1) % log_every == 0:
            print(f"  warm start step {step + 1}/{steps}: answer nll {sum(losses[-log_every:]) / log_every:.4f}",
                  flush=True)
    staged = os.path.join(work, "model")
    export_hf(ddp, staged, tokenizer_dir=tok_dir)
    rt.shutdown()
    acc = heldout_accuracy(staged, digits=digits, ops=ops)
    info = {"family": family, "hidden_size": hidden_size, "num_layers": num_layers, "num_heads": num_heads,
            "num_kv_heads": num_kv_heads, "intermediate_size": intermediate_size, "vocab_size": vocab,
            "warmstart": {"steps": steps, "lr": lr, "batch": batch, "seed": seed, "final_nll": losses[-1] if losses else None},
            "task": {"name": "arithmetic", "digits": list(digits), "ops": list(ops)},
            "heldout_accuracy_greedy": acc, "seconds": time.time() - t_start,
            "tokenizer_hash": tok.hash}
    if moe:
        info["moe"] = {"num_experts": num_experts, "top_k": top_k, "moe_intermediate_size": moe_intermediate_size}
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
    p.add_argument("--steps", type=int, default=470)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--min-digits", type=int, default=1)
    p.add_argument("--max-digits", type=int, default=2)
    p.add_argument("--ops", default="plus")
    p.add_argument("--family", default="llama", choices=FAMILIES)
    p.add_argument("--num-experts", type=int, default=8, help="qwen3_moe: routed experts per layer")
    p.add_argument("--top-k", type=int, default=2, help="qwen3_moe: experts per token")
    p.add_argument("--moe-intermediate-size", type=int, default=128, help="qwen3_moe: each expert's SwiGLU width")
    p.add_argument("--overwrite", action="store_true")
    a = p.parse_args(argv)
    if is_built(a.out) and not a.overwrite:
        raise MegarlError(f"--out {a.out}: already holds a tiny model ({MARKER}); pass --overwrite to rebuild")
    if os.path.exists(a.out) and not is_built(a.out) and os.listdir(a.out) and not a.overwrite:
        raise MegarlError(f"--out {a.out}: exists and is not a tiny model build; refusing to overwrite")
    if a.steps < 0 or a.batch < 1:
        raise MegarlError("--steps must be >= 0 and --batch >= 1")
    if a.family != "llama" and not 1 <= a.top_k <= a.num_experts:
        raise MegarlError(f"--top-k {a.top_k}: must be between 1 and --num-experts {a.num_experts}")
    print(f"building the tiny model in {a.out} (warm start: {a.steps} steps through the megatron actor)", flush=True)
    info = build(a.out, hidden_size=a.hidden_size, num_layers=a.num_layers, num_heads=a.num_heads,
                 num_kv_heads=a.num_kv_heads, intermediate_size=a.intermediate_size, steps=a.steps, lr=a.lr,
                 batch=a.batch, seed=a.seed, digits=(a.min_digits, a.max_digits), ops=tuple(a.ops.split(",")),
                 family=a.family, num_experts=a.num_experts, top_k=a.top_k,
                 moe_intermediate_size=a.moe_intermediate_size)
    print(f"tiny model ready in {a.out}: held-out greedy accuracy {info['heldout_accuracy_greedy']:.3f} "
          f"after {a.steps} warm-start steps ({info['seconds']:.0f}s)", flush=True)


if __name__ == "__main__":
    main()
