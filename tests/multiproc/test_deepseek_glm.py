"""The frontier MoE families: DeepSeek-V3's architecture (DeepSeek-V3/R1, Kimi-K2, Moonlight:
multi-latent attention, sigmoid routing with an expert-score bias over groups and a scaling factor,
shared experts, first dense layers, YaRN; ``DeepseekV3ForCausalLM``) and GLM-4.5's
(``Glm4MoeForCausalLM``: q/k/v bias, q/k norm, RoPE on part of each head, the same routing) mapped
to megatron-core's MLA, attention and MoE layers.

Proven here, beside what tests/multiproc/test_moe_models.py proves for every MoE family (both are
``MOE_FAMILIES``: log-probs against transformers at TP=2, EP=2, TP=2 x EP=2, PP=2 and PP=2 x EP=2,
routing replay at each, HF -> shards -> HF bitwise):

* the configs' refusals, each naming its key; a checkpoint with multi-token-prediction layers;
* log-probs against transformers with YaRN, without a q latent (Moonlight's ``q_proj``) and with
  GLM's partial rotary, and negative controls: the expert-score bias dropped, YaRN dropped, the
  whole head rotated;
* one GRPO update (the real Learner, AdamW, clipping) at EP=2, at TP=2 x EP=2 with sequence
  parallelism, and at PP=2 gives the weights of one process, for both families.
"""

import json
import os

import pytest
import torch
from safetensors.torch import load_file

from megarl.builtin.tiny_checkpoint import make_tiny_hf_checkpoint, tiny_hf_config
from megarl.models.hf_config import ModelConfigError, check_parallel_fit, spec_from_hf_config
from tests._dist import torchrun
from tests._logits import transformers_log_probs
from tests._tolerance import NET_FP32_LOGPROB, adam_weights_tol, within

SMALL = dict(hidden_size=32, intermediate_size=64, num_heads=4)
#: YaRN stretched over a short original context, so that the 19-token rows cross its ramp
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0, "original_max_position_embeddings": 8,
        "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}
#: ... over a context of factor x that (transformers warns when the two disagree)
YARN_KW = dict(rope_parameters=YARN, max_position_embeddings=320)


def _cfg(**kw):
    return tiny_hf_config("deepseek_v3", **{**SMALL, **kw}).to_dict()


def test_deepseek_v3_config_maps_mla_routing_and_dense_layers():
    spec = spec_from_hf_config(_cfg(num_layers=3, first_k_dense_replace=2, **YARN_KW))
    mla, moe = spec.mla, spec.moe
    assert (mla.q_lora_rank, mla.kv_lora_rank, mla.qk_nope_head_dim, mla.qk_rope_head_dim, mla.v_head_dim) == (
        24, 16, 8, 8, 12)
    assert spec.head_dim == 16 and spec.num_query_groups == spec.num_attention_heads == 4
    assert mla.yarn.factor == 40.0 and mla.yarn.mscale_all_dim == 1.0 and spec.rope_theta == 10000.0
    assert moe.moe_layers == (False, False, True) and moe.score_function == "sigmoid" and moe.router_expert_bias
    assert (moe.num_groups, moe.group_topk, moe.routed_scaling_factor) == (2, 1, 2.5)
    assert moe.shared_expert_ffn_hidden_size == 32 and not moe.shared_expert_gate
    check_parallel_fit(spec, 4, 1, ep=4)  # the latent down projections are whole on every TP rank
    with pytest.raises(ModelConfigError, match="num_attention_heads=4 is not divisible by tensor parallel size tp=8"):
        check_parallel_fit(spec, 8, 1)


