"""Forward-only passes padded vs packed (``algo.pack_sequences``), on the tiny Llama, one process.

    python bench/packing.py [--rows 128] [--prompt 8 32] [--response 1 64] [--mbs 16 0] [--repeats 5]

A batch in the experience layout (left-padded prompts, right-padded responses) with prompt and
response lengths drawn uniformly from the given ranges goes through ``response_log_probs`` (what
the actor's old log-probs and the reference run) padded (today's default: rows sorted by length,
each micro-batch cut to its longest row) and packed (the same micro-batches, each one THD
sequence).  On CPU the packed attention is ``cpu_layers.thd_core_attention``: "repad" (the
default), and with ``--block-mask`` also "block_mask" (one dense block-diagonal mask over the
pack).  Prints seconds per forward of the whole batch (median of ``--repeats`` rounds that alternate the layouts,
after one warm-up each), the median per-round speed-up, the token counts each layout computes, and
the largest |log-prob| difference from the padded forward.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import torch


def make_batch(rows: int, prompt: tuple, response: tuple, vocab: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    plen = torch.randint(prompt[0], prompt[1] + 1, (rows,), generator=g)
    rlen = torch.randint(response[0], response[1] + 1, (rows,), generator=g)
    P, R = prompt[1], response[1]
    pos = torch.arange(P + R)
    attn = ((pos >= (P - plen)[:, None]) & (pos < (P + rlen)[:, None])).long()
    prompt_ids = torch.randint(1, vocab, (rows, P), generator=g) * attn[:, :P]
    response_ids = torch.randint(1, vocab, (rows, R), generator=g) * attn[:, P:]
    return prompt_ids, response_ids, attn, plen, rlen


def alternating(fns: dict, repeats: int):
    """Median seconds of each function, run in alternation (one warm-up each, then ``repeats``
    rounds of all of them) so that load from other work on the machine hits them alike; also the
    median over rounds of each one's time relative to the first."""
    outs = {k: f() for k, f in fns.items()}
    times = {k: [] for k in fns}
    for _ in range(repeats):
        for k, f in fns.items():
            t0 = time.perf_counter()
            outs[k] = f()
            times[k].append(time.perf_counter() - t0)
    first = next(iter(fns))
    ratio = {k: statistics.median(a / b for a, b in zip(times[first], times[k])) for k in fns}
    return {k: statistics.median(v) for k, v in times.items()}, ratio, outs


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=128)
    ap.add_argument("--prompt", type=int, nargs=2, default=(8, 32), metavar=("MIN", "MAX"))
    ap.add_argument("--response", type=int, nargs=2, default=(1, 64), metavar=("MIN", "MAX"))
    ap.add_argument("--mbs", type=int, nargs="+", default=(16, 0),
                    help="forward micro-batch sizes (algo.forward_micro_batch_size; 0 = whole batch)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--block-mask", action="store_true",
                    help="also time cpu_layers' dense block-diagonal-mask attention (slow: t**2)")
    # the built-in tiny model's shape (megarl/tinymodel.py), random weights
    ap.add_argument("--hidden-size", type=int, default=128)
    ap.add_argument("--num-layers", type=int, default=4)
    ap.add_argument("--num-heads", type=int, default=4)
    ap.add_argument("--num-kv-heads", type=int, default=2)
    ap.add_argument("--intermediate-size", type=int, default=256)
    ap.add_argument("--vocab", type=int, default=32)
    a = ap.parse_args()

    from megarl.runtime import distributed as rt

    rt.initialize(tp=1, pp=1)
    from megarl.builtin.tiny_checkpoint import make_tiny_hf_checkpoint
    from megarl.models import cpu_layers
    from megarl.models.forward import response_log_probs
    from megarl.models.megatron_ckpt import load_model
    from megarl.runtime import cpu_compat

    with tempfile.TemporaryDirectory() as d:
        hf = make_tiny_hf_checkpoint(os.path.join(d, "llama"), "llama", seed=0, vocab_size=a.vocab,
                                     hidden_size=a.hidden_size, num_layers=a.num_layers, num_heads=a.num_heads,
                                     num_kv_heads=a.num_kv_heads, intermediate_size=a.intermediate_size)
        model = load_model(hf)
    p_ids, r_ids, attn, plen, rlen = make_batch(a.rows, tuple(a.prompt), tuple(a.response), a.vocab)
    lengths = plen + rlen
    real = int(lengths.sum())
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}, cpu={cpu_compat.on_cpu()}; "
          f"tiny llama hidden {a.hidden_size} x {a.num_layers} layers, {a.num_heads} heads / {a.num_kv_heads} KV; "
          f"{a.rows} rows, prompt {a.prompt[0]}-{a.prompt[1]}, response {a.response[0]}-{a.response[1]} tokens: "
          f"{real} real tokens, {a.rows * int(lengths.max())} at full padded width; median of {a.repeats}")
    impls = (("repad", "block_mask") if a.block_mask else ("repad",)) if cpu_compat.on_cpu() else ("thd",)
    order = torch.argsort(lengths, descending=True, stable=True)

    def packed(mbs, impl):
        def run():
            if impl != "thd":
                cpu_layers.THD_ATTENTION = impl
            try:
                return response_log_probs(model, p_ids, r_ids, attn, mbs, pack=True)
            finally:
                cpu_layers.THD_ATTENTION = "repad"
        return run

    for mbs in a.mbs:
        groups = order.split(mbs or a.rows)
        padded_tok = sum(len(g) * int(lengths[g].max()) for g in groups)
        fns = {"padded": lambda: response_log_probs(model, p_ids, r_ids, attn, mbs)}
        fns.update({impl: packed(mbs, impl) for impl in impls})
        secs, ratio, outs = alternating(fns, a.repeats)
        print(f"mbs={mbs or a.rows:4d} padded             {secs['padded'] * 1e3:8.1f} ms/forward  "
              f"({padded_tok} tokens computed, {real / padded_tok:.0%} real)")
        for impl in impls:
            diff = float((outs[impl] - outs["padded"]).abs().max())
            print(f"mbs={mbs or a.rows:4d} packed {impl:<11} {secs[impl] * 1e3:8.1f} ms/forward  "
                  f"({real} tokens, padded/packed time x{ratio[impl]:.2f})  max |log-prob diff| {diff:.3e}")
    rt.shutdown()


if __name__ == "__main__":
    main()
