"""Export of the actor as a HuggingFace checkpoint: what a user loads elsewhere, the actor's
weights in HF layout with its tokenizer and chat template.  ``export/iter_0`` is the starting
policy, the last one the final policy."""

from __future__ import annotations

import os

import torch.distributed as dist


class Exporter:
    """Writes ``<export_root>/iter_<k>``: the actor as an HF checkpoint with the tokenizer and
    chat template of the run's tokenizer contract (collective; rank 0 writes)."""

    def __init__(self, export_root: str, actor, tok, rank0: bool):
        self.export_root, self.actor, self.tok, self.rank0 = export_root, actor, tok, rank0

    def path(self, k: int) -> str:
        return os.path.join(self.export_root, f"iter_{k}")

    def export(self, k: int) -> str:
        out = self.path(k)
        self.actor.onload()
        self.actor.export(out)
        if self.rank0:
            tok = self.tok.tokenizer
            if self.tok.chat_template is not None:
                tok.chat_template = self.tok.chat_template
            tok.save_pretrained(out)
        if dist.is_initialized():
            dist.barrier()
        return out
