"""Vocab-parallel log-probs and entropies from a TP shard of the logits, exact with a padded
vocabulary, differentiable (:func:`token_log_probs_from_logits`, :func:`vocab_parallel_entropy`);
:func:`gather_vocab` puts the shards back together for tests and inspection."""

from __future__ import annotations

import torch
import torch.distributed as dist


def mask_padded_vocab(logits_shard: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Set logits of padding vocabulary rows (ids >= ``vocab_size``) to -inf on this TP shard.

    Padding rows are zero weights, so their logits are 0, not -inf: left in, they would add
    ``exp(0)`` terms to the softmax and bias every log-prob.
    """
    from megatron.core import parallel_state as ps

    per = logits_shard.shape[-1]
    start = ps.get_tensor_model_parallel_rank() * per
    n_pad = start + per - vocab_size
    if n_pad <= 0:
        return logits_shard
    keep = torch.arange(start, start + per, device=logits_shard.device) < vocab_size
    return logits_shard.masked_fill(~keep, float("-inf"))


def token_log_probs_from_logits(logits_shard: torch.Tensor, targets: torch.Tensor, vocab_size: int,
                                temperature: float = 1.0, chunk: int = 0) -> torch.Tensor:
    """``log softmax(logits / T)[target]`` from vocab-parallel logits.

    Args:
        logits_shard: ``(b, s, V_padded / tp)`` this TP rank's slice of the logits.
        targets: ``(b, s)`` token ids (global vocabulary).
        chunk: ``algo.log_prob_chunk``: positions at a time, without an fp32 copy of the whole
            logits (:mod:`megarl.models.chunked_logits`: the same values, bitwise); 0: all at once.
    Returns:
        ``(b, s)`` log-probs, identical on every TP rank, with gradient to the logits.
    """
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    if chunk:
        from megarl.models.chunked_logits import chunked_token_log_probs

        return chunked_token_log_probs(logits_shard, targets, vocab_size, temperature, chunk)

    logits = mask_padded_vocab(logits_shard, vocab_size)
    if temperature != 1.0:
        logits = logits / temperature
    # megatron's kernel expects [s, b, v], returns the negative log-likelihood, and works in place
    # on what it is given: always a copy (for one row in fp32, transpose, contiguous and float
    # would all hand it the model's own logits, which the entropy then read exponentiated)
    nll = vocab_parallel_cross_entropy(logits.transpose(0, 1).to(torch.float32, copy=True,
                                                                  memory_format=torch.contiguous_format),
                                       targets.transpose(0, 1).contiguous())
    return -nll.transpose(0, 1)


def gather_vocab(logits_shard: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Full ``(b, s, vocab_size)`` logits from the TP shards (for tests and inspection)."""
    from megatron.core import parallel_state as ps

    tp = ps.get_tensor_model_parallel_world_size()
    if tp > 1:
        parts = [torch.empty_like(logits_shard) for _ in range(tp)]
        dist.all_gather(parts, logits_shard.contiguous(), group=ps.get_tensor_model_parallel_group())
        logits_shard = torch.cat(parts, -1)
    return logits_shard[..., :vocab_size]


def vocab_parallel_entropy(logits_shard: torch.Tensor, vocab_size: int, chunk: int = 0) -> torch.Tensor:
    """Entropy ``-sum_v p_v log p_v`` of softmax(logits) from vocab-parallel logits, ``(b, s)``.

    H = log Z - sum_v p_v z_v with Z = sum_v exp(z_v): the two sums are all-reduced over the TP
    group by megatron's ``reduce_from_tensor_model_parallel_region``, whose backward is the
    identity: every TP rank computes the same loss from the reduced sums, so each shard's gradient
    is its own part of that one loss's.  (``torch.distributed.nn.functional.all_reduce`` sums the
    gradients in its backward instead, which scaled an entropy bonus's gradient by tp.)  Padded
    vocabulary rows are excluded.  ``chunk`` (``algo.log_prob_chunk``): that many positions at a
    time (:mod:`megarl.models.chunked_logits`: the same values, bitwise; gradients to fp32 noise).
    """
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import reduce_from_tensor_model_parallel_region

    if chunk:
        from megarl.models.chunked_logits import chunked_entropy

        return chunked_entropy(logits_shard, vocab_size, chunk)

    z = mask_padded_vocab(logits_shard, vocab_size).float()
    group = ps.get_tensor_model_parallel_group()
    tp = ps.get_tensor_model_parallel_world_size()
    m = z.detach().max(dim=-1, keepdim=True).values
    if tp > 1:
        dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)
    finite = torch.isfinite(z)
    e = torch.where(finite, torch.exp(z - m), torch.zeros((), dtype=z.dtype, device=z.device))
    s = e.sum(-1)
    ez = (e * torch.where(finite, z - m, torch.zeros((), dtype=z.dtype, device=z.device))).sum(-1)
    if tp > 1:
        s = reduce_from_tensor_model_parallel_region(s)
        ez = reduce_from_tensor_model_parallel_region(ez)
    return torch.log(s) - ez / s
