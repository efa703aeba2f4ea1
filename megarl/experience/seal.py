"""Sealing: an experience batch becomes read-only, content-hashed, and saved with a manifest.

After :func:`seal` every tensor of the batch is a :class:`SealedTensor`: reading, slicing and
arithmetic work as usual (results of arithmetic are ordinary tensors), but any in-place write
into sealed storage -- ``t[0] = x``, ``t.add_(1)``, ``torch.add(a, b, out=t)``, ``t.data = x``,
through a view or ``.detach()`` alias, or through ``.numpy()`` -- raises :class:`SealedWriteError`.
The dataclasses are frozen, so a field cannot be rebound either.

On disk a sealed batch is ``experience.safetensors`` plus ``manifest.json`` holding the
non-tensor facts, the SHA-256 of the tensor file and the batch's content hash (SHA-256 over a
canonical encoding of the metadata and every tensor's name, dtype, shape and bytes).
:func:`load_sealed` verifies both before returning.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from megarl.experience.schema import (
    DerivedTensors,
    ExperienceBatch,
    ExperienceFacts,
    FinishReason,
    LogProbProducer,
    LogProbs,
    RewardRecord,
    RoutedExperts,
    RoutingProducer,
    SamplingConfig,
    TokenOrigins,
    batch_tensors,
)
from megarl.hashing import canonical_json, file_sha256

MANIFEST_NAME = "manifest.json"
TENSOR_FILE = "experience.safetensors"
FORMAT_VERSION = 1


class SealedWriteError(RuntimeError):
    """An in-place write into a sealed experience tensor."""


class CorruptExperienceError(RuntimeError):
    """A saved experience batch does not match its manifest (hash mismatch, missing tensor)."""


_MUTATING_DUNDERS = frozenset(
    {
        "__setitem__", "__delitem__", "__set__", "__iadd__", "__isub__", "__imul__", "__itruediv__",
        "__ifloordiv__", "__imod__", "__ipow__", "__iand__", "__ior__", "__ixor__", "__ilshift__",
        "__irshift__", "__imatmul__",
    }
)  # fmt: skip


def _storage_ptr(t: torch.Tensor) -> int:
    with torch._C.DisableTorchFunctionSubclass():
        return t.untyped_storage().data_ptr()


class SealedTensor(torch.Tensor):
    """A tensor whose storage refuses in-place writes (see module docstring)."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        target = args[0] if args else None
        mutating = name in _MUTATING_DUNDERS or (name.endswith("_") and not name.startswith("__"))
        if mutating and isinstance(target, SealedTensor):
            raise SealedWriteError(f"experience batch is sealed: in-place {name!r} on a sealed tensor is not allowed")
        out_kw = kwargs.get("out")
        outs = out_kw if isinstance(out_kw, (tuple, list)) else (out_kw,)
        if any(isinstance(o, SealedTensor) for o in outs) or (kwargs.get("inplace") and isinstance(target, SealedTensor)):
            raise SealedWriteError(f"experience batch is sealed: {name!r} would write into a sealed tensor")
        with torch._C.DisableTorchFunctionSubclass():
            result = func(*args, **kwargs)
        if name == "numpy" and isinstance(target, SealedTensor):
            result.setflags(write=False)
            return result
        sealed_ptrs = {_storage_ptr(a) for a in _flat(args, kwargs) if isinstance(a, SealedTensor)}
        return _wrap_aliases(result, sealed_ptrs)


def _flat(args, kwargs):
    for a in list(args) + list(kwargs.values()):
        if isinstance(a, (tuple, list)):
            yield from a
        else:
            yield a


def _wrap_aliases(result: Any, sealed_ptrs: set[int]) -> Any:
    """Views of sealed storage stay sealed; fresh results are returned as plain tensors."""
    if isinstance(result, torch.Tensor):
        if type(result) is torch.Tensor and result.untyped_storage().data_ptr() in sealed_ptrs and result.numel() > 0:
            return result.as_subclass(SealedTensor)
        return result
    if isinstance(result, tuple) and not hasattr(result, "_fields"):
        return tuple(_wrap_aliases(r, sealed_ptrs) for r in result)
    if isinstance(result, list):
        return [_wrap_aliases(r, sealed_ptrs) for r in result]
    return result


