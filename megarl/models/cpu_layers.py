"""megarl's stand-ins for megatron-core's local layers on a machine without CUDA, as ModuleSpecs.

megatron's local spec (``get_gpt_layer_local_spec``, the only one without transformer-engine)
lacks three things megarl proves on CPU: its ``DotProductAttention`` refuses packed (THD)
sequences and context parallelism (only TE's attention has them), and its torch norm refuses
``config.sequence_parallel``.  :func:`local_spec` puts :class:`LocalAttention` (a THD path,
:func:`thd_core_attention`, and a context-parallel one, :func:`context_parallel_core_attention`)
and :class:`SequenceParallelTorchNorm` in their places, the megatron-core way; megatron's
classes themselves are not touched.  Every other call is megatron's own code.

``models/builder.py`` uses it where ``cpu_compat.use_local_layer_stand_ins()`` says so: on CPU.
On CUDA the local spec stays megatron's own (no packed sequences, context or sequence
parallelism without transformer-engine), and with TE the TE spec is used.
``tests/multiproc/test_cpu_compat.py`` fails loudly when megatron changes the surface overridden here.
"""
from __future__ import annotations

import copy
import dataclasses

import torch
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.torch_norm import WrappedTorchNorm

from megarl.models.context_parallel import all_positions

__all__ = ["LocalAttention", "SequenceParallelTorchNorm", "local_spec"]


def sequence_parallel_norm(original_new, cls, config, hidden_size: int, eps: float = 1e-5, **kwargs):
    """megatron's local (torch) norm under sequence parallelism: the same ``torch.nn.RMSNorm`` /
    ``LayerNorm``, its weights marked ``sequence_parallel`` so that ``finalize_model_grads``
    sums their gradients over the TP ranks (each rank's norm saw 1/tp of the sequence).  That is
    what transformer-engine's and apex's norms do; megatron's torch norm refuses
    ``config.sequence_parallel`` instead (``transformer/torch_norm.py``)."""
    if not config.sequence_parallel:
        return original_new(cls, config, hidden_size, eps, **kwargs)
    plain = copy.copy(config)  # the same settings, read by the norm's constructor only
    object.__setattr__(plain, "sequence_parallel", False)
    norm = original_new(cls, plain, hidden_size, eps, **kwargs)
    for p in norm.parameters():
        p.sequence_parallel = True
    return norm


#: How :func:`thd_core_attention` computes a packed micro-batch.  "repad": scatter the
#: sequences into a ``[max_seqlen, n_seqs]`` grid and run megatron's own attention with its causal
#: mask (cost ``n_seqs * max_seqlen**2``, the padded forward's attention; TE's varlen kernels pay
#: ``sum(len_i**2)``); "block_mask": one
#: ``[t, t]`` block-diagonal causal mask over the whole pack (cost ``t**2``; the literal
#: definition, kept to cross-check "repad" in tests and bench/packing.py).
THD_ATTENTION = "repad"


def thd_core_attention(original, module, query, key, value, packed_seq_params):
    """Causal self-attention of a packed (THD) micro-batch through megatron's local attention.

    ``query`` ``[t, np, hn]`` and ``key`` / ``value`` ``[t, ng, hn]`` hold the tokens of the
    sequences delimited by ``packed_seq_params.cu_seqlens_q`` back to back (RoPE was already
    applied per sequence by megatron).  Token k of sequence i attends to tokens of sequence i at
    or before k and to nothing else.  Returns ``[t, np * hn]``, the layout TE returns for THD.
    """
    from megatron.core.transformer.enums import AttnMaskType

    if module.attn_mask_type != AttnMaskType.causal:
        raise NotImplementedError(f"packed sequences on CPU: only causal self-attention, not {module.attn_mask_type}")
    cu = packed_seq_params.cu_seqlens_q
    for name in ("cu_seqlens_kv", "cu_seqlens_q_padded", "cu_seqlens_kv_padded"):
        other = getattr(packed_seq_params, name)
        if other is not None and other is not cu and not torch.equal(other, cu):
            raise NotImplementedError(f"packed sequences on CPU: {name} must equal cu_seqlens_q (self-attention, "
                                      "no padding between sequences)")
    if query.dim() == 4:  # [t, 1, np, hn]
        query, key, value = query.squeeze(1), key.squeeze(1), value.squeeze(1)
    t = query.shape[0]
    if int(cu[-1]) != t:
        raise ValueError(f"packed sequences: cu_seqlens ends at {int(cu[-1])}, but the pack has {t} tokens")
    cu = cu.to(device=query.device, dtype=torch.long)
    lengths = cu[1:] - cu[:-1]
    n = lengths.numel()
    seq = torch.repeat_interleave(torch.arange(n, device=query.device), lengths, output_size=t)
    if THD_ATTENTION == "block_mask":
        masked = (seq[:, None] != seq[None, :]) | torch.ones(t, t, dtype=torch.bool, device=query.device).triu(1)
        ctx = original(module, query.unsqueeze(1), key.unsqueeze(1), value.unsqueeze(1), masked[None, None])
        return ctx.reshape(t, -1)
    if THD_ATTENTION != "repad":
        raise ValueError(f"cpu_layers.THD_ATTENTION={THD_ATTENTION!r}: expected 'repad' or 'block_mask'")
    width = int(lengths.max()) if n else 0
    pos = torch.arange(t, device=query.device) - torch.repeat_interleave(cu[:-1], lengths, output_size=t)
    flat = pos * n + seq  # token k sits at [pos_k, seq_k] of a [width, n] (sbhd) grid

    def grid(x):
        return x.new_zeros((width * n, *x.shape[1:])).index_copy_(0, flat, x).view(width, n, *x.shape[1:])

    # the explicit mask is the one megatron builds for a causal module given none
    causal = torch.ones(width, width, dtype=torch.bool, device=query.device).triu(1)
    ctx = original(module, grid(query), grid(key), grid(value), causal)  # [width, n, np * hn]
    return ctx.reshape(width * n, -1).index_select(0, flat)


