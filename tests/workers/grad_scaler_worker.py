"""torchrun worker: fp16's loss scaler through megatron's real Float16 optimizer on CPU (gloo).

megarl refuses fp16 on CPU (``cpu_compat.params_dtype_problem``); this worker lifts that for
itself to run what a GPU fp16 run does: the model is built in fp16 and cast whole to fp16 (the
local layer spec makes its norms in fp32 whatever ``params_dtype`` says; on a GPU, TE's norms
follow it, and megatron's Float16Module casts every parameter), megatron's optimizer keeps fp32
master weights and a ``DynamicGradScaler`` (initial scale 2**32, hysteresis 2).

    --mode save    (any DP) steps from the start until the first one that is not an overflow;
                   an update snapshot taken, an overflowing step (the loss times inf), the
                   snapshot restored; a checkpoint (megarl's checkpointing.checkpoint); one more
                   step.  Then, from fresh models: the checkpoint loaded and that step again;
                   the negative control (loaded, then the scaler reset to a fresh one's state,
                   as a resume that lost it would be); and the refusals of a checkpoint without
                   the scaler file or with one the optimizer state disagrees with.
    --mode resume  (another DP) the checkpoint loaded, its scaler state and that step.

The global batch is the same whatever DP is (tests/workers/distopt_worker.py's).
"""

import argparse
import json
import os
import shutil

import torch

from megarl.checkpointing import checkpoint
from megarl.config import OptimSettings
from megarl.models.vocab_parallel import token_log_probs_from_logits
from megarl.models.megatron_ckpt import load_model
from megarl.models.optim import grad_scaler_states, load_grad_scaler_states, train_step, wrap_for_training
from megarl.models.safetensors_io import CheckpointError
from megarl.models.weights import iter_hf_tensors
from megarl.roles.rollback import UpdateSnapshot
from megarl.runtime import cpu_compat
from megarl.runtime import distributed as rt
from tests.workers.distopt_worker import batch


class Run:
    def __init__(self, hf: str):
        from megatron.core import parallel_state as ps

        self.dp, self.dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
        torch.manual_seed(0)
        model = load_model(hf, dtype=torch.float16)
        model.half()
        self.ddp, self.opt = wrap_for_training(model, OptimSettings(optimizer="adam", lr=1e-3, weight_decay=0.1))
        self.vocab = model.megarl_spec.vocab_size
        self.poison = False

    def loss_fn(self, output, mb):
        lp = token_log_probs_from_logits(output[:, :-1].float(), mb["tokens"][:, 1:], self.vocab)
        loss = -(lp * mb["loss_mask"]).sum() / mb["norm"]
        if self.poison:
            loss = loss * float("inf")  # every gradient inf / nan: an overflow on every rank
        return loss, {"loss": loss.detach()}

    def step(self, k: int) -> bool:
        return train_step(self.ddp, self.opt, batch(k, self.dp, self.dp_rank), self.loss_fn).update_successful

    def weights(self) -> dict:
        return {name: t.detach().clone() for name, t in iter_hf_tensors(self.ddp)}

    def scalers(self) -> list:
        return grad_scaler_states(self.opt)


def _refused(hf: str, ckpt: str) -> str:
    r = Run(hf)
    try:
        checkpoint.load_roles(ckpt, {"actor": (r.ddp, r.opt)})
    except CheckpointError as e:
        return str(e)
    return ""


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--hf", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--mode", choices=("save", "resume"), required=True)
    p.add_argument("--ckpt", required=True)
    a = p.parse_args()
    cpu_compat.params_dtype_problem = lambda dtype: None  # this worker's own: see the docstring
    rt.initialize(tp=1, pp=1)
    rank0 = torch.distributed.get_rank() == 0
    out = {}
    if a.mode == "save":
        r = Run(a.hf)
        out["fresh"] = r.scalers()
        k = 0
        while not r.step(k):
            k += 1
            assert k < 64, "no fp16 step succeeded"
        out["overflows"], out["first_success"] = k, r.scalers()
        snap = UpdateSnapshot()
        snap.take(r.ddp, r.opt, None, 0)
        r.poison = True
        assert not r.step(k + 1)
        r.poison = False
        out["after_overflow"] = r.scalers()
        snap.restore(r.ddp, r.opt, None)
        out["after_rollback"] = r.scalers()
        path = checkpoint.save(os.path.dirname(a.ckpt), 1, {"iteration": 1}, {"actor": (r.ddp, r.opt)})
        assert path == a.ckpt, (path, a.ckpt)
        out["saved_file"] = json.load(open(os.path.join(a.ckpt, "actor_grad_scaler.json")))
        out["uninterrupted_ok"] = r.step(100)
        out["uninterrupted"] = r.weights()

        b = Run(a.hf)
        checkpoint.read_state(a.ckpt)  # every file's sha256 verified first
        checkpoint.load_roles(a.ckpt, {"actor": (b.ddp, b.opt)})
        out["resumed_scalers"] = b.scalers()
        out["resumed_ok"] = b.step(100)
        out["resumed"] = b.weights()

        c = Run(a.hf)
        checkpoint.load_roles(a.ckpt, {"actor": (c.ddp, c.opt)})
        load_grad_scaler_states(c.opt, out["fresh"], "negative control")
        out["lost_ok"] = c.step(100)
        out["lost"] = c.weights()

        root = os.path.dirname(a.ckpt)
        missing, edited = os.path.join(root, "missing"), os.path.join(root, "edited")
        if rank0:
            for d in (missing, edited):
                shutil.copytree(a.ckpt, d)
            os.remove(os.path.join(missing, "actor_grad_scaler.json"))
            f = os.path.join(edited, "actor_grad_scaler.json")
            rec = json.load(open(f))
            rec["per_rank"][-1][0]["scale"] *= 2
            json.dump(rec, open(f, "w"))
        torch.distributed.barrier()
        out["refused_missing"] = _refused(a.hf, missing)
        out["refused_edited"] = _refused(a.hf, edited)
    else:
        r = Run(a.hf)
        checkpoint.load_roles(a.ckpt, {"actor": (r.ddp, r.opt)})
        out["resumed_scalers"] = r.scalers()
        out["resumed_ok"] = r.step(100)
    gathered = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(gathered, {k: v for k, v in out.items() if k.startswith("refused")})
    out["refused_per_rank"] = gathered
    if rank0:
        torch.save(out, a.out)
    rt.shutdown()


if __name__ == "__main__":  # dist_checkpointing's writer starts a multiprocessing manager, which
    main()  # imports this module again: it must do nothing on import
