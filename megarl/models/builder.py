"""Build a megatron-core ``GPTModel`` (or a scalar value-head variant) from a :class:`ModelSpec`.

The layer is composed from megatron's ``ModuleSpec``s: the transformer-engine spec on CUDA,
the local (pure megatron-core) spec on CPU, with megarl's stand-ins for the local attention and
norm (``models/cpu_layers.py``).  Both realise the same function; only kernels differ.  The
value-head variant (critic, neural reward model) replaces the vocabulary projection by a
replicated ``hidden -> 1`` linear so it maps to HF ``*ForTokenClassification`` with
``num_labels=1``.

A mixture-of-experts model (``spec.moe``) is built from megatron's decoder *block* spec, one
layer spec per layer (MoE or dense: ``moe_layer_freq``), with ``SequentialMLP`` experts (one
MLP per local expert; ``moe_grouped_gemm`` off, so the experts have the same names and layouts
with and without transformer-engine) placed over the expert-parallel group.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F

from megarl.models.hf_config import ModelConfigError, ModelSpec, check_parallel_fit
from megarl.runtime import cpu_compat


@dataclass(frozen=True)
class BuildOptions:
    """How to build (not what): parallel sizes, dtype, vocab padding."""

    tp: int = 1
    pp: int = 1
    params_dtype: torch.dtype = torch.float32
    #: pad the vocabulary to a multiple of this; must be divisible by every TP size the
    #: checkpoint will be loaded at, so the padded shape is the same for all layouts.
    vocab_multiple: int = 128
    use_transformer_engine: Optional[bool] = None  # None: TE on CUDA, local spec on CPU
    seq_length: int = 0  # 0: the spec's max_sequence_length
    #: False when the weights are loaded from a checkpoint right after: skips drawing random
    #: full-size master weights (with CPU init megatron builds the whole tensor, then slices).
    init_weights: bool = True
    #: expert parallel size and expert tensor parallel size (None: ``tp``, megatron's default);
    #: must match the initialised parallel state (mixture-of-experts models only)
    ep: int = 1
    etp: Optional[int] = None
    #: the router's load-balancing (aux) loss and z-loss coefficients; RL fine-tuning keeps
    #: both off by default (they are training-time regularisers, not part of the function)
    moe_aux_loss_coeff: float = 0.0
    moe_z_loss_coeff: Optional[float] = None
    #: megatron's sequence parallelism (effective at tp > 1 only): the residual stream and the
    #: norms hold 1/tp of the sequence; a forward's sequence length must be a multiple of tp
    sequence_parallel: bool = False
    #: activation recomputation (``parallel.recompute``): None, "full" or "selective"; for full the
    #: method ("uniform" / "block") and layer count, for selective the recomputed modules
    recompute_granularity: Optional[str] = None
    recompute_method: Optional[str] = None
    recompute_num_layers: Optional[int] = None
    recompute_modules: Optional[tuple] = None
    #: context-parallel size (``parallel.cp``): each sequence split over cp ranks
    #: (:mod:`megarl.models.context_parallel`); None: the initialised parallel state's
    cp: Optional[int] = None

    @property
    def resolved_etp(self) -> int:
        return self.tp if self.etp is None else self.etp

    @property
    def resolved_sp(self) -> bool:
        """Sequence parallelism as built: asked for, and more than one TP rank to split over."""
        return self.sequence_parallel and self.tp > 1

    @property
    def sequence_multiple(self) -> int:
        """What a forward's sequence length must be a multiple of: tp under sequence parallelism,
        times 2 x cp under context parallelism (each CP rank holds two of 2 x cp chunks, which
        sequence parallelism splits again over tp)."""
        cp = self.cp or 1
        return (self.tp if self.resolved_sp else 1) * (2 * cp if cp > 1 else 1)

    def resolved_te(self) -> bool:
        if self.use_transformer_engine is None:
            import importlib.util

            # TE kernels on CUDA when installed; megatron's local spec otherwise (same function)
            return cpu_compat.use_transformer_engine(importlib.util.find_spec("transformer_engine") is not None)
        return self.use_transformer_engine


def recompute_options(rc) -> dict:
    """:class:`BuildOptions` fields for a ``parallel.recompute`` section (``{}`` when off)."""
    if rc is None or rc.granularity is None:
        return {}
    if rc.granularity == "full":
        return dict(recompute_granularity="full", recompute_method=rc.method, recompute_num_layers=rc.num_layers)
    return dict(recompute_granularity="selective", recompute_modules=tuple(rc.modules))


def _recompute_config(opts: BuildOptions) -> dict:
    if opts.recompute_granularity is None:
        return {}
    out = dict(recompute_granularity=opts.recompute_granularity)
    if opts.recompute_granularity == "full":
        out.update(recompute_method=opts.recompute_method, recompute_num_layers=opts.recompute_num_layers)
    else:
        out.update(recompute_modules=list(opts.recompute_modules))
    return out


def padded_vocab_size(spec: ModelSpec, opts: BuildOptions) -> int:
    padded = spec.padded_vocab_size(opts.vocab_multiple)
    if padded % opts.tp:
        raise ModelConfigError(
            f"model.vocab_multiple={opts.vocab_multiple} gives padded vocabulary {padded}, "
            f"which is not divisible by tp={opts.tp}; use a multiple of {opts.tp}"
        )
    return padded


def transformer_config(spec: ModelSpec, opts: BuildOptions):
    """megatron ``TransformerConfig`` realising ``spec`` exactly (dropout 0, no fusions on CPU);
    ``MLATransformerConfig`` for multi-latent attention (:func:`mla_transformer_config`)."""
    from megatron.core.transformer.transformer_config import MLATransformerConfig, TransformerConfig

    problem = cpu_compat.params_dtype_problem(opts.params_dtype)
    if problem is not None:
        raise ModelConfigError(f"model.dtype={opts.params_dtype}: {problem}")
    bf16 = opts.params_dtype == torch.bfloat16
    fp16 = opts.params_dtype == torch.float16
    cls = MLATransformerConfig if spec.mla is not None else TransformerConfig
    return cls(**cpu_compat.adjust_transformer_config(dict(
        **moe_transformer_config(spec, opts),
        **mla_transformer_config(spec),
        **_recompute_config(opts),
        num_layers=spec.num_layers,
        hidden_size=spec.hidden_size,
        ffn_hidden_size=spec.ffn_hidden_size,
        num_attention_heads=spec.num_attention_heads,
        num_query_groups=spec.num_query_groups,
        kv_channels=spec.head_dim,
        normalization="RMSNorm",
        layernorm_epsilon=spec.rms_norm_eps,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=spec.linear_bias,
        add_qkv_bias=spec.qkv_bias,
        qk_layernorm=spec.qk_norm or spec.mla is not None,  # under MLA: the q and kv latent norms
        hidden_dropout=0.0,
        attention_dropout=0.0,
        attention_softmax_in_fp32=True,
        apply_query_key_layer_scaling=False,
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
        cross_entropy_loss_fusion=False,
        tensor_model_parallel_size=opts.tp,
        pipeline_model_parallel_size=opts.pp,
        context_parallel_size=opts.cp or 1,
        sequence_parallel=opts.resolved_sp,
        params_dtype=opts.params_dtype,
        pipeline_dtype=opts.params_dtype,
        bf16=bf16,
        fp16=fp16,
        use_cpu_initialization=False,
        perform_initialization=opts.init_weights,
        variable_seq_lengths=False,
        batch_p2p_comm=False,
        batch_p2p_sync=True,
    )))


def mla_transformer_config(spec: ModelSpec) -> dict:
    """The multi-latent attention fields of megatron's ``MLATransformerConfig`` ({} without MLA).

    RoPE on the ``qk_rope_head_dim`` part only: unscaled (``rope_type="rope"``, scaling factor 1:
    the softmax scale is ``1 / sqrt(qk_nope + qk_rope)``) or YaRN (``rope_type="yarn"``)."""
    mla = spec.mla
    if mla is None:
        return {}
    out = dict(q_lora_rank=mla.q_lora_rank, kv_lora_rank=mla.kv_lora_rank, qk_head_dim=mla.qk_nope_head_dim,
               qk_pos_emb_head_dim=mla.qk_rope_head_dim, v_head_dim=mla.v_head_dim, rope_type="rope",
               rotary_base=spec.rope_theta, rotary_percent=1.0, rotary_scaling_factor=1.0, mscale=1.0,
               mscale_all_dim=0.0)
    if mla.yarn is not None:  # YaRN (hf_config.YarnScaling): megatron's YarnRotaryEmbedding and softmax scale
        y = mla.yarn
        out.update(rope_type="yarn", rotary_scaling_factor=y.factor,
                   original_max_position_embeddings=y.original_max_position_embeddings, beta_fast=y.beta_fast,
                   beta_slow=y.beta_slow, mscale=y.mscale, mscale_all_dim=y.mscale_all_dim)
    return out


def moe_transformer_config(spec: ModelSpec, opts: BuildOptions) -> dict:
    """The MoE fields of megatron's ``TransformerConfig`` for ``spec`` ({} for a dense model).

    Routing: softmax scores in fp32 (``moe_router_dtype``), top-k, renormalised iff
    ``norm_topk_prob`` (megatron: softmax after the top-k, ``moe_router_pre_softmax=False``).
    Dense layers of a MoE model are ``0`` entries of ``moe_layer_freq``.  The token dispatcher
    is alltoall (the one for EP on GPUs); ``cpu_compat`` replaces it on CPU."""
    moe = spec.moe
    if moe is None:
        return {}
    return dict(
        num_moe_experts=moe.num_experts,
        moe_router_topk=moe.top_k,
        moe_ffn_hidden_size=moe.ffn_hidden_size,
        moe_layer_freq=[int(m) for m in moe.moe_layers],
        moe_shared_expert_intermediate_size=moe.shared_expert_ffn_hidden_size,
        moe_shared_expert_gate=moe.shared_expert_gate,
        moe_router_pre_softmax=not moe.norm_topk_prob,
        moe_router_score_function=moe.score_function,
        moe_router_num_groups=moe.num_groups,
        moe_router_group_topk=moe.group_topk,
        moe_router_topk_scaling_factor=moe.routed_scaling_factor,
        moe_router_enable_expert_bias=moe.router_expert_bias,
        # the checkpoint's expert bias is part of the function: it moves only with the weights,
        # not by megatron's aux-loss-free balancing update (a pre-training device, off in RL)
        moe_router_bias_update_rate=0.0,
        moe_router_dtype="fp32",
        moe_router_load_balancing_type="aux_loss",
        moe_aux_loss_coeff=opts.moe_aux_loss_coeff,
        moe_z_loss_coeff=opts.moe_z_loss_coeff,
        moe_grouped_gemm=False,
        moe_token_dispatcher_type="alltoall",
        moe_permute_fusion=False,
        moe_router_fusion=False,
        # megatron's router replay (megarl.models.router_replay): inert until an action is set
        moe_enable_routing_replay=True,
        expert_model_parallel_size=opts.ep,
        expert_tensor_parallel_size=opts.resolved_etp,
    )


def layer_spec(spec: ModelSpec, opts: BuildOptions, config=None, vp_stage: Optional[int] = None):
    """The decoder's layer spec (dense) or block spec (MoE; and any model built from megarl's local
    layers, ``models/cpu_layers.py``: ``config`` is its TransformerConfig; the block is this
    stage's layers, of virtual stage ``vp_stage`` under virtual stages)."""
    from megatron.core.models.gpt import gpt_layer_specs

    from megarl.models import cpu_layers

    if spec.moe is not None:
        built = gpt_layer_specs.get_gpt_decoder_block_spec(
            config, use_transformer_engine=opts.resolved_te(), normalization="RMSNorm", vp_stage=vp_stage)
    elif opts.resolved_te():
        return gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec(
            qk_layernorm=spec.qk_norm
        )
    else:
        built = gpt_layer_specs.get_gpt_layer_local_spec(
            qk_layernorm=spec.qk_norm, normalization="RMSNorm"
        )
    if spec.mla is not None:
        built = mla_duplicated_down_projections(built, opts.resolved_te())
    if opts.resolved_te() or not cpu_compat.use_local_layer_stand_ins():
        return built
    # megatron's local layers refuse packed sequences, context and sequence parallelism
    return cpu_layers.local_spec(built, config, vp_stage)


