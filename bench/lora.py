"""What LoRA (``actor.lora``) buys on one update of a ~0.3B model, on CPU, against full fine-tuning.

    python bench/lora.py [--out docs/perf/lora.json] [--rank 16] [--repeats 3]

Each setting runs in its own process (``torch.distributed.run``, one rank, gloo): it builds a
~0.3B-parameter Llama (hidden 1024, 24 layers, vocabulary 32,000; random weights: the numbers do
not depend on them), wraps it for training (megatron DDP, AdamW), runs one warm-up optimizer step
(the gradient buffers and the optimizer state are allocated then) and ``--repeats`` measured steps
on 4 rows of 256 tokens in micro-batches of 2.  Reported per setting:

* ``trainable``: parameters with a gradient; ``grad_bytes``: megatron DDP's gradient buffers
  (fp32); ``optimizer_bytes``: the optimizer's state tensors (AdamW's two moments; fp32 weights
  need no main copy);
* ``update_s``: the median measured step (forward, backward, optimizer);
* ``changed_bytes``: the bytes of the HF tensors whose content one step changed (the weight
  stream read before and after a step, compared tensor by tensor) -- what a LoRA actor sends the
  hf engine after its first load (the adapted linears' merged weights);
  ``stream_bytes``: every tensor, what a whole load sends.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODEL = dict(vocab_size=32000, hidden_size=1024, num_layers=24, num_heads=16, num_kv_heads=8,
             intermediate_size=2816, max_position_embeddings=2048)


def _worker(args) -> None:
    import torch

    from megarl.config import OptimSettings
    from megarl.models.vocab_parallel import token_log_probs_from_logits
    from megarl.models.lora import LoraSpec, apply_lora, trainable_parameters
    from megarl.models.megatron_ckpt import load_model
    from megarl.models.optim import train_step, wrap_for_training
    from megarl.models.weights import iter_hf_tensors, unwrap
    from megarl.runtime import distributed as rt

    rt.initialize(tp=1, pp=1)
    torch.manual_seed(0)
    model = load_model(args.hf)
    if args.rank:
        apply_lora(model, LoraSpec(rank=args.rank, alpha=2.0 * args.rank, dropout=0.0,
                                   targets=("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")))
    trainable = sum(p.numel() for p in trainable_parameters(model))
    ddp, opt = wrap_for_training(model, OptimSettings(optimizer="adam", lr=1e-4, clip_grad=1.0))
    V = unwrap(ddp).megarl_spec.vocab_size
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, V, (4, 256), generator=g)
    mask = torch.ones(4, 255)
    micro = [{"tokens": tokens[i:i + 2], "loss_mask": mask[i:i + 2]} for i in (0, 2)]

    def loss_fn(output, mb):
        lp = token_log_probs_from_logits(output[:, :-1], mb["tokens"][:, 1:], V)
        loss = -(lp * mb["loss_mask"]).sum() / mask.sum()
        return loss, {"loss": loss.detach()}

    train_step(ddp, opt, micro, loss_fn)  # warm-up: buffers and optimizer state allocated
    grad_bytes = sum(b.grad_data.numel() * b.grad_data.element_size() for b in ddp.buffers)
    inner = getattr(opt, "optimizer", opt)
    optimizer_bytes = sum(t.numel() * t.element_size() for s in inner.state.values() for t in s.values()
                          if torch.is_tensor(t) and t.dim() > 0)
    before = {k: v.clone() for k, v in iter_hf_tensors(ddp)}
    seconds = []
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        train_step(ddp, opt, micro, loss_fn)
        seconds.append(time.perf_counter() - t0)
    after = dict(iter_hf_tensors(ddp))
    changed = sum(t.numel() * t.element_size() for k, t in after.items() if not torch.equal(t, before[k]))
    total = sum(t.numel() * t.element_size() for t in after.values())
    out = {"rank": args.rank, "parameters": sum(t.numel() for t in after.values()), "trainable": trainable,
           "grad_bytes": grad_bytes, "optimizer_bytes": optimizer_bytes, "update_s": statistics.median(seconds),
           "changed_bytes": changed, "stream_bytes": total}
    with open(args.result, "w") as f:
        json.dump(out, f)
    rt.shutdown()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=None)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--hf", help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        return _worker(args)
    from megarl.builtin.tiny_checkpoint import make_tiny_hf_checkpoint

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        hf = make_tiny_hf_checkpoint(os.path.join(tmp, "llama"), "llama", seed=0, **MODEL)
        for rank in (0, args.rank):
            result = os.path.join(tmp, f"r{rank}.json")
            cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "1", "--master-addr",
                   "127.0.0.1", "--master-port", str(_free_port()), os.path.abspath(__file__), "--worker",
                   "--hf", hf, "--rank", str(rank), "--repeats", str(args.repeats), "--result", result]
            subprocess.run(cmd, check=True, env=dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="2"))
            rows.append(json.load(open(result)))
            r = rows[-1]
            print(f"{'full' if not rank else f'lora r={rank}':<10} trainable {r['trainable'] / 1e6:8.2f} M  "
                  f"grads {r['grad_bytes'] / 2**20:8.1f} MiB  optimizer {r['optimizer_bytes'] / 2**20:8.1f} MiB  "
                  f"update {r['update_s']:6.2f} s  changed by a step {r['changed_bytes'] / 2**20:8.1f} MiB of "
                  f"{r['stream_bytes'] / 2**20:.1f} MiB streamed", flush=True)
    full, lora = rows
    summary = {"memory_ratio": (full["grad_bytes"] + full["optimizer_bytes"]) / (lora["grad_bytes"] + lora["optimizer_bytes"]),
               "trainable_ratio": full["trainable"] / lora["trainable"], "update_speedup": full["update_s"] / lora["update_s"],
               "changed_share": lora["changed_bytes"] / lora["stream_bytes"]}
    print(f"gradients + optimizer {summary['memory_ratio']:.0f}x smaller, {summary['trainable_ratio']:.0f}x fewer "
          f"trainable parameters, update {summary['update_speedup']:.2f}x; a step changes "
          f"{100 * summary['changed_share']:.0f}% of the streamed bytes")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"model": MODEL, "rows": rows, "summary": summary,
                       "command": f"python bench/lora.py --rank {args.rank} --repeats {args.repeats}"}, f, indent=2)


if __name__ == "__main__":
    main()
