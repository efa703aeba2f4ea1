"""configs/grpo_moe_tiny.yaml end to end, shrunk: ``python -m megarl.train`` builds the built-in
tiny Qwen3-MoE (``model.tiny.family=qwen3_moe``: a real warm start through megatron's MoE layer)
into an empty cache, then trains GRPO with the rollout's routing recorded and the router's aux
and z losses on.  One launch proves: the build's checkpoint and marker are a Qwen3-MoE of the
configured experts (and the held-out accuracy is measured), the hf engine took the actor's
expert weights every iteration, each sealed batch carries the routing of its tokens, and the
router losses are reported per iteration with values their formulas allow."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from megarl.models.hf_config import load_spec
from tests._dist import ROOT, subprocess_env
from tests._train_runs import batches, metrics

RECIPE = os.path.join(ROOT, "configs", "grpo_moe_tiny.yaml")
ITERS = 3


def test_moe_tiny_recipe_builds_and_trains_with_router_losses(tmp_path):
    cache, run_dir = tmp_path / "cache", tmp_path / "run"
    overrides = ["model.tiny.hidden_size=32", "model.tiny.num_layers=2", "model.tiny.num_heads=2",
                 "model.tiny.num_kv_heads=1", "model.tiny.num_experts=4", "model.tiny.top_k=2",
                 "model.tiny.moe_intermediate_size=32", "model.tiny.warmstart_steps=20",
                 "data.arithmetic_train_n=200", "data.arithmetic_heldout_n=16", "eval.n=16", "eval.every=0",
                 f"trainer.iterations={ITERS}", "trainer.prompts_per_iteration=4", "rollout.n=4",
                 "trainer.save_experience=true", f"trainer.run_dir={run_dir}",
                 "actor.moe_aux_loss_coeff=0.01", "actor.moe_z_loss_coeff=0.001"]
    env = dict(subprocess_env(), MEGARL_CACHE=str(cache))
    proc = subprocess.run([sys.executable, "-m", "megarl.train", "--config", RECIPE, *overrides], env=env,
                          capture_output=True, text=True, timeout=600, cwd=str(tmp_path))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]

    model = cache / "tiny_arith_qwen3_moe"
    with open(model / "config.json") as f:
        hf = json.load(f)
    spec = load_spec(str(model))  # transformers 5 writes num_experts as num_local_experts
    assert hf["architectures"] == ["Qwen3MoeForCausalLM"] and spec.moe.num_experts == 4 and spec.moe.top_k == 2
    assert spec.moe.ffn_hidden_size == 32 and spec.moe.norm_topk_prob and all(spec.moe.moe_layers)
    with open(model / "tiny_model.json") as f:
        info = json.load(f)
    assert info["family"] == "qwen3_moe" and info["moe"] == {"num_experts": 4, "top_k": 2, "moe_intermediate_size": 32}
    assert 0.0 <= info["heldout_accuracy_greedy"] <= 1.0 and info["warmstart"]["steps"] == 20

    rows = metrics(str(run_dir))
    assert len(rows) == ITERS
    for r in rows:
        # E sum_i f_i P_i >= 1 (Cauchy-Schwarz; 1 at a perfectly balanced top-k), and at most E
        assert 1.0 - 1e-6 <= r["update/moe_aux_loss"] <= 4.0
        assert r["update/moe_z_loss"] > 0.0  # mean squared logsumexp of the router logits
        assert r["prep/routing/load_max_over_mean"] >= 1.0
        assert r["rollout/weight_sync_bytes"] > 0
    for b in batches(str(run_dir)):
        re = b.facts.routed_experts
        assert re is not None and re.experts.shape[2:] == (2, 2)  # (rows, tokens, MoE layers, top_k)
        assert re.experts.shape[:2] == b.facts.attention_mask.shape
        assert int(re.experts.max()) < 4 and (re.producer.role, re.producer.backend) == ("rollout", "hf")


def test_moe_recipe_keys_are_refused_naming_the_key():
    """model.tiny.family / top_k, rollout.ep: one error naming the key, before any model loads."""
    import pytest

    from megarl.config import ConfigError, load_config, validate, validate_model_fit
    from megarl.models.hf_config import spec_from_hf_config
    from megarl.models.tiny import tiny_hf_config

    def refused(overrides, key, world=1):
        with pytest.raises(ConfigError, match=rf"^{key}: "):
            validate(load_config(RECIPE, overrides), world)

    assert validate(load_config(RECIPE, []), 1) == 1
    refused(["model.tiny.family=mixtral"], r"model\.tiny\.family")
    refused(["model.tiny.top_k=9"], r"model\.tiny\.top_k")  # 8 experts
    refused(["rollout.ep=2"], r"rollout\.ep")  # the hf engine has no expert parallelism
    refused(["rollout.backend=sglang", "rollout.tp=2", "rollout.ep=4"], r"rollout\.ep", world=2)
    sg = load_config(RECIPE, ["rollout.backend=sglang", "rollout.tp=2", "rollout.ep=2", "algo.routing_replay=none"])
    assert validate(sg, 2) == 2
    moe = spec_from_hf_config(tiny_hf_config("qwen3_moe", num_experts=6).to_dict())
    validate_model_fit(sg, moe, "moe/config.json")
    with pytest.raises(ConfigError, match=r"^rollout\.ep: .*dense"):
        validate_model_fit(sg, spec_from_hf_config(tiny_hf_config("llama").to_dict()), "llama/config.json")
    with pytest.raises(ConfigError, match=r"^rollout\.ep: 4 must divide the number of routed experts .*\(6\)"):
        sg4 = load_config(RECIPE, ["rollout.backend=sglang", "rollout.tp=4", "rollout.ep=4", "algo.routing_replay=none"])
        validate_model_fit(sg4, moe, "moe/config.json")
