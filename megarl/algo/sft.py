"""A supervised cross-entropy term mixed into the RL update (``algo.sft: {path, coef}``).

Demonstration rows (x_j, y_j) are drawn from their own dataset; each optimizer step's loss is

    L = L_RL + c * (1 / N_sft) * sum_j sum_t -log pi(y_jt | x_j, y_j<t)

with ``N_sft`` the number of demonstration response tokens in that step over every rank: its own
normaliser, independent of the RL term's aggregation mode, so the weight ``c`` means the same
whatever the RL batch holds.  This is prime-rl's separately normalised ``ce`` component beside
``rl`` and ``kl``, and NeMo-RL's ``positive_example_nll_weight`` taken from a demonstration set
rather than from the rollout (also InstructGPT's PPO-ptx: Ouyang et al. 2022, arXiv:2203.02155,
eq. 2, with pretraining text in place of demonstrations).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["SFTLossOutput", "sft_nll_loss"]


@dataclass
class SFTLossOutput:
    loss: torch.Tensor
    metrics: dict[str, float]


def sft_nll_loss(log_probs: torch.Tensor, loss_mask: torch.Tensor, coef: float, tokens: int) -> SFTLossOutput:
    """One micro-batch's share of the SFT term: ``c * sum(-m * log pi) / N_sft``.

    Args:
        log_probs: ``(b, R)`` log pi of each demonstration response token under the current weights.
        loss_mask: ``(b, R)`` 1 on the demonstration's response tokens (0 on padding and on rows
            that only even out the ranks).
        coef: c >= 0.
        tokens: N_sft, the step's demonstration response tokens over every rank (> 0).
    Returns:
        the loss share and ``sft_nll`` (this micro-batch's share of the step's mean NLL per
        token: the shares of a step add up to it).
    """
    if log_probs.shape != loss_mask.shape:
        raise ValueError(f"sft_nll_loss: log_probs {tuple(log_probs.shape)} and loss_mask {tuple(loss_mask.shape)} differ")
    if not tokens > 0:
        raise ValueError(f"sft_nll_loss: the step's demonstration token count must be > 0, got {tokens}")
    if coef < 0:
        raise ValueError(f"sft_nll_loss: coef must be >= 0, got {coef}")
    m = loss_mask.to(log_probs.dtype)
    nll = -(log_probs * m).sum() / tokens
    return SFTLossOutput(loss=coef * nll, metrics={"sft_nll": float(nll.detach())})
