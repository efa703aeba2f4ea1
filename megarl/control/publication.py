"""Publication: the committed actor's weights into every rollout engine, verified, with retries.

``publish(v)`` walks the state machine ACTOR_COMMITTED(v) -> EXPORTING(v) -> ROLLOUT_LOADING(v)
-> ROLLOUT_READY(v): the gathered tensors stream in buckets into the engines, which checksum what
landed against v's manifest and activate v only on equality, flushing their KV / prefix cache.
A load an engine refuses fails on every rank together (the stream is drained first, so no rank
waits in a collective) and is loaded again, at most ``rollout.max_retries`` times: an engine
never serves a half-loaded or unverified version.  ``faults.corrupt_weight_sync_at`` corrupts a
bucket in transit at this seam, so the engines' own check is what refuses it.
"""

from __future__ import annotations

import contextlib
import sys
import time
from collections import Counter
from typing import Dict, Optional

from megarl.control.placement import Placement
from megarl.control.state_machine import ExportEvidence, IterationStateMachine, RolloutActivation
from megarl.rollout.weight_stream import TensorManifest
from megarl.observability.profiling import phase_context, span
from megarl.rollout.weight_sync import sync_actor_to_engine
from megarl.runtime.data_parallel import all_ranks_agree, gather_objects
from megarl.versions import PolicyVersion


class EngineTimeSlice:
    """GPU time-slicing of the rollout engine: it releases its KV cache and weights while the
    trainer's forwards and update run (``rollout.enable_memory_saver`` on SGLang) and resumes
    them before the next load.  Inert when slicing is off or this rank holds no engine.
    ``keep_weights``: release the KV cache only (``actor.lora.engine: adapter``: the base the
    adapters apply to stays loaded, so that each version sends its adapter alone)."""

    def __init__(self, engine, enabled: bool, keep_weights: bool = False):
        self.engine, self.enabled = engine, enabled and engine is not None
        self.keep_weights = keep_weights
        self.asleep = False

    def release(self) -> None:
        if self.enabled:
            if self.keep_weights:  # SGLang's engine: sleep(release_weights=False)
                self.engine.sleep(release_weights=False)
            else:
                self.engine.sleep()
            self.asleep = True

    def resume(self) -> None:
        if self.engine is not None and self.asleep:
            self.engine.wake()
            self.asleep = False


