"""Learner on its own: a fake actor (a weight vector its "optimizer step" moves, scripted to
fail), a fake host snapshot, a real state machine and a hand-built sealed batch.  The weight
manifest that proves a rollback is a real TensorManifest of the fake actor's weights.

combine_steps is pure.  The update path reads the megatron parallel state (DP rank, last PP
stage for the step metrics), so those tests run in the shared world-size-1 ``megatron_world``."""

from __future__ import annotations

import math
import os
from collections import Counter
from types import SimpleNamespace

import pytest
import torch

from megarl.algo.kl import FixedKLController
from megarl.control import learning
from megarl.control.learning import Learner, UpdateFailure, combine_steps, policy_loss_config
from megarl.control.state_machine import Phase
from megarl.models.optim import StepResult
from megarl.observability.metrics import StageTimer
from megarl.rollout.weight_stream import TensorManifest
from megarl.versions import PolicyVersion
from tests._control_fakes import H, load_cfg, phases, sealed_batch, sm_sealed
from tests._tolerance import formula_tol
from tests._dist import ROOT

REWARDS = [[1.0, 0.0], [0.0, 1.0], [1.0, 1.0], [0.0, 0.0]]  # B=4 groups of G=2: rows 2g, 2g+1
CKPT = "/runs/r/checkpoints"
PPO_RECIPE = os.path.join(ROOT, "configs", "ppo_arith_tiny.yaml")


# ---- pure: per-step metrics -> per-iteration -------------------------------------------------


def test_combine_steps_golden():
    steps = [{"pg_loss": 1.0, "ratio_max": 1.2, "ratio_min": 0.9, "tokens": 10.0, "clipfrac": 0.1},
             {"pg_loss": 3.0, "ratio_max": 1.5, "ratio_min": 0.8, "tokens": 6.0, "clipfrac": 0.3, "entropy": 2.0}]
    out = combine_steps(steps, "update/")
    assert out == pytest.approx({"update/pg_loss": 2.0, "update/policy_loss": 2.0, "update/ratio_max": 1.5,
                                 "update/ratio_min": 0.8, "update/tokens": 16.0, "update/clipfrac": 0.2,
                                 "update/entropy": 2.0})  # a key some steps lack: the mean of those that have it
    critic = combine_steps([{"value_loss": 0.5}, {"value_loss": 1.5}], "update/critic_")
    assert critic == {"update/critic_value_loss": 1.0}  # no policy_loss alias outside update/
    assert combine_steps([], "update/") == {}


def test_old_log_probs_from_the_rollout_are_accepted_only_when_reuse_is_configured():
    assert policy_loss_config(load_cfg("rollout.reuse_rollout_log_probs=false")).old_log_prob_roles == ("actor",)
    reuse = policy_loss_config(load_cfg("rollout.reuse_rollout_log_probs=true"))
    assert reuse.old_log_prob_roles == ("actor", "rollout")
    pc = policy_loss_config(load_cfg())
    assert (pc.clip_low, pc.clip_high, pc.kl.placement, pc.kl.beta) == (0.2, 0.28, "loss", 0.001)
    assert pc.log_prob_space == "raw"


# ---- the update and its recovery -------------------------------------------------------------


