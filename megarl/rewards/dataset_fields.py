"""Datasets checked against the reward at start-up: every train / held-out row must carry the
ground-truth fields the reward reads.

A held-out file whose rows carry ``target`` where the reward reads ``answer`` would otherwise
evaluate as a model that is always wrong (every score ``invalid``), and such a training file
would train on, quietly dropping the groups.  :func:`check_datasets_against_reward` reads the
rows -- through :func:`megarl.data.prompts.iter_rows`, the reader of
:func:`~megarl.data.prompts.load_prompt_dataset`, before any tokenizer or model loads -- and,
with ``data.on_missing_fields=error`` (the default), refuses the first bad row, naming the
config key, the row (``file:line`` for JSONL and ``file:row`` for Parquet, both 1-based;
``name[split]#index`` for a ``datasets`` source) and the field.  With ``skip`` the bad rows are
counted and printed, and :func:`drop_rows_missing_fields` drops them from the loaded dataset
(counted in its ``stats["dropped_missing_fields"]``).

What a reward reads comes from ``reward.required_fields`` when set, else from the reward's own
declaration (:mod:`megarl.rewards.declarations`) and the fields a reference-guided scorer's prompt
names (``reward.models[i].prompt``, ``reward.judges[i].prompt``: ``{answer}``); a reward model
without one reads none.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from typing import List, Mapping, Optional, Tuple

from megarl.data.prompts import PromptDatasetError, configured_sources, iter_rows, source_kind

__all__ = ["FieldCheck", "configured_reward", "reward_requirements", "first_missing", "check_file", "check_datasets_against_reward",
           "drop_rows_missing_fields"]

_CACHE: dict = {}


def configured_reward(cfg):
    """The reward function ``reward.fn`` names, built once per process and spec (start-up builds
    it to fail fast on a bad ``reward.*``, and reads its field declaration from the same object)."""
    r = cfg.reward
    key = json.dumps([r.fn, dict(r.kwargs or {}), list(r.components or [])], sort_keys=True, default=str)
    if key not in _CACHE:
        from megarl.rewards import build_reward_function

        _CACHE[key] = build_reward_function(r.fn, r.kwargs, r.components)
    return _CACHE[key]


def reward_requirements(cfg) -> Tuple[tuple, str]:
    """``(requirements, what)``: the fields the configured reward reads, and a phrase naming
    where that came from (for the error text): ``reward.required_fields``, else ``reward.fn``'s
    declaration; and, either way, the ground-truth fields each reference-guided reward model's or
    judge's prompt names."""
    r = cfg.reward
    requirements, what = (), []
    if r.required_fields is not None:
        from megarl.rewards.declarations import normalise_requirements

        requirements = normalise_requirements(list(r.required_fields), "reward.required_fields")
        what = ["reward.required_fields"]
    elif r.fn:
        from megarl.rewards.declarations import required_fields

        requirements, what = tuple(required_fields(configured_reward(cfg)) or ()), [f"reward.fn {r.fn!r}"]
    from megarl.rewards.verdicts import template_ground_truth_fields

    templates = [(f"{key}.prompt", template_ground_truth_fields(m.prompt, own=("prompt",)))
                 for key, m in r.neural_models() if m.prompt]
    templates += [(f"reward.judges[{i}].prompt", template_ground_truth_fields(j.prompt)) for i, j in enumerate(r.judges)]
    for key, fields in templates:
        reads = [f for f in fields if f not in requirements]
        if reads:
            requirements += tuple(reads)
            what.append(key)
    if not what:
        return (), "the reward model(s) (read no fields)"
    return requirements, " and ".join(what)


def first_missing(ground_truth: Mapping, requirements) -> Optional[object]:
    """The first requirement ``ground_truth`` does not meet (a field absent or null), or None."""
    for req in requirements:
        names = (req,) if isinstance(req, str) else req
        if not any(ground_truth.get(n) is not None for n in names):
            return req
    return None


