#!/usr/bin/env python
"""The hf backend's two decodes on the long-tail mix: transformers' ``generate`` (every row runs
until the batch's longest ends) against the decode that retires finished rows
(``rollout.retire_finished``, megarl/rollout/hf_retiring.py).

    python -m megarl.tinymodel --task running_sum --out .cache/megarl/tiny_rsum_llama   # once
    python bench/retiring_decode.py --model .cache/megarl/tiny_rsum_llama [--prompts 64 --n 4 --repeats 3]

The batch is a training rollout's: ``--prompts`` held-out running-sum problems (the task's
evaluation draw, seed 1, its tail of chain lengths) x ``--n`` samples each at temperature 1, up
to ``--max-new-tokens``.  Both decodes sample the same candidates (per-row seeds), so the tokens
are the same work; printed per decode: seconds (median of ``--repeats``, after one warm-up
call), generated tokens per second, decode steps, rows computed over all steps (``row_steps``:
what the steps cost), the length mix (median, p99, max, mean / max), and how many candidates came
out token for token the same in both.  Speed is this machine's, printed, never asserted.
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


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", required=True, help="a running-sum tiny model (python -m megarl.tinymodel --task running_sum)")
    p.add_argument("--prompts", type=int, default=64)
    p.add_argument("--n", type=int, default=4)
    p.add_argument("--max-new-tokens", type=int, default=320)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--json", default=None, help="also write the numbers here")
    a = p.parse_args()

    import torch

    from megarl.commands.evaluate import load_engine
    from megarl.data.tasks.running_sum import make_problems
    from megarl.data.tokenizer import TokenizerContract
    from megarl.rollout.protocol import GenerationRequest, SamplingParams

    tok = TokenizerContract.from_pretrained(a.model)
    rows = make_problems("heldout", 1, a.prompts, distinct=True)
    requests = [GenerationRequest(r["id"], tuple(tok.encode_prompt([{"role": "user", "content": r["prompt"]}])))
                for r in rows]
    out, tokens_by_mode = {}, {}
    for mode in ("generate", "retiring"):
        engine = load_engine(a.model, tok, "cpu", retire_finished=mode == "retiring")
        engine.generate(requests[:4], SamplingParams(temperature=a.temperature, max_new_tokens=16, n=1, seed=0))
        secs, res = [], None
        for rep in range(a.repeats):
            sampling = SamplingParams(temperature=a.temperature, max_new_tokens=a.max_new_tokens, n=a.n, seed=100 + rep)
            t0 = time.perf_counter()
            res = engine.generate(requests, sampling)
            secs.append(time.perf_counter() - t0)
        lengths = sorted(len(r.response_ids) for r in res)
        work = engine.last_decode
        s = statistics.median(secs)
        out[mode] = {"seconds": s, "seconds_all": secs, "tokens": sum(lengths), "tokens_per_s": sum(lengths) / s,
                     "steps": work["steps"], "rows": work["rows"], "row_steps": work["row_steps"],
                     "length_median": lengths[len(lengths) // 2], "length_p99": lengths[int(0.99 * (len(lengths) - 1))],
                     "length_max": lengths[-1], "mean_over_max": sum(lengths) / len(lengths) / max(lengths[-1], 1)}
        tokens_by_mode[mode] = [r.response_ids for r in res]
    same = sum(x == y for x, y in zip(tokens_by_mode["generate"], tokens_by_mode["retiring"]))
    g, r = out["generate"], out["retiring"]
    print(f"model {a.model}, {a.prompts} prompts x n={a.n}, temperature {a.temperature}, up to {a.max_new_tokens} "
          f"new tokens, torch {torch.__version__}, {torch.get_num_threads()} threads")
    print(f"lengths: median {g['length_median']}, p99 {g['length_p99']}, max {g['length_max']}, "
          f"mean/max {g['mean_over_max']:.3f}")
    print(f"{'decode':10s} {'seconds':>8s} {'tokens/s':>9s} {'steps':>6s} {'row_steps':>10s}")
    for mode in ("generate", "retiring"):
        m = out[mode]
        print(f"{mode:10s} {m['seconds']:8.2f} {m['tokens_per_s']:9.0f} {m['steps']:6d} {m['row_steps']:10d}")
    print(f"retiring: {r['tokens_per_s'] / g['tokens_per_s']:.2f}x the tokens/s of generate, "
          f"{g['row_steps'] / max(r['row_steps'], 1):.2f}x fewer rows computed; {same} of {len(tokens_by_mode['generate'])} "
          "candidates token for token the same")
    out["same_candidates"], out["candidates"] = same, len(tokens_by_mode["generate"])
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
