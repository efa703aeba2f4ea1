"""The one rollout protocol every backend (hf, sglang) implements.

Requests carry token ids, never strings: prompts are templated and tokenized once by the
tokenizer contract (megarl.data.tokenizer) and the ids travel from then on, so the rollout
and the actor cannot disagree on action positions.  Results carry the version that produced
them and the log-prob of every sampled token in two named spaces:

* ``raw_log_probs``       log softmax(logits)[token]: the policy pi_theta itself; what PPO
                          ratios and actor teacher-forced log-probs are compared against;
* ``processed_log_probs`` log of the distribution actually sampled from, after temperature,
                          top-k and top-p; None when it equals the raw one (T=1, no filtering)
                          or the backend cannot observe it (say so in its ``log_prob_spaces``).

A generic ``log_probs`` field is deliberately absent: the probability space that
``old_log_probs`` live in must be defined first, so every log-prob field names its space.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import torch

from megarl.rollout.weight_stream import TensorManifest
from megarl.versions import PolicyVersion

__all__ = [
    "FinishReason",
    "SamplingConfig",
    "SamplingParams",
    "GenerationRequest",
    "GenerationResult",
    "LoadReport",
    "ActivationReport",
    "RolloutEngine",
    "SubmittingEngine",
    "EngineWrapper",
    "RolloutError",
    "RolloutBusyError",
    "NoActiveVersionError",
    "VersionNotStagedError",
    "EngineAsleepError",
    "InvalidRequestError",
]

# FinishReason is the experience schema's (one enum for rollout and experience; the backends
# here never emit TOOL).  SamplingParams is the engine-side view of the schema's SamplingConfig
# plus what an engine needs and a sealed batch does not: the seed and greedy decoding (T=0, for
# evaluation and tests); convert with from_config()/to_config().
from megarl.experience.schema import FinishReason, SampleRouting, SamplingConfig  # noqa: E402


class RolloutError(RuntimeError):
    """Base of rollout engine errors."""


class RolloutBusyError(RolloutError):
    """generate() while weights are being loaded: never served by a half-loaded model."""


class NoActiveVersionError(RolloutError):
    """generate() before any version was activated (the engine's initial weights are random)."""


class VersionNotStagedError(RolloutError):
    """activate(v) for a version that was not loaded and verified."""


class EngineAsleepError(RolloutError):
    """The engine released its memory; wake() it first."""


class InvalidRequestError(RolloutError, ValueError):
    """A request or sampling contract that cannot be served as asked."""


@dataclass(frozen=True)
class SamplingParams:
    """The sampling contract of one rollout.

    temperature 0 means greedy.  top_k -1 / top_p 1.0 disable the filters (the schema's
    SamplingConfig conventions).  ``n`` candidates are
    generated per request, candidate i seeded from (seed, request_id, i) so a result does not
    depend on what else was in the batch.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_new_tokens: int = 128
    stop_token_ids: tuple[int, ...] = ()
    n: int = 1
    seed: int = 0
    #: MoE: return each sample's routing (``GenerationResult.routed_experts``); an engine that
    #: cannot (a dense model, a backend release without it) refuses with InvalidRequestError
    return_routed_experts: bool = False

    def __post_init__(self):
        if not (self.temperature >= 0.0):
            raise InvalidRequestError(f"SamplingParams.temperature must be >= 0, got {self.temperature}")
        if not (0.0 < self.top_p <= 1.0):
            raise InvalidRequestError(f"SamplingParams.top_p must be in (0, 1], got {self.top_p}")
        if self.top_k == 0 or self.top_k < -1:
            raise InvalidRequestError(f"SamplingParams.top_k must be -1 (off) or >= 1, got {self.top_k}")
        if self.max_new_tokens < 1:
            raise InvalidRequestError(
                f"SamplingParams.max_new_tokens must be >= 1, got {self.max_new_tokens}"
            )
        if self.n < 1:
            raise InvalidRequestError(f"SamplingParams.n must be >= 1, got {self.n}")
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))

    @classmethod
    def from_config(cls, config: SamplingConfig, seed: int) -> "SamplingParams":
        return cls(temperature=config.temperature, top_p=config.top_p, top_k=config.top_k,
                   max_new_tokens=config.max_new_tokens, stop_token_ids=config.stop_token_ids,
                   n=config.n, seed=seed)

    def to_config(self) -> SamplingConfig:
        """The schema record of this contract (greedy has none: SamplingConfig needs T > 0)."""
        if self.greedy:
            raise InvalidRequestError("greedy decoding (temperature 0) has no SamplingConfig record")
        return SamplingConfig(temperature=self.temperature, top_p=self.top_p, top_k=self.top_k,
                              max_new_tokens=self.max_new_tokens, n=self.n, stop_token_ids=self.stop_token_ids)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def transforms_distribution(self) -> bool:
        """True when the sampled distribution differs from softmax(logits)."""
        return not self.greedy and (self.temperature != 1.0 or self.top_k >= 1 or self.top_p < 1.0)


@dataclass(frozen=True)
class GenerationRequest:
    """One prompt to sample ``SamplingParams.n`` candidates for.

    ``candidate_indices`` regenerates only some candidates of the request (a retry after a
    rollout failure): candidate i keeps its seed ``candidate_seed(seed, request_id, i)``, so a
    retry draws from the same per-candidate stream as the lost attempt.  ``attempt`` is echoed
    in every result so that a late result of an older attempt can be told from the retry's.
    ``task``: the row an agent session's environment starts on (``Environment.reset``); a plain
    engine never reads it.
    """

    request_id: str
    prompt_ids: tuple[int, ...]
    candidate_indices: tuple[int, ...] | None = None  # None: 0 .. n-1
    attempt: int = 0
    task: Mapping[str, Any] | None = field(default=None, compare=False)

    def __post_init__(self):
        if not self.request_id:
            raise InvalidRequestError("GenerationRequest.request_id must be non-empty")
        if isinstance(self.prompt_ids, str):
            raise InvalidRequestError(
                f"request {self.request_id}: prompt_ids must be token ids, got a string; "
                "encode prompts once with megarl.data.tokenizer.TokenizerContract.encode_prompt"
            )
        ids = tuple(int(t) for t in self.prompt_ids)
        if not ids:
            raise InvalidRequestError(f"request {self.request_id}: prompt_ids is empty")
        object.__setattr__(self, "prompt_ids", ids)
        if self.candidate_indices is not None:
            idx = tuple(int(c) for c in self.candidate_indices)
            if not idx or len(set(idx)) != len(idx) or min(idx) < 0:
                raise InvalidRequestError(
                    f"request {self.request_id}: candidate_indices must be distinct, non-negative and "
                    f"non-empty, got {self.candidate_indices}")
            object.__setattr__(self, "candidate_indices", idx)
        if self.attempt < 0:
            raise InvalidRequestError(f"request {self.request_id}: attempt must be >= 0, got {self.attempt}")

    def candidates(self, n: int) -> tuple[int, ...]:
        """The candidate indices to generate under a contract of ``n`` per request."""
        if self.candidate_indices is None:
            return tuple(range(n))
        if max(self.candidate_indices) >= n:
            raise InvalidRequestError(
                f"request {self.request_id}: candidate_indices {self.candidate_indices} outside "
                f"[0, {n}) of the sampling contract's n")
        return self.candidate_indices


@dataclass(frozen=True)
class GenerationResult:
    """One candidate of one request.  Joined downstream by (request_id, candidate_index)."""

    request_id: str
    candidate_index: int
    prompt_ids: tuple[int, ...]  # as actually fed to the model
    response_ids: tuple[int, ...]  # includes the eos/stop token when finish_reason is eos/stop
    finish_reason: FinishReason
    raw_log_probs: torch.Tensor  # (len(response_ids),) float32
    processed_log_probs: torch.Tensor | None  # (len(response_ids),) float32 or None
    policy_version: str  # PolicyVersion.short_id of the weights that generated it
    seed: int | None = None  # the per-candidate seed actually used
    attempt: int = 0  # the request's attempt this result answers
    #: MoE, when ``SamplingParams.return_routed_experts``: the top-k experts of every prompt token
    #: (from the prefill) and every response token but the last, ``(len(prompt_ids) +
    #: len(response_ids) - 1, layers, top_k)``
    routed_experts: SampleRouting | None = None
    #: an agent session's whole episode (``megarl.rollout.agent.Trajectory``): then
    #: ``response_ids`` is every token after the prompt, policy and environment ones interleaved,
    #: ``raw_log_probs`` 0.0 on the environment's, and ``policy_version`` its last policy token's
    episode: Any = field(default=None, compare=False)
    #: a response generated across versions (``megarl.rollout.segmented``: an in-flight weight
    #: update between two segments): the version of every response token, oldest first; then
    #: ``policy_version`` is the last token's.  None: every token is ``policy_version``'s
    token_versions: tuple[str, ...] | None = None
    #: seconds from the generate call's start until this candidate was complete, where the backend
    #: knows it (hf: the call's end, or the step its row retired; sglang: the request's e2e latency)
    latency_s: float | None = field(default=None, compare=False)
    #: prompt tokens the engine served from its prefix cache (SGLang's ``cached_tokens``; None:
    #: not reported)
    cached_prompt_tokens: int | None = field(default=None, compare=False)
    #: times the engine preempted this request (SGLang retracts running requests when its KV
    #: pool runs out and recomputes them later: ``num_retractions``; None: not reported)
    preemptions: int | None = field(default=None, compare=False)

    def __post_init__(self):
        n = len(self.response_ids)
        if self.token_versions is not None and len(self.token_versions) != n:
            raise ValueError(f"{self.request_id}/{self.candidate_index}: {len(self.token_versions)} token versions "
                             f"for {n} response tokens")
        if self.routed_experts is not None:
            rows = len(self.prompt_ids) + n - 1
            if not isinstance(self.routed_experts, SampleRouting):
                raise TypeError(f"{self.request_id}/{self.candidate_index}: routed_experts must be a SampleRouting")
            if self.routed_experts.experts.shape[0] != rows:
                raise ValueError(
                    f"{self.request_id}/{self.candidate_index}: routed_experts has "
                    f"{self.routed_experts.experts.shape[0]} token rows, expected len(prompt_ids) + "
                    f"len(response_ids) - 1 = {rows}")
        if self.raw_log_probs.shape != (n,):
            raise ValueError(
                f"{self.request_id}/{self.candidate_index}: raw_log_probs shape "
                f"{tuple(self.raw_log_probs.shape)} != ({n},)"
            )
        if self.processed_log_probs is not None and self.processed_log_probs.shape != (n,):
            raise ValueError(
                f"{self.request_id}/{self.candidate_index}: processed_log_probs shape "
                f"{tuple(self.processed_log_probs.shape)} != ({n},)"
            )


@dataclass(frozen=True)
class LoadReport:
    """What load_weights staged and verified."""

    version_id: str
    manifest_hash: str
    num_tensors: int
    num_bytes: int
    num_buckets: int
    seconds: float


@dataclass(frozen=True)
class ActivationReport:
    """What activate() did; feeds megarl.control.state_machine.RolloutActivation."""

    version_id: str
    manifest_hash: str
    manifest_verified: bool
    cache_flushed: bool


@runtime_checkable
class RolloutEngine(Protocol):
    """A committed actor version in inference layout, generating.

    Lifecycle per version: load_weights(v, ...) stages and verifies; activate(v) flips the active
    pointer atomically and flushes caches; generate() serves only the active version; a
    generate() during load_weights is refused.  sleep()/wake() release and re-acquire device
    memory around the actor's turn.
    """

    #: which log-prob spaces this backend fills: subset of {"raw", "processed"}
    log_prob_spaces: frozenset[str]

    #: the dtype the engine holds its weights in, and so the dtype the actor's tensors are cast to
    #: on their way in (the expected manifest must be computed in it: ``actor_manifest(actor,
    #: dtype=engine.dtype)``); None: the actor's own dtype, no cast
    dtype: torch.dtype | None

    #: where the engine takes incoming tensors: the weight stream moves each tensor there before
    #: handing it over (the CPU for the hf backend on CPU, the engine's GPU for sglang)
    device: torch.device

    @property
    def active_version(self) -> PolicyVersion | None: ...

    def staging_target(self, name: str) -> torch.Tensor | None:
        """While :meth:`load_weights` runs: the tensor that will hold ``name`` once staged, for a
        producer to build it in place (saving a copy), or None (not loading, no such tensor, or
        an engine that never stages in place).

        Only a producer whose tensors go straight to this engine may write there (the weight
        stream does so only without a transport in between); whatever lands is verified against
        the expected manifest like every other tensor.
        """
        ...

    def load_weights(
        self,
        version: PolicyVersion,
        named_tensor_buckets: Iterable[Sequence[tuple[str, torch.Tensor]]],
        expected_manifest: TensorManifest,
    ) -> LoadReport: ...

    def activate(self, version: PolicyVersion) -> ActivationReport: ...

    def generate(
        self, requests: Sequence[GenerationRequest], sampling: SamplingParams
    ) -> list[GenerationResult]: ...

    def flush_cache(self) -> None: ...

    def sleep(self) -> None: ...

    def wake(self) -> None: ...

    def close(self) -> None:
        """Stop what the engine started outside this process (split placement: the rollout
        ranks); an in-process engine ends with its process and has nothing to stop."""
        ...


@runtime_checkable
class TeacherForcingEngine(Protocol):
    """A rollout engine that also scores given tokens under the version it serves
    (``async_rl.proximal_log_probs=engine``: the proximal policy's log-probs from the rollout
    engine instead of an actor forward)."""

    def teacher_force(self, prompts: Sequence[Sequence[int]],
                      responses: Sequence[Sequence[int]]) -> tuple[PolicyVersion, list[torch.Tensor]]:
        """``(v, lps)``: ``lps[i][t] = log softmax(logits_v(prompt_i + response_i[:t]))[response_i[t]]``,
        raw (temperature 1, no processing), float32, for every token of ``responses[i]``, under
        the active version ``v`` (returned, so the caller can check which version scored)."""
        ...


@runtime_checkable
class KeepsUnsentTensors(Protocol):
    """A rollout engine that loads a version from some of its tensors: those not sent are kept
    from the version it holds and proven, where they lie, against the expected manifest (a LoRA
    actor changes only its adapted linears: ``weight_sync.sync_actor_to_engine(names=...)``)."""

    def load_weights(self, version: PolicyVersion, named_tensor_buckets: Iterable[Sequence[tuple[str, torch.Tensor]]],
                     expected_manifest: TensorManifest, keep_unsent: bool = False) -> LoadReport:
        """As :meth:`RolloutEngine.load_weights`; ``keep_unsent``: a tensor the stream does not
        hold is the engine's own, checksummed in place and compared like a received one (a kept
        tensor that is not the expected one fails the load, naming it)."""
        ...


@runtime_checkable
class ServesAdapters(Protocol):
    """A rollout engine that serves a LoRA policy as its base plus an adapter it applies itself
    (SGLang's LoRA backends; ``actor.lora.engine: adapter``): the base is loaded once by
    :meth:`RolloutEngine.load_weights` under its own manifest, each version after that as its
    adapter's tensors only."""

    def load_adapter(self, version: PolicyVersion, tensors: Mapping[str, torch.Tensor], config: dict,
                     base_manifest_hash: str, expected_manifest: TensorManifest) -> LoadReport:
        """Stage ``version`` as the base this engine holds plus the peft-format adapter ``tensors``
        (``config``: its ``adapter_config.json``).  Refused unless the engine's loaded base is the
        one whose manifest hash is ``base_manifest_hash``; each tensor is checked by its sha256
        where the engine deserialised it.  ``expected_manifest`` is the version's (the merged
        weights'), reported on activation."""
        ...


@runtime_checkable
class SubmittingEngine(RolloutEngine, Protocol):
    """A rollout engine that also generates while its caller does other work (split placement's
    :class:`~megarl.rollout.remote.RemoteEngine`): the asynchronous producer submits a batch ahead
    and collects it an iteration or more later."""

    def submit(self, requests: Sequence[GenerationRequest], sampling: SamplingParams,
               segmented: bool = True) -> Any:
        """Send ``requests`` and return a ticket at once; ``segmented``: a version published
        while they generate may take over between segments (``async_rl.segment_tokens``)."""
        ...

    def collect(self, ticket: Any) -> list[GenerationResult]: ...

    @property
    def stats(self) -> dict[str, float]:
        """Cumulative seconds the engines spent generating, idle and loading (and in-flight
        activations), as of their last results."""
        ...


class EngineWrapper:
    """An engine around another that changes some calls and forwards the rest, every one named
    here (no ``__getattr__``): the members of :class:`RolloutEngine`, and those of
    :class:`SubmittingEngine`, which reach an inner engine that has them."""

    def __init__(self, inner):
        self.inner = inner

    @property
    def log_prob_spaces(self) -> frozenset[str]:
        return self.inner.log_prob_spaces

    @property
    def dtype(self) -> torch.dtype | None:
        return self.inner.dtype

    @property
    def device(self) -> torch.device:
        return self.inner.device

    @property
    def active_version(self) -> PolicyVersion | None:
        return self.inner.active_version

    def staging_target(self, name: str) -> torch.Tensor | None:
        return self.inner.staging_target(name)

    def load_weights(self, version: PolicyVersion, named_tensor_buckets, expected_manifest: TensorManifest,
                     **kwargs) -> LoadReport:  # keep_unsent reaches an inner engine that has it
        return self.inner.load_weights(version, named_tensor_buckets, expected_manifest, **kwargs)

    def activate(self, version: PolicyVersion) -> ActivationReport:
        return self.inner.activate(version)

    def generate(self, requests: Sequence[GenerationRequest], sampling: SamplingParams) -> list[GenerationResult]:
        return self.inner.generate(requests, sampling)

    def flush_cache(self) -> None:
        self.inner.flush_cache()

    def sleep(self) -> None:
        self.inner.sleep()

    def wake(self) -> None:
        self.inner.wake()

    def close(self) -> None:
        self.inner.close()

    def submit(self, requests: Sequence[GenerationRequest], sampling: SamplingParams, segmented: bool = True) -> Any:
        return self.inner.submit(requests, sampling, segmented)

    def collect(self, ticket: Any) -> list[GenerationResult]:
        return self.inner.collect(ticket)

    @property
    def stats(self) -> dict[str, float]:
        return self.inner.stats


def candidate_seed(seed: int, request_id: str, candidate_index: int) -> int:
    """Deterministic 63-bit seed of one candidate from the rollout seed and its identity.

    Uses sha256 rather than hash(): Python's str hash is salted per process, and SPMD ranks or a
    resumed run must derive the same seed.
    """
    import hashlib

    h = hashlib.sha256(f"{seed}|{request_id}|{candidate_index}".encode()).digest()
    return int.from_bytes(h[:8], "little") & ((1 << 63) - 1)