@pytest.mark.parametrize("kw,match", [
    (dict(norm_topk_prob=False), "norm_topk_prob=false"),
    (dict(n_group=2, topk_group=2), "n_group=2 with topk_group=2 and num_experts_per_tok=2"),
    (dict(moe_layer_freq=2), "moe_layer_freq=2"),
    (dict(attention_bias=True), "attention_bias=true"),
    (dict(rope_interleave=False), "rope_interleave=false"),
    (dict(scoring_func="softmax"), "scoring_func='softmax'"),
    (dict(first_k_dense_replace=2), "first_k_dense_replace=2 leaves no mixture-of-experts layer"),
    (dict(YARN_KW, rope_parameters=dict(YARN, truncate=False)), "truncate=false"),
])
def test_deepseek_v3_refusals_name_the_key(kw, match):
    with pytest.raises(ModelConfigError, match=match):
        spec_from_hf_config(_cfg(**kw))


def test_deepseek_v3_refuses_what_it_does_not_realise():
    cfg = _cfg()
    cfg["num_key_value_heads"] = 2
    with pytest.raises(ModelConfigError, match="num_key_value_heads=2 with multi-latent attention"):
        spec_from_hf_config(cfg)
    cfg = _cfg()  # DeepSeek's published checkpoint is fp8 with its scales: not a tensor layout megarl maps
    cfg["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]}
    with pytest.raises(ModelConfigError, match=r"\['quantization_config'\] are not understood"):
        spec_from_hf_config(cfg)


def _sharpen_attention(hf_dir, scale=6.0):
    """Scale the query and key projections up: a random tiny model's attention is near uniform,
    blind to its temperature and positions; sharpened, YaRN's softmax scale and frequencies show."""
    from safetensors.torch import save_file

    path = os.path.join(hf_dir, "model.safetensors")
    tensors = load_file(path)
    for name in tensors:
        if name.endswith(("q_b_proj.weight", "q_proj.weight", "kv_b_proj.weight")):
            tensors[name] = tensors[name] * scale
    save_file(tensors, path, metadata={"format": "pt"})


def test_deepseek_v3_yarn_and_q_proj_match_transformers_with_negative_controls(tmp_path, megatron_world):
    """YaRN and Moonlight's plain ``q_proj`` (no q latent), one process, against transformers;
    with the expert-score bias zeroed, or YaRN left out, the log-probs are over 20x the tolerance off."""
    import dataclasses

    from megarl.models.builder import BuildOptions, build_model
    from megarl.models.forward import teacher_forced_log_probs
    from megarl.models.megatron_ckpt import load_model
    from megarl.models.weights import load_hf_weights

    tokens = torch.randint(0, 260, (4, 19), generator=torch.Generator().manual_seed(1))
    cases = {"yarn": YARN_KW, "q_proj": dict(q_lora_rank=None, num_layers=3)}
    for name, kw in cases.items():
        d = make_tiny_hf_checkpoint(str(tmp_path / name), "deepseek_v3", seed=31, vocab_size=260, **SMALL, **kw)
        _sharpen_attention(d)
        ref = transformers_log_probs(d, tokens)
        model = load_model(d)
        err = (teacher_forced_log_probs(model, tokens) - ref).abs().max().item()
        assert within(err, NET_FP32_LOGPROB, f"deepseek_v3/{name}_vs_transformers"), (name, err)
        if name == "q_proj":
            assert any("linear_q_proj" in n for n, _ in model.named_parameters())
        biases = [m.expert_bias for m in model.modules() if getattr(m, "expert_bias", None) is not None]
        assert biases and all(b.abs().max() > 0 for b in biases)  # loaded from e_score_correction_bias
        for b in biases:
            b.zero_()
        off = (teacher_forced_log_probs(model, tokens) - ref).abs().max().item()
        assert off > 20 * NET_FP32_LOGPROB, (name, "expert bias dropped", off)
        if name == "yarn":
            spec = model.megarl_spec
            plain = dataclasses.replace(spec, mla=dataclasses.replace(spec.mla, yarn=None))
            other = build_model(plain, BuildOptions(init_weights=False))
            load_hf_weights(other, d, plain)
            off = (teacher_forced_log_probs(other, tokens) - ref).abs().max().item()
            assert off > 20 * NET_FP32_LOGPROB, ("yarn dropped", off)


def test_glm4_moe_config_maps_bias_norm_and_partial_rotary():
    spec = spec_from_hf_config(tiny_hf_config("glm4_moe", **SMALL).to_dict())
    assert spec.qkv_bias and not spec.linear_bias and spec.qk_norm and spec.rotary_percent == 0.5
    assert spec.mla is None and spec.head_dim == 8 and spec.num_query_groups == 2
    moe = spec.moe
    assert moe.score_function == "sigmoid" and moe.router_expert_bias and moe.hf_layout == "deepseek"
    assert moe.moe_layers == (False, True) and moe.shared_expert_ffn_hidden_size == 32
    # GLM-4.5's config.json holds the factor at the top level, transformers 5 in rope_parameters
    cfg = tiny_hf_config("glm4_moe", **SMALL).to_dict()
    cfg["rope_parameters"].pop("partial_rotary_factor")
    cfg["partial_rotary_factor"] = 0.5
    assert spec_from_hf_config(cfg).rotary_percent == 0.5
    cfg["partial_rotary_factor"] = 0.3  # 8 x 0.3 rotary dimensions
    with pytest.raises(ModelConfigError, match="partial_rotary_factor=0.3 of head_dim=8"):
        spec_from_hf_config(cfg)
    dense = tiny_hf_config("llama").to_dict()
    dense["partial_rotary_factor"] = 0.5
    with pytest.raises(ModelConfigError, match="partial_rotary_factor=0.5 is not supported for llama"):
        spec_from_hf_config(dense)


def test_glm4_moe_matches_transformers_and_the_whole_head_rotated_does_not(tmp_path, megatron_world):
    import dataclasses

    from megarl.models.builder import BuildOptions, build_model
    from megarl.models.forward import teacher_forced_log_probs
    from megarl.models.megatron_ckpt import load_model
    from megarl.models.weights import load_hf_weights

    tokens = torch.randint(0, 270, (4, 19), generator=torch.Generator().manual_seed(2))
    d = make_tiny_hf_checkpoint(str(tmp_path / "glm"), "glm4_moe", seed=33, vocab_size=270, num_kv_heads=2,
                                **SMALL)
    _sharpen_attention(d)
    ref = transformers_log_probs(d, tokens)
    model = load_model(d)
    err = (teacher_forced_log_probs(model, tokens) - ref).abs().max().item()
    assert within(err, NET_FP32_LOGPROB, "glm4_moe/one_process_vs_transformers"), err
    whole = dataclasses.replace(model.megarl_spec, rotary_percent=1.0)
    other = build_model(whole, BuildOptions(init_weights=False))
    load_hf_weights(other, d, whole)
    off = (teacher_forced_log_probs(other, tokens) - ref).abs().max().item()
    assert off > 20 * NET_FP32_LOGPROB, ("the whole head rotated", off)


def test_multi_token_prediction_layers_in_a_checkpoint_are_refused(tmp_path, megatron_world):
    """DeepSeek-V3 and GLM-4.5 publish their MTP layers as one more decoder layer
    (``model.layers.{num_hidden_layers}.*``, which transformers skips): megarl maps none, and refuses
    the checkpoint naming them rather than dropping them from every export."""
    from safetensors.torch import save_file

    from megarl.models.megatron_ckpt import load_model
    from megarl.models.safetensors_io import CheckpointError

    d = make_tiny_hf_checkpoint(str(tmp_path / "mtp"), "deepseek_v3", seed=3, vocab_size=64, **SMALL)
    path = os.path.join(d, "model.safetensors")
    tensors = load_file(path)
    tensors["model.layers.2.eh_proj.weight"] = torch.zeros(32, 64)
    tensors["model.layers.2.enorm.weight"] = torch.ones(32)
    save_file(tensors, path, metadata={"format": "pt"})
    with open(os.path.join(d, "config.json")) as f:
        cfg = json.load(f)
    cfg["num_nextn_predict_layers"] = 1
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(cfg, f)
    with pytest.raises(CheckpointError, match=r"decoder layer\(s\) \[2\] \(model.layers.2.\*\) past "
                                              r"num_hidden_layers=2: multi-token prediction \(num_nextn_predict_layers=1\)"):
        load_model(d)


#: the update's checkpoints: DeepSeek-V3 with YaRN (3 layers: the first dense), GLM-4.5 as
#: tiny_checkpoint makes it (2 layers)
UPDATE_FAMILIES = {"deepseek_v3": dict(YARN_KW, num_layers=3), "glm4_moe": dict(num_kv_heads=2)}
#: PP=2: an uneven split of DeepSeek-V3's 3 layers (the dense one alone on the first stage), an even
#: one of GLM's 2
PP_LAYOUT = {"deepseek_v3": "pp2uneven", "glm4_moe": "pp2update"}


@pytest.fixture(scope="module", params=sorted(UPDATE_FAMILIES))
def family_update(request, tmp_path_factory):
    fam = request.param
    root = tmp_path_factory.mktemp(f"{fam}_update")
    hf = make_tiny_hf_checkpoint(str(root / fam), fam, seed=13, vocab_size=64, **UPDATE_FAMILIES[fam], **SMALL)
    tags = ("ep1", "ep2", "tp2ep2", PP_LAYOUT[fam])
    torchrun("moe_train_worker.py", 2, "--hf", hf, "--out", str(root), "--layouts", *tags)
    res = {tag: torch.load(root / f"{tag}.pt") for tag in tags}
    res["pp2"] = res.pop(PP_LAYOUT[fam])
    return fam, hf, res


@pytest.mark.parametrize("tag", ["ep2", "tp2ep2", "pp2"])
def test_an_update_at_a_layout_equals_one_process(family_update, tag):
    """One GRPO update (two mini-batches, AdamW, clipping) at EP=2, at TP=2 x EP=2 (sequence
    parallelism, the experts whole on each EP rank) and at PP=2 (for DeepSeek-V3 an uneven split:
    parallel.first_stage_layers=1 of 3) gives the weights of EP=1, within the Adam bound of fp32
    gradients summed in another order; every expert, the routers, the MLA projections and their
    latent norms moved (the comparison is not vacuous for any tensor)."""
    fam, hf, res = family_update
    ref, got = res["ep1"], res[tag]
    if tag == "pp2" and fam == "deepseek_v3":  # the dense layer alone on the first stage, its experts none
        assert got["held_experts"] == [[], [0, 1, 2, 3]], got["held_experts"]
    initial = load_file(os.path.join(hf, "model.safetensors"))
    assert set(got["weights"]) == set(initial)
    assert ref["metrics"]["update/optimizer_steps"] == got["metrics"]["update/optimizer_steps"] == 2
    for name, t in initial.items():
        if name.endswith("e_score_correction_bias"):  # a buffer: no gradient, kept as loaded
            assert torch.equal(got["weights"][name], t) and torch.equal(ref["weights"][name], t), name
            continue
        assert (ref["weights"][name] - t).abs().max() > 1e-6, f"{name} did not move"
        err = (got["weights"][name] - ref["weights"][name]).abs().max().item()
        assert within(err, adam_weights_tol(3e-3, 2, 1e-3), f"frontier_moe/{tag}_vs_ep1/weights"), \
            f"{name}: {tag} differs from one process by {err} after one GRPO update"
    for key in ("update/grad_norm", "update/pg_loss"):
        rel = abs(got["metrics"][key] - ref["metrics"][key]) / abs(ref["metrics"][key])
        assert within(rel, 1e-5, f"frontier_moe/{tag}_vs_ep1/{key}_rel"), (key, rel)
