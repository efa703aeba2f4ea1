"""torchrun worker (2 processes): the PPO update (actor and critic, the real
:class:`~megarl.control.learning.Learner`) on micro-batches of rows against micro-batches cut by a
token budget (``algo.micro_batch_tokens``), at TP=2, PP=2 and DP=2 in one launch (``rt.initialize``
rebuilds megatron's groups between layouts), and at TP=2 with sequence parallelism (the packed
sequences get filler tokens up to a multiple of tp).

The batch: 6 groups of 3, prompts of 3-4 tokens and responses of 1-17 tokens (one long row in
each group), advantages, old values and returns drawn from a seeded generator.  Each mode starts
from the same checkpoint: two mini-batches, one SGD step of the actor and of the critic each
(SGD: the step is the gradient times the rate, so a gradient that differs shows as it is).  Rank 0
saves, per layout and mode, the update's metrics and every weight of the actor and the critic
after it.  The padded mode's micro-batches are 2 rows; the token budget (16) gives bins of 1-4
rows, splits, and at DP=2 filler micro-batches.
"""

import argparse
import contextlib
import os
from collections import Counter

import torch

from megarl.algo.kl import FixedKLController
from megarl.config import load_config
from megarl.control.learning import Learner
from megarl.experience.schema import DerivedTensors, ExperienceBatch, LogProbProducer, LogProbs
from megarl.experience.seal import seal, with_derived
from megarl.models.weights import iter_hf_tensors
from megarl.roles.actor import Actor
from megarl.roles.critic import Critic
from megarl.runtime import distributed as rt
from tests._control_fakes import ROOT, make_samples, ok_record, sm_sealed, version

PPO_RECIPE = os.path.join(ROOT, "configs", "ppo_arith_tiny.yaml")
GROUPS, G = 6, 3
OVERRIDES = ["rollout.n=3", f"trainer.prompts_per_iteration={GROUPS}", "algo.num_mini_batches=2",
             "algo.ppo_epochs=1", "algo.micro_batch_size=2", "critic.micro_batch_size=2", "critic.warmup_iters=0",
             "actor.optim.optimizer=sgd", "actor.optim.lr=0.5", "actor.optim.clip_grad=0.0",
             "critic.optim.optimizer=sgd", "critic.optim.lr=0.5", "critic.optim.clip_grad=0.0",
             "algo.entropy_coef=0.01", "algo.kl.placement=loss", "algo.kl.beta=0.05"]
BUDGET = 16
#: algo.log_prob_chunk in the third mode: log-probs and entropy 3 positions at a time
CHUNK = 3


