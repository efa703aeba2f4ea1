"""The driver: orders the phases of each iteration and drives the versioned state machine.

    ACTOR_COMMITTED(v) -> EXPORTING(v) -> ROLLOUT_LOADING(v) -> ROLLOUT_READY(v) -> GENERATING(v)
      -> EXPERIENCE_SEALED(v) -> UPDATING_FROM(v) -> ACTOR_COMMITTED(v+1)

One iteration (:meth:`Trainer.iteration`) is five calls, one component each:

1. publish  -- :class:`~megarl.control.publication.WeightPublisher`: v into the engines, verified;
2. produce  -- a :class:`~megarl.control.interfaces.RolloutProducer`: complete, scored groups on v;
3. prepare  -- :class:`~megarl.control.preparation.ExperiencePreparer`: old/ref/critic forwards,
   the sealed batch, advantages;
4. update   -- :class:`~megarl.control.learning.Learner`: the optimizer steps, rolled back on failure;
5. commit   -- here: the manifest of the new weights names v+1, on the evidence of every rank.

The driver holds the committed version and its manifest and the run's counters; it owns the
ordering, the versions and the run's lifecycle (progress, checkpoints, stop signals, the final
evaluation and export).  Every rank runs this same code (SPMD).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from collections import Counter
from typing import Dict, Optional

import torch.distributed as dist

from megarl.checkpointing.run_dir import resume_command
from megarl.config.schema import TrainConfig
from megarl.errors import MegarlError
from megarl.control.assembly import assemble, assemble_engine, wire_components
from megarl.control.export import Exporter
from megarl.control.interfaces import RunProgress
from megarl.control.persistence import RunPersistence
from megarl.control.state_machine import IterationStateMachine, PhaseDeadlines, UpdateEvidence
from megarl.observability.metrics import MetricsWriter, StageTimer, progress_line
from megarl.observability.profiling import IterationProfiler, phase_context, span
from megarl.observability.sample_log import SampleLogger
from megarl.rollout.weight_sync import actor_manifest, make_version
from megarl.runtime.data_parallel import broadcast_object, dp_size, gather_objects, take_objects_moved
from megarl.runtime import cpu_compat


def stop_file_is_stale(path: str) -> bool:
    """Whether ``<run_dir>/STOP`` found at start-up is the last stop's (removed) rather than a
    request made since this launch (honoured at the first commit).  launch/multinode.sh stamps
    its launch in ``MEGARL_LAUNCH_TIME`` (seconds since the epoch): a STOP written after it is the
    scheduler's time-limit warning arriving while the trainer started, and must not be lost.
    Without the stamp every STOP found at start-up is taken as stale."""
    launched = os.environ.get("MEGARL_LAUNCH_TIME")
    if not launched:
        return True
    try:
        stamp = float(launched)
    except ValueError:
        raise MegarlError(f"MEGARL_LAUNCH_TIME={launched!r}: expected the launch's time in seconds since the epoch "
                          "(launch/multinode.sh sets it)") from None
    return os.path.getmtime(path) < stamp


class Trainer:
    """Wires the components for one run and runs its iterations."""

    def __init__(self, cfg: TrainConfig, run_dir: str, model_path: str, tokenizer_dir: str, run_id: str):
        t_init = time.perf_counter()
        self.cfg, self.run_dir = cfg, run_dir
        self.rank0 = dist.get_rank() == 0
        self.world, self.dp = dist.get_world_size(), dp_size()
        # SIGTERM / SIGUSR1 and <run_dir>/STOP (launch/multinode.sh writes it when Slurm warns of
        # the time limit) ask for a checkpoint at the next commit and a clean exit; from here on,
        # so that a signal during start-up is not lost.  A STOP file left by the last stop is stale.
        self.stop_signal = False
        self._install_signal_handlers()
        self.stop_file = os.path.join(run_dir, "STOP")
        if self.rank0 and os.path.exists(self.stop_file) and stop_file_is_stale(self.stop_file):
            os.remove(self.stop_file)

        parts = assemble(cfg, model_path, tokenizer_dir)
        self.parts, self.actor = parts, parts.actor
        self.progress = RunProgress()
        self.persistence = RunPersistence(
            cfg, run_dir, actor=parts.actor, critic=parts.critic, reference=parts.reference, sampler=parts.sampler,
            kl_ctl=parts.kl_ctl, progress=self.progress, tok=parts.tok, train_data=parts.train_data,
            reward_fn=parts.reward_fn, reward_models=parts.reward_models, judges=parts.judges, teacher=parts.teacher,
            demonstrations=parts.demonstrations,
            layout={"tp": cfg.parallel.tp, "pp": cfg.parallel.pp, "dp": self.dp, "world": self.world,
                    "ep": cfg.parallel.ep, "cp": cfg.parallel.cp, "vpp": cfg.parallel.vpp,
                    "distributed_optimizer": cpu_compat.use_distributed_optimizer(cfg.parallel.distributed_optimizer)},
            rank0=self.rank0)
        self.persistence.record_origins()  # what this start built each role from, before a resume loads over it
        resume = self.persistence.resume() if cfg.trainer.resume == "auto" else None
        # e2e/resume_s: from the start of this process's trainer to its first iteration, after a resume
        self._resumed_at = t_init if resume is not None else None
        self._last_checkpoint: Optional[tuple] = None  # (seconds, bytes) of the checkpoint since the last row
        self.start_iteration = 0 if resume is None else resume["iteration"]
        self.run_id = run_id if resume is None else resume["run_id"]

        self.exporter = Exporter(os.path.join(run_dir, "export"), parts.actor, parts.tok, self.rank0)
        iter0 = self.exporter.path(0)
        if resume is None or not os.path.isfile(os.path.join(iter0, "config.json")):
            iter0 = self.exporter.export(0)
        eng = assemble_engine(cfg, parts.tok, iter0, parts.injector)
        self.engine = eng.engine
        self.manifest = actor_manifest(parts.actor.ddp, dtype=eng.sync_dtype)
        self.sync_dtype = eng.sync_dtype
        self.version = make_version(parts.actor.ddp, self.manifest, run_id=self.run_id,
                                    optimizer_step=0 if resume is None else resume["policy_version"]["optimizer_step"],
                                    tokenizer_hash=parts.tok.hash)
        if resume is not None:
            saved = resume["policy_version"]["weight_manifest_hash"]
            if self.manifest.global_hash != saved:
                raise RuntimeError(f"resume: the loaded actor's manifest {self.manifest.global_hash} is not the "
                                   f"checkpointed version's {saved}")
            self.persistence.truncate_metrics(self.start_iteration)
            done_marker = os.path.join(run_dir, "DONE")
            if self.rank0 and os.path.exists(done_marker):  # a finished run continued (trainer.iterations raised)
                os.remove(done_marker)
        self.persistence.register_version(self.version)
        self.sm = IterationStateMachine(committed=self.version,
                                       deadlines=PhaseDeadlines.from_config(cfg.trainer.phase_timeout_s))
        self.pending = (self.persistence.load_pending(resume, self.version)
                        if resume is not None and cfg.trainer.resume_experience == "reuse" else None)
        resumed_at = None if resume is None else self.start_iteration
        self.metrics = MetricsWriter.for_run(cfg, run_dir, self.run_id, enabled=self.rank0, resumed_at=resumed_at)
        self.samples = SampleLogger(cfg.trainer, run_dir, parts.tok, self.metrics, self.rank0, resumed_at)

        c = wire_components(cfg, parts, eng, sm=self.sm, progress=self.progress, run_dir=run_dir,
                            run_id=self.run_id, dp=self.dp, rank0=self.rank0, ckpt_root=self.persistence.ckpt_root)
        self.publisher, self.producer, self.preparer = c.publisher, c.producer, c.preparer
        if resume is not None and resume.get("carried_over"):  # open partial rollouts the checkpoint recorded
            self.producer.restore(resume["carried_over"])
        self.learner, self.evaluator = c.learner, c.evaluator

    def close(self) -> None:
        """Stop what the run started outside this process (split placement: the rollout ranks)."""
        if self.engine is None:  # a rank that holds no engine
            return
        try:
            self.engine.close()
        except Exception as e:  # noqa: BLE001 -- the run is ending; never hide why it ended
            print(f"closing the rollout ranks: {type(e).__name__}: {e}", file=sys.stderr, flush=True)

    @property
    def counters(self) -> Counter:
        return self.progress.counters

    def _install_signal_handlers(self) -> None:
        """SIGTERM / SIGUSR1 (Slurm, before the time limit): checkpoint at the next commit, exit."""

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
                    print(f"stopping after {it} iterations on a signal; resume with: {resume_command(self.run_dir)}",
                          flush=True)
                self.metrics.close()
                return {"iterations": it, "heldout_accuracy": self.progress.last_eval, "stopped": "signal"}
            if outcome == "wall":
                if self.rank0:
                    print(f"stopping after {it} iterations: trainer.max_wall_minutes reached; resume with: "
                          f"{resume_command(self.run_dir)}", flush=True)
                break
        if bar is not None:
            bar.close()
        if not final_eval_done:
            self.publisher.publish(self.version, self.manifest)
            self.metrics.write(it, self.evaluator.evaluate(it, self.version))
        self.exporter.export(it)
        self.metrics.close()
        result = {"iterations": it, "heldout_accuracy": self.progress.last_eval}
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
                self.exporter.export(done)
        wall = broadcast_object(cfg.trainer.max_wall_minutes is not None
                                and time.time() - t_start > cfg.trainer.max_wall_minutes * 60)
        if done == total or wall:
            with span("eval", k, self.version.short_id, final=1), phase_context(k, self.version.short_id):
                self.publisher.publish(self.version, self.manifest)  # the final policy, for the final evaluation
                m.update(self.evaluator.evaluate(done, self.version))
        self.metrics.write(k, m)
        line = progress_line(done, total, m, self.progress.last_eval, unscored=self.progress.last_eval_unscored)
        if bar is not None:
            bar.update(1)
            bar.write(line)
        elif self.rank0:  # a log file, not a terminal: plain lines, no carriage returns
            print(line, flush=True)
        if k in cfg.faults.hold_after_iteration:
            self._hold_for_a_stop(k)
        signalled = self._stop_requested()
        every = cfg.trainer.checkpoint_every
        if (every and done % every == 0) or signalled or (wall and done < total):
            with span("checkpoint", k, self.version.short_id):
                in_flight = self.producer.in_flight()
                path = self.persistence.save(done, self.run_id, self.version, self.manifest.global_hash,
                                             in_flight=in_flight)
            self._last_checkpoint = (self.persistence.last_checkpoint_s, float(self.persistence.last_checkpoint_bytes))
            if self.rank0:
                print(f"checkpoint {path} ({self.persistence.last_checkpoint_s:.2f}s)", flush=True)
        if signalled:
            return "signal"
        if wall:
            return "wall"
        return "final" if done == total else ""

    def _stop_requested(self) -> bool:
        """Whether any rank was asked to stop (a signal, or rank 0 sees <run_dir>/STOP): collective."""
        return any(gather_objects(self.stop_signal or (self.rank0 and os.path.exists(self.stop_file))))

    def _hold_for_a_stop(self, k: int) -> None:
        """``faults.hold_after_iteration``: wait here, every rank together, until a stop is asked
        for (or the process is killed); the drill that makes a test's stop land at a known point."""
        if self.rank0:
            print(f"faults: holding after iteration {k} until a stop is asked for", flush=True)
        while not self._stop_requested():
            time.sleep(0.05)

    def iteration(self, k: int) -> Dict[str, float]:
        """publish -> produce -> prepare -> update -> commit, on committed version v."""
        timer = StageTimer(k, self.version.short_id)
        injector = self.parts.injector
        recovered = {}
        if self._resumed_at is not None:  # the recovery a resume took: load, verify, rebuild, up to here
            recovered["e2e/resume_s"] = time.perf_counter() - self._resumed_at
            self._resumed_at = None
        if self._last_checkpoint is not None:
            recovered["e2e/checkpoint_s"], recovered["e2e/checkpoint_bytes"] = self._last_checkpoint
            self._last_checkpoint = None
        if injector is not None:
            injector.iteration = k
        m: Dict[str, float] = {"e2e/policy_version_step": self.version.optimizer_step}
        if self.pending is not None and self.pending[1]["iteration"] == k:
            # trainer.resume_experience=reuse: iteration k's batch, sealed before a crash
            pending, self.pending = self.pending, None
            batch, before = self.persistence.adopt_pending(pending, k, self.version, self.sm)
            m.update(before)
        else:
            with timer.stage("weight_sync"):
                m.update(self.publisher.publish(self.version, self.manifest, k))
            if self.evaluator.due(k):
                with timer.stage("eval"):
                    m.update(self.evaluator.evaluate(k, self.version))
            counters0 = Counter(self.counters)
            produced = self.producer.produce(k, self.version, timer)
            m.update(produced.metrics)
            batch, prep = self.preparer.prepare(k, self.version, produced, timer)
            m.update(prep)
            if self.cfg.trainer.resume_experience == "reuse":
                with timer.stage("pending_write"):
                    self.persistence.write_pending(k, self.version, batch, m, self.counters - counters0)
        self.samples.log(k, batch)  # trainer.log_samples_every: a table of the sealed batch
        m.update(self.learner.update_with_recovery(k, batch, self.version, self.manifest, timer))
        if not m.get("update/skipped_batch"):
            with timer.stage("commit"):
                self.commit()
        reference = self.parts.reference
        if reference is not None and self.cfg.reference.refresh_every and (k + 1) % self.cfg.reference.refresh_every == 0:
            reference.refresh_from(self.actor.ddp, version=f"ref-{self.version.short_id}")
            self.counters["reference_refreshes"] += 1
        m.update(timer.metrics())
        if self.parts.reward_runner is not None:  # rank 0 (it writes metrics.jsonl): per-scorer telemetry
            m.update(self.parts.reward_runner.metrics())
        tokens = float(batch.facts.response_mask.sum())
        m["e2e/updated_tokens"] = tokens * self.cfg.algo.ppo_epochs
        m["e2e/tokens_per_s"] = tokens / m["e2e/iteration_s"]
        m.update(recovered)
        if self.world > 1:  # what the phases handed each other between ranks (pickled objects), all ranks
            moved = gather_objects(take_objects_moved())
            m["e2e/objects_moved_bytes"] = float(sum(x["bytes"] for x in moved))
            m["e2e/objects_moved_s"] = max(x["seconds"] for x in moved)
        # device-hours: every rank of this world holds one device for the whole iteration
        self.counters["device_hours"] += self.world * m["e2e/iteration_s"] / 3600.0
        m["e2e/device_hours_per_update"] = self.counters["device_hours"] / max(self.version.optimizer_step, 1)
        peak = self.cfg.trainer.peak_flops
        if peak and m.get("update/model_flops") and m.get("e2e/stage_s/update"):
            m["update/mfu"] = m["update/model_flops"] / (m["e2e/stage_s/update"] * self.world * peak)
        if injector is not None:
            injected = Counter()
            for c in gather_objects(dict(injector.counts)):
                injected.update(c)
            m.update({f"faults/injected/{k_}": float(v) for k_, v in sorted(injected.items())})
        m.update({f"e2e/count/{k_}": v for k_, v in sorted(self.counters.items())})
        return m

    def commit(self) -> None:
        """UPDATING_FROM(v) -> ACTOR_COMMITTED(v+1).  Each rank reports whether its update ran to
        the end and the manifest of the weights it now holds; v+1 is committed only when every
        rank completed and every rank's manifest is the same."""
        manifest = actor_manifest(self.actor.ddp, dtype=self.sync_dtype)
        reports = gather_objects((self.learner.completed, manifest.global_hash))
        new = self.version.successor(manifest.global_hash, update_attempt=self.learner.update_attempt)
        self.sm.commit(new, UpdateEvidence.from_rank_reports(reports, manifest.global_hash))
        self.version, self.manifest = new, manifest
        self.persistence.register_version(new)