def mla_duplicated_down_projections(block, te: bool):
    """The MLA layers of ``block`` with their q and kv down projections duplicated on every TP rank
    (each rank the whole weight, its gradient summed over the TP ranks under sequence parallelism).

    That is megatron's transformer-engine spec (``TELinear``, ``parallel_mode="duplicated"``); its
    local spec builds them column-parallel instead, and then the RoPE part of the kv latent
    (``k_pos_emb``, cut out after the all-gather) takes only this rank's heads' gradient: the
    rows of ``kv_a_proj_with_mqa`` that make it, and everything before, train on a partial sum.
    megatron's ``Linear`` (``post_training/modelopt/layers.py``, a ``torch.nn.Linear`` marked
    ``sequence_parallel``) is the duplicated linear MLA accepts without transformer-engine."""
    if te:
        return block
    from megatron.core.post_training.modelopt.layers import Linear
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear
    from megatron.core.transformer.multi_latent_attention import MLASelfAttention

    def fix(layer):
        attn = layer.submodules.self_attention
        if attn.module is not MLASelfAttention:
            return layer
        sub = attn.submodules
        changes = {k: Linear for k in ("linear_q_down_proj", "linear_kv_down_proj")
                   if getattr(sub, k) is ColumnParallelLinear}
        attn = dataclasses.replace(attn, submodules=dataclasses.replace(sub, **changes))
        return dataclasses.replace(layer, submodules=dataclasses.replace(layer.submodules, self_attention=attn))

    return dataclasses.replace(block, layer_specs=[fix(layer) for layer in block.layer_specs])


