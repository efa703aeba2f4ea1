"""The hybrid engine: megatron actor shards -> rollout engine, verified by manifest.

Two collective passes over the actor's logical tensors (gathered over TP, one parameter alive
at a time, names and layouts from the mapping module):

1. at commit, :func:`actor_manifest` checksums every logical tensor where it lies
   (``megarl.models.weights.iter_hf_views``: on the GPU for a GPU actor, nothing but a few KiB
   per tensor crosses to the host; Q, K and V read inside the fused QKV; PP stages exchange
   entries only); its global hash becomes the ``weight_manifest_hash`` of the new
   :class:`PolicyVersion`;
2. at export, :func:`sync_actor_to_engine` streams the same tensors in buckets into the engine
   (``megarl.models.weights.iter_hf_tensors``, broadcast over PP), which checksums what landed
   and activates only if it equals that manifest.

The manifest is layout-independent (it describes logical HF tensors, each exactly once, in the
canonical order of :func:`megarl.models.mapping.hf_names_in_order`), so a run resumed at another
TP/PP/EP proves its loaded weights against the checkpointed version with it.

Every rank of the model-parallel group runs both passes; only ranks holding an engine (one per
inference group) consume the stream, the others drain it.  If the engine rejects a bucket, the
stream is still drained so no rank is left waiting in a collective.
"""

from __future__ import annotations

from typing import Callable, Iterable, Iterator, List, Optional, Tuple

import torch
import torch.distributed as dist

from megarl.hashing import json_sha256
from megarl.models import mapping
from megarl.models.weights import iter_hf_views, iter_hf_tensors, unwrap
from megarl.observability.profiling import span
from megarl.rollout.protocol import LoadReport
from megarl.rollout.weight_stream import ManifestMismatchError, TensorEntry, TensorManifest, iter_buckets
from megarl.versions import PolicyVersion

Bucket = List[Tuple[str, torch.Tensor]]


def actor_manifest(actor_model, dtype: Optional[torch.dtype] = None) -> TensorManifest:
    """Collective: the manifest (name, shape, dtype, checksum) of the actor's logical tensors,
    identical on every rank, its entries in the canonical mapping order whatever the layout.

    Each pipeline stage checksums the tensors it owns where they lie, on the device they were
    gathered on: a Q, K or V is read in place inside megatron's fused QKV (no de-interleaving
    copy), and the stages exchange their entries, never the tensors.  A routed expert of a
    mixture-of-experts model is checksummed on its owner EP rank only and the EP ranks exchange
    entries the same way, so every expert appears exactly once (:func:`_union_over`).  With
    ``dtype`` the checksums are of the tensors cast to it (what an engine in that dtype receives)."""
    from megatron.core import parallel_state as ps

    own = TensorManifest()
    for name, shape, view in iter_hf_views(actor_model):
        own.add_view(name, shape, view if dtype is None else view.to(dtype))
    ep, pp = ps.get_expert_model_parallel_world_size(), ps.get_pipeline_model_parallel_world_size()
    if ep == 1 and pp == 1:
        return own  # complete, and in canonical order already
    entries = list(own.entries.values())
    if ep > 1:  # within a stage first: its EP ranks hold its dense tensors alike and their own experts
        entries = _union_over(entries, ps.get_expert_model_parallel_group(), "expert-parallel")
    if pp > 1:
        entries = _union_over(entries, ps.get_pipeline_model_parallel_group(), "pipeline")
    order = {name: i for i, name in enumerate(mapping.hf_names_in_order(unwrap(actor_model).megarl_spec))}
    manifest = TensorManifest()
    for entry in sorted(entries, key=lambda e: order[e.name]):
        manifest.add_entry(entry)
    return manifest


def _union_over(entries: List[TensorEntry], group, what: str) -> List[TensorEntry]:
    """Collective over ``group``: every rank's entries, each name once.  A name several ranks
    hold (an EP group's ranks are data-parallel replicas of everything but their experts) must
    have the same entry on all of them, else the ranks disagree about the weights: refused by name."""
    parts: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(parts, entries, group=group)
    seen: dict = {}
    for rank, part in enumerate(parts):
        for e in part:
            first = seen.setdefault(e.name, (rank, e))
            if first[1] != e:
                raise ManifestMismatchError(
                    f"{e.name}: {what} ranks {first[0]} and {rank} hold different weights "
                    f"({first[1].checksum} vs {e.checksum}); replicas must be identical")
    return [e for _, e in seen.values()]


