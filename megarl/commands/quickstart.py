"""The model layer end to end on CPU, as a newcomer's first command.

    python -m megarl.quickstart [--config configs/quickstart_tiny.yaml] [key=value ...]

1. builds the built-in tokenizer and a tiny random HF checkpoint (``transformers``);
2. converts it to a megatron dist checkpoint at TP=2 under ``torchrun`` (gloo);
3. scores the chat-templated prompts with ``tools/score.py`` at TP=2 and checks the log-probs
   against ``transformers``;
4. exports the megatron checkpoint back to HF at TP=1 and checks it is bitwise equal.

Each step prints what it did; any mismatch exits non-zero.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

from megarl.errors import MegarlError, cli_main

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DEFAULT_CONFIG = os.path.join(ROOT, "configs", "quickstart_tiny.yaml")


class QuickstartFailure(MegarlError):
    pass


def _run(cmd, what: str, nproc: int = 1) -> float:
    t0 = time.time()
    if nproc > 1:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
               "--master-addr", "127.0.0.1", "--master-port", str(_free_port())] + cmd
    else:
        cmd = [sys.executable] + cmd
    env = dict(os.environ, PYTHONWARNINGS="ignore", OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    proc = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if proc.returncode != 0:
        sys.stdout.write(proc.stdout[-4000:])
        raise QuickstartFailure(f"step '{what}' failed (exit {proc.returncode}): {' '.join(cmd)}")
    dt = time.time() - t0
    print(f"  [{what}] done in {dt:.1f}s", flush=True)
    return dt


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@cli_main
def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default=DEFAULT_CONFIG)
    p.add_argument("overrides", nargs="*", help="key=value overrides (omegaconf dotlist)")
    args = p.parse_args(argv)

    from omegaconf import OmegaConf

    if not os.path.isfile(args.config):
        raise QuickstartFailure(f"{args.config}: config file not found")
    cfg = OmegaConf.merge(OmegaConf.load(args.config), OmegaConf.from_dotlist(args.overrides))
    import torch
    from safetensors.torch import load_file

    from megarl.builtin.tiny_checkpoint import make_tiny_hf_checkpoint
    from megarl.builtin.tiny_tokenizer import build_tiny_tokenizer

    out = os.path.abspath(cfg.out_dir)
    hf, meg, back = (os.path.join(out, d) for d in ("hf", "megatron", "hf_export"))
    tools = os.path.join(ROOT, "tools")
    tp, pp = int(cfg.tp), int(cfg.pp)
    print(f"megarl quickstart: {cfg.family} tiny model, TP={tp} PP={pp}, output in {out}", flush=True)

    print("1/4 tokenizer + tiny random HF checkpoint", flush=True)
    tok = build_tiny_tokenizer(os.path.join(out, "tokenizer"))
    m = cfg.model
    if len(tok) > m.vocab_size:
        raise QuickstartFailure(f"model.vocab_size={m.vocab_size} is smaller than the tokenizer ({len(tok)})")
    make_tiny_hf_checkpoint(hf, cfg.family, seed=int(cfg.seed), vocab_size=int(m.vocab_size),
                            hidden_size=int(m.hidden_size), num_layers=int(m.num_layers),
                            num_heads=int(m.num_heads), num_kv_heads=int(m.num_kv_heads),
                            intermediate_size=int(m.intermediate_size),
                            tokenizer_dir=os.path.join(out, "tokenizer"))

    print(f"2/4 HF -> megatron dist checkpoint at TP={tp} PP={pp} (torchrun x{tp * pp})", flush=True)
    _run([os.path.join(tools, "convert_checkpoint.py"), "hf-to-megatron", "--hf", hf, "--out", meg,
          "--tp", str(tp), "--pp", str(pp), "--overwrite"], "convert", nproc=tp * pp)

    print(f"3/4 score chat-templated prompts at TP={tp} PP={pp}", flush=True)
    seqs = [tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                    tokenize=True, return_dict=False) for q in cfg.prompts]
    seqs = [list(s["input_ids"]) if isinstance(s, dict) else list(s) for s in seqs]
    inp, scored = os.path.join(out, "prompts.jsonl"), os.path.join(out, "scores.jsonl")
    with open(inp, "w") as f:
        for s in seqs:
            f.write(json.dumps({"token_ids": s}) + "\n")
    _run([os.path.join(tools, "score.py"), "--model", meg, "--input", inp, "--out", scored,
          "--tp", str(tp), "--pp", str(pp)], "score", nproc=tp * pp)
    import transformers

    ref = transformers.AutoModelForCausalLM.from_pretrained(hf).eval()
    worst = 0.0
    with open(scored) as f:
        got = [json.loads(line)["token_logprobs"] for line in f]
    for s, g in zip(seqs, got, strict=True):
        t = torch.tensor([s])
        with torch.no_grad():
            lp = torch.log_softmax(ref(t).logits.float(), -1)[0, :-1].gather(-1, t[0, 1:, None])[:, 0]
        worst = max(worst, (torch.tensor(g) - lp).abs().max().item())
    print(f"  {len(seqs)} prompts, {sum(len(s) - 1 for s in seqs)} tokens scored; "
          f"max |megatron - transformers| log-prob = {worst:.2e}", flush=True)
    if worst > float(cfg.tolerance):
        raise QuickstartFailure(f"log-prob mismatch {worst:.2e} > tolerance {cfg.tolerance}")

    print("4/4 megatron -> HF export at TP=1 (reshard on load)", flush=True)
    _run([os.path.join(tools, "convert_checkpoint.py"), "megatron-to-hf", "--megatron", meg,
          "--out", back, "--overwrite"], "export")
    a, b = load_file(os.path.join(hf, "model.safetensors")), load_file(os.path.join(back, "model.safetensors"))
    same = set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)
    if not same:
        raise QuickstartFailure(f"export {back} is not bitwise equal to {hf}")
    print(f"  {len(a)} tensors bitwise equal to the source checkpoint", flush=True)
    print("quickstart OK", flush=True)


if __name__ == "__main__":
    main()
