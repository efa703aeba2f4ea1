#!/usr/bin/env python
"""What one decode step costs as a function of the rows it computes: the number that decides
whether a long-tail batch's waiting costs anything.

    python bench/decode_rows.py                         # this machine's CPU, the long-tail recipe's model shape
    python bench/decode_rows.py --device cuda           # the same on a GPU
    python bench/decode_rows.py --hidden 2048 --layers 24 --heads 16 --kv-heads 8 --ffn 5632 --device cuda

A synchronous batch decodes until its longest response ends.  If a step costs in proportion to
its live rows (this CPU), a response that finished early costs nothing more once it leaves the
batch (``rollout.retire_finished``), so the tail's only cost is its own tokens and there is
little for overlap or partial rollouts to hide.  If a step costs about the same for 8 rows as for
256 (a GPU, memory-bound at these sizes), the steps after the short responses ended are paid in
full for a few rows: that idle engine is what partial rollouts and asynchronous training reclaim.

The model is a randomly initialised transformers Llama (the step's cost does not depend on the
weights), by default the shape of ``configs/grpo_rsum_tiny.yaml``'s model.  For each row count a
KV cache of ``--context`` tokens is built by a prefill, then ``--steps`` single-token decode
steps are timed (after ``--warmup`` untimed ones; median of ``--repeats``).  Printed: ms per step,
us per row-step, and the step's cost relative to the smallest row count; speed is this machine's,
printed, never asserted.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32, 64, 128, 256])
    p.add_argument("--context", type=int, default=96, help="tokens already in each row's KV cache")
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--ffn", type=int, default=256)
    p.add_argument("--vocab", type=int, default=64)
    p.add_argument("--json", default=None, help="also write the numbers here")
    a = p.parse_args()

    import torch
    from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    dtype = getattr(torch, a.dtype)
    cfg = LlamaConfig(vocab_size=a.vocab, hidden_size=a.hidden, num_hidden_layers=a.layers,
                      num_attention_heads=a.heads, num_key_value_heads=a.kv_heads, intermediate_size=a.ffn,
                      max_position_embeddings=a.context + a.warmup + a.steps + 8)
    model = LlamaForCausalLM(cfg).to(device=a.device, dtype=dtype).eval()

    def sync():
        if a.device.startswith("cuda"):
            torch.cuda.synchronize()

    rows_out = []
    with torch.no_grad():
        for n in a.rows:
            per_rep = []
            for _ in range(a.repeats):
                ids = torch.randint(0, a.vocab, (n, a.context), device=a.device)
                cache = DynamicCache(config=model.config)
                logits = model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1).logits
                pos = a.context
                tok = logits[:, -1].argmax(-1, keepdim=True)
                for _ in range(a.warmup):
                    tok = model(input_ids=tok, position_ids=torch.full((n, 1), pos, device=a.device),
                                past_key_values=cache, use_cache=True).logits[:, -1].argmax(-1, keepdim=True)
                    pos += 1
                sync()
                t0 = time.perf_counter()
                for _ in range(a.steps):
                    tok = model(input_ids=tok, position_ids=torch.full((n, 1), pos, device=a.device),
                                past_key_values=cache, use_cache=True).logits[:, -1].argmax(-1, keepdim=True)
                    pos += 1
                sync()
                per_rep.append((time.perf_counter() - t0) / a.steps)
            step_s = statistics.median(per_rep)
            rows_out.append({"rows": n, "ms_per_step": step_s * 1e3, "us_per_row_step": step_s * 1e6 / n})
    base = rows_out[0]["ms_per_step"]
    print(f"decode step cost by live rows: device {a.device}, {a.dtype}, hidden {a.hidden}, {a.layers} layers, "
          f"context {a.context}, threads {torch.get_num_threads()}")
    print(f"{'rows':>6} {'ms/step':>9} {'us/row-step':>12} {'x rows=' + str(rows_out[0]['rows']):>12}")
    for r in rows_out:
        r["relative"] = r["ms_per_step"] / base
        print(f"{r['rows']:>6} {r['ms_per_step']:>9.3f} {r['us_per_row_step']:>12.2f} {r['relative']:>12.2f}")
    # least squares of ms/step = floor + per_row x rows: what a step costs whatever its rows
    # (launches, Python, cache bookkeeping) and what each live row adds
    xs, ys = [r["rows"] for r in rows_out], [r["ms_per_step"] for r in rows_out]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    per_row = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / max(sum((x - mx) ** 2 for x in xs), 1e-12)
    floor = my - per_row * mx
    fit = {"floor_ms": floor, "per_row_ms": per_row,
           "break_even_rows": floor / per_row if per_row > 0 else float("inf")}
    print(f"fit: {floor:.3f} ms per step + {per_row * 1e3:.1f} us per live row; a step of "
          f"{fit['break_even_rows']:.0f} rows costs twice the floor.  Past that, a finished row that leaves the "
          f"batch saves about its share; below it, a batch decoding its few longest rows pays the floor per "
          f"step: the tail's cost")
    if a.json:
        rows_out = {"rows": rows_out, "fit": fit}
        with open(a.json, "w") as f:
            json.dump({"args": vars(a), **rows_out}, f, indent=2)


if __name__ == "__main__":
    main()
