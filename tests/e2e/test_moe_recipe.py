"""configs/grpo_moe_tiny.yaml end to end, shrunk: ``python -m megarl.train`` builds the built-in
tiny Qwen3-MoE (``model.tiny.family=qwen3_moe``: a real warm start through megatron's MoE layer)
into an empty cache, then trains GRPO with the rollout's routing recorded and replayed and the
router's aux and z losses on.  One launch proves:

* the build's checkpoint and marker are a Qwen3-MoE of the configured experts, and the marker's
  held-out accuracy is the one :func:`megarl.builtin.tasks.arithmetic.heldout_accuracy` measures on it;
* the hf engine served the actor's weights, experts included, every iteration: each sealed
  batch's rollout log-probs are those of that iteration's export (transformers, teacher-forced);
* each sealed batch carries the routing of its tokens: the recorded top-k experts are the ones
  transformers' routers choose on that export, on every recorded token and MoE layer;
* the router losses are reported every iteration, within the bounds their formulas imply (their
  exact values and gradients are tests/unit/models/test_moe_losses.py's)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from megarl.models.hf_config import load_spec
from tests._dist import ROOT, subprocess_env
from tests._moe import SHRUNK, assert_routing_is_the_exports
from tests._tolerance import NET_FP32_LOGPROB, max_abs_diff, within
from tests._train_runs import batches, hf_response_log_probs, metrics

RECIPE = os.path.join(ROOT, "configs", "grpo_moe_tiny.yaml")
ITERS = 3


def test_moe_tiny_recipe_builds_and_trains_with_router_losses(tmp_path):
    from megarl.builtin.tasks.arithmetic import heldout_accuracy

    cache, run_dir = tmp_path / "cache", tmp_path / "run"
    overrides = [*SHRUNK, f"trainer.iterations={ITERS}", "trainer.prompts_per_iteration=4", "rollout.n=4",
                 "trainer.save_experience=true", "trainer.export_every=1", f"trainer.run_dir={run_dir}",
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
    assert info["warmstart"]["steps"] == 20
    # greedy decoding of one model on one CPU process: the same accuracy when measured again
    assert heldout_accuracy(str(model), n=info["warmstart"]["heldout_n"]) == info["heldout_accuracy_greedy"]

    rows = metrics(str(run_dir))
    assert len(rows) == ITERS
    for r in rows:
        # E sum_i f_i P_i >= 1 (Cauchy-Schwarz; 1 at a perfectly balanced top-k), and at most E
        assert 1.0 - 1e-6 <= r["update/moe_aux_loss"] <= 4.0
        assert r["update/moe_z_loss"] > 0.0  # mean squared logsumexp of the router logits
        assert r["prep/routing/load_max_over_mean"] >= 1.0
        assert r["rollout/weight_sync_bytes"] > 0
    sealed = batches(str(run_dir))
    assert len(sealed) == ITERS
    for k, b in enumerate(sealed):
        f = b.facts
        re = f.routed_experts
        assert re is not None and re.experts.shape[2:] == (2, 2)  # (rows, tokens, MoE layers, top_k)
        assert re.experts.shape[:2] == f.attention_mask.shape
        assert int(re.experts.max()) < 4 and (re.producer.role, re.producer.backend) == ("rollout", "hf")
        assert re.producer.version == f.policy_version[0]
        # the engine served export k (experts included): its log-probs are that export's (fp32,
        # transformers generate vs teacher-forced: two code paths, tests/_tolerance.py)
        hf_model, (lp, _) = hf_response_log_probs(os.path.join(str(run_dir), "export", f"iter_{k}"), f)
        err = max_abs_diff(lp, f.rollout_log_probs.values, f.response_mask != 0)
        assert within(err, NET_FP32_LOGPROB, "moe_recipe/rollout_vs_export"), (k, err)
        # and the recorded routing is what that export's routers choose
        assert_routing_is_the_exports(hf_model, f, k)


def test_moe_recipe_keys_are_refused_naming_the_key():
    """model.tiny.family / top_k, rollout.ep: one error naming the key, before any model loads."""
    import pytest

    from megarl.builtin.tiny_checkpoint import tiny_hf_config
    from megarl.commands.run_checks import check_run
    from megarl.config import ConfigError, load_config
    from megarl.models.fit import validate_model_fit
    from megarl.models.hf_config import spec_from_hf_config

    def refused(overrides, key, world=1):
        with pytest.raises(ConfigError, match=rf"^{key}: "):
            check_run(load_config(RECIPE, overrides), world)

    assert check_run(load_config(RECIPE, []), 1) == 1
    refused(["model.tiny.family=mixtral"], r"model\.tiny\.family")
    refused(["model.tiny.top_k=9"], r"model\.tiny\.top_k")  # 8 experts
    refused(["rollout.ep=2"], r"rollout\.ep")  # the hf engine has no expert parallelism
    refused(["rollout.backend=sglang", "rollout.tp=2", "rollout.ep=4"], r"rollout\.ep", world=2)
    sg = load_config(RECIPE, ["rollout.backend=sglang", "rollout.tp=2", "rollout.ep=2", "algo.routing_replay=none"])
    assert check_run(sg, 2) == 2
    moe = spec_from_hf_config(tiny_hf_config("qwen3_moe", num_experts=6).to_dict())
    validate_model_fit(sg, moe, "moe/config.json")
    with pytest.raises(ConfigError, match=r"^rollout\.ep: .*dense"):
        validate_model_fit(sg, spec_from_hf_config(tiny_hf_config("llama").to_dict()), "llama/config.json")
    with pytest.raises(ConfigError, match=r"^rollout\.ep: 4 must divide the number of routed experts .*\(6\)"):
        sg4 = load_config(RECIPE, ["rollout.backend=sglang", "rollout.tp=4", "rollout.ep=4", "algo.routing_replay=none"])
        validate_model_fit(sg4, moe, "moe/config.json")
