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


def bradley_terry_loss(chosen: torch.Tensor, rejected: torch.Tensor,
                       normaliser: float) -> Tuple[torch.Tensor, Dict[str, float]]:
    """``sum_i -log sigma(s_c,i - s_r,i) / normaliser`` over this share of the pairs.

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
    loss = terms.sum() / normaliser
    d = margin.detach()
    return loss, {"pairs": float(d.numel()), "correct": float((d > 0).sum()), "margin_sum": float(d.sum()),
                  "loss_sum": float(terms.detach().sum())}


def pair_accuracy(chosen: torch.Tensor, rejected: torch.Tensor) -> float:
    """The share of pairs whose chosen answer scores strictly higher (a tie counts as wrong)."""
    return float((chosen.float() > rejected.float()).float().mean()) if chosen.numel() else float("nan")
