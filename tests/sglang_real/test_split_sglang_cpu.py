"""Split placement with the real SGLang engine on the rollout rank (torchrun over gloo, on CPU):
1 trainer rank + 1 rollout rank, asynchronous (eta = 1), in-flight weight updates.

The trainer streams every version over the gloo bridge to the rollout rank, whose SGLang engine
loads it between generation segments (``async_rl.segment_tokens``; a straggling rollout rank
makes a version arrive mid-response).  Checked from what the run leaves behind:

* the staleness bound holds per policy token (age in [0, eta], none from the future) and the
  admission is exact: batch k was generated on v_{k - eta};
* some responses were finished by a version published while they were generated, and **every
  policy token's rollout log-prob is the teacher-forced log-prob of the version it is labelled
  with** (that version's export, through transformers, fp32): SGLang served exactly the version
  it was sent, at the segment it was sent, and the continuation's prefix was recomputed by the
  new weights (no KV of the old version attended to -- SGLang's radix cache is on);
* negative control: the tokens a newer version sampled, scored by the version their response
  started on, are far outside the tolerance (so the check above can fail).
"""

from __future__ import annotations

import os

from tests._tolerance import NET_FP32_LOGPROB
from tests._train_runs import (GRPO, ITERS, audit_labels, batches, checkpointed_run_cmd, hf_response_log_probs, metrics,
                               run_to_exit, staleness_audit, token_steps)

ETA = 1
ASYNC = ["placement.mode=split", "rollout.backend=sglang", "rollout.enable_memory_saver=false",
         f"async_rl.max_staleness={ETA}",
         "async_rl.correction=tis", "rollout.reuse_rollout_log_probs=false", "trainer.save_experience=true",
         "trainer.export_every=1", "actor.optim.lr=1.0e-2",
         # in-flight weight updates, made certain: each job's first segment boundary waits for the
         # trainer's next command (a publication), whatever the machine's load (a fixed straggle of
         # the rollout rank was not: under load no update landed mid-response)
         "async_rl.segment_tokens=2", "faults.rollout_segment_await_s=60"]


def _spanning_tokens_against_their_start(run_dir) -> float:
    """The smallest, over responses that span versions, of the largest gap between a token's
    rollout log-prob and the log-prob the response's *first* version gives it (the wrong
    labelling: as if no update had landed mid-response)."""
    worst = []
    for b in batches(run_dir):
        f, o = b.facts, b.facts.token_origins
        if o is None:
            continue
        steps = token_steps(o)
        pol = o.policy_mask()
        for step in sorted(set(steps[pol].tolist())):
            _, (lp, _) = hf_response_log_probs(os.path.join(run_dir, "export", f"iter_{step}"), f)
            for row in range(f.batch_size):
                s = steps[row][pol[row]]
                if int(s[0]) != step or len(set(s.tolist())) == 1:
                    continue
                later = pol[row] & (steps[row] != step)
                worst.append(float((lp[row] - f.rollout_log_probs.values[row]).abs()[later].max()))
    assert worst, "no response spanned versions"
    return min(worst)


def test_sglang_on_the_rollout_rank_takes_inflight_updates_between_segments(assets, tmp_path):
    d = str(tmp_path / "split")
    run_to_exit(checkpointed_run_cmd(assets, d, GRPO, 2, ASYNC))
    assert os.path.isfile(os.path.join(d, "DONE"))
    ms = metrics(d)
    assert [m["iteration"] for m in ms] == list(range(ITERS))
    hists = staleness_audit(d, ETA)  # every policy token's age within [0, eta]
    for k in range(ITERS):
        assert hists[k] == {min(k, ETA): 1.0}, (k, hists[k])  # exact admission
    assert sum(m.get("async/inflight_activations", 0.0) for m in ms) > 0
    # the labels: every token's log-prob is its own version's (1e-4), some responses span versions
    assert audit_labels(d) > 0
    assert _spanning_tokens_against_their_start(d) > 100 * NET_FP32_LOGPROB
