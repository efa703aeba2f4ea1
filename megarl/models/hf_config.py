"""HuggingFace ``config.json`` -> :class:`ModelSpec`, the one description megarl builds from.

Only the decoder families whose every config field we understand are accepted: Llama,
Qwen2 (q/k/v bias), Qwen3 (per-head q/k RMSNorm) and Mistral, and the mixture-of-experts
families Qwen3-MoE, Qwen2-MoE (a shared expert behind a sigmoid gate) and Mixtral, whose
routed experts are described by :class:`MoESpec`.  A field we do not understand,
or a value we cannot realise exactly (another activation, another RoPE scaling type, sliding
window attention shorter than the sequences we run), is rejected *by name*: training on a
silently different model is worse than not starting.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import asdict, dataclass, field
from typing import Any, Optional

from megarl.errors import MegarlError


class ModelConfigError(MegarlError, ValueError):
    """An HF config megarl cannot realise exactly; the message names the file and the key."""


#: architectures entry -> (family, head kind)
ARCHITECTURES = {
    "LlamaForCausalLM": ("llama", "lm"),
    "Qwen2ForCausalLM": ("qwen2", "lm"),
    "Qwen3ForCausalLM": ("qwen3", "lm"),
    "MistralForCausalLM": ("mistral", "lm"),
    "LlamaForTokenClassification": ("llama", "value"),
    "Qwen2ForTokenClassification": ("qwen2", "value"),
    "Qwen3ForTokenClassification": ("qwen3", "value"),
    "MistralForTokenClassification": ("mistral", "value"),
    # a reward model's usual head: the score read at the last non-pad token (no bias)
    "LlamaForSequenceClassification": ("llama", "sequence"),
    "Qwen2ForSequenceClassification": ("qwen2", "sequence"),
    "Qwen3ForSequenceClassification": ("qwen3", "sequence"),
    "MistralForSequenceClassification": ("mistral", "sequence"),
    "Qwen3MoeForCausalLM": ("qwen3_moe", "lm"),
    "Qwen2MoeForCausalLM": ("qwen2_moe", "lm"),
    "MixtralForCausalLM": ("mixtral", "lm"),
    "DeepseekV3ForCausalLM": ("deepseek_v3", "lm"),
    "Glm4MoeForCausalLM": ("glm4_moe", "lm"),
}
MODEL_TYPES = {"llama", "qwen2", "qwen3", "mistral", "qwen3_moe", "qwen2_moe", "mixtral", "deepseek_v3", "glm4_moe"}
#: model_type -> the architecture a config without ``architectures`` gets
_DEFAULT_ARCH = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                 "mistral": "MistralForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM",
                 "qwen2_moe": "Qwen2MoeForCausalLM", "mixtral": "MixtralForCausalLM",
                 "deepseek_v3": "DeepseekV3ForCausalLM", "glm4_moe": "Glm4MoeForCausalLM"}
#: mixture-of-experts family -> the dense family whose attention it shares, and the HF tensor
#: naming of its MoE block (:data:`megarl.models.mapping.MOE_HF_NAMES`)
MOE_FAMILIES = {"qwen3_moe": ("qwen3", "qwen_moe"), "qwen2_moe": ("qwen2", "qwen_moe"),
                "mixtral": ("mistral", "mixtral"), "deepseek_v3": ("deepseek_v3", "deepseek"),
                # GLM-4.5: grouped-query attention of its own, DeepSeek-V3's MoE block and routing
                "glm4_moe": ("glm4_moe", "deepseek")}
#: families whose attention is multi-latent attention (:class:`MLASpec`)
MLA_FAMILIES = {"deepseek_v3"}
#: families whose RoPE turns only the first ``partial_rotary_factor`` of each head (rotate-half)
PARTIAL_ROTARY_FAMILIES = {"glm4_moe"}

# Keys that describe bookkeeping, generation defaults or HF runtime switches: they do not
# change the function the network computes, so they are accepted and carried along.
_BENIGN_KEYS = {
    "_name_or_path", "architectures", "model_type", "transformers_version", "torch_dtype",
    "dtype", "use_cache", "bos_token_id", "eos_token_id", "pad_token_id", "id2label",
    "label2id", "initializer_range", "output_attentions", "output_hidden_states",
    "return_dict", "problem_type", "chunk_size_feed_forward", "is_encoder_decoder",
    "attention_dropout", "pretraining_tp", "tokenizer_class", "task_specific_params",
    "prefix", "finetuning_task", "add_cross_attention", "tie_encoder_decoder",
    "cross_attention_hidden_size", "decoder_start_token_id", "sep_token_id",
    "num_labels", "classifier_dropout", "_attn_implementation_autoset", "layer_types",
    "max_window_layers", "use_bfloat16", "tf_legacy_loss", "pruned_heads",
    "torchscript", "is_decoder", "typical_p", "auto_map", "keys_to_ignore_at_inference",
    "output_scores", "return_dict_in_generate", "megarl",
}
# Keys whose values megarl reads or checks below.
_SEMANTIC_KEYS = {
    "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
    "num_attention_heads", "num_key_value_heads", "head_dim", "hidden_act", "rms_norm_eps",
    "rope_theta", "rope_scaling", "rope_parameters", "max_position_embeddings",
    "tie_word_embeddings", "attention_bias", "mlp_bias", "sliding_window",
    "use_sliding_window", "partial_rotary_factor", "token_classification_bias",
}
# Keys of the mixture-of-experts families (accepted only there).  ``router_aux_loss_coef`` and
# ``output_router_logits`` are training switches of transformers' own loss: megarl's aux loss
# is its own setting (0 by default in RL), so they do not change the function and are carried.
_MOE_BENIGN_KEYS = {"router_aux_loss_coef", "output_router_logits"}
_MOE_SEMANTIC_KEYS = {
    "qwen3_moe": {"num_experts", "num_local_experts", "num_experts_per_tok", "moe_intermediate_size",
                  "norm_topk_prob", "decoder_sparse_step", "mlp_only_layers"},
    "qwen2_moe": {"num_experts", "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob",
                  "decoder_sparse_step", "mlp_only_layers", "shared_expert_intermediate_size", "qkv_bias"},
    "mixtral": {"num_local_experts", "num_experts_per_tok", "router_jitter_noise"},
    # DeepSeek-V3 (transformers' DeepseekV3Config, and the keys of DeepSeek's own config.json):
    # ``aux_loss_alpha`` / ``seq_aux`` are its training-time balance loss and ``ep_size`` a
    # parallel hint, carried like ``router_aux_loss_coef``; ``head_dim`` / ``qk_head_dim`` are
    # derived by transformers (checked against the MLA sizes)
    "deepseek_v3": {"n_routed_experts", "num_local_experts", "n_shared_experts", "routed_scaling_factor",
                    "kv_lora_rank", "q_lora_rank", "qk_rope_head_dim", "v_head_dim", "qk_nope_head_dim",
                    "qk_head_dim", "n_group", "topk_group", "num_experts_per_tok", "first_k_dense_replace",
                    "norm_topk_prob", "moe_intermediate_size", "rope_interleave", "num_nextn_predict_layers",
                    "num_mtp_layers", "moe_layer_freq", "topk_method", "scoring_func", "ep_size",
                    "aux_loss_alpha", "seq_aux"},
    # GLM-4.5 / GLM-4.5-Air (transformers' Glm4MoeConfig): q/k/v bias (``attention_bias``, o_proj
    # without), optional per-head q/k norm, partial rotary, DeepSeek-V3's routing
    "glm4_moe": {"n_routed_experts", "num_local_experts", "n_shared_experts", "routed_scaling_factor", "n_group",
                 "topk_group", "num_experts_per_tok", "first_k_dense_replace", "norm_topk_prob",
                 "moe_intermediate_size", "use_qk_norm", "num_nextn_predict_layers", "num_mtp_layers",
                 "moe_layer_freq", "topk_method", "scoring_func"},
}


@dataclass(frozen=True)
class Llama3RopeScaling:
    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


@dataclass(frozen=True)
class YarnScaling:
    """YaRN RoPE scaling as DeepSeek-V3 configures it (arXiv:2309.00071; transformers'
    ``_compute_yarn_parameters`` and ``yarn_apply_mscale``; megatron-core's
    ``YarnRotaryEmbedding``): the rotary frequencies interpolated by ``factor`` outside the
    ``[beta_slow, beta_fast]`` rotation band of ``original_max_position_embeddings``; cos and sin
    scaled by ``m(mscale) / m(mscale_all_dim)`` and the softmax scale by ``m(mscale_all_dim)**2``,
    ``m(x) = 0.1 x ln(factor) + 1``."""

    factor: float
    original_max_position_embeddings: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 1.0
    mscale_all_dim: float = 0.0


@dataclass(frozen=True)
class MLASpec:
    """Multi-latent attention (DeepSeek-V2/V3; megatron-core ``MLASelfAttention``).

    Per token: ``c_q = RMSNorm(W_qa x)`` (``q_lora_rank`` wide; without it ``q = W_q x``),
    ``q = W_qb c_q`` split per head into a ``qk_nope_head_dim`` part and a ``qk_rope_head_dim``
    part that takes RoPE; ``[c_kv; k_rope] = W_kva x``, ``c_kv`` RMS-normalised and expanded per
    head by ``W_kvb`` into ``[k_nope; v]`` (``qk_nope_head_dim`` + ``v_head_dim``), ``k_rope`` one
    RoPE'd vector shared by every head.  Attention scores use ``qk_nope + qk_rope`` wide keys
    scaled by ``1 / sqrt(qk_nope + qk_rope)``.  DeepSeek-V2 (arXiv:2405.04434), section 2.1.

    ``rope_interleave``: DeepSeek's checkpoints hold the RoPE dimensions as interleaved pairs;
    megatron's MLA takes them so (its ``apply_rotary_pos_emb`` de-interleaves for MLA), as
    transformers does with ``rope_interleave=true``.  The latent norms take ``latent_norm_eps``
    (transformers builds them with its default 1e-6, not ``rms_norm_eps``)."""

    q_lora_rank: Optional[int]
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    latent_norm_eps: float = 1e-6
    yarn: Optional[YarnScaling] = None

    @property
    def q_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim


@dataclass(frozen=True)
class MoESpec:
    """The routed experts of a mixture-of-experts model (megatron-core's MoE layer realises it).

    Routing, as every supported family computes it: ``scores = softmax(router(x))`` over all
    experts in fp32, the ``top_k`` largest are chosen, and their weights are the chosen scores,
    renormalised to sum 1 when ``norm_topk_prob``.  megatron-core expresses the same with
    ``moe_router_pre_softmax = not norm_topk_prob``: softmax over the top-k logits (= the
    renormalised scores) or softmax first, then top-k (the raw scores).

    The DeepSeek-V3 knobs (``score_function="sigmoid"``, ``num_groups`` / ``group_topk``,
    ``routed_scaling_factor``, ``router_expert_bias``) have their megatron-core counterparts
    in :func:`megarl.models.builder.transformer_config` already; no config maps to them yet.
    """

    num_experts: int
    top_k: int
    ffn_hidden_size: int  # each routed expert's intermediate size
    norm_topk_prob: bool
    #: per decoder layer: True where the MLP is the MoE block, False where it is a dense MLP
    #: (Qwen's ``mlp_only_layers`` / ``decoder_sparse_step``; DeepSeek's ``first_k_dense_replace``)
    moe_layers: tuple
    shared_expert_ffn_hidden_size: Optional[int] = None  # None: no shared expert
    shared_expert_gate: bool = False  # Qwen2-MoE: sigmoid(gate(x)) scales the shared expert
    hf_layout: str = "qwen_moe"  # the HF tensor names of the block (mapping.MOE_HF_NAMES)
    score_function: str = "softmax"
    num_groups: Optional[int] = None  # group-limited routing (DeepSeek-V3 n_group)
    group_topk: Optional[int] = None  # (DeepSeek-V3 topk_group)
    routed_scaling_factor: Optional[float] = None
    router_expert_bias: bool = False  # DeepSeek-V3 e_score_correction_bias

    @property
    def moe_layer_indices(self) -> tuple:
        return tuple(i for i, m in enumerate(self.moe_layers) if m)


@dataclass(frozen=True)
class ModelSpec:
    """Everything needed to build the megatron model and map its tensors to and from HF."""

    family: str
    architecture: str
    vocab_size: int
    hidden_size: int
    ffn_hidden_size: int
    num_layers: int
    num_attention_heads: int
    num_query_groups: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    linear_bias: bool
    qk_norm: bool
    rope_scaling: Optional[Llama3RopeScaling] = None
    sliding_window: Optional[int] = None
    value_head: bool = False
    value_head_bias: bool = False  # HF *ForTokenClassification: token_classification_bias
    #: HF *ForSequenceClassification: one score per sequence, the head's output at the last token
    #: that is not ``pad_token_id`` (:func:`sequence_score_positions`); the per-token outputs exist too
    sequence_score: bool = False
    moe: Optional[MoESpec] = None  # mixture-of-experts families; None: every layer is dense
    #: the fraction of each head's dimensions RoPE turns (GLM-4.5: 0.5; rotate-half on the first part)
    rotary_percent: float = 1.0
    mla: Optional[MLASpec] = None  # multi-latent attention (DeepSeek-V3); None: grouped-query attention
    raw_config: dict = field(default_factory=dict, compare=False, repr=False)

    @property
    def checkpoint_dtype(self):
        """The dtype the HF checkpoint declares (``dtype`` / ``torch_dtype``), or None."""
        import torch

        name = self.raw_config.get("dtype") or self.raw_config.get("torch_dtype")
        return {"float32": torch.float32, "bfloat16": torch.bfloat16,
                "float16": torch.float16}.get(str(name).replace("torch.", ""))

    @property
    def max_sequence_length(self) -> int:
        """Longest sequence this model computes exactly (a sliding window caps it)."""
        if self.sliding_window is not None:
            return min(self.max_position_embeddings, self.sliding_window)
        return self.max_position_embeddings

    def padded_vocab_size(self, multiple: int) -> int:
        return -(-self.vocab_size // multiple) * multiple

    def to_dict(self) -> dict:
        d = asdict(self)
        d.pop("raw_config")
        return d


def _require(cfg: dict, key: str, where: str) -> Any:
    if key not in cfg or cfg[key] is None:
        raise ModelConfigError(f"{where}: required key '{key}' is missing")
    return cfg[key]


def _rope(cfg: dict, where: str) -> tuple[float, Optional[Llama3RopeScaling]]:
    """RoPE theta and scaling from either the transformers>=5 ``rope_parameters`` dict or the
    older top-level ``rope_theta`` + ``rope_scaling``."""
    params = cfg.get("rope_parameters")
    if params is not None:
        theta = params.get("rope_theta", cfg.get("rope_theta"))
        scaling = params if params.get("rope_type", "default") != "default" else None
        key = "rope_parameters"
    else:
        theta = cfg.get("rope_theta", 10000.0)
        scaling = cfg.get("rope_scaling")
        key = "rope_scaling"
    if theta is None:
        raise ModelConfigError(f"{where}: required key 'rope_theta' is missing")
    if not scaling:
        return float(theta), None
    rope_type = scaling.get("rope_type", scaling.get("type"))
    if rope_type in (None, "default"):
        return float(theta), None
    if rope_type != "llama3":
        raise ModelConfigError(
            f"{where}: {key}.rope_type='{rope_type}' is not supported (supported: default, llama3)"
        )
    try:
        rs = Llama3RopeScaling(
            factor=float(scaling["factor"]),
            low_freq_factor=float(scaling["low_freq_factor"]),
            high_freq_factor=float(scaling["high_freq_factor"]),
            original_max_position_embeddings=int(scaling["original_max_position_embeddings"]),
        )
    except KeyError as e:
        raise ModelConfigError(f"{where}: {key} of type llama3 lacks key {e}") from None
    return float(theta), rs


def _architecture(cfg: dict, where: str) -> tuple[str, str, str]:
    """``(architecture, family, head)`` from ``architectures`` (at most one entry) or, without
    it, from ``model_type``; the two must agree where both are given."""
    archs = cfg.get("architectures") or []
    model_type = cfg.get("model_type")
    if len(archs) > 1:
        raise ModelConfigError(f"{where}: 'architectures' lists {archs}; expected exactly one")
    if archs:
        arch = archs[0]
        if arch not in ARCHITECTURES:
            raise ModelConfigError(
                f"{where}: architectures entry '{arch}' is not supported; supported: "
                f"{sorted(ARCHITECTURES)}"
            )
        family, head = ARCHITECTURES[arch]
    else:
        if model_type not in MODEL_TYPES:
            raise ModelConfigError(
                f"{where}: no 'architectures' and model_type={model_type!r} is not one of "
                f"{sorted(MODEL_TYPES)}"
            )
        family, head = model_type, "lm"
        arch = _DEFAULT_ARCH[family]
    if model_type is not None and model_type != family:
        raise ModelConfigError(
            f"{where}: model_type='{model_type}' disagrees with architectures entry '{arch}'"
        )
    return arch, family, head


def _attention_heads(cfg: dict, hidden: int, where: str) -> tuple[int, int, int]:
    """``(heads, query groups, head_dim)``; head_dim defaults to hidden_size / heads."""
    heads = int(_require(cfg, "num_attention_heads", where))
    groups = int(cfg.get("num_key_value_heads") or heads)
    head_dim = cfg.get("head_dim")
    if head_dim is None:
        if hidden % heads:
            raise ModelConfigError(
                f"{where}: hidden_size={hidden} is not divisible by num_attention_heads={heads}"
            )
        head_dim = hidden // heads
    if heads % groups:
        raise ModelConfigError(
            f"{where}: num_attention_heads={heads} is not divisible by num_key_value_heads={groups}"
        )
    return heads, groups, head_dim


def _biases(cfg: dict, family: str, attn_family: str, moe_family: bool, where: str) -> tuple[bool, bool]:
    """``(qkv_bias, linear_bias)``: Qwen2 attention has a QKV bias only; elsewhere megatron's
    ``add_bias_linear`` covers o_proj and the MLP together, and MoE experts take none."""
    attention_bias = bool(cfg.get("attention_bias", False))
    mlp_bias = bool(cfg.get("mlp_bias", False))
    if attn_family == "glm4_moe":  # q/k/v take attention_bias, o_proj and the MLPs no bias
        return attention_bias, False
    if family in MLA_FAMILIES and attention_bias:
        raise ModelConfigError(f"{where}: attention_bias=true is not supported for {family} (megatron-core's "
                               "multi-latent attention builds its projections without a bias)")
    if attn_family == "qwen2":
        return bool(cfg.get("qkv_bias", True)), False
    if moe_family and (attention_bias or mlp_bias):
        key = "attention_bias" if attention_bias else "mlp_bias"
        raise ModelConfigError(
            f"{where}: {key}=true is not supported for {family} (megatron's experts and shared "
            "experts take no bias with expert tensor parallelism)"
        )
    if attention_bias != mlp_bias:
        raise ModelConfigError(
            f"{where}: attention_bias={attention_bias} with mlp_bias={mlp_bias} is not "
            "supported (megatron's add_bias_linear covers o_proj and the MLP together)"
        )
    return attention_bias, attention_bias


def spec_from_hf_config(cfg: dict, where: str = "config.json") -> ModelSpec:
    """Validate an HF config dict and turn it into a :class:`ModelSpec`.

    Raises :class:`ModelConfigError` naming ``where`` and the offending key.
    """
    arch, family, head = _architecture(cfg, where)

    moe_family = family in MOE_FAMILIES
    known = _BENIGN_KEYS | _SEMANTIC_KEYS | ((_MOE_BENIGN_KEYS | _MOE_SEMANTIC_KEYS[family]) if moe_family else set())
    # the attention of an MoE family is its dense sibling's
    attn_family = MOE_FAMILIES[family][0] if moe_family else family
    unknown = sorted(k for k in cfg if k not in known)
    if unknown:
        raise ModelConfigError(
            f"{where}: config key(s) {unknown} are not understood by megarl's {family} "
            "mapping; refusing to build a model that might silently differ"
        )

    act = cfg.get("hidden_act", "silu")
    if act != "silu":
        raise ModelConfigError(f"{where}: hidden_act='{act}' is not supported (expected 'silu')")

    hidden = int(_require(cfg, "hidden_size", where))
    mla = _mla_spec(cfg, where) if family in MLA_FAMILIES else None
    if mla is not None:
        heads, groups, head_dim = _mla_heads(cfg, mla, where)
    else:
        heads, groups, head_dim = _attention_heads(cfg, hidden, where)
    qkv_bias, linear_bias = _biases(cfg, family, attn_family, moe_family, where)

    sliding_window = cfg.get("sliding_window")
    if attn_family == "qwen2" or attn_family == "qwen3":
        if cfg.get("use_sliding_window", False):
            raise ModelConfigError(
                f"{where}: use_sliding_window=true is not supported (sliding window attention)"
            )
        sliding_window = None
    if mla is not None:
        yarn, cfg_no_yarn = _split_yarn(cfg, where)
        mla = dataclasses.replace(mla, yarn=yarn)
        theta, rope_scaling = _rope(cfg_no_yarn, where)
    else:
        theta, rope_scaling = _rope(cfg, where)
    rotary = _rotary_fraction(cfg, family, head_dim, where)
    if rope_scaling is not None and family != "llama":
        raise ModelConfigError(f"{where}: llama3 rope scaling on family '{family}' is unexpected")

    intermediate = int(_require(cfg, "intermediate_size", where))
    num_layers = int(_require(cfg, "num_hidden_layers", where))
    moe = _moe_spec(cfg, family, num_layers, intermediate, where) if moe_family else None
    if moe is not None and head != "lm":
        raise ModelConfigError(f"{where}: {arch}: value heads on mixture-of-experts models are not supported")
    if head != "lm":
        labels = len(cfg["id2label"]) if isinstance(cfg.get("id2label"), dict) else int(cfg.get("num_labels", 1))
        if labels != 1:
            raise ModelConfigError(f"{where}: {arch} with {labels} labels (id2label / num_labels); a reward or value "
                                   "head has exactly one")

    return ModelSpec(
        family=family,
        architecture=arch,
        vocab_size=int(_require(cfg, "vocab_size", where)),
        hidden_size=hidden,
        ffn_hidden_size=intermediate,
        num_layers=num_layers,
        num_attention_heads=heads,
        num_query_groups=groups,
        head_dim=int(head_dim),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        rope_theta=theta,
        max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        qkv_bias=qkv_bias,
        linear_bias=linear_bias,
        qk_norm=(attn_family == "qwen3") or (attn_family == "glm4_moe" and bool(cfg.get("use_qk_norm", False))),
        rotary_percent=rotary,
        rope_scaling=rope_scaling,
        sliding_window=int(sliding_window) if sliding_window else None,
        value_head=head in ("value", "sequence"),
        value_head_bias=(head == "value") and bool(cfg.get("token_classification_bias", True)),
        sequence_score=(head == "sequence"),
        moe=moe,
        mla=mla,
        raw_config=dict(cfg),
    )


def _mla_spec(cfg: dict, where: str) -> MLASpec:
    """The :class:`MLASpec` of a DeepSeek-V3 config (sizes named on refusal)."""
    q_rank = cfg.get("q_lora_rank")
    mla = MLASpec(q_lora_rank=int(q_rank) if q_rank else None,
                  kv_lora_rank=int(_require(cfg, "kv_lora_rank", where)),
                  qk_nope_head_dim=int(_require(cfg, "qk_nope_head_dim", where)),
                  qk_rope_head_dim=int(_require(cfg, "qk_rope_head_dim", where)),
                  v_head_dim=int(_require(cfg, "v_head_dim", where)))
    if not cfg.get("rope_interleave", True):
        # megatron's MLA always reads the RoPE part as interleaved pairs (DeepSeek's layout)
        raise ModelConfigError(f"{where}: rope_interleave=false is not supported (megatron-core's multi-latent "
                               "attention takes the RoPE dimensions as interleaved pairs, DeepSeek's layout)")
    if mla.qk_rope_head_dim % 2:
        raise ModelConfigError(f"{where}: qk_rope_head_dim={mla.qk_rope_head_dim} must be even (RoPE rotates pairs)")
    for key, want in (("qk_head_dim", mla.q_head_dim), ("head_dim", mla.qk_rope_head_dim)):
        if key in cfg and cfg[key] is not None and int(cfg[key]) != want:
            raise ModelConfigError(f"{where}: {key}={cfg[key]} disagrees with the MLA sizes (expected {want}: "
                                   "qk_nope_head_dim + qk_rope_head_dim, and qk_rope_head_dim for head_dim)")
    return mla


def _rotary_fraction(cfg: dict, family: str, head_dim: int, where: str) -> float:
    """``partial_rotary_factor`` (top level, or in transformers 5's ``rope_parameters``): the
    fraction of each head RoPE turns; refused where the family turns the whole head."""
    params = cfg.get("rope_parameters") or {}
    frac = float(cfg.get("partial_rotary_factor", params.get("partial_rotary_factor", 1.0)) or 1.0)
    if frac == 1.0:
        return 1.0
    if family not in PARTIAL_ROTARY_FAMILIES:
        raise ModelConfigError(f"{where}: partial_rotary_factor={frac} is not supported for {family} "
                               "(only full rotary embeddings)")
    if not 0 < frac < 1 or (head_dim * frac) % 2:
        raise ModelConfigError(f"{where}: partial_rotary_factor={frac} of head_dim={head_dim} does not give an "
                               "even number of rotary dimensions")
    return frac


def _split_yarn(cfg: dict, where: str) -> tuple[Optional[YarnScaling], dict]:
    """DeepSeek-V3's YaRN scaling (``rope_scaling`` / ``rope_parameters`` of type yarn), and the
    config without it (for :func:`_rope`, which reads theta and refuses every other type)."""
    key = "rope_parameters" if cfg.get("rope_parameters") is not None else "rope_scaling"
    scaling = cfg.get(key) or {}
    if scaling.get("rope_type", scaling.get("type")) != "yarn":
        return None, cfg
    known = {"rope_type", "type", "rope_theta", "factor", "original_max_position_embeddings", "beta_fast",
             "beta_slow", "mscale", "mscale_all_dim", "truncate"}
    unknown = sorted(set(scaling) - known)
    if unknown:
        raise ModelConfigError(f"{where}: {key} of type yarn has key(s) {unknown} megarl does not realise")
    if scaling.get("truncate", True) is not True:
        raise ModelConfigError(f"{where}: {key}.truncate=false is not supported (megatron-core rounds the "
                               "correction range to whole dimensions)")
    try:
        yarn = YarnScaling(factor=float(scaling["factor"]),
                           original_max_position_embeddings=int(scaling["original_max_position_embeddings"]),
                           beta_fast=float(scaling.get("beta_fast") or 32), beta_slow=float(scaling.get("beta_slow") or 1),
                           mscale=float(scaling.get("mscale") or 1.0),
                           mscale_all_dim=float(scaling.get("mscale_all_dim") or 0.0))
    except KeyError as e:
        raise ModelConfigError(f"{where}: {key} of type yarn lacks key {e}") from None
    if yarn.mscale != 1.0 and not yarn.mscale_all_dim:
        # transformers then ignores mscale (attention factor m(1)); megatron divides m(mscale) by m(0)
        raise ModelConfigError(f"{where}: {key}.mscale={yarn.mscale} without mscale_all_dim is not supported "
                               "(transformers and megatron-core scale cos/sin differently there)")
    rest = dict(cfg)
    rest[key] = {"rope_type": "default", "rope_theta": scaling["rope_theta"]} if "rope_theta" in scaling else None
    return yarn, rest


def _mla_heads(cfg: dict, mla: MLASpec, where: str) -> tuple[int, int, int]:
    """``(heads, query groups, head_dim)`` of multi-latent attention: every head has its own key
    and value (expanded from the shared latent), so the groups are the heads; head_dim is the
    query/key width."""
    heads = int(_require(cfg, "num_attention_heads", where))
    kv_heads = int(cfg.get("num_key_value_heads") or heads)
    if kv_heads != heads:
        raise ModelConfigError(f"{where}: num_key_value_heads={kv_heads} with multi-latent attention must equal "
                               f"num_attention_heads={heads} (each head's key and value come from the latent)")
    return heads, heads, mla.q_head_dim


def _moe_spec(cfg: dict, family: str, num_layers: int, intermediate: int, where: str) -> MoESpec:
    """The :class:`MoESpec` of a Qwen3-MoE, Qwen2-MoE or Mixtral config (keys named on refusal)."""
    layout = MOE_FAMILIES[family][1]
    if family == "mixtral":
        experts = int(_require(cfg, "num_local_experts", where))
        expert_ffn = intermediate  # Mixtral's intermediate_size is each expert's
        norm_topk = True  # transformers' Mixtral always renormalises the chosen weights
        moe_layers = (True,) * num_layers
        shared = None
        jitter = float(cfg.get("router_jitter_noise") or 0.0)
        if jitter:
            raise ModelConfigError(
                f"{where}: router_jitter_noise={jitter} is not supported (transformers scales the "
                "experts' input by the noise too; megatron's moe_input_jitter_eps only the router's)"
            )
    elif family in ("deepseek_v3", "glm4_moe"):
        return _deepseek_moe_spec(cfg, num_layers, where)
    else:
        key = "num_experts" if "num_experts" in cfg else "num_local_experts"
        experts = int(_require(cfg, key, where))
        expert_ffn = int(_require(cfg, "moe_intermediate_size", where))
        norm_topk = bool(cfg.get("norm_topk_prob", False))
        step = int(cfg.get("decoder_sparse_step", 1) or 1)
        only_dense = set(cfg.get("mlp_only_layers") or [])
        bad = sorted(i for i in only_dense if not (isinstance(i, int) and 0 <= i < num_layers))
        if bad:
            raise ModelConfigError(f"{where}: mlp_only_layers names layers {bad} outside [0, {num_layers})")
        # transformers: layer i is sparse iff i is not in mlp_only_layers and (i + 1) % step == 0
        moe_layers = tuple(experts > 0 and i not in only_dense and (i + 1) % step == 0 for i in range(num_layers))
        shared = cfg.get("shared_expert_intermediate_size") if family == "qwen2_moe" else None
        shared = int(shared) if shared else None
    top_k = int(_require(cfg, "num_experts_per_tok", where))
    if experts < 1:
        raise ModelConfigError(f"{where}: num_experts={experts}: a mixture-of-experts model needs >= 1 expert")
    if not 1 <= top_k <= experts:
        raise ModelConfigError(f"{where}: num_experts_per_tok={top_k} must be in [1, {experts}]")
    if top_k == 1 and norm_topk:
        # every chosen weight would be 1; megatron refuses top-1 softmax-after-top-k (zero gradient)
        raise ModelConfigError(
            f"{where}: num_experts_per_tok=1 with norm_topk_prob=true is not supported "
            "(megatron-core's top-1 routing needs the softmax before the top-k)"
        )
    if not any(moe_layers):
        raise ModelConfigError(f"{where}: no layer is a mixture-of-experts layer "
                               "(mlp_only_layers / decoder_sparse_step leave none)")
    return MoESpec(num_experts=experts, top_k=top_k, ffn_hidden_size=expert_ffn, norm_topk_prob=norm_topk,
                   moe_layers=moe_layers, shared_expert_ffn_hidden_size=shared,
                   shared_expert_gate=shared is not None, hf_layout=layout)


def _deepseek_moe_spec(cfg: dict, num_layers: int, where: str) -> MoESpec:
    """DeepSeek-V3's routing, GLM-4.5's too (arXiv:2412.19437, section 2.1.2; transformers'
    ``DeepseekV3TopkRouter``, ``Glm4MoeTopkRouter``):
    ``s = sigmoid(W_r x)`` in fp32; experts are chosen on ``s + b`` (``e_score_correction_bias``),
    first the ``topk_group`` best of ``n_group`` groups by the sum of each group's two best, then
    the ``num_experts_per_tok`` best inside them; the weights are the chosen *unbiased* ``s``,
    normalised to sum 1 and scaled by ``routed_scaling_factor``.  ``n_shared_experts`` always-on
    experts of ``moe_intermediate_size`` each; the first ``first_k_dense_replace`` layers are dense.
    megatron-core: sigmoid score function, expert bias, group-limited top-k (its group score is the
    sum of the ``topk / group_topk`` best, which is DeepSeek's two only when that ratio is 2)."""
    key = "n_routed_experts" if "n_routed_experts" in cfg else "num_local_experts"
    experts = int(_require(cfg, key, where))
    top_k = int(_require(cfg, "num_experts_per_tok", where))
    for k, want in (("scoring_func", "sigmoid"), ("topk_method", "noaux_tc")):
        if k in cfg and cfg[k] != want:
            raise ModelConfigError(f"{where}: {k}={cfg[k]!r} is not supported (transformers' DeepseekV3 computes "
                                   f"{k}={want!r})")
    freq = int(cfg.get("moe_layer_freq", 1) or 1)
    if freq != 1:
        raise ModelConfigError(f"{where}: moe_layer_freq={freq} is not supported (transformers' DeepseekV3 makes "
                               "every layer after first_k_dense_replace a mixture-of-experts layer)")
    if not cfg.get("norm_topk_prob", True) and top_k > 1:
        raise ModelConfigError(f"{where}: norm_topk_prob=false is not supported with sigmoid routing "
                               "(megatron-core always normalises the chosen sigmoid scores)")
    groups = int(cfg.get("n_group") or 1)
    group_topk = int(cfg.get("topk_group") or 1)
    if groups > 1:
        if experts % groups:
            raise ModelConfigError(f"{where}: n_group={groups} does not divide {key}={experts}")
        if not 1 <= group_topk <= groups or top_k % group_topk or top_k // group_topk != 2:
            raise ModelConfigError(
                f"{where}: n_group={groups} with topk_group={group_topk} and num_experts_per_tok={top_k} is not "
                "supported: megatron-core scores a group by its num_experts_per_tok / topk_group best experts, "
                "transformers by its 2 best; they agree only when that ratio is 2")
    first_dense = int(cfg.get("first_k_dense_replace") or 0)
    if not 0 <= first_dense < num_layers:
        raise ModelConfigError(f"{where}: first_k_dense_replace={first_dense} leaves no mixture-of-experts layer "
                               f"among num_hidden_layers={num_layers}")
    ffn = int(_require(cfg, "moe_intermediate_size", where))
    n_shared = int(cfg.get("n_shared_experts") or 0)
    scale = float(cfg.get("routed_scaling_factor") or 1.0)
    if not 1 <= top_k <= experts:
        raise ModelConfigError(f"{where}: num_experts_per_tok={top_k} must be in [1, {experts}]")
    return MoESpec(num_experts=experts, top_k=top_k, ffn_hidden_size=ffn, norm_topk_prob=True,
                   moe_layers=tuple(i >= first_dense for i in range(num_layers)),
                   shared_expert_ffn_hidden_size=n_shared * ffn if n_shared else None, shared_expert_gate=False,
                   hf_layout="deepseek", score_function="sigmoid",
                   num_groups=groups if groups > 1 else None, group_topk=group_topk if groups > 1 else None,
                   routed_scaling_factor=scale if scale != 1.0 else None, router_expert_bias=True)


def load_spec(model_dir: str) -> ModelSpec:
    """Read ``model_dir/config.json`` into a :class:`ModelSpec`."""
    path = os.path.join(model_dir, "config.json")
    if not os.path.isfile(path):
        raise ModelConfigError(f"{path}: file not found (expected an HF config.json)")
    try:
        with open(path) as f:
            cfg = json.load(f)
    except json.JSONDecodeError as e:
        raise ModelConfigError(f"{path}: not valid JSON ({e})") from None
    return spec_from_hf_config(cfg, where=path)


def check_parallel_fit(spec: ModelSpec, tp: int, pp: int, where: str = "config.json", ep: int = 1,
                       etp: Optional[int] = None, experts: bool = True, first_stage_layers: Optional[int] = None,
                       last_stage_layers: Optional[int] = None) -> None:
    """Raise a named error if the model cannot be split at this TP/PP (and, with ``experts``,
    its experts placed at this EP / expert TP: :func:`check_expert_fit`)."""
    if spec.num_attention_heads % tp:
        raise ModelConfigError(
            f"{where}: num_attention_heads={spec.num_attention_heads} is not divisible by "
            f"tensor parallel size tp={tp}"
        )
    if spec.num_query_groups % tp:
        raise ModelConfigError(
            f"{where}: num_key_value_heads={spec.num_query_groups} is not divisible by "
            f"tensor parallel size tp={tp}"
        )
    moe = spec.moe
    if (moe is None or not all(moe.moe_layers)) and spec.ffn_hidden_size % tp:
        raise ModelConfigError(
            f"{where}: intermediate_size={spec.ffn_hidden_size} is not divisible by tp={tp}"
        )
    if first_stage_layers is None and last_stage_layers is None:
        if spec.num_layers % pp:
            raise ModelConfigError(
                f"{where}: num_hidden_layers={spec.num_layers} is not divisible by pipeline "
                f"parallel size pp={pp}"
            )
    else:
        from megarl.models.stages import StageSplitError, stage_layer_counts

        try:
            stage_layer_counts(spec.num_layers, pp, first_stage_layers, last_stage_layers)
        except StageSplitError as e:
            raise ModelConfigError(f"{where}: {e}") from None
    if experts:
        check_expert_fit(spec, tp, ep, etp, where)


class ExpertFitError(ModelConfigError):
    """The experts cannot be placed; ``size`` names the parallel size at fault (ep, etp or tp)."""

    def __init__(self, message: str, size: str):
        super().__init__(message)
        self.size = size


def check_expert_fit(spec: ModelSpec, tp: int, ep: int = 1, etp: Optional[int] = None,
                     where: str = "config.json") -> None:
    """Raise :class:`ExpertFitError` if the experts cannot be placed at this EP / expert TP
    (``etp`` None: ``tp``); a dense model takes only ep=1 and etp=tp."""
    moe = spec.moe
    if moe is None:
        if ep != 1 or (etp is not None and etp != tp):
            raise ExpertFitError(
                f"{where}: expert parallelism (ep={ep}, etp={etp}) needs a mixture-of-experts model; "
                f"{spec.architecture} is dense", "ep" if ep != 1 else "etp")
        return
    etp = tp if etp is None else etp
    if moe.num_experts % ep:
        raise ExpertFitError(
            f"{where}: the number of experts ({moe.num_experts}) is not divisible by expert parallel "
            f"size ep={ep}", "ep")
    key = "intermediate_size" if spec.family == "mixtral" else "moe_intermediate_size"
    if moe.ffn_hidden_size % etp:
        raise ExpertFitError(
            f"{where}: {key}={moe.ffn_hidden_size} is not divisible by expert tensor parallel size "
            f"etp={etp}", "etp")
    if moe.shared_expert_ffn_hidden_size and moe.shared_expert_ffn_hidden_size % tp:
        raise ExpertFitError(
            f"{where}: shared_expert_intermediate_size={moe.shared_expert_ffn_hidden_size} is not "
            f"divisible by tp={tp}", "tp")


def sequence_score_positions(tokens, lengths, pad_token_id):
    """Where HF ``*ForSequenceClassification`` reads each row's score: the last position (within
    the row's ``lengths``) whose token is not ``pad_token_id`` -- a real token equal to the pad
    id (an EOS used as pad) is skipped, as transformers does; a row of pad ids reads position 0.
    Without a pad id: the row's last token (what transformers does for a batch of one)."""
    import torch

    L = tokens.shape[1]
    idx = torch.arange(L)
    inside = idx[None, :] < lengths[:, None]
    if pad_token_id is None:
        return (lengths - 1).clamp(min=0)
    real = inside & (tokens != pad_token_id)
    return (idx[None, :] * real).argmax(-1)
