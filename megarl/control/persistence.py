"""Persistence: training-position checkpoints, resume, and the pending sealed batch.

A checkpoint is the training position after an iteration, taken at ACTOR_COMMITTED: actor,
critic and refreshed-reference weights with their optimizer state, schedules, the sampler
cursor, the KL controller, per-rank RNG, the run's cumulative counters, the contract hashes
(tokenizer, chat template, sampling, reward, model config, training data) and the identity of
every role a start rebuilds from a path (``origins``: the model and reference weights, each
reward model's weights, tokenizer and template, the scorer's version).  Resuming refuses a
changed contract or identity, naming the key and both values, unless ``trainer.resume_force``
(then the run id changes); a restored (refreshed) reference must hash to what was saved.

With ``trainer.resume_experience=reuse`` rank 0 also keeps the last sealed batch and what its
rollout changed; a restart that resumes the iteration it belongs to trains on it instead of
generating again, after checking its version and every config hash.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import time
from typing import Callable, Dict, Optional

import torch.distributed as dist

from megarl.control.interfaces import RunProgress
from megarl.control.state_machine import IterationStateMachine, SealEvidence
from megarl.experience.schema import ExperienceBatch
from megarl.versions import PolicyVersion


def weights_identity(model) -> str:
    """Collective: the hash of a megatron model's weight manifest (layout-independent)."""
    from megarl.rollout.weight_sync import actor_manifest

    return actor_manifest(model).global_hash


def _on_device(role):
    offloader = getattr(role, "offloader", None)
    return offloader.on_device() if offloader is not None else contextlib.nullcontext()


