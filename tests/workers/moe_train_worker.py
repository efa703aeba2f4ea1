"""torchrun worker (2 processes): a tiny MoE trained and synced at EP=2 against EP=1, in one launch.

Layouts, one after the other in the same processes (``rt.initialize`` rebuilds megatron's groups):

* ``ep1`` (DP=2, every rank holds all experts) and ``ep2`` (DP=2 for the dense part, EP=2: each
  rank holds two of the four experts).  On each: the weight manifest of the loaded checkpoint;
  the teacher-forced old log-probs of ragged rows split over the DP ranks (``map_rows``: the EP
  ranks run different rows, so the MoE micro-batches must be widened alike); one GRPO update by
  the real :class:`~megarl.control.learning.Learner` (two mini-batches with pad rows, two
  micro-batches each, AdamW with weight decay and clipping at a norm the step exceeds); the
  weights after it (``iter_hf_tensors``) and their manifest; and at both versions a sync into an
  hf rollout engine on *every* rank, what it served read back.
* ``tp2sp``: the same at TP=2 with sequence parallelism (DP=1; megatron trains MoE layers at
  TP > 1 only with it), and the TP-replicated weights (routers, norms: their gradients summed
  over the TP ranks' parts of the sequence) compared across the two TP ranks after the update.
* ``pp2``: the manifest of the same checkpoint, for the layout-independence of its hash.
* ``ep2tok``: ``ep2`` with token-budget micro-batches (``algo.micro_batch_tokens``) for the old
  log-probs and the update: packed, a different token count on each EP rank, lengthened alike.
* ``cp2ep2`` and ``cp2ep2tok``: context parallelism (CP=2, DP=1) with the experts over EP=2 --
  megatron takes the EP group from the CP ranks, which hold halves of the same rows -- padded and
  packed: every sequence split over the two ranks, each rank's tokens dispatched to its experts.

Rank 0 saves one file per layout for the test to judge; ranks exchange what the test needs from
rank 1 (its engine's load reports and served tensors' checksums).  With ``--train ARGS``, the
same processes then run ``megarl.train``'s ``main(ARGS)`` (a short GRPO run at ``parallel.ep=2``),
and again with ``trainer.iterations=3 parallel.ep=1``: its resume from the EP=2 checkpoint must be
refused (the exit code is saved).
"""

import argparse
import os
from collections import Counter

import torch

from megarl.algo.kl import FixedKLController
from megarl.config import load_config
from megarl.control.learning import Learner
from megarl.models import mapping
from megarl.models.megatron_ckpt import load_model
from megarl.models.weights import iter_hf_tensors
from megarl.roles.actor import Actor
from megarl.rollout.hf_backend import HFRolloutEngine
from megarl.rollout.weight_stream import TensorManifest
from megarl.rollout.weight_sync import actor_manifest, make_version, sync_actor_to_engine
from megarl.runtime import distributed as rt
from megarl.runtime.data_parallel import gather_objects, map_rows
from tests._control_fakes import GRPO_RECIPE, H, sealed_batch, sm_sealed

#: 4 groups of G=3; every group has a reward spread (no zero-advantage group)
REWARDS = [[1.0, 0.0, 0.0], [0.0, 1.0, 1.0], [1.0, 0.0, 1.0], [0.0, 0.0, 1.0]]
OVERRIDES = ["rollout.n=3", "trainer.prompts_per_iteration=4", "algo.num_mini_batches=2", "algo.ppo_epochs=1",
             "algo.micro_batch_size=2", "actor.optim.lr=3e-3", "actor.optim.weight_decay=0.1",
             "actor.optim.clip_grad=0.1", "algo.entropy_coef=0.01"]


#: ``ep2tok``: micro-batches of at most 9 tokens (rows are 5-8), packed, for the update and the
#: old log-probs: each EP rank's packed micro-batches differ in length and are lengthened alike
TOKEN_BUDGET = 9


def grpo_advantages(rewards, response_mask):
    """(r - mean_group) / (std_group + 1e-6) on every response token (GRPO, unbiased std)."""
    adv = []
    for group in rewards:
        r = torch.tensor(group)
        adv += ((r - r.mean()) / (r.std() + 1e-6)).tolist()
    return torch.tensor(adv)[:, None] * response_mask


