"""The experience record: immutable facts, derived tensors, and log-probs that know who made them.

Layout (the convention every layer follows):
- ``prompt_ids`` ``(bs, prompt_len)`` int64, left-padded; ``response_ids`` ``(bs, response_len)``
  int64, right-padded; the model input is ``cat([prompt_ids, response_ids], 1)``.
- ``attention_mask`` ``(bs, prompt_len + response_len)``: 1 on every real token (prompt or
  response, including non-action tokens such as tool output), 0 on padding.
- ``response_mask`` ``(bs, response_len)``: 1 iff response token t of sample b is a sampled
  action of the policy.  The first sampled action is response token 0.
- every per-token tensor of the response (log-probs, values, advantages, ...) is
  ``(bs, response_len)`` aligned with ``response_ids``.

- ``routed_experts`` (MoE, :class:`RoutedExperts`) ``(bs, prompt_len + response_len, layers, top_k)``
  aligned with ``attention_mask``: the experts the rollout routed each token to.
- ``token_origins`` (multi-turn agent trajectories, :class:`~megarl.experience.origins.TokenOrigins`)
  ``(bs, response_len)``: each response token's source (policy / environment), turn and policy
  version.  A record with an environment token (response_mask 0 between real response tokens)
  or a multi-turn finish reason cannot be sealed without it.

Facts (never change once sealed): ids, tokens, masks, finish reasons, versions, sampling
config, seeds / request ids, rollout / old / reference log-probs, values, reward records, the
rollout's routing (MoE).
Derived (recomputable under hyperparameters): shaped rewards, advantages, returns.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from enum import Enum
from types import MappingProxyType
from typing import Any, Mapping, Sequence

import torch

from megarl.experience.origins import TokenOrigins, TokenSource, first_bad
from megarl.versions import VersionError, behaviour_label, step_of_short_id


class FinishReason(str, Enum):
    """Why generation of one response stopped."""

    EOS = "eos"  # the model emitted its end-of-sequence token: terminal
    STOP = "stop"  # a configured stop string / token: terminal
    LENGTH = "length"  # max_new_tokens or context limit: truncated, the state could continue
    TOOL = "tool"  # the policy handed over to a tool: the episode continues, not terminal
    ABORT = "abort"  # the request was aborted (worker failure, preemption): not trainable
    # multi-turn (agent) trajectories: why the whole trajectory ended
    ENVIRONMENT = "environment"  # the environment ended the episode (terminated): terminal
    ENV_TRUNCATED = "env_truncated"  # the environment truncated it: not terminal, GAE bootstraps
    MAX_TURNS = "max_turns"  # rollout.agent.max_turns reached: not terminal, GAE bootstraps

    @property
    def terminated(self) -> bool:
        """True when the episode really ended after the last action (GAE d_T = 1)."""
        if self is FinishReason.ABORT:
            raise ValueError("finish_reason 'abort' has no termination semantics: aborted samples must be retried, not trained")
        return self in (FinishReason.EOS, FinishReason.STOP, FinishReason.ENVIRONMENT)


#: finish reasons only a multi-turn trajectory has: a record with one needs ``token_origins``
MULTI_TURN_FINISH_REASONS = frozenset(
    {FinishReason.ENVIRONMENT, FinishReason.ENV_TRUNCATED, FinishReason.MAX_TURNS, FinishReason.TOOL})


class RewardStatus(str, Enum):
    OK = "ok"
    ERROR = "error"  # the scorer crashed / raised
    TIMEOUT = "timeout"  # the scorer did not answer in time
    INVALID = "invalid"  # the scorer could not evaluate this input (unparseable, out of domain)


@dataclass(frozen=True)
class ScoreSpan:
    """A part of a reward that applies to some of the response: ``value`` is about response tokens
    ``first`` .. ``last`` (inclusive) and is received after action ``last`` (an environment step's
    reward for the policy turn it answered: that turn's tokens, received after its last policy
    token).  ``label`` says what the part is (``"turn 1"``)."""

    first: int
    last: int
    value: float
    label: str = ""

    def __post_init__(self) -> None:
        if isinstance(self.first, bool) or isinstance(self.last, bool) or not 0 <= int(self.first) <= int(self.last):
            raise ValueError(f"ScoreSpan needs 0 <= first <= last, got first={self.first!r} last={self.last!r}")
        object.__setattr__(self, "first", int(self.first))
        object.__setattr__(self, "last", int(self.last))
        if not math.isfinite(self.value):
            raise ValueError(f"ScoreSpan.value must be a finite float, got {self.value!r}")
        object.__setattr__(self, "value", float(self.value))

    def to_json(self) -> dict:
        return {"first": self.first, "last": self.last, "value": self.value, "label": self.label}


@dataclass(frozen=True)
class RewardRecord:
    """What ``RewardFunction(sample)`` returns.

    ``total`` is a finite float iff ``status == ok``; any failure is a status with ``total=None``
    and an ``error`` text -- never a silent 0.  ``step_rewards`` / ``step_token_ends`` carry process
    rewards: score k belongs to the reasoning step that ends at response token
    ``step_token_ends[k]`` (the step-to-token map), strictly increasing.  ``inputs`` keeps what each
    neural scorer read: its name -> ``sha256:<hex>`` of the token ids of its own rendering of the
    sample (:func:`megarl.roles.reward_model.input_digest`; ``tools/inspect_experience.py
    --scorer-input`` renders it again and compares).

    ``applies_to`` is the applicable mask: the parts of ``total`` that belong to some of the
    response only (:class:`ScoreSpan`, in order, not overlapping), such as the reward of each
    turn of a multi-turn episode.  What they leave of ``total`` (``total - sum(values)``: an
    outcome-level addition such as a reward model's score or a length penalty) applies to the
    whole response, received after its last action; ``None`` is all of ``total`` that way.
    Which estimator reads it, and how, is the algorithm's choice (``algo.reward_placement``).
    """

    total: float | None
    components: Mapping[str, float] = field(default_factory=dict)
    scorer_version: str = ""
    status: RewardStatus = RewardStatus.OK
    error: str | None = None
    step_rewards: tuple[float, ...] | None = None
    step_token_ends: tuple[int, ...] | None = None
    inputs: Mapping[str, str] = field(default_factory=dict)
    applies_to: tuple[ScoreSpan, ...] | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "status", RewardStatus(self.status))
        if self.applies_to is not None:
            spans = tuple(self.applies_to)
            object.__setattr__(self, "applies_to", spans)
            if not spans or not all(isinstance(x, ScoreSpan) for x in spans):
                raise ValueError("RewardRecord.applies_to must be a non-empty tuple of ScoreSpan (None: the whole response)")
            if any(b.first <= a.last for a, b in zip(spans, spans[1:], strict=False)):
                raise ValueError("RewardRecord.applies_to: spans must be in order and not overlap, got "
                                 f"{[(x.first, x.last) for x in spans]}")
            if self.status is not RewardStatus.OK:
                raise ValueError(f"RewardRecord.applies_to is set on a {self.status.value!r} record (a failure applies to nothing)")
        object.__setattr__(self, "components", MappingProxyType(dict(self.components)))
        object.__setattr__(self, "inputs", MappingProxyType(dict(self.inputs)))
        if not self.scorer_version:
            raise ValueError("RewardRecord.scorer_version must name the scorer version that produced it")
        if self.status is RewardStatus.OK:
            if self.total is None or not math.isfinite(self.total):
                raise ValueError(f"RewardRecord.total must be a finite float when status is 'ok', got {self.total!r}")
            if self.error is not None:
                raise ValueError("RewardRecord.error must be None when status is 'ok'")
        else:
            if self.total is not None:
                raise ValueError(
                    f"RewardRecord.total must be None when status is {self.status.value!r} (a failure is not a score)"
                )
            if not self.error:
                raise ValueError(f"RewardRecord.error must explain status {self.status.value!r}")
        for k, v in self.components.items():
            if not isinstance(k, str) or not math.isfinite(v):
                raise ValueError(f"RewardRecord.components[{k!r}] must be a finite float, got {v!r}")
        if (self.step_rewards is None) != (self.step_token_ends is None):
            raise ValueError("RewardRecord.step_rewards and step_token_ends must be given together")
        if self.step_rewards is not None:
            if len(self.step_rewards) != len(self.step_token_ends):
                raise ValueError(
                    f"RewardRecord.step_rewards has {len(self.step_rewards)} entries, "
                    f"step_token_ends {len(self.step_token_ends)}"
                )
            ends = list(self.step_token_ends)
            if any(b <= a for a, b in zip(ends, ends[1:], strict=False)) or (ends and ends[0] < 0):
                raise ValueError(f"RewardRecord.step_token_ends must be non-negative and strictly increasing, got {ends}")

    def to_json(self) -> dict:
        return {
            "total": self.total,
            "components": dict(self.components),
            "scorer_version": self.scorer_version,
            "status": self.status.value,
            "error": self.error,
            "step_rewards": None if self.step_rewards is None else list(self.step_rewards),
            "step_token_ends": None if self.step_token_ends is None else list(self.step_token_ends),
            **({"inputs": dict(self.inputs)} if self.inputs else {}),  # (a record without neural scorers: as before)
            **({"applies_to": [x.to_json() for x in self.applies_to]} if self.applies_to is not None else {}),
        }

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> "RewardRecord":
        return cls(
            total=d["total"],
            components=d["components"],
            scorer_version=d["scorer_version"],
            status=RewardStatus(d["status"]),
            error=d["error"],
            step_rewards=None if d["step_rewards"] is None else tuple(d["step_rewards"]),
            step_token_ends=None if d["step_token_ends"] is None else tuple(d["step_token_ends"]),
            inputs=d.get("inputs") or {},
            applies_to=None if d.get("applies_to") is None else tuple(ScoreSpan(**x) for x in d["applies_to"]),
        )

    def outcome_remainder(self) -> float:
        """What of ``total`` applies to the whole response: all of it without ``applies_to``."""
        return float(self.total) - (0.0 if self.applies_to is None else sum(x.value for x in self.applies_to))


LOG_PROB_ROLES = ("actor", "rollout", "engine", "reference", "teacher")
LOG_PROB_SPACES = ("raw", "processed")


@dataclass(frozen=True)
class LogProbProducer:
    """Who computed a log-prob tensor.

    role: ``actor`` -- the trainable actor, teacher-forced on the frozen experience before any
    update (the old policy); ``rollout`` -- recorded by the rollout engine while sampling;
    ``engine`` -- teacher-forced by the rollout engine on the trained version, after sampling
    (the proximal policy of an asynchronous batch, ``async_rl.proximal_log_probs=engine``);
    ``reference`` -- the reference (KL anchor) model; ``teacher`` -- on-policy distillation's
    teacher, a frozen stronger model teacher-forced on the student's samples.
    version: the producing model's version id (policy version for actor / rollout).
    space: ``raw`` -- log softmax of the unmodified logits; ``processed`` -- after temperature /
    top-k / top-p / logits processors (the sampling distribution).
    precision: the dtype the producing model computed in (``bfloat16`` engine, ``float32``
    actor: the values are float32 either way); empty in records sealed before it was recorded.
    """

    role: str
    version: str
    space: str = "raw"
    precision: str = ""

    def __post_init__(self) -> None:
        if self.role not in LOG_PROB_ROLES:
            raise ValueError(f"LogProbProducer.role {self.role!r} is not one of {LOG_PROB_ROLES}")
        if not self.version:
            raise ValueError("LogProbProducer.version must be a non-empty version id")
        if self.space not in LOG_PROB_SPACES:
            raise ValueError(f"LogProbProducer.space {self.space!r} is not one of {LOG_PROB_SPACES}")
        if self.precision and not isinstance(getattr(torch, self.precision, None), torch.dtype):
            raise ValueError(f"LogProbProducer.precision {self.precision!r} is not a torch dtype name")


@dataclass(frozen=True)
class LogProbs:
    """Per-response-token log-probs ``values`` ``(bs, response_len)`` with their producer."""

    values: torch.Tensor
    producer: LogProbProducer

    def __post_init__(self) -> None:
        if not isinstance(self.producer, LogProbProducer):
            raise TypeError(f"LogProbs.producer must be a LogProbProducer, got {type(self.producer).__name__}")
        if not isinstance(self.values, torch.Tensor) or not self.values.is_floating_point() or self.values.dim() != 2:
            raise ValueError("LogProbs.values must be a floating (bs, response_len) tensor")


def expect_producer(
    lp: Any,
    *,
    field: str,
    roles: Sequence[str],
    version: str | None = None,
    space: str | None = None,
) -> LogProbs:
    """Refuse a log-prob record from the wrong producer.  Pure Python: no tensor op runs.

    Args:
        lp: the record passed in as ``field``.
        field: the name of the argument / field (used in the error).
        roles: the acceptable producer roles.
        version: if given, the producer version that must match.
        space: if given, the probability space (``raw`` / ``processed``) that must match.
    Returns:
        ``lp`` unchanged.
    """
    if not isinstance(lp, LogProbs):
        raise TypeError(
            f"{field} must be a LogProbs record (values + producer), got {type(lp).__name__}; "
            "a bare tensor carries no proof of which model produced it"
        )
    p = lp.producer
    if p.role not in roles:
        raise ValueError(f"{field} must be produced by role {tuple(roles)}, got role {p.role!r} (version {p.version!r})")
    if version is not None and p.version != version:
        raise ValueError(f"{field} must come from version {version!r}, got {p.version!r} (role {p.role!r})")
    if space is not None and p.space != space:
        raise ValueError(f"{field} must be in probability space {space!r}, got {p.space!r} (role {p.role!r})")
    return lp


@dataclass(frozen=True)
class SamplingConfig:
    """The sampling contract of a rollout (identical for every sample of a batch)."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_new_tokens: int = 256
    n: int = 1  # samples per prompt (the group size G for GRPO)
    stop_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if not self.temperature > 0:
            raise ValueError(f"SamplingConfig.temperature must be > 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"SamplingConfig.top_p must be in (0, 1], got {self.top_p}")
        if self.top_k == 0 or self.top_k < -1:
            raise ValueError(f"SamplingConfig.top_k must be -1 (off) or >= 1, got {self.top_k}")
        if self.max_new_tokens < 1:
            raise ValueError(f"SamplingConfig.max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.n < 1:
            raise ValueError(f"SamplingConfig.n must be >= 1, got {self.n}")
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))

    def to_json(self) -> dict:
        return dataclasses.asdict(self) | {"stop_token_ids": list(self.stop_token_ids)}

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> "SamplingConfig":
        return cls(**{**d, "stop_token_ids": tuple(d["stop_token_ids"])})


ROUTING_ROLES = ("rollout", "actor")


def compact_expert_dtype(num_experts: int) -> torch.dtype:
    """The smallest integer dtype that holds every expert id: uint8 up to 256 experts, int16 up to
    32768, else int32.  Fixed by ``num_experts`` so that a record's bytes (and its hash) are too."""
    if num_experts < 1:
        raise ValueError(f"num_experts must be >= 1, got {num_experts}")
    if num_experts <= 256:
        return torch.uint8
    if num_experts <= 32768:
        return torch.int16
    return torch.int32


@dataclass(frozen=True)
class RoutingProducer:
    """Who chose the experts: ``role`` ``rollout`` (the engine while generating; ``backend`` hf or
    sglang) or ``actor`` (a trainer forward, for the mismatch metric); ``version`` the policy
    version of the weights that routed."""

    role: str
    backend: str
    version: str

    def __post_init__(self) -> None:
        if self.role not in ROUTING_ROLES:
            raise ValueError(f"RoutingProducer.role {self.role!r} is not one of {ROUTING_ROLES}")
        if not self.backend:
            raise ValueError("RoutingProducer.backend must name the engine or model that routed")
        if not self.version:
            raise ValueError("RoutingProducer.version must be a non-empty version id")


def _check_expert_ids(where: str, ids: torch.Tensor, num_experts: int, top_k: int) -> None:
    if ids.dtype != compact_expert_dtype(num_experts):
        raise ValueError(f"{where}: dtype {ids.dtype} is not the compact dtype "
                         f"{compact_expert_dtype(num_experts)} of {num_experts} experts")
    if ids.shape[-1] != top_k:
        raise ValueError(f"{where}: last dimension {ids.shape[-1]} != top_k {top_k}")
    if ids.numel() == 0:
        return
    wide = ids.to(torch.int64)
    if int(wide.min()) < 0 or int(wide.max()) >= num_experts:
        raise ValueError(f"{where}: expert ids outside [0, {num_experts})")
    s = wide.sort(dim=-1).values
    if top_k > 1 and bool((s[..., 1:] == s[..., :-1]).any()):
        raise ValueError(f"{where}: an expert appears twice in one token's top-k")


@dataclass(frozen=True)
class SampleRouting:
    """The experts one generated sample was routed to, as the engine returned them.

    ``experts`` ``(len(prompt_ids) + len(response_ids) - 1, len(moe_layers), top_k)``: row t is
    the top-k of token t of prompt + response, in every MoE layer (the top-k *set*: the order
    within a row is the engine's).  The last response token is never fed through the model (the
    engine stops after sampling it), so it has no row.  ``moe_layers`` are the indices, among the
    model's decoder layers, of the MoE layers the columns stand for.  ``experts`` is in the
    compact dtype of ``num_experts`` (:func:`compact_expert_dtype`).
    """

    experts: torch.Tensor
    num_experts: int
    moe_layers: tuple[int, ...]
    backend: str  # the engine that routed (hf, sglang): the sealed record's producer backend

    def __post_init__(self) -> None:
        object.__setattr__(self, "moe_layers", tuple(int(i) for i in self.moe_layers))
        if not self.backend:
            raise ValueError("SampleRouting.backend must name the engine that routed")
        if not isinstance(self.experts, torch.Tensor) or self.experts.dim() != 3:
            raise ValueError("SampleRouting.experts must be a (tokens, layers, top_k) tensor")
        if self.experts.shape[1] != len(self.moe_layers) or not self.moe_layers:
            raise ValueError(f"SampleRouting.experts has {self.experts.shape[1]} layers, moe_layers "
                             f"{self.moe_layers}")
        _check_expert_ids("SampleRouting.experts", self.experts, self.num_experts, self.experts.shape[-1])

    @property
    def top_k(self) -> int:
        return int(self.experts.shape[-1])


def routing_token_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """``(bs, seq)`` bool: the positions whose routing a rollout records -- every real token
    except each row's last one (never fed through the model while generating)."""
    am = attention_mask != 0
    last = am.int().cumsum(dim=1) == am.sum(dim=1, keepdim=True)
    return am & ~last


@dataclass(frozen=True)
class RoutedExperts:
    """The experts a batch was routed to: a behaviour fact of each sample, sealed with it.

    ``experts`` ``(bs, prompt_len + response_len, len(moe_layers), top_k)`` in the compact dtype
    of ``num_experts`` (:func:`compact_expert_dtype`), aligned with ``attention_mask``: position s
    of row b is token s of ``cat([prompt_ids, response_ids], 1)``.  Recorded on
    :func:`routing_token_mask` (every real token but the row's last); every other position
    (padding, the last token) holds experts ``0 .. top_k-1``, a valid top-k that a replaying
    forward may route to and that no metric counts.  ``moe_layers``: the decoder-layer index of
    each column.  The top-k order within a row is the producer's; compare them as sets.
    """

    experts: torch.Tensor
    producer: RoutingProducer
    num_experts: int
    moe_layers: tuple[int, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "moe_layers", tuple(int(i) for i in self.moe_layers))
        if not isinstance(self.producer, RoutingProducer):
            raise TypeError(f"RoutedExperts.producer must be a RoutingProducer, got {type(self.producer).__name__}")
        if not isinstance(self.experts, torch.Tensor) or self.experts.dim() != 4:
            raise ValueError("RoutedExperts.experts must be a (bs, seq, layers, top_k) tensor")
        if not self.moe_layers or len(set(self.moe_layers)) != len(self.moe_layers):
            raise ValueError(f"RoutedExperts.moe_layers must be distinct and non-empty, got {self.moe_layers}")
        if self.experts.shape[2] != len(self.moe_layers):
            raise ValueError(f"RoutedExperts.experts has {self.experts.shape[2]} layers, moe_layers {self.moe_layers}")
        _check_expert_ids("RoutedExperts.experts", self.experts, self.num_experts, self.experts.shape[-1])

    @property
    def top_k(self) -> int:
        return int(self.experts.shape[-1])

    def metadata(self) -> dict:
        """The non-tensor part (what the manifest and the content hash record)."""
        return {"producer": dataclasses.asdict(self.producer), "num_experts": self.num_experts,
                "moe_layers": list(self.moe_layers), "top_k": self.top_k}

    def select(self, rows: torch.Tensor) -> "RoutedExperts":
        """The rows ``rows`` of the batch (a mini-batch), same producer."""
        return dataclasses.replace(self, experts=self.experts[rows])


def _check_tensor(name: str, t: Any, shape: tuple[int, ...], *, floating: bool | None = None) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"ExperienceFacts.{name} must be a tensor, got {type(t).__name__}")
    if tuple(t.shape) != shape:
        raise ValueError(f"ExperienceFacts.{name} must have shape {shape}, got {tuple(t.shape)}")
    if floating is True and not t.is_floating_point():
        raise ValueError(f"ExperienceFacts.{name} must be floating point, got {t.dtype}")
    if floating is False and t.is_floating_point():
        raise ValueError(f"ExperienceFacts.{name} must be an integer/bool tensor, got {t.dtype}")


