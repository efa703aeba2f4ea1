"""sglang rollout backend: an in-process ``sglang.Engine`` per inference group, on GPU.

Written against SGLang's offline Engine API as read in (sources cited where used):
  * ``python/sglang/srt/entrypoints/engine.py``: ``Engine(**ServerArgs)`` runs its schedulers in
    child processes (one per TP rank); ``update_weights_from_tensor(named_tensors, load_format,
    flush_cache)`` takes, for ``load_format="flattened_bucket"``, a list of per-TP-rank
    pre-serialized payloads (``_serialize_tensors_per_rank``); ``flush_cache()``;
    ``release_memory_occupation(tags)`` / ``resume_memory_occupation(tags)``, effective only when
    the engine was started with ``enable_memory_saver=True`` (TorchMemorySaverAdapter).
  * ``python/sglang/srt/weight_sync/utils.py``: tensors cross to the schedulers as CUDA IPC
    handles serialized with ``MultiprocessingSerializer``; every TP rank serializes its own copy
    and the group's first rank gathers them with ``gather_object``; ``monkey_patch_torch_reductions``
    first.
  * slime ``slime/backends/megatron_utils/update_weight/update_weight_from_tensor.py``
    (``_send_to_colocated_engine``): one ``FlattenedTensorBucket`` per dtype, payload
    ``{"flattened_tensor", "metadata"}`` serialized with ``output_str=True``; keep the flattened
    tensors alive until every engine call returned (SGLang enqueues the copy and may return
    before it ran); ``torch.cuda.ipc_collect()`` after each bucket.
  * verl ``verl/workers/rollout/sglang_rollout/sglang_rollout.py``: only infer-TP rank 0 talks to
    the engine; ``flush_cache`` after the whole update; release ``["kv_cache", "weights"]``.
  * Log-prob space: SGLang's Sampler returns log softmax(logits / T) by default and the raw
    log softmax(logits) when ``SGLANG_RETURN_ORIGINAL_LOGPROB`` (``RETURN_ORIGINAL_LOGPROB``
    in older releases) is true.  This backend sets both before the engine (and so its child
    processes) starts and therefore returns **raw** log-probs; ``processed_log_probs`` is None
    (SGLang does not return the top-k/top-p-renormalised probability).  tests/gpu checks the
    space against a direct forward.

Differences from the hf backend, stated rather than hidden: SGLang updates weights in place (no
second copy of the model fits next to the KV cache), so once the first bucket of v+1 has been
handed over, v is gone.  Every tensor is checked against the expected manifest *before* it is
handed over (a corrupted tensor is never loaded), generate() is refused from the first bucket
until activate(), and a failed load leaves the engine with no active version (the control plane
must reload a version) unless nothing had been handed over yet, in which case it stays on v.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterable, Sequence

import torch

from megarl.rollout.protocol import (
    ActivationReport,
    EngineAsleepError,
    FinishReason,
    GenerationRequest,
    GenerationResult,
    InvalidRequestError,
    LoadReport,
    NoActiveVersionError,
    RolloutBusyError,
    RolloutError,
    SamplingParams,
    VersionNotStagedError,
    candidate_seed,
)
from megarl.rollout.weight_stream import ManifestMismatchError, TensorManifest, flatten_bucket_by_dtype
from megarl.versions import PolicyVersion

__all__ = [
    "SGLangRolloutEngine",
    "BackendUnavailableError",
    "import_sglang",
    "sglang_sampling_params",
    "result_from_sglang_output",
]

LOG_PROB_ENV_VARS = ("SGLANG_RETURN_ORIGINAL_LOGPROB", "RETURN_ORIGINAL_LOGPROB")


class BackendUnavailableError(RolloutError, ImportError):
    """A rollout backend's package is not installed."""


def import_sglang():
    """Import sglang lazily, with an error that says what to install."""
    try:
        import sglang  # noqa: F401
        import sglang.srt.entrypoints.engine  # noqa: F401
    except ImportError as e:
        raise BackendUnavailableError(
            "rollout backend 'sglang' needs the Python package 'sglang', which is not importable "
            f"here ({e}); install the GPU extra: pip install megarl[gpu]"
        ) from e
    return sglang


def _serializer():
    from sglang.srt.utils import MultiprocessingSerializer

    return MultiprocessingSerializer


def _monkey_patch_torch_reductions():
    # location moved between releases (slime backends/megatron_utils/sglang.py)
    try:
        from sglang.srt.utils.patch_torch import monkey_patch_torch_reductions
    except ImportError:
        from sglang.srt.patch_torch import monkey_patch_torch_reductions
    monkey_patch_torch_reductions()


