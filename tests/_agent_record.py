"""The multi-turn golden record of the experience tests: three trajectories with environment
tokens between policy turns (tests/unit/experience/test_agent_record.py,
test_reward_placement.py), and the inspection tool loaded from its file."""

from __future__ import annotations

import importlib.util
import os

import torch

from megarl.control.batch import collate_trajectories
from megarl.experience.schema import ExperienceFacts, FinishReason, LogProbProducer, LogProbs, RewardRecord, SamplingConfig
from tests._dist import ROOT

# three trajectories after their prompts.  A: policy turn 0 (v1), two environment tokens, turn 1
# (v1), one environment token, turn 2 (v2: the weights changed between turns), ended by the
# environment.  B: two turns on v2, stopped at max_turns.  C: a single policy turn on v2.
PROMPTS = [[5, 6], [7, 8], [9]]
RESPONSES = [[10, 20, 21, 11, 22, 12], [13, 23, 14, 15], [16, 17]]
SOURCES = [[1, 2, 2, 1, 2, 1], [1, 2, 1, 1], [1, 1]]
TURNS = [[0, 0, 0, 1, 1, 2], [0, 0, 1, 1], [0, 0]]
VERSIONS = [["v1", None, None, "v1", None, "v2"], ["v2", None, "v2", "v2"], ["v2", "v2"]]
LOG_PROBS = [[-0.5, 0.0, 0.0, -0.25, 0.0, -0.125], [-1.0, 0.0, -0.75, -2.0], [-0.5, -1.5]]
FINISH = (FinishReason.ENVIRONMENT, FinishReason.MAX_TURNS, FinishReason.EOS)
SIDS = ("r/it1/p0/c00", "r/it1/p0/c01", "r/it1/p0/c02")


def trajectories(**over) -> "object":
    kw = dict(prompts=PROMPTS, responses=RESPONSES, raw_log_probs=[torch.tensor(x) for x in LOG_PROBS],
              sources=SOURCES, turns=TURNS, token_versions=VERSIONS, pad_id=0)
    kw.update(over)
    return collate_trajectories(**kw)


def agent_facts(c=None, **over) -> ExperienceFacts:
    c = trajectories() if c is None else c
    bs = c.prompt_ids.shape[0]
    kw = dict(
        run_id="r", iteration=1, prompt_id=("p0",) * bs, group_id=("r/it1/p0",) * bs, sample_id=SIDS[:bs],
        prompt_ids=c.prompt_ids, response_ids=c.response_ids, attention_mask=c.attention_mask,
        response_mask=c.response_mask, finish_reason=FINISH[:bs], policy_version=("v2",) * bs,
        sampling=SamplingConfig(max_new_tokens=4, n=bs), request_id=tuple(f"q{i}" for i in range(bs)),
        seed=tuple(range(bs)), rewards=tuple(RewardRecord(total=float(i), scorer_version="calc-1") for i in range(bs)),
        rollout_log_probs=LogProbs(c.rollout_log_probs, LogProbProducer("rollout", "v2")),
        token_origins=c.token_origins)
    kw.update(over)
    return ExperienceFacts(**kw)


def inspect_module():
    path = os.path.join(ROOT, "tools", "inspect_experience.py")
    spec = importlib.util.spec_from_file_location("inspect_experience_tool", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod
