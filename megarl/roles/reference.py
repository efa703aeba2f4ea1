"""The reference policy: a frozen copy of the starting actor, the KL anchor.

Eval mode, no optimizer, an explicit version.  It changes only when the config says so
(``reference.refresh_every``: never by default, or every K iterations, as in DeepSeekMath's
iterative GRPO), never as a side effect of a reload.  Offloaded to the host between its
forwards when configured (GPU time-slicing).
"""

from __future__ import annotations

import torch

from megarl.roles.common import copy_weights
from megarl.roles.frozen import FrozenRole


class Reference(FrozenRole):
    def __init__(self, path: str, tp: int, pp: int, version: str, vocab_multiple: int = 128,
                 offload: bool = False, sequence_parallel: bool = False, log_prob_chunk: int = 0):
        super().__init__(path, tp, pp, version, vocab_multiple=vocab_multiple, offload=offload,
                         sequence_parallel=sequence_parallel, log_prob_chunk=log_prob_chunk)
        self.refreshes = 0

    @torch.no_grad()
    def refresh_from(self, actor_model, version: str) -> None:
        """Copy the actor's current weights (same layout) into the reference; new ``version``."""
        with self._on_device():
            copy_weights(actor_model, self.model)
        self.version = version
        self.refreshes += 1
