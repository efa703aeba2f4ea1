"""Evaluation on held-out prompts during training (the export is :mod:`megarl.control.export`).

The evaluation decodes greedily on the version the engines serve and scores with the training
scorer, through the loop that ``python -m megarl.eval`` runs (:mod:`megarl.evaluation`): the
accuracy is over the scored prompts, and a prompt whose generation was lost after every retry
or whose scorer failed is counted as unscored, never as wrong.
"""

from __future__ import annotations

import json
import math
import os
import time
from typing import Dict, Optional


from megarl.control.interfaces import RunProgress, SampleScorer
from megarl.control.placement import Placement
from megarl.control.candidates import evaluate_prompts
from megarl.evaluation.estimators import accuracy_metrics, episode_metrics, per_source_metrics, result_row
from megarl.rollout.protocol import SamplingParams
from megarl.versions import PolicyVersion


class Evaluator:
    """Args: ``eval_cfg`` the ``eval`` section; ``heldout`` the held-out prompts (or None:
    evaluation is off); ``default_max_new_tokens`` when ``eval.max_new_tokens`` is unset;
    ``max_retries`` regenerations of a lost result; ``progress`` receives the last accuracy and
    what went unscored; ``results_dir`` (rank 0, ``eval.save_results``) receives
    ``iter_<k>.jsonl`` per evaluation, with responses decoded by ``decode``."""

    def __init__(self, eval_cfg, heldout, *, engine, placement: Placement, scorer: SampleScorer,
                 progress: RunProgress, run_id: str, default_max_new_tokens: int, max_retries: int,
                 results_dir: Optional[str] = None, decode=None):
        self.cfg, self.heldout, self.engine, self.placement, self.scorer = eval_cfg, heldout, engine, placement, scorer
        self.progress, self.run_id = progress, run_id
        self.default_max_new_tokens, self.max_retries = default_max_new_tokens, max_retries
        self.results_dir, self.decode = results_dir, decode

    @property
    def enabled(self) -> bool:
        return self.heldout is not None

    def due(self, k: int) -> bool:
        """Whether the periodic evaluation runs before iteration ``k``'s rollout: before the first
        update with ``eval.before_train``, then every ``eval.every`` iterations (0: none until
        the final evaluation)."""
        if not self.enabled:
            return False
        if k == 0:
            return bool(self.cfg.before_train)
        return bool(self.cfg.every) and k % self.cfg.every == 0

    def evaluate(self, k: int, version: PolicyVersion) -> Dict[str, float]:
        """Greedy decoding of the held-out prompts on the version the engines serve; accuracy
        over the scored prompts (megarl/evaluation/estimators.py)."""
        if self.heldout is None:
            return {}
        e = self.cfg
        recs = list(self.heldout.records[: e.n])
        greedy = SamplingParams(temperature=0.0, max_new_tokens=e.max_new_tokens or self.default_max_new_tokens, n=1)
        t0 = time.perf_counter()
        decode = None
        if self.results_dir is not None and self.decode is not None:
            decode = lambda ids: self.decode(ids, skip_special_tokens=True)  # noqa: E731
        outcomes = evaluate_prompts(recs, [f"{self.run_id}/eval{k}/{i:04d}" for i in range(len(recs))],
                                    engine=self.engine, placement=self.placement, scorer=self.scorer, sampling=greedy,
                                    max_retries=self.max_retries, counters=self.progress.counters, decode=decode,
                                    source_field=e.source_field)
        m = accuracy_metrics(outcomes, e.success_threshold)
        m.update(per_source_metrics(outcomes, lambda ps, prefix: accuracy_metrics(ps, e.success_threshold, prefix)))
        m.update(episode_metrics(outcomes, e.success_threshold))  # agent episodes: turns, tool calls
        acc = m["eval/accuracy"]
        self.progress.last_eval = None if math.isnan(acc) else acc
        self.progress.last_eval_unscored = (len(recs) - m["eval/scored"], len(recs))
        m.update({"eval/policy_version_step": version.optimizer_step, "eval/seconds": time.perf_counter() - t0})
        dropped = self.heldout.stats.get("dropped_missing_fields")
        if dropped:  # data.on_missing_fields=skip dropped held-out rows the reward could not score
            m["eval/dropped_missing_fields"] = dropped
        if self.results_dir is not None:
            os.makedirs(self.results_dir, exist_ok=True)
            with open(os.path.join(self.results_dir, f"iter_{k}.jsonl"), "w") as f:
                for p in outcomes:
                    f.write(json.dumps(result_row(p, e.success_threshold, iteration=k,
                                                  policy_version=version.short_id)) + "\n")
        return m
