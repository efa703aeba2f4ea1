"""A frozen model role: loaded at the actor's TP/PP, eval mode, no gradients, no optimizer, an
explicit version, offloaded to the host between its forwards when configured (GPU
time-slicing).  The reference (:mod:`megarl.roles.reference`) and on-policy distillation's teacher
(:mod:`megarl.roles.teacher`) are both one."""

from __future__ import annotations

import contextlib

import torch

from megarl.models.forward import response_log_probs
from megarl.models.megatron_ckpt import load_model
from megarl.models.weights import precision
from megarl.roles.common import freeze
from megarl.runtime.data_parallel import map_rows


class WholeBatchLogProbs:
    """``batch_log_probs`` over a role's own ``log_probs``: what preparation calls of a frozen role
    (the reference, the teacher, the LoRA actor's adapters-off reference)."""

    def batch_log_probs(self, prompt_ids: torch.Tensor, response_ids: torch.Tensor, attention_mask: torch.Tensor,
                        micro_batch_size: int, pack: bool = False, micro_batch_tokens: int = 0) -> torch.Tensor:
        """``(B, R)`` over the whole batch: each DP rank forwards its rows, gathered (collective
        over the world)."""
        return map_rows(lambda *t: self.log_probs(*t, micro_batch_size, pack=pack, micro_batch_tokens=micro_batch_tokens),
                        prompt_ids, response_ids, attention_mask).cpu()


class FrozenRole(WholeBatchLogProbs):
    def __init__(self, path: str, tp: int, pp: int, version: str, vocab_multiple: int = 128,
                 offload: bool = False, sequence_parallel: bool = False, log_prob_chunk: int = 0):
        self.log_prob_chunk = log_prob_chunk  # algo.log_prob_chunk
        self.model = load_model(path, tp=tp, pp=pp, vocab_multiple=vocab_multiple, sequence_parallel=sequence_parallel)
        freeze(self.model)
        self.version = version
        self.offloader = None
        if offload:
            from megarl.roles.offload import ReferenceOffloader

            self.offloader = ReferenceOffloader(self.model)
            self.offloader.offload()

    @property
    def precision(self) -> str:
        """The dtype its forward computes in (the record's ``LogProbProducer.precision``)."""
        return precision(self.model)

    def _on_device(self):
        return self.offloader.on_device() if self.offloader is not None else contextlib.nullcontext()

    def log_probs(self, prompt_ids: torch.Tensor, response_ids: torch.Tensor, attention_mask: torch.Tensor,
                  micro_batch_size: int, pack: bool = False, micro_batch_tokens: int = 0) -> torch.Tensor:
        """``(b, R)`` its log-probs of the response tokens (collective over the MP group);
        ``pack``: each micro-batch as one packed sequence (``algo.pack_sequences``);
        ``micro_batch_tokens``: packed micro-batches cut by that token budget."""
        with self._on_device():
            return response_log_probs(self.model, prompt_ids, response_ids, attention_mask, micro_batch_size,
                                      pack=pack, micro_batch_tokens=micro_batch_tokens,
                                      log_prob_chunk=self.log_prob_chunk)

    def origin_id(self, identify) -> str:
        """What a resume must find again (collective): ``identify`` of its weights."""
        with self._on_device():
            return identify(self.model)