def _supports_sampling_seed() -> bool:
    try:
        from sglang.srt.sampling.sampling_params import SamplingParams as SglSP
    except ImportError:
        return False
    fields = getattr(SglSP, "__struct_fields__", None)  # msgspec.Struct (recent releases)
    if fields is None:
        import inspect

        fields = tuple(inspect.signature(SglSP.__init__).parameters)
    return "sampling_seed" in fields


# ---- pure mapping functions (CPU-testable) -----------------------------------------------------


def sglang_sampling_params(sampling: SamplingParams, seed: int | None, with_seed: bool) -> dict:
    """Our sampling contract as an SGLang ``sampling_params`` dict for one candidate (n=1: we
    expand candidates ourselves so each gets its own seed, like the hf backend)."""
    params = {
        "temperature": sampling.temperature,  # 0 -> greedy in SGLang (top_k=1)
        "top_p": sampling.top_p,
        "top_k": sampling.top_k,  # -1 = off, same convention as SGLang
        "max_new_tokens": sampling.max_new_tokens,
        "stop_token_ids": list(sampling.stop_token_ids) or None,
        "n": 1,
        "ignore_eos": False,
        "skip_special_tokens": False,
        "no_stop_trim": True,
    }
    if with_seed and seed is not None and not sampling.greedy:
        params["sampling_seed"] = int(seed)
    return params


def result_from_sglang_output(
    out: dict,
    request: GenerationRequest,
    candidate_index: int,
    sampling: SamplingParams,
    eos_token_ids: Sequence[int],
    version_id: str,
    seed: int | None,
) -> GenerationResult:
    """Map one SGLang generate() output (``output_ids`` + ``meta_info``) to a GenerationResult.

    ``meta_info["output_token_logprobs"]`` is a list of ``(logprob, token_id, text_or_None)``,
    one per generated token; ``meta_info["finish_reason"]`` is ``{"type": "stop"|"length"|
    "abort", "matched": token id or str or None, ...}``.
    """
    meta = out["meta_info"]
    entries = meta.get("output_token_logprobs")
    if entries is None:
        raise RolloutError(f"{request.request_id}: SGLang output has no output_token_logprobs (return_logprob not set?)")
    tokens = [int(e[1]) for e in entries]
    output_ids = out.get("output_ids")
    if output_ids is not None and list(output_ids) != tokens:
        raise RolloutError(
            f"{request.request_id}/{candidate_index}: SGLang output_ids {list(output_ids)[:8]}... disagree "
            f"with the tokens of output_token_logprobs {tokens[:8]}..."
        )
    fr = meta.get("finish_reason") or {}
    kind = fr.get("type") if isinstance(fr, dict) else str(fr)
    matched = fr.get("matched") if isinstance(fr, dict) else None
    if kind == "length":
        reason = FinishReason.LENGTH
    elif kind == "abort":
        reason = FinishReason.ABORT
    elif kind == "stop":
        last = matched if isinstance(matched, int) else (tokens[-1] if tokens else None)
        if last in set(eos_token_ids):
            reason = FinishReason.EOS
        elif last in set(sampling.stop_token_ids):
            reason = FinishReason.STOP
        else:
            raise RolloutError(
                f"{request.request_id}: SGLang stopped on {matched!r}, which is neither an eos id "
                f"{list(eos_token_ids)} nor a stop id {list(sampling.stop_token_ids)}"
            )
        if not tokens or tokens[-1] != last:
            raise RolloutError(
                f"{request.request_id}: SGLang finished on {last} but the response does not end with it "
                f"({tokens[-3:]}); the response boundary would be wrong"
            )
    else:
        raise RolloutError(f"{request.request_id}: unknown SGLang finish_reason {fr!r}")
    raw = torch.tensor([float(e[0]) for e in entries], dtype=torch.float32)
    return GenerationResult(
        request_id=request.request_id,
        candidate_index=candidate_index,
        prompt_ids=request.prompt_ids,
        response_ids=tuple(tokens),
        finish_reason=reason,
        raw_log_probs=raw,
        processed_log_probs=None,
        policy_version=version_id,
        seed=seed,
    )


# ---- the engine ---------------------------------------------------------------------------------


