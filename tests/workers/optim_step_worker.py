"""torchrun worker: one optimizer step on a fixed global batch at --tp/--pp (dp = world/(tp*pp)).

Saves the updated logical (HF-named) weights and the reported grad norm from rank 0.
"""

import argparse
import os

import torch

from megarl.config import OptimSettings
from megarl.models.vocab_parallel import token_log_probs_from_logits
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
p.add_argument("--overlap", action="store_true", help="overlapped gradient reduction (DDP buckets)")
p.add_argument("--recompute", default=None,
               help="comma-separated parallel.recompute modes, each run in turn: full-uniform, full-block, "
                    "selective (core_attn and mlp), selective-layernorm")
a = p.parse_args()

rt.initialize(tp=a.tp, pp=a.pp)


def recompute_settings(mode):
    from megarl.config.schema import RecomputeSettings

    if mode is None:
        return None
    granularity, _, detail = mode.partition("-")
    if granularity == "full":
        return RecomputeSettings(granularity="full", method=detail, num_layers=1)
    return RecomputeSettings(granularity="selective", modules=[detail] if detail else ["core_attn", "mlp"])


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


def count_forward_calls(model):
    """Forward hooks on this rank's decoder layers and their norms, core attention and MLPs;
    returns a function that removes them and gives ``{module kind: calls}``."""
    from megarl.models.weights import unwrap

    counts, hooks = {}, []
    for layer in unwrap(model).decoder.layers:
        for kind, mod in (("layer", layer), ("input_layernorm", layer.input_layernorm),
                          ("core_attention", layer.self_attention.core_attention), ("mlp", layer.mlp)):
            counts[kind] = 0
            hooks.append(mod.register_forward_hook(lambda *_, _k=kind: counts.__setitem__(_k, counts[_k] + 1)))

    def done():
        for h in hooks:
            h.remove()
        return dict(counts)

    return done


OPTIMIZERS = [("sgd", OptimSettings(optimizer="sgd", lr=0.5, clip_grad=1e9)),
              ("adam", OptimSettings(optimizer="adam", lr=1e-3, weight_decay=0.1, clip_grad=0.05))]
for mode, (name, cfg) in [(m, o) for m in (a.recompute.split(",") if a.recompute else [None]) for o in OPTIMIZERS]:
    model = load_model(a.hf, tp=a.tp, pp=a.pp, sequence_parallel=a.sp, recompute=recompute_settings(mode))
    ddp, opt = wrap_for_training(model, cfg, overlap_grad_reduce=a.overlap)
    events = []  # each bucket group's reduction: started in the backward, or only when finalized?
    for bg in ddp.bucket_groups:
        for what in ("start_grad_sync", "finish_grad_sync"):
            original = getattr(bg, what)
            setattr(bg, what, lambda *x, _o=original, _w=what, **k: (events.append(_w), _o(*x, **k))[1])
    calls = count_forward_calls(model)  # what ran in the step: a recomputed module runs twice
    res = train_step(ddp, opt, micro, loss_fn)
    assert res.update_successful
    calls = calls()
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
    saved = {"weights": weights, "grad_norm": res.grad_norm, "calls": calls}
    if dp > 1:
        # a second step: megatron DDP learns each bucket's gradients in the first, so only from the
        # second on does an overlapped reduction start inside the backward, before finalize waits
        events.clear()
        res2 = train_step(ddp, opt, micro, loss_fn)
        assert events and (events[0] == "start_grad_sync") == a.overlap, events
        saved.update(weights2={k: v.clone() for k, v in iter_hf_tensors(ddp)}, grad_norm2=res2.grad_norm,
                     first_event2=events[0])
    if rt.is_main():
        tag = ("_sp" if a.sp else "") + ("_overlap" if a.overlap else "") + (f"_{mode}" if mode else "")
        torch.save(saved, os.path.join(a.out, f"{name}_tp{a.tp}_pp{a.pp}_dp{dp}{tag}.pt"))
rt.shutdown()
