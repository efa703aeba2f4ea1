"""torchrun worker (4 processes): context parallelism (``parallel.cp``) against no context
parallelism, in one launch (``rt.initialize`` rebuilds megatron's groups between layouts).

Layouts: ``cp1`` (DP=4, the reference), ``cp2`` (CP=2 x DP=2), ``cp2tp2`` (CP=2 x TP=2),
``cp2tp2sp`` (the same with sequence parallelism -- rows padded to 2 x cp x tp = 8 -- and full
activation recomputation, whose backward re-runs the attention's K/V gathers) and ``cp2pp2``
(CP=2 x PP=2, the pipeline's activations are each rank's share).  In each, from the same
checkpoint: the actor's teacher-forced log-probs of a ragged PPO batch (prompts of 3-4 tokens,
responses of 1-17: rows of 4-21 tokens, so chunk edges fall inside real tokens), one PPO update
of the real :class:`~megarl.control.learning.Learner` (actor and critic, two SGD steps), then
the actor's log-probs and the critic's values after it.  Rank 0 saves them with the update's
metrics and every weight after it.

At every CP layout the same again with token-budget micro-batches (``algo.micro_batch_tokens``:
packed THD sequences, each split over the CP ranks on its own, rows padded at their ends to
multiples of 2 x cp), against the same CP=1 reference (padded micro-batches of rows).

Negative controls, at CP=2: the log-probs with each rank's share shifted on its own (the labels
across a chunk edge go wrong, verl PR #4250), and the update with the gathered terms' gradient
summed over the CP ranks (the backward of ``torch.distributed.nn.all_gather``), which scales
every gradient by cp.
"""

import argparse
import os
from collections import Counter

import torch
import torch.distributed as dist

from megarl.algo.kl import FixedKLController
from megarl.config import load_config
from megarl.control.learning import Learner
from megarl.models import context_parallel
from megarl.models.weights import iter_hf_tensors
from megarl.roles.actor import Actor
from megarl.roles.critic import Critic
from megarl.runtime import distributed as rt
from tests._control_fakes import sm_sealed
from tests.workers.token_budget_worker import BUDGET, GROUPS, OVERRIDES, PPO_RECIPE, ppo_batch

LAYOUTS = (("cp1", 1, 1, 1, False), ("cp2", 1, 1, 2, False), ("cp2tp2", 2, 1, 2, False),
           ("cp2tp2sp", 2, 1, 2, True), ("cp2pp2", 1, 2, 2, False))


def roles(a, tp, pp, sp, budget=0):
    from megarl.config.schema import RecomputeSettings

    cfg = load_config(PPO_RECIPE, OVERRIDES + [f"algo.micro_batch_tokens={budget}"])
    # with sequence parallelism also full recomputation: the backward re-runs the CP attention's gathers
    rc = RecomputeSettings(granularity="full") if sp else None
    actor = Actor(a.hf, tp, pp, cfg.actor.optim, total_steps=4, vocab_multiple=16, sequence_parallel=sp, recompute=rc)
    critic = Critic(cfg.critic, actor.model, tp, pp, total_steps=4, vocab_multiple=16, sequence_parallel=sp,
                    recompute=rc)
    return cfg, actor, critic


def log_probs(actor, batch, budget=0):
    f = batch.facts
    return actor.log_probs(f.prompt_ids, f.response_ids, f.attention_mask, micro_batch_size=2,
                           micro_batch_tokens=budget)


def update(cfg, actor, critic, v, batch, out):
    from megatron.core import parallel_state as ps

    learner = Learner(cfg, actor=actor, critic=critic, sm=sm_sealed(v, batch.facts.batch_size, GROUPS),
                      kl_ctl=FixedKLController(cfg.algo.kl.beta), counters=Counter(),
                      dp=ps.get_data_parallel_world_size(), sync_dtype=None, rank0=rt.is_main(), ckpt_root=out)
    return learner.update(0, batch, v)


def counting_attention():
    """Counts of the CPU stand-in CP attention's calls by kind (padded rows, packed THD)."""
    from megarl.models import cpu_layers

    counts = Counter()
    real = cpu_layers.context_parallel_core_attention

    def counted(original, module, query, key, value, packed_seq_params=None):
        counts["thd" if packed_seq_params is not None else "padded"] += 1
        return real(original, module, query, key, value, packed_seq_params)

    cpu_layers.context_parallel_core_attention = counted
    return counts


