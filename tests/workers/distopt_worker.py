"""torchrun worker: megatron's distributed optimizer on CPU (gloo) against the plain one.

    --mode steps   two Adam steps on a fixed global batch split over DP, with the plain and with
                   the distributed optimizer from the same start; saves both weights (rank 0)
    --mode save    one step with the distributed optimizer, a checkpoint (megarl's
                   checkpointing.checkpoint, optimizer state included), a second step; saves the weights
    --mode resume  loads that checkpoint (at this DP, with the --dist optimizer or the plain one)
                   and takes the second step; saves the weights

The global batch is the same whatever DP is: 8 rows, rank r takes its contiguous 8/dp of them in
micro-batches of 2, each normalised by the global token count (megarl's loss contract: the
gradient is a sum over ranks and micro-batches).
"""

import argparse
import os

import torch

from megarl.checkpointing import checkpoint
from megarl.config import OptimSettings
from megarl.models.vocab_parallel import token_log_probs_from_logits
from megarl.models.megatron_ckpt import load_model
from megarl.models.optim import train_step, wrap_for_training
from megarl.models.weights import iter_hf_tensors
from megarl.runtime import distributed as rt


def batch(step: int, dp: int, dp_rank: int):
    g = torch.Generator().manual_seed(100 + step)
    B, S = 8, 13
    tokens = torch.randint(0, 250, (B, S), generator=g)
    lengths = torch.randint(4, S + 1, (B,), generator=g)
    mask = (torch.arange(S - 1)[None, :] < (lengths[:, None] - 1)).float()
    norm = mask.sum()
    rows = list(range(dp_rank * (B // dp), (dp_rank + 1) * (B // dp)))
    return [{"tokens": tokens[rows[i:i + 2]], "loss_mask": mask[rows[i:i + 2]], "norm": norm}
            for i in range(0, len(rows), 2)]


class Run:
    def __init__(self, hf: str, clip: float, dist_opt: bool):
        from megatron.core import parallel_state as ps

        self.dp, self.dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
        torch.manual_seed(0)
        model = load_model(hf)
        settings = OptimSettings(optimizer="adam", lr=1e-2, weight_decay=0.1, clip_grad=clip)
        self.ddp, self.opt = wrap_for_training(model, settings, use_distributed_optimizer=dist_opt)
        self.vocab = model.megarl_spec.vocab_size

    def loss_fn(self, output, mb):
        lp = token_log_probs_from_logits(output[:, :-1], mb["tokens"][:, 1:], self.vocab)
        loss = -(lp * mb["loss_mask"]).sum() / mb["norm"]
        return loss, {"loss": loss.detach()}

    def step(self, k: int) -> float:
        res = train_step(self.ddp, self.opt, batch(k, self.dp, self.dp_rank), self.loss_fn)
        assert res.update_successful
        return res.grad_norm

    def weights(self) -> dict:
        return {name: t.detach().clone() for name, t in iter_hf_tensors(self.ddp)}

    def optimizers(self) -> list:
        return [type(o).__name__ for o in getattr(self.opt, "chained_optimizers", [self.opt])]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--hf", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--mode", choices=("steps", "save", "resume"), required=True)
    p.add_argument("--ckpt", default=None)
    p.add_argument("--dist", type=int, default=1, help="1: the distributed optimizer (resume mode)")
    p.add_argument("--clip", type=float, default=0.0)
    a = p.parse_args()
    rt.initialize(tp=1, pp=1)
    out = {}
    if a.mode == "steps":
        for dist_opt in (False, True):
            r = Run(a.hf, a.clip, dist_opt)
            norms = [r.step(k) for k in range(2)]
            out["dist" if dist_opt else "plain"] = {"weights": r.weights(), "grad_norms": norms,
                                                    "optimizers": r.optimizers()}
    elif a.mode == "save":
        r = Run(a.hf, a.clip, True)
        r.step(0)
        path = checkpoint.save(os.path.dirname(a.ckpt), 1, {"iteration": 1}, {"actor": (r.ddp, r.opt)})
        assert path == a.ckpt, (path, a.ckpt)
        r.step(1)
        out = {"weights": r.weights(), "optimizers": r.optimizers()}
    else:
        r = Run(a.hf, a.clip, bool(a.dist))
        checkpoint.read_state(a.ckpt)  # every file's sha256 verified first
        checkpoint.load_roles(a.ckpt, {"actor": (r.ddp, r.opt)})
        r.step(1)
        out = {"weights": r.weights(), "optimizers": r.optimizers()}
    if torch.distributed.get_rank() == 0:
        torch.save(out, a.out)
    rt.shutdown()


if __name__ == "__main__":  # dist_checkpointing's writer starts a multiprocessing manager, which
    main()  # imports this module again: it must do nothing on import
