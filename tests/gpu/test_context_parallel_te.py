"""The context-parallel GPU check (issue 31): transformer-engine's CP attention under megarl's plumbing.

    bash tests/gpu/run.sh                                   # runs this last (2 GPUs; SKIP with one)
    torchrun --nproc-per-node 2 tests/gpu/test_context_parallel_te.py [--json PATH]

On 2 GPUs, one random tiny Llama in bf16 built with transformer-engine's layer spec, from one
checkpoint: at CP=1 (each rank the whole rows) and at CP=2 (each rank its zig-zag half,
TE's ``TEDotProductAttention`` exchanging K/V chunks ring-wise, ``cp_comm_type`` p2p):

1. teacher-forced log-probs of ragged rows (``megarl.models.forward.teacher_forced_log_probs``),
   padded and packed into token-budget (THD) micro-batches: CP=2 equals CP=1 to bf16 tolerance;
2. one optimizer step's gradient norm (a next-token loss through ``next_token_terms``, the
   global normaliser): CP=2 equals CP=1 to bf16 tolerance (a gradient summed over CP ranks would
   show as 2x).

On CPU the same plumbing runs with ``cpu_compat``'s stand-in attention (tests/multiproc/test_context_parallel.py).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, ROOT)
from tests._tolerance import bf16_logprob_tol  # noqa: E402

NAME = "context parallelism (TE, CP=2 on 2 GPUs) = CP=1: log-probs, grad norm"
LLAMA = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 1024, "hidden_size": 256,
         "intermediate_size": 512, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
         "head_dim": 64, "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "max_position_embeddings": 1024,
         "tie_word_embeddings": False, "hidden_act": "silu", "bos_token_id": 1, "eos_token_id": 2,
         "torch_dtype": "bfloat16"}
# log-probs: tests._tolerance.bf16_logprob_tol from the depth and the largest |logit| (measured at
# CP=1): two bf16 passes of one implementation whose attention sums run in another order
GRAD_NORM_RTOL = 2e-2  # bf16, another order of the attention's sums


def skip_reason():
    if not torch.cuda.is_available():
        return "needs CUDA GPUs"
    if torch.cuda.device_count() < 2 and int(os.environ.get("WORLD_SIZE", "1")) < 2:
        return "needs 2 GPUs (torchrun --nproc-per-node 2)"
    import importlib.util

    if importlib.util.find_spec("transformer_engine") is None:
        return "needs transformer-engine (the CP attention on CUDA is TE's)"
    return None


def measure(hf: str, cp: int, tokens: torch.Tensor, lengths: torch.Tensor):
    from megarl.models.forward import teacher_forced_log_probs
    from megarl.models.vocab_parallel import token_log_probs_from_logits
    from megarl.models.micro_batches import next_token_terms
    from megarl.models.megatron_ckpt import load_model
    from megarl.config.schema import OptimSettings
    from megarl.models.optim import train_step, wrap_for_training
    from megarl.models.weights import unwrap
    from megarl.runtime import distributed as rt

    rt.initialize(tp=1, pp=1, cp=cp)
    model = load_model(hf, tp=1, pp=1)
    core = type(unwrap(model).decoder.layers[0].self_attention.core_attention)
    assert "transformer_engine" in core.__module__, f"core attention is {core.__module__}, not TE's"
    ddp, opt = wrap_for_training(model, OptimSettings(optimizer="sgd", lr=0.0, clip_grad=0.0))
    tok, lens = tokens.cuda(), lengths.cuda()
    lp = teacher_forced_log_probs(ddp, tok, 4, lengths=lens)
    from tests._logits import full_logits

    scale = None
    if cp == 1:  # the largest |logit|, for the tolerance (one sequence at a time: no padding's logits)
        with torch.no_grad():
            scale = max(float(full_logits(ddp, tok[i:i + 1, :int(lens[i])]).abs().max()) for i in range(tok.shape[0]))
    # packed (THD) token-budget micro-batches: TE's THD CP attention, each sequence split on its own
    lp_packed = teacher_forced_log_probs(ddp, tok, 4, lengths=lens, micro_batch_tokens=1024)
    V = unwrap(ddp).megarl_spec.vocab_size
    mask = (torch.arange(tok.shape[1] - 1, device=tok.device)[None, :] < (lens - 1)[:, None]).float()
    norm = float(mask.sum())

    def loss_fn(output, mb):
        terms = next_token_terms(output, mb, lambda logits, nxt: token_log_probs_from_logits(logits, nxt, V))
        return -(terms * mb["loss_mask"]).sum() / norm, {}

    mbs = [{"tokens": tok[i:i + 4], "loss_mask": mask[i:i + 4]} for i in range(0, tok.shape[0], 4)]
    grad_norm = train_step(ddp, opt, mbs, loss_fn).grad_norm
    return lp.float().cpu(), lp_packed.float().cpu(), grad_norm, core.__name__, scale


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    why = skip_reason()
    row = {"name": NAME, "status": "SKIP", "detail": why or "", "seconds": 0.0}
    if why is None:
        import torch.distributed as dist

        from megarl.builtin.tiny_checkpoint import write_random_hf_checkpoint

        t0 = time.perf_counter()
        try:
            from megarl.runtime import distributed as rt

            rt.init_process_group()
            # one directory both ranks see (the same machine): named by the rendezvous port
            with tempfile.TemporaryDirectory(prefix=f"megarl-gpu-cp-{os.environ.get('MASTER_PORT', '0')}-",
                                             dir=os.environ.get("OUT")) as mine:
                box = [mine]
                dist.broadcast_object_list(box, src=0)
                hf = os.path.join(box[0], "llama")
                if dist.get_rank() == 0:
                    write_random_hf_checkpoint(hf, LLAMA, seed=11, dtype=torch.bfloat16)
                dist.barrier()
                g = torch.Generator().manual_seed(7)
                lengths = torch.randint(8, 500, (8,), generator=g)
                tokens = torch.randint(10, 1000, (8, 512), generator=g)
                tokens = tokens * (torch.arange(512)[None, :] < lengths[:, None])
                lp1, _packed1, gn1, _, scale = measure(hf, 1, tokens, lengths)
                lp2, packed2, gn2, core, _ = measure(hf, 2, tokens, lengths)
                LOG_PROB_ATOL = bf16_logprob_tol(LLAMA["num_hidden_layers"], scale)
                err = max(float((lp2 - lp1).abs().max()), float((packed2 - lp1).abs().max()))
                rel = abs(gn2 - gn1) / gn1
                assert err < LOG_PROB_ATOL, f"max |log-prob CP=2 - CP=1| {err:.4f} >= {LOG_PROB_ATOL}"
                assert rel < GRAD_NORM_RTOL, f"grad norm CP=1 {gn1:.5f} vs CP=2 {gn2:.5f}"
                row.update(status="PASS", detail=f"max |log-prob CP=2 - CP=1| {err:.4f} (bf16, {core}); grad norm "
                                                 f"CP=1 {gn1:.5f}, CP=2 {gn2:.5f}")
                dist.barrier()  # rank 0 removes the directory last
        except Exception as e:  # a failed check is a row, not a crash
            row.update(status="FAIL", detail=f"{type(e).__name__}: {e}")
        row["seconds"] = round(time.perf_counter() - t0, 1)
    if int(os.environ.get("RANK", "0")) == 0:
        print(f"[gpu-check] {row['status']:<10} {row['seconds']:5.1f}s  {row['name']}: {row['detail']}", flush=True)
        if args.json:
            with open(args.json, "w") as f:
                json.dump([row], f, indent=1)
    return 0 if row["status"] in ("PASS", "SKIP") else 1



def test_context_parallel_gpu_check():
    """The same check through pytest (2 GPUs); skipped where it cannot run."""
    import subprocess

    import pytest

    why = skip_reason()
    if why is None and torch.cuda.device_count() < 2:
        why = "needs 2 GPUs"
    if why:
        pytest.skip(why)
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", os.path.abspath(__file__)],
                          capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=ROOT), timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]


if __name__ == "__main__":
    sys.exit(main())