def _freeze(t: torch.Tensor | None) -> torch.Tensor | None:
    if t is None or type(t) is SealedTensor:  # already read-only: sealed facts under new derived tensors
        return t
    with torch._C.DisableTorchFunctionSubclass():
        return t.detach().clone().contiguous().as_subclass(SealedTensor)


def _plain(t: torch.Tensor) -> torch.Tensor:
    with torch._C.DisableTorchFunctionSubclass():
        return t.detach().as_subclass(torch.Tensor).contiguous().clone()


def _map_tensors(batch: ExperienceBatch, fn, content_hash: str | None) -> ExperienceBatch:
    f = batch.facts
    facts = dataclasses.replace(
        f,
        prompt_ids=fn(f.prompt_ids),
        response_ids=fn(f.response_ids),
        attention_mask=fn(f.attention_mask),
        response_mask=fn(f.response_mask),
        values=fn(f.values),
        bootstrap_values=fn(f.bootstrap_values),
        rollout_log_probs=None if f.rollout_log_probs is None else LogProbs(fn(f.rollout_log_probs.values), f.rollout_log_probs.producer),
        old_log_probs=None if f.old_log_probs is None else LogProbs(fn(f.old_log_probs.values), f.old_log_probs.producer),
        ref_log_probs=None if f.ref_log_probs is None else LogProbs(fn(f.ref_log_probs.values), f.ref_log_probs.producer),
        teacher_log_probs=None if f.teacher_log_probs is None else LogProbs(fn(f.teacher_log_probs.values),
                                                                            f.teacher_log_probs.producer),
        routed_experts=None if f.routed_experts is None else dataclasses.replace(
            f.routed_experts, experts=fn(f.routed_experts.experts)),
        token_origins=None if f.token_origins is None else dataclasses.replace(
            f.token_origins, source=fn(f.token_origins.source), turn=fn(f.token_origins.turn),
            version_index=fn(f.token_origins.version_index)),
    )
    derived = None
    if batch.derived is not None:
        d = batch.derived
        derived = dataclasses.replace(
            d,
            advantages=fn(d.advantages),
            loss_mask=fn(d.loss_mask),
            returns=fn(d.returns),
            shaped_rewards=fn(d.shaped_rewards),
            is_weights=fn(d.is_weights),
        )
    return ExperienceBatch(facts=facts, derived=derived, content_hash=content_hash)


def _metadata(batch: ExperienceBatch) -> dict:
    f = batch.facts

    def prod(lp: LogProbs | None):
        if lp is None:
            return None
        out = dataclasses.asdict(lp.producer)
        if not out["precision"]:  # absent when unrecorded: earlier records keep their hashes
            del out["precision"]
        return out

    meta: dict[str, Any] = {
        "run_id": f.run_id,
        "iteration": f.iteration,
        "prompt_id": list(f.prompt_id),
        "group_id": list(f.group_id),
        "sample_id": list(f.sample_id),
        "finish_reason": [r.value for r in f.finish_reason],
        "policy_version": list(f.policy_version),
        "sampling": f.sampling.to_json(),
        "request_id": list(f.request_id),
        "seed": list(f.seed),
        "rewards": [r.to_json() for r in f.rewards],
        "producers": {
            "rollout_log_probs": prod(f.rollout_log_probs),
            "old_log_probs": prod(f.old_log_probs),
            "ref_log_probs": prod(f.ref_log_probs),
        },
        "critic_version": f.critic_version,
        "derived": None,
    }
    if f.teacher_log_probs is not None:  # absent (not null) without a teacher: earlier records keep their hashes
        meta["producers"]["teacher_log_probs"] = prod(f.teacher_log_probs)
    if batch.derived is not None:
        meta["derived"] = {"estimator": batch.derived.estimator, "hyperparameters": dict(batch.derived.hyperparameters)}
    if f.routed_experts is not None:  # absent (not null) for dense models: their hashes stay as they were
        meta["routed_experts"] = f.routed_experts.metadata()
    if f.token_origins is not None:  # absent (not null) for single-turn records: their hashes stay as they were
        meta["token_origins"] = f.token_origins.metadata()
    return meta


def _tensor_bytes(t: torch.Tensor) -> bytes:
    p = _plain(t).reshape(-1)
    if p.dtype != torch.uint8:
        p = p.view(torch.uint8)
    return p.numpy().tobytes()


