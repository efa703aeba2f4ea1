"""torchrun worker (pp=2): each family loaded as PP=2 with --vpp virtual stages per rank; saves
the chunks' layer numbers, teacher-forced log-probs (even rows, padded ragged rows, packed rows),
the HF tensors streamed back out of the shards, and one Adam step over 5 micro-batches (not a
multiple of pp): its grad norm and the weights after it.  The stepped model is saved as a megarl
checkpoint; a checkpoint saved by the other layout (``--load``) is loaded and streamed out."""

import argparse
import os

import torch
import torch.distributed as dist

from megarl.models.builder import BuildOptions, build_model_chunks
from megarl.config.schema import OptimSettings
from megarl.models.forward import teacher_forced_log_probs
from megarl.models.vocab_parallel import token_log_probs_from_logits
from megarl.models.optim import train_step, wrap_for_training
from megarl.models.hf_config import load_spec
from megarl.models.megatron_ckpt import load_model, save_megatron_checkpoint
from megarl.models.weights import iter_hf_tensors, load_hf_weights
from megarl.runtime import distributed as rt


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--vpp", type=int, default=1)
    p.add_argument("--data", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--families", nargs="+", required=True)
    p.add_argument("--load", type=int, default=None, help="load the checkpoints saved at this many virtual stages")
    p.add_argument("--filler-adds-router-losses", action="store_true",
                   help="the negative control: a filler micro-batch's router losses counted (no moe_losses.suspended)")
    a = p.parse_args()
    if a.filler_adds_router_losses:
        import contextlib

        from megarl.models import moe_losses

        moe_losses.suspended = lambda config: contextlib.nullcontext()

    rt.initialize(tp=1, pp=2, vpp=a.vpp)
    tokens = torch.load(os.path.join(a.data, "tokens.pt"))
    lengths = torch.tensor([19, 4, 11, 1, 16])[: tokens.shape[0]].clamp(max=tokens.shape[1])
    for fam in a.families:
        hf_dir = os.path.join(a.data, fam)
        spec = load_spec(hf_dir)
        # the MoE family with the router's losses on: a filler micro-batch must not add them
        moe = dict(moe_aux_loss_coeff=0.01, moe_z_loss_coeff=0.001) if spec.moe is not None else {}
        chunks = build_model_chunks(spec, BuildOptions(tp=1, pp=2, init_weights=False, **moe))
        load_hf_weights(chunks, hf_dir)
        layers = [[int(layer.layer_number) for layer in c.decoder.layers] for c in chunks]
        every = [None] * dist.get_world_size()
        dist.all_gather_object(every, layers)
        out = {
            "layers": every,
            "chunks": len(chunks),
            # 5 rows in micro-batches of 2 and of 1: 3 and 5 micro-batches (not multiples of pp)
            "log_probs": teacher_forced_log_probs(chunks, tokens, micro_batch_size=2),
            "log_probs_mb1": teacher_forced_log_probs(chunks, tokens, micro_batch_size=1),
            "padded_log_probs": teacher_forced_log_probs(chunks, tokens, micro_batch_size=2, lengths=lengths),
            "packed_log_probs": teacher_forced_log_probs(chunks, tokens, micro_batch_size=2, lengths=lengths, pack=True),
            "hf": {name: t.clone() for name, t in iter_hf_tensors(chunks)},
        }
        ddp, opt = wrap_for_training(chunks, OptimSettings(lr=1e-3))
        V = spec.vocab_size

        def loss_fn(output, mb):
            t = mb["tokens"]
            lp = token_log_probs_from_logits(output[:, :-1], t[:, 1:], V)
            return -lp.sum() / (tokens.shape[0] * (tokens.shape[1] - 1)), {"lp_sum": float(lp.sum())}

        step = train_step(ddp, opt, [{"tokens": tokens[i:i + 1]} for i in range(tokens.shape[0])], loss_fn)
        metrics = [None] * dist.get_world_size()
        dist.all_gather_object(metrics, step.metrics)  # the loss's metrics live on the last stage
        out.update(step_ok=step.update_successful, moe_losses=step.moe_losses, grad_norm=step.grad_norm, step_metrics=metrics[-1],
                   after={name: t.clone() for name, t in iter_hf_tensors(ddp)})
        save_megatron_checkpoint(ddp, os.path.join(a.out, f"{fam}_ckpt_vpp{a.vpp}"))
        if a.load is not None:
            loaded = load_model(os.path.join(a.out, f"{fam}_ckpt_vpp{a.load}"), tp=1, pp=2)
            out.update(loaded_chunks=len(loaded) if isinstance(loaded, list) else 1,
                       loaded={name: t.clone() for name, t in iter_hf_tensors(loaded)})
        if rt.is_main():
            tag = "_unsuspended" if a.filler_adds_router_losses else ""
            torch.save(out, os.path.join(a.out, f"{fam}_vpp{a.vpp}{tag}.pt"))
    rt.shutdown()


if __name__ == "__main__":  # dist_checkpointing's writer starts processes that import this file
    main()