def check_mask_layout(attention_mask: torch.Tensor, response_mask: torch.Tensor, prompt_len: int) -> None:
    """Validate the mask convention; raise naming the row and the rule broken.

    - prompt part ``attention_mask[:, :prompt_len]`` is left-padded (zeros, then ones) and has
      at least one real token;
    - response part ``attention_mask[:, prompt_len:]`` is right-padded (ones, then zeros);
    - ``response_mask`` is 0/1, never 1 where the response attention is 0;
    - a non-empty response starts and ends on a sampled action (response token 0 and its last
      real token): a mask shifted by one token either way fails here.
    """
    am = attention_mask != 0
    rm = response_mask != 0
    if not torch.all((attention_mask == 0) | (attention_mask == 1)) or not torch.all(
        (response_mask == 0) | (response_mask == 1)
    ):
        raise ValueError("attention_mask and response_mask must be 0/1")
    p, r = am[:, :prompt_len], am[:, prompt_len:]
    # left-padded prompt: once a 1 is seen every later position is 1 -> cummax equals itself
    bad = (p.int().cummax(dim=1).values != p.int()).any(dim=1) | ~p.any(dim=1)
    if bad.any():
        raise ValueError(f"attention_mask prompt part must be left-padded and non-empty; bad rows {bad.nonzero().flatten().tolist()}")
    bad = (r.int().flip(1).cummax(dim=1).values.flip(1) != r.int()).any(dim=1)
    if bad.any():
        raise ValueError(f"attention_mask response part must be right-padded; bad rows {bad.nonzero().flatten().tolist()}")
    bad = (rm & ~r).any(dim=1)
    if bad.any():
        raise ValueError(
            f"response_mask is 1 on padding (attention_mask 0) in rows {bad.nonzero().flatten().tolist()}: "
            "off-by-one or misaligned response mask"
        )
    if r.shape[1] == 0:
        return
    bad = r[:, 0] & ~rm[:, 0]
    if bad.any():
        raise ValueError(
            f"response_mask[:, 0] must be 1 (the first response token is the first sampled action); "
            f"rows {bad.nonzero().flatten().tolist()} start late: off-by-one response mask"
        )
    last = (r.sum(dim=1) - 1).clamp(min=0)
    bad = r.any(dim=1) & ~rm.gather(1, last[:, None]).squeeze(1)
    if bad.any():
        raise ValueError(
            f"response_mask must be 1 on the last real response token (eos / last sampled token); "
            f"rows {bad.nonzero().flatten().tolist()} end early: off-by-one response mask"
        )


