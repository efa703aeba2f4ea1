"""Weight-sync bandwidth and hf-backend protocol overhead, on CPU.

    python bench/weight_sync.py                # tiny + ~1B sync, tokens/s comparison
    python bench/weight_sync.py --skip-1b      # without the ~1B model (needs ~16 GB RAM)

1. Full sync GB/s = logical bytes / (actor manifest at commit + gathered bucketed stream out of
   the megatron actor + engine staging copy + receiver manifest check + activation).  The actor
   is megatron-core at TP=1 in fp32 (the CPU path); ~1B fp32 needs ~16 GB RAM (actor + the
   engine's two buffers).
2. Tokens/s of HFRolloutEngine.generate vs plain ``model.generate(do_sample=True)`` on the
   same model, batch and sampling (EOS disabled so both produce exactly the same number of
   tokens).  The issue's target: the protocol costs < 5%.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


from megarl.rollout.hf_backend import HFRolloutEngine  # noqa: E402
from megarl.rollout.protocol import GenerationRequest, SamplingParams  # noqa: E402
from megarl.rollout.weight_stream import iter_buckets  # noqa: E402
from bench.shapes import ONE_B, llama  # noqa: E402
from megarl.builtin.hf_actor import HFActorStandIn, tiny_llama_config  # noqa: E402


NO_TOKENIZER = "sha256:" + "0" * 64  # the bench has no tokenizer


def bench_sync(name, hf_config: dict, bucket_bytes, repeats):
    """A full hybrid-engine sync from a megatron actor (TP=1 world of 1, fp32 on CPU): actor
    manifest at commit + gathered stream in buckets + engine staging copy + receiver manifest
    check + activation."""
    from megarl.builtin.tiny_checkpoint import write_random_hf_checkpoint
    from megarl.models.megatron_ckpt import load_model
    from megarl.rollout.weight_sync import actor_manifest, make_version, sync_actor_to_engine

    with tempfile.TemporaryDirectory() as d:
        write_random_hf_checkpoint(d, hf_config)
        actor = load_model(d)
        engine = HFRolloutEngine(d, dtype=torch.float32)
        best, all_s = None, []
        for i in range(repeats):
            t0 = time.perf_counter()
            manifest = actor_manifest(actor)  # at commit: the version's weight hash
            t1 = time.perf_counter()
            version = make_version(actor, manifest, "bench", i, NO_TOKENIZER)
            report = sync_actor_to_engine(actor, engine, version, manifest, bucket_bytes)
            engine.activate(version)
            t2 = time.perf_counter()
            row = (t2 - t0, t1 - t0, t2 - t1, report)
            all_s.append(t2 - t0)
            best = row if best is None or row[0] < best[0] else best
        total, t_send, t_recv, report = best
        gb = report.num_bytes / 1e9
        print(
            f"[sync] {name}: {report.num_tensors} tensors, {gb:.3f} GB (fp32), bucket {bucket_bytes >> 20} MiB, "
            f"{report.num_buckets} buckets: full sync {total:.3f} s = {gb / total:.2f} GB/s "
            f"(actor manifest {t_send:.3f} s, gather+transfer+stage+verify+activate {t_recv:.3f} s "
            f"= {gb / t_recv:.2f} GB/s); every sync: {', '.join(f'{x:.2f}' for x in all_s)} s (the first two "
            f"write the engine's two buffers for the first time: page faults)", flush=True
        )
        del engine, actor


def bench_tokens(repeats, batch, prompt_len, new_tokens):
    config = tiny_llama_config(vocab_size=8000, hidden=1024, layers=6, eos_token_id=None, bos_token_id=None,
                               pad_token_id=0, num_attention_heads=16, num_key_value_heads=16)
    actor = HFActorStandIn.create(config)
    g = torch.Generator().manual_seed(1)
    prompts = torch.randint(1, 8000, (batch, prompt_len), generator=g)
    requests = [GenerationRequest(f"r{i}", tuple(prompts[i].tolist())) for i in range(batch)]
    sampling = SamplingParams(temperature=0.7, top_p=0.9, max_new_tokens=new_tokens, seed=0)
    with tempfile.TemporaryDirectory() as d:
        engine = HFRolloutEngine(actor.export_config(d), eos_token_ids=())
        version, manifest = actor.commit(0)
        engine.load_weights(version, iter_buckets(actor.named_tensors(), 64 << 20), manifest)
        engine.activate(version)

        def plain():
            with torch.no_grad():
                out = actor.model.generate(
                    input_ids=prompts, attention_mask=torch.ones_like(prompts), do_sample=True,
                    temperature=0.7, top_p=0.9, max_new_tokens=new_tokens, pad_token_id=0,
                    top_k=0,  # transformers defaults to top_k=50; the protocol run has no top-k
                )
            return out.shape[1] - prompt_len

        def protocol():
            res = engine.generate(requests, sampling)
            assert all(len(r.response_ids) == new_tokens for r in res)
            return new_tokens

        plain(), protocol()  # warm up
        # CPU time of this process next to wall time: on a shared machine other processes'
        # load swings wall time by several x between runs, CPU time much less
        wall = {"plain": [], "protocol": []}
        cpu = {"plain": [], "protocol": []}
        for _ in range(repeats):
            for label, fn in (("plain", plain), ("protocol", protocol)):
                t0, c0 = time.perf_counter(), time.process_time()
                n = fn()
                wall[label].append(time.perf_counter() - t0)
                cpu[label].append(time.process_time() - c0)
                assert n == new_tokens
        for name, times in (("wall", wall), ("cpu", cpu)):
            tps = {k: batch * new_tokens / sorted(v)[len(v) // 2] for k, v in times.items()}
            overhead = 100.0 * (tps["plain"] / tps["protocol"] - 1.0)
            print(
                f"[tokens/s {name}] hidden 1024 x 6 layers, vocab 8000, batch {batch}, prompt {prompt_len}, "
                f"{new_tokens} new, T=0.7 top_p=0.9, {torch.get_num_threads()} thread(s), median of {repeats}: "
                f"plain generate {tps['plain']:.1f} tok/s, hf backend {tps['protocol']:.1f} tok/s, "
                f"protocol overhead {overhead:+.1f}% (target < 5%)"
            )


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--skip-1b", action="store_true")
    ap.add_argument("--bucket-mib", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--only-tokens", action="store_true")
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads (1: robust on shared CPUs)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    if args.only_tokens:
        return bench_tokens(args.repeats, batch=8, prompt_len=16, new_tokens=64)
    from megarl.runtime import distributed as rt

    rt.initialize(tp=1, pp=1)
    bench_sync("tiny (hidden 64, 2 layers, vocab 320)", llama(320, 64, 2, 128, 4, 2), 1 << 20, args.repeats)
    if not args.skip_1b:
        bench_sync("~1B random Llama", ONE_B, args.bucket_mib << 20, 3)  # the 3rd is the steady state
    bench_tokens(args.repeats, batch=8, prompt_len=16, new_tokens=64)


if __name__ == "__main__":
    main()