def content_hash(batch: ExperienceBatch) -> str:
    """SHA-256 over canonical metadata JSON and each tensor's (name, dtype, shape, bytes)."""
    h = hashlib.sha256()
    h.update(canonical_json(_metadata(batch), default=None).encode())
    for name, t in sorted(batch_tensors(batch).items()):
        h.update(f"\0{name}\0{t.dtype}\0{tuple(t.shape)}\0".encode())
        h.update(_tensor_bytes(t))
    return "sha256:" + h.hexdigest()


def _require_origins(facts: ExperienceFacts) -> None:
    """A multi-turn record (:meth:`ExperienceFacts.multi_turn`) must say where each token came
    from: without ``token_origins`` an environment token is indistinguishable from a masked-out
    action and its turn and policy version are lost."""
    if facts.token_origins is not None:
        return
    multi = facts.multi_turn()
    if bool(multi.any()):
        b = int(multi.nonzero()[0])
        env = ((facts.attention_mask[b, facts.prompt_len:] != 0) & (facts.response_mask[b] == 0)).nonzero()
        why = (f"response position {int(env[0])} is a real token outside response_mask (an environment token)"
               if env.numel() else f"finish_reason {facts.finish_reason[b].value!r}")
        raise ValueError(f"seal: sample {facts.sample_id[b]!r} is a multi-turn trajectory ({why}), but the record "
                         "has no token_origins (per-token source, turn and policy version): it cannot be sealed")


def seal(batch: ExperienceBatch) -> ExperienceBatch:
    """A read-only copy of ``batch`` with its content hash (the caller's tensors stay untouched).

    Sealing a sealed batch returns it unchanged.  The metadata must be JSON-serialisable
    (``derived.hyperparameters`` included), since the hash covers it.  A multi-turn record
    without ``token_origins`` is refused (:func:`_require_origins`).
    """
    if batch.sealed:
        return batch
    _require_origins(batch.facts)
    frozen = _map_tensors(batch, _freeze, None)
    return dataclasses.replace(frozen, content_hash=content_hash(frozen))


def with_derived(batch: ExperienceBatch, derived: DerivedTensors) -> ExperienceBatch:
    """A new sealed batch: the same sealed facts with ``derived`` (replacing any earlier one)."""
    if not batch.sealed:
        raise ValueError("with_derived: seal the facts first (derived tensors are computed from sealed facts)")
    return seal(ExperienceBatch(facts=batch.facts, derived=derived))


def verify(batch: ExperienceBatch) -> None:
    """Recompute the content hash of a sealed batch; raise CorruptExperienceError on mismatch."""
    if not batch.sealed:
        raise ValueError("verify: batch is not sealed (content_hash is None)")
    got = content_hash(batch)
    if got != batch.content_hash:
        raise CorruptExperienceError(f"experience content hash {got} != sealed hash {batch.content_hash}")


def save_sealed(batch: ExperienceBatch, directory: str | os.PathLike) -> Path:
    """Write ``experience.safetensors`` and ``manifest.json`` into ``directory``; return the manifest path.

    The manifest is written last (atomically, via rename), so a directory with a manifest has a
    complete tensor file.
    """
    if not batch.sealed:
        raise ValueError("save_sealed: only a sealed batch can be saved (call seal() first)")
    verify(batch)
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    tensors = {k: _plain(v) for k, v in batch_tensors(batch).items()}
    tmp = d / (TENSOR_FILE + ".tmp")
    save_file(tensors, str(tmp))
    os.replace(tmp, d / TENSOR_FILE)
    manifest = {
        "format_version": FORMAT_VERSION,
        "content_hash": batch.content_hash,
        "tensor_file": TENSOR_FILE,
        "tensor_file_sha256": file_sha256(d / TENSOR_FILE),
        "tensors": {k: {"dtype": str(v.dtype), "shape": list(v.shape)} for k, v in sorted(tensors.items())},
        "metadata": _metadata(batch),
    }
    mtmp = d / (MANIFEST_NAME + ".tmp")
    mtmp.write_text(json.dumps(manifest, indent=1, sort_keys=True))
    os.replace(mtmp, d / MANIFEST_NAME)
    return d / MANIFEST_NAME


