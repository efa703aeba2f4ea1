"""Multi-turn, tool-using rollouts as token-in / token-out sessions.

A trajectory is one token list that only grows: the prompt, then policy turns and environment
output, in the order they happened.  The rules that make the field's three recurring bugs
impossible by construction:

* **Sampled tokens are kept as generated.**  Each policy turn appends the engine's
  ``response_ids`` with its raw log-probs and the version that generated them; nothing the
  policy produced is ever decoded and encoded again.  The decoded text of a turn goes to the
  environment only (as the action it reads), never back into the trajectory.
* **Environment output is rendered once**, by the chat template
  (:class:`megarl.envs.render.EnvTurnRenderer`), and appended with loss mask 0, no policy
  version, source ``environment``.  All messages of one environment step (parallel tool
  results) are rendered in one template call.  Earlier turns are never re-rendered, so a
  template that rewrites past assistant turns (Qwen3 stripping ``<think>``) cannot change what
  the policy is trained on.
* **The next turn continues from token ids** (``GenerationRequest.prompt_ids`` = the whole
  trajectory so far): the hf engine teacher-forces them, SGLang takes them as ``input_ids`` and
  reuses its prefix cache.

Turns of all active trajectories are generated in batched engine calls (:func:`_policy_turn`
says how they are seeded); environments step concurrently
(:class:`megarl.envs.runner.EnvironmentPool`, per-step timeout).  An environment that fails is a
status on the trajectory (never a reward).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

import torch

from megarl.experience.schema import FinishReason
from megarl.rollout.protocol import EngineWrapper, GenerationRequest, GenerationResult, SamplingParams

POLICY, ENVIRONMENT = 1, 2  # the token sources of a trajectory (0 is padding in the record)


@dataclass(frozen=True)
class AgentLimits:
    """``max_turns`` policy turns; ``max_total_tokens`` tokens after the prompt (policy and
    environment together); each turn samples at most ``SamplingParams.max_new_tokens``."""

    max_turns: int
    max_total_tokens: int


@dataclass
class Trajectory:
    """One candidate's whole episode.  ``response_ids`` is everything after ``prompt_ids``; the
    per-token lists have its length.  ``generated``: the engine's raw result of every policy
    turn, in order (what the per-sample audit compares the trajectory with)."""

    request_id: str
    candidate_index: int
    prompt_ids: Tuple[int, ...]
    attempt: int = 0  # the request's attempt this trajectory answers
    response_ids: List[int] = field(default_factory=list)
    source: List[int] = field(default_factory=list)
    turn: List[int] = field(default_factory=list)
    token_versions: List[Optional[str]] = field(default_factory=list)
    raw_log_probs: List[float] = field(default_factory=list)
    finish_reason: Optional[FinishReason] = None
    reward_components: Dict[str, float] = field(default_factory=dict)
    #: each environment step's reward components, by the policy turn the step answered
    turn_rewards: List[Dict[str, float]] = field(default_factory=list)
    env_status: str = "ok"
    env_error: Optional[str] = None
    turns: int = 0
    tool_calls: int = 0
    step_latency_s: List[float] = field(default_factory=list)
    generated: List[GenerationResult] = field(default_factory=list)
    rendered: List[Tuple[int, ...]] = field(default_factory=list)

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    @property
    def policy_turns(self) -> int:
        """The policy turns it holds (``turns`` counts only those the environment answered)."""
        return len(self.generated)

    @property
    def policy_version(self) -> Optional[str]:
        """The version of the last policy token (the sample's version in the record)."""
        return next((v for v in reversed(self.token_versions) if v is not None), None)

    def turn_spans(self) -> list:
        """The applicable mask of the episode's rewards: for each policy turn an environment step
        answered, a :class:`~megarl.experience.schema.ScoreSpan` over that turn's policy tokens
        (response positions), its value the step's reward components summed.  A turn without
        policy tokens has nowhere to put its reward: it is left to the outcome remainder."""
        from megarl.experience.schema import ScoreSpan

        spans = []
        for k, comps in enumerate(self.turn_rewards):
            pos = [i for i, (src, tu) in enumerate(zip(self.source, self.turn, strict=True)) if src == POLICY and tu == k]
            if pos:
                spans.append(ScoreSpan(first=pos[0], last=pos[-1], value=float(sum(comps.values())), label=f"turn {k}"))
        return spans

    def log_probs_tensor(self) -> torch.Tensor:
        return torch.tensor(self.raw_log_probs, dtype=torch.float32)

    def _append(self, ids, src: int, version: Optional[str], log_probs, turn: int) -> None:
        ids = [int(t) for t in ids]
        self.response_ids += ids
        self.source += [src] * len(ids)
        self.turn += [turn] * len(ids)
        self.token_versions += [version] * len(ids)
        self.raw_log_probs += [float(x) for x in log_probs] if log_probs is not None else [0.0] * len(ids)

    def append_policy_turn(self, result: GenerationResult) -> None:
        self.generated.append(result)
        self._append(result.response_ids, POLICY, result.policy_version, result.raw_log_probs.tolist(), self.turns)

    def append_environment(self, ids: Sequence[int]) -> None:
        """The environment's answer to the turn just finished (``turns`` already counts it): it
        shares that turn's index, the record's rule (``megarl.experience.origins``)."""
        self.rendered.append(tuple(int(t) for t in ids))
        self._append(ids, ENVIRONMENT, None, None, self.turns - 1)


def audit(traj: Trajectory) -> List[str]:
    """The per-sample contract of a trajectory; returns the violations (empty when it holds).

    Policy tokens are exactly the engine's sampled ids and raw log-probs, turn by turn, each with
    the version that generated it; environment tokens are exactly what was rendered, with no
    version and log-prob 0; every token was generated or rendered (nothing else entered)."""
    bad = []
    pos = 0
    g = r = 0
    n = len(traj.response_ids)
    if not (len(traj.source) == len(traj.turn) == len(traj.token_versions) == len(traj.raw_log_probs) == n):
        return [f"{traj.request_id}/{traj.candidate_index}: per-token lists disagree with the {n} tokens"]
    while pos < n:
        if traj.source[pos] == POLICY:
            res = traj.generated[g]
            k = len(res.response_ids)
            if tuple(traj.response_ids[pos:pos + k]) != tuple(res.response_ids):
                bad.append(f"turn {traj.turn[pos]}: sampled ids differ from the engine's")
            if set(traj.source[pos:pos + k]) != {POLICY} or set(traj.token_versions[pos:pos + k]) != {res.policy_version}:
                bad.append(f"turn {traj.turn[pos]}: policy tokens without the generating version")
            if not torch.equal(torch.tensor(traj.raw_log_probs[pos:pos + k], dtype=torch.float32),
                               res.raw_log_probs.float()):
                bad.append(f"turn {traj.turn[pos]}: log-probs differ from the engine's")
            g += 1
        else:
            ids = traj.rendered[r]
            k = len(ids)
            if tuple(traj.response_ids[pos:pos + k]) != ids or set(traj.source[pos:pos + k]) != {ENVIRONMENT}:
                bad.append(f"turn {traj.turn[pos]}: environment tokens differ from the rendered ones")
            if any(v is not None for v in traj.token_versions[pos:pos + k]) or any(traj.raw_log_probs[pos:pos + k]):
                bad.append(f"turn {traj.turn[pos]}: environment tokens carry a policy version or log-prob")
            r += 1
        pos += max(k, 1)
    if g != len(traj.generated) or r != len(traj.rendered):
        bad.append("tokens and the generated / rendered segments do not line up")
    return [f"{traj.request_id}/{traj.candidate_index}: {b}" for b in bad]


def run_agent_rollouts(engine, prompts: Sequence[GenerationRequest | Tuple[str, Tuple[int, ...]]],
                       rows: Optional[Sequence[Mapping[str, Any]]], env_factory: Callable[[], Any], renderer,
                       sampling: SamplingParams, limits: AgentLimits, *, decode: Callable[[Sequence[int]], str],
                       step_timeout_s: float, max_workers: int,
                       encode_prompt: Optional[Callable[[Sequence], List[int]]] = None,
                       prompt_messages: Optional[Sequence[Optional[Sequence]]] = None,
                       between_turns: Optional[Callable[[], None]] = None) -> List[Trajectory]:
    """The trajectories of every candidate of ``prompts``: requests (their ``candidate_indices``
    of ``sampling.n``, their ``attempt``) or ``(request_id, prompt_ids)`` pairs (all ``n``).
    ``rows[i]`` is the environment's row of prompt i (ground truth and task data); None takes
    each request's ``task``.

    ``decode`` turns a policy turn's ids into the action text the environment reads.  An
    environment whose ``reset`` returns messages has them appended to the prompt's messages
    (``prompt_messages[i]``) and the prompt encoded once with ``encode_prompt``; a text prompt
    cannot take them.  Returns the trajectories in (prompt, candidate) order.

    ``between_turns``: called before every turn but the first, while no policy turn is being
    generated (split placement's in-flight weight update: a version published meanwhile becomes
    the served one).  A trajectory then spans versions: each policy token keeps the version that
    sampled it (``Trajectory.token_versions``), and the next turn is a new prefill of the exact
    token list so far under the new weights -- no KV of an older version is attended to."""
    from megarl.envs.runner import EnvironmentPool

    if limits.max_turns < 1 or limits.max_total_tokens < 1:
        raise ValueError(f"agent limits must be >= 1, got {limits}")
    reqs = [p if isinstance(p, GenerationRequest) else GenerationRequest(p[0], tuple(p[1])) for p in prompts]
    trajs, env_rows, prompt_of = _new_trajectories(reqs, rows, sampling)
    position = {id(t): j for j, t in enumerate(trajs)}  # a trajectory's environment in the pool
    pool = EnvironmentPool(env_factory, step_timeout_s=step_timeout_s, max_workers=max_workers)
    try:
        _reset(pool, trajs, env_rows, prompt_of, prompt_messages, encode_prompt)
        stops = tuple(sorted(set(sampling.stop_token_ids) | set(renderer.assistant_end_ids)))
        first_turn = True
        while True:
            active = [t for t in trajs if not t.done]
            if not active:
                break
            if between_turns is not None and not first_turn:
                between_turns()
            first_turn = False
            results = _policy_turn(engine, active, sampling, stops, limits)
            stepping: List[Trajectory] = []
            for t in active:
                res = results.get(id(t))
                if res is None or res.finish_reason is FinishReason.ABORT:
                    # the engine gave the turn up (a deadline, a weight update): the whole
                    # candidate is regenerated from its request (same seeds), never continued
                    t.finish_reason = FinishReason.ABORT
                    continue
                t.append_policy_turn(res)
                if res.finish_reason is FinishReason.LENGTH:
                    # the turn was cut by its token limit: no complete action for the environment
                    t.finish_reason = FinishReason.LENGTH
                else:
                    stepping.append(t)
            if not stepping:
                continue
            outs = pool.step([position[id(t)] for t in stepping],
                             [decode(t.generated[-1].response_ids) for t in stepping])
            for t, res in zip(stepping, outs, strict=True):
                _after_step(t, res, renderer, limits)
    finally:
        pool.close()
    return trajs


def _new_trajectories(reqs: Sequence[GenerationRequest], rows, sampling: SamplingParams):
    """``(trajectories, environment rows, prompt index of each)``: one trajectory per candidate,
    in (prompt, candidate) order."""
    trajs: List[Trajectory] = []
    env_rows: List[Mapping[str, Any]] = []
    prompt_of: List[int] = []  # the prompt index of each trajectory
    for i, q in enumerate(reqs):
        row = q.task if rows is None else rows[i]
        if row is None:
            raise ValueError(f"{q.request_id}: an agent session needs the environment's row (GenerationRequest.task)")
        for c in q.candidates(sampling.n):
            trajs.append(Trajectory(q.request_id, c, q.prompt_ids, attempt=q.attempt))
            env_rows.append(row)
            prompt_of.append(i)
    return trajs, env_rows, prompt_of


def _reset(pool, trajs, env_rows, prompt_of, prompt_messages, encode_prompt) -> None:
    """Reset every trajectory's environment; messages a reset returns are appended to the
    prompt's messages and the prompt re-encoded (a text prompt cannot take them)."""
    from megarl.envs.runner import EnvStatus

    for j, res in enumerate(pool.reset(env_rows)):
        t = trajs[j]
        if res.status is not EnvStatus.OK:
            _fail(t, res.status.value, res.error)
            continue
        extra = tuple(res.outcome.observation) if res.outcome is not None else ()
        if extra:
            i = prompt_of[j]
            msgs = None if prompt_messages is None else prompt_messages[i]
            if msgs is None or encode_prompt is None:
                raise ValueError(f"{t.request_id}: the environment's reset returned messages, but the prompt is "
                                 "plain text (no messages to append them to)")
            t.prompt_ids = tuple(encode_prompt(list(msgs) + [{"role": m.role, "content": m.content}
                                                             for m in extra]))


def _policy_turn(engine, active: List[Trajectory], sampling: SamplingParams, stops, limits: AgentLimits
                 ) -> Dict[int, GenerationResult]:
    """One policy turn of every active trajectory, by ``id(trajectory)``; a trajectory the
    engine did not answer is absent.

    Seeds: turn t of candidate c of request r samples from ``candidate_seed(seed,
    f"{r}/c{c}/t{t}", 0)`` (its own request id, candidate 0), so a trajectory does not depend on
    what else is in the batch."""
    budget = {id(t): limits.max_total_tokens - len(t.response_ids) for t in active}
    # one engine call per distinct per-turn limit (a trajectory near its budget samples less)
    by_limit: Dict[int, List[Trajectory]] = {}
    for t in active:
        by_limit.setdefault(min(sampling.max_new_tokens, budget[id(t)]), []).append(t)
    results: Dict[int, GenerationResult] = {}
    for cap, group in sorted(by_limit.items()):
        sp = SamplingParams(temperature=sampling.temperature, top_p=sampling.top_p, top_k=sampling.top_k,
                            max_new_tokens=cap, stop_token_ids=stops, n=1, seed=sampling.seed)
        turn_reqs = [GenerationRequest(f"{t.request_id}/c{t.candidate_index}/t{t.turns}",
                                       t.prompt_ids + tuple(t.response_ids)) for t in group]
        # keyed by id: an engine may answer out of order, twice, or not at all
        got = {r.request_id: r for r in engine.generate(turn_reqs, sp) if r.candidate_index == 0}
        for t, q in zip(group, turn_reqs, strict=True):
            if q.request_id in got:
                results[id(t)] = got[q.request_id]
    return results


def _after_step(t: Trajectory, res, renderer, limits: AgentLimits) -> None:
    """Apply one environment step's result to ``t``: its rewards and tool calls, then either an
    end (terminated, truncated, out of turns or tokens, a failure) or the rendered observation."""
    from megarl.envs.render import EnvRenderError
    from megarl.envs.runner import EnvStatus

    t.step_latency_s.append(float(res.latency_s))
    if res.status is not EnvStatus.OK:
        _fail(t, res.status.value, res.error)
        return
    out = res.outcome
    t.turn_rewards.append({k: float(v) for k, v in dict(out.reward_components).items()})
    for k, v in dict(out.reward_components).items():
        t.reward_components[k] = t.reward_components.get(k, 0.0) + float(v)
    # the environment's own count when it gives one (a tool may answer in a user message)
    info = dict(out.info or {})
    t.tool_calls += int(info["tool_calls"]) if "tool_calls" in info else \
        sum(1 for m in out.observation if m.role == "tool")
    if out.terminated:
        t.finish_reason = FinishReason.ENVIRONMENT
        t.turns += 1
        return
    if out.truncated:
        t.finish_reason = FinishReason.ENV_TRUNCATED
        t.turns += 1
        return
    t.turns += 1
    if t.turns >= limits.max_turns:
        t.finish_reason = FinishReason.MAX_TURNS
        return
    try:
        ids = renderer.render(out.observation)
    except EnvRenderError as e:  # text that would encode as a control token
        _fail(t, "invalid", str(e))
        return
    if len(t.response_ids) + len(ids) >= limits.max_total_tokens:
        t.finish_reason = FinishReason.LENGTH  # no room for the observation and a reply
        return
    t.append_environment(ids)


def _fail(t: Trajectory, status: str, error: Optional[str]) -> None:
    """An environment failure ends the trajectory as a status (the scorer reports it as a failed
    sample, never a reward; the group rule applies)."""
    t.env_status = status
    t.env_error = error
    t.finish_reason = FinishReason.ENV_TRUNCATED


def agent_metrics(trajs: Sequence[Trajectory], prefix: str = "rollout/agent") -> Dict[str, float]:
    """Turns and tool calls per trajectory, environment errors / timeouts, the share of
    environment tokens, per-step latency, and the finish reasons."""
    n = max(len(trajs), 1)
    toks = sum(len(t.response_ids) for t in trajs)
    env_toks = sum(t.source.count(ENVIRONMENT) for t in trajs)
    lat = sorted(x for t in trajs for x in t.step_latency_s)
    m = {f"{prefix}/turns_mean": sum(t.policy_turns for t in trajs) / n,
         f"{prefix}/tool_calls_mean": sum(t.tool_calls for t in trajs) / n,
         f"{prefix}/tool_call_rate": sum(1 for t in trajs if t.tool_calls) / n,
         f"{prefix}/env_errors": float(sum(1 for t in trajs if t.env_status == "error")),
         f"{prefix}/env_timeouts": float(sum(1 for t in trajs if t.env_status == "timeout")),
         f"{prefix}/env_invalid": float(sum(1 for t in trajs if t.env_status == "invalid")),
         f"{prefix}/env_token_share": env_toks / max(toks, 1)}
    if lat:
        m[f"{prefix}/step_latency_p50_s"] = lat[len(lat) // 2]
        m[f"{prefix}/step_latency_max_s"] = lat[-1]
    for reason in {t.finish_reason for t in trajs if t.finish_reason is not None}:
        m[f"{prefix}/finish/{reason.value}"] = sum(1 for t in trajs if t.finish_reason is reason) / n
    return m


def episode_result(t: Trajectory, served: str = "") -> GenerationResult:
    """A finished trajectory as the engine-level result of its candidate: the whole token list
    after the prompt as ``response_ids`` (raw log-probs 0.0 on environment tokens), the last
    policy token's version (``served``, the version the engine serves, for one that never took
    a turn: its environment failed at reset), the first turn's seed, the engine's preemptions
    summed over its turns, and the trajectory itself as ``episode``."""
    version = t.policy_version or served
    first = t.generated[0] if t.generated else None
    pre = [g.preemptions for g in t.generated if g.preemptions is not None]
    return GenerationResult(request_id=t.request_id, candidate_index=t.candidate_index, prompt_ids=t.prompt_ids,
                            response_ids=tuple(t.response_ids), finish_reason=t.finish_reason,
                            raw_log_probs=t.log_probs_tensor(), processed_log_probs=None,
                            policy_version=version if version is not None else "",
                            seed=first.seed if first is not None else None, attempt=t.attempt, episode=t,
                            preemptions=sum(pre) if pre else None)


class AgentSessionEngine(EngineWrapper):
    """A rollout engine whose candidates are whole multi-turn sessions.

    ``generate(requests, sampling)`` runs :func:`run_agent_rollouts` over the wrapped engine
    (each request's ``task`` is its environment's row) and answers one
    :class:`~megarl.rollout.protocol.GenerationResult` per candidate (:func:`episode_result`),
    so everything that drives an engine -- placement over inference groups, regeneration of lost
    candidates by sample id, the group buffer, the evaluation loop -- drives agents unchanged.
    A candidate the engine aborted (or never answered) in any turn is answered ``abort`` with no
    tokens: it is regenerated from its request, with the same per-turn seeds.  Weight loading and
    the other engine calls go to the wrapped engine (:attr:`engine`; :class:`~megarl.rollout.protocol.EngineWrapper`).
    """

    def __init__(self, engine, *, env_factory: Callable[[], Any], renderer, limits: AgentLimits,
                 decode: Callable[[Sequence[int]], str], step_timeout_s: float, max_workers: int,
                 encode_prompt: Optional[Callable[[Sequence], List[int]]] = None):
        super().__init__(engine)
        self.engine, self.env_factory, self.renderer, self.limits = engine, env_factory, renderer, limits
        self.decode, self.step_timeout_s, self.max_workers = decode, step_timeout_s, max_workers
        self.encode_prompt = encode_prompt

    def generate(self, requests: Sequence[GenerationRequest], sampling: SamplingParams,
                 between_turns: Optional[Callable[[], None]] = None) -> List[GenerationResult]:
        """``between_turns``: :func:`run_agent_rollouts`' (in-flight weight updates between turns)."""
        messages = [q.task.get("messages") if q.task is not None else None for q in requests]
        trajs = run_agent_rollouts(self.engine, list(requests), None, self.env_factory, self.renderer, sampling,
                                   self.limits, decode=self.decode, step_timeout_s=self.step_timeout_s,
                                   max_workers=self.max_workers, encode_prompt=self.encode_prompt,
                                   prompt_messages=messages, between_turns=between_turns)
        active = self.engine.active_version
        served = active.short_id if active is not None else ""
        out = []
        for t in trajs:
            if t.finish_reason is FinishReason.ABORT:
                out.append(GenerationResult(request_id=t.request_id, candidate_index=t.candidate_index,
                                            prompt_ids=t.prompt_ids, response_ids=(), finish_reason=FinishReason.ABORT,
                                            raw_log_probs=torch.zeros(0), processed_log_probs=None,
                                            policy_version=t.policy_version or served, attempt=t.attempt))
            else:
                out.append(episode_result(t, served))
        return out
