"""The single source of truth for HF <-> megatron tensor names and layouts.

Every path that moves weights between the two worlds goes through this module: HF
checkpoint import (each TP rank reads only the rows/columns it owns), export back to HF
safetensors, and the hybrid-engine weight sync that streams logical HF-named tensors into
the rollout engine.

Layouts (megatron-core ``attention.py`` / ``mlp.py``; Megatron-Bridge ``param_mapping.py``):

* ``linear_qkv`` is grouped per query group g: rows ``[q heads of g; k_g; v_g]`` with
  ``heads_per_group * head_dim`` q rows.  TP splits dim 0, so a rank holds whole groups.
  Biases follow the same layout.  RoPE is rotate-half in both, so no q/k permutation.
* ``linear_fc1`` (SwiGLU) is logically ``[gate; up]``, but TP rank r holds
  ``[gate_r; up_r]``: gate and up are split separately, then concatenated per rank.
* Row-parallel weights (``linear_proj``, ``linear_fc2``) split dim 1; their biases are
  replicated (added after the all-reduce).
* Embedding and output layer: the vocabulary is padded with zero rows to the padded size,
  split over TP along dim 0, and the padding is dropped on export.
* Tied embeddings: only ``embedding.word_embeddings.weight`` is mapped; HF ``lm_head.weight``
  is absent (or ignored on import when it equals the embedding).
* Mixture-of-experts layers: router replicated, routed experts laid out like a dense MLP over
  the *expert* TP group, named by global expert index (:func:`_moe_rules` says how).
* Layer names are global (``decoder.layers.{global}``): :func:`canonical_name` maps a PP stage's
  local names, and the transformer-engine spec's fused norms, to them.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch

from megarl.errors import MegarlError
from megarl.models.hf_config import ModelSpec

# Layout kinds.
REPLICATED = "replicated"
VOCAB = "vocab"
ROW = "row"  # TP-split along dim 1
COLUMN = "column"  # TP-split along dim 0, one HF tensor (multi-latent attention's projections)
QKV = "qkv"
GATE_UP = "gate_up"

_TE_ALIASES = {
    "self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
    "mlp.linear_fc1.layer_norm_weight": "pre_mlp_layernorm.weight",
    # multi-latent attention: TE fuses the latent norms into the up projections
    "self_attention.linear_q_up_proj.layer_norm_weight": "self_attention.q_layernorm.weight",
    "self_attention.linear_kv_up_proj.layer_norm_weight": "self_attention.kv_layernorm.weight",
}
#: buffers the mapping carries like parameters: DeepSeek-V3's expert-score bias (megatron keeps it
#: a float32 buffer of the router; it is part of the function and of the checkpoint)
MAPPED_BUFFERS = ("mlp.router.expert_bias",)
_LAYER_RE = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
_LOCAL_EXPERT_RE = re.compile(r"^mlp\.experts\.local_experts\.(\d+)\.(.+)$")

#: Which tensor-parallel group splits a parameter: the ordinary one, or the experts' own.
TP_GROUP = "tp"
EXPERT_TP_GROUP = "etp"


@dataclass(frozen=True)
class MoEHFNames:
    """The HF tensor names of one MoE block, relative to ``model.layers.{i}.``.

    ``expert`` is formatted with the global expert index ``e``; ``gate`` / ``up`` / ``down`` are
    the expert MLP's projections (also the shared expert's, under ``shared``)."""

    block: str  # the module holding the router and the experts
    router: str
    expert: str
    gate: str
    up: str
    down: str
    shared: Optional[str] = None  # the shared expert MLP
    shared_gate: Optional[str] = None  # its sigmoid gate (Qwen2-MoE)
    router_bias: Optional[str] = None  # the expert-score bias the choice adds (DeepSeek-V3)


#: MoESpec.hf_layout -> the HF names of that family's MoE block
MOE_HF_NAMES = {
    "qwen_moe": MoEHFNames(block="mlp", router="gate.weight", expert="experts.{e}", gate="gate_proj",
                           up="up_proj", down="down_proj", shared="shared_expert",
                           shared_gate="shared_expert_gate.weight"),
    "mixtral": MoEHFNames(block="block_sparse_moe", router="gate.weight", expert="experts.{e}", gate="w1",
                          up="w3", down="w2"),
    "deepseek": MoEHFNames(block="mlp", router="gate.weight", expert="experts.{e}", gate="gate_proj",
                           up="up_proj", down="down_proj", shared="shared_experts",
                           router_bias="gate.e_score_correction_bias"),
}


class MappingError(MegarlError, ValueError):
    """A tensor that does not fit the mapping; the message names it."""


@dataclass(frozen=True)
class ParamRule:
    """How one logical megatron parameter is made of HF tensors."""

    megatron_name: str  # canonical, global layer index
    hf_names: Tuple[str, ...]
    kind: str
    layer: Optional[int] = None  # global layer index; None for embedding / final / output
    where: str = "layer"  # "first" stage, "last" stage or the stage owning ``layer``
    #: the intermediate size of the MLP a GATE_UP / ROW rule belongs to, when it is not the dense
    #: ``ffn_hidden_size`` (routed and shared experts)
    ffn: Optional[int] = None
    expert: Optional[int] = None  # global index of the routed expert; None: not an expert
    tp_group: str = TP_GROUP  # the group that splits it (EXPERT_TP_GROUP for routed experts)


def rules(spec: ModelSpec) -> List[ParamRule]:
    """All logical megatron parameters of ``spec``, in a fixed canonical order."""
    out = [ParamRule("embedding.word_embeddings.weight", ("model.embed_tokens.weight",), VOCAB,
                     where="first")]
    for i in range(spec.num_layers):
        m, h = f"decoder.layers.{i}", f"model.layers.{i}"
        attn = f"{h}.self_attn"
        mlp = f"{h}.mlp"
        r = [ParamRule(f"{m}.input_layernorm.weight", (f"{h}.input_layernorm.weight",), REPLICATED, i)]
        if spec.mla is not None:
            r.extend(_mla_rules(spec, i))
        else:
            r.append(ParamRule(f"{m}.self_attention.linear_qkv.weight",
                               (f"{attn}.q_proj.weight", f"{attn}.k_proj.weight", f"{attn}.v_proj.weight"), QKV, i))
        if spec.qkv_bias:
            r.append(ParamRule(f"{m}.self_attention.linear_qkv.bias",
                               (f"{attn}.q_proj.bias", f"{attn}.k_proj.bias", f"{attn}.v_proj.bias"), QKV, i))
        if spec.qk_norm:
            r.append(ParamRule(f"{m}.self_attention.q_layernorm.weight", (f"{attn}.q_norm.weight",), REPLICATED, i))
            r.append(ParamRule(f"{m}.self_attention.k_layernorm.weight", (f"{attn}.k_norm.weight",), REPLICATED, i))
        r.append(ParamRule(f"{m}.self_attention.linear_proj.weight", (f"{attn}.o_proj.weight",), ROW, i))
        if spec.linear_bias:
            r.append(ParamRule(f"{m}.self_attention.linear_proj.bias", (f"{attn}.o_proj.bias",), REPLICATED, i))
        r.append(ParamRule(f"{m}.pre_mlp_layernorm.weight", (f"{h}.post_attention_layernorm.weight",), REPLICATED, i))
        if spec.moe is not None and spec.moe.moe_layers[i]:
            r.extend(_moe_rules(spec, i))
            out.extend(r)
            continue
        r.append(ParamRule(f"{m}.mlp.linear_fc1.weight", (f"{mlp}.gate_proj.weight", f"{mlp}.up_proj.weight"), GATE_UP, i))
        if spec.linear_bias:
            r.append(ParamRule(f"{m}.mlp.linear_fc1.bias", (f"{mlp}.gate_proj.bias", f"{mlp}.up_proj.bias"), GATE_UP, i))
        r.append(ParamRule(f"{m}.mlp.linear_fc2.weight", (f"{mlp}.down_proj.weight",), ROW, i))
        if spec.linear_bias:
            r.append(ParamRule(f"{m}.mlp.linear_fc2.bias", (f"{mlp}.down_proj.bias",), REPLICATED, i))
        out.extend(r)
    out.append(ParamRule("decoder.final_layernorm.weight", ("model.norm.weight",), REPLICATED, where="last"))
    if spec.value_head:
        out.append(ParamRule("output_layer.weight", ("score.weight",), REPLICATED, where="last"))
        if spec.value_head_bias:
            out.append(ParamRule("output_layer.bias", ("score.bias",), REPLICATED, where="last"))
    elif not spec.tie_word_embeddings:
        out.append(ParamRule("output_layer.weight", ("lm_head.weight",), VOCAB, where="last"))
    return out


def _mla_rules(spec: ModelSpec, i: int) -> List[ParamRule]:
    """Multi-latent attention of layer ``i`` (megatron-core ``MLASelfAttention``; HF
    ``DeepseekV3Attention``), every projection one HF tensor:

    * ``linear_q_down_proj`` = ``q_a_proj`` and ``linear_kv_down_proj`` = ``kv_a_proj_with_mqa``
      (rows ``[c_kv; k_rope]``): duplicated, whole on every TP rank
      (:func:`megarl.models.builder.mla_duplicated_down_projections`), before the latent norms
      ``q_layernorm`` = ``q_a_layernorm`` and ``kv_layernorm`` = ``kv_a_layernorm``;
    * ``linear_q_up_proj`` = ``q_b_proj`` (``linear_q_proj`` = ``q_proj`` without a q latent) and
      ``linear_kv_up_proj`` = ``kv_b_proj``: rows per head, ``[q_nope; q_rope]`` and
      ``[k_nope; v]`` in both, so a TP rank's rows are its heads;
    * ``linear_proj`` = ``o_proj``, row-parallel over ``heads x v_head_dim`` (in :func:`rules`).
    """
    m, a = f"decoder.layers.{i}.self_attention", f"model.layers.{i}.self_attn"
    kv_down = ParamRule(f"{m}.linear_kv_down_proj.weight", (f"{a}.kv_a_proj_with_mqa.weight",), REPLICATED, i)
    kv_rest = [ParamRule(f"{m}.kv_layernorm.weight", (f"{a}.kv_a_layernorm.weight",), REPLICATED, i),
               ParamRule(f"{m}.linear_kv_up_proj.weight", (f"{a}.kv_b_proj.weight",), COLUMN, i)]
    if spec.mla.q_lora_rank is None:
        return [ParamRule(f"{m}.linear_q_proj.weight", (f"{a}.q_proj.weight",), COLUMN, i), kv_down, *kv_rest]
    # the two down projections next to each other in the stream: SGLang fuses them into one
    # parameter and loads it only from a call that holds both (weight_stream.iter_buckets)
    return [ParamRule(f"{m}.linear_q_down_proj.weight", (f"{a}.q_a_proj.weight",), REPLICATED, i), kv_down,
            ParamRule(f"{m}.q_layernorm.weight", (f"{a}.q_a_layernorm.weight",), REPLICATED, i),
            ParamRule(f"{m}.linear_q_up_proj.weight", (f"{a}.q_b_proj.weight",), COLUMN, i), *kv_rest]


def mla_hf_shapes(spec: ModelSpec, i: int) -> Dict[str, Tuple[int, ...]]:
    """The HF shapes of layer ``i``'s multi-latent attention (o_proj included)."""
    mla, H, n = spec.mla, spec.hidden_size, spec.num_attention_heads
    a = f"model.layers.{i}.self_attn"
    out = {f"{a}.kv_a_proj_with_mqa.weight": (mla.kv_lora_rank + mla.qk_rope_head_dim, H),
           f"{a}.kv_a_layernorm.weight": (mla.kv_lora_rank,),
           f"{a}.kv_b_proj.weight": (n * (mla.qk_nope_head_dim + mla.v_head_dim), mla.kv_lora_rank),
           f"{a}.o_proj.weight": (H, n * mla.v_head_dim)}
    if mla.q_lora_rank is None:
        out[f"{a}.q_proj.weight"] = (n * mla.q_head_dim, H)
    else:
        out.update({f"{a}.q_a_proj.weight": (mla.q_lora_rank, H), f"{a}.q_a_layernorm.weight": (mla.q_lora_rank,),
                    f"{a}.q_b_proj.weight": (n * mla.q_head_dim, mla.q_lora_rank)})
    return out


