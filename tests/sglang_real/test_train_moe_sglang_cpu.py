"""configs/grpo_moe_tiny.yaml with ``rollout.backend=sglang`` on CPU, as a user runs it (shrunk, from
an empty cache: the built-in tiny Qwen3-MoE is built first): SGLang records the experts each token
was routed to, megatron replays them (``algo.routing_replay=rollout``), and the update trains on
them.  One launch proves:

* SGLang's routed experts are the megatron router's on the same tokens: the trainer's own top-k,
  teacher-forced on the sealed batch, differs from SGLang's record on no more (token, layer) pairs
  than fp32 near-ties allow (``prep/routing/mismatch_router``), and under replay every recorded
  token of every layer is dispatched to exactly SGLang's experts (``prep/routing/replay_differs``);
* the record is SGLang's (producer backend ``sglang``, the version that sampled it), of the batch's
  shape, and it is the top-k that transformers' routers choose on that version's export wherever
  the choice is not a near-tie;
* the engine held each version exactly: its raw log-probs are that export's (transformers,
  teacher-forced), and >100x off the previous export's (the negative control);
* the routing-replay update ran on it every iteration (the router losses are reported).
"""

from __future__ import annotations

import os
import subprocess
import sys

from tests._dist import ROOT, subprocess_env
from tests._tolerance import NET_FP32_LOGPROB, max_abs_diff, within
from tests._train_runs import batches, hf_response_log_probs, metrics
from tests._moe import SHRUNK, assert_routing_is_the_exports

RECIPE = os.path.join(ROOT, "configs", "grpo_moe_tiny.yaml")
ITERS = 3
#: fp32 on both sides (SGLang's torch-native MoE and megatron's router): a top-k set may differ
#: only where two router logits tie within rounding; on this random tiny model such ties are rare
MAX_FP32_ROUTER_MISMATCH = 0.01


def test_moe_recipe_trains_with_sglangs_routing_replayed_in_megatron(tmp_path):
    cache, run_dir = tmp_path / "cache", tmp_path / "run"
    overrides = [*SHRUNK, "rollout.backend=sglang", "algo.routing_replay=rollout", "trainer.run_id=sglang-moe-cpu",
                 f"trainer.iterations={ITERS}", "trainer.prompts_per_iteration=4", "rollout.n=4",
                 "trainer.save_experience=true", "trainer.export_every=1", f"trainer.run_dir={run_dir}",
                 "actor.optim.lr=1.0e-2", "actor.moe_aux_loss_coeff=0.01",
                 # the actor's old-log-prob forward (where the routing is compared) every iteration
                 "rollout.log_prob_parity_every=1",
                 "reward.fn=tests.plugins.faulty_rewards:digit_count"]  # every group has variance: every update moves
    env = dict(subprocess_env(), MEGARL_CACHE=str(cache))
    proc = subprocess.run([sys.executable, "-m", "megarl.train", "--config", RECIPE, *overrides], env=env,
                          capture_output=True, text=True, timeout=900, cwd=str(tmp_path))
    assert proc.returncode == 0, f"--- stdout ---\n{proc.stdout[-4000:]}\n--- stderr ---\n{proc.stderr[-8000:]}"

    rows = metrics(str(run_dir))
    assert [r["iteration"] for r in rows] == list(range(ITERS))
    for r in rows:
        assert r["prep/routing/tokens"] > 0
        assert r["prep/routing/replay_differs"] == 0.0, r["prep/routing/replay_differs"]
        assert r["prep/routing/mismatch_router"] <= MAX_FP32_ROUTER_MISMATCH, r["prep/routing/mismatch_router"]
        assert 1.0 - 1e-6 <= r["update/moe_aux_loss"] <= 4.0  # the update ran through the routed layers
        # the actor, replaying SGLang's routing, gives SGLang's log-probs (fp32)
        assert within(r["prep/rollout_actor_logprob_max_abs_err"], NET_FP32_LOGPROB, "sglang_cpu/rollout_vs_actor")
    sealed = batches(str(run_dir))
    assert len(sealed) == ITERS
    for k, b in enumerate(sealed):
        f = b.facts
        re = f.routed_experts
        assert re is not None and (re.producer.role, re.producer.backend) == ("rollout", "sglang")
        assert re.producer.version == f.policy_version[0] and len(set(f.policy_version)) == 1
        assert re.experts.shape[:2] == f.attention_mask.shape and re.experts.shape[2:] == (2, 2)
        assert int(re.experts.max()) < 4 and len(set(re.experts.flatten().tolist())) > 2  # routing is not constant
        export = os.path.join(str(run_dir), "export", f"iter_{k}")
        hf_model, (lp, _) = hf_response_log_probs(export, f)
        err = max_abs_diff(lp, f.rollout_log_probs.values, f.response_mask != 0)
        assert within(err, NET_FP32_LOGPROB, "sglang_cpu/engine_vs_export"), (k, err)
        if k:  # negative control: the previous version's export is far off, so the check can fail
            _, (prev, _) = hf_response_log_probs(os.path.join(str(run_dir), "export", f"iter_{k - 1}"), f)
            assert max_abs_diff(prev, f.rollout_log_probs.values, f.response_mask != 0) > 100 * NET_FP32_LOGPROB
        assert_routing_is_the_exports(hf_model, f, k)
