"""The synchronous PPO / GRPO iteration, top to bottom, driven through the state machine.

    ACTOR_COMMITTED(v) -> EXPORTING(v) -> ROLLOUT_LOADING(v) -> ROLLOUT_READY(v) -> GENERATING(v)
      -> EXPERIENCE_SEALED(v) -> UPDATING_FROM(v) -> ACTOR_COMMITTED(v+1)

One iteration (:meth:`Trainer.iteration`), each phase one call named after it:

1. ``publish``         the committed actor v streams into the rollout engines (manifest-verified,
                       KV flushed); the state machine reaches ROLLOUT_READY(v);
2. ``rollout``         sample B prompts (seeded, resumable cursor), expand to B x G with
                       prompt/group/sample ids, generate on v, score every sample; a failed
                       score is a status (dropped or quarantined, its GRPO group with it);
                       DAPO dynamic sampling draws more prompts on the same v until B groups
                       with a reward spread are accepted (at most ``max_rounds`` rounds);
3. ``prepare``         old log-probs by the actor before any update (or the rollout's, after a
                       measured parity check), reference log-probs, critic values -> seal the
                       facts (EXPERIENCE_SEALED(v)); advantages / returns as derived tensors;
4. ``update``          ``ppo_epochs`` x mini-batches of whole groups, actor (and critic) steps
                       through megatron's schedule under the global normaliser (UPDATING_FROM(v));
5. ``commit``          the manifest of the new weights names v+1; every rank agrees first.

Every rank runs this same code (SPMD).  The experience batch is small and exists on every
rank; model forwards split its rows over data-parallel replicas (``map_rows``).
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Dict, List, Optional

import torch
import torch.distributed as dist

from megarl.algo.advantages import AdvantageConfig, AdvantageInputs, check_finite, masked_whiten
from megarl.algo.aggregation import global_normaliser, masked_mean
from megarl.algo.kl import AdaptiveKLController, FixedKLController, KLConfig, kl_k1, kl_k3
from megarl.algo.objective import actor_loss
from megarl.algo.policy_loss import PolicyLossConfig
from megarl.algo.registry import get_advantage
from megarl.algo.reward_shaping import kl_shaped_token_rewards, place_outcome_rewards
from megarl.algo.value_loss import clipped_value_loss
from megarl.config import TrainConfig
from megarl.control.batch import collate, plan_mini_batches
from megarl.control.placement import create_engine, generate_everywhere, make_placement
from megarl.control.state_machine import (
    ExportEvidence,
    IterationStateMachine,
    PhaseDeadlines,
    RolloutActivation,
    SealEvidence,
    UpdateEvidence,
)
from megarl.data.tokenizer import TokenizerContract
from megarl.errors import MegarlError
from megarl.experience.groups import CandidateStatus, GroupBuffer, GroupPolicy, group_index
from megarl.experience.schema import (
    DerivedTensors,
    ExperienceBatch,
    ExperienceFacts,
    FinishReason,
    LogProbProducer,
    LogProbs,
    RewardRecord,
    RewardStatus,
)
from megarl.experience.seal import save_sealed, seal, with_derived
from megarl.metrics import MetricsWriter, StageTimer, progress_line
from megarl.profiling import IterationProfiler, span
from megarl.models.forward import gather_response, token_log_probs_from_logits, vocab_parallel_entropy
from megarl.rollout.protocol import GenerationRequest, SamplingParams
from megarl.rollout.weight_sync import actor_manifest, make_version, sync_actor_to_engine
from megarl.roles.actor import Actor
from megarl.roles.common import sequence_length, step_tensors
from megarl.runtime.data_parallel import (
    all_ranks_agree,
    broadcast_object,
    dp_rank,
    dp_size,
    gather_objects,
    map_rows,
)


def _null():
    import contextlib

    return contextlib.nullcontext()


class RolloutParityError(MegarlError, RuntimeError):
    """Rollout log-probs disagree with the actor's beyond ``rollout.log_prob_parity_tol``: reusing
    them as old log-probs would change the PPO ratio, so the run stops (exit 2)."""


class UpdateFailure(MegarlError, RuntimeError):
    """The update of v failed on some rank (an exception, a non-finite loss or grad norm); every
    rank raises it together, after agreeing on it."""


@dataclass
class Sample:
    """One candidate on its way to the experience record."""

    prompt_id: str
    group_id: str
    sample_id: str
    request_id: str
    prompt_ids: tuple
    response_ids: tuple
    raw_log_probs: torch.Tensor
    finish_reason: FinishReason
    policy_version: str
    seed: Optional[int]
    record: Optional[RewardRecord] = None
    prompt: object = None  # the PromptRecord


@dataclass
class RolloutOutcome:
    samples: List[Sample]
    real_sizes: Dict[str, int]
    metrics: Dict[str, float] = field(default_factory=dict)


def _percentile(x: torch.Tensor, q: float) -> float:
    return float(torch.quantile(x.float(), q)) if x.numel() else 0.0


class Trainer:
    """Holds the roles, the engines, the data and the run's counters; runs iterations."""

    def __init__(self, cfg: TrainConfig, run_dir: str, model_path: str, tokenizer_dir: str, run_id: str):
        from megarl.data.prompts import PromptSampler, load_prompt_dataset

        self.cfg, self.run_dir, self.run_id = cfg, run_dir, run_id
        self.rank0 = dist.get_rank() == 0
        # SIGTERM / SIGUSR1 and <run_dir>/STOP (launch/multinode.sh writes it when Slurm warns of
        # the time limit) ask for a checkpoint at the next commit and a clean exit; from here on,
        # so that a signal during start-up is not lost.  A STOP file left by the last stop is stale.
        self.stop_signal = False
        self._install_signal_handlers()
        self.stop_file = os.path.join(run_dir, "STOP")
        if self.rank0 and os.path.exists(self.stop_file):
            os.remove(self.stop_file)
        self.world = dist.get_world_size()
        self.dp = dp_size()
        p = cfg.parallel
        template = open(cfg.model.chat_template).read() if cfg.model.chat_template else None
        self.tok = TokenizerContract.from_pretrained(tokenizer_dir, chat_template=template)
        self.tokenizer_dir = tokenizer_dir
        d = cfg.data
        load = dict(prompt_field=d.prompt_field, messages_field=d.messages_field, id_field=d.id_field,
                    apply_chat_template=d.apply_chat_template, system_prompt=d.system_prompt,
                    max_prompt_tokens=d.max_prompt_tokens)
        self.train_data = load_prompt_dataset(d.train_path, self.tok, **load)
        self.heldout = load_prompt_dataset(d.heldout_path, self.tok, **load) if d.heldout_path else None
        self.sampler = PromptSampler(len(self.train_data), seed=cfg.trainer.seed, shuffle=d.shuffle)

        a = cfg.algo
        steps_per_iter = a.ppo_epochs * a.num_mini_batches
        total_steps = cfg.trainer.iterations * steps_per_iter
        self.actor = Actor(model_path, p.tp, p.pp, cfg.actor.optim, total_steps,
                           vocab_multiple=cfg.model.vocab_multiple, offload=cfg.actor.offload)
        self.reference = None
        if cfg.reference.enabled:
            from megarl.roles.reference import Reference

            self.reference = Reference(cfg.reference.path or model_path, p.tp, p.pp, version="ref-0",
                                       vocab_multiple=cfg.model.vocab_multiple, offload=cfg.reference.offload)
        self.critic = None
        if cfg.critic is not None:
            from megarl.roles.critic import Critic

            self.critic = Critic(cfg.critic, self.actor.model, p.tp, p.pp, total_steps,
                                 vocab_multiple=cfg.model.vocab_multiple)
        from megarl.faults import FaultInjector
        from megarl.roles.rollback import UpdateSnapshot

        injector = FaultInjector(cfg.faults, seed=cfg.faults.seed, rank=dist.get_rank(), world=self.world)
        self.injector = injector if injector.active else None
        self.snapshots = {"actor": UpdateSnapshot(), "critic": UpdateSnapshot()}
        self.snapshot_s = self.snapshot_bytes = 0
        self._build_rewards()

        self.policy_cfg = PolicyLossConfig(
            name=a.policy_loss, clip_low=a.clip_low, clip_high=a.clip_high, dual_clip=a.dual_clip,
            agg_mode=a.agg_mode, entropy_coef=a.entropy_coef,
            kl=KLConfig(placement=a.kl.placement, estimator=a.kl.estimator, beta=a.kl.beta),
            old_log_prob_roles=("actor", "rollout") if cfg.rollout.reuse_rollout_log_probs else ("actor",),
            log_prob_space="raw")
        self.adv_cfg = AdvantageConfig(gamma=a.gamma, lam=a.lam, zero_std_rule=a.zero_std_rule, std_eps=a.std_eps)
        self.kl_ctl = (AdaptiveKLController(a.kl.beta, a.kl.target, a.kl.horizon) if a.kl.adaptive
                       else FixedKLController(a.kl.beta))
        self.norm_constant = float(cfg.rollout.max_new_tokens) if a.agg_mode == "seq-mean-token-sum-norm" else None

        self.counters: Counter = Counter()
        self.parity_checked = False
        self.last_eval: Optional[float] = None
        self.ckpt_root = os.path.join(run_dir, "checkpoints")
        resume = self._resume() if cfg.trainer.resume == "auto" else None
        self.start_iteration = 0 if resume is None else resume["iteration"]
        self.run_id = run_id = self.run_id if resume is None else resume["run_id"]

        # engines: created on an HF config of the actor (weights only ever arrive by stream)
        self.export_root = os.path.join(run_dir, "export")
        iter0 = os.path.join(self.export_root, "iter_0")
        if resume is None or not os.path.isfile(os.path.join(iter0, "config.json")):
            iter0 = self.export(0)
        self.placement = make_placement(cfg.rollout.backend, cfg.rollout.tp)
        from megarl.models.safetensors_io import model_dir_eos_token_ids

        # the contract's eos and the model dir's (config.json / generation_config.json), which
        # SGLang stops on regardless: both backends end responses on the same tokens
        eos = list(dict.fromkeys(([self.tok.eos_token_id] if self.tok.eos_token_id is not None else [])
                                 + list(model_dir_eos_token_ids(iter0))))
        pad = self.tok.pad_token_id if self.tok.pad_token_id is not None else (eos[0] if eos else 0)
        self.pad_id = pad
        self.engine = create_engine(cfg, self.placement, iter0, eos, pad)
        if self.engine is not None and (cfg.faults.rollout_error_rate or cfg.faults.duplicate_result_rate):
            from megarl.faults import FaultyRolloutEngine

            self.engine = FaultyRolloutEngine(self.engine, injector)
        self.sync_dtype = broadcast_object(getattr(self.engine, "dtype", None) if self.rank0 else None)
        if isinstance(self.sync_dtype, str):
            self.sync_dtype = getattr(torch, self.sync_dtype)

        self.manifest = actor_manifest(self.actor.ddp, dtype=self.sync_dtype)
        self.version = make_version(self.actor.ddp, self.manifest, run_id=run_id,
                                    optimizer_step=0 if resume is None else resume["policy_version"]["optimizer_step"],
                                    tokenizer_hash=self.tok.hash)
        if resume is not None:
            saved = resume["policy_version"]["weight_manifest_hash"]
            if self.manifest.global_hash != saved:
                raise RuntimeError(f"resume: the loaded actor's manifest {self.manifest.global_hash} is not the "
                                   f"checkpointed version's {saved}")
            if self.rank0:
                self._truncate_metrics(self.start_iteration)
        self.sm = IterationStateMachine(committed=self.version, deadlines=PhaseDeadlines())
        self.pending = (self._load_pending(resume) if resume is not None and cfg.trainer.resume_experience == "reuse"
                        else None)
        self.metrics = MetricsWriter(run_dir, enabled=self.rank0, tensorboard=cfg.trainer.tensorboard)
        self.quarantine_path = os.path.join(run_dir, "quarantine.jsonl")
        # GPU time-slicing: the engine releases KV cache and weights while the trainer computes
        self.time_slice = cfg.rollout.backend == "sglang" and cfg.rollout.enable_memory_saver
        self.engine_asleep = False

    # ---- construction helpers -------------------------------------------------------------

    def _build_rewards(self) -> None:
        from megarl.rewards import build_reward_function
        from megarl.rewards.runner import RewardRunner

        r = self.cfg.reward
        self.reward_fn = build_reward_function(r.fn, r.kwargs, r.components) if r.fn else None
        if self.reward_fn is not None and self.cfg.faults.reward_timeout_rate:
            from megarl.faults import FaultyRewardFunction

            self.reward_fn = FaultyRewardFunction(self.reward_fn, self.injector, hang_s=1.5 * r.timeout_s + 0.05)
        self.reward_runner = (RewardRunner(self.reward_fn, timeout_s=r.timeout_s, max_retries=r.max_retries,
                                           backoff_s=r.retry_backoff_s) if self.reward_fn and self.rank0 else None)
        self.reward_model = None
        if r.model.path:
            from megarl.roles.reward_model import RewardModel

            p = self.cfg.parallel
            self.reward_model = RewardModel(r.model.path, p.tp, p.pp, tokenizer=r.model.tokenizer,
                                            chat_template=r.model.chat_template,
                                            vocab_multiple=self.cfg.model.vocab_multiple, offload=r.model.offload,
                                            micro_batch_size=self.cfg.algo.forward_micro_batch_size)

    # ---- training-position checkpoints -------------------------------------------------------

    def contract_hashes(self) -> Dict[str, str]:
        """What a resumed run must share with the checkpoint (a change refuses, naming the field)."""
        from megarl.config import section_hash

        r = self.cfg.rollout
        sampling = {k: getattr(r, k) for k in ("temperature", "top_p", "top_k", "max_new_tokens", "n")}
        return {"tokenizer": self.tok.hash,
                "chat_template": section_hash({"template": self.tok.chat_template}),
                "sampling": section_hash(sampling), "reward": section_hash(self.cfg.reward),
                "model_config": self._model_config_hash(), "train_data": self.train_data.stats["sha256"]}

    def _model_config_hash(self) -> str:
        from megarl.rollout.weight_sync import model_config_hash

        return model_config_hash(self.actor.ddp)

    def _ckpt_roles(self) -> dict:
        roles = {"actor": (self.actor.ddp, self.actor.optimizer)}
        if self.critic is not None:
            roles["critic"] = (self.critic.ddp, self.critic.optimizer)
        if self.reference is not None and self.reference.refreshes:
            roles["reference"] = (self.reference.model, None)
        return roles

    def save_checkpoint(self, iteration: int) -> str:
        """Collective: the training position after ``iteration`` iterations (at ACTOR_COMMITTED)."""
        from megarl import checkpoint

        t0 = time.perf_counter()
        self.actor.onload()
        if self.critic is not None:
            self.critic.onload()
        ref_ctx = (self.reference._on_device() if self.reference is not None and self.reference.refreshes
                   else _null())
        state = {
            "run_id": self.run_id, "iteration": iteration, "policy_version": self.version.to_dict(),
            "sampler": self.sampler.state_dict(), "kl_controller": self.kl_ctl.state_dict(),
            "actor": {"scheduler": self.actor.scheduler.state_dict(), "steps": self.actor.steps},
            "critic": None if self.critic is None else {"scheduler": self.critic.scheduler.state_dict(),
                                                        "steps": self.critic.steps, "version": self.critic.version},
            "reference": None if self.reference is None else {"version": self.reference.version,
                                                              "refreshes": self.reference.refreshes},
            "scorer_version": getattr(self.reward_fn, "version", None),
            "reward_model_version": getattr(self.reward_model, "version", None),
            "counters": dict(self.counters), "parity_checked": self.parity_checked, "last_eval": self.last_eval,
            "hashes": self.contract_hashes(),
            "layout": {"tp": self.cfg.parallel.tp, "pp": self.cfg.parallel.pp, "dp": self.dp, "world": self.world},
            "weight_manifests": {"actor": self.manifest.global_hash},
            "unconsumed_experience": None,
            "unconsumed_experience_note": "saved at ACTOR_COMMITTED: every sealed batch was consumed by the update",
        }
        with ref_ctx:
            path = checkpoint.save(self.ckpt_root, iteration, state, self._ckpt_roles(),
                                   keep=self.cfg.trainer.checkpoint_keep,
                                   crash_before_publish=self.cfg.faults.crash_during_checkpoint_at)
        self.counters["checkpoints"] += 1
        self.last_checkpoint_s = time.perf_counter() - t0
        return path

    def _resume(self) -> Optional[dict]:
        """Continue from ``<run_dir>/checkpoints/latest`` (verified) if there is one."""
        from megarl import checkpoint

        path = checkpoint.find_latest(self.ckpt_root) if os.path.isdir(self.ckpt_root) else None
        if path is None:
            return None
        state = checkpoint.read_state(path)
        now = self.contract_hashes()
        changed = [k for k in sorted(now) if state["hashes"].get(k) != now[k]]
        if changed and not self.cfg.trainer.resume_force:
            raise checkpoint.CheckpointError(
                f"resume from {path}: {', '.join(changed)} changed since the checkpoint was written "
                f"(e.g. {changed[0]}: {state['hashes'].get(changed[0])} -> {now[changed[0]]}); "
                "start a new run_dir, or set trainer.resume_force=true to continue as a new run id")
        if changed:
            state["run_id"] = f"{state['run_id']}-forced{state['iteration']}"
            self.counters["forced_resumes"] += 1
        layout = state["layout"]
        same = (layout["tp"], layout["pp"], layout["world"]) == (self.cfg.parallel.tp, self.cfg.parallel.pp, self.world)
        roles = {"actor": (self.actor.ddp, self.actor.optimizer)}
        if self.critic is not None:
            roles["critic"] = (self.critic.ddp, self.critic.optimizer)
        if self.reference is not None and state["reference"] and state["reference"]["refreshes"]:
            roles["reference"] = (self.reference.model, None)
        checkpoint.load_roles(path, roles)
        self.actor.scheduler.load_state_dict(state["actor"]["scheduler"])
        self.actor.steps = state["actor"]["steps"]
        if self.critic is not None:
            self.critic.scheduler.load_state_dict(state["critic"]["scheduler"])
            self.critic.steps, self.critic.version = state["critic"]["steps"], state["critic"]["version"]
        if self.reference is not None and state["reference"]:
            self.reference.version = state["reference"]["version"]
            self.reference.refreshes = state["reference"]["refreshes"]
        self.sampler.load_state_dict(state["sampler"])
        self.kl_ctl.load_state_dict(state["kl_controller"])
        self.counters.update(state["counters"])
        self.parity_checked = state["parity_checked"]
        self.last_eval = state["last_eval"]
        checkpoint.restore_rng(path, same_layout=same)
        self.counters["resumes"] += 1
        if self.rank0:
            print(f"resumed from {path}: iteration {state['iteration']}, version step "
                  f"{state['policy_version']['optimizer_step']}"
                  f"{'' if same else ' (at a different layout: saved ' + str(layout) + ')'}", flush=True)
        return state

    def _truncate_metrics(self, start: int) -> None:
        """Rows of iterations that will run again (written after the checkpoint) are dropped."""
        path = os.path.join(self.run_dir, "metrics.jsonl")
        if not os.path.isfile(path):
            return
        with open(path) as f:
            rows = [line for line in f if line.strip() and json.loads(line)["iteration"] < start]
        with open(path + ".tmp", "w") as f:
            f.writelines(rows)
        os.replace(path + ".tmp", path)

    def _install_signal_handlers(self) -> None:
        """SIGTERM / SIGUSR1 (Slurm, before the time limit): checkpoint at the next commit, exit."""
        import signal

        def handler(signum, _frame):
            self.stop_signal = True

        for sig in (signal.SIGTERM, signal.SIGUSR1):
            try:
                signal.signal(sig, handler)
            except ValueError:  # not the main thread
                pass

    # ---- the run ------------------------------------------------------------------------------

    def run(self, start_iteration: Optional[int] = None) -> Dict[str, float]:
        cfg = self.cfg
        total = cfg.trainer.iterations
        t_start = time.time()
        it = self.start_iteration if start_iteration is None else start_iteration
        bar = None
        if self.rank0 and sys.stderr.isatty():
            from tqdm import tqdm

            bar = tqdm(total=total, initial=it, desc="train", unit="iter", dynamic_ncols=True)
        final_eval_done = False
        profiler = IterationProfiler(cfg.trainer.profile_iterations, os.path.join(self.run_dir, "profile"),
                                     dist.get_rank())
        while it < total:
            profiler.start(it)
            with span("iteration", it, self.version.short_id):
                outcome = self._run_one(it, total, t_start, bar)
            trace = profiler.stop()
            if trace and self.rank0:
                print(f"timeline of iteration {it}: {trace} (tools/timeline_summary.py; ui.perfetto.dev)", flush=True)
            it += 1
            final_eval_done = final_eval_done or outcome in ("final", "wall")
            if outcome == "signal":
                if self.rank0:
                    print(f"stopping after {it} iterations on a signal; resume with the same command", flush=True)
                self.metrics.close()
                return {"iterations": it, "heldout_accuracy": self.last_eval, "stopped": "signal"}
            if outcome == "wall":
                if self.rank0:
                    print(f"stopping after {it} iterations: trainer.max_wall_minutes reached", flush=True)
                break
        if bar is not None:
            bar.close()
        if not final_eval_done:
            self.publish()
            self.metrics.write(it, self.evaluate(it))
        self.export(it)
        self.metrics.close()
        result = {"iterations": it, "heldout_accuracy": self.last_eval}
        if it == total and self.rank0:  # launch/multinode.sh requeues a job until this exists
            with open(os.path.join(self.run_dir, "DONE"), "w") as f:
                json.dump(result, f)
        return result

    def _run_one(self, k: int, total: int, t_start: float, bar) -> str:
        """Iteration k and what follows it: export, final evaluation, metrics, checkpoint.
        Returns "final" (k was the last), "wall" (trainer.max_wall_minutes), "signal" (a stop
        was asked for) or "" (go on)."""
        cfg = self.cfg
        m = self.iteration(k)
        done = k + 1
        if cfg.trainer.export_every and done % cfg.trainer.export_every == 0 and done < total:
            with span("export", k, self.version.short_id):
                self.export(done)
        wall = broadcast_object(cfg.trainer.max_wall_minutes is not None
                                and time.time() - t_start > cfg.trainer.max_wall_minutes * 60)
        if done == total or wall:
            with span("eval", k, self.version.short_id, final=1):
                self.publish()  # the final policy into the engine for the final evaluation
                m.update(self.evaluate(done))
        self.metrics.write(k, m)
        if bar is not None:
            bar.update(1)
            bar.write(progress_line(done, total, m, self.last_eval))
        elif self.rank0:  # a log file, not a terminal: plain lines, no carriage returns
            print(progress_line(done, total, m, self.last_eval), flush=True)
        signalled = any(gather_objects(self.stop_signal or (self.rank0 and os.path.exists(self.stop_file))))
        every = cfg.trainer.checkpoint_every
        if (every and done % every == 0) or signalled or (wall and done < total):
            with span("checkpoint", k, self.version.short_id):
                path = self.save_checkpoint(done)
            if self.rank0:
                print(f"checkpoint {path} ({self.last_checkpoint_s:.2f}s)", flush=True)
        if signalled:
            return "signal"
        if wall:
            return "wall"
        return "final" if done == total else ""

    def iteration(self, k: int) -> Dict[str, float]:
        timer = StageTimer(k, self.version.short_id)
        m: Dict[str, float] = {"e2e/policy_version_step": self.version.optimizer_step}
        pending = self._take_pending(k)
        if pending is not None:  # trainer.resume_experience=reuse: iteration k's batch, sealed before a crash
            batch, before = pending
            m.update(before)
        else:
            with timer.stage("weight_sync"):
                m.update(self.publish(k))
            if self.heldout is not None and self.cfg.eval.every and k % self.cfg.eval.every == 0:
                with timer.stage("eval"):
                    m.update(self.evaluate(k))
            counters0 = Counter(self.counters)
            outcome = self.rollout(k, timer)
            m.update(outcome.metrics)
            batch, prep = self.prepare(k, outcome, timer)
            m.update(prep)
            if self.cfg.trainer.resume_experience == "reuse":
                with timer.stage("pending_write"):
                    self._write_pending(k, batch, m, self.counters - counters0)
        m.update(self._update_with_recovery(k, batch, timer))
        if not m.get("update/skipped_batch"):
            with timer.stage("commit"):
                self.commit()
        if self.reference is not None and self.cfg.reference.refresh_every and (k + 1) % self.cfg.reference.refresh_every == 0:
            self.reference.refresh_from(self.actor.ddp, version=f"ref-{self.version.short_id}")
            self.counters["reference_refreshes"] += 1
        m.update(timer.metrics())
        tokens = float(batch.facts.response_mask.sum())
        m["e2e/updated_tokens"] = tokens * self.cfg.algo.ppo_epochs
        m["e2e/tokens_per_s"] = tokens / m["e2e/iteration_s"]
        if self.injector is not None:
            injected = Counter()
            for c in gather_objects(dict(self.injector.counts)):
                injected.update(c)
            m.update({f"faults/injected/{k_}": float(v) for k_, v in sorted(injected.items())})
        m.update({f"e2e/count/{k_}": v for k_, v in sorted(self.counters.items())})
        return m

    # ---- update failures: roll back to v on every rank, then retry, skip or stop -----------------

    def _update_with_recovery(self, k: int, batch: ExperienceBatch, timer: StageTimer) -> Dict[str, float]:
        t = self.cfg.trainer
        failures = 0
        while True:
            try:
                with timer.stage("update", samples=batch.facts.batch_size,
                             groups=len(set(batch.facts.group_id)), attempt=failures):
                    return self.update(k, batch)
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
                    self._rollback()
                if t.on_update_failure == "skip":
                    self.sm.recover(self.version)
                    self.counters["updates_skipped"] += 1
                    return {"update/skipped_batch": 1.0}
                self.sm.retry_update(self.version)
                self.counters["update_retries"] += 1

    def _rollback(self) -> None:
        """Actor (and critic) back to the committed v, proven by the weight manifest on every rank."""
        from megarl.roles.rollback import RollbackError

        self.actor.steps = self.snapshots["actor"].restore(self.actor.ddp, self.actor.optimizer, self.actor.scheduler)
        if self.critic is not None:
            self.critic.steps = self.snapshots["critic"].restore(self.critic.ddp, self.critic.optimizer,
                                                                 self.critic.scheduler)
            self.critic.version = self.critic_version_at_snapshot
        restored = gather_objects(actor_manifest(self.actor.ddp, dtype=self.sync_dtype).global_hash)
        bad = [i for i, h in enumerate(restored) if h != self.manifest.global_hash]
        if bad:
            raise RollbackError(f"rollback: ranks {bad} hold weights whose manifest is not the committed "
                                f"{self.version.short_id}'s ({self.manifest.global_hash})")
        self.counters["update_rollbacks"] += 1

    # ---- trainer.resume_experience=reuse: the sealed batch of an interrupted iteration --------

    def _pending_dir(self) -> str:
        return os.path.join(self.run_dir, "experience", "pending")

    def _pending_hashes(self) -> Dict[str, str]:
        from megarl.config import section_hash

        return {**self.contract_hashes(), "algo": section_hash(self.cfg.algo)}

    def _write_pending(self, k: int, batch: ExperienceBatch, metrics: Dict[str, float], counters: Counter) -> None:
        """Rank 0 writes iteration k's sealed batch and what its rollout changed (sampler cursor,
        counters, metrics), replacing the previous one atomically."""
        if self.rank0:
            import shutil

            final, tmp = self._pending_dir(), self._pending_dir() + ".tmp"
            shutil.rmtree(tmp, ignore_errors=True)
            save_sealed(batch, tmp)
            side = {"iteration": k, "policy_version": self.version.to_dict(), "hashes": self._pending_hashes(),
                    "content_hash": batch.content_hash, "sampler": self.sampler.state_dict(),
                    "counters": dict(counters), "parity_checked": self.parity_checked, "metrics": metrics}
            with open(os.path.join(tmp, "position.json"), "w") as f:
                json.dump(side, f, sort_keys=True)
                f.flush()
                os.fsync(f.fileno())
            shutil.rmtree(final, ignore_errors=True)
            os.replace(tmp, final)
        if dist.is_initialized():
            dist.barrier()

    def _take_pending(self, k: int):
        """The sealed batch of iteration k from before a restart, once, if it may be reused."""
        if self.pending is None or self.pending[1]["iteration"] != k:
            return None
        batch, side = self.pending
        self.pending = None
        facts = batch.facts
        groups = {g: facts.group_id.count(g) for g in set(facts.group_id)}
        self.sm.adopt_sealed(SealEvidence(samples_expected=facts.batch_size, samples_written=facts.batch_size,
                                          groups_expected=len(groups), groups_complete=len(groups),
                                          sample_version_ids=frozenset(facts.policy_version)))
        self.sampler.load_state_dict(side["sampler"])
        self.counters.update(side["counters"])
        self.parity_checked = side["parity_checked"]
        if "eval/accuracy" in side["metrics"]:
            self.last_eval = side["metrics"]["eval/accuracy"]
        self.counters["sealed_batches_reused"] += 1
        if self.rank0:
            print(f"iteration {k}: reusing the batch sealed before the restart ({batch.content_hash[:16]}, "
                  f"{facts.batch_size} samples of {self.version.short_id})", flush=True)
        return batch, dict(side["metrics"])

    def _load_pending(self, resume_state: dict):
        """Check ``experience/pending`` against the checkpoint we resumed from: None when it is
        not the resumed iteration's (the crash came before its seal: the rollout runs again); a
        clear error naming the field when it is but a version or a config hash differs."""
        from megarl import checkpoint
        from megarl.experience.seal import load_sealed

        d = self._pending_dir()
        side_path = os.path.join(d, "position.json")
        if not os.path.isfile(side_path):
            return None
        side = json.load(open(side_path))
        if side["iteration"] != resume_state["iteration"]:
            if self.rank0:
                print(f"resume: the sealed batch in {d} is iteration {side['iteration']}'s, not "
                      f"{resume_state['iteration']}'s; its rollout runs again", flush=True)
            return None
        saved, now = side["policy_version"], self.version.to_dict()
        for key in ("run_id", "optimizer_step", "weight_manifest_hash", "tokenizer_hash"):
            if saved.get(key) != now.get(key):
                raise checkpoint.CheckpointError(
                    f"trainer.resume_experience=reuse: {d} was sealed on policy version {key}={saved.get(key)}, "
                    f"the checkpoint resumes {key}={now.get(key)}; set trainer.resume_experience=rerun")
        hashes = self._pending_hashes()
        changed = [key for key in sorted(hashes) if side["hashes"].get(key) != hashes[key]]
        if changed:
            raise checkpoint.CheckpointError(
                f"trainer.resume_experience=reuse: {', '.join(changed)} changed since {d} was sealed; "
                "set trainer.resume_experience=rerun to generate it again")
        batch = load_sealed(d)  # verifies the file's sha256 and the content hash
        if batch.content_hash != side["content_hash"] or set(batch.facts.policy_version) != {self.version.short_id}:
            raise checkpoint.CheckpointError(f"{d}: the sealed batch is not the one position.json describes")
        return batch, side

    # ---- 1. publish v into the rollout engines ----------------------------------------------

    def publish(self, k: Optional[int] = None) -> Dict[str, float]:
        """Stream v into the engines.  A load an engine refuses (a manifest mismatch, an engine
        that rejected an update) fails on every rank together -- the stream is drained, so no rank
        waits in a collective -- and is loaded again, at most ``rollout.max_retries`` times: an
        engine never serves a half-loaded or unverified version."""
        from megarl.rollout.protocol import RolloutError
        from megarl.rollout.weight_stream import ManifestMismatchError

        v = self.version
        t0 = time.perf_counter()
        for attempt in range(self.cfg.rollout.max_retries + 1):
            self.sm.begin_export()
            self.sm.begin_rollout_loading(ExportEvidence(manifest_hash=self.manifest.global_hash))
            error, report, act = None, None, None
            try:
                if self.engine is not None and self.engine_asleep:
                    self.engine.wake()
                    self.engine_asleep = False
                report = sync_actor_to_engine(self.actor.ddp, self.engine, v, self.manifest,
                                              bucket_bytes=self.cfg.rollout.bucket_mb * 1024**2, dtype=self.sync_dtype,
                                              transport=self._sync_fault(k, attempt))
                act = self.engine.activate(v) if self.engine is not None else None
            except (RolloutError, ManifestMismatchError) as e:
                error = f"{type(e).__name__}: {e}"
            if all_ranks_agree(error is None):
                break
            errors = "; ".join(f"rank {i}: {e}" for i, e in enumerate(gather_objects(error)) if e is not None)
            self.sm.fail(f"loading {v.short_id} into the rollout engines failed: {errors}")
            self.counters["weight_load_failures"] += 1
            if self.rank0:
                print(f"loading {v.short_id} failed (attempt {attempt + 1}): {errors}", file=sys.stderr, flush=True)
            if attempt == self.cfg.rollout.max_retries:
                raise RolloutError(f"the rollout engines refused {v.short_id} {attempt + 1} times "
                                   f"(rollout.max_retries={self.cfg.rollout.max_retries}); last: {errors}")
            self.sm.recover(self.version)
        own = (RolloutActivation(act.version_id, act.manifest_hash, act.manifest_verified, act.cache_flushed)
               if act is not None and self.placement.is_group_leader else None)
        acts = [a for a in gather_objects(own) if a is not None]
        self.sm.mark_rollout_ready(acts, self.placement.num_groups)
        self.counters["kv_flushes"] += sum(1 for a in acts if a.cache_flushed)
        self.actor.offload()  # GPU time-slicing: the engine generates while the actor sits on the host
        if self.critic is not None:
            self.critic.offload()
        out = {"rollout/weight_sync_s": time.perf_counter() - t0}
        if report is not None:
            out["rollout/weight_sync_bytes"] = float(report.num_bytes)
        return out

    def _sync_fault(self, k: Optional[int], attempt: int):
        """``faults.corrupt_weight_sync_at``: one value of the first bucket flipped in transit on
        the first load attempt of those iterations (the engine's manifest check must refuse it)."""
        if k is None or attempt > 0 or k not in (self.cfg.faults.corrupt_weight_sync_at or ()):
            return None
        state = {"done": False}

        def corrupt(bucket):
            if state["done"] or not bucket:
                return bucket
            state["done"] = True
            if self.injector is not None:
                self.injector.count("corrupted_weight_syncs")
            name, t = bucket[0]
            bad = t.clone()
            bad.view(-1)[0] += 1
            return [(name, bad)] + list(bucket[1:])

        return corrupt

    # ---- 2. rollout: prompts -> B x G samples with rewards -------------------------------------

    def _sampling(self, k: int, round_: int) -> SamplingParams:
        r = self.cfg.rollout
        return SamplingParams(temperature=r.temperature, top_p=r.top_p, top_k=r.top_k,
                              max_new_tokens=r.max_new_tokens, n=r.n,
                              seed=self.cfg.trainer.seed * 1_000_003 + k * 101 + round_)

    def rollout(self, k: int, timer: StageTimer) -> RolloutOutcome:
        cfg, a = self.cfg, self.cfg.algo
        B, G = cfg.trainer.prompts_per_iteration, cfg.rollout.n
        v = self.version.short_id
        self.sm.begin_generating([v] * self.placement.num_groups)
        retries = cfg.rollout.max_retries
        group_cfg = (GroupPolicy(G, max_retries=retries, partial_rule="allow_partial", min_partial_size=1)
                     if a.advantage not in ("grpo", "dr_grpo", "rloo")
                     else GroupPolicy(G, max_retries=retries, partial_rule=a.partial_groups,
                                      min_partial_size=a.min_partial_size))
        buffer = GroupBuffer(group_cfg)
        accepted: List[Sample] = []
        real_sizes: Dict[str, int] = {}
        m: Counter = Counter()
        timing = {"generate": 0.0, "reward": 0.0}
        rounds = a.dynamic_sampling.max_rounds if a.dynamic_sampling.enabled else 1
        n_groups_accepted = 0
        for rnd in range(rounds):
            need = B - n_groups_accepted
            if need <= 0:
                break
            records = [self.train_data.records[i] for i in self.sampler.next_indices(B)]
            by_group = {}
            requests = []
            for j, rec in enumerate(records):
                gid = f"{self.run_id}/it{k}/r{rnd}/p{j:03d}"
                by_group[gid] = rec
                requests.append(GenerationRequest(gid, tuple(rec.prompt_ids)))
                buffer.open_group(gid, rec.prompt_id, v, [f"{gid}/c{c:02d}" for c in range(G)])
            m["rollout/prompts"] += len(records)
            self._generate_groups(requests, by_group, buffer, self._sampling(k, rnd), timer, timing, m)
            for g in buffer.pop_released():
                members = [payload for _, payload in g.samples]
                spread = len({p.record.total for p in members}) > 1
                if a.dynamic_sampling.enabled and not spread:
                    m["rollout/groups_filtered_zero_spread"] += 1
                    continue
                if n_groups_accepted >= B:
                    m["rollout/groups_surplus"] += 1
                    continue
                n_groups_accepted += 1
                accepted.extend(members)
                real_sizes[g.group_id] = g.real_size
            m["rollout/dapo_rounds"] = rnd + 1
        if not accepted:
            self.sm.fail(f"iteration {k}: no complete group survived rollout and scoring")
            raise RuntimeError(f"iteration {k}: every group was dropped (see {self.quarantine_path} and the counters)")
        bc = buffer.counters
        self.counters["groups_dropped"] += bc["dropped"]
        self.counters["samples_failed"] += bc["failed_candidates"]
        self.counters["groups_partial"] += bc["released_partial"]
        # a result the join ignored: a late one (older attempt, closed group) or a duplicate
        self.counters["results_ignored"] += bc["stale"] + bc["duplicates"] + bc["wrong_version"]
        self.counters["candidates_regenerated"] += bc["retries"]
        m["rollout/groups_accepted"] = n_groups_accepted
        m["rollout/groups_dropped"] = bc["dropped"]
        m["rollout/groups_partial"] = bc["released_partial"]
        m["rollout/candidates_regenerated"] = bc["retries"]
        m["rollout/results_ignored"] = bc["stale"] + bc["duplicates"] + bc["wrong_version"]
        m["rollout/group_size_mean"] = sum(real_sizes.values()) / len(real_sizes)
        m["rollout/generate_s"] = timing["generate"]
        m["prep/reward_s"] = timing["reward"]
        return RolloutOutcome(accepted, real_sizes, self._rollout_metrics(accepted, dict(m), timing["generate"]))

    def _generate_groups(self, requests: List[GenerationRequest], by_group: dict, buffer: GroupBuffer,
                         sampling: SamplingParams, timer: StageTimer, timing: dict, m: Counter) -> None:
        """Generate and score the G candidates of ``requests`` until every one is in ``buffer``
        (ok, or failed for good), regenerating lost and aborted ones by sample id.

        The join is idempotent: a candidate counts once, for the attempt the buffer asked for;
        a duplicate, a late result of an older attempt, a result of a closed group or of an
        earlier call's request is counted and ignored.  A regeneration keeps the candidate's
        seed and policy version; if the engine no longer serves that version, the candidate
        fails (its group is then handled as incomplete), never filled from another version."""
        G = self.cfg.rollout.n
        v = self.version.short_id
        while requests:
            errors: list = []
            t0 = time.perf_counter()
            with timer.stage("generate", requests=len(requests), samples=sum(len(q.candidates(G)) for q in requests)):
                results = generate_everywhere(self.engine, self.placement, requests, sampling, errors)
            timing["generate"] += time.perf_counter() - t0
            m["rollout/engine_errors"] += len(errors)
            self.counters["engine_errors"] += len(errors)
            expected = {(f"{q.request_id}/c{c:02d}", q.attempt): q for q in requests for c in q.candidates(G)}
            fresh, extra, seen = [], [], set()
            for r in results:
                key = (f"{r.request_id}/c{r.candidate_index:02d}", r.attempt)
                if key in expected and key not in seen:
                    seen.add(key)
                    fresh.append(r)
                else:
                    extra.append(r)
            samples = [Sample(prompt_id=by_group[r.request_id].prompt_id, group_id=r.request_id,
                              sample_id=f"{r.request_id}/c{r.candidate_index:02d}", request_id=r.request_id,
                              prompt_ids=r.prompt_ids, response_ids=r.response_ids, raw_log_probs=r.raw_log_probs,
                              finish_reason=r.finish_reason, policy_version=r.policy_version, seed=r.seed,
                              prompt=by_group[r.request_id]) for r in fresh]
            m["rollout/samples"] += len(samples)
            finished = [s for s in samples if s.finish_reason is not FinishReason.ABORT]
            t0 = time.perf_counter()
            with timer.stage("reward", samples=len(finished)):
                self.score(finished)
            timing["reward"] += time.perf_counter() - t0
            retry_reqs = []
            for s, r in zip(samples, fresh):
                if s.finish_reason is FinishReason.ABORT:
                    m["rollout/aborted"] += 1
                    status, reason = CandidateStatus.RETRYABLE, "aborted by the engine"
                elif s.record.status is not RewardStatus.OK:
                    m[f"prep/reward_{s.record.status.value}"] += 1
                    status, reason = CandidateStatus.FATAL, s.record.error
                else:
                    status, reason = CandidateStatus.OK, ""
                retry_reqs.append(buffer.report(group_id=s.group_id, prompt_id=s.prompt_id, sample_id=s.sample_id,
                                                policy_version=s.policy_version, attempt=r.attempt, status=status,
                                                payload=s, reason=reason))
            for (sid, attempt), q in expected.items():
                if (sid, attempt) not in seen:  # lost: the engine never answered for it
                    m["rollout/candidates_lost"] += 1
                    self.counters["candidates_lost"] += 1
                    retry_reqs.append(buffer.report(group_id=q.request_id, prompt_id=by_group[q.request_id].prompt_id,
                                                    sample_id=sid, policy_version=v, attempt=attempt,
                                                    status=CandidateStatus.RETRYABLE, reason="lost"))
            for r in extra:
                if not buffer.knows(r.request_id):  # a request of an earlier iteration or evaluation
                    self.counters["results_ignored"] += 1
                    continue
                buffer.report(group_id=r.request_id, prompt_id=by_group[r.request_id].prompt_id,
                              sample_id=f"{r.request_id}/c{r.candidate_index:02d}", policy_version=r.policy_version,
                              attempt=r.attempt, status=CandidateStatus.OK, payload=None)
            by_req: Dict[tuple, List[int]] = {}
            for rr in (x for x in retry_reqs if x is not None):
                active = self.engine_version()
                if rr.policy_version != active:  # never fill a group from another version
                    buffer.report(group_id=rr.group_id, prompt_id=rr.prompt_id, sample_id=rr.sample_id,
                                  policy_version=rr.policy_version, attempt=rr.attempt,
                                  status=CandidateStatus.FATAL, reason=f"version {rr.policy_version} is not loaded")
                    continue
                by_req.setdefault((rr.group_id, rr.attempt), []).append(int(rr.sample_id.rsplit("/c", 1)[1]))
            requests = [GenerationRequest(gid, tuple(by_group[gid].prompt_ids), candidate_indices=tuple(sorted(cs)),
                                          attempt=att) for (gid, att), cs in sorted(by_req.items())]

    def engine_version(self) -> str:
        """The policy version the rollout engines serve (the state machine's GENERATING(v))."""
        return self.sm.state.version.short_id

    def score(self, samples: List[Sample]) -> None:
        """Rewards for ``samples`` (in place).  Rule functions run once, on rank 0, and are
        broadcast; the neural reward model is a collective forward.  Failures stay statuses
        unless ``reward.penalty`` names a number for that status."""
        from megarl.rewards.base import RewardSample
        from megarl.rewards.runner import apply_penalties

        rs = [RewardSample(sample_id=s.sample_id, prompt_id=s.prompt_id, group_id=s.group_id,
                           prompt_text=(s.prompt.text if s.prompt.text is not None
                                        else self.tok.decode(s.prompt_ids, skip_special_tokens=True)),
                           response_text=self.tok.decode(s.response_ids, skip_special_tokens=True),
                           prompt_ids=tuple(s.prompt_ids), response_ids=tuple(s.response_ids),
                           finish_reason=s.finish_reason.value, ground_truth=dict(s.prompt.ground_truth),
                           messages=s.prompt.messages) for s in samples]
        records = None
        if self.rank0 and self.reward_runner is not None:
            rc = self.reward_runner.counters
            before = (rc["timeout"], rc["error"], rc["retries"])
            records = [r.to_json() for r in self.reward_runner.score(rs)]  # JSON travels, mappingproxy does not
            records = (records, [n - b for n, b in zip((rc["timeout"], rc["error"], rc["retries"]), before)])
        records = broadcast_object(records)
        if records is not None:
            records, (timeouts, errors, retries) = records
            self.counters["reward_call_timeouts"] += timeouts
            self.counters["reward_call_errors"] += errors
            self.counters["reward_call_retries"] += retries
        records = None if records is None else [RewardRecord.from_json(r) for r in records]
        if self.reward_model is not None:
            rm = self.reward_model
            texts = [rm.encode(x.messages, x.prompt_text, x.response_text) for x in rs]
            scores = rm.score(texts)
            w = self.cfg.reward.model.weight
            merged = []
            for i, x in enumerate(rs):
                sc = float(scores[i])
                base = records[i] if records is not None else None
                if base is not None and base.status is not RewardStatus.OK:
                    merged.append(base)
                    continue
                comps = dict(base.components) if base is not None else {}
                comps["reward_model"] = sc
                total = (base.total if base is not None else 0.0) + w * sc
                version = f"{base.scorer_version}+{rm.version}" if base is not None else rm.version
                merged.append(RewardRecord(total=total, components=comps, scorer_version=version))
            records = merged
        records = apply_penalties(records, self.cfg.reward.penalty)
        for s, r in zip(samples, records):
            s.record = r
        failed = [s for s in samples if s.record.status is not RewardStatus.OK]
        if failed and self.rank0 and self.cfg.reward.on_failure == "quarantine":
            with open(self.quarantine_path, "a") as f:
                for s in failed:
                    f.write(json.dumps({"sample_id": s.sample_id, "prompt_id": s.prompt_id,
                                        "policy_version": s.policy_version,
                                        "response_text": self.tok.decode(s.response_ids),
                                        "response_ids": list(s.response_ids),
                                        "reward": s.record.to_json()}) + "\n")
        self.counters["reward_failures"] += len(failed)

    def _rollout_metrics(self, samples: List[Sample], m: Dict[str, float], gen_s: float) -> Dict[str, float]:
        lens = torch.tensor([len(s.response_ids) for s in samples], dtype=torch.float32)
        plens = torch.tensor([len(s.prompt_ids) for s in samples], dtype=torch.float32)
        totals = torch.tensor([s.record.total for s in samples], dtype=torch.float64)
        m["rollout/samples_accepted"] = len(samples)
        m["rollout/prompt_tokens"] = float(plens.sum())
        m["rollout/response_tokens"] = float(lens.sum())
        m["rollout/action_tokens"] = float(lens.sum())
        m["rollout/tokens_per_s"] = float(lens.sum()) / gen_s if gen_s > 0 else 0.0
        m["rollout/response_len_mean"] = float(lens.mean())
        m["rollout/response_len_min"] = float(lens.min())
        m["rollout/response_len_max"] = float(lens.max())
        m["rollout/response_len_p50"] = _percentile(lens, 0.5)
        m["rollout/response_len_p90"] = _percentile(lens, 0.9)
        m["rollout/eos_share"] = sum(s.finish_reason is FinishReason.EOS for s in samples) / len(samples)
        m["rollout/truncated_share"] = sum(s.finish_reason is FinishReason.LENGTH for s in samples) / len(samples)
        m["rollout/reward_mean"] = float(totals.mean())
        m["rollout/reward_std"] = float(totals.std()) if len(samples) > 1 else 0.0
        comps: Dict[str, List[float]] = {}
        for s in samples:
            for name, val in s.record.components.items():
                comps.setdefault(name, []).append(val)
        for name, vals in comps.items():
            m[f"prep/reward_component/{name}"] = sum(vals) / len(vals)
        return m

    # ---- 3. prepare: old / reference log-probs, values, seal, advantages ----------------------

    def prepare(self, k: int, outcome: RolloutOutcome, timer: StageTimer):
        cfg, a = self.cfg, self.cfg.algo
        v = self.version.short_id
        samples = outcome.samples
        c = collate([s.prompt_ids for s in samples], [s.response_ids for s in samples],
                    [s.raw_log_probs for s in samples], self.pad_id)
        mbs = a.forward_micro_batch_size
        m: Dict[str, float] = {}
        if self.time_slice and self.engine is not None:
            self.engine.sleep()
            self.engine_asleep = True
        self.actor.onload()
        ntok = float(c.attention_mask.sum())
        rollout_lp = LogProbs(c.rollout_log_probs, LogProbProducer("rollout", v, "raw"))
        every = cfg.rollout.log_prob_parity_every
        check_parity = cfg.rollout.reuse_rollout_log_probs and (
            not self.parity_checked or (every > 0 and k % every == 0))
        reuse = cfg.rollout.reuse_rollout_log_probs and not check_parity
        with timer.stage("old_log_prob", samples=len(samples), tokens=int(ntok)):
            t0 = time.perf_counter()
            if reuse:
                old = rollout_lp
            else:
                vals = map_rows(lambda *t: self.actor.log_probs(*t, mbs), c.prompt_ids, c.response_ids,
                                c.attention_mask).cpu()
                old = LogProbs(vals, LogProbProducer("actor", v, "raw"))
            m["prep/old_log_prob_s"] = time.perf_counter() - t0
            m["prep/actor_tokens_per_s"] = ntok / max(m["prep/old_log_prob_s"], 1e-9)
        keep = c.response_mask != 0
        if old.producer.role == "actor":
            diff = (old.values - c.rollout_log_probs).abs()[keep]
            m["prep/rollout_actor_logprob_max_abs_err"] = float(diff.max())
            m["prep/rollout_actor_logprob_mean_abs_err"] = float(diff.mean())
            if check_parity:
                if float(diff.max()) > cfg.rollout.log_prob_parity_tol:
                    self.sm.fail("rollout/actor log-prob parity check failed")
                    raise RolloutParityError(
                        f"rollout.reuse_rollout_log_probs: measured max |rollout - actor| log-prob "
                        f"{float(diff.max()):.3e} > rollout.log_prob_parity_tol={cfg.rollout.log_prob_parity_tol}")
                self.parity_checked = True
        ref = None
        if self.reference is not None:
            with timer.stage("ref_log_prob", samples=len(samples), tokens=int(ntok)):
                t0 = time.perf_counter()
                vals = map_rows(lambda *t: self.reference.log_probs(*t, mbs), c.prompt_ids, c.response_ids,
                                c.attention_mask).cpu()
                ref = LogProbs(vals, LogProbProducer("reference", self.reference.version, "raw"))
                m["prep/ref_log_prob_s"] = time.perf_counter() - t0
                m["prep/ref_tokens_per_s"] = ntok / max(m["prep/ref_log_prob_s"], 1e-9)
            d = (old.values - ref.values)[keep]
            m["prep/old_ref_logprob_max_abs_diff"] = float(d.abs().max())
            m["update/kl_ref"] = float(masked_mean(kl_k3(old.values, ref.values), keep))
            m["update/kl_ref_k1"] = float(masked_mean(kl_k1(old.values, ref.values), keep))
        values = bootstrap = None
        if self.critic is not None:
            self.critic.onload()
            with timer.stage("critic_values", samples=len(samples), tokens=int(ntok)):
                t0 = time.perf_counter()
                R = c.response_ids.shape[1]

                def crit(*t):
                    pt, b = self.critic.values(*t, mbs)
                    return torch.cat([pt, b[:, None]], 1)

                both = map_rows(crit, c.prompt_ids, c.response_ids, c.attention_mask).cpu()
                values, bootstrap = both[:, :R] * keep, both[:, R]
                m["prep/critic_s"] = time.perf_counter() - t0
                m["prep/critic_tokens_per_s"] = ntok / max(m["prep/critic_s"], 1e-9)
        facts = ExperienceFacts(
            run_id=self.run_id, iteration=k,
            prompt_id=tuple(s.prompt_id for s in samples), group_id=tuple(s.group_id for s in samples),
            sample_id=tuple(s.sample_id for s in samples),
            prompt_ids=c.prompt_ids, response_ids=c.response_ids, attention_mask=c.attention_mask,
            response_mask=c.response_mask, finish_reason=tuple(s.finish_reason for s in samples),
            policy_version=tuple(s.policy_version for s in samples),
            sampling=self._sampling(k, 0).to_config(), request_id=tuple(s.request_id for s in samples),
            seed=tuple(s.seed for s in samples), rewards=tuple(s.record for s in samples),
            rollout_log_probs=rollout_lp, old_log_probs=old, ref_log_probs=ref, values=values,
            critic_version=self.critic.version if self.critic is not None else None)
        sealed = seal(ExperienceBatch(facts))
        groups_complete = sum(1 for g, n in outcome.real_sizes.items() if facts.group_id.count(g) == n)
        self.sm.seal_experience(SealEvidence(
            samples_expected=sum(outcome.real_sizes.values()), samples_written=facts.batch_size,
            groups_expected=len(outcome.real_sizes), groups_complete=groups_complete,
            sample_version_ids=frozenset(facts.policy_version)))
        self.sealed_hashes = gather_objects(sealed.content_hash)
        if len(set(self.sealed_hashes)) != 1:
            raise RuntimeError(f"ranks sealed different experience: {self.sealed_hashes}")
        with timer.stage("advantages"):
            derived, adv_m = self.advantages(facts, outcome, bootstrap)
        m.update(adv_m)
        batch = with_derived(sealed, derived)
        if cfg.trainer.save_experience and self.rank0:
            save_sealed(batch, os.path.join(self.run_dir, "experience", f"iter_{k:06d}"))
        return batch, m

    def advantages(self, facts: ExperienceFacts, outcome: RolloutOutcome, bootstrap):
        a = self.cfg.algo
        scores = facts.scores()
        mask = facts.response_mask
        token_rewards = None
        est = get_advantage(a.advantage)
        if a.advantage in ("grpo", "dr_grpo", "rloo"):
            gidx, _ = group_index(facts.group_id, outcome.real_sizes)
            inputs = AdvantageInputs(response_mask=mask, scores=scores, group_index=gidx)
        else:
            if a.kl.placement == "reward":
                token_rewards, _ = kl_shaped_token_rewards(scores, mask, facts.old_log_probs, facts.ref_log_probs,
                                                           self.kl_ctl.value)
            else:
                token_rewards = place_outcome_rewards(scores, mask)
            inputs = AdvantageInputs(response_mask=mask, token_rewards=token_rewards.float(),
                                     values=facts.values, terminated=facts.terminated(),
                                     bootstrap_values=bootstrap)
        res = est(inputs, self.adv_cfg)
        check_finite(res)
        adv = res.advantages
        if a.advantage == "gae" and a.whiten_advantages:
            adv = masked_whiten(adv, res.loss_mask, self.adv_cfg.whiten_eps)
        keep = res.loss_mask != 0
        m = {f"prep/adv/{k}": v for k, v in res.metrics.items()}
        m["prep/advantage_mean"] = float(masked_mean(adv, keep)) if keep.any() else 0.0
        m["prep/advantage_std"] = float(adv[keep].std()) if int(keep.sum()) > 1 else 0.0
        if a.advantage in ("grpo", "dr_grpo", "rloo"):
            spreads = {}
            for g, t in zip(facts.group_id, scores.tolist()):
                spreads.setdefault(g, set()).add(t)
            m["prep/zero_variance_group_share"] = sum(len(s) == 1 for s in spreads.values()) / len(spreads)
        derived = DerivedTensors(
            advantages=adv.float(), loss_mask=res.loss_mask, returns=None if res.returns is None else res.returns.float(),
            shaped_rewards=None if token_rewards is None else token_rewards.float(), estimator=a.advantage,
            hyperparameters={"gamma": a.gamma, "lam": a.lam, "zero_std_rule": a.zero_std_rule,
                             "std_eps": a.std_eps, "kl_beta": self.kl_ctl.value,
                             "whiten": bool(a.advantage == "gae" and a.whiten_advantages)})
        return derived, m

    # ---- 4. update -----------------------------------------------------------------------------

    def update(self, k: int, batch: ExperienceBatch) -> Dict[str, float]:
        cfg, a = self.cfg, self.cfg.algo
        f, d = batch.facts, batch.derived
        self.sm.begin_update()
        self.actor.onload()
        if self.critic is not None:
            self.critic.onload()
        if cfg.trainer.update_rollback == "memory":
            self.critic_version_at_snapshot = self.critic.version if self.critic is not None else None
            t0 = time.perf_counter()
            nbytes = self.snapshots["actor"].take(self.actor.ddp, self.actor.optimizer, self.actor.scheduler,
                                                  self.actor.steps)
            if self.critic is not None:
                nbytes += self.snapshots["critic"].take(self.critic.ddp, self.critic.optimizer,
                                                        self.critic.scheduler, self.critic.steps)
            self.snapshot_s, self.snapshot_bytes = time.perf_counter() - t0, nbytes
        L = sequence_length(f.attention_mask)
        st = step_tensors(f.prompt_ids, f.response_ids, f.attention_mask, L)
        V = self.actor.vocab_size
        old_prod = f.old_log_probs.producer
        ref_prod = f.ref_log_probs.producer if f.ref_log_probs is not None else None
        kl_in_loss = self.policy_cfg.kl.placement == "loss"
        need_entropy_grad = a.entropy_coef > 0
        v = self.version.short_id
        gen = torch.Generator().manual_seed(cfg.trainer.seed * 7919 + k)
        actor_metrics: List[Dict[str, float]] = []
        critic_metrics: List[Dict[str, float]] = []
        grad_norms, critic_norms, skipped, lag = [], [], 0, 0
        train_actor = self.critic is None or k >= cfg.critic.warmup_iters
        R = f.response_len
        full = {"tokens": st["tokens"], "prompt_lens": st["prompt_lens"], "response_lens": st["response_lens"],
                "old_log_probs": f.old_log_probs.values, "advantages": d.advantages, "loss_mask": d.loss_mask}
        if kl_in_loss:
            full["ref_log_probs"] = f.ref_log_probs.values
        if self.critic is not None:
            full["old_values"] = f.values
            full["returns"] = d.returns
        kl_beta = self.kl_ctl.value
        n_steps = a.ppo_epochs * a.num_mini_batches
        step_idx = -1
        for epoch in range(a.ppo_epochs):
            plans = plan_mini_batches(f.group_id, a.num_mini_batches, self.dp, a.micro_batch_size, gen)
            for plan in plans:
                rows, is_pad = plan.rank_rows(dp_rank(), self.dp)
                real_mask = d.loss_mask[plan.rows]
                norm = global_normaliser(real_mask, a.agg_mode, norm_constant=self.norm_constant)
                local = {name: t[rows].clone() for name, t in full.items()}
                local["loss_mask"][is_pad] = 0
                step = a.micro_batch_size or rows.numel()  # 0: this rank's whole mini-batch at once
                mbs = [{name: t[i:i + step] for name, t in local.items()} for i in range(0, rows.numel(), step)]

                step_idx += 1
                fault = (self.injector.optimizer_fault(k, step_idx, n_steps - 1)
                         if self.injector is not None and train_actor else None)
                if train_actor:
                    def loss_fn(output, mb, norm=norm, poison=fault == "nan"):
                        lp_all = token_log_probs_from_logits(output[:, :-1], mb["tokens"][:, 1:], V)
                        lp = gather_response(lp_all, mb["prompt_lens"], mb["response_lens"], R)
                        if need_entropy_grad:
                            ent = gather_response(vocab_parallel_entropy(output[:, :-1], V), mb["prompt_lens"],
                                                  mb["response_lens"], R)
                        else:
                            with torch.no_grad():
                                ent = gather_response(vocab_parallel_entropy(output[:, :-1].detach(), V),
                                                      mb["prompt_lens"], mb["response_lens"], R)
                        out = actor_loss(
                            lp, old_log_probs=LogProbs(mb["old_log_probs"], old_prod), advantages=mb["advantages"],
                            loss_mask=mb["loss_mask"], cfg=self.policy_cfg, normaliser=norm,
                            ref_log_probs=LogProbs(mb["ref_log_probs"], ref_prod) if kl_in_loss else None,
                            entropy=ent, old_version=v, kl_beta=kl_beta)
                        return (out.loss * float("nan") if poison else out.loss), out.metrics

                    res = self._guarded_step("actor", lambda: self.actor.train_step(
                        mbs, loss_fn, after_optimizer_step=self._raise_injected(k) if fault == "exception" else None))
                    grad_norms.append(res.grad_norm)
                    if cfg.faults.crash_during_update_at == k and step_idx == 0:
                        from megarl.faults import crash_now

                        crash_now("inside the update, after its first optimizer step,", k)
                    skipped += 0 if res.update_successful else 1
                    actor_metrics.append(self._reduce_step_metrics(res.metrics))
                    lag += 1
                if self.critic is not None:
                    def vloss(output, mb, norm=norm):
                        vals = gather_response(output[..., 0].float(), mb["prompt_lens"], mb["response_lens"], R)
                        out = clipped_value_loss(vals, mb["old_values"], mb["returns"], mb["loss_mask"],
                                                 self.critic.value_clip, a.agg_mode, norm)
                        return out.loss, {**out.metrics, "value_loss": float(out.loss.detach())}

                    cres = self._guarded_step("critic", lambda: self.critic.train_step(mbs, vloss))
                    critic_norms.append(cres.grad_norm)
                    critic_metrics.append(self._reduce_step_metrics(cres.metrics))
        m = self._combine_steps(actor_metrics, "update/")
        m.update(self._combine_steps(critic_metrics, "update/critic_"))
        if actor_metrics:
            m["update/first_step_pg_loss"] = actor_metrics[0].get("pg_loss", float("nan"))
        if grad_norms:
            m["update/grad_norm"] = sum(grad_norms) / len(grad_norms)
            m["update/grad_norm_max"] = max(grad_norms)
        if critic_norms:
            m["update/critic_grad_norm"] = sum(critic_norms) / len(critic_norms)
        m["update/skipped_steps"] = skipped
        if cfg.trainer.update_rollback == "memory":  # the host copy of v a failed update would return to
            m["update/snapshot_s"], m["update/snapshot_bytes"] = self.snapshot_s, float(self.snapshot_bytes)
        m["update/optimizer_steps"] = len(grad_norms)
        m["update/policy_lag_max"] = max(lag - 1, 0)
        m["update/lr"] = self.actor.lr
        m["update/kl_beta"] = kl_beta
        self.counters["skipped_steps"] += skipped
        if a.kl.adaptive and f.ref_log_probs is not None:
            keep = f.response_mask != 0
            cur = float(masked_mean(kl_k1(f.old_log_probs.values, f.ref_log_probs.values), keep))
            self.kl_ctl.update(cur, f.batch_size)
        self.update_ok = all_ranks_agree(True)
        return m

    def _guarded_step(self, role: str, step):
        """One optimizer step that every rank either completes or abandons together: an
        exception here or a non-finite grad norm anywhere makes every rank raise
        :class:`UpdateFailure` (after an all-reduce of the status), before the next collective.
        An exception that leaves a peer blocked inside a collective cannot be recovered in
        process; the job's collective timeout ends it and ``resume=auto`` restarts it."""
        import math

        res, error = None, None
        try:
            res = step()
            if not math.isfinite(res.grad_norm):
                error = f"non-finite {role} grad norm {res.grad_norm}"
        except Exception as e:  # noqa: BLE001 -- any failure of the step is rolled back
            error = f"{type(e).__name__}: {e}"
        if all_ranks_agree(error is None):
            return res
        errors = [f"rank {i}: {e}" for i, e in enumerate(gather_objects(error)) if e is not None]
        raise UpdateFailure(f"{role} update failed ({'; '.join(errors)})")

    def _raise_injected(self, k: int):
        from megarl.faults import InjectedFault

        def hook():
            raise InjectedFault(f"faults.fail_optimizer_step_at: injected failure in iteration {k}'s optimizer "
                                f"step on rank {dist.get_rank()}")

        return hook

    #: per-micro-batch values that are shares of the step's global loss: they add up
    _SHARES = ("pg_loss", "kl_loss", "entropy", "value_loss")

    def _reduce_step_metrics(self, local: List[Dict[str, float]]) -> Dict[str, float]:
        """One optimizer step's micro-batch metrics (they live on the last PP stage) reduced over
        micro-batches and DP ranks: loss shares summed, ratio tails min / max, the rest
        token-weighted means."""
        from megatron.core import parallel_state as ps

        mine = local if (ps.is_pipeline_last_stage() and ps.get_tensor_model_parallel_rank() == 0) else []
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

    @staticmethod
    def _combine_steps(steps: List[Dict[str, float]], prefix: str) -> Dict[str, float]:
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

    # ---- 5. commit v+1 -------------------------------------------------------------------------

    def commit(self) -> None:
        manifest = actor_manifest(self.actor.ddp, dtype=self.sync_dtype)
        new = self.version.successor(manifest.global_hash)
        ok = self.update_ok
        self.sm.commit(new, UpdateEvidence(ranks_succeeded=self.world if ok else 0, world_size=self.world,
                                           manifest_hash=manifest.global_hash))
        self.version, self.manifest = new, manifest

    # ---- evaluation and export ---------------------------------------------------------------

    def evaluate(self, k: int) -> Dict[str, float]:
        """Greedy decoding of the held-out prompts on the version the engines serve."""
        if self.heldout is None:
            return {}
        e = self.cfg.eval
        recs = list(self.heldout.records[: e.n])
        requests = [GenerationRequest(f"{self.run_id}/eval{k}/{i:04d}", tuple(r.prompt_ids)) for i, r in enumerate(recs)]
        greedy = SamplingParams(temperature=0.0, max_new_tokens=e.max_new_tokens or self.cfg.rollout.max_new_tokens, n=1)
        t0 = time.perf_counter()
        by_req = self._generate_each(requests, greedy)
        samples = [Sample(prompt_id=rec.prompt_id, group_id=req.request_id, sample_id=req.request_id,
                          request_id=req.request_id, prompt_ids=req.prompt_ids,
                          response_ids=by_req[req.request_id].response_ids,
                          raw_log_probs=by_req[req.request_id].raw_log_probs,
                          finish_reason=by_req[req.request_id].finish_reason,
                          policy_version=by_req[req.request_id].policy_version, seed=None, prompt=rec)
                   for rec, req in zip(recs, requests) if req.request_id in by_req]
        self.score(samples)
        ok = [s for s in samples if s.record.status is RewardStatus.OK]
        succ = sum(1 for s in ok if s.record.total >= e.success_threshold)
        acc = succ / len(recs)  # a prompt without an answer (lost after every retry) counts as wrong
        self.last_eval = acc
        return {"eval/accuracy": acc, "eval/n": len(recs), "eval/generation_failures": len(recs) - len(samples),
                "eval/reward_mean": sum(s.record.total for s in ok) / max(len(ok), 1),
                "eval/scorer_failures": len(samples) - len(ok),
                "eval/response_len_mean": sum(len(s.response_ids) for s in samples) / len(samples),
                "eval/policy_version_step": self.version.optimizer_step,
                "eval/seconds": time.perf_counter() - t0}

    def _generate_each(self, requests: List[GenerationRequest], sampling: SamplingParams) -> Dict[str, object]:
        """One result per request (n=1), regenerating lost ones up to ``rollout.max_retries``
        times; extra deliveries (duplicates, late results) are counted and ignored."""
        out: Dict[str, object] = {}
        todo = list(requests)
        for attempt in range(self.cfg.rollout.max_retries + 1):
            if not todo:
                break
            wanted = {q.request_id for q in todo}
            for r in generate_everywhere(self.engine, self.placement, todo, sampling):
                if r.request_id in wanted and r.attempt == attempt and r.request_id not in out:
                    out[r.request_id] = r
                else:
                    self.counters["results_ignored"] += 1
            lost = [q for q in todo if q.request_id not in out]
            self.counters["candidates_lost"] += len(lost)
            todo = [GenerationRequest(q.request_id, q.prompt_ids, attempt=attempt + 1) for q in lost]
        return out

    def export(self, k: int) -> str:
        """Collective: the actor as an HF checkpoint with its tokenizer and chat template."""
        out = os.path.join(self.export_root, f"iter_{k}")
        self.actor.onload()
        self.actor.export(out)
        if self.rank0:
            tok = self.tok.tokenizer
            if self.tok.chat_template is not None:
                tok.chat_template = self.tok.chat_template
            tok.save_pretrained(out)
        if dist.is_initialized():
            dist.barrier()
        return out
