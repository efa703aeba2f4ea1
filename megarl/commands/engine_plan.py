"""How SGLang shards the HF tensors megarl's weight stream sends it, per engine rank, for the
full-size proof (megarl/commands/full_size.py).

megarl streams whole HF tensors; each SGLang TP rank keeps its part as SGLang's layers cut it
(SGLang 0.5.23, ``srt/layers/linear.py``, ``vocab_parallel_embedding.py``,
``moe/fused_moe_triton/layer.py``):

* ``QKVParallelLinear``: query heads split over the TP ranks (``divide(heads, tp)``); key/value
  heads split too, or -- when ``tp >= kv heads`` -- each rank holds one KV head, replicated over
  ``tp / kv heads`` ranks (``divide(tp, kv heads)``);
* column-parallel linears (``gate_proj`` / ``up_proj``) split their output rows, row-parallel ones
  (``o_proj``, ``down_proj``) their input columns, each by ``divide``;
* ``VocabParallelEmbedding`` / ``ParallelLMHead``: the vocabulary padded to a multiple of 64,
  then split in equal row ranges (the padding rows are no HF rows);
* a mixture-of-experts layer (``FusedMoE``): the routed experts split over ``ep`` ranks
  (``num_experts % ep == 0``), each expert's intermediate size over ``moe_tp = tp / ep`` ranks;
  the router, norms and a shared expert's gate replicated; a shared expert is a dense MLP at ``tp``;
* multi-latent attention (``models/deepseek_v2.py``): the down projections ``q_a_proj`` and
  ``kv_a_proj_with_mqa`` and the latent norms replicated, ``q_b_proj`` / ``q_proj`` and
  ``kv_b_proj`` column-parallel (rows per head), ``o_proj`` row-parallel; the router's expert-score
  bias replicated.

Each rule here returns the slice a rank holds; the proof checks that the ranks' slices tile
every HF tensor once (the same check as the training side's), and a size that does not divide
is refused naming ``rollout.tp`` / ``rollout.ep``.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Dict, Optional, Tuple

from megarl.errors import ConfigError

#: SGLang's ``DEFAULT_VOCAB_PADDING_SIZE``
VOCAB_PADDING = 64


def _divide(n: int, d: int, what: str, key: str) -> int:
    if d <= 0 or n % d:
        raise ConfigError(f"{key}: SGLang splits {what}={n} over {d} ranks, which does not divide it")
    return n // d


def _rows(total: int, parts: int, rank: int, what: str, key: str) -> Tuple[int, int]:
    step = _divide(total, parts, what, key)
    return rank * step, (rank + 1) * step


def sglang_shards(spec, tp: int, ep: int = 1) -> Dict[str, set]:
    """``{HF name: {(dim, start, stop) | None}}``: what each of SGLang's ``tp`` ranks (experts
    over ``ep``) holds of each HF tensor of ``spec`` (``None``: the whole tensor)."""
    from megarl.models import mapping

    reads: Dict[str, set] = defaultdict(set)
    heads, kv, d = spec.num_attention_heads, spec.num_query_groups, spec.head_dim
    _divide(heads, tp, "num_attention_heads", "rollout.tp")
    replicas = _divide(tp, kv, "num_key_value_heads (replicated: tp / kv heads)", "rollout.tp") if tp >= kv else 1
    if tp >= kv:
        kv_per_rank = 1
    else:
        kv_per_rank = _divide(kv, tp, "num_key_value_heads", "rollout.tp")
    padded = -(-spec.vocab_size // VOCAB_PADDING) * VOCAB_PADDING
    vocab_rows = _divide(padded, tp, f"the vocabulary padded to {VOCAB_PADDING}", "rollout.tp")
    moe = spec.moe
    moe_tp = None
    if moe is not None:
        _divide(moe.num_experts, ep, "the number of experts", "rollout.ep")
        moe_tp = _divide(tp, ep, "rollout.tp over rollout.ep (SGLang's moe_tp_size)", "rollout.ep")
    shapes = mapping.hf_shapes(spec)
    for name, shape in shapes.items():
        leaf = name.split(".")[-2] if name.endswith((".weight", ".bias")) else name.split(".")[-1]
        kind = name.rsplit(".", 1)[-1]
        for r in range(tp):
            reads[name].add(_slice(spec, name, leaf, kind, shape, r, tp, ep, moe_tp, heads, kv_per_rank, replicas, d,
                                   vocab_rows))
    return reads


def _slice(spec, name, leaf, kind, shape, r, tp, ep, moe_tp, heads, kv_per_rank, replicas, d, vocab_rows):
    """The slice of ``name`` SGLang's TP rank ``r`` holds."""
    if leaf in ("embed_tokens", "lm_head"):
        a, b = r * vocab_rows, (r + 1) * vocab_rows
        b = min(b, spec.vocab_size)
        return (0, a, b) if a < b else ("not held",)  # a rank of padding rows only holds no HF rows
    expert = _expert_index(name)
    if expert is not None:  # a routed expert: on EP rank e // (E / ep), split over moe_tp
        ep_rank = r // moe_tp  # SGLang's EP ranks are contiguous blocks of moe_tp TP ranks
        per = spec.moe.num_experts // ep
        if expert // per != ep_rank:
            return ("not held",)
        m = r % moe_tp
        f = spec.moe.ffn_hidden_size
        if leaf in ("gate_proj", "up_proj", "w1", "w3"):
            return (0, *_rows(f, moe_tp, m, "moe_intermediate_size", "rollout.ep"))
        return (1, *_rows(f, moe_tp, m, "moe_intermediate_size", "rollout.ep"))
    if leaf == "q_proj":
        per = heads // tp
        return (0, r * per * d, (r + 1) * per * d)
    if leaf in ("k_proj", "v_proj"):
        head = r // replicas if replicas > 1 else r * kv_per_rank
        return (0, head * d, (head + kv_per_rank) * d)
    if leaf == "o_proj":
        return (1, *_rows(shape[1], tp, r, "the attention output width", "rollout.tp")) if kind == "weight" else None
    if leaf in ("q_b_proj", "kv_b_proj"):  # multi-latent attention's up projections: rows per head
        return (0, *_rows(shape[0], tp, r, "the heads' rows of " + leaf, "rollout.tp"))
    if leaf in ("gate_proj", "up_proj"):
        return (0, *_rows(shape[0], tp, r, "intermediate_size", "rollout.tp"))
    if leaf == "down_proj":
        return (1, *_rows(shape[1], tp, r, "intermediate_size", "rollout.tp")) if kind == "weight" else None
    return None  # norms, routers, a shared expert's gate: whole on every rank


def _expert_index(name: str) -> Optional[int]:
    parts = name.split(".")
    for i, p in enumerate(parts[:-1]):
        if p == "experts" and parts[i + 1].isdigit():
            return int(parts[i + 1])
    return None


def engine_reads(spec, tp: int, ep: int = 1) -> Dict[str, set]:
    """:func:`sglang_shards` without the "not held" markers (an EP rank's foreign experts, a TP
    rank of vocabulary padding only)."""
    out = sglang_shards(spec, tp, ep)
    return {name: {x for x in got if x != ("not held",)} for name, got in out.items()}