def set_latent_norm_eps(model, eps: float) -> None:
    """Give MLA's q and kv latent norms ``eps`` (transformers builds them with 1e-6 whatever
    ``rms_norm_eps`` is; megatron with ``layernorm_epsilon``): the torch norms of the local spec,
    or the norms transformer-engine fuses into the up projections (that path never run here: no GPU;
    tests/gpu/test_frontier_sglang.py checks it)."""
    from megatron.core.transformer.multi_latent_attention import MLASelfAttention

    for module in model.modules():
        if not isinstance(module, MLASelfAttention):
            continue
        for norm, fused in (("q_layernorm", "linear_q_up_proj"), ("kv_layernorm", "linear_kv_up_proj")):
            target = getattr(module, norm, None)
            if target is not None and hasattr(target, "eps"):
                target.eps = eps
            up = getattr(module, fused, None)
            if up is not None and hasattr(up, "layer_norm_weight") and hasattr(up, "eps"):
                up.eps = eps


class ScalarValueHead(torch.nn.Module):
    """``hidden -> 1`` projection, replicated over TP (a scalar cannot be vocab-split).

    Signature-compatible with megatron's ``ColumnParallelLinear`` as used by ``GPTModel``.  Under
    sequence parallelism the hidden states arrive as ``[s/tp, b, h]``; they are all-gathered
    along the sequence first, so every TP rank computes the values of the whole sequence with the
    same replicated weights (the backward keeps this rank's slice of the gradient: every rank's
    loss is the same function of the gathered states).
    """

    def __init__(self, hidden_size: int, dtype: torch.dtype, bias: bool = False, sequence_parallel: bool = False):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.empty(1, hidden_size, dtype=dtype))
        self.bias = torch.nn.Parameter(torch.zeros(1, dtype=dtype)) if bias else None
        self.sequence_parallel = sequence_parallel
        torch.nn.init.normal_(self.weight, std=0.02)

    def forward(self, hidden_states, weight=None, runtime_gather_output=None):
        if self.sequence_parallel:
            from megatron.core.tensor_parallel import gather_from_sequence_parallel_region

            hidden_states = gather_from_sequence_parallel_region(hidden_states, tensor_parallel_output_grad=False)
        return F.linear(hidden_states, self.weight, self.bias), None


