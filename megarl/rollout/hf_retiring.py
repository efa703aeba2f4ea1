"""Decoding in which a finished response leaves the batch (``rollout.retire_finished``, hf backend).

transformers' ``generate`` runs every row of a batch through every decode step until the last
row finishes: a response that ended at step 10 of a 250-step batch is computed 240 more times,
its outputs thrown away.  On a long-tail mix -- most responses short, a few long -- that is most
of the decode work.  Here a step runs only the rows still generating: the rows that finished are
dropped from the next input, the attention mask and the KV cache (``Cache.batch_select_indices``),
so a step costs what its live rows cost, as continuous batching (SGLang, vLLM) does by design.

Everything else is ``generate``'s: the prefill over the left-padded prompts, positions from the
attention mask (``cumsum - 1``), float32 logits of the last position handed to the same logits
processors (megarl's recorder, transformers' warpers, megarl's seeded chooser).  The chooser's
uniforms depend on a row's seed and the step only (``counter_uniforms``), never on which rows
share the batch, so a candidate draws the same numbers either way; its logits may differ in the
last bits, because a matmul over fewer rows may round otherwise.  With no row finishing early the
steps are generate's, bitwise (``tests/unit/rollout/test_rollout_hf_backend.py``).

Not for MoE routing capture (``return_routed_experts``): the engine refuses the combination.
"""

from __future__ import annotations

import time
from typing import Sequence

import torch

__all__ = ["decode_retiring"]


@torch.no_grad()
def decode_retiring(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, processors, chooser,
                    max_new_tokens: int, terminal: Sequence[int], pad_token_id: int) -> tuple[torch.Tensor, dict]:
    """Decode ``input_ids`` (left-padded, ``(B, W)``) up to ``max_new_tokens`` tokens per row.

    ``processors``: a ``LogitsProcessorList`` ending in the seeded chooser ``chooser``, which is
    told the rows of each step (``chooser.rows``) and leaves their tokens in ``chooser.last_tokens``.
    Returns ``(generated (B, T), stats)``: ``T`` the longest row's steps, rows padded with
    ``pad_token_id`` after their terminal token; ``stats``: ``steps`` and ``row_steps`` (the
    rows computed over all decode steps, the work a dense batch would do is ``B x steps``).
    """
    from transformers import DynamicCache

    B = input_ids.shape[0]
    dev = input_ids.device
    out = torch.full((B, max_new_tokens), pad_token_id, dtype=torch.long)
    terminal_t = torch.tensor(sorted(set(terminal)), dtype=torch.long, device=dev)
    rows = torch.arange(B, device=dev)
    attn = attention_mask.long()
    position = attn.cumsum(-1) - 1
    position.masked_fill_(attn == 0, 1)
    cache = DynamicCache(config=model.config)
    logits = model(input_ids=input_ids, attention_mask=attn, position_ids=position, past_key_values=cache,
                   use_cache=True, logits_to_keep=1).logits[:, -1, :]
    ids = input_ids
    steps = row_steps = 0
    finished_at = [None] * B  # monotonic time each row's last token was chosen
    for step in range(max_new_tokens):
        chooser.rows = rows
        processors(ids, logits.to(dtype=torch.float32, copy=True))
        tokens = chooser.last_tokens
        out[rows.cpu(), step] = tokens.cpu()
        steps, row_steps = step + 1, row_steps + len(rows)
        if step + 1 == max_new_tokens:
            break
        live = ~torch.isin(tokens, terminal_t) if len(terminal_t) else torch.ones_like(tokens, dtype=torch.bool)
        now = time.monotonic()
        for r in rows[~live].tolist():
            finished_at[r] = now
        if not bool(live.any()):
            break
        if not bool(live.all()):  # retire the finished rows from the batch and the cache
            keep = live.nonzero().squeeze(1)
            cache.batch_select_indices(keep)
            rows, attn, tokens = rows[keep], attn[keep], tokens[keep]
        attn = torch.cat([attn, attn.new_ones((len(rows), 1))], dim=1)
        ids = tokens[:, None]
        logits = model(input_ids=ids, attention_mask=attn, position_ids=attn.sum(-1, keepdim=True) - 1,
                       past_key_values=cache, use_cache=True).logits[:, -1, :]
    chooser.rows = None
    end = time.monotonic()
    return out[:, :steps], {"steps": steps, "row_steps": row_steps,
                            "finished_at": [end if t is None else t for t in finished_at]}
