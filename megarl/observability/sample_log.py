"""Sample generations in the logs: a small table of the sealed batch every few iterations.

Every ``trainer.log_samples_every`` iterations (0, K, 2K, ...; 0 = off) rank 0 takes
``trainer.log_samples_n`` rows of that iteration's sealed batch -- the first sample of n groups
spread evenly over the batch (:func:`pick_rows`; no random draw, so the training's RNG streams
are untouched) -- and writes them

* to ``<run_dir>/samples.jsonl``, one JSON object per row (keys in :data:`COLUMNS` and
  ``reward_components`` as an object);
* to every tracker that has tables (a ``wandb.Table`` under ``samples``; an mlflow JSON artifact
  ``samples/iter_<k>.json``), at ``step = iteration``;
* and ``trainer.log_samples_console`` of them as one short line each to the console.

A row: the prompt and response text (decoded without special tokens, as the reward function
saw them; an agent trajectory with its environment output between ``<< >>``), the reward total, components and status, the finish reason, the advantage and the
policy version that generated it.  The advantage is one number per sample: the mean of the
derived advantages over the sample's response tokens -- for group estimators (GRPO, RLOO, ...)
that is the sample's advantage itself (it is the same on every token); for GAE it is the mean of
the per-token advantages (after whitening when ``algo.whiten_advantages``).
"""

from __future__ import annotations

import json
import os
import sys
from typing import Dict, List, Optional, Sequence

COLUMNS = ["iteration", "sample_id", "policy_version", "prompt", "response", "reward", "reward_components",
           "reward_status", "finish_reason", "advantage", "response_tokens"]


def pick_rows(group_ids: Sequence[str], n: int) -> List[int]:
    """``n`` (at most the batch size) row indices: the first sample of ``n`` groups spread evenly
    over the batch's groups (groups ``i * groups // n``); with more rows than groups, the groups'
    first samples, then their second ones, and so on.  Deterministic: no random draw."""
    groups: Dict[str, List[int]] = {}
    for row, g in enumerate(group_ids):
        groups.setdefault(g, []).append(row)
    members = list(groups.values())
    if n <= len(members):
        return [members[i * len(members) // n][0] for i in range(n)]
    rows = [m[j] for j in range(max(map(len, members))) for m in members if j < len(m)]
    return rows[:n]


def sample_rows(batch, tok, rows: List[int]) -> List[dict]:
    """The rows of one sealed batch (facts and derived advantages) as dicts keyed by :data:`COLUMNS`."""
    f, d = batch.facts, batch.derived
    P = f.prompt_len
    out = []
    for b in rows:
        prompt = f.prompt_ids[b][f.attention_mask[b, :P] != 0].tolist()
        keep = f.response_mask[b] != 0
        response = f.response_ids[b][keep].tolist()
        adv = float(d.advantages[b][keep].double().mean()) if keep.any() and d is not None else None
        r = f.rewards[b]
        text = (tok.decode(response, skip_special_tokens=True) if f.token_origins is None
                else _trajectory_text(tok, f.response_ids[b], f.token_origins.source[b]))
        out.append({
            "iteration": f.iteration, "sample_id": f.sample_id[b], "policy_version": f.policy_version[b],
            "prompt": tok.decode(prompt, skip_special_tokens=True),
            "response": text,
            "reward": r.total, "reward_components": dict(r.components), "reward_status": r.status.value,
            "finish_reason": f.finish_reason[b].value, "advantage": adv, "response_tokens": len(response)})
    return out


def _trajectory_text(tok, response_ids, source) -> str:
    """A multi-turn trajectory as text: the policy's turns as decoded, each stretch of
    environment output between them in ``<< >>`` (``[ 1 2 + 3 4 ] << 4 6 >> 4 6``)."""
    parts, run, kind = [], [], None
    for t, s in zip(response_ids.tolist(), source.tolist(), strict=True):
        if s == 0:
            break
        if s != kind and run:
            parts.append((kind, run))
            run = []
        kind = s
        run.append(t)
    if run:
        parts.append((kind, run))
    out = []
    for kind, ids in parts:
        text = tok.decode(ids, skip_special_tokens=True).strip()
        out.append(f"<< {text} >>" if kind == 2 else text)
    return " ".join(out)


def _short(text: str, width: int) -> str:
    text = " ".join(text.split())
    return text if len(text) <= width else text[:width - 3] + "..."


def console_line(row: dict) -> str:
    reward = "-" if row["reward"] is None else f"{row['reward']:.3f}"
    adv = "-" if row["advantage"] is None else f"{row['advantage']:+.3f}"
    short_id = "/".join(row["sample_id"].split("/")[-2:])  # <prompt>/<candidate> of <run>/it<k>/r<round>/...
    return (f"sample it{row['iteration']} {short_id} | reward {reward} ({row['reward_status']}) adv {adv} | "
            f"{row['finish_reason']} | {_short(row['prompt'], 60)!r} -> {_short(row['response'], 60)!r}")


class SampleLogger:
    """Rank 0 logs (``enabled``); ``metrics`` is the run's :class:`~megarl.observability.metrics.MetricsWriter`
    (its trackers get the tables).  ``resumed_at``: rows of iterations from there on (they run
    again) are dropped from ``samples.jsonl``, as ``metrics.jsonl`` drops theirs."""

    def __init__(self, trainer_cfg, run_dir: str, tok, metrics, enabled: bool, resumed_at: Optional[int] = None):
        self.every, self.n, self.console = (trainer_cfg.log_samples_every, trainer_cfg.log_samples_n,
                                            trainer_cfg.log_samples_console)
        self.tok, self.metrics = tok, metrics
        self.enabled = enabled and self.every > 0
        self.path = os.path.join(run_dir, "samples.jsonl")
        if self.enabled and resumed_at is not None and os.path.isfile(self.path):
            with open(self.path) as fh:
                kept = [line for line in fh if line.strip() and json.loads(line)["iteration"] < resumed_at]
            with open(self.path + ".tmp", "w") as fh:
                fh.writelines(kept)
            os.replace(self.path + ".tmp", self.path)

    def due(self, k: int) -> bool:
        return self.enabled and k % self.every == 0

    def log(self, k: int, batch) -> Optional[List[dict]]:
        """Iteration k's table, if it is due; returns its rows."""
        if not self.due(k):
            return None
        rows = sample_rows(batch, self.tok, pick_rows(batch.facts.group_id, self.n))
        with open(self.path, "a") as fh:
            for row in rows:
                fh.write(json.dumps(row) + "\n")
        table = [[json.dumps(r[c]) if c == "reward_components" else r[c] for c in COLUMNS] for r in rows]
        self.metrics.log_table(k, COLUMNS, table)
        if self.console:
            from tqdm import tqdm

            for row in rows[:self.console]:
                tqdm.write(console_line(row), file=sys.stdout)  # above the progress bar when there is one
            sys.stdout.flush()
        return rows
