"""Failures never corrupt training (the seed's failure rules), proven with faults injected at
the real seams (megarl/runtime/faults.py and the wrappers beside each seam) of real runs:

* lost, late and duplicated rollout results, hung reward calls and a weight load corrupted in
  transit: the run completes, every sealed sample comes from the version its record names
  (re-scored by that version's export), no group mixes prompts, no sample is trained twice, and
  the trainer's counters equal what was injected;
* an exception in the optimizer step on one rank, or a non-finite loss: every rank returns to
  the committed version (the trainer checks the weight manifest's hash on every rank) and the
  retried update makes the run bitwise the uninterrupted one; a skipped update keeps v;
* a crash inside an update with ``trainer.resume_experience=reuse``: the resumed run reuses the
  sealed batch and is bitwise the uninterrupted run; a changed config refuses the reuse.
"""

import os
from collections import defaultdict

from tests._tolerance import NET_FP32_LOGPROB, max_abs_diff, within
from tests._train_runs import (
    GRPO,
    ITERS,
    batches,
    check_same_run,
    checkpointed_run_cmd,
    hf_response_log_probs,
    metrics,
    run_to_exit,
    uninterrupted,
)

FAULT_COUNTERS = ("faults/", "e2e/count/update_", "e2e/count/kv_flushes", "sealed_batches_reused")


def test_grpo_dp2_survives_lost_late_duplicate_results_and_hung_rewards(assets, tmp_path):
    d = str(tmp_path / "faults")
    run_to_exit(checkpointed_run_cmd(assets, d, GRPO, 2, [
        "trainer.iterations=3", "trainer.checkpoint_every=0", "trainer.save_experience=true",
        "trainer.export_every=1", "faults.rollout_error_rate=0.2", "faults.duplicate_result_rate=0.1",
        # an injected hang lasts 10 timeouts (certain to be declared); a real call (the digit
        # count) takes microseconds, so a 2 s limit never fires on one, however busy the machine
        "faults.reward_timeout_rate=0.2", "reward.timeout_s=2.0", "reward.max_retries=3",
        "rollout.max_retries=3", "faults.corrupt_weight_sync_at=[1]",
        # and an update that fails at iteration 1 and is skipped: the batch is dropped, v1 stays
        "faults.fail_optimizer_step_at=[1]", "trainer.on_update_failure=skip"]))
    ms = metrics(d)
    last = ms[-1]
    injected = {k.split("/")[-1]: v for k, v in last.items() if k.startswith("faults/injected/")}
    for kind in ("rollout_errors", "late_results", "duplicate_results", "reward_timeouts"):
        assert injected.get(kind, 0) > 0, f"no {kind} injected: the test would prove nothing ({injected})"
    # every injected fault was seen, and handled, by the trainer
    assert last["e2e/count/candidates_lost"] == injected["rollout_errors"]
    assert last["e2e/count/results_ignored"] == injected["late_results"] + injected["duplicate_results"]
    assert last["e2e/count/reward_call_timeouts"] == injected["reward_timeouts"]
    assert last["e2e/count/candidates_regenerated"] > 0
    # a weight load corrupted in transit is refused by the engines' manifest check and loaded again
    assert injected["corrupted_weight_syncs"] == 2  # the first load of v1 into each DP replica's engine
    assert last["e2e/count/weight_load_failures"] == 1  # one failed attempt, agreed by all ranks
    assert [m["e2e/policy_version_step"] for m in ms[:3]] == [0, 1, 1]
    assert ms[1]["update/skipped_batch"] == 1 and last["e2e/count/updates_skipped"] == 1
    assert last["e2e/count/update_rollbacks"] == 1
    seen = set()
    for k, b in enumerate(batches(d)):
        f = b.facts
        (v,) = set(f.policy_version)  # one version per sealed batch ...
        step = ms[k]["e2e/policy_version_step"]
        assert v.startswith(f"v{step}.0-") and f.old_log_probs.producer.version == v
        by_group = defaultdict(set)
        for pid, gid in zip(f.prompt_id, f.group_id):
            by_group[gid].add(pid)
        assert all(len(p) == 1 for p in by_group.values()), "a group mixes prompts"
        assert all(f.group_id.count(g) == 4 for g in by_group), "an incomplete group was trained"
        assert not seen & set(f.sample_id), "a sample was trained twice"
        seen |= set(f.sample_id)
        # ... and it is that version's: the export of v_k scores the sampled tokens as the engine did
        keep = f.response_mask != 0
        _, (lp, _) = hf_response_log_probs(os.path.join(d, "export", f"iter_{k}"), f)  # what iteration k was served
        # fp32, the export through transformers vs the engine's sampling pass (another batch)
        err = max_abs_diff(lp, f.rollout_log_probs.values, keep)
        assert within(err, NET_FP32_LOGPROB, "faults_e2e/rescored_by_export"), err


