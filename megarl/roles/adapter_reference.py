"""The reference of a LoRA actor (``actor.lora``, ``reference.path`` null): the actor itself with
its adapters off -- the base model it started from -- so the KL anchor costs no second copy of
the model.  Its forward is the actor's under :func:`megarl.models.lora.adapters_disabled`; with
the adapters off the actor computes exactly as its frozen base does (bitwise: the adapters'
hooks return the base output untouched), which ``tests/workers/lora_step_worker.py`` asserts
against a separately loaded frozen copy at every layout.  Never refreshed
(``reference.refresh_every`` is refused with LoRA: the base does not move).
"""

from __future__ import annotations

import contextlib

import torch

from megarl.models.lora import adapters_disabled
from megarl.roles.frozen import WholeBatchLogProbs


class AdapterOffReference(WholeBatchLogProbs):
    refreshes = 0
    offloader = None  # nothing of its own to offload: the weights are the actor's

    def __init__(self, actor, version: str = "ref-0"):
        self.actor, self.version = actor, version

    @property
    def model(self):
        return self.actor.ddp

    @property
    def precision(self) -> str:
        return self.actor.precision

    def _on_device(self):
        return contextlib.nullcontext()

    def log_probs(self, prompt_ids: torch.Tensor, response_ids: torch.Tensor, attention_mask: torch.Tensor,
                  micro_batch_size: int, pack: bool = False, micro_batch_tokens: int = 0) -> torch.Tensor:
        with adapters_disabled(self.actor.ddp):
            return self.actor.log_probs(prompt_ids, response_ids, attention_mask, micro_batch_size, pack=pack,
                                        micro_batch_tokens=micro_batch_tokens)

    def origin_id(self, identify) -> str:
        """The base's identity (collective): what a frozen copy of the starting actor would have."""
        with adapters_disabled(self.actor.ddp):
            return identify(self.actor.ddp)
