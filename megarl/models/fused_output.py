"""Log-probs and entropy from the last hidden states, the output layer applied a chunk at a time.

:mod:`megarl.models.chunked_logits` never copies the whole logits to fp32, but the logits are still
there: megatron's ``GPTModel`` applies its output layer to every position and returns a transposed
``(b, s, V/tp)`` copy, and its autograd keeps the gradient of that size.  At a 152k vocabulary and
8k tokens that is 1.2 GB per TP rank in bf16 for the forward and as much again for the backward.

With ``algo.log_prob_chunk > 0`` the model's last stage returns its final hidden states ``(b, s,
h)`` instead (:func:`output_head`: the output layer's input as megatron prepares it -- gathered
along the sequence under sequence parallelism -- and nothing else), and :func:`fused_log_probs`
computes, ``chunk`` positions at a time, ``logits = h W^T`` on this rank's vocabulary shard ``W``
(``(V/tp, h)``, the model's dtype, as megatron's output layer), then the same fp32 statistics as
:mod:`megarl.models.chunked_logits`, reduced over the TP group, and drops the chunk.  The forward
keeps the hidden states and four numbers per position; the backward recomputes each chunk's
logits and gives

* ``dlogits_v = g_lp ([v = t] - p_v) / T - g_H p_v (z_v - E_p[z]) / T`` (``z = logits / T``,
  ``p = softmax(z)`` over the global vocabulary, padding rows excluded);
* ``dh = dlogits W`` (this rank's share: the output layer's input region sums it over TP, as
  megatron's column-parallel linear does) and ``dW = sum over chunks of dlogits^T h``, accumulated
  in fp32.

So no tensor of more than ``chunk`` positions of the vocabulary exists in the forward-only passes
or the update (``tests/multiproc/test_token_budget.py`` watches every tensor created).  The
values are the whole computation's up to the order of fp32 sums in the matmul and in ``dW``.
"""

from __future__ import annotations

import contextlib
from typing import Iterator, Tuple

import torch
import torch.distributed as dist
import torch.nn.functional as F

from megarl.models.chunked_logits import _centre_and_pick, _chunks, _tp, _vocab_keep_of
from megarl.models.micro_batches import next_token_terms
from megarl.models.vocab_parallel import token_log_probs_from_logits, vocab_parallel_entropy
from megarl.models.weights import as_chunks, unwrap


