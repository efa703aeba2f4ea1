"""torchrun worker: at --tp (dp = world/tp) an optimizer step after an actor offload/onload
cycle updates every rank's shard bitwise like the same step without it, and the reference
model's forward is unchanged across a host round trip.  Exits non-zero on any mismatch."""

import argparse

import torch

from megarl.config import OptimSettings
from megarl.models.vocab_parallel import token_log_probs_from_logits
from tests._logits import full_logits
from megarl.models.megatron_ckpt import load_model
from megarl.models.optim import train_step, wrap_for_training
from megarl.roles.offload import ActorOffloader, ReferenceOffloader
from megarl.runtime import distributed as rt

p = argparse.ArgumentParser()
p.add_argument("--tp", type=int, default=2)
p.add_argument("--hf", required=True)
a = p.parse_args()

rt.initialize(tp=a.tp, pp=1)
cfg = OptimSettings(optimizer="adam", lr=1e-3, weight_decay=0.1, clip_grad=0.05)


def batch(seed):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, 250, (4, 9), generator=g)
    mask = torch.ones(4, 8)
    return [{"tokens": tokens[i:i + 2], "loss_mask": mask[i:i + 2]} for i in (0, 2)]


def actor():
    model = load_model(a.hf, tp=a.tp)
    V = model.megarl_spec.vocab_size

    def loss_fn(output, mb):
        lp = token_log_probs_from_logits(output[:, :-1], mb["tokens"][:, 1:], V)
        loss = -(lp * mb["loss_mask"]).sum() / 32.0
        return loss, {"loss": loss.detach()}

    ddp, opt = wrap_for_training(model, cfg)
    return ddp, opt, loss_fn


runs = []
for offload in (True, False):
    ddp, opt, loss_fn = actor()
    start = {n: q.detach().clone() for n, q in ddp.named_parameters()}
    assert train_step(ddp, opt, batch(1), loss_fn).update_successful
    if offload:
        off = ActorOffloader(ddp, opt, preserve_grads=False)
        moved = off.offload()
        assert all(v > 0 for v in moved.values()), moved
        assert all(q.untyped_storage().nbytes() == 0 for q in ddp.parameters())
        junk = [torch.full((1 << 18,), float("nan")) for _ in range(4)]
        off.onload()
        del junk
    res = train_step(ddp, opt, batch(2), loss_fn)
    runs.append(({n: q.detach().clone() for n, q in ddp.named_parameters()}, res.grad_norm))

(w_off, gn_off), (w_ref, gn_ref) = runs
assert gn_off == gn_ref, (gn_off, gn_ref)
assert max((w_ref[k] - start[k]).abs().max().item() for k in w_ref) > 1e-4, "vacuous: no update"
for k in w_ref:
    assert torch.equal(w_off[k], w_ref[k]), f"rank {rt.rank()}: {k} differs after offload"

ref_model = load_model(a.hf, tp=a.tp)
tokens = batch(3)[0]["tokens"]
before = full_logits(ref_model, tokens)
ref = ReferenceOffloader(ref_model)
ref.offload()
assert all(q.untyped_storage().nbytes() == 0 for q in ref_model.parameters())
with ref.on_device():
    after = full_logits(ref_model, tokens)
assert torch.equal(before, after), f"rank {rt.rank()}: reference logits changed"
assert ref.is_offloaded
if rt.is_main():
    print("OFFLOAD_WORKER_OK")
rt.shutdown()
