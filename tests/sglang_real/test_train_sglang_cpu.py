"""megarl.train with ``rollout.backend=sglang`` on CPU: the GPU path's control flow, run for real
with the real engine (one process: the hybrid placement, the engine in-process beside the actor)."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from tests._dist import subprocess_env
from tests._tolerance import NET_FP32_LOGPROB, max_abs_diff, within
from tests._train_runs import GRPO, batches, hf_response_log_probs, metrics

ITERS = 3


LORA = ["actor.lora.rank=4", "actor.lora.alpha=8"]


@pytest.mark.parametrize("lora", [[], LORA, [*LORA, "actor.lora.engine=adapter"]], ids=["full", "lora", "lora_adapter"])
def test_grpo_trains_on_what_the_real_engine_sampled_with_the_version_it_was_sent(assets, tmp_path, lora):
    """With ``actor.lora`` the engine is sent the merged weights (W + s B A, per TP shard): what it
    samples is what the merged export gives, every version.  With ``actor.lora.engine=adapter`` it
    is sent the base once and then each version's adapter only, which SGLang's own LoRA backend
    (torch-native on CPU) applies: it samples what the merged export gives all the same."""
    run_dir = str(tmp_path / "run")
    cmd = [sys.executable, "-m", "megarl.train", "--config", GRPO, f"model.path={assets['model']}",
           "model.build_tiny=false", f"data.train_path={assets['train']}", f"data.heldout_path={assets['heldout']}",
           "data.task.build=false", "rollout.backend=sglang", f"trainer.iterations={ITERS}",
           "trainer.run_id=sglang-cpu", f"trainer.run_dir={run_dir}", "trainer.prompts_per_iteration=4",
           "rollout.n=4", "eval.n=8", "eval.every=1", "trainer.save_experience=true", "trainer.export_every=1",
           "rollout.reuse_rollout_log_probs=true", "rollout.log_prob_parity_every=2", "actor.optim.lr=1.0e-2",
           # a dense reward (digits in the response): every group has variance, so every update moves
           "reward.fn=tests.plugins.faulty_rewards:digit_count", *lora]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=subprocess_env(), timeout=900)
    assert proc.returncode == 0, f"--- stdout ---\n{proc.stdout[-5000:]}\n--- stderr ---\n{proc.stderr[-8000:]}"
    assert os.path.isfile(os.path.join(run_dir, "DONE"))
    ms = metrics(run_dir)
    assert [m["iteration"] for m in ms] == list(range(ITERS))
    # the parity check against the megatron actor ran on iterations 0 and 2, on the engine's samples
    for k in (0, 2):
        err = ms[k]["prep/rollout_actor_logprob_max_abs_err"]
        assert within(err, NET_FP32_LOGPROB, "sglang_cpu/rollout_vs_actor"), (k, err)
    sealed = batches(run_dir)
    assert len(sealed) == ITERS, "every iteration's sealed batch is saved (trainer.save_experience)"
    for k, b in enumerate(sealed):
        f = b.facts
        (v,) = set(f.policy_version)  # on-policy: every sample from the version just sent
        assert re.fullmatch(rf"v{k}\.0-[0-9a-f]{{8}}", v), v
        assert f.rollout_log_probs is not None and f.rollout_log_probs.producer.version == v
        # what SGLang reported is what the export of v_k gives in transformers: the engine held
        # exactly v_k's weights (none dropped or stale) and answered in the raw log-prob space
        _, (lp, _) = hf_response_log_probs(os.path.join(run_dir, "export", f"iter_{k}"), f)
        err = max_abs_diff(lp, f.rollout_log_probs.values, f.response_mask.bool())
        assert within(err, NET_FP32_LOGPROB, "sglang_cpu/engine_vs_export"), (k, err)
        if k:  # a trained version differs from the one before: the comparison above can fail
            _, (prev, _) = hf_response_log_probs(os.path.join(run_dir, "export", f"iter_{k - 1}"), f)
            assert max_abs_diff(prev, f.rollout_log_probs.values, f.response_mask.bool()) > 100 * NET_FP32_LOGPROB
    assert "eval/accuracy" in ms[0] and "eval/accuracy" in ms[-1]
    if "actor.lora.engine=adapter" in lora:  # after the base, each version's adapter only
        first, later = ms[0]["rollout/weight_sync_bytes"], [m["rollout/weight_sync_bytes"] for m in ms[1:]]
        assert all(0 < b < first / 10 for b in later), (first, later)
    # what the real engine reports per request: its prefix cache's share of the prompt tokens (the 4
    # candidates of a prompt share it), each request's end-to-end latency and its retractions (a
    # KV pool this size never runs out for the tiny batch: none)
    for m in ms:
        assert 0.0 <= m["rollout/prefix_cache_hit_rate"] <= 1.0, m
        assert m["rollout/preemptions"] == 0.0 and m["rollout/preempted_share"] == 0.0, m
        assert 0.0 < m["rollout/first_completion_s"] <= m["rollout/group_completion_s_max"], m


def test_distillation_from_a_teacher_served_by_sglang(assets, tmp_path):
    """teacher.engine=sglang beside rollout.backend=sglang: two SGLang engines in the trainer's
    process, the teacher's loaded from its checkpoint through the verified weight path.  Every
    sealed teacher log-prob (SGLang's input-token log-probs of the rollout's own tokens) equals
    transformers' teacher-forced forward of the teacher; the run origin names the engine and the
    teacher's weights."""
    import json

    from megarl.builtin.tiny_checkpoint import make_tiny_hf_checkpoint

    teacher_dir = str(tmp_path / "teacher")
    make_tiny_hf_checkpoint(teacher_dir, "llama", seed=7, vocab_size=112, hidden_size=32, num_layers=2, num_heads=2,
                            num_kv_heads=2, intermediate_size=64, tokenizer_dir=assets["model"])
    run_dir = str(tmp_path / "run")
    cmd = [sys.executable, "-m", "megarl.train", "--config", GRPO, f"model.path={assets['model']}",
           "model.build_tiny=false", f"data.train_path={assets['train']}", f"data.heldout_path={assets['heldout']}",
           "data.task.build=false", "rollout.backend=sglang", "trainer.iterations=2", f"trainer.run_dir={run_dir}",
           "trainer.prompts_per_iteration=4", "rollout.n=4", "eval.every=0", "trainer.save_experience=true",
           "trainer.checkpoint_every=1", "algo.advantage=on_policy_distill", f"teacher.path={teacher_dir}",
           "teacher.engine=sglang"]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=subprocess_env(), timeout=900)
    assert proc.returncode == 0, f"--- stdout ---\n{proc.stdout[-5000:]}\n--- stderr ---\n{proc.stderr[-8000:]}"
    origin = json.load(open(os.path.join(run_dir, "checkpoints", "iter_000002", "state.json")))["origins"]["teacher"]
    assert origin["id"].startswith("engine=sglang weights=sha256:"), origin
    sealed = batches(run_dir)
    assert len(sealed) == 2
    for b in sealed:
        f = b.facts
        assert f.teacher_log_probs.producer.role == "teacher"
        _, (want, _) = hf_response_log_probs(teacher_dir, f)
        err = max_abs_diff(want, f.teacher_log_probs.values, f.response_mask.bool())
        assert within(err, NET_FP32_LOGPROB, "sglang_cpu/teacher_vs_transformers"), err
        # negative control: the student's own log-probs are another model's
        assert max_abs_diff(f.old_log_probs.values, f.teacher_log_probs.values, f.response_mask.bool()) > 1e-2