@dataclass
class FieldCheck:
    """What :func:`check_file` found: rows read, and the bad rows (``where``, requirement) in order."""

    path: str
    rows: int = 0
    bad: List[Tuple[str, object]] = field(default_factory=list)


def check_file(path: str, requirements, *, reserved=(), key: str = "data", what: str = "the reward",
               on_missing: str = "error", split: Optional[str] = None, subset: Optional[str] = None) -> FieldCheck:
    """Check every row of the prompt source ``path`` (read by :func:`megarl.data.prompts.iter_rows`,
    the loader's own reader; ``split`` / ``subset`` for ``datasets`` sources), minus the
    ``reserved`` prompt / messages / id fields: the rest is the reward's ``ground_truth``.
    ``on_missing="error"`` raises PromptDatasetError at the first bad row; ``"skip"`` collects
    them all."""
    out = FieldCheck(path)
    if not requirements:
        return out
    from megarl.rewards.declarations import describe_requirement

    reserved = set(reserved)
    try:
        for where, row in iter_rows(path, split=split, subset=subset):
            out.rows += 1
            gt = {k: v for k, v in row.items() if k not in reserved}
            req = first_missing(gt, requirements)
            if req is None:
                continue
            if on_missing == "error":
                raise PromptDatasetError(
                    f"{key}: {where}: the row has no {describe_requirement(req)} field, which {what} reads; "
                    f"its fields: {sorted(gt)} (fix the file, point the reward at the right field, e.g. "
                    f"reward.kwargs.answer_key, or set data.on_missing_fields=skip to drop such rows)")
            out.bad.append((where, req))
    except OSError as e:
        raise PromptDatasetError(f"{key}: prompt file {path} cannot be read: {e}") from None
    return out


def _reserved(d) -> tuple:
    return (d.prompt_field, d.messages_field, d.id_field)


def _exists(path: str) -> bool:
    try:
        source_kind(path)
        return True
    except PromptDatasetError:  # missing / unknown: the loader's own checks say so, with their key
        return False


def check_datasets_against_reward(cfg, sources: Optional[List[tuple]] = None) -> dict:
    """Start-up: check ``data.train_path`` and ``data.heldout_path`` (or the ``(key, path, split,
    subset)`` sources given) against the reward; returns ``{key: rows that would be skipped}``.
    A source that does not exist is left to the existence checks."""
    d = cfg.data
    requirements, what = reward_requirements(cfg)
    if sources is None:
        sources = configured_sources(d)
    skipped = {}
    for key, path, split, subset in sources:
        if path is None or not requirements or not _exists(path):
            continue
        found = check_file(path, requirements, reserved=_reserved(d), key=key, what=what,
                           on_missing=d.on_missing_fields, split=split, subset=subset)
        if found.bad:
            from megarl.rewards.declarations import describe_requirement

            where, req = found.bad[0]
            print(f"{key}: {len(found.bad)} of {found.rows} rows lack a field {what} reads "
                  f"(first: {where}, {describe_requirement(req)}); data.on_missing_fields=skip drops them",
                  flush=True)
        skipped[key] = len(found.bad)
    return skipped


def drop_rows_missing_fields(cfg, dataset):
    """``dataset`` without the records whose ground truth lacks a field the reward reads, under
    ``data.on_missing_fields=skip`` (counted in ``stats["dropped_missing_fields"]``); unchanged
    (the very object) otherwise or when nothing is dropped.  None stays None."""
    if dataset is None or cfg.data.on_missing_fields != "skip":
        return dataset
    requirements, _ = reward_requirements(cfg)
    kept = tuple(r for r in dataset.records if first_missing(r.ground_truth, requirements) is None)
    dropped = len(dataset.records) - len(kept)
    if not dropped:
        return dataset
    if not kept:
        raise PromptDatasetError(
            f"prompt file {dataset.stats.get('path')}: every prompt lacks a field the reward reads "
            f"(data.on_missing_fields=skip dropped all {dropped})")
    return replace(dataset, records=kept, stats=dict(dataset.stats, kept=len(kept), dropped_missing_fields=dropped))
