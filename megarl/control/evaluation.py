"""Evaluation on held-out prompts, and export of the actor as a HuggingFace checkpoint.

The evaluation decodes greedily on the version the engines serve and scores with the training
scorer; a prompt whose generation was lost after every retry counts as wrong.  The export is
what a user loads elsewhere: the actor's weights in HF layout with its tokenizer and chat
template; ``export/iter_0`` is the starting policy, the last one the final policy.
"""

from __future__ import annotations

import os
import time
from collections import Counter
from typing import Dict, List

import torch.distributed as dist

from megarl.control.interfaces import RunProgress, Sample, SampleScorer
from megarl.control.placement import Placement, generate_everywhere
from megarl.experience.schema import RewardStatus
from megarl.rollout.protocol import GenerationRequest, SamplingParams
from megarl.versions import PolicyVersion


class Evaluator:
    """Args: ``eval_cfg`` the ``eval`` section; ``heldout`` the held-out prompts (or None:
    evaluation is off); ``default_max_new_tokens`` when ``eval.max_new_tokens`` is unset;
    ``max_retries`` regenerations of a lost result; ``progress`` receives the last accuracy."""

    def __init__(self, eval_cfg, heldout, *, engine, placement: Placement, scorer: SampleScorer,
                 progress: RunProgress, run_id: str, default_max_new_tokens: int, max_retries: int):
        self.cfg, self.heldout, self.engine, self.placement, self.scorer = eval_cfg, heldout, engine, placement, scorer
        self.progress, self.run_id = progress, run_id
        self.default_max_new_tokens, self.max_retries = default_max_new_tokens, max_retries

    @property
    def enabled(self) -> bool:
        return self.heldout is not None

    def due(self, k: int) -> bool:
        """Whether the periodic evaluation runs before iteration ``k``'s rollout."""
        return self.enabled and bool(self.cfg.every) and k % self.cfg.every == 0

    def evaluate(self, k: int, version: PolicyVersion) -> Dict[str, float]:
        """Greedy decoding of the held-out prompts on the version the engines serve."""
        if self.heldout is None:
            return {}
        e = self.cfg
        recs = list(self.heldout.records[: e.n])
        requests = [GenerationRequest(f"{self.run_id}/eval{k}/{i:04d}", tuple(r.prompt_ids)) for i, r in enumerate(recs)]
        greedy = SamplingParams(temperature=0.0, max_new_tokens=e.max_new_tokens or self.default_max_new_tokens, n=1)
        t0 = time.perf_counter()
        by_req = self._generate_each(requests, greedy)
        samples = [Sample(prompt_id=rec.prompt_id, group_id=req.request_id, sample_id=req.request_id,
                          request_id=req.request_id, prompt_ids=req.prompt_ids,
                          response_ids=by_req[req.request_id].response_ids,
                          raw_log_probs=by_req[req.request_id].raw_log_probs,
                          finish_reason=by_req[req.request_id].finish_reason,
                          policy_version=by_req[req.request_id].policy_version, seed=None, prompt=rec)
                   for rec, req in zip(recs, requests) if req.request_id in by_req]
        self.scorer.score(samples)
        ok = [s for s in samples if s.record.status is RewardStatus.OK]
        succ = sum(1 for s in ok if s.record.total >= e.success_threshold)
        acc = succ / len(recs)  # a prompt without an answer (lost after every retry) counts as wrong
        self.progress.last_eval = acc
        return {"eval/accuracy": acc, "eval/n": len(recs), "eval/generation_failures": len(recs) - len(samples),
                "eval/reward_mean": sum(s.record.total for s in ok) / max(len(ok), 1),
                "eval/scorer_failures": len(samples) - len(ok),
                "eval/response_len_mean": sum(len(s.response_ids) for s in samples) / max(len(samples), 1),
                "eval/policy_version_step": version.optimizer_step,
                "eval/seconds": time.perf_counter() - t0}

    def _generate_each(self, requests: List[GenerationRequest], sampling: SamplingParams) -> Dict[str, object]:
        """One result per request (n=1), regenerating lost ones up to ``rollout.max_retries``
        times; extra deliveries (duplicates, late results) are counted and ignored."""
        counters: Counter = self.progress.counters
        out: Dict[str, object] = {}
        todo = list(requests)
        for attempt in range(self.max_retries + 1):
            if not todo:
                break
            wanted = {q.request_id for q in todo}
            for r in generate_everywhere(self.engine, self.placement, todo, sampling):
                if r.request_id in wanted and r.attempt == attempt and r.request_id not in out:
                    out[r.request_id] = r
                else:
                    counters["results_ignored"] += 1
            lost = [q for q in todo if q.request_id not in out]
            counters["candidates_lost"] += len(lost)
            todo = [GenerationRequest(q.request_id, q.prompt_ids, attempt=attempt + 1) for q in lost]
        return out


class Exporter:
    """Writes ``<export_root>/iter_<k>``: the actor as an HF checkpoint with the tokenizer and
    chat template of the run's tokenizer contract (collective; rank 0 writes)."""

    def __init__(self, export_root: str, actor, tok, rank0: bool):
        self.export_root, self.actor, self.tok, self.rank0 = export_root, actor, tok, rank0

    def path(self, k: int) -> str:
        return os.path.join(self.export_root, f"iter_{k}")

    def export(self, k: int) -> str:
        out = self.path(k)
        self.actor.onload()
        self.actor.export(out)
        if self.rank0:
            tok = self.tok.tokenizer
            if self.tok.chat_template is not None:
                tok.chat_template = self.tok.chat_template
            tok.save_pretrained(out)
        if dist.is_initialized():
            dist.barrier()
        return out