class WeightPublisher:
    """Streams committed versions into the engines (see the module docstring)."""

    def __init__(self, *, actor, critic, engine, placement: Placement, sm: IterationStateMachine,
                 time_slice: EngineTimeSlice, counters: Counter, sync_dtype, bucket_mb: int, max_retries: int,
                 corrupt_at=(), injector=None, rank0: bool = False, changed_only: Optional[frozenset] = None,
                 adapter: Optional[dict] = None):
        self.actor, self.critic, self.engine, self.placement, self.sm = actor, critic, engine, placement, sm
        self.time_slice, self.counters, self.sync_dtype = time_slice, counters, sync_dtype
        self.bucket_bytes, self.max_retries = bucket_mb * 1024**2, max_retries
        self.corrupt_at, self.injector, self.rank0 = tuple(corrupt_at or ()), injector, rank0
        #: a LoRA actor's adapted tensors (HF names): after a first whole load the engine is sent
        #: only these and keeps the rest, proven against the manifest (None: every tensor, always)
        self.changed_only = changed_only
        self._whole_loaded = False
        #: ``actor.lora.engine: adapter`` (``{"rank", "alpha", "base_model"}``): the engine is sent
        #: the base (adapters off) when it holds none, then each version's adapter only
        self.adapter = adapter
        self._base_manifest: Optional[TensorManifest] = None

    def publish(self, version: PolicyVersion, manifest: TensorManifest, k: Optional[int] = None) -> Dict[str, float]:
        """Load ``version`` (named by ``manifest``) into every engine; ROLLOUT_READY(v) on return.
        ``k`` is the iteration (None for the final evaluation's load), for fault injection."""
        from megarl.rollout.protocol import RolloutError
        from megarl.rollout.weight_stream import ManifestMismatchError

        t0 = time.perf_counter()
        for attempt in range(self.max_retries + 1):
            self.sm.begin_export()
            self.sm.begin_rollout_loading(ExportEvidence(manifest_hash=manifest.global_hash))
            error, report, act = None, None, None
            try:
                self.time_slice.resume()
                with phase_context(k, version.short_id) if k is not None else contextlib.nullcontext():
                    # a retry sends everything: whatever the engine kept is not trusted again
                    names = self.changed_only if self._whole_loaded and attempt == 0 else None
                    if self.adapter is not None:
                        report = self._load_adapter(version, manifest, k, attempt)
                    else:
                        report = sync_actor_to_engine(self.actor.ddp, self.engine, version, manifest,
                                                      bucket_bytes=self.bucket_bytes, dtype=self.sync_dtype,
                                                      transport=self._transport_fault(k, attempt), names=names)
                    with span("weight_sync.activate"):
                        act = self.engine.activate(version) if self.engine is not None else None
            except (RolloutError, ManifestMismatchError) as e:
                error = f"{type(e).__name__}: {e}"
            if all_ranks_agree(error is None):
                self._whole_loaded = True
                break
            errors = "; ".join(f"rank {i}: {e}" for i, e in enumerate(gather_objects(error)) if e is not None)
            self.sm.fail(f"loading {version.short_id} into the rollout engines failed: {errors}")
            self.counters["weight_load_failures"] += 1
            if self.rank0:
                print(f"loading {version.short_id} failed (attempt {attempt + 1}): {errors}", file=sys.stderr, flush=True)
            if attempt == self.max_retries:
                raise RolloutError(f"the rollout engines refused {version.short_id} {attempt + 1} times "
                                   f"(rollout.max_retries={self.max_retries}); last: {errors}")
            self.sm.recover(version)
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

    def _load_adapter(self, version: PolicyVersion, manifest: TensorManifest, k: Optional[int], attempt: int):
        """Collective, ``actor.lora.engine: adapter``: the base (the actor with its adapters off,
        under its own manifest and a version named by it) streamed when an engine holds none or
        on a retry, then the adapters in peft's format into each engine's LoRA backend, which
        checks them by sha256 and the base by its manifest hash (:class:`ServesAdapters`)."""
        import dataclasses

        import torch

        from megarl.models.lora import adapters_disabled
        from megarl.models.peft_export import gather_peft_tensors, peft_config
        from megarl.rollout.weight_sync import actor_manifest

        ddp, engine = self.actor.ddp, self.engine
        if self._base_manifest is None:
            with adapters_disabled(ddp):
                self._base_manifest = actor_manifest(ddp, self.sync_dtype)
        base = self._base_manifest
        holds = engine is None or engine.active_version is not None
        num_bytes = 0
        if attempt > 0 or not self._whole_loaded or not all_ranks_agree(holds):
            base_version = dataclasses.replace(version, weight_manifest_hash=base.global_hash)
            with adapters_disabled(ddp):
                loaded = sync_actor_to_engine(ddp, engine, base_version, base, bucket_bytes=self.bucket_bytes,
                                              dtype=self.sync_dtype, transport=self._transport_fault(k, attempt))
            num_bytes += loaded.num_bytes if loaded is not None else 0
        tensors = gather_peft_tensors(ddp, self.sync_dtype or (engine.dtype if engine is not None else torch.float32))
        if engine is None:
            return None
        config = peft_config(tensors, rank=self.adapter["rank"], alpha=self.adapter["alpha"], dropout=0.0,
                             base_model=self.adapter["base_model"])
        report = engine.load_adapter(version, tensors, config, base.global_hash, manifest)
        return dataclasses.replace(report, num_bytes=report.num_bytes + num_bytes)

    def _transport_fault(self, k: Optional[int], attempt: int):
        """``faults.corrupt_weight_sync_at``: one value of the first bucket flipped in transit on
        the first load attempt of those iterations (the engine's manifest check must refuse it)."""
        if k is None or attempt > 0 or k not in self.corrupt_at:
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
