"""torchrun worker: one optimizer step of LoRA adapters (megarl/models/lora.py) on a fixed global
batch at --tp/--pp (dp = world/(tp*pp)).

The adapters start from layout-independent values (A as apply_lora draws it, B drawn here whole
from the layer's name and split like the layer, so that A gets a gradient too).  Rank 0 saves
the merged logical weights the weight stream reads, every adapter's whole A and B after the step,
the base weights read with the adapters off, the grad norm and the trainable parameter count;
after the SGD step, the adapters in peft's format (``peft_<layout>``).
``--no-reduce``: the row-parallel adapter's reduction removed (the negative control).
``--ep`` (a mixture-of-experts checkpoint): the routed experts over EP ranks, their adapters
gathered over EP; ``--no-expert-reduce``: the routed expert adapters' gradient sum over the
expert TP ranks removed (the negative control at TP=2).
"""

import argparse
import os

import torch
import torch.distributed as dist

from megarl.config import OptimSettings
from megarl.models.vocab_parallel import token_log_probs_from_logits
from megarl.models.lora import LoraSpec, adapters_disabled, adapters_of, apply_lora, trainable_parameters
from megarl.models.megatron_ckpt import load_model
from megarl.models.optim import train_step, wrap_for_training
from megarl.models.weights import iter_hf_tensors, unwrap
from megarl.runtime import distributed as rt

p = argparse.ArgumentParser()
p.add_argument("--tp", type=int, default=1)
p.add_argument("--pp", type=int, default=1)
p.add_argument("--hf", required=True)
p.add_argument("--out", required=True)
p.add_argument("--no-reduce", action="store_true")
p.add_argument("--sp", action="store_true", help="sequence parallelism (tp > 1)")
p.add_argument("--ep", type=int, default=1)
p.add_argument("--no-expert-reduce", action="store_true")
a = p.parse_args()

rt.initialize(tp=a.tp, pp=a.pp, ep=a.ep)
from megatron.core import parallel_state as ps  # noqa: E402
from megatron.core.tensor_parallel import mappings  # noqa: E402

from megarl.models import lora  # noqa: E402

if a.no_reduce:
    mappings.reduce_from_tensor_model_parallel_region = lambda x: x
if a.no_expert_reduce:
    lora._sum_grad_over = lambda t, group: t

dp, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
tp, tp_rank = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
g = torch.Generator().manual_seed(7)
B, S = 8, 13
tokens = torch.randint(0, 250, (B, S), generator=g)
lengths = torch.randint(4, S + 1, (B,), generator=g)
loss_mask = (torch.arange(S - 1)[None, :] < (lengths[:, None] - 1)).float()
global_tokens = loss_mask.sum()
per_rank = B // dp
rows = slice(dp_rank * per_rank, (dp_rank + 1) * per_rank)
micro = [{"tokens": tokens[rows][i:i + 2], "loss_mask": loss_mask[rows][i:i + 2]} for i in range(0, per_rank, 2)]
SPEC = LoraSpec(rank=4, alpha=8.0, dropout=0.0, targets=("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"))


def loss_fn(output, mb):
    lp = token_log_probs_from_logits(output[:, :-1], mb["tokens"][:, 1:], model_spec.vocab_size)
    loss = -(lp * mb["loss_mask"]).sum() / global_tokens
    return loss, {"loss": loss.detach()}


def whole(t, style_dim, gated=False, expert=False):
    """The adapter tensor gathered over TP (the expert TP group for a routed expert's) along
    ``style_dim`` (None: replicated); ``gated``: each rank's rows are [gate part; up part]."""
    group = ps.get_expert_tensor_parallel_group() if expert else ps.get_tensor_model_parallel_group()
    n = group.size()
    if style_dim is None or n == 1:
        return t.detach().clone()
    parts = [torch.empty_like(t) for _ in range(n)]
    dist.all_gather(parts, t.detach().contiguous(), group=group)
    if gated:
        halves = [x.chunk(2, 0) for x in parts]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves], 0)
    return torch.cat(parts, style_dim)


def adapter_tensors(model):
    """{layer name: (A, B)} whole, gathered to rank 0 over the pipeline stages."""
    mine = {ad.name: (whole(ad.A, 1 if ad.style == "row" else None, expert=ad.expert_group is not None),
                      whole(ad.B, None if ad.style == "row" else 0, gated=ad.gated, expert=ad.expert_group is not None))
            for ad in adapters_of(model)}
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    return {k: v for part in every for k, v in part.items()}


def logits_of(model):
    from megarl.models.forward import response_log_probs

    prompt = tokens[:, :4]
    return response_log_probs(model, prompt, tokens[:, 4:], torch.ones_like(tokens))