class RunPersistence:
    """Args: ``cfg`` the run config; ``actor`` / ``critic`` / ``reference`` the roles;
    ``sampler`` the prompt cursor; ``kl_ctl`` the KL controller; ``progress`` the run's
    counters and flags; ``tok`` / ``train_data`` for the contract hashes; ``reward_fn`` /
    ``reward_models`` (one per ``cfg.reward.neural_models()`` entry) for the scorer versions
    recorded; ``judges`` (one per ``cfg.reward.judges`` entry: the judge on rank 0, None
    elsewhere) for theirs; ``layout`` tp/pp/dp/world;
    ``identify`` a model's weight identity (collective; :func:`weights_identity`)."""

    def __init__(self, cfg, run_dir: str, *, actor, critic, reference, sampler, kl_ctl, progress: RunProgress,
                 tok, train_data, reward_fn, reward_models=(), layout: Dict[str, int], rank0: bool,
                 identify: Optional[Callable[[object], str]] = None, judges=(), teacher=None, demonstrations=None):
        self.identify = identify or weights_identity
        self.origins: Dict[str, dict] = {}
        self._registered: Optional[set] = None  # short ids in <run_dir>/versions.jsonl
        self.cfg, self.run_dir = cfg, run_dir
        self.actor, self.critic, self.reference = actor, critic, reference
        self.teacher = teacher  # teacher.path: a run origin (a resume with another teacher is refused)
        self.demonstrations = demonstrations  # algo.sft: a run origin (its file's content); its cursor is saved
        self.sampler, self.kl_ctl, self.progress = sampler, kl_ctl, progress
        self.tok, self.train_data, self.reward_fn = tok, train_data, reward_fn
        self.reward_models = tuple(reward_models)
        self.judges = tuple(judges)  # reward.judges: the judge on rank 0, None elsewhere
        self.layout, self.rank0 = layout, rank0
        self.ckpt_root = os.path.join(run_dir, "checkpoints")
        self.pending_dir = os.path.join(run_dir, "experience", "pending")
        self.last_checkpoint_s = 0.0
        self.last_checkpoint_bytes = 0

    # ---- contracts ------------------------------------------------------------------------------

    def contract_hashes(self) -> Dict[str, str]:
        """What a resumed run must share with the checkpoint (a change refuses, naming the field)."""
        from megarl.config import section_hash
        from megarl.rollout.weight_sync import model_config_hash

        r = self.cfg.rollout
        sampling = {k: getattr(r, k) for k in ("temperature", "top_p", "top_k", "max_new_tokens", "n")}
        return {"tokenizer": self.tok.hash,
                "chat_template": section_hash({"template": self.tok.chat_template}),
                "sampling": section_hash(sampling), "reward": section_hash(self.cfg.reward),
                "model_config": model_config_hash(self.actor.ddp), "train_data": self.train_data.stats["sha256"]}

    def record_origins(self) -> Dict[str, dict]:
        """Collective, before a resume overwrites anything: what this start built each role from
        (``{role: {"key", "path", "id"}}``).  The unrefreshed reference is labelled by its
        weights (``ref-0-<8 hex>``), not by the label alone."""
        cfg, o = self.cfg, {}
        self.actor.onload()
        o["model"] = {"key": "model.path", "path": cfg.model.path, "id": self.identify(self.actor.ddp)}
        if self.reference is not None:
            key = "reference.path" if cfg.reference.path else "model.path"
            rid = self.reference.origin_id(self.identify)
            o["reference"] = {"key": key, "path": cfg.reference.path or cfg.model.path, "id": rid}
            if not self.reference.refreshes:
                self.reference.version = f"ref-0-{rid.split(':')[-1][:8]}"
        if self.teacher is not None:
            tid = self.teacher.origin_id(self.identify)
            o["teacher"] = {"key": "teacher.path", "path": cfg.teacher.path, "id": tid}
            self.teacher.version = f"teacher-{tid.split(':')[-1][:8]}"
        for (key, m), rm in zip(cfg.reward.neural_models(), self.reward_models, strict=True):
            with _on_device(rm):
                weights = self.identify(rm.model)
            contract = rm.contract
            from megarl.config import section_hash

            # (reward.model keeps the origin name its checkpoints were saved with)
            o["reward_model" if key == "reward.model" else f"reward_model/{m.name}"] = {
                "key": f"{key}.path", "path": m.path,
                "id": f"weights={weights} tokenizer={contract.hash} "
                      f"template={section_hash({'template': contract.chat_template})}"}
        for i, (j, judge) in enumerate(zip(cfg.reward.judges, self.judges, strict=True)):
            from megarl.runtime.data_parallel import broadcast_object

            # the weights' content (the verified manifest it serves), tokenizer, template, prompt, rule, sampling
            jid = None if judge is None else (f"weights={judge.engine.active_version.weight_manifest_hash} "
                                              f"tokenizer={judge.contract.hash} judge={judge.version}")
            o[f"judge/{j.name}"] = {"key": f"reward.judges[{i}].path", "path": j.path, "id": broadcast_object(jid)}
        if self.demonstrations is not None:
            o["sft"] = {"key": "algo.sft.path", "path": self.demonstrations.path,
                        "id": f"sha256:{self.demonstrations.sha256}"}
        if self.reward_fn is not None:
            o["scorer"] = {"key": "reward.fn", "path": cfg.reward.fn, "id": self.reward_fn.version}
        self.origins = o
        return o

    def _changed_origins(self, state: dict) -> list:
        """``(role, saved, now)`` for every role this start rebuilds whose identity is not the
        checkpoint's.  A refreshed reference is restored from the checkpoint, not rebuilt."""
        saved_all = state.get("origins") or {}
        changed = []
        for role, now in self.origins.items():
            saved = saved_all.get(role)
            if saved is None:
                continue  # a checkpoint of an older megarl, or a role the run did not have
            if role == "reference" and (state.get("reference") or {}).get("refreshes"):
                continue
            if saved["id"] != now["id"]:
                changed.append((role, saved, now))
        return changed

    def _pending_hashes(self) -> Dict[str, str]:
        from megarl.config import section_hash

        return {**self.contract_hashes(), "algo": section_hash(self.cfg.algo)}

    # ---- checkpoints ----------------------------------------------------------------------------

    def _roles(self, with_reference: bool) -> dict:
        roles = {"actor": (self.actor.ddp, self.actor.optimizer)}
        if self.critic is not None:
            roles["critic"] = (self.critic.ddp, self.critic.optimizer)
        if self.reference is not None and with_reference:
            roles["reference"] = (self.reference.model, None)
        return roles

    def save(self, iteration: int, run_id: str, version: PolicyVersion, manifest_hash: str,
             in_flight: Optional[dict] = None) -> str:
        """Collective: the training position after ``iteration`` iterations (at ACTOR_COMMITTED).
        The checkpoint counts itself: ``checkpoints`` is cumulative across resumes.

        ``in_flight`` (an asynchronous producer's ``in_flight()``): generation submitted ahead
        for later iterations, or partial rollouts carried over.  Either it is recorded
        (``recorded``: the producer restores it from ``carried_over``), or it is deliberately not
        saved: its prompts go back to the sampler (served first after a resume, so no prompt is
        skipped) and the checkpoint says how many groups (and tokens) a resume drops."""
        import contextlib

        from megarl.checkpointing import checkpoint

        t0 = time.perf_counter()
        self.actor.onload()
        if self.critic is not None:
            self.critic.onload()
        refreshed = self.reference is not None and self.reference.refreshes
        ref_ctx = self.reference._on_device() if refreshed else contextlib.nullcontext()
        counters = self.progress.counters
        counters["checkpoints"] += 1
        state = {
            "run_id": run_id, "iteration": iteration, "policy_version": version.to_dict(),
            "sampler": self.sampler.state_dict(returned=(in_flight or {}).get("prompt_indices", ())),
            "kl_controller": self.kl_ctl.state_dict(),
            "actor": {"scheduler": self.actor.scheduler.state_dict(), "steps": self.actor.steps},
            "critic": None if self.critic is None else {"scheduler": self.critic.scheduler.state_dict(),
                                                        "steps": self.critic.steps, "version": self.critic.version},
            "reference": None if self.reference is None else {"version": self.reference.version,
                                                              "refreshes": self.reference.refreshes,
                                                              "weights": self._reference_weights(refreshed)},
            "origins": self.origins,
            "scorer_version": None if self.reward_fn is None else self.reward_fn.version,
            "reward_model_version": "+".join(rm.version for rm in self.reward_models) or None,
            "counters": dict(counters), "parity_checked": self.progress.parity_checked,
            "last_eval": self.progress.last_eval, "hashes": self.contract_hashes(), "layout": dict(self.layout),
            "weight_manifests": {"actor": manifest_hash},
            "unconsumed_experience": None,
            "unconsumed_experience_note": "saved at ACTOR_COMMITTED: every sealed batch was consumed by the update",
        }
        if self.demonstrations is not None:  # algo.sft's cursor: a resume draws the rows it would have drawn
            state["sft_sampler"] = self.demonstrations.sampler.state_dict()
        if in_flight and "recorded" in in_flight:  # work carried over the checkpoint, restored by a resume
            state["carried_over"] = in_flight["recorded"]
        elif in_flight:
            state["in_flight_dropped"] = {k: v for k, v in in_flight.items() if k != "prompt_indices"}
        with ref_ctx:
            path = checkpoint.save(self.ckpt_root, iteration, state, self._roles(refreshed),
                                   keep=self.cfg.trainer.checkpoint_keep,
                                   crash_before_publish=self.cfg.faults.crash_during_checkpoint_at)
        self.last_checkpoint_s = time.perf_counter() - t0
        self.last_checkpoint_bytes = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)
        return path

    def _reference_weights(self, refreshed: bool) -> Optional[str]:
        """The identity of the reference as it stands (collective when it was refreshed)."""
        if not refreshed:
            return (self.origins.get("reference") or {}).get("id")
        with self.reference._on_device():
            return self.identify(self.reference.model)

    def resume(self) -> Optional[dict]:
        """Continue from ``<run_dir>/checkpoints/latest`` (verified) if there is one: roles,
        schedules, sampler, KL controller, progress and RNG restored; the checkpoint's state is
        returned (None when there is none)."""
        from megarl.checkpointing import checkpoint

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
        roles = self._changed_origins(state)
        if roles and not self.cfg.trainer.resume_force:
            what = "; ".join(f"{now['key']}: the checkpoint's {role} is {saved['path']} ({saved['id']}), this start "
                             f"builds it from {now['path']} ({now['id']})" for role, saved, now in roles)
            raise checkpoint.CheckpointError(
                f"resume from {path}: {what}; the run would go on against another {roles[0][0]} than it trained "
                "with.  Resume with the checkpoint's paths; to start a new run on purpose, use a new trainer.run_dir "
                "(or trainer.resume_force=true to continue these weights under a new run id)")
        counters = self.progress.counters
        changed = changed + [f"origin of {role}" for role, _, _ in roles]
        if changed:
            state["run_id"] = f"{state['run_id']}-forced{state['iteration']}"
            counters["forced_resumes"] += 1
        saved = state["layout"]
        if "distributed_optimizer" in saved and saved["distributed_optimizer"] != self.layout.get("distributed_optimizer"):
            # the two optimizers' checkpoints are not each other's (their param-group records differ)
            raise checkpoint.CheckpointError(
                f"resume from {path}: saved with parallel.distributed_optimizer={saved['distributed_optimizer']}, "
                f"resumed with {self.layout.get('distributed_optimizer')}; the optimizer state does not load across "
                "the two: resume with the saved setting (or start a new run from the exported weights)")
        if saved.get("ep", 1) != self.layout.get("ep", 1):
            # megatron keeps an MoE model's optimizer state in two optimizers at EP > 1 (dense and
            # expert parameters), in one at EP = 1: the sharded state does not map across
            raise checkpoint.CheckpointError(
                f"resume from {path}: saved at parallel.ep={saved.get('ep', 1)}, resumed at "
                f"parallel.ep={self.layout.get('ep', 1)}; the optimizer state is not resharded across expert-parallel "
                "sizes: resume at the saved parallel.ep (or start a new run from the exported weights)")
        same = ((saved["tp"], saved["pp"], saved.get("cp", 1), saved.get("vpp", 1), saved["world"])
                == (self.layout["tp"], self.layout["pp"], self.layout.get("cp", 1), self.layout.get("vpp", 1),
                    self.layout["world"]))
        checkpoint.load_roles(path, self._roles(bool(state["reference"] and state["reference"]["refreshes"])))
        self.actor.scheduler.load_state_dict(state["actor"]["scheduler"])
        self.actor.steps = state["actor"]["steps"]
        if self.critic is not None:
            self.critic.scheduler.load_state_dict(state["critic"]["scheduler"])
            self.critic.steps, self.critic.version = state["critic"]["steps"], state["critic"]["version"]
        if self.reference is not None and state["reference"]:
            # an unrefreshed reference keeps the label of the weights this start built (record_origins)
            self.reference.refreshes = state["reference"]["refreshes"]
            if self.reference.refreshes:  # restored from the checkpoint: it must be what was saved
                self.reference.version = state["reference"]["version"]
                saved_ref, loaded = state["reference"].get("weights"), self._reference_weights(True)
                if saved_ref is not None and loaded != saved_ref:
                    raise checkpoint.CheckpointError(
                        f"resume from {path}: the refreshed reference loaded from the checkpoint hashes to {loaded}, "
                        f"it was saved as {saved_ref}")
        self.sampler.load_state_dict(state["sampler"])
        if self.demonstrations is not None and "sft_sampler" in state:  # (absent: the SFT term starts here)
            self.demonstrations.sampler.load_state_dict(state["sft_sampler"])
        self.kl_ctl.load_state_dict(state["kl_controller"])
        counters.update(state["counters"])
        self.progress.parity_checked = state["parity_checked"]
        self.progress.last_eval = state["last_eval"]
        checkpoint.restore_rng(path, same_layout=same)
        counters["resumes"] += 1
        if self.rank0:
            print(f"resumed from {path}: iteration {state['iteration']}, version step "
                  f"{state['policy_version']['optimizer_step']}"
                  f"{'' if same else ' (at a different layout: saved ' + str(saved) + ')'}", flush=True)
        return state

    def register_version(self, version: PolicyVersion) -> None:
        """Rank 0 appends ``version``'s whole tuple to ``<run_dir>/versions.jsonl`` (once per
        short id): what every sealed sample's short id stands for, for the run's whole life."""
        if not self.rank0:
            return
        path = os.path.join(self.run_dir, "versions.jsonl")
        if self._registered is None:
            self._registered = set()
            if os.path.isfile(path):
                with open(path) as f:
                    self._registered = {json.loads(line)["short_id"] for line in f if line.strip()}
        if version.short_id in self._registered:
            return
        with open(path, "a") as f:
            f.write(json.dumps({"short_id": version.short_id, **version.to_dict()}, sort_keys=True) + "\n")
            f.flush()
            os.fsync(f.fileno())
        self._registered.add(version.short_id)

    def truncate_metrics(self, start: int) -> None:
        """Rows of iterations that will run again (written after the checkpoint) are dropped."""
        if not self.rank0:
            return
        path = os.path.join(self.run_dir, "metrics.jsonl")
        if not os.path.isfile(path):
            return
        with open(path) as f:
            rows = [line for line in f if line.strip() and json.loads(line)["iteration"] < start]
        with open(path + ".tmp", "w") as f:
            f.writelines(rows)
        os.replace(path + ".tmp", path)

    # ---- trainer.resume_experience=reuse: the sealed batch of an interrupted iteration --------

    def write_pending(self, k: int, version: PolicyVersion, batch: ExperienceBatch, metrics: Dict[str, float],
                      counters_delta) -> None:
        """Rank 0 writes iteration k's sealed batch and what its rollout changed (sampler cursor,
        counters, metrics), replacing the previous one atomically."""
        from megarl.experience.seal import save_sealed

        if self.rank0:
            final, tmp = self.pending_dir, self.pending_dir + ".tmp"
            shutil.rmtree(tmp, ignore_errors=True)
            save_sealed(batch, tmp)
            side = {"iteration": k, "policy_version": version.to_dict(), "hashes": self._pending_hashes(),
                    "content_hash": batch.content_hash, "sampler": self.sampler.state_dict(),
                    "counters": dict(counters_delta), "parity_checked": self.progress.parity_checked,
                    "metrics": metrics}
            with open(os.path.join(tmp, "position.json"), "w") as f:
                json.dump(side, f, sort_keys=True)
                f.flush()
                os.fsync(f.fileno())
            shutil.rmtree(final, ignore_errors=True)
            os.replace(tmp, final)
        if dist.is_initialized():
            dist.barrier()

    def load_pending(self, resume_state: dict, version: PolicyVersion):
        """Check ``experience/pending`` against the checkpoint we resumed from: None when it is
        not the resumed iteration's (the crash came before its seal: the rollout runs again); a
        clear error naming the field when it is but a version or a config hash differs."""
        from megarl.experience.seal import load_sealed
        from megarl.checkpointing import checkpoint

        d = self.pending_dir
        side_path = os.path.join(d, "position.json")
        if not os.path.isfile(side_path):
            return None
        with open(side_path) as f:
            side = json.load(f)
        if side["iteration"] != resume_state["iteration"]:
            if self.rank0:
                print(f"resume: the sealed batch in {d} is iteration {side['iteration']}'s, not "
                      f"{resume_state['iteration']}'s; its rollout runs again", flush=True)
            return None
        saved, now = side["policy_version"], version.to_dict()
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
        if batch.content_hash != side["content_hash"] or set(batch.facts.policy_version) != {version.short_id}:
            raise checkpoint.CheckpointError(f"{d}: the sealed batch is not the one position.json describes")
        return batch, side

    def adopt_pending(self, pending, k: int, version: PolicyVersion, sm: IterationStateMachine):
        """The pending batch of iteration k, adopted as sealed: EXPERIENCE_SEALED(v) under the
        same completeness conditions, and the sampler, counters and flags its rollout left."""
        batch, side = pending
        facts = batch.facts
        groups = {g: facts.group_id.count(g) for g in set(facts.group_id)}
        sm.adopt_sealed(SealEvidence(samples_expected=facts.batch_size, samples_written=facts.batch_size,
                                     groups_expected=len(groups), groups_complete=len(groups),
                                     sample_version_ids=frozenset(facts.policy_version)))
        self.sampler.load_state_dict(side["sampler"])
        self.progress.counters.update(side["counters"])
        self.progress.parity_checked = side["parity_checked"]
        if "eval/accuracy" in side["metrics"]:  # NaN (nothing scored) is no accuracy, as in the Evaluator
            acc = side["metrics"]["eval/accuracy"]
            self.progress.last_eval = None if acc is None or math.isnan(acc) else acc
        self.progress.counters["sealed_batches_reused"] += 1
        if self.rank0:
            print(f"iteration {k}: reusing the batch sealed before the restart ({batch.content_hash[:16]}, "
                  f"{facts.batch_size} samples of {version.short_id})", flush=True)
        return batch, dict(side["metrics"])
