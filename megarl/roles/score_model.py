"""A reward model in training: a megatron model with a scalar score head, trained on preference
pairs (:mod:`megarl.algo.preference`) and exported as the HF checkpoint ``reward.models`` reads.

It starts from a causal LM's trunk with a zero score head (HF ``*ForSequenceClassification``,
num_labels=1: every pair starts at margin 0), or from a reward model already, trained further in
its own head format.  The score is read where transformers reads it: the last non-pad token of
a sequence-classification head, the last token of a token-classification one.
"""

from __future__ import annotations

import dataclasses
from typing import Dict, List, Sequence

import torch

from megarl.algo.preference import bradley_terry_loss
from megarl.models.builder import build_model, build_model_chunks, virtual_stages
from megarl.models.hf_config import load_spec, sequence_score_positions
from megarl.models.megatron_ckpt import load_model
from megarl.models.micro_batches import token_terms
from megarl.models.optim import StepResult, train_step, wrap_for_training
from megarl.models.weights import export_hf, unwrap
from megarl.roles.common import copy_weights, lr_scheduler
from megarl.roles.reward_model import sequence_scores

HEADS = ("ForCausalLM", "ForSequenceClassification", "ForTokenClassification")


def score_head_spec(spec, pad_token_id: int):
    """``spec``'s trunk with a sequence-classification score head (no bias, untied), whose config
    names the pad id transformers needs to find each row's last token."""
    base = next((spec.architecture[:-len(h)] for h in HEADS if spec.architecture.endswith(h)), None)
    if base is None:
        from megarl.errors import ConfigError

        raise ConfigError(f"model.path: {spec.architecture} is not a causal LM or a reward model (expected an HF "
                          f"architecture ending in one of {', '.join(HEADS)})")
    raw = dict(spec.raw_config)
    if raw.get("pad_token_id") is None:
        raw["pad_token_id"] = int(pad_token_id)
    return dataclasses.replace(spec, architecture=base + "ForSequenceClassification", value_head=True,
                               value_head_bias=False, sequence_score=True, tie_word_embeddings=False,
                               raw_config=raw)


class ScoreModel:
    """The trained reward model: its megatron model (DDP), optimizer, LR schedule and head format."""

    def __init__(self, path: str, optim, total_steps: int, pad_token_id: int, tp: int, pp: int,
                 vocab_multiple: int, sequence_parallel: bool = False, recompute=None,
                 distributed_optimizer=None, overlap_grad_reduce: bool = False, center_coef: float = 0.0):
        self.center_coef = center_coef  # trainer.center_rewards_coef: the loss's reward-centering term
        kw = dict(tp=tp, pp=pp, vocab_multiple=vocab_multiple, sequence_parallel=sequence_parallel,
                  recompute=recompute)
        if load_spec(path).value_head:  # a reward model already: trained further as it is
            self.model = load_model(path, **kw)
            self.init = "reward_model"
        else:
            trunk = load_model(path, **kw)
            inner = unwrap(trunk)
            spec = score_head_spec(inner.megarl_spec, pad_token_id)
            opts = dataclasses.replace(inner.megarl_opts, init_weights=False)
            self.model = build_model_chunks(spec, opts) if virtual_stages() > 1 else build_model(spec, opts)
            copy_weights(trunk, self.model, skip=("output_layer.",))  # the trunk; a zero head
            del trunk
            self.init = "causal_lm"
        spec = unwrap(self.model).megarl_spec
        self.sequence_score = spec.sequence_score
        self.score_pad_id = spec.raw_config.get("pad_token_id") if spec.sequence_score else None
        self.pad_token_id = pad_token_id
        self.ddp, self.optimizer = wrap_for_training(self.model, optim, overlap_grad_reduce=overlap_grad_reduce,
                                                     use_distributed_optimizer=distributed_optimizer)
        self.scheduler = lr_scheduler(self.optimizer, optim, total_steps)

    def score_positions(self, tokens: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        return (sequence_score_positions(tokens, lengths, self.score_pad_id) if self.sequence_score
                else (lengths - 1).clamp(min=0))

    def micro_batches(self, pairs: Sequence[tuple], width: int, pairs_per_micro_batch: int) -> List[Dict]:
        """This rank's pairs as micro-batches of rows ``[c0, r0, c1, r1, ...]`` (a pair never
        split), every one ``width`` tokens wide, with where each row's score is read."""
        size = pairs_per_micro_batch or len(pairs)
        out = []
        for i in range(0, len(pairs), size):
            rows = [side for pair in pairs[i:i + size] for side in pair]
            tokens = torch.full((len(rows), width), self.pad_token_id, dtype=torch.long)
            for j, r in enumerate(rows):
                tokens[j, :len(r)] = torch.tensor(r, dtype=torch.long)
            lengths = torch.tensor([len(r) for r in rows], dtype=torch.long)
            out.append({"tokens": tokens, "score_at": self.score_positions(tokens, lengths)})
        return out

    def train_step(self, micro_batches: List[Dict], global_pairs: int) -> StepResult:
        """One optimizer step: the Bradley-Terry loss summed over every rank's pairs / ``global_pairs``."""

        def loss_fn(output, mb):
            v = token_terms(output[..., 0].float(), mb)
            s = v.gather(1, mb["score_at"][:, None].to(v.device))[:, 0]
            return bradley_terry_loss(s[0::2], s[1::2], normaliser=global_pairs, center_coef=self.center_coef)

        result = train_step(self.ddp, self.optimizer, micro_batches, loss_fn)
        if result.update_successful:
            self.scheduler.step(increment=1)
        return result

    def scores(self, rows: Sequence[Sequence[int]], micro_batch_size: int) -> torch.Tensor:
        """``(n,)`` scores of token rows, split over DP (collective)."""
        return sequence_scores(self.ddp, rows, self.pad_token_id, self.score_pad_id, self.sequence_score,
                               micro_batch_size)

    def export(self, out_dir: str, tokenizer_dir: str, dtype=None) -> None:
        """The HF checkpoint (collective; rank 0 writes): the score head in ``score.weight``."""
        export_hf(self.model, out_dir, tokenizer_dir=tokenizer_dir, dtype=dtype)
