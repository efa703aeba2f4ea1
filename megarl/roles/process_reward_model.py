"""A process reward model (``reward.models`` entry of ``kind: process``): the reward model role
(:class:`~megarl.roles.reward_model.RewardModel`) read once per step -- at each step's end in
its own rendering -- with each score placed on the actor token that ends the step
(:mod:`megarl.data.step_map`), so ``grpo_process`` trains on it as on a rule's steps.

The record's step scores are the model's (steps that end on one actor token merge into their
lowest score); its component, and its share of the total, is the steps' aggregate
(``step_aggregate``: min, mean or last).  A rendering the steps cannot be mapped through (the
template rewrites the response) is status invalid naming why; a forward that failed is error.
"""

from __future__ import annotations

from collections import Counter

from megarl.data.scorer_input import render_with_offsets
from megarl.data.step_map import prm_read_positions, step_char_ends
from megarl.experience.schema import RewardRecord, RewardStatus
from megarl.rewards.rules import step_token_ends
from megarl.roles.reward_model import add_component, input_digest
from megarl.runtime.data_parallel import gather_objects

AGGREGATES = {"min": min, "mean": lambda xs: sum(xs) / len(xs), "last": lambda xs: xs[-1]}


def _plan(rm, settings, x):
    """``(ids, PRM positions, step char ends)`` of one sample, or a string saying why not."""
    ids, text, offsets = render_with_offsets(rm.contract, x.messages, x.prompt_text, x.response_text, rm.prompt,
                                             x.ground_truth, key=f"{rm.key}.prompt")
    if ids != rm.encode(x.messages, x.prompt_text, x.response_text, x.ground_truth):
        return ids, "its tokenizer does not give the same ids for the text with offsets"
    ends = step_char_ends(x.response_text, settings.step_separator)
    if not ends:  # an empty response: its one step is its end
        ends = [len(x.response_text)]
    try:
        return ids, (prm_read_positions(text, offsets, x.response_text, ends), ends)
    except ValueError as e:
        return ids, str(e)


def add_process_scores(rs, records, key: str, settings, rm, counters: Counter):
    """One process reward model's step scores added to each ok record (collective: every rank
    renders the same samples and runs its share of the forward)."""
    plans = [_plan(rm, settings, x) for x in rs]
    rows = [ids for ids, _ in plans]
    ok = [i for i, (_, p) in enumerate(plans) if not isinstance(p, str)]
    error = None
    try:
        scores = rm.step_scores([rows[i] for i in ok], [plans[i][1][0] for i in ok]) if ok else []
    except Exception as e:  # noqa: BLE001 -- a status for every sample, below
        scores, error = None, f"{type(e).__name__}: {e}"
    failed = [(rank, err) for rank, err in enumerate(gather_objects(error)) if err is not None]
    by_row = dict(zip(ok, scores or [], strict=False))
    which = f"process reward model {settings.name!r} ({key})"
    merged = []
    for i, x in enumerate(rs):
        base = records[i] if records is not None else None
        if base is not None and base.status is not RewardStatus.OK:
            merged.append(base)
            continue
        inputs = {**(base.inputs if base is not None else {}), settings.name: input_digest(rows[i])}
        plan = plans[i][1]
        if failed or isinstance(plan, str):
            status = RewardStatus.ERROR if failed else RewardStatus.INVALID
            why = (f"{which}'s forward failed on rank {failed[0][0]}: {failed[0][1]}" if failed
                   else f"{which}: {plan}")
            counters[f"process_reward_model_{status.value}"] += 1
            merged.append(RewardRecord(total=None, scorer_version=rm.version, status=status, error=why, inputs=inputs))
            continue
        ends = step_token_ends(plan[1], list(x.response_char_ends))
        steps: dict = {}
        for end, s in zip(ends, by_row[i].tolist(), strict=True):
            steps[end] = min(steps.get(end, s), s)
        placed = sorted(steps.items())
        values = [s for _, s in placed]
        agg = float(AGGREGATES[settings.step_aggregate](values))
        merged.append(add_component(base, settings.name, agg, settings.weight, rm.version, inputs,
                                    step_rewards=tuple(values), step_token_ends=tuple(e for e, _ in placed)))
    return merged