class SGLangRolloutEngine:
    """One SGLang engine per inference group; every rank of the group constructs this object and
    calls every method (SPMD), the group's first rank owns ``sglang.Engine``.

    Args:
        model_path: exported HF model dir (config.json; weights are replaced by the stream, the
            engine starts with ``load_format="dummy"`` so nothing is read from disk).
        tp_size: SGLang tensor parallel size == number of ranks in ``group``.
        group: torch.distributed process group of this inference group (None when tp_size == 1
            and no torch.distributed): its ranks are the GPUs base_gpu_id .. base_gpu_id+tp-1.
        eos_token_ids: ids reported as FinishReason.EOS.
        engine_kwargs: extra ``ServerArgs`` (e.g. ``attention_backend``, ``cuda_graph_max_bs``).
    """

    log_prob_spaces = frozenset({"raw"})

    def __init__(
        self,
        model_path: str | os.PathLike,
        *,
        tp_size: int = 1,
        group=None,
        eos_token_ids: Sequence[int] = (),
        dtype: str = "bfloat16",
        mem_fraction_static: float = 0.5,
        seed: int = 0,
        engine_kwargs: dict | None = None,
    ):
        sglang = import_sglang()
        import torch.distributed as dist

        self.group = group
        self.tp_size = tp_size
        self.rank_in_group = dist.get_rank(group) if group is not None else 0
        group_size = dist.get_world_size(group) if group is not None else 1
        if group_size != tp_size:
            raise ValueError(f"sglang backend: inference group has {group_size} ranks but tp_size={tp_size}")
        self.src_global_rank = dist.get_global_rank(group, 0) if group is not None else 0
        self.device = torch.device("cuda", torch.cuda.current_device())
        self.eos_token_ids = tuple(int(t) for t in eos_token_ids)
        for var in LOG_PROB_ENV_VARS:  # raw log-probs; must precede the schedulers' spawn
            os.environ[var] = "1"
        self._engine = None
        if self.rank_in_group == 0:
            kwargs = dict(
                model_path=os.fspath(model_path),
                tp_size=tp_size,
                base_gpu_id=self.device.index,
                enable_memory_saver=True,
                skip_tokenizer_init=True,
                load_format="dummy",
                dtype=dtype,
                mem_fraction_static=mem_fraction_static,
                random_seed=seed,
                log_level="error",
            )
            kwargs.update(engine_kwargs or {})
            self._engine = sglang.Engine(**kwargs)
        self._with_seed = _supports_sampling_seed()
        self._active: PolicyVersion | None = None
        self._staged: PolicyVersion | None = None
        self._staged_manifest: TensorManifest | None = None
        self._loading: PolicyVersion | None = None
        self._asleep = False
        self._barrier()

    # ---- collectives within the inference group ----

    def _barrier(self):
        if self.group is not None:
            import torch.distributed as dist

            dist.barrier(group=self.group)

    def _all_ok(self, ok: bool) -> bool:
        if self.group is None:
            return ok
        import torch.distributed as dist

        flag = torch.tensor([1 if ok else 0], device=self.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=self.group)
        return bool(flag.item())

    def _broadcast(self, obj):
        if self.group is None:
            return obj
        import torch.distributed as dist

        box = [obj]
        dist.broadcast_object_list(box, src=self.src_global_rank, group=self.group)
        return box[0]

    # ---- versions ----

    @property
    def active_version(self) -> PolicyVersion | None:
        return self._active

    def load_weights(
        self,
        version: PolicyVersion,
        named_tensor_buckets: Iterable[Sequence[tuple[str, torch.Tensor]]],
        expected_manifest: TensorManifest,
    ) -> LoadReport:
        import torch.distributed as dist

        if expected_manifest.global_hash != version.weight_manifest_hash:
            raise ManifestMismatchError(
                f"expected manifest hash {expected_manifest.global_hash} is not the manifest of "
                f"{version.short_id} ({version.weight_manifest_hash})"
            )
        if self._asleep:
            raise EngineAsleepError(f"load_weights({version.short_id}): engine is asleep; wake() first")
        if self._loading is not None:
            raise RolloutBusyError(f"load_weights({version.short_id}): already loading {self._loading.short_id}")
        _monkey_patch_torch_reductions()
        serializer = _serializer()
        self._loading, self._staged, self._staged_manifest = version, None, None
        t0 = time.perf_counter()
        received = TensorManifest()
        n_bytes = n_buckets = 0
        try:
            for bucket in named_tensor_buckets:
                n_buckets += 1
                error = None
                try:  # verify before handing anything to the engine
                    for name, tensor in bucket:
                        if name in received.entries:
                            raise ManifestMismatchError(f"{version.short_id}: tensor {name!r} received twice")
                        received.entries[name] = expected_manifest.check_entry(name, tensor)
                        n_bytes += tensor.numel() * tensor.element_size()
                except ManifestMismatchError as e:
                    error = e
                if not self._all_ok(error is None):
                    raise error or ManifestMismatchError(
                        f"{version.short_id}: another rank of the inference group rejected bucket {n_buckets}"
                    )
                on_device = [(n, t.to(self.device, non_blocking=True)) for n, t in bucket]
                flat = flatten_bucket_by_dtype(on_device)
                payloads = [
                    serializer.serialize(
                        {"flattened_tensor": b.get_flattened_tensor(), "metadata": b.get_metadata()},
                        output_str=True,
                    )
                    for b in flat.values()
                ]
                torch.cuda.synchronize(self.device)
                gathered = [None] * self.tp_size if self.rank_in_group == 0 else None
                if self.group is not None:
                    dist.gather_object(payloads, gathered, dst=self.src_global_rank, group=self.group)
                else:
                    gathered = [payloads]
                self._active = None  # in place from here: v is no longer what the engine holds
                if self.rank_in_group == 0:
                    counts = {len(p) for p in gathered}
                    if len(counts) != 1:
                        raise RolloutError(f"TP ranks sent different numbers of dtype buckets: {counts}")
                    for i in range(counts.pop()):
                        self._engine.update_weights_from_tensor(
                            named_tensors=[per_rank[i] for per_rank in gathered],
                            load_format="flattened_bucket",
                            flush_cache=False,
                        )
                self._barrier()  # every rank keeps its flattened tensors alive until here (slime)
                del flat, payloads, on_device, gathered
                torch.cuda.ipc_collect()
            diff = expected_manifest.compare(received)
            if not diff.ok:
                raise ManifestMismatchError(f"{version.short_id}: stream incomplete: {diff.describe()}", diff)
            self.flush_cache()
            self._staged, self._staged_manifest = version, received
        finally:  # on failure before any hand-over _active is still v; after it, None (reload)
            self._loading = None
        return LoadReport(version.short_id, received.global_hash, len(received), n_bytes, n_buckets, time.perf_counter() - t0)

    def activate(self, version: PolicyVersion) -> ActivationReport:
        if self._staged != version:
            staged = self._staged.short_id if self._staged else None
            raise VersionNotStagedError(f"activate({version.short_id}): staged version is {staged}")
        self.flush_cache()
        self._active, self._staged = version, None
        return ActivationReport(version.short_id, self._staged_manifest.global_hash, True, True)

    def flush_cache(self) -> None:
        if self.rank_in_group == 0:
            out = self._engine.flush_cache()
            success = getattr(out, "success", True)
            if success is False:
                raise RolloutError(f"SGLang flush_cache failed: {out}")
        self._barrier()

    # ---- memory ----

    def sleep(self, release_weights: bool = True) -> None:
        """Release KV cache (and weights) for the actor's turn.  Released weights are gone: the
        active version is cleared and the next version must be loaded after wake()."""
        if self._loading is not None:
            raise RolloutBusyError("sleep(): engine is loading")
        if self.rank_in_group == 0:
            self._engine.release_memory_occupation(tags=["kv_cache", "weights"] if release_weights else ["kv_cache"])
        if release_weights:
            self._active, self._staged = None, None
        self._asleep = True
        self._barrier()

    def wake(self) -> None:
        if self.rank_in_group == 0:
            self._engine.resume_memory_occupation()
        self._asleep = False
        self._barrier()

    def shutdown(self) -> None:
        if self._engine is not None:
            self._engine.shutdown()
            self._engine = None

    # ---- generation ----

    def generate(
        self, requests: Sequence[GenerationRequest], sampling: SamplingParams
    ) -> list[GenerationResult]:
        """All ranks of the group call with the same requests; rank 0 runs, results are broadcast."""
        if self._loading is not None:
            raise RolloutBusyError(f"generate refused: loading {self._loading.short_id}")
        if self._asleep:
            raise EngineAsleepError("generate refused: engine is asleep; wake() first")
        if self._active is None:
            raise NoActiveVersionError("generate refused: no version is active (none loaded, or released)")
        ids = [r.request_id for r in requests]
        if len(set(ids)) != len(ids):
            raise InvalidRequestError(f"duplicate request_id in one generate call: {sorted(ids)}")
        version_id = self._active.short_id
        rows = [(r, c) for r in requests for c in range(sampling.n)]
        seeds = [candidate_seed(sampling.seed, r.request_id, c) for r, c in rows]
        results = None
        if self.rank_in_group == 0 and rows:
            outs = self._engine.generate(
                input_ids=[list(r.prompt_ids) for r, _ in rows],
                sampling_params=[sglang_sampling_params(sampling, s, self._with_seed) for s in seeds],
                return_logprob=True,
            )
            results = [
                result_from_sglang_output(o, r, c, sampling, self.eos_token_ids, version_id, None if sampling.greedy else s)
                for o, (r, c), s in zip(outs, rows, seeds, strict=True)
            ]
        return self._broadcast(results) or []
