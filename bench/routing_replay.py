"""Rollout routing replay on an MoE model: the rollout / trainer mismatch with replay off vs on.

    python bench/routing_replay.py [--model HF_MOE_DIR] [--data FILE.jsonl] [--rollout-dtype bfloat16]
                                   [--prompts 32] [--n 4] [--max-new-tokens 16] [--repeats 3]

The rollout is the hf engine serving the checkpoint's weights in ``--rollout-dtype`` (bf16: a
deliberately different precision from the fp32 trainer, as a bf16 inference engine is next to
an fp32-master trainer); it samples ``--n`` responses per prompt and records the experts every
token was dispatched to.  The trainer is the megatron model of the same checkpoint in fp32.
Prompts: the ``prompt`` field of ``--data`` rows encoded with the model's tokenizer and chat
template, else random token ids.  Without ``--model`` a random tiny Qwen3-MoE is built.

Prints, replay off vs on:
* the routing mismatch: the share of recorded tokens whose top-k set differs between rollout and
  trainer in at least one MoE layer, per layer, and the share the trainer dispatched differently
  from the record (0 under replay);
* the rollout-vs-trainer log-prob gap over response tokens: mean k3 KL estimate
  (``exp(d) - 1 - d``, d = trainer - rollout; Schulman 2020), mean and max ``|d|``;
* the trainer's forward seconds (median of ``--repeats``), replay off vs on.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def prompts_from(args, vocab: int):
    from megarl.rollout.protocol import GenerationRequest

    if args.data:
        from megarl.data.tokenizer import TokenizerContract

        contract = TokenizerContract.from_pretrained(args.model)
        rows = [json.loads(line) for line in open(args.data) if line.strip()][: args.prompts]
        out = []
        for i, row in enumerate(rows):
            text = row["prompt"]
            ids = contract.encode_prompt([{"role": "user", "content": text}] if contract.chat_template else text)
            out.append(GenerationRequest(f"p{i}", tuple(int(t) for t in ids)))
        return out
    g = torch.Generator().manual_seed(0)
    return [GenerationRequest(f"p{i}", tuple(int(t) for t in torch.randint(
        4, vocab - 1, (int(torch.randint(4, 24, (1,), generator=g)),), generator=g))) for i in range(args.prompts)]


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="an HF MoE checkpoint (default: a random tiny Qwen3-MoE)")
    ap.add_argument("--data", default=None, help="JSONL with a prompt field (needs --model with a tokenizer)")
    ap.add_argument("--rollout-dtype", default="bfloat16", choices=("bfloat16", "float32"))
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--n", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=16)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")

    from transformers import AutoModelForCausalLM

    from megarl.builtin.tiny_checkpoint import make_tiny_hf_checkpoint
    from megarl.control.batch import collate
    from megarl.models.forward import response_log_probs
    from megarl.models.megatron_ckpt import load_model
    from megarl.models.router_replay import RecordRouting, RoutingStats
    from megarl.rollout.hf_backend import HFRolloutEngine
    from megarl.rollout.protocol import SamplingParams
    from megarl.rollout.weight_stream import TensorManifest, hf_logical_tensors, iter_buckets
    from megarl.runtime import distributed as rt
    from megarl.versions import PolicyVersion

    rt.initialize(tp=1, pp=1)
    if args.model is None:
        args.model = make_tiny_hf_checkpoint(os.path.join(tempfile.mkdtemp(), "q3moe"), "qwen3_moe", seed=11,
                                             hidden_size=64, intermediate_size=128, num_layers=4, num_experts=8,
                                             vocab_size=300, initializer_range=0.3)
    dtype = getattr(torch, args.rollout_dtype)
    src = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    tensors = [(n, t.to(dtype)) for n, t in hf_logical_tensors(src)]
    manifest = TensorManifest.from_named_tensors(tensors)
    version = PolicyVersion(run_id="bench", optimizer_step=0, update_attempt=0, weight_manifest_hash=manifest.global_hash,
                            tokenizer_hash="sha256:" + "0" * 64, model_config_hash="sha256:" + "1" * 64)
    engine = HFRolloutEngine(args.model, dtype=dtype)
    engine.load_weights(version, iter_buckets(iter(tensors), 1 << 24), manifest)
    engine.activate(version)
    requests = prompts_from(args, src.config.vocab_size)
    sampling = SamplingParams(temperature=args.temperature, max_new_tokens=args.max_new_tokens, n=args.n, seed=7,
                              return_routed_experts=True)
    t0 = time.perf_counter()
    res = engine.generate(requests, sampling)
    gen_s = time.perf_counter() - t0
    c = collate([r.prompt_ids for r in res], [r.response_ids for r in res], [r.raw_log_probs for r in res],
                engine.pad_token_id, routing=[r.routed_experts for r in res], version=version.short_id)
    model = load_model(args.model)
    keep = c.response_mask.bool()
    print(f"model {args.model}: {len(c.routed_experts.moe_layers)} MoE layers, {c.routed_experts.num_experts} experts, "
          f"top-{c.routed_experts.top_k}; rollout {args.rollout_dtype}, trainer float32; "
          f"{len(res)} samples, {int(keep.sum())} response tokens (generation {gen_s:.2f} s)")
    for replay in (False, True):
        times = []
        for _ in range(args.repeats):
            stats = RoutingStats(c.routed_experts.moe_layers)
            t0 = time.perf_counter()
            lp = response_log_probs(model, c.prompt_ids, c.response_ids, c.attention_mask, 0,
                                    routing=RecordRouting(c.routed_experts.experts, c.routed_experts.moe_layers,
                                                          replay=replay, stats=stats))
            times.append(time.perf_counter() - t0)
        m = stats.reduce()
        d = (lp - c.rollout_log_probs)[keep]
        k3 = float((torch.exp(d) - 1 - d).mean())
        layers = " ".join(f"L{i}={m[f'mismatch_layer/{i}']:.3f}" for i in c.routed_experts.moe_layers)
        print(f"replay {'on ' if replay else 'off'}: routing mismatch tokens {m['mismatch_tokens']:.4f} "
              f"(per layer {layers}); dispatched != record {m['replay_differs']:.4f}; "
              f"log-prob k3 {k3:.3e}, mean |d| {float(d.abs().mean()):.3e}, max |d| {float(d.abs().max()):.3e}; "
              f"forward {statistics.median(times):.3f} s (with the mismatch measure)")


if __name__ == "__main__":
    main()
