"""Log-probs and entropy from vocab-parallel logits, a chunk of positions at a time.

The straightforward path (:func:`megarl.models.vocab_parallel.token_log_probs_from_logits`) hands
megatron's ``vocab_parallel_cross_entropy`` an fp32 copy of the whole ``(b, s, V/tp)`` logits,
which it keeps for its backward (the softmax), and :func:`~megarl.models.vocab_parallel.vocab_parallel_entropy`
keeps several more of that size.  For long responses and large vocabularies that copy is the
biggest tensor of the update: 8k tokens x 152k vocabulary / TP 2 is 2.5 GB in fp32 per micro-batch
(slime#1951 is a 58 GiB logits buffer).  Here the logits are read ``chunk`` positions at a time:
each chunk is copied to fp32, reduced over the TP group, and dropped; the backward recomputes the
softmax of each chunk from the saved per-position ``log Z`` (and, for the entropy, ``E_p[z]``), so
nothing of the logits' size is kept but the gradient itself, in the logits' dtype.

Per position, with ``z = logits / T`` over the global vocabulary (padding rows excluded), ``m =
max z`` and ``Z = sum_v exp(z_v - m)``:

* log-prob of target ``t``: ``(z_t - m) - log Z``, with ``d/dz_v = [v = t] - p_v`` (times ``1/T``
  for the raw logits) -- the same operations, in the same order, as megatron's kernel and its
  backward, so the values and (in fp32) the gradients are bitwise theirs;
* entropy: ``H = log Z - sum_v p_v (z_v - m)``, with ``dH/dz_v = -p_v (z_v - E_p[z])``.

Both are computed identically on every TP rank from the reduced sums; each rank's gradient is the
one of its own shard (as ``reduce_from_tensor_model_parallel_region``, whose backward is the
identity, gives the unchunked entropy).  The backward needs no communication.
"""

from __future__ import annotations

from typing import Tuple

import torch
import torch.distributed as dist


def _tp():
    from megatron.core import parallel_state as ps

    return ps.get_tensor_model_parallel_group(), ps.get_tensor_model_parallel_world_size(), \
        ps.get_tensor_model_parallel_rank()


def _chunks(shape: Tuple[int, ...], chunk: int):
    """``(row, slice of positions)`` covering a ``(b, s, ...)`` tensor, ``chunk`` positions each."""
    b, s = shape[0], shape[1]
    for i in range(b):
        for j in range(0, s, chunk):
            yield i, slice(j, min(j + chunk, s))


def _fp32_chunk(logits: torch.Tensor, i: int, sl: slice, keep: torch.Tensor, temperature: float) -> torch.Tensor:
    """Positions ``sl`` of row ``i`` as an fp32 copy (never a view: it is changed in place), divided
    by the temperature, padding vocabulary rows at -inf."""
    z = logits[i, sl].to(torch.float32, copy=True)
    if temperature != 1.0:
        z.div_(temperature)
    if keep is not None:
        z.masked_fill_(~keep, float("-inf"))
    return z


def _vocab_keep(logits: torch.Tensor, vocab_size: int, rank: int):
    """This shard's columns that are real vocabulary (None: all of them)."""
    return _vocab_keep_of(logits.shape[-1], vocab_size, rank, logits.device)


def _vocab_keep_of(per: int, vocab_size: int, rank: int, device):
    """Of a shard of ``per`` vocabulary columns on this TP rank, those that are real (None: all)."""
    start = rank * per
    if start + per <= vocab_size:
        return None
    return torch.arange(start, start + per, device=device) < vocab_size


def _centre_and_pick(z: torch.Tensor, targets: torch.Tensor, rank: int, group, tp: int):
    """``z`` (positions x this shard's columns, fp32) minus its global max in place; returns that
    max ``m`` and ``z_t - m`` on this shard (0 where the target lies on another shard): the first
    half of megatron's vocab-parallel cross-entropy, in its order."""
    per = z.shape[-1]
    m = z.max(dim=-1).values
    if tp > 1:
        dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)
    z.sub_(m.unsqueeze(-1))
    local = targets - rank * per
    outside = (local < 0) | (local >= per)
    zt = z.gather(-1, local.masked_fill(outside, 0).unsqueeze(-1)).squeeze(-1)
    zt.masked_fill_(outside, 0.0)
    return m, zt


