"""The experience layout built from generation results: left-padded prompts, right-padded
responses, their masks and the rollout log-probs, against a row-by-row construction."""

import pytest
import torch

from megarl.control.batch import collate


def test_collate_matches_row_by_row_layout():
    g = torch.Generator().manual_seed(0)
    prompts = [[5, 6, 7], [8], [9, 10, 11, 12], [13, 14]]
    responses = [[1, 2], [], [3, 4, 5, 6, 7], [2]]
    lps = [-torch.rand(len(r), generator=g, dtype=torch.float64) for r in responses]
    c = collate(prompts, responses, lps, pad_id=0)
    P, R = 4, 5
    for b, (p, r, l) in enumerate(zip(prompts, responses, lps)):
        assert c.prompt_ids[b].tolist() == [0] * (P - len(p)) + p
        assert c.response_ids[b].tolist() == r + [0] * (R - len(r))
        assert c.attention_mask[b].tolist() == [0] * (P - len(p)) + [1] * (len(p) + len(r)) + [0] * (R - len(r))
        assert c.response_mask[b].tolist() == [1] * len(r) + [0] * (R - len(r))
        assert c.rollout_log_probs[b, :len(r)].tolist() == l.float().tolist()
        assert not c.rollout_log_probs[b, len(r):].any()
    assert c.rollout_log_probs.dtype == torch.float32 and c.prompt_ids.dtype == torch.long


def test_collate_all_empty_responses_and_mismatched_log_probs():
    c = collate([[1, 2], [3]], [[], []], [torch.zeros(0), torch.zeros(0)], pad_id=7)
    assert c.response_ids.tolist() == [[7], [7]] and not c.response_mask.any()
    assert c.attention_mask.tolist() == [[1, 1, 0], [0, 1, 0]]
    with pytest.raises(ValueError, match="row 1 has 2 response tokens but 1 rollout log-probs"):
        collate([[1], [2]], [[3], [4, 5]], [torch.zeros(1), torch.zeros(1)], pad_id=0)


@pytest.mark.parametrize("dp,mbs", [(1, 4), (2, 4), (2, 0), (3, 0)])
def test_mini_batch_plans_keep_groups_whole_and_pad_to_equal_micro_batches(dp, mbs):
    """Whole groups per mini-batch, every row once, padded (loss-masked repeats) to a multiple of
    dp x micro_batch_size -- of dp alone when micro_batch_size is 0 (one micro-batch per rank)."""
    from megarl.control.batch import plan_mini_batches

    groups = [f"g{i // 3}" for i in range(7 * 3)] + ["g7", "g7"]  # 7 groups of 3, one partial of 2
    plans = plan_mini_batches(groups, 2, dp, mbs, torch.Generator().manual_seed(0))
    seen = torch.cat([p.rows for p in plans]).sort().values
    assert seen.tolist() == list(range(len(groups)))
    for p in plans:
        for g in {groups[i] for i in p.rows.tolist()}:  # groups are not split: all members are here
            assert sum(groups[i] == g for i in p.rows.tolist()) == groups.count(g)
        assert p.padded.numel() % (dp * max(mbs, 1)) == 0 and p.padded.numel() - p.rows.numel() < dp * max(mbs, 1)
        assert int(p.is_pad.sum()) == p.padded.numel() - p.rows.numel()
        shards = [p.rank_rows(r, dp)[0] for r in range(dp)]
        assert len({s.numel() for s in shards}) == 1