def test_optimizer_step_exception_on_one_rank_rolls_back_everywhere(assets, tmp_path, tmp_path_factory):
    """DP=2, rank 1 raises after its optimizer applied the last step of iteration 1: both ranks
    return to v1 (manifest hash checked on each), the update is retried on the same sealed batch,
    and the run ends bitwise equal to the uninterrupted one (weights, optimizer state, metrics)."""
    ref = uninterrupted(assets, tmp_path_factory, GRPO, 2, [])
    d = str(tmp_path / "fail")
    out = run_to_exit(checkpointed_run_cmd(assets, d, GRPO, 2, ["faults.fail_optimizer_step_at=[1]",
                                                                "faults.fail_optimizer_step_rank=1",
                                                                "trainer.save_experience=true"]))
    assert "rank 1: InjectedFault" in out.stderr, out.stderr[-2000:]
    m = metrics(d)[-1]
    assert m["faults/injected/optimizer_step_failures"] == 1
    assert m["e2e/count/update_failures"] == m["e2e/count/update_rollbacks"] == m["e2e/count/update_retries"] == 1
    check_same_run(ref, d, killed_at=0, ignore=FAULT_COUNTERS, resumes=0)
    # the version iteration 1's retried update committed says so (v2.1), the next one starts again at .0
    versions = [set(b.facts.policy_version) for b in batches(d)]
    assert [len(v) for v in versions] == [1] * ITERS, versions
    assert [next(iter(v)).split("-")[0] for v in versions] == ["v0.0", "v1.0", "v2.1", "v3.0", "v4.0"], versions


def test_non_finite_loss_rolls_back_everywhere(assets, tmp_path, tmp_path_factory):
    """DP=2, rank 0's loss of iteration 2's last step is NaN: the all-reduced gradients and the
    grad norm are NaN on both ranks, both roll back to v2 (manifest hash checked on each), and
    the retried update makes the run bitwise the uninterrupted one."""
    ref = uninterrupted(assets, tmp_path_factory, GRPO, 2, [])
    d = str(tmp_path / "nan")
    out = run_to_exit(checkpointed_run_cmd(assets, d, GRPO, 2, ["faults.fail_optimizer_step_at=[2]",
                                                                "faults.fail_optimizer_step_kind=nan",
                                                                "faults.fail_optimizer_step_rank=0"]))
    assert "non-finite actor grad norm" in out.stderr + out.stdout, (out.stdout + out.stderr)[-3000:]
    m = metrics(d)[-1]
    assert m["faults/injected/optimizer_step_failures"] == 1
    assert m["e2e/count/update_failures"] == m["e2e/count/update_rollbacks"] == m["e2e/count/update_retries"] == 1
    check_same_run(ref, d, killed_at=0, ignore=FAULT_COUNTERS, resumes=0)


def test_crash_in_update_resumes_by_reusing_the_sealed_batch(assets, tmp_path, tmp_path_factory):
    ref = uninterrupted(assets, tmp_path_factory, GRPO, 1, [])
    d = str(tmp_path / "reuse")
    reuse = ["trainer.resume_experience=reuse"]
    run_to_exit(checkpointed_run_cmd(assets, d, GRPO, 1, reuse + ["faults.crash_during_update_at=2"]), expect=17)
    assert os.path.isfile(os.path.join(d, "experience", "pending", "position.json"))
    # the sealed batch was made under another algorithm config: reusing it is refused, naming it
    bad = run_to_exit(checkpointed_run_cmd(assets, d, GRPO, 1, reuse + ["algo.clip_high=0.3"]), expect=2)
    assert "algo changed" in bad.stderr and "resume_experience=rerun" in bad.stderr, bad.stderr[-2000:]
    out = run_to_exit(checkpointed_run_cmd(assets, d, GRPO, 1, reuse))
    assert "iteration 2: reusing the batch sealed before the restart" in out.stdout, out.stdout[-2000:]
    assert metrics(d)[-1]["e2e/count/sealed_batches_reused"] == 1
    check_same_run(ref, d, killed_at=2, ignore=FAULT_COUNTERS)