@dataclass(frozen=True)
class ExperienceFacts:
    """The immutable facts of one rollout batch (field layout in the module docstring).

    Per-sample metadata are tuples of length bs; tensors are batched.  ``old_log_probs`` must be
    produced by the actor (or the rollout engine when configured to reuse rollout log-probs) at
    the samples' ``policy_version``; ``ref_log_probs`` by the reference; ``rollout_log_probs``
    by the rollout engine at ``policy_version``; ``teacher_log_probs`` by on-policy
    distillation's teacher.
    """

    run_id: str
    iteration: int
    prompt_id: tuple[str, ...]
    group_id: tuple[str, ...]
    sample_id: tuple[str, ...]
    prompt_ids: torch.Tensor
    response_ids: torch.Tensor
    attention_mask: torch.Tensor
    response_mask: torch.Tensor
    finish_reason: tuple[FinishReason, ...]
    policy_version: tuple[str, ...]
    sampling: SamplingConfig
    request_id: tuple[str, ...]
    seed: tuple[int | None, ...]
    rewards: tuple[RewardRecord, ...]
    rollout_log_probs: LogProbs | None = None
    old_log_probs: LogProbs | None = None
    ref_log_probs: LogProbs | None = None
    values: torch.Tensor | None = None
    critic_version: str | None = None
    routed_experts: RoutedExperts | None = None  # MoE only: the rollout's routing (algo.routing_replay)
    token_origins: TokenOrigins | None = None  # multi-turn only: source / turn / version per response token
    #: ``(bs,)`` the critic's V(s_T), the state after each response's last token: what GAE
    #: bootstraps a truncated sample from (sealed with ``values``, so the batch re-derives alone)
    bootstrap_values: torch.Tensor | None = None
    #: on-policy distillation: the teacher's log-probs of the sampled tokens (``teacher.path``)
    teacher_log_probs: LogProbs | None = None

    def __post_init__(self) -> None:
        bs = len(self.sample_id)
        for name in ("prompt_id", "group_id", "sample_id", "finish_reason", "policy_version", "request_id", "seed", "rewards"):
            v = getattr(self, name)
            if not isinstance(v, tuple):
                object.__setattr__(self, name, v := tuple(v))
            if len(v) != bs:
                raise ValueError(f"ExperienceFacts.{name} has {len(v)} entries, expected bs={bs} (len(sample_id))")
        object.__setattr__(self, "finish_reason", tuple(FinishReason(f) for f in self.finish_reason))
        if len(set(self.sample_id)) != bs:
            raise ValueError("ExperienceFacts.sample_id contains duplicates; joins are by id")
        for i, r in enumerate(self.rewards):
            if not isinstance(r, RewardRecord):
                raise TypeError(f"ExperienceFacts.rewards[{i}] must be a RewardRecord, got {type(r).__name__}")
        if FinishReason.ABORT in self.finish_reason:
            i = self.finish_reason.index(FinishReason.ABORT)
            raise ValueError(f"ExperienceFacts: sample {self.sample_id[i]!r} has finish_reason 'abort'; retry it instead")
        if self.prompt_ids.dim() != 2 or self.response_ids.dim() != 2:
            raise ValueError("ExperienceFacts.prompt_ids / response_ids must be (bs, prompt_len) / (bs, response_len)")
        P, R = self.prompt_ids.shape[1], self.response_ids.shape[1]
        _check_tensor("prompt_ids", self.prompt_ids, (bs, P), floating=False)
        _check_tensor("response_ids", self.response_ids, (bs, R), floating=False)
        _check_tensor("attention_mask", self.attention_mask, (bs, P + R), floating=False)
        _check_tensor("response_mask", self.response_mask, (bs, R), floating=False)
        check_mask_layout(self.attention_mask, self.response_mask, P)
        versions = set(self.policy_version)
        behaviour = self._behaviour_labels()
        if self.rollout_log_probs is not None:
            expect_producer(self.rollout_log_probs, field="rollout_log_probs", roles=("rollout",))
            _check_tensor("rollout_log_probs.values", self.rollout_log_probs.values, (bs, R), floating=True)
            if self.rollout_log_probs.producer.version not in behaviour:
                raise ValueError(
                    f"rollout_log_probs version {self.rollout_log_probs.producer.version!r} != sample policy_version "
                    f"{sorted(versions)} (expected the behaviour label, one of {sorted(behaviour)})"
                )
        if self.old_log_probs is not None:
            expect_producer(self.old_log_probs, field="old_log_probs", roles=("actor", "rollout", "engine"))
            _check_tensor("old_log_probs.values", self.old_log_probs.values, (bs, R), floating=True)
            if versions != {self.old_log_probs.producer.version} and not self._proximal_after_behaviour():
                raise ValueError(
                    f"old_log_probs version {self.old_log_probs.producer.version!r} must be the behaviour "
                    f"policy_version of every sample, got {sorted(versions)} (or, for an asynchronous batch, "
                    "the actor's on a version no older than any of them)"
                )
        if self.ref_log_probs is not None:
            expect_producer(self.ref_log_probs, field="ref_log_probs", roles=("reference",))
            _check_tensor("ref_log_probs.values", self.ref_log_probs.values, (bs, R), floating=True)
        if self.teacher_log_probs is not None:
            expect_producer(self.teacher_log_probs, field="teacher_log_probs", roles=("teacher",))
            _check_tensor("teacher_log_probs.values", self.teacher_log_probs.values, (bs, R), floating=True)
        if self.values is not None:
            _check_tensor("values", self.values, (bs, R), floating=True)
            if not self.critic_version:
                raise ValueError("ExperienceFacts.critic_version must name the critic that produced values")
        if self.bootstrap_values is not None:
            _check_tensor("bootstrap_values", self.bootstrap_values, (bs,), floating=True)
            if self.values is None:
                raise ValueError("ExperienceFacts.bootstrap_values come with the critic's values (none given)")
        if self.routed_experts is not None:
            re_ = self.routed_experts
            if not isinstance(re_, RoutedExperts):
                raise TypeError(f"ExperienceFacts.routed_experts must be a RoutedExperts record, got {type(re_).__name__}")
            if re_.producer.role != "rollout":
                raise ValueError(f"routed_experts must be the rollout's routing (role 'rollout'), got role "
                                 f"{re_.producer.role!r} (backend {re_.producer.backend!r})")
            if re_.producer.version not in behaviour:
                raise ValueError(f"routed_experts version {re_.producer.version!r} != sample policy_version {sorted(versions)}")
            want = (bs, P + R, len(re_.moe_layers), re_.top_k)
            if tuple(re_.experts.shape) != want:
                raise ValueError(f"ExperienceFacts.routed_experts.experts must have shape (bs, prompt_len + response_len, "
                                 f"layers, top_k) = {want}, got {tuple(re_.experts.shape)}")
        if self.token_origins is not None:
            self._check_token_origins()
        self._check_reward_spans()

    def _check_reward_spans(self) -> None:
        """Every reward part is received after an action of its own sample's response."""
        R = self.response_ids.shape[1]
        for b, r in enumerate(self.rewards):
            for x in r.applies_to or ():
                if x.last >= R or not bool(self.response_mask[b, x.last]):
                    raise ValueError(f"ExperienceFacts.rewards: sample {self.sample_id[b]!r}: the part {x.label or x.value!r} "
                                     f"ends at response position {x.last}, which is not an action token "
                                     f"(response_len {R})")

    def _policy_token_versions(self) -> set:
        """Every version that generated a policy token: each sample's, and each turn's."""
        o = self.token_origins
        extra = o.versions if isinstance(o, TokenOrigins) else ()
        return set(self.policy_version) | set(extra)

    def _behaviour_labels(self) -> set:
        """The producer versions the rollout-side records (log-probs, routing) may carry: the
        label (:func:`megarl.versions.behaviour_label`; one version: its id) of the samples'
        versions, or of every policy token's version (an earlier turn may be older)."""
        out = set()
        for ids in (set(self.policy_version), self._policy_token_versions()):
            if len(ids) == 1:
                out.add(next(iter(ids)))
                continue
            try:
                out.add(behaviour_label(ids))
            except VersionError:  # ids that are no short ids have no label: nothing matches, the check names them
                pass
        return out

    def _proximal_after_behaviour(self) -> bool:
        """Decoupled PPO (asynchronous batches): the old log-probs are the actor's (or the engine's,
        teacher-forced) on the trained version, the proximal policy, which no sample may postdate.  The bound itself (at most
        eta steps older) is checked per token before sealing (``megarl.experience.staleness``)."""
        old = self.old_log_probs.producer
        if old.role not in ("actor", "engine"):
            return False
        try:
            s = step_of_short_id(old.version)
            return all(step_of_short_id(i) <= s for i in self._policy_token_versions())
        except VersionError:
            return False

    def _check_token_origins(self) -> None:
        """The rules tying ``token_origins`` to the rest of the record (its own rules are checked
        when it is built); a failure names the sample and the response position."""
        o = self.token_origins
        if not isinstance(o, TokenOrigins):
            raise TypeError(f"ExperienceFacts.token_origins must be a TokenOrigins record, got {type(o).__name__}")
        bs, P, R = self.batch_size, self.prompt_len, self.response_len
        if tuple(o.source.shape) != (bs, R):
            raise ValueError(f"ExperienceFacts.token_origins must have shape (bs, response_len) = {(bs, R)}, "
                             f"got {tuple(o.source.shape)}")

        def fail(rule: str, bad: torch.Tensor) -> None:
            at = first_bad(bad)
            if at is not None:
                raise ValueError(f"ExperienceFacts.token_origins: sample {self.sample_id[at[0]]!r}, response "
                                 f"position {at[1]}: {rule}")

        policy, env = o.policy_mask(), o.environment_mask()
        fail("response_mask must be 1 exactly on policy tokens (source 1)", (self.response_mask != 0) != policy)
        fail("padding (source 0) must be exactly where attention_mask is 0",
             (o.source == TokenSource.PAD) != (self.attention_mask[:, P:] == 0))
        if self.rollout_log_probs is not None:
            fail("rollout_log_probs must be 0 on an environment token (the policy did not sample it)",
                 env & (self.rollout_log_probs.values != 0))
        for b, v in enumerate(o.last_policy_versions()):
            if v is not None and v != self.policy_version[b]:
                raise ValueError(f"ExperienceFacts.token_origins: sample {self.sample_id[b]!r}: policy_version "
                                 f"{self.policy_version[b]!r} must be the version of its last policy token, {v!r}")

    def multi_turn(self) -> torch.Tensor:
        """``(bs,)`` bool: the samples that are multi-turn trajectories -- an environment token
        (response_mask 0 on a real response token; the mask layout puts policy tokens at both
        ends) or a finish reason in :data:`MULTI_TURN_FINISH_REASONS`."""
        env = ((self.attention_mask[:, self.prompt_len:] != 0) & (self.response_mask == 0)).any(dim=1)
        reason = torch.tensor([f in MULTI_TURN_FINISH_REASONS for f in self.finish_reason], dtype=torch.bool)
        return env | reason

    @property
    def batch_size(self) -> int:
        return len(self.sample_id)

    @property
    def prompt_len(self) -> int:
        return self.prompt_ids.shape[1]

    @property
    def response_len(self) -> int:
        return self.response_ids.shape[1]

    def input_ids(self) -> torch.Tensor:
        """``(bs, prompt_len + response_len)`` the tokens the model is teacher-forced on."""
        return torch.cat([self.prompt_ids, self.response_ids], dim=1)

    def terminated(self) -> torch.Tensor:
        """``(bs,)`` bool: the episode ended after the last action (eos / stop / environment)."""
        return torch.tensor([f.terminated for f in self.finish_reason], dtype=torch.bool)

    def response_lengths(self) -> torch.Tensor:
        """``(bs,)`` int64 number of sampled action tokens."""
        return (self.response_mask != 0).sum(dim=1)

    def scores(self) -> torch.Tensor:
        """``(bs,)`` float64 reward totals; raises naming the sample if any reward is not ok."""
        out = []
        for sid, r in zip(self.sample_id, self.rewards, strict=True):
            if r.status is not RewardStatus.OK:
                raise ValueError(f"sample {sid!r} has reward status {r.status.value!r} ({r.error}); it cannot be trained on")
            out.append(r.total)
        return torch.tensor(out, dtype=torch.float64)


