"""sglang rollout backend: an in-process ``sglang.Engine`` per inference group, on GPU.

Written against SGLang 0.5.3 .. 0.5.23 (``setup.py`` extra ``gpu``; the Docker image pins 0.5.23).
What each call relies on is recorded, per release, in ``docker/sglang_api/sglang-<v>.json`` (read
from the release's source by ``docker/sglang_api/record.py``), and
``tests/test_sglang_api_contract.py`` drives this class against a fake engine built from those
records.  Every rank of the group constructs :class:`SGLangRolloutEngine` and calls every method;
the group's first rank owns the engine.  Log-probs are **raw** (``processed_log_probs`` is None).

Differences from the hf backend, stated rather than hidden: SGLang updates weights in place (no
second copy of the model fits next to the KV cache), so once the first bucket of v+1 has been
handed over, v is gone.  Every tensor is checked against the expected manifest *before* it is
handed over (a corrupted tensor is never loaded), generate() is refused from the first bucket
until activate(), and a failed load leaves the engine with no active version (the control plane
must reload one) unless nothing had been handed over yet, in which case it stays on v.

What each SGLang call relies on, release by release (paths, sessions, memory tags, EOS, seeds,
weight checks, routed experts, environment variables): docs/gpu.md, "SGLang calls, release by
release".
"""

from __future__ import annotations

import dataclasses
import json
import os
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
    RolloutBusyError,
    RolloutError,
    SamplingParams,
    candidate_seed,
)
from megarl.rollout.lifecycle import VersionLifecycle
from megarl.rollout.manifest_receiver import ManifestReceiver
from megarl.experience.schema import SampleRouting, compact_expert_dtype
from megarl.models.safetensors_io import model_dir_eos_token_ids
from megarl.rollout.weight_stream import (
    ManifestMismatchError,
    TensorManifest,
    flatten_bucket_by_dtype,
    get_flattened_tensor_bucket_class,
)
from megarl.versions import PolicyVersion

__all__ = [
    "SGLangRolloutEngine",
    "BackendUnavailableError",
    "WeightUpdateRejectedError",
    "import_sglang",
    "sglang_sampling_params",
    "stop_token_ids_sent",
    "result_from_sglang_output",
    "routed_experts_from_sglang_output",
    "moe_layout_from_config",
    "MoELayout",
    "model_dir_eos_token_ids",
    "TRAINER_ENV_VARS",
]

LOG_PROB_ENV_VARS = ("SGLANG_RETURN_ORIGINAL_LOGPROB", "RETURN_ORIGINAL_LOGPROB")
#: variables ``Engine()`` overwrites in the calling (trainer) process; restored after it started
TRAINER_ENV_VARS = ("CUDA_DEVICE_MAX_CONNECTIONS", "NCCL_CUMEM_ENABLE", "NCCL_NVLS_ENABLE",
                    "NCCL_GRAPH_MIXING_SUPPORT")
#: memory-saver tags (``constants.py`` GPU_MEMORY_TYPE_KV_CACHE / GPU_MEMORY_TYPE_WEIGHTS)
KV_CACHE, WEIGHTS = "kv_cache", "weights"
_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "half": torch.float16,
           "float32": torch.float32, "float": torch.float32}


class BackendUnavailableError(RolloutError, ImportError):
    """A rollout backend's package is not installed."""


class WeightsNotWrittenError(RolloutError):
    """A load the engine reported as successful left engine parameters unwritten."""


#: when a load proves every engine parameter was written (SGLangRolloutEngine ``verify_writes``)
VERIFY_WRITES = ("first", "every", "never")


def weight_checker_request():
    """SGLang's ``CheckWeightsReqInput`` (None for a release without the weight checker)."""
    try:
        from sglang.srt.managers.io_struct import CheckWeightsReqInput
    except ImportError:
        return None
    return CheckWeightsReqInput


class WeightUpdateRejectedError(RolloutError):
    """The engine answered a weight-update call with ``success=False``: the load failed."""


