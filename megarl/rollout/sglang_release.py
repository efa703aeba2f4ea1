"""What megarl relies on in each SGLang release, in one place: imports, API probes, answers.

Everything here names the release it was read from (docs/gpu.md, "SGLang calls, release by
release"); ``docker/sglang_api/sglang-<v>.json`` records the surface per release and
``tests/unit/rollout/test_sglang_api_contract.py`` drives the backend against a fake built from those records.
The engine (:mod:`megarl.rollout.sglang_backend`) asks these functions, never SGLang's modules
directly, what the installed release can do.
"""

from __future__ import annotations

import os

import torch

from megarl.rollout.protocol import RolloutError
from megarl.rollout.sglang_outputs import moe_layout_from_config

LOG_PROB_ENV_VARS = ("SGLANG_RETURN_ORIGINAL_LOGPROB", "RETURN_ORIGINAL_LOGPROB")
#: variables ``Engine()`` overwrites in the calling (trainer) process; restored after it started
TRAINER_ENV_VARS = ("CUDA_DEVICE_MAX_CONNECTIONS", "NCCL_CUMEM_ENABLE", "NCCL_NVLS_ENABLE",
                    "NCCL_GRAPH_MIXING_SUPPORT")
#: memory-saver tags (``constants.py`` GPU_MEMORY_TYPE_KV_CACHE / GPU_MEMORY_TYPE_WEIGHTS)
KV_CACHE, WEIGHTS = "kv_cache", "weights"


class BackendUnavailableError(RolloutError, ImportError):
    """A rollout backend's package is not installed."""


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


def sglang_serializer():
    from sglang.srt.utils import MultiprocessingSerializer

    return MultiprocessingSerializer


def patch_torch_reductions():
    # location moved between releases (slime backends/megatron_utils/sglang.py)
    try:
        from sglang.srt.utils.patch_torch import monkey_patch_torch_reductions
    except ImportError:
        from sglang.srt.patch_torch import monkey_patch_torch_reductions
    monkey_patch_torch_reductions()


def supports_sampling_seed() -> bool:
    try:
        from sglang.srt.sampling.sampling_params import SamplingParams as SglSP
    except ImportError:
        return False
    fields = getattr(SglSP, "__struct_fields__", None)  # msgspec.Struct (recent releases)
    if fields is None:
        import inspect

        fields = tuple(inspect.signature(SglSP.__init__).parameters)
    return "sampling_seed" in fields


def generate_accepts(option: str) -> bool:
    """The installed release's ``Engine.generate`` takes ``option`` (``return_routed_experts``: 0.5.7+)."""
    import inspect

    from sglang.srt.entrypoints.engine import Engine

    return option in inspect.signature(Engine.generate).parameters


def captures_logical_ids() -> bool:
    """Whether routed-expert ids are captured before the logical -> physical map (0.5.23:
    ``sglang.srt.state_capturer``; 0.5.7 captures after it, in ``layers/moe/topk.py``)."""
    import importlib

    try:
        importlib.import_module("sglang.srt.state_capturer.routed_experts")
    except ImportError:
        return False
    return True


def call_success(out, call: str) -> tuple[bool, str]:
    """``(success, message)`` of a weight-update call; any other shape is an API change."""
    if isinstance(out, (tuple, list)) and len(out) == 2 and isinstance(out[0], bool):
        return out[0], str(out[1])
    if hasattr(out, "success"):  # a *ReqOutput struct
        return bool(out.success), str(getattr(out, "message", ""))
    raise RolloutError(f"SGLang {call} returned {out!r}; expected (success: bool, message: str) — "
                       "has the API changed? (docker/sglang_api/record.py records it)")


def weight_checker_request():
    """SGLang's ``CheckWeightsReqInput`` (None for a release without the weight checker)."""
    try:
        from sglang.srt.managers.io_struct import CheckWeightsReqInput
    except ImportError:
        return None
    return CheckWeightsReqInput



def refuse_unnamed_architecture(config: dict, where: str) -> None:
    """SGLang picks the model class from config.json's ``architectures``; without it 0.5.23 fails
    inside its model registry with a bare ``TypeError`` (megarl's exports always write it; a config
    saved from a bare transformers config object may not)."""
    archs = config.get("architectures")
    if not (isinstance(archs, list) and archs and all(isinstance(a, str) for a in archs)):
        raise RolloutError(f"sglang backend: {where} has architectures={archs!r}; SGLang picks its model class from "
                           "it: set it to the model's class, e.g. [\"LlamaForCausalLM\"] (megarl's HF exports write it)")


def refuse_dropped_layers(config: dict, where: str) -> None:
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



def restore_env(saved: dict) -> None:
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


def adapter_sha256(t: torch.Tensor) -> str:
    """A tensor's checksum as SGLang's LoRA loader computes it on each TP worker
    (``tp_worker.load_lora_adapter_from_tensors``, ``expected_checksums``): sha256 of its bytes."""
    import hashlib

    return hashlib.sha256(t.detach().cpu().contiguous().flatten().view(torch.uint8).numpy().tobytes()).hexdigest()


def load_adapter_request(name: str, tensors, config: dict, tp_size: int, checksums: dict):
    """SGLang's ``LoadLoRAAdapterFromTensorsReqInput`` as ``Engine.load_lora_adapter_from_tensors``
    builds it (one serialised copy per TP rank), with ``expected_checksums``, which that method
    does not pass on: every TP worker checks each tensor it deserialised."""
    import dataclasses as dc

    try:
        from sglang.srt.managers.io_struct import LoadLoRAAdapterFromTensorsReqInput
    except ImportError as e:
        raise RolloutError(f"actor.lora.engine=adapter needs SGLang's LoadLoRAAdapterFromTensorsReqInput (SGLang "
                           f"0.5.23); installed: {_installed_version()}: {e}") from e
    fields = {f.name for f in dc.fields(LoadLoRAAdapterFromTensorsReqInput)} if dc.is_dataclass(
        LoadLoRAAdapterFromTensorsReqInput) else set(getattr(LoadLoRAAdapterFromTensorsReqInput, "__annotations__", {}))
    if "expected_checksums" not in fields:
        raise RolloutError("actor.lora.engine=adapter: this SGLang's LoadLoRAAdapterFromTensorsReqInput has no "
                           f"expected_checksums (installed: {_installed_version()}); the adapter could not be verified")
    payload = sglang_serializer().serialize(dict(tensors))
    return LoadLoRAAdapterFromTensorsReqInput(lora_name=name, config_dict=config,
                                              serialized_named_tensors=[payload] * tp_size,
                                              expected_checksums=checksums)


def _installed_version() -> str:
    try:
        from importlib.metadata import version

        return version("sglang")
    except Exception:  # noqa: BLE001 - only for the message
        return "?"
