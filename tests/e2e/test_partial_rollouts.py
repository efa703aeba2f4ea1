"""Partial rollouts in hybrid placement (megarl/control/production_partial.py), end to end on the
tiny model, checked from what the runs leave behind.

* eta = 2, DP = 2 (torchrun over gloo, an hf engine per rank), one token per segment so that
  unfinished candidates carry over and finish on later versions: every policy token of every
  trained sample is audited against the version that trained it (none older than 2 steps, none
  from the future), every token of a response spanning versions was sampled by the version it is
  labelled with (its rollout log-prob is that version's export's, teacher-forced), the histogram
  the run wrote equals the audit; every trained group is whole (G members of one prompt), trained
  once, and within eta steps of its admission; the checkpoint declares the carried work dropped
  and gives its prompts back to the sampler.
* eta = 0 (synchronous, over-sampled): every trained token is the trained version's, an
  unfinished group's tokens are dropped (counted) and the group is due next iteration; killed
  while holding after iteration 2 and resumed, the run ends bitwise like the uninterrupted one
  (the checkpoint records the open groups).
"""

from __future__ import annotations

import json
import os
import re
import shutil

import pytest

from tests._train_runs import (GRPO, ITERS, audit_labels, batches, check_same_run, checkpointed_run_cmd,
                               kill_while_holding, latest_checkpoint, metrics, rewrite_checkpoint_state, run_to_exit,
                               staleness_audit, uninterrupted)

#: B = 4 prompts (checkpointed_run_cmd), 2 more kept open; one token per segment
PARTIAL = ["async_rl.partial_rollouts=true", "async_rl.segment_tokens=1", "async_rl.extra_groups=2"]
ETA2 = PARTIAL + ["async_rl.max_staleness=2", "async_rl.correction=tis", "rollout.reuse_rollout_log_probs=false",
                  "trainer.save_experience=true", "trainer.export_every=1"]
ETA0 = PARTIAL + ["trainer.save_experience=true"]


def _groups(run_dir):
    """Per iteration: the trained groups' ids, their sizes and prompts."""
    out = {}
    for b in batches(run_dir):
        f = b.facts
        groups = {}
        for gid, pid in zip(f.group_id, f.prompt_id):
            groups.setdefault(gid, []).append(pid)
        out[f.iteration] = groups
    return out


def _check_groups(run_dir, eta, G=4):
    """Whole groups (G members, one prompt), each trained once, within max(eta, 1) iterations of
    its admission (its id names the iteration that admitted it; no update is skipped here)."""
    seen = set()
    lag = {}
    for k, groups in sorted(_groups(run_dir).items()):
        for gid, prompts in groups.items():
            assert len(prompts) == G and len(set(prompts)) == 1, (k, gid, prompts)
            assert gid not in seen, f"group {gid} trained twice"
            seen.add(gid)
            admitted = int(re.search(r"/it(\d+)/", gid)[1])
            assert 0 <= k - admitted <= max(eta, 1), (k, gid)
            lag[k - admitted] = lag.get(k - admitted, 0) + 1
    return lag


def test_partial_rollouts_eta2_dp2_bound_whole_groups_and_dropped_at_checkpoint(assets, tmp_path):
    eta = 2
    d = str(tmp_path / "eta2")
    run_to_exit(checkpointed_run_cmd(assets, d, GRPO, 2, ETA2))
    hists = staleness_audit(d, eta)
    assert audit_labels(d) > 0  # some responses were finished by a later version than the one they started on
    ms = metrics(d)
    assert sorted(hists) == list(range(ITERS))
    for k, m in enumerate(ms):
        written = {int(key.rsplit("_", 1)[1]): v for key, v in m.items() if key.startswith("prep/staleness/samples_age_")}
        assert written == hists[k]
        assert m["rollout/groups_accepted"] == 4
    assert any(max(h) > 0 for h in hists.values())  # carried work was trained, older than the trained version
    assert sum(m["rollout/partial_groups_carried_in"] for m in ms) > 0
    assert sum(m["rollout/mixed_version_share"] for m in ms) > 0
    lag = _check_groups(d, eta)
    assert sum(lag.values()) == 4 * ITERS and lag.get(0, 0) < 4 * ITERS
    # the checkpoint after the last iteration: the open groups' tokens declared dropped, prompts given back
    state = json.load(open(os.path.join(d, "checkpoints", f"iter_{ITERS:06d}", "state.json")))
    open_groups = ms[-1]["rollout/partial_groups_open"]
    assert state["in_flight_dropped"]["groups"] == open_groups == 2
    assert state["in_flight_dropped"]["partial_tokens"] == ms[-1]["rollout/partial_tokens_open"]
    assert len(state["sampler"]["returned"]) == open_groups and "carried_over" not in state


def test_partial_rollouts_eta0_on_policy_and_exact_resume_after_kill(assets, tmp_path, tmp_path_factory):
    a = uninterrupted(assets, tmp_path_factory, GRPO, 1, ETA0)
    hists = staleness_audit(a, 0)
    assert all(h == {0: 1.0} for h in hists.values())  # every trained token is the trained version's
    ms = metrics(a)
    assert sum(m.get("rollout/partial_tokens_dropped", 0) for m in ms) > 0  # over-sampled work was dropped
    lag = _check_groups(a, 0)
    assert lag.get(1, 0) > 0  # a group left open was trained the next iteration (due), not starved
    state = json.load(open(os.path.join(a, "checkpoints", f"iter_{ITERS:06d}", "state.json")))
    assert len(state["carried_over"]) == 2 and "in_flight_dropped" not in state and "returned" not in state["sampler"]

    b = str(tmp_path / "b")
    kill_while_holding(checkpointed_run_cmd(assets, b, GRPO, 1, ETA0), str(tmp_path / "killed.log"), 2)
    assert latest_checkpoint(b) == 2
    c = str(tmp_path / "c")
    shutil.copytree(b, c)  # the same kill, for the negative control below
    run_to_exit(checkpointed_run_cmd(assets, b, GRPO, 1, ETA0))
    check_same_run(a, b, killed_at=2)
    assert _groups(a) == _groups(b)  # the same groups, of the same prompts, in the same iterations
    # negative control: the checkpoint without its record of the open groups (what a checkpoint
    # held before it was written, its MANIFEST made to verify): the resumed run is another run
    rewrite_checkpoint_state(os.path.join(c, "checkpoints", "iter_000002"), lambda st: st.pop("carried_over"))
    run_to_exit(checkpointed_run_cmd(assets, c, GRPO, 1, ETA0))
    with pytest.raises(AssertionError):
        check_same_run(a, c, killed_at=2)
