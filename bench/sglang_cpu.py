"""SGLang's CPU engine against the hf backend on the tiny model: engine start, weight load, tokens/s.

    PYTHONPATH=$PWD "$(tools/sglang_env.sh)" bench/sglang_cpu.py [--new-tokens 32] [--batches 1 128] [--json F]

Both engines sit behind megarl's RolloutEngine protocol and get the same weights through megarl's
stream (a random tiny Llama of the embedded default's shape: hidden 128, 4 layers, fp32); EOS is
disabled so every row produces exactly ``--new-tokens`` tokens.  Batch 1 and the GRPO recipe's
batch (16 prompts x 8 samples = 128 rows), sampling at T=1.  Runs in the SGLang environment
(``tools/sglang_env.sh``); ``megarl.rollout.sglang_cpu`` supplies what SGLang needs without CUDA.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 128], help="rows per generate call")
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()

    from megarl.rollout import sglang_cpu

    sglang_cpu.prepare()
    import torch

    from megarl.rollout.hf_backend import HFRolloutEngine
    from megarl.rollout.protocol import GenerationRequest, SamplingParams
    from megarl.rollout.sglang_backend import SGLangRolloutEngine
    from megarl.rollout.weight_stream import iter_buckets
    from megarl.builtin.hf_actor import HFActorStandIn, tiny_llama_config

    config = tiny_llama_config(vocab_size=64, hidden=128, layers=4, eos_token_id=None, bos_token_id=None,
                               intermediate_size=256, architectures=["LlamaForCausalLM"])
    actor = HFActorStandIn.create(config, dtype=torch.float32)
    rows = []
    with tempfile.TemporaryDirectory() as d:
        actor.export_config(d)
        for name in ("hf", "sglang"):
            t0 = time.perf_counter()
            if name == "hf":
                engine = HFRolloutEngine(d, eos_token_ids=())
            else:
                engine = SGLangRolloutEngine(d, eos_token_ids=(), dtype="float32", device="cpu",
                                             engine_kwargs=sglang_cpu.engine_kwargs(8192))
            start = time.perf_counter() - t0
            version, manifest = actor.commit(0)
            t0 = time.perf_counter()
            engine.load_weights(version, iter_buckets(actor.named_tensors(), 1 << 20), manifest)
            engine.activate(version)
            load = time.perf_counter() - t0
            for batch in a.batches:
                g = torch.Generator().manual_seed(batch)
                prompts = [GenerationRequest(f"b{i}", tuple(int(x) for x in torch.randint(4, 64, (a.prompt_len,), generator=g)))
                           for i in range(batch)]
                sampling = SamplingParams(temperature=1.0, max_new_tokens=a.new_tokens)
                engine.generate(prompts[:1], sampling)  # warm-up
                best = float("inf")
                for _ in range(a.repeats):
                    t0 = time.perf_counter()
                    out = engine.generate(prompts, sampling)
                    best = min(best, time.perf_counter() - t0)
                tokens = sum(len(r.response_ids) for r in out)
                assert tokens == batch * a.new_tokens, (tokens, batch, a.new_tokens)
                row = {"engine": name, "batch": batch, "new_tokens": a.new_tokens, "tokens_per_s": tokens / best,
                       "generate_s": best, "start_s": start, "load_s": load}
                rows.append(row)
                print(f"{name:7s} batch {batch:4d}: {tokens / best:9.0f} tokens/s ({best:.3f} s for {tokens} tokens); "
                      f"start {start:.1f} s, load {load:.2f} s", flush=True)
            if name == "sglang":
                engine.shutdown()
    for batch in a.batches:
        hf = next(r for r in rows if r["engine"] == "hf" and r["batch"] == batch)
        sg = next(r for r in rows if r["engine"] == "sglang" and r["batch"] == batch)
        print(f"batch {batch}: sglang / hf = {sg['tokens_per_s'] / hf['tokens_per_s']:.2f}x")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"rows": rows, "threads": os.environ.get("OMP_NUM_THREADS")}, f, indent=1)


if __name__ == "__main__":
    main()
