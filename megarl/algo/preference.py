"""The Bradley-Terry objective of a reward model trained on preference pairs.

Bradley & Terry (1952) model the chance that answer ``c`` is preferred to ``r`` as
``sigma(s(c) - s(r))`` for a scalar score ``s``; the reward model is the ``s`` that maximises the
likelihood of the observed preferences (Ouyang et al. 2022, InstructGPT, eq. 1; Stiennon et al.
2020).  Pure tensor math, rank-agnostic: the caller gives each rank's pairs and the global count.
"""

from __future__ import annotations

from typing import Dict, Tuple

import torch
import torch.nn.functional as F


def bradley_terry_loss(chosen: torch.Tensor, rejected: torch.Tensor, normaliser: float,
                       center_coef: float = 0.0) -> Tuple[torch.Tensor, Dict[str, float]]:
    """``sum_i [-log sigma(s_c,i - s_r,i) + center_coef (s_c,i + s_r,i)^2] / normaliser`` over this
    share of the pairs.

    The likelihood fixes only score differences within a pair, so each prompt's scores may sit at
    an offset of their own: a right answer to one prompt can score below a wrong one to another.
    A policy trained against such scores without a per-prompt baseline (PPO's critic must learn
    it) is rewarded by the offsets.  ``center_coef > 0`` adds the reward-centering term of
    Eisenstein et al. 2023 ("Helping or Herding?", TRL's ``center_rewards_coefficient``): each
    pair's mean score is pulled to 0, so across prompts the preferred answers score above 0 and
    the others below.

    ``chosen`` / ``rejected``: ``(n,)`` scores of the same ``n`` pairs; ``normaliser``: the number
    of pairs in the global batch (all micro-batches, all DP ranks), so summing the shares over
    micro-batches and ranks gives the batch mean whatever the split (the loss contract of
    :mod:`megarl.models.optim`).  Metrics are this share's sums, for the caller to reduce:
    ``pairs``, ``correct`` (``s_c > s_r``), ``margin_sum`` and ``loss_sum``.
    """
    if chosen.shape != rejected.shape or chosen.dim() != 1:
        raise ValueError(f"bradley_terry_loss: chosen {list(chosen.shape)} and rejected {list(rejected.shape)} "
                         "must be two (n,) vectors")
    margin = chosen.float() - rejected.float()
    terms = -F.logsigmoid(margin)
    if center_coef:
        terms = terms + center_coef * (chosen.float() + rejected.float()) ** 2
    loss = terms.sum() / normaliser
    d = margin.detach()
    return loss, {"pairs": float(d.numel()), "correct": float((d > 0).sum()), "margin_sum": float(d.sum()),
                  "loss_sum": float(terms.detach().sum())}


def pair_accuracy(chosen: torch.Tensor, rejected: torch.Tensor) -> float:
    """The share of pairs whose chosen answer scores strictly higher (a tie counts as wrong)."""
    return float((chosen.float() > rejected.float()).float().mean()) if chosen.numel() else float("nan")
