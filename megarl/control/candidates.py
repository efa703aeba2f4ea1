"""Candidates: which results count for which candidate (:func:`join_results`, the join the
training rollout and the evaluation both regenerate lost candidates from), and the evaluation
loop: prompts -> generations (lost candidates regenerated) -> scores -> outcomes.

The evaluation loop is one code path for the held-out evaluation during training and for ``python -m megarl.eval``:
requests go through :func:`megarl.control.placement.generate_everywhere` (collective under
torch.distributed; a plain call in one process), the samples are scored by the run's scorer
(:class:`megarl.control.interfaces.SampleScorer`), and each candidate becomes a
:class:`~megarl.evaluation.estimators.Candidate` with its status.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Sequence, Tuple

from megarl.control.interfaces import Sample, SampleScorer
from megarl.control.placement import Placement, generate_everywhere
from megarl.evaluation.estimators import LOST, Candidate, PromptOutcome
from megarl.experience.groups import candidate_of, candidate_sample_id
from megarl.experience.schema import RewardStatus
from megarl.rollout.protocol import GenerationRequest, GenerationResult, SamplingParams

__all__ = ["Join", "join_results", "generate_candidates", "evaluate_prompts"]


@dataclass
class Join:
    """One generation call's results against the candidates it asked for (``requests``): the
    join both the training rollout and the evaluation regenerate from.

    fresh: the first result of each asked (candidate, attempt) that ``accept`` takes, in delivery order;
    extra: every other result -- a duplicate, a late result of an older attempt, a result of a
        request not asked for in this call (an earlier iteration's, an evaluation's), or one
        ``accept`` refused;
    lost: ``(sample id, attempt, request)`` for each asked candidate nothing answered, in request
        and candidate order."""

    fresh: List[GenerationResult] = field(default_factory=list)
    extra: List[GenerationResult] = field(default_factory=list)
    lost: List[Tuple[str, int, GenerationRequest]] = field(default_factory=list)


def join_results(requests: Sequence[GenerationRequest], results: Sequence[GenerationResult], n: int,
                 accept: Optional[Callable[[GenerationResult], bool]] = None) -> Join:
    """Match ``results`` to the candidates of ``requests`` (``n`` per request unless it names
    its candidates) by sample id and attempt: the join is idempotent, a candidate counts once."""
    expected = {(candidate_sample_id(q.request_id, c), q.attempt): q for q in requests for c in q.candidates(n)}
    out, seen = Join(), set()
    for r in results:
        key = (candidate_sample_id(r.request_id, r.candidate_index), r.attempt)
        if key in expected and key not in seen and (accept is None or accept(r)):
            seen.add(key)
            out.fresh.append(r)
        else:
            out.extra.append(r)
    out.lost = [(sid, attempt, q) for (sid, attempt), q in expected.items() if (sid, attempt) not in seen]
    return out


def generate_candidates(engine, placement: Placement, requests: Sequence[GenerationRequest], sampling: SamplingParams,
                        max_retries: int, counters: Counter) -> Dict[Tuple[str, int], GenerationResult]:
    """One result per (request, candidate), regenerating lost candidates (same request id, so
    the same per-candidate seeds) up to ``max_retries`` times; extra deliveries (duplicates,
    late results, foreign ids) are counted in ``results_ignored`` and dropped, candidates still
    missing after an attempt in ``candidates_lost``."""
    n = sampling.n
    out: Dict[Tuple[str, int], GenerationResult] = {}
    todo = list(requests)
    for _attempt in range(max_retries + 1):
        if not todo:
            break
        join = join_results(todo, generate_everywhere(engine, placement, todo, sampling), n)
        for r in join.fresh:
            out[(r.request_id, r.candidate_index)] = r
        counters["results_ignored"] += len(join.extra)
        counters["candidates_lost"] += len(join.lost)
        lost_by_request: Dict[str, List[int]] = {}
        for sid, _, q in join.lost:
            lost_by_request.setdefault(q.request_id, []).append(candidate_of(sid))
        retry = []
        for q in todo:
            lost = tuple(lost_by_request.get(q.request_id, ()))
            if lost:
                # the whole request again when every candidate is missing, else only the lost ones
                idx = q.candidate_indices if len(lost) == len(q.candidates(n)) else lost
                retry.append(GenerationRequest(q.request_id, q.prompt_ids, candidate_indices=idx, attempt=q.attempt + 1,
                                               task=q.task))
        todo = retry
    return out


def _prompt_of(rec) -> object:
    return rec.text if rec.text is not None else [dict(m) for m in rec.messages]


def evaluate_prompts(records: Sequence, request_ids: Sequence[str], *, engine, placement: Placement,
                     scorer: SampleScorer, sampling: SamplingParams, max_retries: int, counters: Counter,
                     decode: Optional[Callable[[Sequence[int]], str]] = None,
                     source_field: Optional[str] = None) -> List[PromptOutcome]:
    """Generate ``sampling.n`` candidates for each prompt record, score them, and return one
    :class:`PromptOutcome` per record (in order).  ``decode`` (the tokenizer contract's decode,
    special tokens skipped) fills the response texts of the outcomes; ``source_field`` names the
    ground-truth field that gives a prompt's source."""
    requests = [GenerationRequest(rid, tuple(r.prompt_ids), task=r.task())
                for r, rid in zip(records, request_ids, strict=True)]
    got = generate_candidates(engine, placement, requests, sampling, max_retries, counters)
    samples: List[Sample] = []
    for rec, req in zip(records, requests, strict=True):
        for c in range(sampling.n):
            r = got.get((req.request_id, c))
            if r is None:
                continue
            # n=1 keeps the request id as the sample id (what training's evaluation always used)
            sid = req.request_id if sampling.n == 1 else candidate_sample_id(req.request_id, c)
            samples.append(Sample(prompt_id=rec.prompt_id, group_id=req.request_id, sample_id=sid,
                                  request_id=req.request_id, prompt_ids=req.prompt_ids, response_ids=r.response_ids,
                                  raw_log_probs=r.raw_log_probs, finish_reason=r.finish_reason,
                                  policy_version=r.policy_version, seed=r.seed, prompt=rec, episode=r.episode))
    scorer.score(samples)
    scored = {(s.request_id, s.sample_id): s for s in samples}
    outcomes = []
    for i, (rec, req) in enumerate(zip(records, requests, strict=True)):
        cands = []
        for c in range(sampling.n):
            sid = req.request_id if sampling.n == 1 else candidate_sample_id(req.request_id, c)
            s = scored.get((req.request_id, sid))
            if s is None:
                cands.append(Candidate(index=c, status=LOST))
                continue
            rec_ = s.record
            ok = rec_.status is RewardStatus.OK
            cands.append(Candidate(index=c, status=rec_.status.value, reward=rec_.total if ok else None,
                                   response_text=None if decode is None else decode(s.response_ids),
                                   response_len=len(s.response_ids), finish_reason=s.finish_reason.value,
                                   error=rec_.error, components=dict(rec_.components),
                                   turns=None if s.episode is None else s.episode.policy_turns,
                                   tool_calls=None if s.episode is None else s.episode.tool_calls))
        source = rec.ground_truth.get(source_field) if source_field else None
        outcomes.append(PromptOutcome(index=i, prompt_id=rec.prompt_id, prompt=_prompt_of(rec), source=source,
                                      candidates=cands))
    return outcomes