@dataclass(frozen=True)
class DerivedTensors:
    """Tensors recomputable from facts under ``hyperparameters`` (all ``(bs, response_len)``).

    ``loss_mask`` is the response mask after algorithm-level exclusions (skipped zero-variance
    groups, mismatch-masked sequences); it is what the loss and its normaliser use.
    """

    advantages: torch.Tensor
    loss_mask: torch.Tensor
    returns: torch.Tensor | None = None
    shaped_rewards: torch.Tensor | None = None
    is_weights: torch.Tensor | None = None
    estimator: str = ""
    hyperparameters: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        object.__setattr__(self, "hyperparameters", MappingProxyType(dict(self.hyperparameters)))
        if not self.estimator:
            raise ValueError("DerivedTensors.estimator must name the estimator that produced them")
        shape = tuple(self.advantages.shape)
        for name in ("loss_mask", "returns", "shaped_rewards", "is_weights"):
            t = getattr(self, name)
            if t is not None and tuple(t.shape) != shape:
                raise ValueError(f"DerivedTensors.{name} has shape {tuple(t.shape)}, expected advantages' {shape}")


@dataclass(frozen=True)
class ExperienceBatch:
    """Facts plus (optionally) the derived tensors of one hyperparameter setting.

    ``content_hash`` is set by :func:`megarl.experience.seal.seal`; a batch with a hash is sealed.
    """

    facts: ExperienceFacts
    derived: DerivedTensors | None = None
    content_hash: str | None = None

    def __post_init__(self) -> None:
        if self.derived is not None:
            want = (self.facts.batch_size, self.facts.response_len)
            if tuple(self.derived.advantages.shape) != want:
                raise ValueError(f"ExperienceBatch.derived.advantages must be {want}, got {tuple(self.derived.advantages.shape)}")

    @property
    def sealed(self) -> bool:
        return self.content_hash is not None


def batch_tensors(batch: ExperienceBatch) -> dict[str, torch.Tensor]:
    """Every tensor of the batch under a stable dotted name (``facts.old_log_probs``, ...)."""
    out: dict[str, torch.Tensor] = {}
    f = batch.facts
    for name in ("prompt_ids", "response_ids", "attention_mask", "response_mask", "values", "bootstrap_values"):
        t = getattr(f, name)
        if t is not None:
            out[f"facts.{name}"] = t
    for name in ("rollout_log_probs", "old_log_probs", "ref_log_probs", "teacher_log_probs"):
        lp = getattr(f, name)
        if lp is not None:
            out[f"facts.{name}"] = lp.values
    if f.routed_experts is not None:
        out["facts.routed_experts"] = f.routed_experts.experts
    if f.token_origins is not None:
        for name in ("source", "turn", "version_index"):
            out[f"facts.token_origins.{name}"] = getattr(f.token_origins, name)
    if batch.derived is not None:
        for name in ("advantages", "loss_mask", "returns", "shaped_rewards", "is_weights"):
            t = getattr(batch.derived, name)
            if t is not None:
                out[f"derived.{name}"] = t
    return out