def run_layout(a, tp, pp, sp, budget=0):
    cfg, actor, critic = roles(a, tp, pp, sp, budget)
    v, batch = ppo_batch()
    f = batch.facts
    kinds = []  # per optimizer step: whether each micro-batch ran packed
    for role in (actor, critic):
        def recorded(mbs, loss_fn, _step=role.train_step, **kw):
            kinds.append([("packed" in mb) for mb in mbs])
            return _step(mbs, loss_fn, **kw)

        role.train_step = recorded
    before = log_probs(actor, batch, budget)
    metrics = update(cfg, actor, critic, v, batch, a.out)
    values, bootstrap = critic.values(f.prompt_ids, f.response_ids, f.attention_mask, micro_batch_size=2,
                                      micro_batch_tokens=budget)
    return {"log_probs": before, "metrics": metrics, "log_probs_after": log_probs(actor, batch, budget), "packed": kinds,
            "values_after": values, "bootstrap_after": bootstrap,
            "actor": {k: t.clone() for k, t in iter_hf_tensors(actor.ddp)},
            "critic": {k: t.clone() for k, t in iter_hf_tensors(critic.ddp)}}


def labels_shifted_per_share(a):
    """The anchors' bug as a control: every CP rank shifts its own share of the tokens (the last
    position of each chunk then predicts the chunk's own next token, not the next chunk's first)."""
    from megarl.models.forward import forward_only, gather_response, right_align
    from megarl.models.vocab_parallel import token_log_probs_from_logits
    from megarl.models.micro_batches import PositionWise, round_up, sequence_multiple
    from megarl.models.weights import unwrap

    _cfg, actor, _critic = roles(a, 1, 1, False)
    _v, batch = ppo_batch()
    f = batch.facts
    tokens, plen, rlen = right_align(f.prompt_ids, f.response_ids, f.attention_mask)
    tokens = torch.nn.functional.pad(tokens, (0, round_up(tokens.shape[1], sequence_multiple(actor.ddp)) - tokens.shape[1]))
    V = unwrap(actor.ddp).megarl_spec.vocab_size

    class PerShare(PositionWise):
        def on_context_parallel_share(self, output, toks, width, cu_seqlens=None):
            own = context_parallel.split(toks)
            labels = torch.cat([own[:, 1:], own.new_zeros((own.shape[0], 1))], 1)
            return context_parallel.gather(self.fn(output, labels))[:, :width - 1]

    fn = PerShare(lambda out, nxt: token_log_probs_from_logits(out, nxt, V).float(), shift=True)
    lp = forward_only(actor.ddp, [tokens], fn)[0]
    return gather_response(lp, plen, rlen, f.response_ids.shape[1])


def update_with_summed_gather_gradient(a):
    """The other control: the gathered terms' gradient summed over the CP ranks before each rank
    keeps its positions (what an all-gather whose backward reduce-scatters does)."""
    original = context_parallel._Gather.backward

    def summed(ctx, grad):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=context_parallel.group())
        return original(ctx, grad)

    context_parallel._Gather.backward = staticmethod(summed)
    try:
        cfg, actor, critic = roles(a, 1, 1, False)
        v, batch = ppo_batch()
        return update(cfg, actor, critic, v, batch, a.out)
    finally:
        context_parallel._Gather.backward = original


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--hf", required=True)
    p.add_argument("--out", required=True)
    a = p.parse_args()
    results = {}
    attention = counting_attention()
    for tag, tp, pp, cp, sp in LAYOUTS:
        rt.initialize(tp=tp, pp=pp, cp=cp)
        results[tag] = run_layout(a, tp, pp, sp)
        results[tag]["attention"] = dict(attention)
        attention.clear()
        if cp > 1:  # packed token-budget micro-batches, every sequence split on its own
            results[tag + "_tokens"] = run_layout(a, tp, pp, sp, BUDGET)
            results[tag + "_tokens"]["attention"] = dict(attention)
            attention.clear()
        if tag == "cp2":
            results["control_labels_per_share"] = labels_shifted_per_share(a)
            results["control_summed_gradient"] = update_with_summed_gather_gradient(a)
    if rt.is_main():
        torch.save(results, os.path.join(a.out, "context_parallel.pt"))
    rt.shutdown()


if __name__ == "__main__":
    main()
