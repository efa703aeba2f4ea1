#!/usr/bin/env python
"""Seconds and peak RSS to load and shard an HF checkpoint into megatron, per GB of weights.

    python bench/load_checkpoint.py [--size-gb 1.0] [--tps 1 2]

Writes a random Llama-shaped fp32 checkpoint of about ``--size-gb`` (2 safetensors shards),
then for each TP runs ``torchrun --nproc-per-node TP`` workers that build the model (no random
init) and load their slices.  Prints per-rank wall time and peak RSS above the post-import
baseline, normalised per GB of checkpoint.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def _rss_gb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024**2  # Linux: KiB


def make_checkpoint(out: str, size_gb: float) -> float:
    from megarl.builtin.tiny_checkpoint import write_random_hf_checkpoint

    hidden, ffn, vocab = 1024, 4096, 32000
    per_layer = 4 * hidden * hidden + 3 * hidden * ffn  # MHA + SwiGLU, fp32 below
    layers = max(1, int((size_gb * 1024**3 / 4 - 2 * vocab * hidden) // per_layer))
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": vocab,
           "hidden_size": hidden, "intermediate_size": ffn, "num_hidden_layers": layers,
           "num_attention_heads": 16, "num_key_value_heads": 16, "rms_norm_eps": 1e-5,
           "rope_theta": 10000.0, "max_position_embeddings": 4096, "tie_word_embeddings": False}
    return write_random_hf_checkpoint(out, cfg, max_shard_bytes=int(size_gb * 1024**3) // 2 + 1)


def worker(args) -> None:
    import torch.distributed as dist

    from megarl.models.megatron_ckpt import load_model
    from megarl.runtime import distributed as rt

    rt.initialize(tp=args.tp)
    base = _rss_gb()
    t0 = time.perf_counter()
    model = load_model(args.hf, tp=args.tp)
    dt = time.perf_counter() - t0
    shard_gb = sum(p.numel() * p.element_size() for p in model.parameters()) / 1024**3
    row = {"rank": dist.get_rank(), "seconds": dt, "peak_rss_gb": _rss_gb(), "rss_above_base_gb": _rss_gb() - base,
           "shard_gb": shard_gb}
    rows = [None] * dist.get_world_size()
    dist.all_gather_object(rows, row)
    if rt.is_main():
        with open(args.result, "w") as f:
            json.dump(rows, f)
    rt.shutdown()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size-gb", type=float, default=1.0)
    p.add_argument("--tps", type=int, nargs="+", default=[1, 2])
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--hf", help=argparse.SUPPRESS)
    p.add_argument("--tp", type=int, default=1, help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        return worker(args)
    with tempfile.TemporaryDirectory() as tmp:
        hf = os.path.join(tmp, "hf")
        t0 = time.perf_counter()
        gb = make_checkpoint(hf, args.size_gb)
        print(f"checkpoint: {gb:.2f} GB fp32, 2 shards, written in {time.perf_counter() - t0:.1f}s")
        print(f"{'tp':>3} {'rank':>4} {'load s':>8} {'s/GB':>7} {'peak RSS GB':>12} {'RSS over base GB':>17} "
              f"{'per GB ckpt':>12} {'shard GB':>9}")
        for tp in args.tps:
            result = os.path.join(tmp, f"tp{tp}.json")
            cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(tp),
                   os.path.abspath(__file__), "--worker", "--hf", hf, "--tp", str(tp), "--result", result]
            env = dict(os.environ, PYTHONWARNINGS="ignore")
            proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
            if proc.returncode != 0:
                sys.exit(f"tp={tp} failed:\n{proc.stderr[-3000:]}")
            with open(result) as f:
                for r in json.load(f):
                    print(f"{tp:>3} {r['rank']:>4} {r['seconds']:>8.2f} {r['seconds'] / gb:>7.2f} "
                          f"{r['peak_rss_gb']:>12.2f} {r['rss_above_base_gb']:>17.2f} "
                          f"{r['rss_above_base_gb'] / gb:>12.2f} {r['shard_gb']:>9.2f}")


if __name__ == "__main__":
    main()
