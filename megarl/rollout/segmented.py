"""Generation in segments, so that a newer policy version can take over a response mid-way.

``generate_in_segments(engine, requests, sampling, segment_tokens, between)`` generates every
candidate ``segment_tokens`` new tokens at a time; after each segment it calls ``between()``
(where the rollout rank of a split placement applies a version published meanwhile: an
in-flight weight update) and continues every unfinished candidate from its exact token list
(``prompt + response so far``, as token ids: nothing is re-tokenized).  The continuation is a
new prefill, so its KV is recomputed by the weights now active -- the engine flushed every cache
at activation -- and no state computed by an older version is ever attended to by a newer one.

Each token keeps the version the engine reported for the segment that sampled it
(``GenerationResult.token_versions``, set when a candidate spans versions); the result's
``policy_version`` is its last token's (the record's convention, as for an agent's turns) and
``token_versions[0]``, the oldest, is the version it started on, which decides its age.  Segment 0 is the
plain call with ``max_new_tokens`` cut to the segment, so with no version change in between the
result is the same token stream a whole-response call samples from (the continuations draw from
their own per-segment seeds).
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch

from megarl.rollout.protocol import FinishReason, GenerationRequest, GenerationResult, SamplingParams

__all__ = ["generate_in_segments", "segment_seed", "started_on"]


def started_on(result) -> str:
    """The version a result's generation started on: its first token's (``policy_version`` is
    its last's); an agent episode's first policy token's (its environment tokens have none)."""
    if result.token_versions:
        return result.token_versions[0]
    episode = result.episode
    if episode is not None:
        first = next((v for v in episode.token_versions if v is not None), None)
        if first is not None:
            return first
    return result.policy_version


def segment_seed(seed: int, segment: int) -> int:
    """The rollout seed of segment ``segment`` (0: ``seed`` itself, so segment 0 is the plain call)."""
    return seed if segment == 0 else (seed * 1_000_003 + 7919 * segment) & ((1 << 62) - 1)


class _Open:
    """One candidate being generated: what it has so far."""

    def __init__(self, first: GenerationResult, request: GenerationRequest):
        self.first, self.request = first, request
        self.ids: List[int] = list(first.response_ids)
        self.raw: List[torch.Tensor] = [first.raw_log_probs]
        self.processed: Optional[List[torch.Tensor]] = ([first.processed_log_probs]
                                                        if first.processed_log_probs is not None else None)
        self.versions: List[str] = [first.policy_version] * len(first.response_ids)
        self.finish = first.finish_reason
        self.preemptions = first.preemptions  # summed over segments where the engine reports them

    def extend(self, r: GenerationResult) -> None:
        self.ids.extend(r.response_ids)
        self.raw.append(r.raw_log_probs)
        if self.processed is not None and r.processed_log_probs is not None:
            self.processed.append(r.processed_log_probs)
        else:
            self.processed = None
        self.versions.extend([r.policy_version] * len(r.response_ids))
        self.finish = r.finish_reason
        if self.preemptions is not None and r.preemptions is not None:
            self.preemptions += r.preemptions

    def result(self) -> GenerationResult:
        mixed = len(set(self.versions)) > 1
        return dataclasses.replace(
            self.first, response_ids=tuple(self.ids), raw_log_probs=torch.cat(self.raw),
            processed_log_probs=None if self.processed is None else torch.cat(self.processed),
            finish_reason=self.finish, policy_version=self.versions[-1] if self.versions else self.first.policy_version,
            token_versions=tuple(self.versions) if mixed else None, preemptions=self.preemptions)


def generate_in_segments(engine, requests: Sequence[GenerationRequest], sampling: SamplingParams,
                         segment_tokens: int, between: Callable[[], None] = lambda: None) -> List[GenerationResult]:
    """The results of ``engine.generate(requests, sampling)``, generated ``segment_tokens`` new
    tokens at a time with ``between()`` called after every segment but the last (see the module
    docstring).  Results come back in the order of the first segment's."""
    if segment_tokens <= 0 or sampling.max_new_tokens <= segment_tokens:
        return engine.generate(requests, sampling)
    if sampling.return_routed_experts:
        raise ValueError("generate_in_segments: routing records of segmented responses are not built")
    budget = sampling.max_new_tokens
    first = engine.generate(requests, dataclasses.replace(sampling, max_new_tokens=segment_tokens))
    by_id = {q.request_id: q for q in requests}
    open_: Dict[Tuple[str, int], _Open] = {}
    order = []
    for r in first:
        key = (r.request_id, r.candidate_index)
        order.append(key)
        open_[key] = _Open(r, by_id[r.request_id])
    segment = 0
    while True:
        todo = [o for o in open_.values() if o.finish is FinishReason.LENGTH and len(o.ids) < budget]
        if not todo:
            break
        between()
        segment += 1
        # a request per candidate, under an id of its own (an engine call takes each id once);
        # the candidate's seed for this segment is derived from that id and the segment's seed
        cont = [GenerationRequest(f"{o.first.request_id}#c{o.first.candidate_index}",
                                  tuple(o.first.prompt_ids) + tuple(o.ids),
                                  candidate_indices=(o.first.candidate_index,), attempt=o.first.attempt,
                                  task=o.request.task) for o in todo]
        owner = {q.request_id: o for q, o in zip(cont, todo, strict=True)}
        # one call per remaining budget (most candidates share one; an engine call has one max_new_tokens)
        by_left: Dict[int, List[int]] = {}
        for i, o in enumerate(todo):
            by_left.setdefault(min(segment_tokens, budget - len(o.ids)), []).append(i)
        for left, idx in sorted(by_left.items()):
            params = dataclasses.replace(sampling, max_new_tokens=left, seed=segment_seed(sampling.seed, segment))
            for r in engine.generate([cont[i] for i in idx], params):
                owner[r.request_id].extend(r)
    return [open_[k].result() for k in order]