class _FusedOutput(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, targets, vocab_size: int, temperature: float, chunk: int):
        group, tp, rank = _tp()
        per = weight.shape[0]
        keep = _vocab_keep_of(per, vocab_size, rank, weight.device)
        shape = targets.shape
        lp = torch.empty(shape, dtype=torch.float32, device=hidden.device)
        ent, maxes, sums_z, mean_z = (torch.empty_like(lp) for _ in range(4))
        for i, sl in _chunks(hidden.shape, chunk):
            z = _logits(hidden, weight, i, sl, keep, temperature)
            m, zt = _centre_and_pick(z, targets[i, sl], rank, group, tp)
            e = torch.exp(z)
            if keep is not None:
                z.masked_fill_(~keep, 0.0)  # (-inf) x 0 would be NaN; those rows carry no mass
            sums = torch.stack([zt, e.sum(dim=-1), (e * z).sum(dim=-1)])
            if tp > 1:
                dist.all_reduce(sums, group=group)
            zt, s, ez = sums[0], sums[1], sums[2]
            lp[i, sl] = zt - torch.log(s)
            ent[i, sl] = torch.log(s) - ez / s
            maxes[i, sl], sums_z[i, sl], mean_z[i, sl] = m, s, ez / s
        ctx.save_for_backward(hidden, weight, targets, maxes, sums_z, mean_z)
        ctx.vocab_size, ctx.temperature, ctx.chunk = vocab_size, temperature, chunk
        ctx.set_materialize_grads(False)
        return lp, ent

    @staticmethod
    def backward(ctx, g_lp, g_ent):
        hidden, weight, targets, maxes, sums_z, mean_z = ctx.saved_tensors
        _group, _tp_size, rank = _tp()
        per = weight.shape[0]
        keep = _vocab_keep_of(per, ctx.vocab_size, rank, weight.device)
        d_hidden = torch.zeros_like(hidden) if ctx.needs_input_grad[0] else None
        d_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) \
            if ctx.needs_input_grad[1] else None
        for i, sl in _chunks(hidden.shape, ctx.chunk):
            z = _logits(hidden, weight, i, sl, keep, ctx.temperature)
            z.sub_(maxes[i, sl].unsqueeze(-1))
            p = torch.exp(z).div_(sums_z[i, sl].unsqueeze(-1))  # padding rows: 0
            d = torch.zeros_like(p)
            if g_lp is not None:
                local = targets[i, sl] - rank * per
                inside = (local >= 0) & (local < per)
                rows = torch.arange(p.shape[0], device=p.device)[inside]
                d.sub_(p * g_lp[i, sl].unsqueeze(-1))
                d[rows, local[inside]] += g_lp[i, sl][inside]
            if g_ent is not None:
                if keep is not None:
                    z.masked_fill_(~keep, 0.0)
                # z - m - (E_p[z] - m): the centred logits
                z.sub_((mean_z[i, sl]).unsqueeze(-1))
                d.sub_(p.mul_(z).mul_(g_ent[i, sl].unsqueeze(-1)))
            if ctx.temperature != 1.0:
                d.div_(ctx.temperature)
            if keep is not None:
                d.masked_fill_(~keep, 0.0)
            h = hidden[i, sl]
            if d_hidden is not None:
                d_hidden[i, sl] = d.to(weight.dtype) @ weight
            if d_weight is not None:
                d_weight.addmm_(d.t(), h.to(torch.float32))
        if d_weight is not None:
            d_weight = d_weight.to(weight.dtype)
        return d_hidden, d_weight, None, None, None, None


def _logits(hidden, weight, i: int, sl: slice, keep, temperature: float) -> torch.Tensor:
    """Positions ``sl`` of row ``i``: ``h W^T`` in the model's dtype (megatron's output layer), then
    an fp32 copy divided by the temperature, padding vocabulary rows at -inf."""
    z = F.linear(hidden[i, sl], weight).to(torch.float32)
    if temperature != 1.0:
        z.div_(temperature)
    if keep is not None:
        z.masked_fill_(~keep, float("-inf"))
    return z


