"""Mixture-of-experts models (Qwen3-MoE, Qwen2-MoE with its gated shared expert, Mixtral):
the HF config mapped to megatron-core's MoE layer, HF <-> megatron conversion bitwise at every
layout (experts placed over EP ranks, split over expert TP), and log-probs equal to
transformers' within ``NET_FP32_LOGPROB`` (fp32, two implementations: tests/_tolerance.py), and routing replay at every layout (a forced routing dispatched
on every token and layer, the log-probs those of one process replaying it).

One torchrun launch per layout proves all three families at once (tests/workers/moe_worker.py).
TP=2, EP=2, TP=2 x EP=2 (4 processes) and TP=2 x EP=2 with expert TP 1 run in CI; PP=2 and
PP=2 x EP=2 run in CI too.
"""

import json
import os

import pytest
import torch
from safetensors.torch import load_file

from megarl.builtin.tiny_checkpoint import MOE_FAMILIES, make_tiny_hf_checkpoint, tiny_hf_config
from megarl.models.hf_config import ModelConfigError, check_parallel_fit, spec_from_hf_config
from tests._dist import ROOT, torchrun
from tests._hf_tensors import assert_bitwise, load_all
from tests._logits import transformers_log_probs
from tests._routing import forced_routing, moe_layer_indices
from tests._tolerance import LAYOUT_FP32_LOGPROB, NET_FP32_LOGPROB, within
from tests._moe import QWEN3_30B_A3B

#: tiny shapes: hidden 32, 2 layers, 4 experts, top-2; one vocabulary needing padding, one tied
OVERRIDES = {
    "qwen3_moe": dict(vocab_size=300),  # q/k norm, norm_topk_prob=true, untied, padded vocab
    "qwen2_moe": dict(vocab_size=257, tie_word_embeddings=True),  # qkv bias, shared expert + gate, raw top-k
    "mixtral": dict(vocab_size=256),
    # multi-latent attention (q latent), sigmoid routing over 2 groups with a random expert-score
    # bias and scaled weights, a shared expert, layer 0 dense
    "deepseek_v3": dict(vocab_size=260),
    # GLM-4.5: q/k/v bias without an o_proj bias, q/k norm, RoPE on half of each head, DeepSeek-V3's routing
    "glm4_moe": dict(vocab_size=270),
}
SMALL = dict(hidden_size=32, intermediate_size=64, num_heads=4, num_kv_heads=2)


@pytest.fixture(scope="module")
def moe_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe")
    for i, fam in enumerate(MOE_FAMILIES):
        make_tiny_hf_checkpoint(str(root / fam), fam, seed=20 + i, **SMALL, **OVERRIDES[fam])
    # a Qwen3-MoE whose first layer is dense (mlp_only_layers)
    make_tiny_hf_checkpoint(str(root / "qwen3_moe_dense0"), "qwen3_moe", seed=29, vocab_size=256,
                            mlp_only_layers=[0], **SMALL)
    tokens = torch.randint(0, 256, (5, 19), generator=torch.Generator().manual_seed(0))
    torch.save(tokens, root / "tokens.pt")
    refs = {fam: transformers_log_probs(str(root / fam), tokens) for fam in MOE_FAMILIES + ("qwen3_moe_dense0",)}
    return root, tokens, refs


# --------------------------------------------------------------------------------------------
# config -> MoESpec (no model built)
# --------------------------------------------------------------------------------------------

def _cfg(fam, **kw):
    return tiny_hf_config(fam, **SMALL, **kw).to_dict()


