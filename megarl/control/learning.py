"""Learning: the update of v on its sealed batch, and the recovery when it fails.

``ppo_epochs`` x ``num_mini_batches`` optimizer steps; each mini-batch holds whole groups
(seeded shuffle) and is padded to equal micro-batches on every DP rank with rows whose loss
mask is 0 -- or, with ``algo.micro_batch_tokens``, packed into token-budget micro-batches, as many
on every DP rank (:mod:`megarl.models.micro_batches`) -- so every rank runs the same number of
forward/backward passes under one global normaliser.  The actor (and critic) step through megatron's forward-backward schedule, so PP
works.  A step is *guarded*: an exception or a non-finite grad norm on any rank makes every
rank abandon the update together; the actor and critic are then rolled back to v from a host
snapshot (proven by the weight manifest on every rank) and the update is retried, skipped or
the run stops, as ``trainer.on_update_failure`` says.
"""

from __future__ import annotations

import math
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Dict, List

import torch

from megarl.algo.aggregation import global_normaliser, masked_mean
from megarl.algo.kl import KLConfig, kl_k1
from megarl.algo.policy_loss import PolicyLossConfig
from megarl.control.batch import plan_mini_batches
from megarl.control.state_machine import IterationStateMachine
from megarl.errors import MegarlError
from megarl.experience.schema import ExperienceBatch
from megarl.models.micro_batches import pad_columns, padded_micro_batches, rank_rows, token_micro_batches
from megarl.models.flops import train_flops
from megarl.models.fused_output import output_head
from megarl.models.router_replay import record_to_rows
from megarl.models.weights import unwrap
from megarl.observability.metrics import StageTimer
from megarl.roles.common import sequence_length, step_tensors
from megarl.roles.losses import policy_loss_fn, sft_loss_fn, value_loss_fn, with_sft
from megarl.rollout.weight_stream import TensorManifest
from megarl.rollout.weight_sync import actor_manifest
from megarl.runtime.data_parallel import all_ranks_agree, dp_rank, gather_objects
from megarl.versions import PolicyVersion


class UpdateFailure(MegarlError, RuntimeError):
    """The update of v failed on some rank (an exception, a non-finite loss or grad norm); every
    rank raises it together, after agreeing on it."""


def policy_loss_config(cfg) -> PolicyLossConfig:
    a = cfg.algo
    return PolicyLossConfig(
        name=a.policy_loss, clip_low=a.clip_low, clip_high=a.clip_high, dual_clip=a.dual_clip,
        agg_mode=a.agg_mode, entropy_coef=a.entropy_coef, sapo_tau_pos=a.sapo_tau_pos, sapo_tau_neg=a.sapo_tau_neg,
        kl=KLConfig(placement=a.kl.placement, estimator=a.kl.estimator, beta=a.kl.beta),
        old_log_prob_roles=(("actor", "rollout") if cfg.rollout.reuse_rollout_log_probs
                            else ("actor", "engine") if cfg.async_rl.proximal_log_probs == "engine" else ("actor",)),
        log_prob_space="raw")


@dataclass
class _StepLog:
    """What one update's optimizer steps reported, in order."""

    actor: List[Dict[str, float]] = field(default_factory=list)
    critic: List[Dict[str, float]] = field(default_factory=list)
    grad_norms: List[float] = field(default_factory=list)
    critic_norms: List[float] = field(default_factory=list)
    skipped: int = 0
    actor_steps: int = 0
    seconds: Dict[str, float] = field(default_factory=dict)  # the steps' StepResult.seconds, summed

    def add_seconds(self, res) -> None:
        for k, v in getattr(res, "seconds", {}).items():
            self.seconds[k] = self.seconds.get(k, 0.0) + v