def sync_and_read(actor_ddp, engine, version, manifest):
    """Sync ``version`` into this rank's engine, activate it, and return (load report fields with
    the names of every bucket in stream order, ``{name: checksum}`` of what the engine serves)."""
    buckets = []

    def record(bucket):  # the transport hook: sees each bucket on its way into the engine
        buckets.append([name for name, _ in bucket])
        return bucket

    report = sync_actor_to_engine(actor_ddp, engine, version, manifest, bucket_bytes=16 * 1024, transport=record)
    engine.activate(version)
    served = TensorManifest.from_named_tensors(engine._active.targets().items())
    return {"num_tensors": report.num_tensors, "manifest_hash": report.manifest_hash,
            "num_buckets": report.num_buckets, "buckets": buckets}, {n: e.checksum for n, e in served.entries.items()}


def train_layout(a, ep, tp=1, sp=False, budget=0, cp=1, pp=1, etp=None, stage_layers=(None, None)):
    rt.initialize(tp=tp, pp=pp, ep=ep, cp=cp, etp=etp, first_stage_layers=stage_layers[0],
                  last_stage_layers=stage_layers[1])
    from megatron.core import parallel_state as ps

    cfg = load_config(GRPO_RECIPE, OVERRIDES + [f"algo.micro_batch_tokens={budget}"])
    actor = Actor(a.hf, tp, pp, cfg.actor.optim, total_steps=4, sequence_parallel=sp)
    out = {"ep": ps.get_expert_model_parallel_world_size(), "dp": ps.get_data_parallel_world_size(),
           "edp": ps.get_expert_data_parallel_world_size(),
           # megatron DDP: expert grads in their own buffers, reduced over the expert-data-parallel group
           "expert_buffer_groups": [b.data_parallel_group.size() for b in actor.ddp.expert_parallel_buffers],
           "dense_buffer_groups": [b.data_parallel_group.size() for b in actor.ddp.buffers],
           "held_experts": gather_objects(sorted({int(n.split(".")[6]) for n in mapping.stage_param_names(actor.model)
                                                  if ".local_experts." in n}))}
    m0 = actor_manifest(actor.ddp)
    v0 = make_version(actor.ddp, m0, run_id="ep-test", optimizer_step=0, tokenizer_hash=H("tok"))
    out["manifest0"] = [(e.name, e.checksum) for e in m0.entries.values()]
    out["manifest0_hash"] = m0.global_hash
    out["manifest0_every_rank"] = gather_objects(m0.global_hash)
    engine = HFRolloutEngine(a.hf)  # one per rank, as the trainer places them at rollout.tp=1
    report, served = sync_and_read(actor.ddp, engine, v0, m0)
    out["load0"] = gather_objects(report)
    out["served0_every_rank"] = gather_objects(served)

    probe = sealed_batch(v0, REWARDS)
    f = probe.facts
    # old log-probs the way preparation computes them: rows split over DP, micro-batches of 2 by length
    out["old_log_probs"] = map_rows(lambda *t: actor.log_probs(*t, 2, micro_batch_tokens=budget), f.prompt_ids,
                                    f.response_ids, f.attention_mask)
    # 7 rows: 4 on the first rank, 3 and a pad row on the second, so the ranks' micro-batches differ
    out["old_log_probs_7"] = map_rows(lambda *t: actor.log_probs(*t, 2, micro_batch_tokens=budget),
                                      f.prompt_ids[:7], f.response_ids[:7], f.attention_mask[:7])
    batch = sealed_batch(v0, REWARDS, advantages=grpo_advantages(REWARDS, f.response_mask.float()))
    learner = Learner(cfg, actor=actor, critic=None, sm=sm_sealed(v0, f.batch_size, len(REWARDS)),
                      kl_ctl=FixedKLController(cfg.algo.kl.beta), counters=Counter(),
                      dp=ps.get_data_parallel_world_size(),
                      sync_dtype=None, rank0=rt.is_main(), ckpt_root=a.out)
    metrics = learner.update(0, batch, v0)
    out["metrics"] = {k: metrics[k] for k in ("update/grad_norm", "update/grad_norm_max", "update/optimizer_steps",
                                              "update/pg_loss", "update/tokens")}
    out["weights"] = {k: v.clone() for k, v in iter_hf_tensors(actor.ddp)}
    if tp > 1:  # every TP-replicated parameter, as each TP rank holds it after the update
        replicated = {n: p.data.clone() for n, p in actor.ddp.named_parameters()
                      if not getattr(p, "tensor_model_parallel", False)}
        out["replicated_every_tp_rank"] = gather_objects(replicated)
    m1 = actor_manifest(actor.ddp)
    v1 = make_version(actor.ddp, m1, run_id="ep-test", optimizer_step=1, tokenizer_hash=H("tok"))
    out["manifest1"] = [(e.name, e.checksum) for e in m1.entries.values()]
    out["manifest1_every_rank"] = gather_objects(m1.global_hash)
    report, served = sync_and_read(actor.ddp, engine, v1, m1)
    out["load1"] = gather_objects(report)
    out["served1_every_rank"] = gather_objects(served)
    return out