def hf_names_in_order(spec: ModelSpec) -> List[str]:
    """Every HF tensor name of ``spec`` once, in the canonical order of :func:`rules` (the order of
    the weight stream and of a weight manifest's entries, whatever the layout)."""
    return [name for rule in rules(spec) for name in rule.hf_names]


def _moe_rules(spec: ModelSpec, i: int) -> List[ParamRule]:
    """The rules of MoE layer ``i``: router, routed experts in global order, shared expert.

    Mixture-of-experts layers (megatron-core ``MoELayer`` with ``SequentialMLP`` experts):
    ``mlp.router.weight`` is the HF router (``gate``) weight, replicated; routed expert e is
    ``mlp.experts.local_experts.{e}.linear_fc1/fc2`` with the same gate/up and row layouts as a
    dense MLP, split over the *expert* tensor-parallel group (``expert_tensor_parallel_size``);
    the shared expert ``mlp.shared_experts.linear_fc1/fc2`` is split over the ordinary TP group and
    its sigmoid gate ``mlp.shared_experts.gate_weight`` is replicated.  Expert names here carry
    the *global* expert index: EP rank r holds experts ``[r * E / ep, (r + 1) * E / ep)`` as its
    local experts 0.. (:func:`canonical_name` adds the offset).  The HF names of the block are
    one entry of :data:`MOE_HF_NAMES` per family layout.
    """
    moe = spec.moe
    names = MOE_HF_NAMES[moe.hf_layout]
    m, blk = f"decoder.layers.{i}.mlp", f"model.layers.{i}.{names.block}"
    out = [ParamRule(f"{m}.router.weight", (f"{blk}.{names.router}",), REPLICATED, i)]
    if moe.router_expert_bias:
        out.append(ParamRule(f"{m}.router.expert_bias", (f"{blk}.{names.router_bias}",), REPLICATED, i))
    F = moe.ffn_hidden_size
    for e in range(moe.num_experts):
        x, hx = f"{m}.experts.local_experts.{e}", f"{blk}.{names.expert.format(e=e)}"
        out.append(ParamRule(f"{x}.linear_fc1.weight", (f"{hx}.{names.gate}.weight", f"{hx}.{names.up}.weight"),
                             GATE_UP, i, ffn=F, expert=e, tp_group=EXPERT_TP_GROUP))
        out.append(ParamRule(f"{x}.linear_fc2.weight", (f"{hx}.{names.down}.weight",), ROW, i, ffn=F, expert=e,
                             tp_group=EXPERT_TP_GROUP))
    S = moe.shared_expert_ffn_hidden_size
    if S:
        sx, hs = f"{m}.shared_experts", f"{blk}.{names.shared}"
        out.append(ParamRule(f"{sx}.linear_fc1.weight", (f"{hs}.{names.gate}.weight", f"{hs}.{names.up}.weight"),
                             GATE_UP, i, ffn=S))
        out.append(ParamRule(f"{sx}.linear_fc2.weight", (f"{hs}.{names.down}.weight",), ROW, i, ffn=S))
        if moe.shared_expert_gate:
            out.append(ParamRule(f"{sx}.gate_weight", (f"{blk}.{names.shared_gate}",), REPLICATED, i))
    return out


