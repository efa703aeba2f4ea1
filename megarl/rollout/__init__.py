"""Rollout: one engine protocol, the hf and sglang backends, and the weight stream.

``create_rollout_engine("hf" | "sglang", ...)`` picks a backend by name from :data:`BACKENDS`;
sglang is imported only when asked for.
"""

from __future__ import annotations

from megarl.dotted import Registry
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
    "BACKENDS",
    "ROLLOUT_BACKENDS",
    "create_rollout_engine",
]

#: the rollout backends by name, imported when chosen (sglang only when asked for)
BACKENDS = Registry("rollout backend")
BACKENDS.add("hf", "megarl.rollout.hf_backend:HFRolloutEngine")
BACKENDS.add("sglang", "megarl.rollout.sglang_backend:create_engine")
ROLLOUT_BACKENDS = tuple(BACKENDS.names())


def create_rollout_engine(backend: str, model_dir, **kwargs) -> RolloutEngine:
    """Build the named backend on an exported HF model dir (config.json)."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown rollout backend {backend!r}; choose one of {ROLLOUT_BACKENDS}")
    return BACKENDS.get(backend)(model_dir, **kwargs)
