"""Low-rank adapters on megatron's tensor-parallel linears (``actor.lora``).

LoRA (Hu et al. 2021, arXiv:2106.09685) keeps the base weight ``W`` frozen and trains

    y = W x + s * B A x,        A: (r, in),  B: (out, r),  s = alpha / r

with ``A`` initialised as peft does (Kaiming-uniform, or Gaussian N(0, 1/r)) and ``B = 0``, so
the adapted model starts as the base.  megatron shards ``W`` over the tensor-parallel ranks; the
adapter follows the layer's own split so that its output is the TP=1 output at any TP:

* column-parallel (``linear_qkv``, ``linear_fc1``: ``W`` split by output rows, the input whole on
  every rank): ``A`` whole on every rank, ``B`` split by rows like ``W``.  ``h = A x`` is the same
  on every rank; it enters the TP region through megatron's ``copy_to_tensor_model_parallel_region``
  (identity forward, all-reduce backward) so that ``A`` and ``x`` receive the whole gradient, the
  sum of every rank's output rows.
* row-parallel (``linear_proj``, ``linear_fc2``: ``W`` split by input columns, each rank holding
  its slice of the input): ``A`` split by columns like ``W``, ``B`` whole.  ``h = A_k x_k`` is a
  partial sum, completed by ``reduce_from_tensor_model_parallel_region`` (all-reduce forward,
  identity backward) before ``B`` -- the same reduction megatron applies to ``W x``.

Under sequence parallelism each rank holds a part of the sequence where the linear does: the
column adapter gathers ``h = A x`` over the sequence (``gather_from_sequence_parallel_region``)
and the row adapter reduce-scatters its partial ``h`` (``reduce_scatter_to_sequence_parallel_region``),
as the base layers do; the whole tensor that then saw only this rank's positions (the column
``A``, the row ``B``) is marked ``sequence_parallel`` so that megatron's ``finalize_model_grads``
sums its gradient over the TP ranks.

Mixture-of-experts layers: a routed expert's linears (``mlp.experts.local_experts.{e}.*``) run
with megatron's explicit expert communication -- the token dispatcher gathers the tokens over the
*expert* tensor-parallel group before them and sums their partial outputs after -- so the
adapter adds no communication to its forward: the column ``A x`` is whole on every rank, the row
``A_k x_k`` a partial sum the dispatcher completes with the base's.  Only the whole tensor's
gradient (column ``A``, row ``B``) is a partial sum per rank; it passes through megatron's
``copy_to_tensor_model_parallel_region`` over the expert TP group (identity forward, all-reduce
backward).  The expert adapters carry the base's ``allreduce = False`` at EP > 1, so megatron's
DDP reduces them over the expert data-parallel group as it does the experts; each is seeded by
its *global* expert index, so every EP layout starts from the same adapters.  The shared expert
is an ordinary TP linear and takes the dense path.

The adapters are modules of their own beside the linear they adapt (``linear_qkv_lora`` next to
``linear_qkv``), added to the linear's output by a forward hook: the base's parameter names, its
checkpoint entries and its HF mapping stay as they are.  Each adapter's initial values are drawn
from a generator seeded by the run's seed and the layer's global name, whole, then split: every
layout starts from the same adapters.  The weight stream and the export read the merged weight
``W + s * B A`` shard by shard (``megarl.models.weights._read_shard``; no full merged copy is held): the engine
serves the adapted policy and the manifest proves it.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass
from typing import List, Sequence, Tuple

import torch

from megarl.errors import ConfigError

__all__ = ["LoraError", "LoraSpec", "TARGETS", "LoraAdapter", "apply_lora", "adapters_of",
           "adapters_disabled", "adapted_hf_names", "trainable_parameters"]

#: the megatron linears an adapter can wrap, and how each is split over the TP ranks
TARGETS = {"linear_qkv": "column", "linear_fc1": "column", "linear_proj": "row", "linear_fc2": "row"}


class LoraError(ConfigError):
    """A LoRA setting that cannot apply to this model; the message names the key."""


@dataclass(frozen=True)
class LoraSpec:
    """``rank`` r (> 0), ``alpha`` (the scale is alpha / r), ``dropout`` on the adapter's input,
    ``targets`` (names of :data:`TARGETS`), ``init`` (``kaiming`` | ``gaussian``), ``seed``."""

    rank: int
    alpha: float
    dropout: float
    targets: Tuple[str, ...]
    init: str = "kaiming"
    seed: int = 0

    @property
    def scale(self) -> float:
        return self.alpha / self.rank


def _generator(seed: int, name: str) -> torch.Generator:
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") & ((1 << 63) - 1))


def _initial_a(spec: LoraSpec, name: str, fan_in: int) -> torch.Tensor:
    """The whole ``A`` (r, fan_in) of the layer ``name``, as peft initialises it: Kaiming-uniform
    with a = sqrt(5) (bound 1 / sqrt(fan_in)), or N(0, 1/r)."""
    g = _generator(spec.seed, name)
    if spec.init == "gaussian":
        return torch.randn(spec.rank, fan_in, generator=g, dtype=torch.float64) / spec.rank
    bound = 1.0 / math.sqrt(fan_in)  # kaiming_uniform_(a=sqrt(5)): gain sqrt(1/3), bound gain * sqrt(3 / fan_in)
    return (torch.rand(spec.rank, fan_in, generator=g, dtype=torch.float64) * 2 - 1) * bound


class LoraAdapter(torch.nn.Module):
    """The adapter of one linear: ``A`` and ``B`` as this TP rank holds them (module docstring).

    ``style`` ``column`` | ``row``; ``full_in`` / ``full_out`` the linear's logical sizes;
    ``gated``: a gated MLP's ``linear_fc1`` (its rows are [gate; up] per rank, as the base's)."""

    def __init__(self, spec: LoraSpec, name: str, style: str, full_in: int, full_out: int, tp_rank: int, tp: int,
                 dtype: torch.dtype, device, gated: bool = False, sequence_parallel: bool = False,
                 expert_group=None, allreduce: bool = True):
        super().__init__()
        from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes

        self.style, self.scale, self.gated, self.name = style, spec.scale, gated, name
        #: a routed expert's linear: the expert TP group the dispatcher communicates over (None: dense)
        self.expert_group = expert_group
        self.dropout = torch.nn.Dropout(spec.dropout) if spec.dropout > 0 else torch.nn.Identity()
        a = _initial_a(spec, name, full_in)
        if style == "row":
            step = full_in // tp
            a = a[:, tp_rank * step:(tp_rank + 1) * step]
            out = full_out
        else:
            out = full_out // tp
        self.A = torch.nn.Parameter(a.to(device=device, dtype=dtype).contiguous())
        self.B = torch.nn.Parameter(torch.zeros(out, spec.rank, device=device, dtype=dtype))
        if style == "row":
            set_tensor_model_parallel_attributes(self.A, True, 1, 1)
        else:
            set_tensor_model_parallel_attributes(self.B, True, 0, 1)
        for t in (self.A, self.B):  # False for an expert's at EP > 1: DDP reduces it over the expert DP group
            t.allreduce = allreduce
        self.sequence_parallel = sequence_parallel and tp > 1 and expert_group is None
        if self.sequence_parallel:
            # the whole tensor on every rank, its gradient from this rank's part of the sequence:
            # finalize_model_grads sums it over the TP ranks (as for the norms under SP)
            (self.B if style == "row" else self.A).sequence_parallel = True
        self.enabled = True

    def delta(self, x: torch.Tensor) -> torch.Tensor:
        """``s * B A x`` for this rank's part of the linear's output (under sequence parallelism a
        column linear's input and a row linear's output are this rank's part of the sequence)."""
        from megatron.core.tensor_parallel import mappings

        if self.expert_group is not None:  # the dispatcher gathers the input and sums the outputs
            a, b = self.A, self.B
            if self.style == "row":
                b = _sum_grad_over(b, self.expert_group)
            else:
                a = _sum_grad_over(a, self.expert_group)
            return torch.nn.functional.linear(torch.nn.functional.linear(self.dropout(x), a), b) * self.scale
        h = torch.nn.functional.linear(self.dropout(x), self.A)
        if self.style == "row":
            h = (mappings.reduce_scatter_to_sequence_parallel_region(h) if self.sequence_parallel
                 else mappings.reduce_from_tensor_model_parallel_region(h))
        else:
            h = (mappings.gather_from_sequence_parallel_region(h) if self.sequence_parallel
                 else mappings.copy_to_tensor_model_parallel_region(h))
        return torch.nn.functional.linear(h, self.B) * self.scale

    def merged(self, weight: torch.Tensor) -> torch.Tensor:
        """This rank's shard of ``W + s * B A`` (``weight`` this rank's shard of ``W``)."""
        return (weight.float() + self.scale * (self.B.detach().float() @ self.A.detach().float())).to(weight.dtype)

    def sharded_state_dict(self, prefix: str = "", sharded_offsets=(), metadata=None):
        """megatron's sharded entries: the split factor as the linear's (a gated fc1's ``B`` as the
        base's [gate; up] rows, so that a checkpoint loads at another TP)."""
        from megatron.core import parallel_state as ps
        from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

        axis = {"A": 1} if self.style == "row" else {"B": 0}
        sd = make_sharded_tensors_for_checkpoint(
            {"A": self.A, "B": self.B}, prefix, axis, sharded_offsets,
            tp_group=self.expert_group or ps.get_tensor_model_parallel_group(),
            dp_cp_group=(metadata or {}).get("dp_cp_group") or ps.get_data_parallel_group(with_context_parallel=True))
        if self.gated:
            from megatron.core.transformer.mlp import apply_swiglu_sharded_factory

            key = f"{prefix}B"
            sd[key] = apply_swiglu_sharded_factory(sd[key], sharded_offsets,
                                                   (metadata or {}).get("singleton_local_shards", False))
        return sd


def _sum_grad_over(t: torch.Tensor, group) -> torch.Tensor:
    """``t`` unchanged forward; its gradient summed over ``group`` backward (each expert TP rank
    holds a part of the whole tensor's gradient)."""
    from megatron.core.tensor_parallel import mappings

    return mappings.copy_to_tensor_model_parallel_region(t, group=group)


def _layer_input_norm(module, x: torch.Tensor) -> torch.Tensor:
    """A transformer-engine linear that fuses the layer norm before it (``LayerNormColumnParallelLinear``)
    reads the normalised input: the adapter reads the same.  (GPU only; not run here.)"""
    w = getattr(module, "layer_norm_weight", None)
    if w is None:
        return x
    if getattr(module, "zero_centered_gamma", False):
        w = w + 1
    eps = getattr(module, "eps", 1e-5)
    if getattr(module, "normalization", "LayerNorm") == "RMSNorm":
        return torch.nn.functional.rms_norm(x, (x.shape[-1],), w, eps)
    return torch.nn.functional.layer_norm(x, (x.shape[-1],), w, getattr(module, "layer_norm_bias", None), eps)


def _hook(adapter: LoraAdapter):
    def add_delta(module, inputs, output):
        if not adapter.enabled:
            return output
        out, bias = output
        return out + adapter.delta(_layer_input_norm(module, inputs[0])).to(out.dtype), bias

    return add_delta


def _linear_sizes(module, style: str, tp: int) -> Tuple[int, int]:
    """The linear's logical (in, out) sizes from its weight shard."""
    out, inp = module.weight.shape
    return (inp * tp, out) if style == "row" else (inp, out * tp)


def apply_lora(model, spec: LoraSpec, key: str = "actor.lora") -> List[LoraAdapter]:
    """Freeze every parameter of ``model`` (a megatron model or its chunks) and add an adapter
    beside each target linear; returns the adapters.  Raises LoraError naming ``key``'s field for
    an unknown target, a target the model does not have, a rank above a target's smaller size, or
    a linear it cannot wrap (a grouped-GEMM expert block)."""
    from megatron.core import parallel_state as ps

    from megarl.models.mapping import canonical_name, expert_offset
    from megarl.models.weights import chunks_of

    unknown = sorted(set(spec.targets) - set(TARGETS))
    if unknown:
        raise LoraError(f"{key}.target_modules: {unknown} are not linears megarl adapts; choose from {sorted(TARGETS)}")
    if spec.rank < 1:
        raise LoraError(f"{key}.rank: must be >= 1 to apply adapters, got {spec.rank}")
    tp, tp_rank = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
    adapters: List[LoraAdapter] = []
    found = set()
    for chunk in chunks_of(model):
        for p in chunk.parameters():
            p.requires_grad_(False)
        layers = getattr(getattr(chunk, "decoder", None), "layers", [])
        numbers = [layer.layer_number for layer in layers]
        offset = expert_offset(chunk)
        for name, module in list(chunk.named_modules()):
            parent_name, _, leaf = name.rpartition(".")
            if leaf not in spec.targets:
                continue
            routed = ".experts." in f".{name}."
            if routed and not isinstance(getattr(module, "weight", None), torch.Tensor):
                raise LoraError(f"{key}.target_modules: {leaf} of {name} is a grouped-GEMM expert block "
                                "(moe_grouped_gemm), which LoRA does not wrap; megarl builds SequentialMLP experts")
            group = ps.get_expert_tensor_parallel_group() if routed else None
            lin_tp, lin_rank = (group.size(), group.rank()) if routed else (tp, tp_rank)
            style = TARGETS[leaf]
            full_in, full_out = _linear_sizes(module, style, lin_tp)
            if spec.rank > min(full_in, full_out):
                raise LoraError(f"{key}.rank: {spec.rank} is above {leaf}'s smaller size min({full_in}, {full_out}) "
                                f"= {min(full_in, full_out)} ({name})")
            parent = chunk.get_submodule(parent_name)
            gated = leaf == "linear_fc1" and getattr(parent.config, "gated_linear_unit", False)
            global_name = canonical_name(f"{name}.weight", numbers, offset).removesuffix(".weight")
            adapter = LoraAdapter(spec, global_name, style, full_in, full_out, lin_rank, lin_tp,
                                  dtype=module.weight.dtype, device=module.weight.device, gated=gated,
                                  sequence_parallel=bool(getattr(parent.config, "sequence_parallel", False)),
                                  expert_group=group, allreduce=getattr(module.weight, "allreduce", True))
            parent.add_module(f"{leaf}_lora", adapter)
            module.register_forward_hook(_hook(adapter))
            module.weight.megarl_lora = adapter  # the weight stream reads the merged weight
            adapters.append(adapter)
            found.add(leaf)
    missing = sorted(set(spec.targets) - found)
    if missing:
        raise LoraError(f"{key}.target_modules: the model has no {missing}")
    return adapters


def adapters_of(model) -> List[LoraAdapter]:
    from megarl.models.weights import chunks_of

    return [m for c in chunks_of(model) for m in c.modules() if isinstance(m, LoraAdapter)]


def trainable_parameters(model) -> Sequence[torch.nn.Parameter]:
    from megarl.models.weights import chunks_of

    return [p for c in chunks_of(model) for p in c.parameters() if p.requires_grad]


def adapters_disabled(model):
    """A context in which ``model`` computes as its base (every adapter off): the LoRA actor's
    reference without a second copy of the model."""
    import contextlib

    @contextlib.contextmanager
    def off():
        adapters = adapters_of(model)
        before = [a.enabled for a in adapters]
        for a in adapters:
            a.enabled = False
        try:
            yield
        finally:
            for a, was in zip(adapters, before, strict=True):
                a.enabled = was

    return off()


def adapted_hf_names(model) -> frozenset:
    """Collective: the HF names of every tensor an adapter changes (over all pipeline stages): the
    merged weights a LoRA actor's update moves; nothing else of the model ever does."""
    import torch.distributed as dist

    from megarl.models import mapping
    from megarl.models.weights import unwrap

    mine = sorted({a.name for a in adapters_of(model)})
    every = [mine]
    if dist.is_initialized():
        every = [None] * dist.get_world_size()
        dist.all_gather_object(every, mine)
    names = {n for part in every for n in part}
    return frozenset(h for r in mapping.rules(unwrap(model).megarl_spec)
                     if r.megatron_name.removesuffix(".weight") in names for h in r.hf_names)