def import_sglang():
    """Import sglang lazily, with an error that says what to install."""
    try:
        import sglang  # noqa: F401
        import sglang.srt.entrypoints.engine  # noqa: F401
    except ImportError as e:
        raise BackendUnavailableError(
            "rollout backend 'sglang' needs the Python package 'sglang', which is not importable "
            f"here ({e}); install the GPU extra: pip install -e \".[gpu]\" (or use the Dockerfile)"
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


def _generate_accepts(option: str) -> bool:
    """The installed release's ``Engine.generate`` takes ``option`` (``return_routed_experts``: 0.5.7+)."""
    import inspect

    from sglang.srt.entrypoints.engine import Engine

    return option in inspect.signature(Engine.generate).parameters


def _captures_logical_ids() -> bool:
    """Whether routed-expert ids are captured before the logical -> physical map (0.5.23:
    ``sglang.srt.state_capturer``; 0.5.7 captures after it, in ``layers/moe/topk.py``)."""
    import importlib

    try:
        importlib.import_module("sglang.srt.state_capturer.routed_experts")
    except ImportError:
        return False
    return True


def _success(out, call: str) -> tuple[bool, str]:
    """``(success, message)`` of a weight-update call; any other shape is an API change."""
    if isinstance(out, (tuple, list)) and len(out) == 2 and isinstance(out[0], bool):
        return out[0], str(out[1])
    if hasattr(out, "success"):  # a *ReqOutput struct
        return bool(out.success), str(getattr(out, "message", ""))
    raise RolloutError(f"SGLang {call} returned {out!r}; expected (success: bool, message: str) — "
                       "has the API changed? (docker/sglang_api/record.py records it)")


# ---- pure mapping functions (CPU-testable) -----------------------------------------------------


def stop_token_ids_sent(sampling: SamplingParams, eos_token_ids: Sequence[int]) -> tuple[int, ...]:
    """The ``stop_token_ids`` one request sends: the eos ids, then the contract's stop ids."""
    return tuple(dict.fromkeys([*(int(t) for t in eos_token_ids), *sampling.stop_token_ids]))


def sglang_sampling_params(sampling: SamplingParams, seed: int | None, with_seed: bool,
                           eos_token_ids: Sequence[int] = ()) -> dict:
    """Our sampling contract as an SGLang ``sampling_params`` dict for one candidate (n=1: we
    expand candidates ourselves so each gets its own seed, like the hf backend).

    ``with_seed``: the engine honours ``sampling_seed`` (deterministic inference is on)."""
    stop = stop_token_ids_sent(sampling, eos_token_ids)
    params = {
        "temperature": sampling.temperature,  # 0 -> greedy in SGLang (top_k=1)
        "top_p": sampling.top_p,
        "top_k": sampling.top_k,  # -1 = off, same convention as SGLang
        "max_new_tokens": sampling.max_new_tokens,
        "stop_token_ids": list(stop) or None,
        "n": 1,
        "ignore_eos": False,
        "skip_special_tokens": False,
        "no_stop_trim": True,  # the stop token stays in output_ids: the response boundary
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
    "abort", "matched": token id or str or None, ...}`` (``managers/schedule_batch.py``
    ``FINISH_*.to_json``).  A stop must be on an id that was sent
    (:func:`stop_token_ids_sent` of ``sampling`` and ``eos_token_ids``): an eos id is EOS, a
    stop id STOP.
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
        sent = stop_token_ids_sent(sampling, eos_token_ids)
        last = matched if isinstance(matched, int) else None
        if last is None or last not in sent:
            raise RolloutError(
                f"{request.request_id}: SGLang stopped on {matched!r}, which is not one of the stop ids "
                f"sent ({list(sent)}: eos {list(eos_token_ids)}, stop {list(sampling.stop_token_ids)})"
            )
        reason = FinishReason.EOS if last in set(eos_token_ids) else FinishReason.STOP
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
        attempt=request.attempt,
        latency_s=_latency(out.get("meta_info") or {}),
        cached_prompt_tokens=_meta_int(out.get("meta_info") or {}, "cached_tokens"),
        preemptions=_meta_int(out.get("meta_info") or {}, "num_retractions"),
    )


def _meta_int(meta: dict, key: str):
    """A count SGLang's meta_info reports where it does: ``cached_tokens`` (prompt tokens served
    from its radix cache), ``num_retractions`` (times the scheduler retracted the request when
    the KV pool ran out, to recompute it later: a preemption)."""
    v = meta.get(key)
    return int(v) if isinstance(v, int) and not isinstance(v, bool) else None


def _latency(meta: dict):
    """The request's end-to-end seconds where SGLang's meta_info reports them (``e2e_latency``)."""
    v = meta.get("e2e_latency")
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None


