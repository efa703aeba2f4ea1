"""Rollout: one engine protocol, the hf and sglang backends, and the weight stream.

``create_rollout_engine("hf" | "sglang", ...)`` picks a backend by name; sglang is imported only
when asked for.
"""

from __future__ import annotations

from megarl.rollout.protocol import (
    ActivationReport,
    FinishReason,
    GenerationRequest,
    GenerationResult,
    LoadReport,
    RolloutEngine,
    SamplingParams,
)

__all__ = [
    "ActivationReport",
    "FinishReason",
    "GenerationRequest",
    "GenerationResult",
    "LoadReport",
    "RolloutEngine",
    "SamplingParams",
    "ROLLOUT_BACKENDS",
    "create_rollout_engine",
]

ROLLOUT_BACKENDS = ("hf", "sglang")


def create_rollout_engine(backend: str, model_dir, **kwargs) -> RolloutEngine:
    """Build the named backend on an exported HF model dir (config.json)."""
    if backend == "hf":
        from megarl.rollout.hf_backend import HFRolloutEngine

        return HFRolloutEngine(model_dir, **kwargs)
    if backend == "sglang":
        from megarl.rollout.sglang_backend import SGLangRolloutEngine, import_sglang

        import_sglang()  # clear error before any GPU/distributed setup
        return SGLangRolloutEngine(model_dir, **kwargs)
    raise ValueError(f"unknown rollout backend {backend!r}; choose one of {ROLLOUT_BACKENDS}")