class FakeActor:
    """train_step moves ``w`` by 1 and records which batch rows (advantage = row + 1) each
    micro-batch carried.  ``script``: per step "ok", "nan" (the step ran, its grad norm is NaN)
    or "raise" (the optimizer raised after corrupting the weights)."""

    vocab_size, lr = 16, 0.5

    def __init__(self, script=()):
        self.w = torch.zeros(4)
        self.steps, self.script = 0, list(script)
        self.step_rows: list = []  # per train_step: list of micro-batch row lists
        self.calls = Counter()
        self.ddp, self.optimizer, self.scheduler = self, object(), object()

    def named_tensors(self):
        return [("w", self.w)]

    def onload(self):
        self.calls["onload"] += 1

    def train_step(self, mbs, loss_fn, replay_layers=None):
        kind = self.script.pop(0) if self.script else "ok"
        rows = [[int(a) - 1 for a in mb["advantages"][:, 0].tolist()] for mb in mbs]
        self.step_rows.append(rows)
        self.w += 1.0
        self.steps += 1
        if kind == "raise":
            self.w += 100.0
            raise RuntimeError("optimizer exploded")
        n = len(self.step_rows)
        return StepResult(grad_norm=float("nan") if kind == "nan" else float(n), update_successful=True,
                          metrics=[{"pg_loss": 0.1, "tokens": float(len(r)), "ratio_max": 1.0 + 0.01 * n}
                                   for r in rows])


class FakeSnapshot:
    def __init__(self, corrupt=False):
        self.corrupt, self.takes, self.restores = corrupt, 0, 0

    def take(self, ddp, optimizer, scheduler, steps):
        self.takes += 1
        self.w, self.steps = ddp.w.clone(), steps
        return ddp.w.numel() * 4

    def restore(self, ddp, optimizer, scheduler):
        self.restores += 1
        ddp.w.copy_(self.w + (1.0 if self.corrupt else 0.0))
        return self.steps


@pytest.fixture
def world(megatron_world, monkeypatch):
    monkeypatch.setattr(learning, "actor_manifest",
                        lambda ddp, dtype=None: TensorManifest.from_named_tensors(ddp.named_tensors()))


def cfg_(*over):
    return load_cfg("rollout.n=2", "trainer.prompts_per_iteration=4", "algo.num_mini_batches=2",
                    "algo.ppo_epochs=2", "algo.micro_batch_size=2", "trainer.max_update_retries=2", *over)


def setup(cfg, script=(), corrupt_snapshot=False):
    actor = FakeActor(script)
    manifest = TensorManifest.from_named_tensors(actor.named_tensors())
    v = PolicyVersion("run", 3, 0, manifest.global_hash, H("tok"), H("cfg"))
    batch = sealed_batch(v, REWARDS, k=3, advantages=torch.arange(1.0, 9.0)[:, None].expand(8, 3).clone())
    batch_adv_rows = batch.derived.advantages[:, 0]
    assert batch_adv_rows.tolist() == list(range(1, 9))
    sm = sm_sealed(v, 8, 4)
    learner = Learner(cfg, actor=actor, critic=None, sm=sm, kl_ctl=FixedKLController(0.001), counters=Counter(),
                      dp=1, sync_dtype=None, rank0=False, ckpt_root=CKPT)
    learner.snapshots = {"actor": FakeSnapshot(corrupt_snapshot), "critic": FakeSnapshot()}
    return learner, actor, batch, v, manifest, sm


def run(learner, batch, v, manifest, k=3):
    return learner.update_with_recovery(k, batch, v, manifest, StageTimer(k, v.short_id))


def test_reduce_step_metrics_sums_loss_shares_and_token_weights_the_rest(world):
    learner, *_ = setup(cfg_())
    out = learner._reduce_step_metrics([
        {"pg_loss": 0.25, "kl_loss": 0.01, "tokens": 3.0, "ratio_max": 1.1, "ratio_min": 0.9, "clipfrac": 0.5},
        {"pg_loss": 0.5, "kl_loss": 0.02, "tokens": 1.0, "ratio_max": 1.3, "ratio_min": 0.95, "clipfrac": 0.1}])
    assert out == pytest.approx({"pg_loss": 0.75, "kl_loss": 0.03, "tokens": 4.0, "ratio_max": 1.3,
                                 "ratio_min": 0.9, "clipfrac": (0.5 * 3 + 0.1 * 1) / 4})