def _routed_experts(meta: dict | None, experts: torch.Tensor | None, where) -> RoutedExperts | None:
    if (meta is None) != (experts is None):
        raise CorruptExperienceError(f"{where}: routed_experts metadata and tensor must be saved together "
                                     f"(metadata {'present' if meta else 'absent'}, tensor "
                                     f"{'present' if experts is not None else 'absent'})")
    if meta is None:
        return None
    return RoutedExperts(experts=experts, producer=RoutingProducer(**meta["producer"]),
                         num_experts=meta["num_experts"], moe_layers=tuple(meta["moe_layers"]))


def _token_origins(meta: dict | None, tensors: dict, where) -> TokenOrigins | None:
    names = [f"facts.token_origins.{n}" for n in ("source", "turn", "version_index")]
    present = [n in tensors for n in names]
    if (meta is None and any(present)) or (meta is not None and not all(present)):
        raise CorruptExperienceError(f"{where}: token_origins metadata and its three tensors must be saved together "
                                     f"(metadata {'present' if meta is not None else 'absent'}, tensors "
                                     f"{[n for n, p in zip(names, present, strict=True) if p]})")
    if meta is None:
        return None
    return TokenOrigins(*(tensors[n] for n in names), versions=tuple(meta["versions"]))


def load_sealed(directory: str | os.PathLike) -> ExperienceBatch:
    """Load a batch saved by :func:`save_sealed`, verifying the file hash and the content hash."""
    d = Path(directory)
    try:
        manifest = json.loads((d / MANIFEST_NAME).read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CorruptExperienceError(f"{d / MANIFEST_NAME} is not valid JSON: {e}") from e
    if manifest.get("format_version") != FORMAT_VERSION:
        raise CorruptExperienceError(f"{d / MANIFEST_NAME}: format_version {manifest.get('format_version')} != {FORMAT_VERSION}")
    tf = d / manifest["tensor_file"]
    got = file_sha256(tf)
    if got != manifest["tensor_file_sha256"]:
        raise CorruptExperienceError(f"{tf}: sha256 {got} != manifest tensor_file_sha256 {manifest['tensor_file_sha256']}")
    tensors = load_file(str(tf))
    if set(tensors) != set(manifest["tensors"]):
        raise CorruptExperienceError(f"{tf}: tensors {sorted(tensors)} != manifest {sorted(manifest['tensors'])}")
    m = manifest["metadata"]

    def lp(name: str) -> LogProbs | None:
        p = m["producers"].get(name)
        return None if p is None else LogProbs(tensors[f"facts.{name}"], LogProbProducer(**p))

    facts = ExperienceFacts(
        run_id=m["run_id"],
        iteration=m["iteration"],
        prompt_id=tuple(m["prompt_id"]),
        group_id=tuple(m["group_id"]),
        sample_id=tuple(m["sample_id"]),
        prompt_ids=tensors["facts.prompt_ids"],
        response_ids=tensors["facts.response_ids"],
        attention_mask=tensors["facts.attention_mask"],
        response_mask=tensors["facts.response_mask"],
        finish_reason=tuple(FinishReason(x) for x in m["finish_reason"]),
        policy_version=tuple(m["policy_version"]),
        sampling=SamplingConfig.from_json(m["sampling"]),
        request_id=tuple(m["request_id"]),
        seed=tuple(m["seed"]),
        rewards=tuple(RewardRecord.from_json(r) for r in m["rewards"]),
        rollout_log_probs=lp("rollout_log_probs"),
        old_log_probs=lp("old_log_probs"),
        ref_log_probs=lp("ref_log_probs"),
        teacher_log_probs=lp("teacher_log_probs"),
        values=tensors.get("facts.values"),
        bootstrap_values=tensors.get("facts.bootstrap_values"),
        critic_version=m["critic_version"],
        routed_experts=_routed_experts(m.get("routed_experts"), tensors.get("facts.routed_experts"), tf),
        token_origins=_token_origins(m.get("token_origins"), tensors, tf),
    )
    derived = None
    if m["derived"] is not None:
        derived = DerivedTensors(
            advantages=tensors["derived.advantages"],
            loss_mask=tensors["derived.loss_mask"],
            returns=tensors.get("derived.returns"),
            shaped_rewards=tensors.get("derived.shaped_rewards"),
            is_weights=tensors.get("derived.is_weights"),
            estimator=m["derived"]["estimator"],
            hyperparameters=m["derived"]["hyperparameters"],
        )
    batch = _map_tensors(ExperienceBatch(facts=facts, derived=derived), _freeze, manifest["content_hash"])
    verify(batch)
    return batch