def model_config_hash(actor_model) -> str:
    """Hash of the model architecture the weights are laid out for (part of the version)."""
    return json_sha256(unwrap(actor_model).megarl_spec.to_dict())


def make_version(actor_model, manifest: TensorManifest, run_id: str, optimizer_step: int,
                 tokenizer_hash: str, update_attempt: int = 0) -> PolicyVersion:
    return PolicyVersion(run_id=run_id, optimizer_step=optimizer_step, update_attempt=update_attempt,
                         weight_manifest_hash=manifest.global_hash, tokenizer_hash=tokenizer_hash,
                         model_config_hash=model_config_hash(actor_model))


class _BuildInEngine:
    """The stream's ``out`` (:func:`megarl.models.mapping.hf_from_shards`): a tensor the merge has
    to build anyway (a de-interleaved Q, K or V) is built straight in the engine's staging tensor
    when the engine offers one of that shape, dtype and device (``staging_target``), which saves
    copying it again; else in a new tensor."""

    def __init__(self, engine):
        self.engine = engine

    def __call__(self, name, shape, like):
        t = self.engine.staging_target(name)
        if t is None or tuple(t.shape) != tuple(shape) or t.dtype != like.dtype or t.device != like.device:
            return torch.empty(shape, dtype=like.dtype, device=like.device)
        return t


def _drained(stream: Iterator) -> None:
    for _ in stream:
        pass


def sync_actor_to_engine(
    actor_model,
    engine,
    version: PolicyVersion,
    expected_manifest: TensorManifest,
    bucket_bytes: int = 512 * 1024**2,
    dtype: Optional[torch.dtype] = None,
    transport: Optional[Callable[[Bucket], Bucket]] = None,
    names: Optional[frozenset] = None,
) -> Optional[LoadReport]:
    """Collective: stream the actor's tensors into ``engine`` (``None`` on ranks without one).

    ``names`` (the same on every rank): stream only these tensors; the engine keeps the others
    and proves them against ``expected_manifest`` where they lie (:class:`KeepsUnsentTensors`).
    A LoRA actor sends its adapted linears' merged weights only, after a first whole load.

    ``transport`` maps each bucket on its way (identity by default).  It is where a real
    transport serialises/ships a bucket, and where fault-injection tests corrupt one; with a
    transport nothing is built in the engine's staging tensors (``engine.staging_target``).
    Returns the engine's :class:`LoadReport`; raises what the engine raised (e.g.
    ``ManifestMismatchError``) after the stream has been drained on this rank.
    """
    # Tensors go where the engine computes: CPU for the hf backend, the GPU for sglang
    # (its CUDA-IPC hand-over then needs no host round trip).
    # The engine's dtype by default; the expected manifest must have been computed in the same
    # dtype (``actor_manifest(actor, dtype=...)``), else the engine rejects the load by name.
    if dtype is None and engine is not None:
        dtype = engine.dtype
    # Without a transport in between, tensors the merge builds are built in the engine (a
    # transport ships or alters buckets on their way, so the engine's memory is not theirs).
    out = _BuildInEngine(engine) if engine is not None and transport is None else None
    # ranks without an engine only drain the stream (onto the CPU)
    stream = iter_hf_tensors(actor_model, dtype=dtype, device=str(engine.device) if engine is not None else "cpu",
                             out=out, names=names)
    if engine is None:
        _drained(stream)
        return None
    buckets: Iterable[Bucket] = _spanned(iter_buckets(_spanned(stream, "weight_sync.gather"), bucket_bytes),
                                         "weight_sync.bucket")
    if transport is not None:
        buckets = (transport(b) for b in buckets)
    try:
        with span("weight_sync.load"):
            if names is not None:
                return engine.load_weights(version, buckets, expected_manifest, keep_unsent=True)
            return engine.load_weights(version, buckets, expected_manifest)
    finally:
        _drained(stream)


def _spanned(items, phase: str):
    """``items``, each one's production inside a profiler span of ``phase``."""
    it = iter(items)
    while True:
        with span(phase):
            try:
                item = next(it)
            except StopIteration:
                return
        yield item