class _GatherOverContext(torch.autograd.Function):
    """All-gather ``[s / cp, ...]`` over the context-parallel group along the first dimension
    (rank after rank); the backward sums every rank's gradient of this rank's part
    (reduce-scatter): each CP rank's queries attend to every rank's keys and values."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        n = torch.distributed.get_world_size(group)
        out = x.new_empty((n * x.shape[0],) + tuple(x.shape[1:]))
        torch.distributed.all_gather_into_tensor(out, x.contiguous(), group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        n = torch.distributed.get_world_size(ctx.group)
        out = grad.new_empty((grad.shape[0] // n,) + tuple(grad.shape[1:]))
        torch.distributed.reduce_scatter_tensor(out, grad.contiguous(), group=ctx.group)
        return out, None


def context_parallel_core_attention(original, module, query, key, value, packed_seq_params=None):
    """Causal self-attention of this context-parallel rank's zig-zag share of the sequence
    (:mod:`megarl.models.context_parallel`) through megatron's local attention: the keys and values
    of every CP rank are all-gathered (each rank's part in that rank's order), and query position
    ``p`` attends to key position ``q`` iff ``q <= p`` in the *whole* sequence -- and, for a packed
    (THD) pack, iff both are in the same ``cu_seqlens`` sequence (each sequence split on its own).
    The function of transformer-engine's CP attention (which exchanges the K/V chunks ring-wise
    instead, without ever holding them all); ``[sq, b, np, hn]`` in, ``[sq, b, np * hn]`` out
    (THD: ``[t, np, hn]`` in, ``[t, np * hn]`` out)."""
    from megatron.core import parallel_state as ps
    from megatron.core.transformer.enums import AttnMaskType

    if module.attn_mask_type != AttnMaskType.causal:
        raise NotImplementedError("context parallelism on CPU: only causal self-attention, "
                                  f"not {module.attn_mask_type}")
    thd = packed_seq_params is not None
    if thd and query.dim() == 3:  # [t, np, hn]: a batch of one
        query, key, value = query.unsqueeze(1), key.unsqueeze(1), value.unsqueeze(1)
    group = ps.get_context_parallel_group()
    cp, rank = torch.distributed.get_world_size(group), ps.get_context_parallel_rank()
    local = query.shape[0]
    length = local * cp
    cu = packed_seq_params.cu_seqlens_q.to(device=query.device, dtype=torch.long) if thd else None
    key, value = _GatherOverContext.apply(key, group), _GatherOverContext.apply(value, group)
    k_pos = all_positions(length, cp, query.device, cu)  # the whole-pack position of each gathered key
    q_pos = k_pos[rank * local:(rank + 1) * local]
    masked = k_pos[None, :] > q_pos[:, None]  # True: not attended (megatron's mask convention)
    if thd:  # and nothing across a sequence boundary
        seq = torch.bucketize(k_pos, cu[1:], right=True)
        masked |= seq[None, :] != seq[rank * local:(rank + 1) * local, None]
    out = original(module, query, key, value, masked[None, None])
    return out.reshape(local, -1) if thd else out


def local_attention_init(original_init, module, config, *args, **kwargs) -> None:
    """megatron's local ``DotProductAttention`` built for a context-parallel model: it asserts
    ``context_parallel_size == 1`` (only transformer-engine's attention splits the sequence on
    CUDA); the stand-in (:func:`context_parallel_core_attention`) does it on CPU, so the module is
    built from the same settings at cp 1 and then holds the real ones."""
    if config.context_parallel_size == 1:
        return original_init(module, config, *args, **kwargs)
    plain = copy.copy(config)  # read by the constructor only
    object.__setattr__(plain, "context_parallel_size", 1)
    original_init(module, plain, *args, **kwargs)
    module.config = config


class LocalAttention(DotProductAttention):
    """megatron's local ``DotProductAttention`` with a packed (THD) path and a context-parallel
    stand-in; a call without ``packed_seq_params`` at cp 1 is megatron's own forward, untouched."""

    takes_thd = True  # read by models/forward.py before a packed forward

    def __init__(self, config, *args, k_channels=None, v_channels=None, **kwargs):
        local_attention_init(DotProductAttention.__init__, self, config, *args, **kwargs)
        if v_channels is not None:
            # multi-latent attention: keys of k_channels, values of v_channels per head (TE's
            # attention takes both; megatron's local one assumes kv_channels for both)
            tp = self.pg_collection.tp.size()
            self.hidden_size_per_partition = v_channels * config.num_attention_heads // tp
            self.hidden_size_per_attention_head = k_channels

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        original = DotProductAttention.forward
        thd = packed_seq_params is not None and packed_seq_params.qkv_format == "thd"
        if self.config.context_parallel_size > 1:
            if attention_bias is not None:
                raise NotImplementedError("context parallelism on CPU: no attention bias")
            return context_parallel_core_attention(original, self, query, key, value,
                                                   packed_seq_params if thd else None)
        if not thd:
            return original(self, query, key, value, attention_mask, attn_mask_type=attn_mask_type,
                            attention_bias=attention_bias, packed_seq_params=packed_seq_params)
        if attention_bias is not None:
            raise NotImplementedError("packed sequences on CPU: no attention bias")
        return thd_core_attention(original, self, query, key, value, packed_seq_params)