class Learner:
    """Args: ``cfg`` the run config (reads ``algo``, ``critic`` and the update keys of
    ``trainer``); ``actor`` the actor role (or its fault-injecting wrapper); ``critic`` or None;
    ``kl_ctl`` the KL coefficient controller (updated here when adaptive); ``sync_dtype`` the
    dtype manifests are computed in; ``counters`` the run's counters."""

    def __init__(self, cfg, *, actor, critic, sm: IterationStateMachine, kl_ctl, counters: Counter, dp: int,
                 sync_dtype, rank0: bool, ckpt_root: str, demonstrations=None, pad_id: int = 0):
        from megarl.roles.rollback import UpdateSnapshot

        a = cfg.algo
        self.cfg, self.actor, self.critic, self.sm, self.kl_ctl = cfg, actor, critic, sm, kl_ctl
        self.counters, self.dp, self.sync_dtype, self.rank0, self.ckpt_root = counters, dp, sync_dtype, rank0, ckpt_root
        self.policy_cfg = policy_loss_config(cfg)
        self.norm_constant = float(cfg.rollout.max_new_tokens) if a.agg_mode == "seq-mean-token-sum-norm" else None
        self.snapshots = {"actor": UpdateSnapshot(), "critic": UpdateSnapshot()}
        self.update_attempt = 0  # failed attempts rolled back before the last update succeeded
        self.snapshot_s = self.snapshot_bytes = 0
        self.critic_version_at_snapshot = None
        #: the last update ran every planned step to the end on this rank (the commit's evidence)
        self.completed = False
        #: algo.sft: the demonstrations and their cursor (as it stood when the update began, for a rollback)
        self.demos, self.pad_id, self.demos_at_start = demonstrations, pad_id, None

    # ---- the update with its recovery --------------------------------------------------------

    def update_with_recovery(self, k: int, batch: ExperienceBatch, version: PolicyVersion,
                             manifest: TensorManifest, timer: StageTimer) -> Dict[str, float]:
        """Update on ``batch``; on a failure roll back to ``version`` (named by ``manifest``)
        and retry, skip (``update/skipped_batch``) or raise, per ``trainer.on_update_failure``."""
        t = self.cfg.trainer
        failures = 0
        while True:
            try:
                with timer.stage("update", samples=batch.facts.batch_size,
                                 groups=len(set(batch.facts.group_id)), attempt=failures):
                    out = self.update(k, batch, version)
                self.update_attempt = failures  # the committed version records it (v<step>.<attempt>)
                return out
            except UpdateFailure as e:
                failures += 1
                self.counters["update_failures"] += 1
                self.sm.fail(str(e))
                if self.rank0:
                    print(f"iteration {k}: {e}", file=sys.stderr, flush=True)
                if t.on_update_failure == "stop" or (t.on_update_failure == "retry" and failures > t.max_update_retries):
                    raise UpdateFailure(f"iteration {k}: the update failed {failures} time(s), "
                                        f"trainer.on_update_failure={t.on_update_failure}, "
                                        f"max_update_retries={t.max_update_retries}; restart from the last "
                                        f"checkpoint in {self.ckpt_root} (resume=auto). Last failure: {e}") from e
                with timer.stage("rollback"):
                    self.rollback(version, manifest)
                if t.on_update_failure == "skip":
                    self.sm.recover(version)
                    self.counters["updates_skipped"] += 1
                    return {"update/skipped_batch": 1.0}
                self.sm.retry_update(version)
                self.counters["update_retries"] += 1

    def rollback(self, version: PolicyVersion, manifest: TensorManifest) -> None:
        """Actor (and critic) back to the committed v, proven by the weight manifest on every rank."""
        from megarl.roles.rollback import RollbackError

        self.actor.steps = self.snapshots["actor"].restore(self.actor.ddp, self.actor.optimizer, self.actor.scheduler)
        if self.demos is not None:  # the retried update draws the demonstrations the failed one drew
            self.demos.sampler.load_state_dict(self.demos_at_start)
        if self.critic is not None:
            self.critic.steps = self.snapshots["critic"].restore(self.critic.ddp, self.critic.optimizer,
                                                                 self.critic.scheduler)
            self.critic.version = self.critic_version_at_snapshot
        restored = gather_objects(actor_manifest(self.actor.ddp, dtype=self.sync_dtype).global_hash)
        bad = [i for i, h in enumerate(restored) if h != manifest.global_hash]
        if bad:
            raise RollbackError(f"rollback: ranks {bad} hold weights whose manifest is not the committed "
                                f"{version.short_id}'s ({manifest.global_hash})")
        self.counters["update_rollbacks"] += 1

    def _take_snapshot(self) -> None:
        self.critic_version_at_snapshot = self.critic.version if self.critic is not None else None
        t0 = time.perf_counter()
        nbytes = self.snapshots["actor"].take(self.actor.ddp, self.actor.optimizer, self.actor.scheduler,
                                              self.actor.steps)
        if self.critic is not None:
            nbytes += self.snapshots["critic"].take(self.critic.ddp, self.critic.optimizer,
                                                    self.critic.scheduler, self.critic.steps)
        self.snapshot_s, self.snapshot_bytes = time.perf_counter() - t0, nbytes

    # ---- one update ----------------------------------------------------------------------------

    def update(self, k: int, batch: ExperienceBatch, version: PolicyVersion) -> Dict[str, float]:
        """``algo.ppo_epochs`` passes over ``batch`` in mini-batches of whole groups, one optimizer
        step of the actor (after the critic's warm-up) and of the critic per mini-batch."""
        cfg, a = self.cfg, self.cfg.algo
        self.completed = False
        self._begin_update()
        columns, replay_layers = self._update_columns(batch)
        gen = torch.Generator().manual_seed(cfg.trainer.seed * 7919 + k)
        log = _StepLog()
        train_actor = self.critic is None or k >= cfg.critic.warmup_iters
        kl_beta = self.kl_ctl.value
        for _epoch in range(a.ppo_epochs):
            for plan in plan_mini_batches(batch.facts.group_id, a.num_mini_batches, self.dp, a.micro_batch_size, gen):
                norm = global_normaliser(batch.derived.loss_mask[plan.rows], a.agg_mode, norm_constant=self.norm_constant)
                if a.micro_batch_tokens:
                    mbs = token_micro_batches(columns, plan.rows, a.micro_batch_tokens, dp_rank(), self.dp)
                    actor_mbs, critic_mbs = mbs, mbs
                else:
                    rows, is_pad = plan.rank_rows(dp_rank(), self.dp)
                    local = rank_rows(columns, rows, is_pad)
                    actor_mbs = padded_micro_batches(local, a.micro_batch_size)
                    critic_mbs = padded_micro_batches(local, cfg.critic.micro_batch_size) if self.critic else None
                if train_actor:
                    self._actor_step(batch, version, actor_mbs, norm, kl_beta, replay_layers, log)
                if self.critic is not None:
                    self._critic_step(batch, critic_mbs, norm, log)
        m = self._update_metrics(log, kl_beta)
        m.update(self._model_flops(batch, train_actor))
        self._adapt_kl(batch)
        self.completed = True
        return m

    def _model_flops(self, batch: ExperienceBatch, train_actor: bool) -> Dict[str, float]:
        """``update/model_flops``: the update's forward and backward passes over every real token,
        ``algo.ppo_epochs`` times, by the PaLM count (:mod:`megarl.models.flops`)."""
        spec = getattr(self.actor, "spec", None)
        if spec is None:
            return {}
        lengths = batch.facts.attention_mask.sum(dim=1).tolist()
        flops = train_flops(spec, spec.padded_vocab_size(self.cfg.model.vocab_multiple), lengths) if train_actor else 0.0
        if self.critic is not None:
            flops += train_flops(unwrap(self.critic.ddp).megarl_spec, 0, lengths)
        return {"update/model_flops": flops * self.cfg.algo.ppo_epochs}

    def _begin_update(self) -> None:
        self.sm.begin_update()
        if self.demos is not None:
            self.demos_at_start = self.demos.sampler.state_dict()
        self.actor.onload()
        if self.critic is not None:
            self.critic.onload()
        if self.cfg.trainer.update_rollback == "memory":
            self._take_snapshot()

    def _update_columns(self, batch: ExperienceBatch):
        """The per-row tensors the update's micro-batches are cut from, and the MoE layers whose
        routing is replayed (None: no replay).  A variant of the update adds its columns here: the
        reference log-probs (KL in the loss), the rollout-correction weights, the critic's old
        values and returns, the recorded routing (``algo.routing_replay=rollout``: every update
        forward dispatches as the rollout did)."""
        f, d = batch.facts, batch.derived
        L = sequence_length(f.attention_mask)
        st = step_tensors(f.prompt_ids, f.response_ids, f.attention_mask, L)
        columns = {"tokens": st["tokens"], "prompt_lens": st["prompt_lens"], "response_lens": st["response_lens"],
                   "old_log_probs": f.old_log_probs.values, "advantages": d.advantages, "loss_mask": d.loss_mask}
        if self.policy_cfg.kl.placement == "loss":
            columns["ref_log_probs"] = f.ref_log_probs.values
        if d.is_weights is not None:  # algo.rollout_correction.token_is_cap
            columns["is_weights"] = d.is_weights
        if self.critic is not None:
            columns["old_values"] = f.values
            columns["returns"] = d.returns
        replay_layers = None
        if self.cfg.algo.routing_replay == "rollout":
            routed = f.routed_experts
            rows = record_to_rows(routed.experts, f.attention_mask, f.prompt_ids.shape[1], routed.moe_layers, L)
            columns["routing"], columns["routing_valid"] = rows.experts, rows.valid
            replay_layers = routed.moe_layers
        return columns, replay_layers

    def _actor_step(self, batch, version, mbs, norm, kl_beta: float, replay_layers, log: "_StepLog"):
        f = batch.facts
        kl_in_loss = self.policy_cfg.kl.placement == "loss"
        chunk = self.cfg.algo.log_prob_chunk  # the model's output: logits, or hidden states (fused_output)
        with output_head(self.actor.ddp if chunk else None, self.actor.vocab_size, chunk) as head:
            loss_fn = policy_loss_fn(
                head=head, response_len=f.response_len, cfg=self.policy_cfg, normaliser=norm, kl_beta=kl_beta,
                old_producer=f.old_log_probs.producer,
                ref_producer=f.ref_log_probs.producer if f.ref_log_probs is not None else None,
                kl_in_loss=kl_in_loss, entropy_grad=self.cfg.algo.entropy_coef > 0, old_version=version.short_id)
            if self.demos is not None:
                mbs, loss_fn = self._with_demonstrations(mbs, loss_fn, head)
            res = self._guarded_step("actor", lambda: self.actor.train_step(mbs, loss_fn,
                                                                            replay_layers=replay_layers))
        log.grad_norms.append(res.grad_norm)
        log.add_seconds(res)
        log.skipped += 0 if res.update_successful else 1
        log.actor.append(self._reduce_step_metrics(res.metrics))
        log.actor[-1].update(res.moe_losses)  # update/moe_aux_loss, update/moe_z_loss when enabled
        log.actor_steps += 1

    def _with_demonstrations(self, mbs: List[dict], policy_loss, head):
        """``algo.sft``: this step's demonstration rows drawn (the same on every rank), this DP
        rank's share cut into micro-batches of the step's kind (padded: as many rows and one width
        as the RL ones, rows that only even out the ranks masked; packed: under the same token
        budget, as many on every rank) after the RL ones, and the loss that tells them apart."""
        a = self.cfg.algo
        cols = self.demos.columns(self.demos.draw(), self.pad_id)
        tokens = int(cols["loss_mask"].sum())  # the SFT term's own normaliser: every rank's rows
        n, rank = cols["tokens"].shape[0], dp_rank()
        if a.micro_batch_tokens:
            demo = token_micro_batches(cols, torch.arange(n), a.micro_batch_tokens, rank, self.dp)
        else:
            size = mbs[0]["tokens"].shape[0]  # every micro-batch of a padded step is [rows, width]
            per = -(-n // self.dp)
            per = -(-per // size) * size
            rows = torch.arange(rank * per, (rank + 1) * per)
            local = rank_rows(cols, rows % n, rows >= n)
            demo = padded_micro_batches(local, size)
            width = max(mb["tokens"].shape[1] for mb in [*mbs, *demo])
            mbs = [dict(mb, tokens=pad_columns(mb["tokens"], width)) for mb in mbs]
            demo = [dict(mb, tokens=pad_columns(mb["tokens"], width)) for mb in demo]
        sft = sft_loss_fn(head=head, coef=a.sft.coef, tokens=tokens)
        return [*mbs, *(dict(mb, megarl_sft=True) for mb in demo)], with_sft(policy_loss, sft)

    def _critic_step(self, batch, cmbs, norm, log: "_StepLog"):
        vloss = value_loss_fn(response_len=batch.facts.response_len, value_clip=self.critic.value_clip,
                              agg_mode=self.cfg.algo.agg_mode, normaliser=norm)
        cres = self._guarded_step("critic", lambda: self.critic.train_step(cmbs, vloss))
        log.critic_norms.append(cres.grad_norm)
        log.add_seconds(cres)
        log.critic.append(self._reduce_step_metrics(cres.metrics))

    def _update_metrics(self, log: "_StepLog", kl_beta: float) -> Dict[str, float]:
        m = combine_steps(log.actor, "update/")
        m.update(combine_steps(log.critic, "update/critic_"))
        if log.actor:
            m["update/first_step_pg_loss"] = log.actor[0].get("pg_loss", float("nan"))
        if log.grad_norms:
            m["update/grad_norm"] = sum(log.grad_norms) / len(log.grad_norms)
            m["update/grad_norm_max"] = max(log.grad_norms)
        if log.critic_norms:
            m["update/critic_grad_norm"] = sum(log.critic_norms) / len(log.critic_norms)
        m["update/skipped_steps"] = log.skipped
        sec = log.seconds
        if sec.get("micro_batches"):  # where the steps went on this rank (actor and critic together)
            m["update/micro_batch_s"] = (sec["forward_backward_s"] - sec["grad_reduce_s"]) / sec["micro_batches"]
            m["update/grad_reduce_s"] = sec["grad_reduce_s"]
            m["update/optimizer_step_s"] = sec["optimizer_s"]
        if self.cfg.trainer.update_rollback == "memory":  # the host copy of v a failed update would return to
            m["update/snapshot_s"], m["update/snapshot_bytes"] = self.snapshot_s, float(self.snapshot_bytes)
        m["update/optimizer_steps"] = len(log.grad_norms)
        m["update/policy_lag_max"] = max(log.actor_steps - 1, 0)
        m["update/lr"] = self.actor.lr
        m["update/kl_beta"] = kl_beta
        self.counters["skipped_steps"] += log.skipped
        return m

    def _adapt_kl(self, batch: ExperienceBatch) -> None:
        """The adaptive KL controller sees the batch's k1 KL of the old policy to the reference."""
        f = batch.facts
        if self.cfg.algo.kl.adaptive and f.ref_log_probs is not None:
            keep = f.response_mask != 0
            cur = float(masked_mean(kl_k1(f.old_log_probs.values, f.ref_log_probs.values), keep))
            self.kl_ctl.update(cur, f.batch_size)

    def _guarded_step(self, role: str, step):
        """One optimizer step that every rank either completes or abandons together: an
        exception here or a non-finite grad norm anywhere makes every rank raise
        :class:`UpdateFailure` (after an all-reduce of the status), before the next collective.
        An exception that leaves a peer blocked inside a collective cannot be recovered in
        process; the job's collective timeout ends it and ``resume=auto`` restarts it."""
        res, error = None, None
        try:
            res = step()
            if not math.isfinite(res.grad_norm):
                error = f"non-finite {role} grad norm {res.grad_norm}"
        except Exception as e:  # noqa: BLE001 -- any failure of the step is rolled back
            error = f"{type(e).__name__}: {e}"
        if all_ranks_agree(error is None):
            self.sm.check_deadline(agree=all_ranks_agree)
            return res
        errors = [f"rank {i}: {e}" for i, e in enumerate(gather_objects(error)) if e is not None]
        raise UpdateFailure(f"{role} update failed ({'; '.join(errors)})")

    #: per-micro-batch values that are shares of the step's global loss: they add up
    _SHARES = ("pg_loss", "kl_loss", "entropy", "value_loss", "sft_nll")

    def _reduce_step_metrics(self, local: List[Dict[str, float]]) -> Dict[str, float]:
        """One optimizer step's micro-batch metrics (they live on the last PP stage) reduced over
        micro-batches and DP ranks: loss shares summed, ratio tails min / max, the rest
        token-weighted means.  Each replica reports once: its TP ranks and its context-parallel
        ranks computed the same loss of the same rows (summing them would count every row cp times)."""
        from megatron.core import parallel_state as ps

        reporter = (ps.is_pipeline_last_stage() and ps.get_tensor_model_parallel_rank() == 0
                    and ps.get_context_parallel_rank() == 0)
        mine = local if reporter else []
        allm = [d for part in gather_objects(mine) for d in part]
        out: Dict[str, float] = {}
        for key in sorted({k for d in allm for k in d}):
            pairs = [(float(d[key]), float(d.get("tokens", 1.0))) for d in allm if key in d]
            vals = [v for v, _ in pairs]
            if key in self._SHARES or key == "tokens":
                out[key] = sum(vals)
            elif key.endswith("_max"):
                out[key] = max(vals)
            elif key.endswith("_min"):
                out[key] = min(vals)
            else:
                w = sum(t for _, t in pairs)
                out[key] = sum(v * t for v, t in pairs) / w if w > 0 else sum(vals) / len(vals)
        return out


def combine_steps(steps: List[Dict[str, float]], prefix: str) -> Dict[str, float]:
    """Per-step metrics -> per-iteration: means over steps (tails: min / max, tokens: sum)."""
    out: Dict[str, float] = {}
    for key in sorted({k for d in steps for k in d}):
        vals = [d[key] for d in steps if key in d]
        if key.endswith("_max"):
            out[prefix + key] = max(vals)
        elif key.endswith("_min"):
            out[prefix + key] = min(vals)
        elif key == "tokens":
            out[prefix + key] = sum(vals)
        else:
            out[prefix + key] = sum(vals) / len(vals)
    if prefix == "update/" and "update/pg_loss" in out:
        out["update/policy_loss"] = out["update/pg_loss"]
    return out