def hf_shapes(spec: ModelSpec) -> Dict[str, Tuple[int, ...]]:
    """The shape every HF tensor must have under ``spec`` (used to reject mismatched files)."""
    H, F, V = spec.hidden_size, spec.ffn_hidden_size, spec.vocab_size
    q, kv = spec.num_attention_heads * spec.head_dim, spec.num_query_groups * spec.head_dim
    shapes: Dict[str, Tuple[int, ...]] = {"model.embed_tokens.weight": (V, H), "model.norm.weight": (H,)}
    if spec.value_head:
        shapes["score.weight"] = (1, H)
        if spec.value_head_bias:
            shapes["score.bias"] = (1,)
    elif not spec.tie_word_embeddings:
        shapes["lm_head.weight"] = (V, H)
    for i in range(spec.num_layers):
        h = f"model.layers.{i}"
        a, m = f"{h}.self_attn", f"{h}.mlp"
        shapes.update({f"{h}.input_layernorm.weight": (H,), f"{h}.post_attention_layernorm.weight": (H,)})
        if spec.mla is not None:
            shapes.update(mla_hf_shapes(spec, i))
        else:
            shapes.update({f"{a}.q_proj.weight": (q, H), f"{a}.k_proj.weight": (kv, H),
                           f"{a}.v_proj.weight": (kv, H), f"{a}.o_proj.weight": (H, q)})
        if spec.moe is not None and spec.moe.moe_layers[i]:
            for rule in _moe_rules(spec, i):
                if rule.megatron_name.endswith("router.expert_bias"):
                    shapes[rule.hf_names[0]] = (spec.moe.num_experts,)
                elif rule.kind == REPLICATED:  # the router [experts, H]; the shared expert's gate [1, H]
                    rows = spec.moe.num_experts if rule.megatron_name.endswith("router.weight") else 1
                    shapes[rule.hf_names[0]] = (rows, H)
                for name in rule.hf_names if rule.kind != REPLICATED else ():
                    shapes[name] = (rule.ffn, H) if rule.kind == GATE_UP else (H, rule.ffn)
        else:
            shapes.update({f"{m}.gate_proj.weight": (F, H), f"{m}.up_proj.weight": (F, H),
                           f"{m}.down_proj.weight": (H, F)})
        if spec.qkv_bias:
            shapes.update({f"{a}.q_proj.bias": (q,), f"{a}.k_proj.bias": (kv,), f"{a}.v_proj.bias": (kv,)})
        if spec.qk_norm:
            shapes.update({f"{a}.q_norm.weight": (spec.head_dim,), f"{a}.k_norm.weight": (spec.head_dim,)})
        if spec.linear_bias:
            shapes.update({f"{a}.o_proj.bias": (H,), f"{m}.gate_proj.bias": (F,),
                           f"{m}.up_proj.bias": (F,), f"{m}.down_proj.bias": (H,)})
    return shapes