def test_moe_config_maps_each_family():
    q3 = spec_from_hf_config(_cfg("qwen3_moe"))
    assert q3.qk_norm and not q3.qkv_bias and q3.moe.norm_topk_prob and q3.moe.shared_expert_ffn_hidden_size is None
    assert (q3.moe.num_experts, q3.moe.top_k, q3.moe.ffn_hidden_size) == (4, 2, 32)
    q2 = spec_from_hf_config(_cfg("qwen2_moe"))
    assert q2.qkv_bias and not q2.qk_norm and not q2.moe.norm_topk_prob
    assert q2.moe.shared_expert_ffn_hidden_size == 64 and q2.moe.shared_expert_gate
    mx = spec_from_hf_config(_cfg("mixtral"))
    assert mx.moe.norm_topk_prob and mx.moe.ffn_hidden_size == 64 and mx.moe.hf_layout == "mixtral"
    # transformers' sparse-layer rule: not in mlp_only_layers and (i + 1) % decoder_sparse_step == 0
    assert spec_from_hf_config(_cfg("qwen3_moe", num_layers=4, decoder_sparse_step=2)).moe.moe_layers == (
        False, True, False, True)
    assert spec_from_hf_config(_cfg("qwen2_moe", mlp_only_layers=[1])).moe.moe_layers == (True, False)


def test_moe_transformer_config_fields():
    from megarl.models.builder import BuildOptions, moe_transformer_config

    assert moe_transformer_config(spec_from_hf_config(tiny_hf_config("qwen3").to_dict()), BuildOptions()) == {}
    q2 = moe_transformer_config(spec_from_hf_config(_cfg("qwen2_moe", mlp_only_layers=[0])), BuildOptions(ep=2))
    assert q2["moe_router_pre_softmax"] is True  # norm_topk_prob=false: softmax over all, then top-k
    assert q2["moe_shared_expert_gate"] and q2["moe_shared_expert_intermediate_size"] == 64
    assert q2["moe_layer_freq"] == [0, 1] and q2["moe_router_dtype"] == "fp32"
    assert q2["moe_aux_loss_coeff"] == 0.0 and q2["moe_grouped_gemm"] is False
    assert q2["expert_model_parallel_size"] == 2 and q2["expert_tensor_parallel_size"] == 1
    mx = moe_transformer_config(spec_from_hf_config(_cfg("mixtral")), BuildOptions(tp=2))
    assert mx["moe_router_pre_softmax"] is False and mx["expert_tensor_parallel_size"] == 2


@pytest.mark.parametrize("fam,kw,match", [
    ("mixtral", dict(num_experts_per_tok=1), "num_experts_per_tok=1 with norm_topk_prob"),
    ("mixtral", dict(router_jitter_noise=0.1), "router_jitter_noise"),
    ("qwen3_moe", dict(attention_bias=True), "attention_bias"),
    ("qwen3_moe", dict(mlp_only_layers=[0, 1]), "no layer is a mixture-of-experts layer"),
    ("qwen2_moe", dict(mlp_only_layers=[5]), "mlp_only_layers"),
])
def test_moe_config_refusals_name_the_key(fam, kw, match):
    with pytest.raises(ModelConfigError, match=match):
        spec_from_hf_config(_cfg(fam, **kw))


def test_moe_keys_are_refused_on_dense_families():
    cfg = tiny_hf_config("qwen3").to_dict()
    cfg["num_experts"] = 4
    with pytest.raises(ModelConfigError, match="num_experts"):
        spec_from_hf_config(cfg)


def test_moe_parallel_fit():
    q3 = spec_from_hf_config(_cfg("qwen3_moe"))
    check_parallel_fit(q3, 2, 1, ep=4)
    check_parallel_fit(q3, 2, 1, ep=2, etp=1)
    with pytest.raises(ModelConfigError, match="number of experts .4. is not divisible by expert parallel size ep=3"):
        check_parallel_fit(q3, 1, 1, ep=3)
    with pytest.raises(ModelConfigError, match="moe_intermediate_size=32 is not divisible by expert tensor parallel"):
        check_parallel_fit(q3, 1, 1, etp=3)
    with pytest.raises(ModelConfigError, match="needs a mixture-of-experts model"):
        check_parallel_fit(spec_from_hf_config(tiny_hf_config("llama").to_dict()), 1, 1, ep=2)


