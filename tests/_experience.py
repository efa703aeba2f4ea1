"""A golden experience record for the experience tests: a ragged batch of six samples (two
groups of three) with every log-prob producer, values and reward records."""

from __future__ import annotations

import torch

from megarl.experience.schema import ExperienceFacts, FinishReason, LogProbs, RewardRecord, SamplingConfig
from tests.dist_algo_invariance import ACTOR, REFERENCE, ROLLOUT, ragged_batch


def make_facts(seed=0, bs=6, **over) -> ExperienceFacts:
    b = ragged_batch(seed, bs=bs, dtype=torch.float32)
    P = b["prompt_len"]
    R = b["response_mask"].shape[1]
    g = torch.Generator().manual_seed(seed)
    prompt_ids = torch.randint(3, 100, (bs, P), generator=g) * b["attention_mask"][:, :P]
    response_ids = torch.randint(3, 100, (bs, R), generator=g) * b["attention_mask"][:, P:]
    kw = dict(
        run_id="runA",
        iteration=42,
        prompt_id=tuple(f"p{i // 3}" for i in range(bs)),
        group_id=tuple(f"runA/step42/p{i // 3}" for i in range(bs)),
        sample_id=tuple(f"runA/step42/p{i // 3}/candidate{i % 3:02d}" for i in range(bs)),
        prompt_ids=prompt_ids,
        response_ids=response_ids,
        attention_mask=b["attention_mask"],
        response_mask=b["response_mask"],
        finish_reason=tuple(FinishReason.LENGTH if i == 0 else FinishReason.EOS for i in range(bs)),
        policy_version=("v7",) * bs,
        sampling=SamplingConfig(temperature=0.8, max_new_tokens=R, n=3),
        request_id=tuple(f"req{i}" for i in range(bs)),
        seed=tuple(range(bs)),
        rewards=tuple(
            RewardRecord(total=float(i), components={"correctness": float(i)}, scorer_version="rm-1") for i in range(bs)
        ),
        rollout_log_probs=LogProbs(b["rollout_log_probs"], ROLLOUT),
        old_log_probs=LogProbs(b["old_log_probs"], ACTOR),
        ref_log_probs=LogProbs(b["ref_log_probs"], REFERENCE),
        values=b["values"],
        critic_version="critic-3",
    )
    kw.update(over)
    return ExperienceFacts(**kw)