for name, cfg in (("sgd", OptimSettings(optimizer="sgd", lr=0.5, clip_grad=1e9)),
                  ("adam", OptimSettings(optimizer="adam", lr=1e-3, weight_decay=0.1, clip_grad=0.05))):
    model = load_model(a.hf, tp=a.tp, pp=a.pp, ep=a.ep, sequence_parallel=a.sp)
    model_spec = unwrap(model).megarl_spec
    base_lp = logits_of(model)
    adapters = apply_lora(model, SPEC)
    # fresh adapters (B = 0) leave the model as it was, bitwise
    assert torch.equal(logits_of(model), base_lp)
    for ad in adapters:  # B drawn whole from the layer's name, split like the layer
        lin_tp, lin_rank = ((ad.expert_group.size(), ad.expert_group.rank()) if ad.expert_group is not None
                            else (tp, tp_rank))
        full_out = ad.B.shape[0] * (1 if ad.style == "row" else lin_tp)
        gen = torch.Generator().manual_seed(sum(map(ord, ad.name)))
        full = torch.randn(full_out, SPEC.rank, generator=gen) * 0.05
        if ad.gated and ad.style == "column":  # the base's rows on this rank: [gate part; up part]
            half = full_out // 2
            step = half // lin_tp
            full_local = torch.cat([full[lin_rank * step:(lin_rank + 1) * step],
                                    full[half + lin_rank * step:half + (lin_rank + 1) * step]])
        elif ad.style == "column":
            step = full_out // lin_tp
            full_local = full[lin_rank * step:(lin_rank + 1) * step]
        else:
            full_local = full
        with torch.no_grad():
            ad.B.copy_(full_local)
    # only the adapters train; the logical count is over their whole tensors (gathered below)
    assert {id(t) for t in trainable_parameters(model)} == {id(t) for ad in adapters_of(model) for t in (ad.A, ad.B)}
    ddp, opt = wrap_for_training(model, cfg)
    res = train_step(ddp, opt, micro, loss_fn)
    assert res.update_successful
    merged = {k: v.clone() for k, v in iter_hf_tensors(ddp)}
    with adapters_disabled(ddp):
        base = {k: v.clone() for k, v in iter_hf_tensors(ddp)}
        assert torch.equal(logits_of(ddp), base_lp)  # the adapters off: the base model, bitwise
    # the LoRA actor's reference (roles/adapter_reference.py) against a frozen copy loaded apart
    from megarl.roles.adapter_reference import AdapterOffReference
    from megarl.roles.reference import Reference

    class _Actor:
        ddp, precision = ddp, "float32"

        def log_probs(self, *t, **k):
            from megarl.models.forward import response_log_probs

            return response_log_probs(ddp, *t[:3], t[3], pack=k.get("pack", False),
                                      micro_batch_tokens=k.get("micro_batch_tokens", 0))

    frozen = Reference(a.hf, a.tp, a.pp, version="ref-0", vocab_multiple=128, sequence_parallel=a.sp)
    am = torch.ones_like(tokens)
    want = frozen.batch_log_probs(tokens[:, :4], tokens[:, 4:], am, 4)
    assert torch.equal(AdapterOffReference(_Actor()).batch_log_probs(tokens[:, :4], tokens[:, 4:], am, 4), want)
    assert not torch.equal(logits_of(ddp), base_lp)  # negative control: the adapters on, another policy
    if name == "sgd" and not (a.no_reduce or a.no_expert_reduce):  # the adapters in peft's format
        from megarl.models.peft_export import export_peft_adapter

        tag = f"tp{a.tp}_pp{a.pp}_ep{a.ep}" + ("_sp" if a.sp else "")
        export_peft_adapter(ddp, os.path.join(a.out, f"peft_{tag}"), rank=SPEC.rank, alpha=SPEC.alpha,
                            dropout=0.0, base_model=a.hf)
    ad = adapter_tensors(ddp)
    n_trainable = sum(t.numel() for pair in ad.values() for t in pair)
    if rt.is_main():
        tag = (("_noreduce" if a.no_reduce else "") + ("_noexpertreduce" if a.no_expert_reduce else "")
               + ("_sp" if a.sp else "") + (f"_ep{a.ep}" if a.ep > 1 else ""))
        torch.save({"merged": merged, "base": base, "adapters": ad, "grad_norm": res.grad_norm,
                    "trainable": n_trainable},
                   os.path.join(a.out, f"lora_{name}_tp{a.tp}_pp{a.pp}_dp{dp}{tag}.pt"))
rt.shutdown()