def chunked_functions():
    """megarl/models/chunked_logits.py against the whole-tensor functions on this TP rank's shard of
    one set of logits (a padded vocabulary, a temperature): values, and gradients of a weighted sum."""
    from megatron.core import parallel_state as ps

    from megarl.models.vocab_parallel import token_log_probs_from_logits, vocab_parallel_entropy

    tp, rank = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
    gen = torch.Generator().manual_seed(3)
    V, padded = 301, 304
    full = torch.randn(3, 19, padded, generator=gen) * 3
    shard = full[..., rank * padded // tp:(rank + 1) * padded // tp]
    targets = torch.randint(0, V, (3, 19), generator=gen)
    weights = torch.randn(3, 18, generator=gen)
    out = {}
    for name, fn in (("log_probs", lambda x, c: token_log_probs_from_logits(x[:, :-1], targets[:, 1:], V, 0.7, c)),
                     ("entropy", lambda x, c: vocab_parallel_entropy(x[:, :-1], V, c))):
        got = {}
        for chunk in (0, 4):
            x = shard.clone().requires_grad_()
            val = fn(x, chunk)
            (val * weights).sum().backward()
            got[chunk] = (val.detach(), x.grad)
        out[name] = got
    return out


def fused_functions():
    """megarl/models/fused_output.py against megatron's kernel and the whole entropy on the logits
    ``h W^T`` of this TP rank's shard of one output weight (a padded vocabulary, temperature 0.7):
    values, and the gradients of a weighted sum to the hidden states (summed over TP, as the output
    layer's input region does) and to the weight shard."""
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import copy_to_tensor_model_parallel_region

    from megarl.models.vocab_parallel import token_log_probs_from_logits, vocab_parallel_entropy
    from megarl.models.fused_output import fused_log_probs

    tp, rank = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
    gen = torch.Generator().manual_seed(5)
    V, padded, h, T = 301, 304, 24, 0.7
    hidden = torch.randn(3, 19, h, generator=gen)
    weight = torch.randn(padded, h, generator=gen) * 0.5
    weight[V:] = 0  # megatron's padding rows
    shard = weight[rank * padded // tp:(rank + 1) * padded // tp]
    targets = torch.randint(0, V, (3, 19), generator=gen)
    w_lp, w_ent = torch.randn(3, 19, generator=gen), torch.randn(3, 19, generator=gen)
    out = {}
    for mode in ("whole", "fused"):
        x, w = hidden.clone().requires_grad_(), shard.clone().requires_grad_()
        xin = copy_to_tensor_model_parallel_region(x)
        if mode == "whole":
            logits = torch.nn.functional.linear(xin, w)
            lp = token_log_probs_from_logits(logits, targets, V, T)
            ent = vocab_parallel_entropy(logits / T, V)
        else:
            lp, ent = fused_log_probs(xin, w, targets, V, T, chunk=4)
        ((lp * w_lp).sum() + (ent * w_ent).sum()).backward()
        out[mode] = {"log_probs": lp.detach(), "entropy": ent.detach(), "hidden_grad": x.grad, "weight_grad": w.grad}
    return out


def ppo_batch():
    """A sealed PPO batch whose rows have ragged lengths (1-17 response tokens)."""
    from megarl.control.batch import collate
    from megarl.experience.schema import ExperienceFacts, SamplingConfig

    v = version()
    s = make_samples(v, [[ok_record(float(c == j % G)) for c in range(G)] for j in range(GROUPS)])
    gen = torch.Generator().manual_seed(7)
    lens = [17 if i % G == 0 else 1 + (i * 5) % 9 for i in range(len(s))]
    resp = [tuple(int(t) for t in torch.randint(5, 290, (n,), generator=gen)) for n in lens]
    lps = [-0.1 * torch.rand(n, generator=gen) for n in lens]
    c = collate([x.prompt_ids for x in s], resp, lps, pad_id=0)
    m = c.response_mask.float()
    facts = ExperienceFacts(
        run_id="run", iteration=0, prompt_id=tuple(x.prompt_id for x in s), group_id=tuple(x.group_id for x in s),
        sample_id=tuple(x.sample_id for x in s), prompt_ids=c.prompt_ids, response_ids=c.response_ids,
        attention_mask=c.attention_mask, response_mask=c.response_mask,
        finish_reason=tuple(x.finish_reason for x in s), policy_version=tuple(x.policy_version for x in s),
        sampling=SamplingConfig(n=G, max_new_tokens=17), request_id=tuple(x.request_id for x in s),
        seed=tuple(x.seed for x in s), rewards=tuple(x.record for x in s),
        rollout_log_probs=LogProbs(c.rollout_log_probs, LogProbProducer("rollout", v.short_id)),
        old_log_probs=LogProbs(c.rollout_log_probs.clone(), LogProbProducer("actor", v.short_id)),
        ref_log_probs=LogProbs((c.rollout_log_probs - 0.03) * m, LogProbProducer("reference", "ref-0")),
        values=torch.randn(m.shape, generator=gen) * m, critic_version="critic-0")
    derived = DerivedTensors(advantages=torch.randn(m.shape, generator=gen) * m, loss_mask=c.response_mask.clone(),
                             returns=torch.randn(m.shape, generator=gen) * m, estimator="gae",
                             hyperparameters={"note": "hand-built"})
    return v, with_derived(seal(ExperienceBatch(facts)), derived)


def update(a, tp, pp, sp, budget, chunk=0):
    from megatron.core import parallel_state as ps

    cfg = load_config(PPO_RECIPE, OVERRIDES + [f"algo.micro_batch_tokens={budget}", f"algo.log_prob_chunk={chunk}"])
    actor = Actor(a.hf, tp, pp, cfg.actor.optim, total_steps=4, vocab_multiple=16, sequence_parallel=sp,
                  log_prob_chunk=chunk)
    critic = Critic(cfg.critic, actor.model, tp, pp, total_steps=4, vocab_multiple=16, sequence_parallel=sp)
    v, batch = ppo_batch()
    learner = Learner(cfg, actor=actor, critic=critic, sm=sm_sealed(v, batch.facts.batch_size, GROUPS),
                      kl_ctl=FixedKLController(cfg.algo.kl.beta), counters=Counter(),
                      dp=ps.get_data_parallel_world_size(), sync_dtype=None, rank0=rt.is_main(), ckpt_root=a.out)
    seen = []  # per optimizer step of each role: (packed, rows, real tokens, filler micro-batch) per micro-batch

    def recording(role):
        step = role.train_step

        def train_step(mbs, loss_fn, **kw):
            seen.append([("packed" in mb, mb["tokens"].shape[0], int((mb["prompt_lens"] + mb["response_lens"]).sum()),
                          not mb["loss_mask"].any()) for mb in mbs])
            return step(mbs, loss_fn, **kw)

        role.train_step = train_step

    recording(actor)
    recording(critic)
    shard = 304 // tp  # the padded vocabulary (300 -> 304) over the TP ranks
    f = batch.facts
    with vocab_probe(shard) as forward_probe:  # the forward-only log-probs of the rollout's tokens
        forward_lp = actor.log_probs(f.prompt_ids, f.response_ids, f.attention_mask, 2, micro_batch_tokens=budget)
    with vocab_probe(shard) as update_probe:
        metrics = learner.update(0, batch, v)
    refusal = None
    if chunk and ps.is_pipeline_last_stage():
        try:  # a value head is no vocabulary output layer: refused by key, never silently the logits
            with critic_head(critic, chunk):
                pass
        except ValueError as e:
            refusal = str(e)
    return {"metrics": metrics, "micro_batches": seen, "actor": {k: t.clone() for k, t in iter_hf_tensors(actor.ddp)},
            "critic": {k: t.clone() for k, t in iter_hf_tensors(critic.ddp)}, "forward_log_probs": forward_lp,
            "probe": {"forward": max_over_ranks(forward_probe[0]), "update": max_over_ranks(update_probe[0])},
            "value_head_refusal": refusal}


def critic_head(critic, chunk):
    from megarl.models.fused_output import output_head

    return output_head(critic.ddp, 300, chunk)


def max_over_ranks(n: int) -> int:
    """The most over the ranks (the last pipeline stage holds the logits)."""
    t = torch.tensor([n])
    torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
    return int(t)


@contextlib.contextmanager
def vocab_probe(vocab_shard: int):
    """While open: the most positions of this rank's vocabulary shard that any tensor created holds
    -- the model's forward, the loss, the backward, the optimizer step -- as ``probe[0]``.  A tensor whose last dimension is the shard's ``vocab_shard`` columns holds
    ``numel / vocab_shard`` positions of it; a view or an in-place op of an input is no new tensor."""
    from torch.utils._python_dispatch import TorchDispatchMode

    probe = [0]

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            given = {x.untyped_storage().data_ptr() for x in (*args, *(kwargs or {}).values())
                     if isinstance(x, torch.Tensor)}
            for t in (out if isinstance(out, (tuple, list)) else (out,)):
                if isinstance(t, torch.Tensor) and t.is_floating_point() and t.dim() and \
                        t.shape[-1] == vocab_shard and t.untyped_storage().data_ptr() not in given:
                    probe[0] = max(probe[0], t.numel() // vocab_shard)
            return out

    with Record():
        yield probe


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--hf", required=True)
    p.add_argument("--out", required=True)
    a = p.parse_args()
    results = {"chunk": CHUNK}
    for tag, tp, pp, sp in (("tp2", 2, 1, False), ("pp2", 1, 2, False), ("dp2", 1, 1, False), ("tp2sp", 2, 1, True)):
        rt.initialize(tp=tp, pp=pp)
        results[tag] = {"padded": update(a, tp, pp, sp, 0), "tokens": update(a, tp, pp, sp, BUDGET),
                        "chunked": update(a, tp, pp, sp, BUDGET, chunk=CHUNK)}
        if tag == "tp2":
            results["chunked_functions_tp2"] = chunked_functions()
            results["fused_functions_tp2"] = fused_functions()
    if rt.is_main():
        torch.save(results, os.path.join(a.out, "token_budget.pt"))
    rt.shutdown()


if __name__ == "__main__":
    main()