def canonical_name(local_name: str, layer_numbers: Sequence[int], expert_offset: int = 0) -> str:
    """Map a parameter name of one PP stage (local layer index, TE or local spec) to the
    canonical global name.  ``layer_numbers[i]`` is the 1-based global ``layer_number`` of
    local layer ``i``; ``expert_offset`` is the global index of this EP rank's local expert 0.

    Layer names are global (``decoder.layers.{global}``); a PP stage's local index is offset by
    the layer's ``layer_number``.  The transformer-engine spec fuses the pre-attention and
    pre-MLP norms into ``linear_qkv.layer_norm_weight`` / ``linear_fc1.layer_norm_weight``:
    :func:`canonical_name` maps those to the local-spec names.
    """
    m = _LAYER_RE.match(local_name)
    if not m:
        return local_name
    local, rest = int(m.group(1)), m.group(2)
    rest = _TE_ALIASES.get(rest, rest)
    x = _LOCAL_EXPERT_RE.match(rest)
    if x:
        rest = f"mlp.experts.local_experts.{int(x.group(1)) + expert_offset}.{x.group(2)}"
    return f"decoder.layers.{layer_numbers[local] - 1}.{rest}"


def expert_offset(model) -> int:
    """Global index of this EP rank's first local expert (0 for a dense model)."""
    spec = getattr(model, "megarl_spec", None)
    if spec is None or spec.moe is None:
        return 0
    from megatron.core import parallel_state as ps

    ep, rank = ps.get_expert_model_parallel_world_size(), ps.get_expert_model_parallel_rank()
    return rank * (spec.moe.num_experts // ep)


def expert_owner(rule: ParamRule, spec: ModelSpec, ep: int) -> Optional[int]:
    """The EP rank holding ``rule``'s routed expert (None: not an expert, every EP rank has it)."""
    if rule.expert is None:
        return None
    return rule.expert // (spec.moe.num_experts // ep)


def stage_param_names(model) -> Dict[str, str]:
    """``{canonical name: local name}`` for the parameters of this PP stage's model chunk (and this
    EP rank's experts, named by their global index)."""
    layers = getattr(getattr(model, "decoder", None), "layers", [])
    numbers = [layer.layer_number for layer in layers]
    offset = expert_offset(model)
    out = {}
    for local_name, _ in named_mapped_tensors(model):
        out[canonical_name(local_name, numbers, offset)] = local_name
    return out


def named_mapped_tensors(model):
    """``(local name, tensor)`` of every tensor the mapping moves: the parameters, and the buffers of
    :data:`MAPPED_BUFFERS` (``dict(...)`` of it is what :func:`stage_param_names` names)."""
    yield from model.named_parameters()
    for name, buf in model.named_buffers():
        if buf is not None and name.endswith(MAPPED_BUFFERS):
            yield name, buf


# --------------------------------------------------------------------------------------
# HF -> one TP shard
# --------------------------------------------------------------------------------------

#: read(hf_name, dim, start, stop) -> tensor slice (dim None: the whole tensor)
SliceReader = Callable[[str, Optional[int], int, int], torch.Tensor]


def _chunk(n: int, tp: int, rank: int, what: str) -> Tuple[int, int]:
    if n % tp:
        raise MappingError(f"{what}: size {n} is not divisible by tp={tp}")
    step = n // tp
    return rank * step, (rank + 1) * step


def shard_from_hf(rule: ParamRule, read: SliceReader, spec: ModelSpec, tp_rank: int, tp: int,
                  padded_vocab: int) -> torch.Tensor:
    """Build TP rank ``tp_rank``'s shard of ``rule`` reading only the HF slices it owns (for a
    routed expert, ``tp_rank`` / ``tp`` are the expert tensor-parallel rank and size)."""
    if rule.kind == REPLICATED:
        return read(rule.hf_names[0], None, 0, 0)
    if rule.kind == ROW:
        name = rule.hf_names[0]
        heads_width = spec.num_attention_heads * (spec.mla.v_head_dim if spec.mla is not None else spec.head_dim)
        full = rule.ffn if rule.ffn is not None else {"o_proj": heads_width,
                                                      "down_proj": spec.ffn_hidden_size}[name.split(".")[-2]]
        a, b = _chunk(full, tp, tp_rank, rule.megatron_name)
        return read(name, 1, a, b)
    if rule.kind == COLUMN:
        name = rule.hf_names[0]
        a, b = _chunk(mla_hf_shapes(spec, rule.layer)[name][0], tp, tp_rank, rule.megatron_name)
        return read(name, 0, a, b)
    if rule.kind == VOCAB:
        a, b = _chunk(padded_vocab, tp, tp_rank, rule.megatron_name)
        real_b = min(b, spec.vocab_size)
        parts = []
        if real_b > a:
            parts.append(read(rule.hf_names[0], 0, a, real_b))
        pad_rows = b - max(a, real_b)
        if pad_rows:
            ref = parts[0] if parts else read(rule.hf_names[0], 0, 0, 1)
            parts.append(torch.zeros((pad_rows,) + tuple(ref.shape[1:]), dtype=ref.dtype))
        return torch.cat(parts, 0)
    if rule.kind == GATE_UP:
        a, b = _chunk(spec.ffn_hidden_size if rule.ffn is None else rule.ffn, tp, tp_rank, rule.megatron_name)
        return torch.cat([read(rule.hf_names[0], 0, a, b), read(rule.hf_names[1], 0, a, b)], 0)
    if rule.kind == QKV:
        ng, hd = spec.num_query_groups, spec.head_dim
        hpg = spec.num_attention_heads // ng
        g0, g1 = _chunk(ng, tp, tp_rank, rule.megatron_name + " (query groups)")
        q = read(rule.hf_names[0], 0, g0 * hpg * hd, g1 * hpg * hd)
        k = read(rule.hf_names[1], 0, g0 * hd, g1 * hd)
        v = read(rule.hf_names[2], 0, g0 * hd, g1 * hd)
        n = g1 - g0
        tail = tuple(q.shape[1:])
        fused = torch.cat([q.reshape((n, hpg * hd) + tail), k.reshape((n, hd) + tail),
                           v.reshape((n, hd) + tail)], 1)
        return fused.reshape((n * (hpg + 2) * hd,) + tail)
    raise MappingError(f"{rule.megatron_name}: unknown layout kind {rule.kind!r}")


# --------------------------------------------------------------------------------------
# TP shards -> HF tensors
# --------------------------------------------------------------------------------------

def _cat(tensors: Sequence[torch.Tensor], dim: int) -> torch.Tensor:
    """``torch.cat``, except that one tensor (TP=1) is returned as it is: no copy of the weights."""
    return tensors[0] if len(tensors) == 1 else torch.cat(list(tensors), dim)


def hf_views_from_shards(rule: ParamRule, shards: Sequence[torch.Tensor], spec: ModelSpec,
                         ) -> Dict[str, Tuple[Tuple[int, ...], torch.Tensor]]:
    """Merge the TP shards of ``rule`` (in TP-rank order) into its HF tensors, each given as
    ``(shape, view)``: a tensor whose elements in row-major order are the HF tensor's.

    At TP=1 every view is of the parameter itself.  It has the HF shape wherever the layouts
    agree; megatron's fused QKV gives Q, K and V as strided ``[groups, rows, hidden]`` views, one
    contiguous block per query group, which can be read (checksummed) where they lie and are
    only copied by whoever needs a contiguous tensor (:func:`hf_from_shards`)."""
    def same(t: torch.Tensor):
        return tuple(t.shape), t

    if rule.kind == REPLICATED:
        return {rule.hf_names[0]: same(shards[0])}
    if rule.kind == ROW:
        return {rule.hf_names[0]: same(_cat(shards, 1))}
    if rule.kind == COLUMN:
        return {rule.hf_names[0]: same(_cat(shards, 0))}
    if rule.kind == VOCAB:
        return {rule.hf_names[0]: same(_cat(shards, 0)[: spec.vocab_size])}
    if rule.kind == GATE_UP:
        halves = [s.chunk(2, 0) for s in shards]
        return {rule.hf_names[0]: same(_cat([h[0] for h in halves], 0)),
                rule.hf_names[1]: same(_cat([h[1] for h in halves], 0))}
    if rule.kind == QKV:
        ng, hd = spec.num_query_groups, spec.head_dim
        hpg = spec.num_attention_heads // ng
        full = _cat(shards, 0)
        tail = tuple(full.shape[1:])
        grouped = full.reshape((ng, (hpg + 2) * hd) + tail)
        parts = grouped.split([hpg * hd, hd, hd], 1)
        return {name: ((ng * part.shape[1],) + tail, part) for name, part in zip(rule.hf_names, parts, strict=True)}
    raise MappingError(f"{rule.megatron_name}: unknown layout kind {rule.kind!r}")


def hf_from_shards(rule: ParamRule, shards: Sequence[torch.Tensor], spec: ModelSpec,
                   out: Optional[Callable[[str, Tuple[int, ...], torch.Tensor], torch.Tensor]] = None,
                   ) -> Dict[str, torch.Tensor]:
    """Merge the TP shards of ``rule`` (in TP-rank order) back into its HF tensors.

    At TP=1 the results are views of the parameter wherever the layouts agree (everything but
    the interleaved QKV); callers that keep them past the parameter's next change must copy.
    ``out(hf_name, shape, like)``, when given, supplies the tensor a de-interleaved Q, K or V is
    written into (e.g. its place in a rollout engine) instead of a fresh allocation."""
    merged = {}
    for name, (shape, view) in hf_views_from_shards(rule, shards, spec).items():
        if out is None or view.is_contiguous():  # a reshape that is a view: nothing to copy
            merged[name] = view.reshape(shape)
            continue
        dst = out(name, shape, view)
        dst.view(view.shape).copy_(view)
        merged[name] = dst
    return merged