def _ensure_tp_attributes(model) -> None:
    """Mark TP-sharded weights as such when megatron skipped it.

    megatron-core sets ``tensor_model_parallel`` / ``partition_dim`` on linear and embedding
    weights only inside its weight initialisers, so with ``perform_initialization=False`` the
    sharded weights look replicated and the optimizer's grad norm counts them on TP rank 0
    only (tests/multiproc/test_optim_step.py catches exactly that).
    """
    from megatron.core.tensor_parallel import layers as tpl

    for module in model.modules():
        if isinstance(module, (tpl.ColumnParallelLinear, tpl.VocabParallelEmbedding)):
            dim = 0
        elif isinstance(module, tpl.RowParallelLinear):
            dim = 1
        elif getattr(module, "parallel_mode", None) in ("column", "row"):  # transformer-engine
            dim = 0 if module.parallel_mode == "column" else 1
        else:
            continue
        w = getattr(module, "weight", None)
        if w is not None and not getattr(w, "tensor_model_parallel", False):
            tpl.set_tensor_model_parallel_attributes(w, True, dim, 1)


def virtual_stages() -> int:
    """Virtual pipeline stages per PP rank in the initialised parallel state (1: none)."""
    from megatron.core import parallel_state as ps

    return ps.get_virtual_pipeline_model_parallel_world_size() or 1


