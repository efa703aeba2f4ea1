#!/usr/bin/env python
"""What one decode step costs as a function of the rows it computes: the number that decides
whether a long-tail batch's wait on its longest responses costs anything.

    python bench/decode_rows.py                         # this machine's CPU, the long-tail recipe's model shape
    python bench/decode_rows.py --device cuda --dtype bfloat16
    python bench/decode_rows.py --device cuda --shape hidden_size=2048 num_layers=24 num_heads=16 intermediate_size=5632

A step's cost is fitted as a floor (what a step costs whatever its rows: launches, Python, cache
bookkeeping) plus a cost per live row.  Past the rows where the two are equal, a finished row that
leaves the batch (``rollout.retire_finished``) saves about its share; below them, a batch decoding
its few longest responses pays the floor on every step: that is what a long tail still costs, and
what partial rollouts and asynchronous training can reclaim.  On this project's CPU the floor
equals about 14-20 rows (docs/performance.md); the ``--device cuda`` path has not run here (no GPU).

The model is a randomly initialised Llama (``tiny_hf_config``; a step's cost does not depend on
the weights) of the shape of ``--recipe``'s ``model.tiny``, ``--shape`` overriding.  For each row
count a KV cache of ``--context`` tokens is built by a prefill, then ``--steps`` single-token
decode steps are timed (after ``--warmup`` untimed ones; median of ``--repeats``).  Printed: ms
per step, us per row-step, the step's cost relative to the smallest row count, and the fit; speed
is this machine's, printed, never asserted.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
SHAPE_KEYS = ("hidden_size", "num_layers", "num_heads", "num_kv_heads", "intermediate_size")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32, 64, 128, 256])
    p.add_argument("--context", type=int, default=96, help="tokens already in each row's KV cache")
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--recipe", default=os.path.join(ROOT, "configs", "grpo_rsum_tiny.yaml"),
                   help="the model shape: this recipe's model.tiny")
    p.add_argument("--shape", nargs="*", default=[], metavar="KEY=VALUE", help=f"override the shape: {SHAPE_KEYS}")
    p.add_argument("--vocab", type=int, default=64)
    p.add_argument("--json", default=None, help="also write the numbers here")
    a = p.parse_args()

    import torch
    from transformers import DynamicCache, LlamaForCausalLM

    from megarl.builtin.tiny_checkpoint import tiny_hf_config
    from megarl.config import merge_config

    shape = {k: merge_config(a.recipe).model.tiny[k] for k in SHAPE_KEYS}  # its base's keys included
    for kv in a.shape:
        key, _, value = kv.partition("=")
        if key not in SHAPE_KEYS or not value.isdigit():
            raise SystemExit(f"--shape {kv!r}: expected KEY=INTEGER with KEY one of {SHAPE_KEYS}")
        shape[key] = int(value)
    torch.manual_seed(0)
    cfg = tiny_hf_config("llama", vocab_size=a.vocab, max_position_embeddings=a.context + a.warmup + a.steps + 8,
                         **shape)
    model = LlamaForCausalLM(cfg).to(device=a.device, dtype=getattr(torch, a.dtype)).eval()

    def sync():
        if a.device.startswith("cuda"):
            torch.cuda.synchronize()

    def decode(tok, cache, pos: int, steps: int):
        for i in range(steps):
            tok = model(input_ids=tok, position_ids=torch.full((len(tok), 1), pos + i, device=a.device),
                        past_key_values=cache, use_cache=True).logits[:, -1].argmax(-1, keepdim=True)
        return tok

    rows_out = []
    with torch.no_grad():
        for n in a.rows:
            per_rep = []
            for _ in range(a.repeats):
                ids = torch.randint(0, a.vocab, (n, a.context), device=a.device)
                cache = DynamicCache(config=model.config)
                logits = model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1).logits
                tok = decode(logits[:, -1].argmax(-1, keepdim=True), cache, a.context, a.warmup)
                sync()
                t0 = time.perf_counter()
                decode(tok, cache, a.context + a.warmup, a.steps)
                sync()
                per_rep.append((time.perf_counter() - t0) / a.steps)
            step_s = statistics.median(per_rep)
            rows_out.append({"rows": n, "ms_per_step": step_s * 1e3, "us_per_row_step": step_s * 1e6 / n})
    base = rows_out[0]["ms_per_step"]
    print(f"decode step cost by live rows: device {a.device}, {a.dtype}, {shape}, "
          f"context {a.context}, threads {torch.get_num_threads()}")
    print(f"{'rows':>6} {'ms/step':>9} {'us/row-step':>12} {'x rows=' + str(rows_out[0]['rows']):>12}")
    for r in rows_out:
        r["relative"] = r["ms_per_step"] / base
        print(f"{r['rows']:>6} {r['ms_per_step']:>9.3f} {r['us_per_row_step']:>12.2f} {r['relative']:>12.2f}")
    # ms/step = floor + per_row x rows (least squares)
    per_row, floor = statistics.linear_regression([r["rows"] for r in rows_out], [r["ms_per_step"] for r in rows_out])
    fit = {"floor_ms": floor, "per_row_ms": per_row,
           "break_even_rows": floor / per_row if per_row > 0 else float("inf")}
    print(f"fit: {floor:.3f} ms per step + {per_row * 1e3:.1f} us per live row; a step of "
          f"{fit['break_even_rows']:.0f} rows costs twice the floor.  Past that, a finished row that leaves the "
          f"batch saves about its share; below it, a batch decoding its few longest rows pays the floor per "
          f"step: the tail's cost")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"args": vars(a), "shape": shape, "rows": rows_out, "fit": fit}, f, indent=2)


if __name__ == "__main__":
    main()