def test_an_update_steps_over_whole_groups_and_reports_golden_metrics(world):
    learner, actor, batch, v, manifest, sm = setup(cfg_())
    m = run(learner, batch, v, manifest)
    assert phases(sm)[-2:] == ["EXPERIENCE_SEALED", "UPDATING_FROM"] and learner.completed
    # ppo_epochs x num_mini_batches = 4 steps, each 2 micro-batches of 2 rows
    assert len(actor.step_rows) == 4 and all(len(s) == 2 and all(len(mb) == 2 for mb in s) for s in actor.step_rows)
    for epoch in (actor.step_rows[:2], actor.step_rows[2:]):
        rows = [r for step in epoch for mb in step for r in mb]
        assert sorted(rows) == list(range(8))  # every sample once per epoch
        for step in epoch:  # a mini-batch holds whole groups
            groups = Counter(r // 2 for mb in step for r in mb)
            assert set(groups.values()) == {2} and len(groups) == 2
    assert m["update/optimizer_steps"] == 4 and m["update/policy_lag_max"] == 3 and m["update/skipped_steps"] == 0
    assert m["update/grad_norm"] == 2.5 and m["update/grad_norm_max"] == 4.0
    assert m["update/pg_loss"] == pytest.approx(0.2) and m["update/policy_loss"] == pytest.approx(0.2)
    assert m["update/first_step_pg_loss"] == pytest.approx(0.2)
    assert m["update/tokens"] == 16.0 and m["update/ratio_max"] == pytest.approx(1.04)
    assert (m["update/lr"], m["update/kl_beta"]) == (0.5, 0.001)
    assert m["update/snapshot_bytes"] == 16.0 and learner.snapshots["actor"].takes == 1
    assert torch.equal(actor.w, torch.full((4,), 4.0)) and actor.calls["onload"] == 1
    assert sum(learner.counters.values()) == 0


def test_the_shuffle_is_seeded_by_the_iteration(world):
    def rows(k):
        learner, actor, batch, v, manifest, _ = setup(cfg_())
        run(learner, batch, v, manifest, k=k)
        return actor.step_rows

    assert rows(3) == rows(3)  # a retried update is the update that never failed
    assert any(rows(k) != rows(3) for k in (4, 5, 6))


def test_a_non_finite_grad_norm_rolls_back_to_v_and_retries_the_same_update(world):
    clean, clean_actor, batch, v, manifest, _ = setup(cfg_())
    want = run(clean, batch, v, manifest)
    learner, actor, batch, v, manifest, sm = setup(cfg_(), script=["ok", "nan"])
    m = run(learner, batch, v, manifest)
    assert phases(sm)[-5:] == ["EXPERIENCE_SEALED", "UPDATING_FROM", "FAILED", "EXPERIENCE_SEALED", "UPDATING_FROM"]
    (fail,) = [s for s in sm.history if s.phase is Phase.FAILED]
    assert "non-finite actor grad norm nan" in fail.reason and "rank 0" in fail.reason
    c = learner.counters
    assert (c["update_failures"], c["update_rollbacks"], c["update_retries"], c["updates_skipped"]) == (1, 1, 1, 0)
    assert learner.snapshots["actor"].restores == 1 and learner.snapshots["actor"].takes == 2
    # the retried update ran from v: same weights and the same steps as the clean one
    assert torch.equal(actor.w, clean_actor.w) and actor.steps == clean_actor.steps == 4
    assert actor.step_rows[2:] == clean_actor.step_rows
    assert m["update/grad_norm_max"] == 6.0 and m["update/optimizer_steps"] == want["update/optimizer_steps"]
    assert learner.completed
    # the version it commits records the retry: v<step>.1 (the clean one: .0)
    assert (learner.update_attempt, clean.update_attempt) == (1, 0)
    assert v.successor(H("w"), update_attempt=learner.update_attempt).short_id.startswith(f"v{v.optimizer_step + 1}.1-")


def test_an_exception_with_skip_rolls_back_and_keeps_v(world):
    learner, actor, batch, v, manifest, sm = setup(cfg_("trainer.on_update_failure=skip"), script=["ok", "raise"])
    m = run(learner, batch, v, manifest)
    assert m == {"update/skipped_batch": 1.0}
    assert sm.state.phase is Phase.ACTOR_COMMITTED and sm.state.version == v
    assert "RuntimeError: optimizer exploded" in [s for s in sm.history if s.phase is Phase.FAILED][0].reason
    assert torch.equal(actor.w, torch.zeros(4)) and actor.steps == 0  # back to v, step count included
    c = learner.counters
    assert (c["update_failures"], c["update_rollbacks"], c["updates_skipped"], c["update_retries"]) == (1, 1, 1, 0)
    assert not learner.completed


def test_stop_raises_naming_the_restart_point_without_rolling_back(world):
    learner, actor, batch, v, manifest, sm = setup(cfg_("trainer.on_update_failure=stop"), script=["raise"])
    with pytest.raises(UpdateFailure) as e:
        run(learner, batch, v, manifest)
    msg = str(e.value)
    assert "on_update_failure=stop" in msg and CKPT in msg and "optimizer exploded" in msg and "iteration 3" in msg
    assert sm.state.phase is Phase.FAILED
    assert learner.counters["update_failures"] == 1 and learner.counters["update_rollbacks"] == 0


def test_retries_are_bounded_by_max_update_retries(world):
    learner, actor, batch, v, manifest, sm = setup(cfg_("trainer.max_update_retries=1"), script=["nan", "nan"])
    with pytest.raises(UpdateFailure, match="failed 2 time"):
        run(learner, batch, v, manifest)
    c = learner.counters
    assert (c["update_failures"], c["update_retries"], c["update_rollbacks"]) == (2, 1, 1)
    assert sm.state.phase is Phase.FAILED and len(actor.step_rows) == 2


def test_a_rollback_that_does_not_restore_v_is_refused_by_the_manifest(world):
    from megarl.roles.rollback import RollbackError

    learner, actor, batch, v, manifest, sm = setup(cfg_(), script=["nan"], corrupt_snapshot=True)
    with pytest.raises(RollbackError) as e:
        run(learner, batch, v, manifest)
    assert "ranks [0]" in str(e.value) and v.short_id in str(e.value) and manifest.global_hash in str(e.value)
    assert learner.counters["update_rollbacks"] == 0 and sm.state.phase is Phase.FAILED


def test_an_unsuccessful_step_is_counted_as_skipped(world):
    learner, actor, batch, v, manifest, _ = setup(cfg_())
    real = actor.train_step

    def step(mbs, loss_fn, replay_layers=None):
        res = real(mbs, loss_fn, replay_layers)
        res.update_successful = len(actor.step_rows) != 2
        return res

    actor.train_step = step
    m = run(learner, batch, v, manifest)
    assert m["update/skipped_steps"] == 1 and learner.counters["skipped_steps"] == 1
    assert math.isfinite(m["update/grad_norm"])


class LossActor(FakeActor):
    """Runs the Learner's real loss closure on logits built so that every response token's
    log-prob is exactly its sealed old log-prob (ratio 1): the step's loss is then known."""

    def train_step(self, mbs, loss_fn, replay_layers=None):
        self.step_rows.append([[int(a) - 1 for a in mb["advantages"][:, 0].tolist()] for mb in mbs])
        metrics = []
        for mb in mbs:
            tokens, pl, rl, old = mb["tokens"], mb["prompt_lens"], mb["response_lens"], mb["old_log_probs"]
            B, L = tokens.shape
            logits = torch.zeros(B, L, self.vocab_size)
            for b in range(B):
                for t in range(int(rl[b])):
                    pos, target, lp = int(pl[b]) - 1 + t, int(tokens[b, int(pl[b]) + t]), float(old[b, t])
                    # log softmax = lp at the target: the other V-1 logits at x with 1 + (V-1) e^x = e^-lp
                    logits[b, pos, :] = math.log(math.expm1(-lp) / (self.vocab_size - 1))
                    logits[b, pos, target] = 0.0
            _, m = loss_fn(logits, mb)
            metrics.append(m)
        return StepResult(grad_norm=1.0, update_successful=True, metrics=metrics)


def test_the_loss_closure_uses_the_sealed_old_log_probs_and_the_mini_batch_normaliser(world):
    learner, _, batch, v, manifest, _ = setup(cfg_())
    actor = LossActor()
    learner.actor = actor
    m = run(learner, batch, v, manifest)
    lens = batch.facts.response_mask.sum(1).tolist()
    want = []
    for step in actor.step_rows:  # vanilla PPO at ratio 1: -A per token, token-mean over the mini-batch
        rows = [r for mb in step for r in mb]
        want.append(-sum((r + 1) * lens[r] for r in rows) / sum(lens[r] for r in rows))
    # float32 token-means of -A (integer-valued A, ratio exactly 1) over <= 40 tokens, against
    # Python floats: <= 45 operations on magnitudes summing to <= 40 * 4
    tol = formula_tol(torch.float32, ops=45, scale=160.0)
    assert m["update/pg_loss"] == pytest.approx(sum(want) / len(want), abs=tol)
    assert m["update/first_step_pg_loss"] == pytest.approx(want[0], abs=tol) and abs(want[0]) > 100 * tol
    # k3 KL to the reference, whose log-probs sit 0.02 above the old ones on every action token
    assert m["update/kl_loss"] == pytest.approx(math.expm1(0.02) - 0.02, rel=1e-3)


class FakeCritic(FakeActor):
    """A critic role: records its micro-batches like the actor, has a value clip and a version."""

    value_clip, version = 0.2, "critic-0"


def _with_critic(batch):
    """``batch`` with critic values in the facts and returns in the derived tensors (PPO)."""
    import dataclasses

    from megarl.experience.schema import ExperienceBatch
    from megarl.experience.seal import seal, with_derived

    f, d = batch.facts, batch.derived
    facts = dataclasses.replace(f, values=torch.zeros_like(f.old_log_probs.values), critic_version="critic-0")
    derived = dataclasses.replace(d, returns=torch.ones_like(d.advantages))
    return with_derived(seal(ExperienceBatch(facts)), derived)


@pytest.mark.parametrize("actor_micro,critic_micro,actor_rows,critic_rows", [
    (4, 1, [4], [1] * 4),
    (2, 0, [2, 2], [4]),  # 0: the whole mini-batch in one micro-batch (the PPO recipe's)
])
def test_critic_steps_use_the_critic_micro_batch_size(world, actor_micro, critic_micro, actor_rows, critic_rows):
    """critic.micro_batch_size is the critic's own: its steps run in micro-batches of that many
    rows (0: all of the mini-batch's) while the actor's use algo.micro_batch_size (it was
    validated but ignored)."""
    from megarl.config import load_config

    cfg = load_config(PPO_RECIPE, ["rollout.n=2", "trainer.prompts_per_iteration=4", "algo.num_mini_batches=2",
                                   "algo.ppo_epochs=1", f"algo.micro_batch_size={actor_micro}",
                                   f"critic.micro_batch_size={critic_micro}", "critic.warmup_iters=0"])
    learner, actor, batch, v, manifest, sm = setup(cfg)
    critic = FakeCritic()
    learner.critic = critic
    run(learner, _with_critic(batch), v, manifest)
    assert [[len(mb) for mb in step] for step in actor.step_rows] == [actor_rows] * 2  # 2 mini-batches of 4 rows
    assert [[len(mb) for mb in step] for step in critic.step_rows] == [critic_rows] * 2
    # the same rows, in the same order, for both roles
    assert [sum(step, []) for step in critic.step_rows] == [sum(step, []) for step in actor.step_rows]
