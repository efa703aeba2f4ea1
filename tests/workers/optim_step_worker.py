"""torchrun worker: one optimizer step on a fixed global batch at --tp/--pp (dp = world/(tp*pp)).

Saves the updated logical (HF-named) weights and the reported grad norm from rank 0.
"""

import argparse
import os

import torch

from megarl.config import OptimSettings
from megarl.models.forward import token_log_probs_from_logits
from megarl.models.megatron_ckpt import load_model
from megarl.models.optim import train_step, wrap_for_training
from megarl.models.weights import iter_hf_tensors
from megarl.runtime import distributed as rt

p = argparse.ArgumentParser()
p.add_argument("--tp", type=int, default=1)
p.add_argument("--pp", type=int, default=1)
p.add_argument("--hf", required=True)
p.add_argument("--out", required=True)
p.add_argument("--micro-batch-size", type=int, default=2)
p.add_argument("--sp", action="store_true", help="sequence parallelism (tp > 1)")
a = p.parse_args()

rt.initialize(tp=a.tp, pp=a.pp)
from megatron.core import parallel_state as ps  # noqa: E402

dp, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
g = torch.Generator().manual_seed(7)
B, S = 8, 13
tokens = torch.randint(0, 250, (B, S), generator=g)
lengths = torch.randint(4, S + 1, (B,), generator=g)  # ragged: padding is masked out
loss_mask = (torch.arange(S - 1)[None, :] < (lengths[:, None] - 1)).float()
global_tokens = loss_mask.sum()  # the global normaliser, known before the step

per_rank = B // dp
rows = slice(dp_rank * per_rank, (dp_rank + 1) * per_rank)
mine_tokens, mine_mask = tokens[rows], loss_mask[rows]
mbs = a.micro_batch_size
micro = [{"tokens": mine_tokens[i:i + mbs], "loss_mask": mine_mask[i:i + mbs]}
         for i in range(0, per_rank, mbs)]


def loss_fn(output, mb):
    V = model.megarl_spec.vocab_size
    lp = token_log_probs_from_logits(output[:, :-1], mb["tokens"][:, 1:], V)
    loss = -(lp * mb["loss_mask"]).sum() / global_tokens
    return loss, {"loss": loss.detach()}


for name, cfg in [
    ("sgd", OptimSettings(optimizer="sgd", lr=0.5, clip_grad=1e9)),
    ("adam", OptimSettings(optimizer="adam", lr=1e-3, weight_decay=0.1, clip_grad=0.05)),
]:
    model = load_model(a.hf, tp=a.tp, pp=a.pp, sequence_parallel=a.sp)
    ddp, opt = wrap_for_training(model, cfg)
    res = train_step(ddp, opt, micro, loss_fn)
    assert res.update_successful
    if a.tp > 1:
        # replicated over TP (norms; under sequence parallelism each rank's norm saw its part of
        # the sequence and finalize_model_grads summed them): every TP rank holds the same values
        # after the step -- Megatron-LM#619 is router weights drifting apart under SP
        for n, p_ in ddp.named_parameters():
            if not getattr(p_, "tensor_model_parallel", False):
                got = [torch.empty_like(p_.data) for _ in range(a.tp)]
                torch.distributed.all_gather(got, p_.data.contiguous(), group=ps.get_tensor_model_parallel_group())
                assert all(torch.equal(got[0], g_) for g_ in got[1:]), f"{name}: {n} differs across TP ranks"
    weights = {k: v.clone() for k, v in iter_hf_tensors(ddp)}
    if rt.is_main():
        tag = "_sp" if a.sp else ""
        torch.save({"weights": weights, "grad_norm": res.grad_norm},
                   os.path.join(a.out, f"{name}_tp{a.tp}_pp{a.pp}_dp{dp}{tag}.pt"))
rt.shutdown()
