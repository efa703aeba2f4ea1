"""The update's loss closures: what a trainable role minimises on one micro-batch's output.

Each builder returns megatron's per-micro-batch loss function ``loss_fn(output, mb) -> (loss share,
metrics)`` (:data:`megarl.models.optim.LossFn`): the model's output brought back to the micro-batch's
rows (:mod:`megarl.models.micro_batches`), the response positions picked out, and the objective of
:mod:`megarl.algo` applied under the step's global normaliser.  The learner
(:mod:`megarl.control.learning`) decides which rows and settings; the math is the algorithm core's.
"""

from __future__ import annotations

from typing import Optional

import torch

from megarl.algo.objective import actor_loss
from megarl.algo.policy_loss import PolicyLossConfig
from megarl.algo.sft import sft_nll_loss
from megarl.algo.value_loss import clipped_value_loss
from megarl.experience.schema import LogProbProducer, LogProbs
from megarl.models.forward import gather_response
from megarl.models.micro_batches import next_token_terms, token_terms


def policy_loss_fn(*, head, response_len: int, cfg: PolicyLossConfig, normaliser, kl_beta: float,
                   old_producer: LogProbProducer, ref_producer: Optional[LogProbProducer], kl_in_loss: bool,
                   entropy_grad: bool, old_version: str):
    """The actor's policy loss of one micro-batch from its logits (:func:`megarl.algo.objective.actor_loss`):
    the response tokens' log-probs and entropies under the current weights against the micro-batch's
    ``old_log_probs``, ``advantages``, ``loss_mask`` (and ``ref_log_probs`` when the KL is in the loss,
    ``is_weights`` under rollout correction).  ``entropy_grad``: the entropy bonus is trained
    (``algo.entropy_coef > 0``); otherwise the entropy is reported without a gradient.  ``head``:
    what the model's output is (:func:`megarl.models.fused_output.output_head`: logits, or the last
    hidden states under ``algo.log_prob_chunk``)."""
    R = response_len

    def loss_fn(output, mb):
        lp_all, ent_all = head.next_token_log_probs_and_entropy(output, mb, entropy_grad)
        lp = gather_response(lp_all, mb["prompt_lens"], mb["response_lens"], R)
        with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
            ent = gather_response(ent_all, mb["prompt_lens"], mb["response_lens"], R)
        out = actor_loss(
            lp, old_log_probs=LogProbs(mb["old_log_probs"], old_producer), advantages=mb["advantages"],
            loss_mask=mb["loss_mask"], cfg=cfg, normaliser=normaliser,
            ref_log_probs=LogProbs(mb["ref_log_probs"], ref_producer) if kl_in_loss else None,
            entropy=ent, is_weights=mb.get("is_weights"), old_version=old_version, kl_beta=kl_beta)
        return out.loss, out.metrics

    return loss_fn


def sft_loss_fn(*, head, coef: float, tokens: int):
    """The SFT term of one demonstration micro-batch (:func:`megarl.algo.sft.sft_nll_loss`): the
    log-probs of its ``loss_mask``'d response tokens, weighted ``coef`` and normalised by the step's
    demonstration ``tokens``; ``head`` as :func:`policy_loss_fn`'s."""

    def loss_fn(output, mb):
        lp_all = next_token_terms(output, mb, head.log_probs)
        lp = gather_response(lp_all, mb["prompt_lens"], mb["response_lens"], mb["loss_mask"].shape[1])
        out = sft_nll_loss(lp, mb["loss_mask"], coef, tokens)
        return out.loss, out.metrics

    return loss_fn


def with_sft(policy_loss, sft_loss):
    """One step's loss function over its RL micro-batches and its demonstration ones (marked
    ``megarl_sft``)."""

    def loss_fn(output, mb):
        return (sft_loss if mb.get("megarl_sft") else policy_loss)(output, mb)

    return loss_fn


def value_loss_fn(*, response_len: int, value_clip: float, agg_mode: str, normaliser):
    """The critic's clipped value loss of one micro-batch (:func:`megarl.algo.value_loss.clipped_value_loss`)
    from its scalar head, against the micro-batch's ``old_values`` and ``returns``."""

    def vloss(output, mb):
        vals = gather_response(token_terms(output[..., 0].float(), mb), mb["prompt_lens"], mb["response_lens"],
                               response_len)
        out = clipped_value_loss(vals, mb["old_values"], mb["returns"], mb["loss_mask"], value_clip, agg_mode,
                                 normaliser)
        return out.loss, {**out.metrics, "value_loss": float(out.loss.detach())}

    return vloss
