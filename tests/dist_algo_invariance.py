"""Ragged random batches for the algorithm tests, and the DP=2 half of the invariance test.

As a library (imported by tests/test_algo_*.py): :func:`ragged_batch` and :func:`run_actor_loss`.
As a script under ``python -m torch.distributed.run --nproc-per-node 2 tests/dist_algo_invariance.py IN OUT``
(gloo): every rank takes an uneven shard of the global batch saved in IN, splits it into
micro-batches, counts the normaliser over the DP group, and writes its loss contribution
(all-reduced) and the gradients of its rows to OUT/rank{r}.pt.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from megarl.algo.aggregation import GlobalNormaliser, global_normaliser
from megarl.algo.kl import KLConfig
from megarl.algo.objective import actor_loss
from megarl.algo.policy_loss import PolicyLossConfig
from megarl.experience.schema import LogProbProducer, LogProbs

ACTOR = LogProbProducer(role="actor", version="v7", space="raw")
REFERENCE = LogProbProducer(role="reference", version="ref0", space="raw")
ROLLOUT = LogProbProducer(role="rollout", version="v7", space="raw")


def ragged_batch(seed: int, bs: int = 7, prompt_len: int = 5, response_len: int = 9, holes: bool = True, dtype=torch.float64) -> dict:
    """A random batch in the experience layout with ragged prompts and responses.

    Row 0 fills the response width (a truncation at max length), row 1 has a one-token response;
    with ``holes`` some rows have non-action tokens (tool output) inside the response.
    """
    g = torch.Generator().manual_seed(seed)
    P, R = prompt_len, response_len
    plen = torch.randint(1, P + 1, (bs,), generator=g)
    rlen = torch.randint(1, R + 1, (bs,), generator=g)
    rlen[0] = R
    if bs > 1:
        rlen[1] = 1
    attn = torch.zeros(bs, P + R, dtype=torch.int64)
    rmask = torch.zeros(bs, R, dtype=torch.int64)
    for b in range(bs):
        attn[b, P - int(plen[b]) : P + int(rlen[b])] = 1
        rmask[b, : int(rlen[b])] = 1
        if holes and b % 3 == 2 and rlen[b] >= 4:
            rmask[b, 1 : 1 + int(torch.randint(1, int(rlen[b]) - 2, (1,), generator=g))] = 0  # tool tokens
    terminated = torch.rand(bs, generator=g) < 0.5
    terminated[0] = False  # hit the length limit
    n_groups = max(bs // 3, 1)
    group_index = torch.arange(bs) % n_groups
    rnd = lambda *s: torch.randn(*s, generator=g, dtype=dtype)  # noqa: E731
    cur = -torch.rand(bs, R, generator=g, dtype=dtype) * 3
    return {
        "attention_mask": attn,
        "response_mask": rmask,
        "prompt_len": P,
        "terminated": terminated,
        "group_index": group_index,
        "scores": rnd(bs),
        "token_rewards": torch.where(rmask != 0, rnd(bs, R) * 0.3, torch.zeros((), dtype=dtype)),
        "values": rnd(bs, R),
        "bootstrap_values": rnd(bs),
        "log_probs": cur,
        "old_log_probs": cur + rnd(bs, R) * 0.3,
        "ref_log_probs": cur + rnd(bs, R) * 0.5,
        "rollout_log_probs": cur + rnd(bs, R) * 0.05,
        "advantages": rnd(bs, R),
        "entropy": torch.rand(bs, R, generator=g, dtype=dtype) * 2,
        "full_log_probs": -torch.rand(bs, P + R, generator=g, dtype=dtype) * 3,
    }


LOSS_CASES = [
    (name, mode)
    for name in ("vanilla", "gspo")
    for mode in ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")
]


def case_config(name: str, mode: str) -> PolicyLossConfig:
    return PolicyLossConfig(
        name=name,
        agg_mode=mode,
        clip_low=0.2,
        clip_high=0.28,
        dual_clip=3.0,
        entropy_coef=0.01,
        kl=KLConfig(placement="loss", estimator="k3", beta=0.05),
    )


def norm_constant(mode: str, batch: dict) -> float | None:
    return float(batch["response_mask"].shape[1]) if mode == "seq-mean-token-sum-norm" else None


def run_actor_loss(batch: dict, rows: slice, log_probs: torch.Tensor, cfg: PolicyLossConfig, normaliser: GlobalNormaliser, width: int | None = None) -> torch.Tensor:
    """Actor loss of the rows ``rows`` of ``batch`` with current log-probs ``log_probs`` (bs_mb, R);
    ``width`` re-pads the micro-batch to a narrower response width (its own longest response)."""
    R = width or batch["response_mask"].shape[1]
    t = lambda k: batch[k][rows, :R]  # noqa: E731
    return actor_loss(
        log_probs[:, :R],
        old_log_probs=LogProbs(t("old_log_probs"), ACTOR),
        advantages=t("advantages"),
        loss_mask=t("response_mask"),
        cfg=cfg,
        normaliser=normaliser,
        ref_log_probs=LogProbs(t("ref_log_probs"), REFERENCE),
        entropy=t("entropy"),
    ).loss


def _main(inp: str, out: str) -> None:
    import torch.distributed as dist

    from megarl.algo.advantages import AdvantageConfig, AdvantageInputs, reinforce_plus_plus_advantage

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    batch = torch.load(inp)
    bs = batch["response_mask"].shape[0]
    cut = [0, 2, bs] if world == 2 else [bs * r // world for r in range(world + 1)]  # uneven shards
    mine = slice(cut[rank], cut[rank + 1])
    n_local = cut[rank + 1] - cut[rank]
    micro = [slice(mine.start + a, mine.start + b) for a, b in ((0, n_local // 2), (n_local // 2, n_local)) if b > a]
    result = {"rows": (mine.start, mine.stop), "loss": {}, "grad": {}}
    for name, mode in LOSS_CASES:
        cfg = case_config(name, mode)
        norm = global_normaliser(
            [batch["response_mask"][m] for m in micro], mode, norm_constant=norm_constant(mode, batch), dp_group=dist.group.WORLD
        )
        lp = batch["log_probs"][mine].clone().requires_grad_(True)
        total = torch.zeros((), dtype=lp.dtype)
        for m in micro:
            loc = slice(m.start - mine.start, m.stop - mine.start)
            loss = run_actor_loss(batch, m, lp[loc], cfg, norm)
            loss.backward()
            total = total + loss.detach()
        dist.all_reduce(total, op=dist.ReduceOp.SUM)
        result["loss"][(name, mode)] = total
        result["grad"][(name, mode)] = lp.grad.clone()
    rpp = reinforce_plus_plus_advantage(
        AdvantageInputs(response_mask=batch["response_mask"][mine], token_rewards=batch["token_rewards"][mine]),
        AdvantageConfig(gamma=0.97),
        process_group=dist.group.WORLD,
    )
    result["reinforce_plus_plus"] = rpp.advantages
    torch.save(result, Path(out) / f"rank{rank}.pt")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    _main(sys.argv[1], sys.argv[2])
