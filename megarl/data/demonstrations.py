"""Demonstrations for the SFT term (``algo.sft``): prompts read like the training prompts (the
``data`` section's fields, chat template, system prompt and length limit), each with the
response to imitate, and the cursor that draws them epoch after epoch.

A demonstration's tokens are its rendered prompt followed by its response's tokens and the
tokenizer's eos (where a generated response ends).  The cursor is a
:class:`~megarl.data.prompts.PromptSampler` of its own (a function of the seed and the epoch);
the checkpoint keeps it, so a resumed run draws the rows it would have drawn.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Sequence, Tuple

import torch

from megarl.errors import ConfigError
from megarl.data.prompts import PromptDatasetError, PromptSampler, load_configured_dataset

__all__ = ["Demonstrations", "load_demonstrations"]


@dataclass
class Demonstrations:
    """``rows``: each demonstration's (prompt ids, response ids); ``sha256`` of the file;
    ``sampler`` the cursor; ``per_step`` rows drawn per optimizer step."""

    path: str
    rows: Tuple[Tuple[Tuple[int, ...], Tuple[int, ...]], ...]
    sha256: str
    sampler: PromptSampler
    per_step: int

    def draw(self) -> List[int]:
        """The next optimizer step's row indices (advances the cursor)."""
        return self.sampler.next_indices(self.per_step)

    def columns(self, indices: Sequence[int], pad_id: int) -> Dict[str, torch.Tensor]:
        """The rows as the update's columns: ``tokens (n, L)`` (prompt then response, right-padded
        with ``pad_id``), ``prompt_lens``, ``response_lens`` ``(n,)`` and ``loss_mask (n, R)``
        (1 on every response token)."""
        picked = [self.rows[i] for i in indices]
        L = max(len(p) + len(r) for p, r in picked)
        R = max(len(r) for _, r in picked)
        tokens = torch.full((len(picked), L), pad_id, dtype=torch.long)
        mask = torch.zeros((len(picked), R), dtype=torch.long)
        for j, (p, r) in enumerate(picked):
            tokens[j, :len(p) + len(r)] = torch.tensor(p + r, dtype=torch.long)
            mask[j, :len(r)] = 1
        return {"tokens": tokens, "prompt_lens": torch.tensor([len(p) for p, _ in picked], dtype=torch.long),
                "response_lens": torch.tensor([len(r) for _, r in picked], dtype=torch.long), "loss_mask": mask}


def load_demonstrations(cfg, contract) -> Demonstrations:
    """``algo.sft.path`` read, validated and tokenized before any model loads.  Raises ConfigError
    naming ``algo.sft.path`` (a file that cannot be read as prompts) or ``algo.sft.response_field``
    (a row without its response text), with the row."""
    s = cfg.algo.sft
    try:
        ds = load_configured_dataset(cfg.data, contract, s.path)
    except PromptDatasetError as e:
        raise ConfigError(f"algo.sft.path: {e}") from e
    eos = [contract.eos_token_id] if contract.eos_token_id is not None else []
    rows = []
    for rec in ds.records:
        text = rec.ground_truth.get(s.response_field)
        if not isinstance(text, str) or not text.strip():
            have = sorted(rec.ground_truth)
            raise ConfigError(f"algo.sft.response_field: row {rec.prompt_id!r} of {s.path} has no text in "
                              f"{s.response_field!r} (the demonstration's response); its other fields: {have}")
        ids = list(contract.tokenizer.encode(text, add_special_tokens=False)) + eos
        rows.append((tuple(rec.prompt_ids), tuple(int(i) for i in ids)))
    return Demonstrations(path=s.path, rows=tuple(rows), sha256=ds.stats["sha256"],
                          sampler=PromptSampler(len(rows), seed=cfg.trainer.seed), per_step=s.rows)