class MoELayout:
    """What the routing output of one model looks like: ``num_hidden_layers`` columns (SGLang's),
    of which ``moe_layers`` are MoE, ``top_k`` ids each among ``num_experts``."""

    def __init__(self, num_hidden_layers: int, num_experts: int, top_k: int, moe_layers: tuple[int, ...]):
        self.num_hidden_layers, self.num_experts, self.top_k = num_hidden_layers, num_experts, top_k
        self.moe_layers = tuple(moe_layers)

    def __repr__(self):
        return (f"MoELayout(layers={self.num_hidden_layers}, experts={self.num_experts}, top_k={self.top_k}, "
                f"moe_layers={self.moe_layers})")


def moe_layout_from_config(config: dict) -> MoELayout | None:
    """The MoE layout of an HF ``config.json`` (None for a dense model): Mixtral (every layer),
    Qwen2-MoE / Qwen3-MoE (``mlp_only_layers``, ``decoder_sparse_step``), DeepSeek-style
    (``first_k_dense_replace``, ``moe_layer_freq``)."""
    text = config.get("text_config") or config
    n_layers = int(text["num_hidden_layers"])
    experts = text.get("num_experts") or text.get("num_local_experts") or text.get("n_routed_experts")
    if not experts:
        return None
    top_k = int(text["num_experts_per_tok"])
    if "first_k_dense_replace" in text or "moe_layer_freq" in text:  # DeepSeek-style
        first, freq = int(text.get("first_k_dense_replace", 0)), int(text.get("moe_layer_freq", 1))
        layers = tuple(i for i in range(n_layers) if i >= first and i % freq == 0)
    elif "mlp_only_layers" not in text and "decoder_sparse_step" not in text:  # Mixtral: every layer
        layers = tuple(range(n_layers))
    else:  # Qwen2-MoE / Qwen3-MoE (transformers 5 writes their num_experts as num_local_experts)
        only = set(text.get("mlp_only_layers") or ())
        step = int(text.get("decoder_sparse_step", 1))
        layers = tuple(i for i in range(n_layers) if i not in only and (i + 1) % step == 0)
    return MoELayout(n_layers, int(experts), top_k, layers)


def routed_experts_from_sglang_output(meta: dict, rows: int, layout: MoELayout, where: str) -> SampleRouting:
    """``meta_info["routed_experts"]`` -> the sample's routing on its MoE layers.

    The value is base64 of int32 bytes (0.5.23) or the int32 tensor itself (0.5.7), laid out
    ``(rows, num_hidden_layers, top_k)`` with ``rows = prompt + output tokens - 1``.  Anything
    else (absent, another size, ids outside the experts) is an error naming the request.
    """
    import base64

    import numpy as np

    value = meta.get("routed_experts")
    if value is None:
        raise RolloutError(f"{where}: SGLang output has no meta_info['routed_experts'] (engine started without "
                           "enable_return_routed_experts, or a model SGLang does not capture?)")
    if isinstance(value, str):
        flat = torch.from_numpy(np.frombuffer(base64.b64decode(value), dtype=np.int32).copy())
    elif isinstance(value, torch.Tensor):
        flat = value.detach().to("cpu", torch.int32).reshape(-1)
    else:
        flat = torch.as_tensor(np.asarray(value, dtype=np.int32)).reshape(-1)
    want = rows * layout.num_hidden_layers * layout.top_k
    if flat.numel() != want:
        raise RolloutError(f"{where}: SGLang routed_experts has {flat.numel()} ids, expected {rows} tokens x "
                           f"{layout.num_hidden_layers} layers x top-{layout.top_k} = {want}")
    ids = flat.reshape(rows, layout.num_hidden_layers, layout.top_k)[:, list(layout.moe_layers)]
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= layout.num_experts):
        raise RolloutError(f"{where}: SGLang routed_experts ids outside [0, {layout.num_experts}) "
                           f"(physical ids of redundant experts?)")
    return SampleRouting(ids.to(compact_expert_dtype(layout.num_experts)), layout.num_experts, layout.moe_layers,
                         "sglang")