def manifest_layout(a, tp, pp):
    rt.initialize(tp=tp, pp=pp)
    m = actor_manifest(load_model(a.hf, tp=tp, pp=pp))
    return {"manifest0": [(e.name, e.checksum) for e in m.entries.values()], "manifest0_hash": m.global_hash,
            "manifest0_every_rank": gather_objects(m.global_hash)}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--hf", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--layouts", nargs="+", default=None, help="these layouts only (default: the first seven)")
    p.add_argument("--train", nargs=argparse.REMAINDER, default=None,
                   help="then run megarl.train's main with these arguments in the same processes")
    a = p.parse_args()
    import time

    results, seconds = {}, {}
    layouts = {"ep1": lambda: train_layout(a, 1), "ep2": lambda: train_layout(a, 2),
               "tp2sp": lambda: train_layout(a, 1, tp=2, sp=True), "pp2": lambda: manifest_layout(a, 1, 2),
               "ep2tok": lambda: train_layout(a, 2, budget=TOKEN_BUDGET),
               "cp2ep2": lambda: train_layout(a, 2, cp=2),
               "cp2ep2tok": lambda: train_layout(a, 2, cp=2, budget=TOKEN_BUDGET),
               # TP=2 x EP=2 in two processes: the experts whole (expert TP 1), EP over the TP ranks
               "tp2ep2": lambda: train_layout(a, 2, tp=2, sp=True, etp=1),
               "pp2update": lambda: train_layout(a, 1, pp=2),
               # an uneven pipeline split: the first stage holds one layer, the last the rest
               "pp2uneven": lambda: train_layout(a, 1, pp=2, stage_layers=(1, None))}
    for tag in a.layouts or list(layouts)[:7]:
        run = layouts[tag]
        t0 = time.perf_counter()
        results[tag] = run()
        seconds[tag] = time.perf_counter() - t0
    for tag, res in results.items():
        res["seconds"] = seconds[tag]
    if rt.is_main():
        for tag, res in results.items():
            torch.save(res, os.path.join(a.out, f"{tag}.pt"))
    if a.train:
        # the real entry point (what ``python -m megarl.train`` runs), here to spare CI a second
        # start-up of torch, megatron and transformers: it brings up its own layout (parallel.ep=2)
        from megarl.train import main as train_main

        shutdown, rt.shutdown = rt.shutdown, lambda: None  # keep the process group for the second run
        try:
            train_main(a.train)
        finally:
            rt.shutdown = shutdown
        # the same run resumed at parallel.ep=1: refused in one line (exit 2), nothing trained
        try:
            train_main(a.train + ["trainer.iterations=3", "parallel.ep=1"])
            code = 0
        except SystemExit as e:
            code = e.code
        if rt.is_main():
            torch.save({"exit_code": code}, os.path.join(a.out, "resume_ep1.pt"))
    rt.shutdown()


if __name__ == "__main__":
    main()