class _ChunkedLogProbs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, targets, vocab_size: int, temperature: float, chunk: int):
        group, tp, rank = _tp()
        keep = _vocab_keep(logits, vocab_size, rank)
        out = torch.empty(targets.shape, dtype=torch.float32, device=logits.device)
        maxes, sums_z = torch.empty_like(out), torch.empty_like(out)  # m and Z per position: the backward's softmax
        for i, sl in _chunks(logits.shape, chunk):
            z = _fp32_chunk(logits, i, sl, keep, temperature)
            m, zt = _centre_and_pick(z, targets[i, sl], rank, group, tp)
            z.exp_()
            sums = torch.stack([zt, z.sum(dim=-1)])
            if tp > 1:
                dist.all_reduce(sums, group=group)
            zt, s = sums[0], sums[1]
            out[i, sl] = -(torch.log(s) - zt)
            maxes[i, sl], sums_z[i, sl] = m, s
        ctx.save_for_backward(logits, targets, maxes, sums_z)
        ctx.vocab_size, ctx.temperature, ctx.chunk = vocab_size, temperature, chunk
        return out

    @staticmethod
    def backward(ctx, grad_out):
        logits, targets, maxes, sums_z = ctx.saved_tensors
        _group, _tp_size, rank = _tp()
        per = logits.shape[-1]
        keep = _vocab_keep(logits, ctx.vocab_size, rank)
        grad = torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)
        # megatron's backward, in its order: (softmax - onehot) x d(nll), then / T
        for i, sl in _chunks(logits.shape, ctx.chunk):
            p = _fp32_chunk(logits, i, sl, keep, ctx.temperature)
            p.sub_(maxes[i, sl].unsqueeze(-1)).exp_().div_(sums_z[i, sl].unsqueeze(-1))  # padding rows: 0
            local = targets[i, sl] - rank * per
            inside = (local >= 0) & (local < per)
            rows = torch.arange(p.shape[0], device=p.device)[inside]
            p[rows, local[inside]] -= 1.0
            p.mul_(-grad_out[i, sl].float().unsqueeze(-1))
            if ctx.temperature != 1.0:
                p.div_(ctx.temperature)
            if keep is not None:
                p.masked_fill_(~keep, 0.0)
            grad[i, sl] = p.to(logits.dtype)
        return grad, None, None, None, None


class _ChunkedEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, vocab_size: int, chunk: int):
        group, tp, rank = _tp()
        keep = _vocab_keep(logits, vocab_size, rank)
        out = torch.empty(logits.shape[:2], dtype=torch.float32, device=logits.device)
        log_z = torch.empty_like(out)  # m + log Z
        mean_z = torch.empty_like(out)  # E_p[z]
        for i, sl in _chunks(logits.shape, chunk):
            z = _fp32_chunk(logits, i, sl, keep, 1.0)
            m = z.max(dim=-1).values
            if tp > 1:
                dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)
            z.sub_(m.unsqueeze(-1))
            e = torch.exp(z)
            if keep is not None:
                z.masked_fill_(~keep, 0.0)  # (-inf) x 0 would be NaN; those rows carry no mass
            sums = torch.stack([e.sum(dim=-1), (e * z).sum(dim=-1)])
            if tp > 1:
                dist.all_reduce(sums, group=group)
            s, ez = sums[0], sums[1]
            out[i, sl] = torch.log(s) - ez / s
            log_z[i, sl] = m + torch.log(s)
            mean_z[i, sl] = m + ez / s
        ctx.save_for_backward(logits, log_z, mean_z)
        ctx.vocab_size, ctx.chunk = vocab_size, chunk
        return out

    @staticmethod
    def backward(ctx, grad_out):
        logits, log_z, mean_z = ctx.saved_tensors
        _group, _tp_size, rank = _tp()
        keep = _vocab_keep(logits, ctx.vocab_size, rank)
        grad = torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)
        for i, sl in _chunks(logits.shape, ctx.chunk):
            z = _fp32_chunk(logits, i, sl, keep, 1.0)
            p = torch.exp(z - log_z[i, sl].unsqueeze(-1))
            z.sub_(mean_z[i, sl].unsqueeze(-1))
            if keep is not None:
                z.masked_fill_(~keep, 0.0)
            grad[i, sl] = (p.mul_(z).mul_(-grad_out[i, sl].float().unsqueeze(-1))).to(logits.dtype)
        return grad, None, None


def chunked_token_log_probs(logits_shard: torch.Tensor, targets: torch.Tensor, vocab_size: int,
                            temperature: float = 1.0, chunk: int = 1024) -> torch.Tensor:
    """``(b, s)`` fp32 ``log softmax(logits / T)[target]`` from ``(b, s, V/tp)`` vocab-parallel
    logits, ``chunk`` positions at a time (module doc); differentiable, identical on every TP rank."""
    if chunk < 1:
        raise ValueError(f"chunk must be >= 1 position, got {chunk}")
    return _ChunkedLogProbs.apply(logits_shard, targets, vocab_size, float(temperature), int(chunk))


def chunked_entropy(logits_shard: torch.Tensor, vocab_size: int, chunk: int = 1024) -> torch.Tensor:
    """``(b, s)`` fp32 entropy of softmax(logits) from ``(b, s, V/tp)`` vocab-parallel logits,
    ``chunk`` positions at a time (module doc); differentiable, identical on every TP rank."""
    if chunk < 1:
        raise ValueError(f"chunk must be >= 1 position, got {chunk}")
    return _ChunkedEntropy.apply(logits_shard, vocab_size, int(chunk))
