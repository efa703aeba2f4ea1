"""On-policy distillation's teacher: a frozen model teacher-forced on the student's samples.

Eval mode, no optimizer, never refreshed, at the actor's TP/PP; offloaded to the host between its
forwards when configured (GPU time-slicing), like the reference.  Its log-probs of the sampled
tokens are the record's ``teacher_log_probs`` (producer role ``teacher``), never an old or a
reference log-prob.  Its identity is the content of its weights (a run origin: a resume with
another teacher is refused).  It must read the actor's token ids: :func:`check_teacher_tokenizer`
refuses another tokenizer before the model loads.
"""

from __future__ import annotations

import contextlib
import os

import torch

from megarl.errors import ConfigError
from megarl.models.forward import response_log_probs
from megarl.models.megatron_ckpt import load_model
from megarl.models.weights import precision
from megarl.roles.common import freeze

__all__ = ["Teacher", "check_teacher_tokenizer"]


def check_teacher_tokenizer(path: str, actor_tokenizer_hash: str, chat_template) -> None:
    """Token-level distillation compares two models' log-probs of the same token ids: the
    teacher's tokenizer (at ``teacher.path``) must be the actor's.  Raises ConfigError naming
    ``teacher.path`` otherwise (or when the path is no checkpoint)."""
    from megarl.data.tokenizer import TokenizerContract

    if not os.path.isfile(os.path.join(path, "config.json")):
        raise ConfigError(f"teacher.path: {path!r} is not an HF checkpoint (no config.json)")
    try:
        contract = TokenizerContract.load(path, chat_template)
    except Exception as e:  # noqa: BLE001 - any tokenizer load failure is this one config error
        raise ConfigError(f"teacher.path: {path!r} has no tokenizer the actor's could be compared with ({e})") from e
    if contract.hash != actor_tokenizer_hash:
        raise ConfigError(f"teacher.path: {path!r} has another tokenizer than the actor's (hash {contract.hash} != "
                          f"{actor_tokenizer_hash}); on-policy distillation compares log-probs of the same token ids")


class Teacher:
    def __init__(self, path: str, tp: int, pp: int, vocab_multiple: int = 128, offload: bool = False,
                 sequence_parallel: bool = False, log_prob_chunk: int = 0):
        self.log_prob_chunk = log_prob_chunk  # algo.log_prob_chunk
        self.model = load_model(path, tp=tp, pp=pp, vocab_multiple=vocab_multiple, sequence_parallel=sequence_parallel)
        freeze(self.model)
        self.version = "teacher"  # labelled by its weights once identified (RunPersistence.record_origins)
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

    @torch.no_grad()
    def log_probs(self, prompt_ids: torch.Tensor, response_ids: torch.Tensor, attention_mask: torch.Tensor,
                  micro_batch_size: int, pack: bool = False, micro_batch_tokens: int = 0) -> torch.Tensor:
        """``(b, R)`` the teacher's log-probs of the response tokens (collective over the MP group)."""
        with self._on_device():
            return response_log_probs(self.model, prompt_ids, response_ids, attention_mask, micro_batch_size,
                                      pack=pack, micro_batch_tokens=micro_batch_tokens,
                                      log_prob_chunk=self.log_prob_chunk)