def build_model_chunks(spec: ModelSpec, opts: BuildOptions, seed: int = 1234) -> list:
    """This rank's model chunks: one per virtual pipeline stage (``rt.initialize(vpp=...)``), in
    vp-stage order, sharing one ``TransformerConfig``; a one-element list without virtual stages.

    Under interleaving, PP rank r's chunk v holds the layers of global chunk ``v * pp + r``
    (megatron's layer offset): with 4 layers at pp=2 x vpp=2, rank 0 holds layers 0 and 2, rank 1
    layers 1 and 3.  Each layer's ``layer_number`` is global, so the HF mapping needs nothing else.
    """
    vpp = virtual_stages()
    if vpp == 1:
        return [build_model(spec, opts, seed)]
    if spec.num_layers % (opts.pp * vpp):
        raise ModelConfigError(f"num_hidden_layers={spec.num_layers} is not divisible by pp x vpp = "
                               f"{opts.pp} x {vpp} (every virtual pipeline stage holds as many layers)")
    config = None
    chunks = []
    for v in range(vpp):
        chunks.append(build_model(spec, opts, seed, vp_stage=v, config=config))
        config = chunks[0].config
    return chunks


def build_model(spec: ModelSpec, opts: BuildOptions, seed: int = 1234, vp_stage: Optional[int] = None,
                config=None):
    """Build this rank's stage of the model (megatron parallel_state must be initialised).

    Every rank seeds identically before building: with CPU initialisation megatron builds the
    full master weight and slices it, so all ranks must draw the same numbers.  ``vp_stage``:
    the virtual pipeline stage to build, with virtual stages (:func:`build_model_chunks` builds
    them all, on one ``config``).
    """
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel

    from megarl.runtime import distributed as rt

    first, last = rt.stage_layers()
    check_parallel_fit(spec, opts.tp, opts.pp, ep=opts.ep, etp=opts.resolved_etp, first_stage_layers=first,
                       last_stage_layers=last)
    ps = parallel_state
    vpp = virtual_stages()
    if (vpp > 1) != (vp_stage is not None):
        raise ModelConfigError(f"build_model: vp_stage={vp_stage} with {vpp} virtual pipeline stage(s) initialised "
                               "(build_model_chunks builds every stage)")
    want = (opts.tp, opts.pp, opts.ep, opts.resolved_etp)
    have = (ps.get_tensor_model_parallel_world_size(), ps.get_pipeline_model_parallel_world_size(),
            ps.get_expert_model_parallel_world_size(), ps.get_expert_tensor_parallel_world_size())
    if spec.moe is None:  # a dense model has no experts to place: only TP and PP must agree
        want, have = want[:2] + (1, opts.tp), have[:2] + (1, opts.tp)
    if want != have:
        raise ModelConfigError(
            f"build options tp={want[0]} pp={want[1]} ep={want[2]} etp={want[3]} disagree with the "
            f"initialised parallel state tp={have[0]} pp={have[1]} ep={have[2]} etp={have[3]}"
        )
    cp = ps.get_context_parallel_world_size()
    if opts.cp is None:
        opts = dataclasses.replace(opts, cp=cp)
    elif opts.cp != cp:
        raise ModelConfigError(f"build options cp={opts.cp} disagree with the initialised parallel state cp={cp}")
    cpu_compat.seed_megatron_rng(seed)
    if spec.mla is not None:
        cpu_compat.patch_mla_te_flag()
    if config is None:
        config = transformer_config(spec, opts)
        if vpp > 1:
            config.virtual_pipeline_model_parallel_size = vpp
        if first is not None or last is not None:  # an uneven split (megarl/models/stages.py)
            config.num_layers_in_first_pipeline_stage = first
            config.num_layers_in_last_pipeline_stage = last
    pre = parallel_state.is_pipeline_first_stage(ignore_virtual=vp_stage is None, vp_stage=vp_stage)
    post = parallel_state.is_pipeline_last_stage(ignore_virtual=vp_stage is None, vp_stage=vp_stage)
    virtual = {} if vp_stage is None else {"vp_stage": vp_stage}
    model = GPTModel(
        config=config,
        transformer_layer_spec=layer_spec(spec, opts, config, vp_stage),
        vocab_size=padded_vocab_size(spec, opts),
        max_sequence_length=opts.seq_length or spec.max_sequence_length,
        pre_process=pre,
        post_process=post,
        parallel_output=True,
        share_embeddings_and_output_weights=spec.tie_word_embeddings and not spec.value_head,
        position_embedding_type="rope",
        rotary_percent=spec.rotary_percent,
        rotary_base=int(spec.rope_theta) if float(spec.rope_theta).is_integer() else spec.rope_theta,
        rope_scaling=False,
        **virtual,
    )
    if spec.rope_scaling is not None and hasattr(model, "rotary_pos_emb"):
        # GPTModel only forwards the factor; the HF config also sets the other three knobs.
        rs = spec.rope_scaling
        rope = model.rotary_pos_emb
        rope.inv_freq = rope._apply_scaling(
            rope.inv_freq,
            factor=rs.factor,
            low_freq_factor=rs.low_freq_factor,
            high_freq_factor=rs.high_freq_factor,
            original_max_position_embeddings=rs.original_max_position_embeddings,
        )
    if spec.value_head and post:
        model.output_layer = ScalarValueHead(spec.hidden_size, opts.params_dtype, bias=spec.value_head_bias,
                                             sequence_parallel=opts.resolved_sp).to(
            next(model.parameters()).device
        )
    if spec.mla is not None:
        set_latent_norm_eps(model, spec.mla.latent_norm_eps)
    if not opts.init_weights:
        _ensure_tp_attributes(model)
    model = cpu_compat.model_to_device(model)
    # Attach what the mapping and I/O layers need to find their way around this stage.
    model.megarl_spec = spec
    model.megarl_opts = opts
    return model
