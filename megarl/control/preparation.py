"""Preparation: the produced samples -> a sealed experience batch with its advantages.

The facts of the batch are computed on version v before any update and sealed (read-only,
content-hashed, equal on every rank): old log-probs by the actor (or the rollout engine's own
raw-space log-probs after a measured token-by-token parity check), reference log-probs, critic
values.  The state machine reaches EXPERIENCE_SEALED(v) only when every sample was written,
every group is complete and every sample records v (or, from an asynchronous producer, a
version at most ``ProducedRollout.max_staleness`` steps older: then ``async_rl.correction``
corrects the behaviour-vs-proximal gap, :mod:`megarl.algo.derivation`).
Advantages and returns are derived tensors attached to the sealed facts, computed by the
estimator the registry names, fed what its entry declares it needs.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Dict, Optional

import torch

from megarl.algo.aggregation import masked_mean
from megarl.algo.derivation import DerivationSettings, derive
from megarl.algo.kl import kl_k1, kl_k3
from megarl.algo.registry import advantage_needs
from megarl.algo.rollout_correction import RolloutCorrectionConfig, async_correction_config
from megarl.algo.routing import routing_load_metrics
from megarl.control.batch import collate, collate_trajectories
from megarl.control.interfaces import ProducedRollout, RunProgress
from megarl.control.state_machine import IterationStateMachine, SealEvidence
from megarl.errors import MegarlError
from megarl.experience.packing import unpadded_rows
from megarl.experience.schema import ExperienceBatch, ExperienceFacts, LogProbProducer, LogProbs
from megarl.experience.seal import save_sealed, seal, with_derived
from megarl.experience.staleness import StalenessError, check_staleness, staleness_metrics
from megarl.models.router_replay import RecordRouting, RoutingStats
from megarl.observability.metrics import StageTimer
from megarl.runtime import data_parallel
from megarl.runtime.data_parallel import broadcast_object, gather_objects, local_rows, map_rows
from megarl.versions import PolicyVersion


class RolloutParityError(MegarlError, RuntimeError):
    """Rollout log-probs disagree with the actor's beyond ``rollout.log_prob_parity_tol``: reusing
    them as old log-probs would change the PPO ratio, so the run stops (exit 2)."""


def agent_origins(k: int, samples):
    """Agent trajectories: each token's source (policy or environment), turn and version, as the
    session recorded them (None: not an agent batch)."""
    if not any(s.episode is not None for s in samples):
        return None
    if not all(s.episode is not None for s in samples):
        raise RuntimeError(f"iteration {k}: agent trajectories mixed with single-turn samples in one batch")
    ep = [s.episode for s in samples]
    return [t.source for t in ep], [t.turn for t in ep], [t.token_versions for t in ep]


def inflight_origins(k: int, samples):
    """Responses that span versions (in-flight weight updates): every token keeps its own
    version, all of them policy tokens of one turn (None: no response spans versions)."""
    if not any(s.token_versions is not None for s in samples):
        return None
    return ([[1] * len(s.response_ids) for s in samples], [[0] * len(s.response_ids) for s in samples],
            [s.token_versions or (s.policy_version,) * len(s.response_ids) for s in samples])


#: the variants whose records carry per-token origins, asked in order (the first that answers
#: collates the batch); a batch none answers for is single-turn on one version each
TOKEN_ORIGINS = (agent_origins, inflight_origins)


@dataclass(frozen=True)
class LogProbParity:
    """The rollout's log-prob reuse keys (``rollout.reuse_rollout_log_probs``,
    ``log_prob_parity_every``, ``log_prob_parity_tol``): reuse the engine's log-probs as the
    proximal ones, after a parity check against the actor on the first iteration and every
    ``every`` after it (0: the first only), failing above ``tol``."""

    reuse: bool = False
    every: int = 0
    tol: float = 0.0

    @classmethod
    def of(cls, rollout) -> "LogProbParity":
        return cls(rollout.reuse_rollout_log_probs, rollout.log_prob_parity_every, rollout.log_prob_parity_tol)


class ExperiencePreparer:
    """Args: ``algo`` and ``async_rl`` the config sections it reads; ``parity`` the rollout's
    log-prob reuse keys;
    ``actor`` / ``reference`` / ``critic`` the roles (reference and critic may be None);
    ``time_slice`` releases the rollout engine's GPU memory before the forwards; ``kl_ctl`` the
    KL coefficient controller (read for KL-shaped rewards); ``progress`` holds whether parity
    was checked; ``save_dir`` where ``trainer.save_experience`` writes each sealed batch."""

    def __init__(self, algo, async_rl, parity: LogProbParity, *, actor, reference, critic, time_slice,
                 sm: IterationStateMachine, kl_ctl, progress: RunProgress, pad_id: int, run_id: str,
                 save_dir: Optional[str], proximal_engine=None, rollout_precision: str = "", teacher=None):
        a = self.algo = algo
        self.parity = parity
        #: the dtype each log-prob producer computed in, for the record (the engine's: its sync dtype)
        self.precision = {"rollout": rollout_precision, "engine": rollout_precision,
                          "actor": getattr(actor, "precision", ""),
                          "reference": getattr(reference, "precision", "") if reference is not None else "",
                          "teacher": getattr(teacher, "precision", "") if teacher is not None else ""}
        #: async_rl.proximal_log_probs=engine: the rollout engine scores the proximal log-probs
        #: (``proximal_engine``: the remote handle, on the rank that holds it; None on the others)
        self.proximal_from_engine = async_rl.proximal_log_probs == "engine"
        self.proximal_engine = proximal_engine
        self.actor, self.reference, self.critic, self.teacher = actor, reference, critic, teacher
        self.time_slice, self.sm, self.kl_ctl, self.progress = time_slice, sm, kl_ctl, progress
        self.pad_id, self.run_id, self.save_dir = pad_id, run_id, save_dir
        self.needs = advantage_needs(a.advantage)
        self.whiten = bool(self.needs.critic and a.whiten_advantages)
        rc = a.rollout_correction
        self.correction = (RolloutCorrectionConfig(token_is_cap=rc.token_is_cap, seq_mask_threshold=rc.seq_mask_threshold,
                                                   seq_mask_stat=rc.seq_mask_stat)
                           if rc.token_is_cap is not None or rc.seq_mask_threshold is not None else None)
        self.async_eta, self.offpolicy = _offpolicy_settings(async_rl)
        if self.offpolicy is not None and self.correction is not None:  # both would weight the same gap
            raise ValueError("algo.rollout_correction and async_rl.correction are both set: use one")

    def prepare(self, k: int, version: PolicyVersion, produced: ProducedRollout, timer: StageTimer):
        """Returns the sealed batch with its derived tensors, and the ``prep/*`` metrics."""
        v = version.short_id
        samples = produced.samples
        t_ready = time.perf_counter()  # the produced samples wait from here for each role's forward
        c = self._collate(k, samples, v)
        m: Dict[str, float] = {}
        self.time_slice.release()
        self.actor.onload()
        ntok = float(c.attention_mask.sum())
        # the behaviour policy: v, or every older version that generated a policy token (async)
        rollout_lp = LogProbs(c.rollout_log_probs, LogProbProducer("rollout", c.behaviour_version, "raw", self.precision["rollout"]))
        keep = c.response_mask != 0
        if self.proximal_from_engine:  # the engine scores while the trainer runs its own forwards
            t0 = time.perf_counter()
            job = self._submit_proximal(c, v)
            ref = self._reference_log_probs(c, keep, len(samples), ntok, timer, m)
            values, bootstrap = self._critic_values(c, keep, len(samples), ntok, timer, m)
            old = self._engine_old_log_probs(k, v, c, job, t0, len(samples), ntok, timer, m)
        else:
            old = self._old_log_probs(k, v, c, rollout_lp, len(samples), ntok, timer, m)
            ref = self._reference_log_probs(c, keep, len(samples), ntok, timer, m)
            values, bootstrap = self._critic_values(c, keep, len(samples), ntok, timer, m)
        teacher = self._teacher_log_probs(c, len(samples), ntok, timer, m)
        self._reference_metrics(old, ref, keep, m)
        for stage, role in (("old_log_prob", "actor"), ("ref_log_prob", "reference"), ("critic_values", "critic"),
                            ("teacher_log_prob", "teacher")):
            if stage in timer.started:  # how long the batch waited for the role (the roles before it, time-sliced)
                m[f"prep/queue_s/{role}"] = timer.started[stage] - t_ready
        facts = ExperienceFacts(
            run_id=self.run_id, iteration=k,
            prompt_id=tuple(s.prompt_id for s in samples), group_id=tuple(s.group_id for s in samples),
            sample_id=tuple(s.sample_id for s in samples),
            prompt_ids=c.prompt_ids, response_ids=c.response_ids, attention_mask=c.attention_mask,
            response_mask=c.response_mask, finish_reason=tuple(s.finish_reason for s in samples),
            policy_version=tuple(s.policy_version for s in samples),
            sampling=produced.sampling, request_id=tuple(s.request_id for s in samples),
            seed=tuple(s.seed for s in samples), rewards=tuple(s.record for s in samples),
            rollout_log_probs=rollout_lp, old_log_probs=old, ref_log_probs=ref, values=values,
            critic_version=self.critic.version if self.critic is not None else None,
            routed_experts=c.routed_experts, token_origins=c.token_origins, bootstrap_values=bootstrap,
            teacher_log_probs=teacher)
        sealed = self._seal(facts, version, produced, c, m)
        with timer.stage("advantages"):
            derived, adv_m = self.advantages(facts, produced.real_sizes)
        m.update(adv_m)
        batch = with_derived(sealed, derived)
        if self.save_dir is not None:
            save_sealed(batch, os.path.join(self.save_dir, f"iter_{k:06d}"))
        return batch, m

    def _collate(self, k: int, samples, v: str):
        """The samples as padded tensors, with the engine's recorded routing under
        ``algo.routing_replay``, and per-token origins when a variant gives them
        (:data:`TOKEN_ORIGINS`: agent trajectories, responses that span versions)."""
        routing = self._recorded_routing(samples)
        prompts, responses, lps = [s.prompt_ids for s in samples], [s.response_ids for s in samples], \
            [s.raw_log_probs for s in samples]
        versions = [s.policy_version for s in samples]
        for origins_of in TOKEN_ORIGINS:
            origins = origins_of(k, samples)
            if origins is not None:
                source, turn, token_versions = origins
                return collate_trajectories(prompts, responses, lps, source, turn, token_versions, self.pad_id,
                                            routing=routing, version=v, sample_versions=versions)
        return collate(prompts, responses, lps, self.pad_id, routing=routing, version=v, sample_versions=versions)

    def _recorded_routing(self, samples):
        """Each sample's routed experts under ``algo.routing_replay`` (None when off); a sample
        the engine returned none for fails the iteration."""
        a = self.algo
        if a.routing_replay == "none":
            return None
        lacking = [s.sample_id for s in samples if s.routed_experts is None]
        if lacking:
            self.sm.fail("rollout samples without routed experts")
            raise RuntimeError(f"algo.routing_replay={a.routing_replay}, but the engine returned no routed experts for "
                               f"{len(lacking)} sample(s), e.g. {lacking[0]}")
        return [s.routed_experts for s in samples]

    def _old_log_probs(self, k: int, v: str, c, rollout_lp, n: int, ntok: float, timer: StageTimer, m: dict):
        """The proximal (old) log-probs: the rollout's when ``rollout.reuse_rollout_log_probs``
        (after the token-by-token parity check that iteration runs), else the actor's on v (with
        the recorded routing for an MoE batch); the rollout/actor gap in ``m``."""
        a, parity = self.algo, self.parity
        mbs, pack, budget = a.forward_micro_batch_size, a.pack_sequences, a.micro_batch_tokens
        check_parity = parity.reuse and (
            not self.progress.parity_checked or (parity.every > 0 and k % parity.every == 0))
        reuse = parity.reuse and not check_parity
        with timer.stage("old_log_prob", samples=n, tokens=int(ntok)):
            t0 = time.perf_counter()
            if reuse:
                old = rollout_lp
            elif c.routed_experts is not None:
                vals, routing_m = self._old_log_probs_routed(c, mbs, pack, budget)
                old = LogProbs(vals, LogProbProducer("actor", v, "raw", self.precision["actor"]))
                m.update(routing_m)
            else:
                vals = map_rows(lambda *t: self.actor.log_probs(*t, mbs, pack=pack, micro_batch_tokens=budget),
                                c.prompt_ids, c.response_ids, c.attention_mask).cpu()
                old = LogProbs(vals, LogProbProducer("actor", v, "raw", self.precision["actor"]))
            m["prep/old_log_prob_s"] = time.perf_counter() - t0
            m["prep/actor_tokens_per_s"] = ntok / max(m["prep/old_log_prob_s"], 1e-9)
        keep = c.response_mask != 0
        if old.producer.role == "actor":
            diff = (old.values - c.rollout_log_probs).abs()[keep]
            m["prep/rollout_actor_logprob_max_abs_err"] = float(diff.max())
            m["prep/rollout_actor_logprob_mean_abs_err"] = float(diff.mean())
            if check_parity:
                if float(diff.max()) > parity.tol:
                    self.sm.fail("rollout/actor log-prob parity check failed")
                    raise RolloutParityError(
                        f"rollout.reuse_rollout_log_probs: measured max |rollout - actor| log-prob "
                        f"{float(diff.max()):.3e} > rollout.log_prob_parity_tol={parity.tol}")
                self.progress.parity_checked = True
        return old

    def _submit_proximal(self, c, v: str):
        """Send the batch to the rollout engine, which serves v (published before production)."""
        if self.proximal_engine is None:
            return None
        return self.proximal_engine.submit_teacher_force(*unpadded_rows(c.prompt_ids, c.response_ids, c.attention_mask),
                                                       version=v)

    def _engine_old_log_probs(self, k: int, v: str, c, job, t0: float, n: int, ntok: float, timer: StageTimer,
                              m: dict):
        """The proximal log-probs the rollout engine teacher-forced on v (every trainer rank gets
        them from the one holding the engine), checked against the actor's forward on the first
        iteration and every ``rollout.log_prob_parity_every``; the check failing stops the run."""
        with timer.stage("old_log_prob", samples=n, tokens=int(ntok)):
            t1 = time.perf_counter()
            rows = self.proximal_engine.collect(job) if job is not None else None
            rows = broadcast_object(rows)
            m["prep/proximal_engine_wait_s"] = time.perf_counter() - t1  # after the trainer's own forwards
            vals = torch.zeros(c.response_ids.shape, dtype=torch.float32)
            for b, row in enumerate(rows):
                vals[b, :len(row)] = row
            m["prep/proximal_engine_s"] = time.perf_counter() - t0
        old = LogProbs(vals, LogProbProducer("engine", v, "raw", self.precision["engine"]))
        every, a = self.parity.every, self.algo
        if not self.progress.parity_checked or (every > 0 and k % every == 0):
            mbs, pack, budget = a.forward_micro_batch_size, a.pack_sequences, a.micro_batch_tokens
            with timer.stage("proximal_parity", samples=n, tokens=int(ntok)):
                actor = map_rows(lambda *t: self.actor.log_probs(*t, mbs, pack=pack, micro_batch_tokens=budget),
                                 c.prompt_ids, c.response_ids, c.attention_mask).cpu()
            diff = (actor - vals).abs()[c.response_mask != 0]
            m["prep/proximal_engine_actor_max_abs_err"] = float(diff.max())
            if float(diff.max()) > self.parity.tol:
                self.sm.fail("engine/actor proximal log-prob parity check failed")
                raise RolloutParityError(
                    f"async_rl.proximal_log_probs=engine: measured max |engine - actor| log-prob on {v} "
                    f"{float(diff.max()):.3e} > rollout.log_prob_parity_tol={self.parity.tol}")
            self.progress.parity_checked = True
        return old

    def _frozen_log_probs(self, role, stage: str, c, n: int, ntok: float, timer: StageTimer):
        """A frozen role's (reference, teacher) log-probs of the batch's response tokens, and the
        seconds they took."""
        a = self.algo
        mbs, pack, budget = a.forward_micro_batch_size, a.pack_sequences, a.micro_batch_tokens
        with timer.stage(stage, samples=n, tokens=int(ntok)):
            t0 = time.perf_counter()
            vals = role.batch_log_probs(c.prompt_ids, c.response_ids, c.attention_mask, mbs, pack=pack,
                                        micro_batch_tokens=budget)
            return vals, time.perf_counter() - t0

    def _reference_log_probs(self, c, keep, n: int, ntok: float, timer: StageTimer, m: dict):
        """The reference model's log-probs (None without one)."""
        if self.reference is None:
            return None
        vals, m["prep/ref_log_prob_s"] = self._frozen_log_probs(self.reference, "ref_log_prob", c, n, ntok, timer)
        m["prep/ref_tokens_per_s"] = ntok / max(m["prep/ref_log_prob_s"], 1e-9)
        return LogProbs(vals, LogProbProducer("reference", self.reference.version, "raw", self.precision["reference"]))

    def _teacher_log_probs(self, c, n: int, ntok: float, timer: StageTimer, m: dict):
        """On-policy distillation's teacher, teacher-forced on the rollout's tokens (None without one)."""
        if self.teacher is None:
            return None
        vals, m["prep/teacher_log_prob_s"] = self._frozen_log_probs(self.teacher, "teacher_log_prob", c, n, ntok, timer)
        return LogProbs(vals, LogProbProducer("teacher", self.teacher.version, "raw", self.precision["teacher"]))

    @staticmethod
    def _reference_metrics(old, ref, keep, m: dict) -> None:
        """The KL of the proximal policy to the reference, in ``m`` (nothing without a reference)."""
        if ref is None:
            return
        d = (old.values - ref.values)[keep]
        m["prep/old_ref_logprob_max_abs_diff"] = float(d.abs().max())
        m["update/kl_ref"] = float(masked_mean(kl_k3(old.values, ref.values), keep))
        m["update/kl_ref_k1"] = float(masked_mean(kl_k1(old.values, ref.values), keep))

    def _critic_values(self, c, keep, n: int, ntok: float, timer: StageTimer, m: dict):
        """The critic's per-token values and bootstrap values ((None, None) without a critic)."""
        if self.critic is None:
            return None, None
        a = self.algo
        mbs, pack, budget = a.forward_micro_batch_size, a.pack_sequences, a.micro_batch_tokens
        self.critic.onload()
        with timer.stage("critic_values", samples=n, tokens=int(ntok)):
            t0 = time.perf_counter()
            R = c.response_ids.shape[1]

            def crit(*t):
                pt, b = self.critic.values(*t, mbs, pack=pack, micro_batch_tokens=budget)
                return torch.cat([pt, b[:, None]], 1)

            both = map_rows(crit, c.prompt_ids, c.response_ids, c.attention_mask).cpu()
            values, bootstrap = both[:, :R] * keep, both[:, R]
            m["prep/critic_s"] = time.perf_counter() - t0
            m["prep/critic_tokens_per_s"] = ntok / max(m["prep/critic_s"], 1e-9)
        return values, bootstrap

    def _seal(self, facts, version: PolicyVersion, produced: ProducedRollout, c, m: dict):
        """The hard per-token staleness bound (the producer declares it; synchronous: 0), then the
        batch sealed, its evidence handed to the state machine, every rank's hash the same."""
        try:
            ages = check_staleness(facts, version.optimizer_step, produced.max_staleness)
        except StalenessError:
            self.sm.fail("a policy token beyond the staleness bound")
            raise
        m.update(staleness_metrics(ages))
        if c.routed_experts is not None:
            m.update(routing_load_metrics(c.routed_experts, facts.attention_mask))
        sealed = seal(ExperienceBatch(facts))
        groups_complete = sum(1 for g, n in produced.real_sizes.items() if facts.group_id.count(g) == n)
        self.sm.seal_experience(SealEvidence(
            samples_expected=sum(produced.real_sizes.values()), samples_written=facts.batch_size,
            groups_expected=len(produced.real_sizes), groups_complete=groups_complete,
            # every policy token's version, not only each sample's last (an agent's earlier turns)
            sample_version_ids=frozenset(facts.policy_version) | frozenset(
                c.token_origins.versions if c.token_origins is not None else ()),
            max_staleness=produced.max_staleness))
        hashes = gather_objects(sealed.content_hash)
        if len(set(hashes)) != 1:
            raise RuntimeError(f"ranks sealed different experience: {hashes}")
        return sealed

    def _old_log_probs_routed(self, c, mbs: int, pack: bool, budget: int):
        """The old log-probs of an MoE batch with its recorded routing: replayed under
        ``algo.routing_replay=rollout``; in both modes the trainer's own top-k is compared with
        the record (``prep/routing/mismatch_*``: the rollout / trainer routing mismatch replay
        removes; ``prep/routing/replay_differs``: dispatched vs recorded, 0 under replay)."""
        routed = c.routed_experts
        stats = RoutingStats(routed.moe_layers)
        n = c.prompt_ids.shape[0]
        rows = local_rows(n)

        def fn(prompt_ids, response_ids, attention_mask, experts):
            real = torch.arange(rows.start, rows.start + prompt_ids.shape[0]) < n
            routing = RecordRouting(experts, routed.moe_layers, replay=self.algo.routing_replay == "rollout",
                                    stats=stats, real_rows=real)
            return self.actor.log_probs(prompt_ids, response_ids, attention_mask, mbs, pack=pack, routing=routing,
                                        micro_batch_tokens=budget)

        vals = map_rows(fn, c.prompt_ids, c.response_ids, c.attention_mask, routed.experts).cpu()
        group = data_parallel.dp_group() if data_parallel.dp_size() > 1 else None
        return vals, {f"prep/routing/{k}": v for k, v in stats.reduce(group).items()}

    def derivation_settings(self) -> DerivationSettings:
        """The settings the derived tensors are computed under now (the KL coefficient moves)."""
        a = self.algo
        return DerivationSettings(estimator=a.advantage, gamma=a.gamma, lam=a.lam, zero_std_rule=a.zero_std_rule,
                                  std_eps=a.std_eps, kl_placement=a.kl.placement, kl_beta=self.kl_ctl.value,
                                  whiten=self.whiten, correction=self.correction, offpolicy=self.offpolicy,
                                  max_staleness=self.async_eta if self.offpolicy is not None else 0,
                                  reward_placement=a.reward_placement, distill_coef=a.distill_coef)

    def advantages(self, facts: ExperienceFacts, real_sizes: Dict[str, int]):
        """The estimator's derived tensors over the sealed facts, and the ``prep/adv*`` metrics
        (:func:`megarl.algo.derivation.derive`, which the recorded settings reproduce offline)."""
        return derive(facts, self.derivation_settings(), real_sizes)


def _offpolicy_settings(an):
    """(eta, the correction config or None) from the ``async_rl`` section."""
    if an.max_staleness > 0 and an.correction is None:
        raise ValueError(f"async_rl.correction must be chosen when async_rl.max_staleness={an.max_staleness} > 0")
    if an.correction is None:
        return an.max_staleness, None
    return an.max_staleness, async_correction_config(an.correction, an.is_cap, an.mask_threshold)