def test_moe_mapping_covers_the_checkpoint(moe_dirs):
    from megarl.models import mapping

    root, _, _ = moe_dirs
    for fam in MOE_FAMILIES + ("qwen3_moe_dense0",):
        with open(root / fam / "config.json") as f:
            spec = spec_from_hf_config(json.load(f))
        src = load_file(str(root / fam / "model.safetensors"))
        assert mapping.hf_shapes(spec) == {k: tuple(v.shape) for k, v in src.items()}, fam
        names = [h for r in mapping.rules(spec) for h in r.hf_names]
        assert sorted(names) == sorted(src), fam  # every HF tensor exactly once
        experts = [r for r in mapping.rules(spec) if r.expert is not None]
        assert {r.tp_group for r in experts} == {mapping.EXPERT_TP_GROUP}
        assert [mapping.expert_owner(r, spec, 2) for r in experts if r.layer == spec.moe.moe_layer_indices[0]] == [
            0, 0, 0, 0, 1, 1, 1, 1]  # 4 experts x (fc1, fc2): EP rank 0 holds experts 0-1, rank 1 experts 2-3


# --------------------------------------------------------------------------------------------
# one process: TP = EP = 1, in-process (quick)
# --------------------------------------------------------------------------------------------

def test_moe_single_process_parity_and_roundtrip(moe_dirs, tmp_path, megatron_world):
    from megarl.models.forward import teacher_forced_log_probs
    from megarl.models.megatron_ckpt import load_model, save_megatron_checkpoint
    from megarl.models.weights import export_hf

    root, tokens, refs = moe_dirs
    for fam in MOE_FAMILIES + ("qwen3_moe_dense0",):
        model = load_model(str(root / fam))
        err = (teacher_forced_log_probs(model, tokens) - refs[fam]).abs().max().item()
        assert within(err, NET_FP32_LOGPROB, f"moe_models/{fam}/one_process_vs_transformers"), \
            f"{fam}: max |log-prob diff| vs transformers = {err}"
        save_megatron_checkpoint(model, str(tmp_path / fam / "meg"), tokenizer_dir=str(root / fam))
        export_hf(load_model(str(tmp_path / fam / "meg")), str(tmp_path / fam / "back"))
        assert_bitwise(load_file(str(root / fam / "model.safetensors")), load_all(str(tmp_path / fam / "back")),
                        f"{fam} tp1 ep1")


# --------------------------------------------------------------------------------------------
# torchrun layouts: all three families in one launch each
# --------------------------------------------------------------------------------------------

#: Layouts proven in CI, one launch each (~12 s for 2 processes, ~21 s for 4 on the 2-core CI
#: machine), the pipeline-parallel MoE ones included: a stage holds its layers' experts and the
#: manifest unions them over EP, then PP.
LAYOUTS = [  # (tp, pp, ep, etp, processes)
    pytest.param(2, 1, 1, None, 2, id="tp2"),
    pytest.param(1, 1, 2, None, 2, id="ep2"),
    pytest.param(2, 1, 2, None, 4, id="tp2_ep2"),  # expert TP = TP = 2, EP = 2: 4 processes
    pytest.param(2, 1, 2, 1, 2, id="tp2_ep2_etp1"),  # expert TP 1 under attention TP 2: EP spans the TP ranks
    pytest.param(1, 2, 1, None, 2, id="pp2"),
    pytest.param(1, 2, 2, None, 4, id="pp2_ep2"),
]


def replayed_reference(hf_dir, tokens, lengths):
    """Log-probs of one process (TP = EP = 1) replaying the worker's forced routing."""
    from megarl.models.forward import Routing, teacher_forced_log_probs
    from megarl.models.megatron_ckpt import load_model

    model = load_model(str(hf_dir))
    moe = model.megarl_spec.moe
    forced = forced_routing(tokens.shape[0], tokens.shape[1], moe_layer_indices(model), moe.top_k, moe.num_experts,
                            lengths)
    return teacher_forced_log_probs(model, tokens, micro_batch_size=2, lengths=lengths,
                                    routing=Routing(forced, replay=True))