def _torch_dtype(dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in _DTYPES:
        raise ValueError(f"sglang backend: dtype must be one of {sorted(_DTYPES)} (or a torch.dtype), got {dtype!r}; "
                         "the weight stream is cast to it, so it cannot be 'auto'")
    return _DTYPES[dtype]


# ---- the engine ---------------------------------------------------------------------------------


def _refuse_unnamed_architecture(config: dict, where: str) -> None:
    """SGLang picks the model class from config.json's ``architectures``; without it 0.5.23 fails
    inside its model registry with a bare ``TypeError`` (megarl's exports always write it; a config
    saved from a bare transformers config object may not)."""
    archs = config.get("architectures")
    if not (isinstance(archs, list) and archs and all(isinstance(a, str) for a in archs)):
        raise RolloutError(f"sglang backend: {where} has architectures={archs!r}; SGLang picks its model class from "
                           "it: set it to the model's class, e.g. [\"LlamaForCausalLM\"] (megarl's HF exports write it)")


def _refuse_dropped_layers(config: dict, where: str) -> None:
    """Refuse a model SGLang would load only in part: its Qwen3-MoE treats every decoder layer as
    sparse (0.5.23 ``models/qwen3_moe.py``), so the dense MLP of a layer that
    :func:`moe_layout_from_config` finds dense (``mlp_only_layers``, ``decoder_sparse_step``) has
    nowhere to go and is skipped in silence."""
    layout = moe_layout_from_config(config)
    text = config.get("text_config") or config
    if text.get("model_type", config.get("model_type")) != "qwen3_moe" or layout is None:
        return
    if len(layout.moe_layers) < layout.num_hidden_layers:
        keys = " and ".join(f"{k}={text[k]}" for k in ("mlp_only_layers", "decoder_sparse_step") if k in text)
        raise RolloutError(f"sglang backend: {where} sets {keys}, leaving layers "
                           f"{sorted(set(range(layout.num_hidden_layers)) - set(layout.moe_layers))} dense, but "
                           "SGLang's Qwen3-MoE treats every layer as sparse and would drop their dense MLP weights in "
                           "silence; use the hf backend, or a model whose every layer is a mixture-of-experts layer")


def create_engine(model_dir, **kwargs) -> "SGLangRolloutEngine":
    """The backend's entry in :data:`megarl.rollout.BACKENDS`: a clear error for a missing sglang
    before any GPU or distributed set-up, then the engine."""
    import_sglang()
    return SGLangRolloutEngine(model_dir, **kwargs)


class SGLangRolloutEngine:
    """One SGLang engine per inference group; every rank of the group constructs this object and
    calls every method (SPMD), the group's first rank owns ``sglang.Engine``.

    Args:
        model_path: exported HF model dir (config.json; weights are replaced by the stream, the
            engine starts with ``load_format="dummy"`` so nothing is read from disk).
        tp_size: SGLang tensor parallel size == number of ranks in ``group``.
        group: torch.distributed process group of this inference group (None when tp_size == 1
            and no torch.distributed): its ranks are the GPUs base_gpu_id .. base_gpu_id+tp-1.
        eos_token_ids: the tokenizer contract's eos ids.  Together with the model dir's own eos
            ids (which SGLang stops on regardless) they are sent as stop ids and reported as
            FinishReason.EOS (:attr:`eos_token_ids`).
        dtype: the engine's dtype, and so the dtype the weight stream is cast to (:attr:`dtype`).
        deterministic_inference: start SGLang with ``enable_deterministic_inference`` so that
            per-candidate seeds are honoured (slower decoding; see docs/gpu.md).
        device: where incoming tensors are staged for the hand-over (default: the current CUDA
            device; the CPU contract test uses ``"cpu"`` with a fake engine).
        engine_kwargs: extra ``ServerArgs`` (e.g. ``attention_backend``, ``enable_memory_saver``).
    """

    log_prob_spaces = frozenset({"raw"})

    def __init__(
        self,
        model_path: str | os.PathLike,
        *,
        tp_size: int = 1,
        group=None,
        eos_token_ids: Sequence[int] = (),
        dtype: str | torch.dtype = "bfloat16",
        mem_fraction_static: float = 0.5,
        seed: int = 0,
        deterministic_inference: bool = False,
        device: str | torch.device | None = None,
        engine_kwargs: dict | None = None,
        return_routed_experts: bool = False,
        verify_writes: str = "first",
    ):
        sglang = import_sglang()
        if verify_writes not in VERIFY_WRITES:
            raise ValueError(f"sglang backend: verify_writes={verify_writes!r}; choose from {', '.join(VERIFY_WRITES)}")
        self.verify_writes = verify_writes
        self._loads_verified = 0
        import torch.distributed as dist

        self.group = group
        self.tp_size = tp_size
        self.rank_in_group = dist.get_rank(group) if group is not None else 0
        group_size = dist.get_world_size(group) if group is not None else 1
        if group_size != tp_size:
            raise ValueError(f"sglang backend: inference group has {group_size} ranks but tp_size={tp_size}")
        self.src_global_rank = dist.get_global_rank(group, 0) if group is not None else 0
        self.device = torch.device(device) if device is not None else torch.device("cuda", torch.cuda.current_device())
        self.dtype = _torch_dtype(dtype)
        self.contract_eos_token_ids = tuple(int(t) for t in eos_token_ids)
        self.model_eos_token_ids = model_dir_eos_token_ids(model_path)
        self.eos_token_ids = tuple(dict.fromkeys(self.contract_eos_token_ids + self.model_eos_token_ids))
        for var in LOG_PROB_ENV_VARS:  # raw log-probs; must precede the schedulers' spawn
            os.environ[var] = "1"
        kwargs = dict(
            model_path=os.fspath(model_path),
            tp_size=tp_size,
            base_gpu_id=self.device.index or 0,
            enable_memory_saver=True,
            skip_tokenizer_init=True,
            load_format="dummy",
            dtype=str(self.dtype).removeprefix("torch."),
            mem_fraction_static=mem_fraction_static,
            random_seed=seed,
            log_level="error",
        )
        if deterministic_inference:
            kwargs["enable_deterministic_inference"] = True
        kwargs.update(engine_kwargs or {})
        self.moe_layout: MoELayout | None = None
        config_path = os.path.join(os.fspath(model_path), "config.json")
        with open(config_path, encoding="utf-8") as f:
            model_config = json.load(f)
        _refuse_unnamed_architecture(model_config, config_path)
        _refuse_dropped_layers(model_config, config_path)
        if return_routed_experts:
            if not _generate_accepts("return_routed_experts"):
                raise RolloutError(f"sglang backend: return_routed_experts needs SGLang >= 0.5.7 (Engine.generate "
                                   f"takes return_routed_experts); installed: {getattr(sglang, '__version__', '?')}")
            self.moe_layout = moe_layout_from_config(model_config)
            if self.moe_layout is None:
                raise RolloutError(f"sglang backend: return_routed_experts, but {model_path} is a dense model")
            if kwargs.get("ep_num_redundant_experts") and not _captures_logical_ids():
                raise RolloutError("sglang backend: this SGLang release records physical expert ids; with "
                                   "ep_num_redundant_experts they are not the model's experts")
            kwargs["enable_return_routed_experts"] = True
        self.deterministic = bool(kwargs.get("enable_deterministic_inference")) or kwargs.get("rl_on_policy_target") is not None
        self._engine, error, status = None, None, (True, "", False)
        if self.rank_in_group == 0:
            saved = {k: os.environ.get(k) for k in TRAINER_ENV_VARS}
            try:
                self._engine = sglang.Engine(**kwargs)
                # the weight-update session API (0.5.21+): every rank must take the same branches
                status = (True, "", all(hasattr(self._engine, m) for m in ("begin_weight_update", "end_weight_update")),
                          self._weight_checker_problem() if verify_writes != "never" else None)
            except Exception as e:  # noqa: BLE001 - re-raised below, after the other ranks know
                error, status = e, (False, f"{type(e).__name__}: {e}", False, None)
            finally:
                _restore_env(saved)
        ok, message, self._has_session, checker_problem = self._broadcast(status)
        if error is not None:
            raise error
        if not ok:
            raise RolloutError(f"SGLang Engine() failed on the inference group's first rank: {message}")
        self._has_weight_checker = verify_writes != "never" and checker_problem is None
        if verify_writes != "never" and checker_problem is not None:
            raise RolloutError(f"sglang backend: verify_writes={verify_writes!r} needs SGLang's weight checker with "
                               "per-parameter checksums (Engine.tokenizer_manager.check_weights(CheckWeightsReqInput("
                               f"action='checksum')), SGLang 0.5.23); installed: {getattr(sglang, '__version__', '?')}: "
                               f"{checker_problem}. Set rollout.verify_engine_weights=never to load without proving "
                               "every parameter was written")
        self._with_seed = self.deterministic and _supports_sampling_seed()
        self._versions = VersionLifecycle()
        self._staged_manifest: TensorManifest | None = None
        self._released: tuple[str, ...] = ()  # memory-saver tags released by sleep(), resumed by wake()
        self.last_load_error: str | None = None  # why the last load failed (None: it did not)
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

    def _synchronize(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    # ---- versions ----

    @property
    def active_version(self) -> PolicyVersion | None:
        return self._versions.active

    @property
    def asleep(self) -> bool:
        return bool(self._released)

    def staging_target(self, name: str) -> torch.Tensor | None:
        """Always None: tensors are handed to SGLang's own loader (flattened per-dtype buckets
        over CUDA IPC), never built in the engine's parameters by the producer."""
        return None

    def _leader_call(self, what: str, fn, error: type[RolloutError] = WeightUpdateRejectedError) -> None:
        """Run ``fn() -> (ok, message)`` on the group's first rank; every rank raises ``error`` if
        it failed (one broadcast: also the sync point, so no rank is left waiting)."""
        status = (True, "")
        if self.rank_in_group == 0:
            try:
                status = fn()
            except Exception as e:  # noqa: BLE001 - an engine exception must not strand the other ranks
                status = (False, f"{type(e).__name__}: {e}")
        ok, message = self._broadcast(status)
        if not ok:
            raise error(f"SGLang {what} failed: {message}")

    def load_weights(
        self,
        version: PolicyVersion,
        named_tensor_buckets: Iterable[Sequence[tuple[str, torch.Tensor]]],
        expected_manifest: TensorManifest,
    ) -> LoadReport:
        rx = ManifestReceiver(version, expected_manifest)
        if self.asleep:
            raise EngineAsleepError(f"load_weights({version.short_id}): engine is asleep; wake() first")
        self._versions.refuse_second_load(version)
        if self.device.type == "cuda":  # it rewrites CUDA IPC handles' device index; a CPU tensor has none
            _monkey_patch_torch_reductions()
        serializer = _serializer()
        bucket_cls = get_flattened_tensor_bucket_class()  # SGLang's own, never megarl's (weight_stream)
        self._versions.begin_load(version)
        self._staged_manifest = None
        verify = self.verify_writes == "every" or (self.verify_writes == "first" and not self._loads_verified)
        written_before: dict[str, str] | None = None  # group rank 0: checksums of the reset parameters
        rx.start()
        session = False  # a weight-update session is open on the engine (group rank 0)
        try:
            for bucket in rx.buckets(named_tensor_buckets):
                self._check_bucket(rx, bucket)  # verify before handing anything to the engine
                on_device = [(n, t.to(self.device, non_blocking=True)) for n, t in bucket]
                flat = flatten_bucket_by_dtype(on_device, bucket_cls=bucket_cls)
                payloads = [
                    serializer.serialize(
                        {"flattened_tensor": b.get_flattened_tensor(), "metadata": b.get_metadata()},
                        output_str=True,
                    )
                    for b in flat.values()
                ]
                gathered = self._gather_payloads(payloads)
                self._versions.loaded_in_place()  # from here v is no longer what the engine holds
                if verify and rx.n_buckets == 1:  # every parameter to random values, and their checksums
                    def reset():
                        nonlocal written_before
                        self._check_weights("reset_tensors")
                        written_before = self._check_weights("checksum")
                        return True, ""

                    self._leader_call("check_weights(reset_tensors, checksum)", reset, RolloutError)
                if not session and self._has_session:
                    session = True  # end_weight_update is owed even if begin fails half-way
                    self._leader_call("begin_weight_update()", lambda: _success(
                        self._engine.begin_weight_update(), "begin_weight_update"))
                # every rank keeps its flattened tensors alive until this returned (slime)
                self._leader_call(f"update_weights_from_tensor (bucket {rx.n_buckets})",
                                  lambda g=gathered: self._hand_over(g))
                del flat, payloads, on_device, gathered
                if self.device.type == "cuda":
                    torch.cuda.ipc_collect()
            if session:
                session = False
                self._leader_call("end_weight_update()", lambda: _success(
                    self._engine.end_weight_update(), "end_weight_update"))
            diff = rx.compare()
            if not diff.ok:
                raise ManifestMismatchError(f"{version.short_id}: stream incomplete: {diff.describe()}", diff)
            if verify and rx.n_buckets:
                self._leader_call("check_weights(checksum) after the update",
                                  lambda: self._unwritten(written_before, version), WeightsNotWrittenError)
                self._loads_verified += 1
            self.flush_cache()
            self._versions.stage(version)
            self._staged_manifest = rx.received
            self.last_load_error = None
        except BaseException as e:
            self.last_load_error = f"{version.short_id}: {type(e).__name__}: {e}"
            if session and self.rank_in_group == 0:  # close it, or the next begin is refused
                try:
                    self._engine.end_weight_update()
                except Exception:  # noqa: BLE001 - the original error is the one to report
                    pass
            raise
        finally:  # on failure before any hand-over v is still active; after it, none is (reload)
            self._versions.end_load()
        return rx.report()

    def _check_bucket(self, rx: ManifestReceiver, bucket) -> None:
        """Every rank of the group checks its copy of one bucket against the expected manifest;
        all raise if any rank found a bad tensor (one all-reduce), so none hands it over."""
        error = None
        try:
            for name, tensor in bucket:
                rx.checked(name, tensor)
        except ManifestMismatchError as e:
            error = e
        if not self._all_ok(error is None):
            raise error or ManifestMismatchError(
                f"{rx.version.short_id}: another rank of the inference group rejected bucket {rx.n_buckets}"
            )

    def _gather_payloads(self, payloads: list) -> list | None:
        """Every TP rank's serialized payloads at the group's first rank (None elsewhere), once
        the tensors they point to are complete."""
        self._synchronize()
        gathered = [None] * self.tp_size if self.rank_in_group == 0 else None
        if self.group is not None:
            import torch.distributed as dist

            dist.gather_object(payloads, gathered, dst=self.src_global_rank, group=self.group)
        else:
            gathered = [payloads]
        return gathered

    def _hand_over(self, gathered) -> tuple[bool, str]:
        """Group rank 0: every dtype bucket of one stream bucket into the engine, checking each
        call's ``success``."""
        counts = {len(p) for p in gathered}
        if len(counts) != 1:
            return False, f"TP ranks sent different numbers of dtype buckets: {counts}"
        for i in range(counts.pop()):
            ok, message = _success(self._engine.update_weights_from_tensor(
                named_tensors=[per_rank[i] for per_rank in gathered],
                load_format="flattened_bucket",
                flush_cache=False,
            ), "update_weights_from_tensor")
            if not ok:
                return False, message
        return True, ""

    def _weight_checker_problem(self) -> str | None:
        """Group rank 0, at start: None when the engine's weight checker returns every
        parameter's checksum (asked once here), else why not -- 0.5.3 has no checker, 0.5.7's
        answers ``CheckWeightsReqOutput`` and has no ``checksum`` action."""
        if weight_checker_request() is None or not hasattr(getattr(self._engine, "tokenizer_manager", None),
                                                           "check_weights"):
            return "it has no weight checker"
        try:
            sums = self._check_weights("checksum")
        except RolloutError as e:
            return str(e)
        return None if sums else "its weight checker returned no parameter checksums"

    def _check_weights(self, action: str) -> dict[str, str]:
        """Group rank 0: SGLang's weight checker; ``checksum`` returns every parameter's checksum
        by engine name (suffixed with the TP rank when there are several)."""
        request = weight_checker_request()
        out = self._engine.loop.run_until_complete(
            self._engine.tokenizer_manager.check_weights(request(action=action), None))
        if not (isinstance(out, tuple) and len(out) == 4):
            raise RolloutError(f"SGLang check_weights(action={action!r}) answered {type(out).__name__} "
                               f"({str(out)[:200]}), not (success, message, ranks, per_engine_checksum)")
        ok, message, ranks, _ = out
        if not ok:
            raise RolloutError(f"SGLang check_weights(action={action!r}) failed: {message}")
        sums = {}
        for rank in ranks or ():
            info = rank["parallelism_info"]
            info = info[0] if isinstance(info, list) else info  # 0.5.23: one entry per runner role (the target)
            for name, digest in rank["checksums"].items():
                sums[name if info["tp_size"] == 1 else f"{name} (tp rank {info['tp_rank']})"] = digest
        return sums

    def _unwritten(self, before: dict[str, str] | None, version: PolicyVersion) -> tuple[bool, str]:
        """Group rank 0, after an update: (ok, message naming every parameter it left as reset)."""
        if not before:
            return False, "the weight checker returned no parameter checksums before the update"
        after = self._check_weights("checksum")
        same = sorted(n for n, digest in before.items() if after.get(n) == digest)
        if same:
            return False, (f"{version.short_id}: the update reported success but left {len(same)} of {len(before)} engine "
                           f"parameters unwritten (the model's loader skipped names it has no parameter for): "
                           f"{', '.join(same[:12])}{' ...' if len(same) > 12 else ''}")
        return True, ""

    def activate(self, version: PolicyVersion) -> ActivationReport:
        self._versions.require_staged(version)
        self.flush_cache()
        self._versions.activate(version)
        return ActivationReport(version.short_id, self._staged_manifest.global_hash, True, True)

    def flush_cache(self) -> None:
        status = (True, "")
        if self.rank_in_group == 0:
            out = self._engine.flush_cache()
            if getattr(out, "success", True) is False:
                status = (False, f"SGLang flush_cache failed: {out}")
        ok, message = self._broadcast(status)
        if not ok:
            raise RolloutError(message)

    # ---- memory ----

    def sleep(self, release_weights: bool = True) -> None:
        """Release KV cache (and weights) for the actor's turn.  Released weights are gone: the
        active version is cleared and the next version must be loaded after wake().  Calling it
        again while asleep releases only what is not released yet."""
        if self._versions.loading is not None:
            raise RolloutBusyError("sleep(): engine is loading")
        wanted = (KV_CACHE, WEIGHTS) if release_weights else (KV_CACHE,)
        tags = tuple(t for t in wanted if t not in self._released)
        if tags:
            self._leader_call(f"release_memory_occupation(tags={list(tags)})", lambda: (
                self._engine.release_memory_occupation(tags=list(tags)), (True, ""))[1], RolloutError)
        self._released += tags
        if WEIGHTS in self._released:
            self._versions.release()

    def wake(self) -> None:
        """Resume exactly the tags sleep() released (resuming others kills SGLang's scheduler, and
        with it this process); a no-op when awake."""
        tags = list(self._released)
        if tags:
            self._leader_call(f"resume_memory_occupation(tags={tags})", lambda: (
                self._engine.resume_memory_occupation(tags=tags), (True, ""))[1], RolloutError)
        self._released = ()

    def close(self) -> None:
        """Nothing to stop here: SGLang's schedulers end with this process.  (:meth:`shutdown`
        stops them now, but SGLang's ``Engine.shutdown`` kills every child process of its caller,
        reward workers included, so the trainer does not call it.)"""

    def shutdown(self) -> None:
        if self._engine is not None:
            self._engine.shutdown()
            self._engine = None

    # ---- generation ----

    def generate(
        self, requests: Sequence[GenerationRequest], sampling: SamplingParams
    ) -> list[GenerationResult]:
        """All ranks of the group call with the same requests; rank 0 runs, results are broadcast."""
        self._versions.refuse_while_loading("generate")
        if self.asleep:
            raise EngineAsleepError("generate refused: engine is asleep; wake() first")
        why = f"; last load failed: {self.last_load_error}" if self.last_load_error else ""
        self._versions.require_active("generate", f" (none loaded, or released{why})")
        ids = [r.request_id for r in requests]
        if len(set(ids)) != len(ids):
            raise InvalidRequestError(f"duplicate request_id in one generate call: {sorted(ids)}")
        if sampling.return_routed_experts and self.moe_layout is None:
            raise InvalidRequestError("return_routed_experts: the engine was not started with "
                                      "return_routed_experts=True (SGLang's enable_return_routed_experts)")
        version_id = self._versions.active.short_id
        rows = [(r, c) for r in requests for c in r.candidates(sampling.n)]
        seeds = [candidate_seed(sampling.seed, r.request_id, c) for r, c in rows]
        results, failure, error = None, None, None
        if self.rank_in_group == 0 and rows:
            try:
                extra = {"return_routed_experts": True} if sampling.return_routed_experts else {}
                outs = self._engine.generate(
                    input_ids=[list(r.prompt_ids) for r, _ in rows],
                    sampling_params=[sglang_sampling_params(sampling, s, self._with_seed, self.eos_token_ids)
                                     for s in seeds],
                    return_logprob=True,
                    **extra,
                )
                honoured = self._with_seed and not sampling.greedy
                results = [
                    result_from_sglang_output(o, r, c, sampling, self.eos_token_ids, version_id, s if honoured else None)
                    for o, (r, c), s in zip(outs, rows, seeds, strict=True)
                ]
                if sampling.return_routed_experts:
                    results = [dataclasses.replace(res, routed_experts=routed_experts_from_sglang_output(
                        o["meta_info"], len(res.prompt_ids) + len(res.response_ids) - 1, self.moe_layout,
                        f"{res.request_id}/{res.candidate_index}"))
                        if res.finish_reason is not FinishReason.ABORT else res
                        for o, res in zip(outs, results, strict=True)]
            except Exception as e:  # noqa: BLE001 - re-raised below, after the other ranks know
                error, failure = e, f"{type(e).__name__}: {e}"
        results, failure = self._broadcast((results, failure))
        if error is not None:
            raise error
        if failure is not None:
            raise RolloutError(f"generate failed on the inference group's first rank: {failure}")
        return results or []


def _restore_env(saved: dict) -> None:
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value