def test_a_generative_judge_on_sglang_scores_as_on_the_hf_engine(assets, tmp_path):
    """reward.judges[i].engine=sglang: the judge's own SGLang engine beside the trainer (rank 0,
    loaded from its checkpoint through the verified weight path) writes the verdicts the hf engine
    writes on the same samples -- one run in which each of two judges is served twice, by the hf
    engine and by SGLang, so every pair reads the same inputs -- the 1 / 0 verdicts equal,
    P(yes) / (P(yes) + P(no)) within the fp32 log-prob budget.  (The hf engine's verdicts equal
    transformers' own generation: tests/e2e/test_train_e2e.py::test_generative_judges_score_their_own_verdicts.)
    The engine is part of the judge's identity: a pair's origins differ by it alone."""
    import json

    from tests._judges import yes_no_judge

    hard = yes_no_judge(str(tmp_path / "judge_a"), assets["model"], seed=5)
    soft = yes_no_judge(str(tmp_path / "judge_b"), assets["model"], seed=6)
    # the strict judge's own template ends on the response (its last digit steers the verdict)
    prompt, tpl = "question : {prompt} answer : {response}", tmp_path / "judge.jinja"
    tpl.write_text("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    judges = ", ".join(
        f"{{name: strict_{e}, path: {hard}, max_new_tokens: 3, prompt: '{prompt}', chat_template: {tpl}, engine: {e}}}, "
        f"{{name: soft_{e}, path: {soft}, probability: true, max_new_tokens: 4, engine: {e}}}" for e in ("hf", "sglang"))
    run_dir = str(tmp_path / "run")
    cmd = [sys.executable, "-m", "megarl.train", "--config", GRPO, f"model.path={assets['model']}",
           "model.build_tiny=false", f"data.train_path={assets['train']}", f"data.heldout_path={assets['heldout']}",
           "data.task.build=false", "trainer.iterations=1", f"trainer.run_dir={run_dir}",
           "trainer.prompts_per_iteration=4", "rollout.n=4", "eval.every=0", "trainer.save_experience=true",
           "trainer.checkpoint_every=1", "reward.penalty.invalid=-1", f"reward.judges=[{judges}]"]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=subprocess_env(), timeout=900)
    assert proc.returncode == 0, f"--- stdout ---\n{proc.stdout[-5000:]}\n--- stderr ---\n{proc.stderr[-8000:]}"
    (b,) = batches(run_dir)
    verdicts, worst = [], 0.0
    for r in b.facts.rewards:
        if r.status.value != "ok":  # no verdict from some judge: both engines' judges are in the record
            continue
        c = r.components
        assert c["strict_hf"] == c["strict_sglang"], r.to_json()
        worst = max(worst, abs(c["soft_hf"] - c["soft_sglang"]))
        verdicts.append(c["strict_hf"])
    # two implementations of one fp32 network through a sigmoid (Lipschitz 1/4): the log-prob budget
    assert within(worst, NET_FP32_LOGPROB, "sglang_cpu/judge_probability_vs_hf"), worst
    assert set(verdicts) == {0.0, 1.0} and len(verdicts) >= 8, verdicts  # the judge read the samples
    with open(os.path.join(run_dir, "checkpoints", "iter_000001", "state.json")) as fh:
        origins = json.load(fh)["origins"]
    for name in ("strict", "soft"):
        hf_id, sg_id = (origins[f"judge/{name}_{e}"]["id"].split(" judge=")[1] for e in ("hf", "sglang"))
        assert "-esglang-" in sg_id and sg_id.replace("-esglang", "") == hf_id, (hf_id, sg_id)