def _check_layout(moe_dirs, out, tp, pp, ep, etp, nproc):
    root, tokens, refs = moe_dirs
    torchrun("moe_worker.py", nproc, "--tp", str(tp), "--pp", str(pp), "--ep", str(ep),
             *(["--etp", str(etp)] if etp else []), "--data", str(root), "--out", str(out),
             "--families", *MOE_FAMILIES)
    tag = f"tp{tp}_pp{pp}_ep{ep}_etp{etp or tp}"
    for fam in MOE_FAMILIES:
        got = torch.load(out / f"{fam}_{tag}.pt")
        err = (got["log_probs"] - refs[fam]).abs().max().item()
        assert within(err, NET_FP32_LOGPROB, f"moe_models/{fam}/{tag}/vs_transformers"), \
            f"{fam} {tag}: max |log-prob diff| vs transformers = {err}"
        lengths = torch.tensor([19, 4, 11, 1, 16])
        valid = torch.arange(18)[None, :] < (lengths - 1)[:, None]
        r_err = ((got["ragged_log_probs"] - refs[fam]) * valid).abs().max().item()
        assert within(r_err, NET_FP32_LOGPROB, f"moe_models/{fam}/{tag}/ragged_vs_transformers"), \
            f"{fam} {tag}: ragged rows differ by {r_err}"
        # routing replay at this layout: the forced experts dispatched on every token and layer,
        # the log-probs those of one process replaying the same routing
        assert got["replay"]["replay_differs"] == 0.0 and got["replay"]["tokens"] == float(valid.sum()), got["replay"]
        want = replayed_reference(root / fam, tokens, lengths)
        # one implementation (megatron's local layers) on the same weights and routing; the
        # layout re-sums the TP / EP partial products
        rp_err = ((got["replayed_log_probs"] - want) * valid).abs().max().item()
        assert within(rp_err, LAYOUT_FP32_LOGPROB, f"moe_models/{fam}/{tag}/replayed_vs_one_process"), \
            f"{fam} {tag}: replayed log-probs differ from one process by {rp_err}"
        # the forced routing is a different sub-network: far outside the tolerance
        assert ((got["replayed_log_probs"] - got["ragged_log_probs"]) * valid).abs().max() > 100 * LAYOUT_FP32_LOGPROB
        if tp > 1:  # the same with sequence parallelism: each TP rank replays its part of the sequence
            sp, full = got["replay_sp"], got["replay"]
            assert (sp["tokens"], sp["replay_differs"]) == (full["tokens"], 0.0), (sp, full)
            # the routers' own choice on states summed in another order: at most a token apart
            assert abs(sp["mismatch_tokens"] - full["mismatch_tokens"]) * full["tokens"] <= 1, (sp, full)
            for key in ("replayed_log_probs", "ragged_log_probs"):
                sp_err = ((got[f"{key}_sp"] - got[key]) * valid).abs().max().item()
                assert within(sp_err, LAYOUT_FP32_LOGPROB, f"moe_models/{fam}/{tag}/{key}_sp"), (key, sp_err)
        src = load_file(str(root / fam / "model.safetensors"))
        assert_bitwise(src, load_all(str(out / f"{fam}_{tag}_export")), f"{fam} {tag}: HF -> shards -> HF")
        assert_bitwise(src, load_all(str(out / f"{fam}_{tag}_back")), f"{fam} {tag}: HF -> dist ckpt -> HF")
        with open(out / f"{fam}_{tag}_meg" / "megarl_model.json") as f:
            meta = json.load(f)
        assert (meta["saved_tp"], meta["saved_pp"], meta["saved_ep"], meta["saved_etp"]) == (tp, pp, ep, etp or tp)
    with open(out / f"placement_{tag}.json") as f:
        placement = json.load(f)
    for r in placement["ranks"]:  # EP rank e holds experts [e * E / ep, (e + 1) * E / ep)
        assert r["train_refused"] is (True if tp > 1 else None), r  # what config.py refuses at start-up
        for fam in MOE_FAMILIES:
            n = 4 // ep
            want = list(range(r["ep_rank"] * n, (r["ep_rank"] + 1) * n))
            with open(root / fam / "config.json") as f:
                moe_layers = spec_from_hf_config(json.load(f)).moe.moe_layers
            per_stage = len(moe_layers) // pp
            if not any(moe_layers[r["pp_rank"] * per_stage:(r["pp_rank"] + 1) * per_stage]):
                want = []  # a stage of dense layers only (DeepSeek-V3's first layer) holds no expert
            assert r["experts"][fam] == want, (fam, r)
    return tag