class SequenceParallelTorchNorm(WrappedTorchNorm):
    """megatron's torch norm, built by :func:`sequence_parallel_norm` (its weights marked
    ``sequence_parallel`` under sequence parallelism); like megatron's, a factory of
    ``torch.nn.RMSNorm`` / ``LayerNorm`` instances."""

    def __new__(cls, config, hidden_size, eps=1e-5, **kwargs):
        return sequence_parallel_norm(WrappedTorchNorm.__new__, cls, config, hidden_size, eps, **kwargs)


#: megatron's local layer -> its stand-in here
SUBSTITUTES = {DotProductAttention: LocalAttention, WrappedTorchNorm: SequenceParallelTorchNorm}


def local_spec(spec, config, vp_stage=None):
    """megatron's local layer spec (a ``ModuleSpec`` of one layer) or block spec
    (``TransformerBlockSubmodules``) with :data:`SUBSTITUTES` in place of megatron's classes.

    A layer spec becomes the block spec megatron's ``TransformerBlock`` would derive from it
    (that layer on every layer this stage builds, and the module-level ``LayerNormImpl`` as
    the final norm), so the final norm is substituted too."""
    from megatron.core.transformer import transformer_block as tb

    if isinstance(spec, ModuleSpec) and not issubclass(spec.module, tb.TransformerBlock):
        spec = tb.TransformerBlockSubmodules(
            layer_specs=[spec] * tb.get_num_layers_to_build(config, vp_stage=vp_stage),
            layer_norm=tb.LayerNormImpl)
    return _substitute(spec, {})


def _substitute(node, memo: dict):
    # memo: a spec shared between layers stays shared (megatron repeats one layer spec)
    if id(node) in memo:
        return memo[id(node)]
    out = node
    if isinstance(node, type):
        out = SUBSTITUTES.get(node, node)
    elif isinstance(node, list):
        out = [_substitute(x, memo) for x in node]
    elif isinstance(node, tuple):
        out = tuple(_substitute(x, memo) for x in node)
    elif dataclasses.is_dataclass(node) and not isinstance(node, type):
        changes = {}
        for f in dataclasses.fields(node):
            if not f.init:
                continue
            value = getattr(node, f.name)
            new = _substitute(value, memo)
            if new is not value:
                changes[f.name] = new
        out = dataclasses.replace(node, **changes) if changes else node
    memo[id(node)] = out
    return out