def fused_log_probs(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, vocab_size: int,
                    temperature: float = 1.0, chunk: int = 1024) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(log softmax(h W^T / T)[target], entropy of softmax(h W^T / T))``, each ``(b, s)`` fp32, from
    ``(b, s, h)`` hidden states and this TP rank's ``(V/tp, h)`` output weight, ``chunk`` positions
    at a time (module doc); differentiable in both, identical on every TP rank."""
    if chunk < 1:
        raise ValueError(f"chunk must be >= 1 position, got {chunk}")
    if hidden.shape[:2] != targets.shape:
        raise ValueError(f"hidden states {tuple(hidden.shape)} and targets {tuple(targets.shape)} disagree")
    return _FusedOutput.apply(hidden, weight, targets, int(vocab_size), float(temperature), int(chunk))


class HiddenHead:
    """The model's output is its last hidden states; the vocabulary terms come from
    :func:`fused_log_probs` with this rank's output ``weight``."""

    def __init__(self, weight: torch.Tensor, vocab_size: int, chunk: int):
        self.weight, self.vocab_size, self.chunk = weight, vocab_size, chunk

    def log_probs(self, output: torch.Tensor, nxt: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
        return fused_log_probs(output, self.weight, nxt, self.vocab_size, temperature, self.chunk)[0]

    def next_token_log_probs_and_entropy(self, output: torch.Tensor, mb, entropy_grad: bool):
        """``(log-probs, entropies)`` of a training micro-batch's rows (``next_token_terms``), from one
        pass of the output layer; the entropy's gradient flows only with ``entropy_grad``."""
        def both(out, nxt):
            lp, ent = fused_log_probs(out, self.weight, nxt, self.vocab_size, 1.0, self.chunk)
            return torch.stack([lp, ent if entropy_grad else ent.detach()], dim=-1)

        terms = next_token_terms(output, mb, both)
        return terms[..., 0], terms[..., 1]


class LogitsHead:
    """The model's output is its vocab-parallel logits (:mod:`megarl.models.vocab_parallel`,
    megatron's kernel on the whole micro-batch)."""

    def __init__(self, vocab_size: int, chunk: int = 0):
        self.vocab_size, self.chunk = vocab_size, chunk

    def log_probs(self, output: torch.Tensor, nxt: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
        return token_log_probs_from_logits(output, nxt, self.vocab_size, temperature, self.chunk)

    def next_token_log_probs_and_entropy(self, output: torch.Tensor, mb, entropy_grad: bool):
        """As :meth:`HiddenHead.next_token_log_probs_and_entropy`; the entropy from detached logits
        without ``entropy_grad``."""
        V, chunk = self.vocab_size, self.chunk
        lp = next_token_terms(output, mb, lambda logits, nxt: token_log_probs_from_logits(logits, nxt, V,
                                                                                               chunk=chunk))
        with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
            ent = next_token_terms(output if entropy_grad else output.detach(), mb,
                                   lambda logits, _nxt: vocab_parallel_entropy(logits, V, chunk))
        return lp, ent


def _output_weight(model) -> torch.Tensor:
    """The weight megatron's ``GPTModel`` hands its output layer on this (last) stage."""
    if model.share_embeddings_and_output_weights:
        return model.shared_embedding_or_output_weight()
    return model.output_layer.weight


def _fusable(model) -> bool:
    from megatron.core.tensor_parallel import ColumnParallelLinear

    layer = getattr(model, "output_layer", None)
    return isinstance(layer, ColumnParallelLinear) and layer.bias is None and not getattr(model, "mtp_process", False)


@contextlib.contextmanager
def output_head(model, vocab_size: int, chunk: int) -> Iterator[object]:
    """The head that turns ``model``'s outputs into log-probs and entropies while the context is
    open.  ``chunk`` > 0 (``algo.log_prob_chunk``): the last stage's output layer returns its input
    as megatron prepares it (``(s, b, h)`` hidden states, all-gathered along the sequence under
    sequence parallelism; their gradient summed over TP), so the model's output is ``(b, s, h)``,
    and the head is a :class:`HiddenHead` (an output layer this cannot stand in for -- a bias,
    multi-token prediction, a value head -- is refused by key).  ``chunk`` 0: the model's logits and
    a :class:`LogitsHead`.  ``model``: one model or this rank's virtual pipeline chunks."""
    if not chunk:
        yield LogitsHead(vocab_size)
        return
    last = [unwrap(c) for c in as_chunks(model) if unwrap(c).post_process]
    for m in last:
        if not _fusable(m):
            raise ValueError(f"algo.log_prob_chunk={chunk}: this model's output layer "
                             f"({type(getattr(m, 'output_layer', None)).__name__}) is not megatron's column-parallel "
                             "linear without a bias (nor multi-token prediction), so it cannot be applied a chunk "
                             "at a time; set algo.log_prob_chunk=0")
    if not last:  # an earlier pipeline stage: it never sees the output
        yield HiddenHead(None, vocab_size, chunk)
        return
    (inner,) = last
    layer = inner.output_layer
    layer.forward = _hidden_forward(layer)
    try:
        yield HiddenHead(_output_weight(inner), vocab_size, chunk)
    finally:
        del layer.forward  # the class's own forward again


def _hidden_forward(layer):
    """A stand-in for ``ColumnParallelLinear.forward`` that returns the input it would multiply."""
    from megatron.core.tensor_parallel import copy_to_tensor_model_parallel_region, gather_from_sequence_parallel_region

    def forward(input_, weight=None, runtime_gather_output=None):
        if layer.sequence_parallel:
            return gather_from_sequence_parallel_region(input_, tensor_parallel_output_grad=True,
                                                        group=layer.tp_group), None
        if layer.tp_group is not None and layer.tp_group.size() > 1:
            return copy_to_tensor_model_parallel_region(input_, group=layer.tp_group), None
        return input_, None

    return forward