@pytest.mark.parametrize("tp,pp,ep,etp,nproc", LAYOUTS)
def test_moe_layout_roundtrip_and_parity(moe_dirs, tmp_path, tp, pp, ep, etp, nproc, megatron_world):
    from megarl.models.megatron_ckpt import load_model
    from megarl.models.weights import export_hf

    tag = _check_layout(moe_dirs, tmp_path, tp, pp, ep, etp, nproc)
    # the dist checkpoint saved at this layout reloads at TP = EP = 1 (experts resharded): bitwise
    root = moe_dirs[0]
    for fam in MOE_FAMILIES:
        export_hf(load_model(str(tmp_path / f"{fam}_{tag}_meg")), str(tmp_path / f"{fam}_{tag}_to1"))
        assert_bitwise(load_file(str(root / fam / "model.safetensors")), load_all(str(tmp_path / f"{fam}_{tag}_to1")),
                        f"{fam} {tag} -> tp1 ep1")


def test_parallel_ep_keys_are_validated_by_name():
    """parallel.ep / parallel.etp: ranges and world fit (validate), experts against EP and a dense
    model with ep > 1 (validate_model_fit), each refused naming the key."""
    from megarl.commands.run_checks import check_run
    from megarl.config import ConfigError, load_config
    from megarl.models.fit import validate_model_fit
    from tests._dist import ROOT

    recipe = os.path.join(ROOT, "configs", "grpo_arith_tiny.yaml")
    cfg = load_config(recipe, ["parallel.ep=2"])
    assert check_run(cfg, 2) == 2  # ep comes out of the data-parallel ranks
    with pytest.raises(ConfigError, match=r"parallel\.ep"):
        check_run(load_config(recipe, ["parallel.ep=2", "parallel.tp=2"]), 2)
    with pytest.raises(ConfigError, match=r"parallel\.ep"):
        validate_model_fit(cfg, spec_from_hf_config(tiny_hf_config("llama").to_dict()), "llama/config.json")
    validate_model_fit(cfg, spec_from_hf_config(_cfg("qwen3_moe")), "q/config.json")
    with pytest.raises(ConfigError, match=r"parallel\.ep: .*number of experts \(4\)"):
        validate_model_fit(load_config(recipe, ["parallel.ep=3"]), spec_from_hf_config(_cfg("qwen3_moe")), "q")
    with pytest.raises(ConfigError, match=r"parallel\.etp: .*moe_intermediate_size=32"):
        validate_model_fit(load_config(recipe, ["parallel.etp=3"]), spec_from_hf_config(_cfg("qwen3_moe")), "q")
    # training MoE layers at tp > 1 needs sequence parallelism (megatron-core): refused at start-up
    with pytest.raises(ConfigError, match=r"parallel\.tp.*sequence parallelism"):
        validate_model_fit(load_config(recipe, ["parallel.tp=2"]), spec_from_hf_config(_cfg("qwen3_moe")), "q")
    validate_model_fit(load_config(recipe, ["parallel.tp=2", "parallel.sequence_parallel=true"]),
                       spec_from_hf_config(_cfg("qwen3_moe")), "q")  # with it, MoE trains at tp > 1


def test_param_count_of_a_real_moe_config():
    """Qwen3-30B-A3B: 30.53 B parameters; at tp 2 x ep 8 (etp 1) the experts split eight ways and
    the rest two ways."""
    from megarl.commands.dry_run import count_params

    spec = spec_from_hf_config(QWEN3_30B_A3B)
    assert spec.moe.num_experts == 128 and spec.moe.top_k == 8 and spec.moe.norm_topk_prob
    n = count_params(spec, 128, 1, 1)
    experts = 48 * 128 * 3 * 2048 * 768
    assert n.total == 30_532_122_624
    shard = count_params(spec, 128, 2, 1, ep=8, etp=1).per_shard
    assert shard == (n.total - 2048 - experts) // 2 + experts // 8 + 2048
    # Mixtral-8x7B's config.json: 46.7 B parameters
    mixtral = spec_from_hf_config({
        "architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "hidden_size": 4096, "intermediate_size": 14336,
        "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "num_local_experts": 8,
        "num_experts_per_tok": 2, "vocab_size": 32000, "rms_norm_eps": 1e-5, "rope_theta": 1e6, "sliding_window": None,
        "max_position_embeddings": 32768, "tie_word_embeddings": False, "hidden_act": "silu", "output_router_logits": False,
        "router_aux_loss_coef": 0.02, "torch_dtype": "bfloat16", "bos_token_id": 1, "eos_token_id": 2,
        "attention_dropout": 0.0, "initializer_range": 0.02, "use_cache": True, "transformers_version": "4.36.0"})
    assert round(count_params(mixtral, 128, 1, 1).total / 1e9, 1) == 46.7


def test_tools_take_ep_and_refuse_misfits_by_flag(moe_dirs, tmp_path):
    """``--ep`` / ``--etp`` on the tools: a dense model with --ep 2, experts that do not divide, and
    a world that does not hold the layout are refused before any process group exists."""
    import subprocess
    import sys

    from tests._dist import ROOT, subprocess_env

    root = moe_dirs[0]
    dense = make_tiny_hf_checkpoint(str(tmp_path / "llama"), "llama", seed=1, **SMALL)
    tool = os.path.join(ROOT, "tools", "convert_checkpoint.py")
    cases = [
        ([dense, "--ep", "2"], "needs a mixture-of-experts model"),
        ([str(root / "qwen3_moe"), "--ep", "3"], "not divisible by expert parallel size ep=3"),
        ([str(root / "qwen3_moe"), "--ep", "2"], "--ep 2 --etp 1 needs exactly 2 processes"),
    ]
    for args, msg in cases:
        proc = subprocess.run([sys.executable, tool, "hf-to-megatron", "--hf", args[0], "--out", str(tmp_path / "o"),
                               *args[1:]], capture_output=True, text=True, env=subprocess_env(), timeout=300)
        assert proc.returncode == 2 and msg in proc.stderr, (args, proc.stderr[-2000:])
    score = os.path.join(ROOT, "tools", "score.py")
    (tmp_path / "in.jsonl").write_text('{"token_ids": [1, 2, 3]}\n')
    proc = subprocess.run([sys.executable, score, "--model", dense, "--input", str(tmp_path / "in.jsonl"),
                           "--out", str(tmp_path / "out.jsonl"), "--ep", "2"],
                          capture_output=True, text=True, env=subprocess_env(), timeout=300)
    assert proc.returncode == 2 and "needs a mixture-of-experts model" in proc.stderr, proc.stderr[-2000:]


def test_score_tool_at_ep2_matches_transformers(moe_dirs, tmp_path):
    """``tools/score.py --ep 2``: the EP ranks score the same batches together (the token dispatcher
    gathers over them) and the log-probs equal transformers'."""
    from tests._dist import ROOT

    root, tokens, refs = moe_dirs
    rows = [tokens[i, :n].tolist() for i, n in enumerate([19, 4, 11, 2, 16])]
    (tmp_path / "in.jsonl").write_text("".join(json.dumps({"token_ids": r}) + "\n" for r in rows))
    torchrun(os.path.join(ROOT, "tools", "score.py"), 2, "--model", str(root / "qwen2_moe"), "--input",
             str(tmp_path / "in.jsonl"), "--out", str(tmp_path / "out.jsonl"), "--ep", "2", "--micro-batch-size", "2")
    got = [json.loads(line)["token_logprobs"] for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    for i, r in enumerate(rows):
        err = (torch.tensor(got[i]) - refs["qwen2_moe"][i, : len(r) - 1]).abs().max().item()
        assert within(err, NET_FP32_LOGPROB, "moe_models/score_tool_ep2_vs_transformers"), f"row {i}: {err}"
