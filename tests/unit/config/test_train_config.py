"""Bad configs fail at start-up, before any model loads, with the key named (exit 2)."""

import os
import subprocess
import sys

import pytest

from megarl.commands.run_checks import check_run
from megarl.config import ConfigError, config_hash, load_config
from megarl.models.fit import validate_model_fit

from tests._dist import ROOT
GRPO = os.path.join(ROOT, "configs", "grpo_arith_tiny.yaml")
PPO = os.path.join(ROOT, "configs", "ppo_arith_tiny.yaml")


def _fail(path, overrides, key, world=1):
    with pytest.raises(ConfigError) as e:
        check_run(load_config(path, overrides), world)
    assert key in str(e.value), str(e.value)
    return str(e.value)


@pytest.mark.parametrize("path", [GRPO, PPO])
def test_recipes_validate(path):
    cfg = load_config(path, [])
    assert check_run(cfg, 1) == 1
    assert check_run(cfg, 2) == 2  # DP=2


def test_whole_batch_micro_batches_fit_any_group_size():
    """The tiny recipe runs its whole batch in one pass (micro sizes 0): changing G or B needs
    no matching micro-batch size."""
    for overrides in ([], ["rollout.n=4"], ["rollout.n=16", "trainer.prompts_per_iteration=3"]):
        cfg = load_config(GRPO, overrides)
        assert cfg.algo.micro_batch_size == 0 and check_run(cfg, 1) == 1 and check_run(cfg, 2) == 2


@pytest.mark.parametrize("overrides,key", [
    (["algo.nonsense=1"], "algo.nonsense"),                      # unknown key
    (["trainer.iterations=many"], "trainer.iterations"),         # wrong type
    (["rollout.temperature=hot"], "rollout.temperature"),
    (["rollout.n=1"], "rollout.n"),                              # G < 2 for a group estimator
    (["trainer.prompts_per_iteration=3", "algo.num_mini_batches=1", "algo.micro_batch_size=16"],
     "algo.micro_batch_size"),                                   # B x G not divisible by dp x mbs
    (["algo.num_mini_batches=3"], "algo.num_mini_batches"),     # mini-batches of whole groups
    (["algo.micro_batch_size=-1"], "algo.micro_batch_size"),     # 0 = whole batch; < 0 is nothing
    (["algo.forward_micro_batch_size=-2"], "algo.forward_micro_batch_size"),
    (["rollout.log_prob_parity_every=-1"], "rollout.log_prob_parity_every"),
    (["parallel.tp=2"], "parallel.tp"),                          # tp x pp x dp != world
    (["algo.advantage=gae"], "algo.advantage"),                  # GRPO has no critic
    (["critic.value_clip=0.1"], "critic"),                       # a critic GRPO would ignore
    (["reference.enabled=false"], "reference.enabled"),          # KL > 0 without a reference
    (["algo.kl.placement=none"], "algo.kl.beta"),                # a beta that would be ignored
    (["reward.model.tokenizer=/x"], "reward.model.tokenizer"),   # RM settings without an RM
    (["reward.on_failure=zero"], "reward.on_failure"),
    (["reward.penalty.crash=-1"], "reward.penalty"),
    (["reward.isolation=subprocess"], "reward.isolation"),
    (["reward.workers=0"], "reward.workers"),
    (["reward.workers=two"], "reward.workers"),
    (["reward.kill_grace_s=0"], "reward.kill_grace_s"),
    (["reward.max_memory_mb=0", "reward.isolation=process"], "reward.max_memory_mb"),
    (["reward.cpu_time_s=-1", "reward.isolation=process"], "reward.cpu_time_s"),
    (["reward.cpu_time_s=5"], "reward.cpu_time_s"),               # a process limit on a thread scorer
    (["reward.isolation=process", "faults.reward_timeout_rate=0.1"], "reward.isolation"),
    (["algo.dynamic_sampling.max_rounds=0"], "algo.dynamic_sampling.max_rounds"),
    (["trainer.resume_experience=maybe"], "trainer.resume_experience"),
    (["trainer.on_update_failure=ignore"], "trainer.on_update_failure"),
    (["trainer.update_rollback=none"], "trainer.on_update_failure"),  # retry needs the host copy of v
    (["rollout.max_retries=-1"], "rollout.max_retries"),
    (["faults.rollout_error_rate=1.0"], "faults.rollout_error_rate"),  # nothing could ever finish
    (["faults.fail_optimizer_step_kind=segfault"], "faults.fail_optimizer_step_kind"),
    (["faults.fail_optimizer_step_rank=4"], "faults.fail_optimizer_step_rank"),
    (["faults.reward_timeout_rate=0.2", "reward.timeout_s=null"], "faults.reward_timeout_rate"),
    # what the estimator's registry entry declares it reads, not its name
    (["algo.advantage=grpo_process"], "algo.advantage"),        # step rewards: no scorer makes them
    (["algo.advantage=reinforce_plus_plus", "algo.dynamic_sampling.enabled=true"],
     "algo.dynamic_sampling.enabled"),                           # no groups to filter
    (["trainer.phase_timeout_s.generating=0"], "trainer.phase_timeout_s.generating"),
    (["trainer.phase_timeout_s.updating_from=-5"], "trainer.phase_timeout_s.updating_from"),
    (["algo.rollout_correction.token_is_cap=2.0"], "algo.rollout_correction"),  # needs the actor's old log-probs
    (["rollout.reuse_rollout_log_probs=false", "algo.rollout_correction.token_is_cap=0.5"],
     "algo.rollout_correction.token_is_cap"),
    (["rollout.reuse_rollout_log_probs=false", "algo.rollout_correction.seq_mask_threshold=0"],
     "algo.rollout_correction.seq_mask_threshold"),
    (["algo.rollout_correction.seq_mask_stat=median"], "algo.rollout_correction.seq_mask_stat"),
    (["reward.overlong_buffer=7"], "reward.overlong_buffer"),   # longer than rollout.max_new_tokens=6
    (["reward.overlong_buffer=0"], "reward.overlong_buffer"),
    # teacher.build: it makes teacher.path, in a run dir of its own
    (["teacher.build.recipe=configs/grpo_arith_tiny.yaml", "teacher.build.run_dir=/tmp/t"], "teacher.build.recipe"),
    (["algo.advantage=on_policy_distill", "teacher.path=/tmp/t/export/iter_1",
      "teacher.build.recipe=configs/grpo_arith_tiny.yaml"], "teacher.build.run_dir"),
    (["algo.advantage=on_policy_distill", "teacher.path=/tmp/t/export/iter_1", "teacher.build.run_dir=/tmp/t"],
     "teacher.build.recipe"),
    (["algo.advantage=on_policy_distill", "teacher.path=/tmp/t", "teacher.engine=sglang", "teacher.offload=true"],
     "teacher.offload"),
    (["algo.advantage=on_policy_distill", "teacher.path=/tmp/t/export/iter_1", "trainer.run_dir=/tmp/t",
      "teacher.build.recipe=configs/grpo_arith_tiny.yaml", "teacher.build.run_dir=/tmp/t"], "teacher.build.run_dir"),
])
def test_bad_grpo_config_names_key(overrides, key):
    _fail(GRPO, overrides, key)


@pytest.mark.parametrize("overrides,key", [
    (["algo.advantage=grpo"], "algo.advantage"),
    (["critic.micro_batch_size=7"], "critic.micro_batch_size"),
    (["algo.kl.estimator=k3"], "algo.kl.estimator"),             # shaped reward needs signed k1
])
def test_bad_ppo_config_names_key(overrides, key):
    _fail(PPO, overrides, key)


def test_estimator_needs_come_from_the_registry():
    """check_run() asks each estimator's registry entry what it needs: every registered name is
    either accepted by one algorithm or refused with the key named, never after a rollout."""
    from megarl.algo.registry import advantage_names, advantage_needs

    import megarl.algo.advantages  # noqa: F401

    assert advantage_needs("grpo").groups and not advantage_needs("grpo").critic
    assert advantage_needs("gae").critic and advantage_needs("gae").token_rewards
    assert advantage_needs("grpo_process").step_rewards
    for name in advantage_names():
        needs = advantage_needs(name)
        path = PPO if needs.critic else GRPO
        cfg = load_config(path, [f"algo.advantage={name}"])
        if needs.step_rewards:
            with pytest.raises(ConfigError, match="algo.advantage"):
                check_run(cfg, 1)
        elif needs.teacher:  # the teacher's path is named
            with pytest.raises(ConfigError, match="^teacher.path: is null"):
                check_run(cfg, 1)
            assert check_run(load_config(path, [f"algo.advantage={name}", "teacher.path=/t"]), 1) == 1
        else:
            assert check_run(cfg, 1) == 1, name


def test_valid_new_keys_accepted():
    cfg = load_config(GRPO, ["rollout.reuse_rollout_log_probs=false", "algo.rollout_correction.token_is_cap=2.0",
                             "algo.rollout_correction.seq_mask_threshold=0.5", "reward.overlong_buffer=2",
                             "trainer.phase_timeout_s.generating=null"])
    assert check_run(cfg, 1) == 1


def test_reward_isolation_keys_accepted():
    cfg = load_config(GRPO, ["reward.isolation=process", "reward.workers=2", "reward.kill_grace_s=0.2",
                             "reward.max_memory_mb=4096", "reward.cpu_time_s=10"])
    assert check_run(cfg, 1) == 1
    assert load_config(GRPO, []).reward.isolation == "auto"  # the tiny recipe's arithmetic: threads


def test_ppo_without_critic_refused(tmp_path):
    text = open(PPO).read().split("\ncritic:")[0] + "\nreward: {fn: arithmetic}\n"
    text = text.replace("base: base/tiny.yaml", f"base: {os.path.join(ROOT, 'configs', 'base', 'tiny.yaml')}")
    p = tmp_path / "ppo_no_critic.yaml"
    p.write_text(text)
    _fail(str(p), [], "critic")


def test_world_size_and_heads_against_tp():
    _fail(GRPO, ["parallel.tp=2"], "parallel.tp", world=3)
    from megarl.models.hf_config import spec_from_hf_config

    spec = spec_from_hf_config({"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 112,
                                "hidden_size": 96, "intermediate_size": 192, "num_hidden_layers": 2,
                                "num_attention_heads": 3, "num_key_value_heads": 3,
                                "max_position_embeddings": 64, "rms_norm_eps": 1e-6})
    cfg = load_config(GRPO, ["parallel.tp=2"])
    with pytest.raises(ConfigError, match="num_attention_heads"):
        validate_model_fit(cfg, spec, "config.json")
    cfg = load_config(GRPO, ["parallel.tp=3", "model.vocab_multiple=16"])
    with pytest.raises(ConfigError, match="model.vocab_multiple"):
        validate_model_fit(cfg, spec, "config.json")


def test_config_hash_ignores_run_dir_only():
    a = load_config(GRPO, ["trainer.run_dir=/tmp/a"])
    b = load_config(GRPO, ["trainer.run_dir=/tmp/b"])
    c = load_config(GRPO, ["actor.optim.lr=2e-4"])
    assert config_hash(a) == config_hash(b) != config_hash(c)


@pytest.mark.parametrize("overrides,key", [
    (["algo.nonsense=1"], "algo.nonsense"),
    (["rollout.n=1"], "rollout.n"),
    (["reward.fn=no_such_reward"], "reward.fn"),
    (["reward.fn=no.such.module:score"], "reward.fn"),
])
def test_train_cli_exits_2_before_loading(tmp_path, overrides, key):
    """The real entry point: one error line naming the key, exit 2, and no model was built
    (model.path points at a directory that must stay absent)."""
    missing_model = tmp_path / "never_built"
    cmd = [sys.executable, "-m", "megarl.train", "--config", GRPO, f"model.path={missing_model}",
           f"data.train_path={tmp_path / 'train.jsonl'}", f"data.heldout_path={tmp_path / 'heldout.jsonl'}",
           *overrides]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=str(tmp_path), timeout=120,
                          env=dict(os.environ, PYTHONPATH=ROOT))
    assert proc.returncode == 2, proc.stderr[-3000:]
    err_lines = [l for l in proc.stderr.splitlines() if l.startswith("error:")]
    assert len(err_lines) == 1 and key in err_lines[0], proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    assert not missing_model.exists() and not (tmp_path / "train.jsonl").exists()


@pytest.mark.parametrize("name,overrides,worlds", [
    ("grpo_qwen2_7b.yaml", ["model.path=/m", "data.train_path=/d.jsonl"], (8, 16)),
    ("ppo_llama3_8b.yaml", ["model.path=/m", "data.train_path=/d.jsonl", "reward.model.path=/rm"], (8, 16)),
])
def test_real_model_recipes_validate(name, overrides, worlds):
    path = os.path.join(ROOT, "configs", name)
    with pytest.raises(ConfigError, match="model.path"):
        load_config(path, [])  # the model and data are the user's to name
    cfg = load_config(path, overrides)
    for w in worlds:
        assert check_run(cfg, w) == w // (cfg.parallel.tp * cfg.parallel.pp)


ASYNC = ["placement.mode=split", "async_rl.max_staleness=2", "async_rl.correction=tis",
         "rollout.reuse_rollout_log_probs=false"]
PARTIAL = ["async_rl.partial_rollouts=true", "async_rl.segment_tokens=8"]


@pytest.mark.parametrize("overrides,world,key", [
    (["placement.mode=spilt"], 2, "placement.mode"),
    (["placement.mode=split"], 1, "placement.rollout_ranks"),          # no trainer rank left
    (["placement.mode=split", "placement.rollout_ranks=0"], 2, "placement.rollout_ranks"),
    (["placement.mode=split", "placement.timeout_s=0"], 2, "placement.timeout_s"),
    (["async_rl.max_staleness=1", "async_rl.correction=tis", "rollout.reuse_rollout_log_probs=false"], 2,
     "async_rl.max_staleness"),                                        # hybrid placement
    (["placement.mode=split", "async_rl.max_staleness=1", "rollout.reuse_rollout_log_probs=false"], 2,
     "async_rl.correction"),                                           # the correction is a required choice
    (ASYNC[:3], 2, "rollout.reuse_rollout_log_probs"),                 # the recipe reuses rollout log-probs
    (ASYNC + ["async_rl.correction=is"], 2, "async_rl.correction"),
    (ASYNC + ["async_rl.is_cap=null"], 2, "async_rl.is_cap"),         # tis truncates at the cap
    (ASYNC + ["async_rl.is_cap=0.5"], 2, "async_rl.is_cap"),
    (ASYNC + ["async_rl.max_staleness=-1"], 2, "async_rl.max_staleness"),
    (ASYNC + ["algo.rollout_correction.token_is_cap=2.0"], 2, "algo.rollout_correction"),
    (ASYNC + ["trainer.resume_experience=reuse"], 2, "trainer.resume_experience"),
    (ASYNC + ["parallel.tp=2"], 2, "parallel.tp"),                     # 1 trainer rank
    # partial rollouts (hybrid placement)
    (PARTIAL + ["placement.mode=split"], 2, "async_rl.partial_rollouts"),
    (["async_rl.partial_rollouts=true"], 2, "async_rl.segment_tokens"),  # the iteration stops between segments
    (PARTIAL + ["async_rl.extra_groups=17"], 2, "async_rl.extra_groups"),  # above B = 16
    (["async_rl.extra_groups=2"], 2, "async_rl.extra_groups"),         # over-sampling without partial rollouts
    (PARTIAL + ["algo.dynamic_sampling.enabled=true"], 2, "algo.dynamic_sampling.enabled"),
    (PARTIAL + ["trainer.resume_experience=reuse"], 2, "trainer.resume_experience"),
    (PARTIAL + ["rollout.agent.env=calculator"], 2, "rollout.agent.env"),
    (PARTIAL + ["async_rl.max_staleness=1", "rollout.reuse_rollout_log_probs=false"], 2, "async_rl.correction"),
    # the proximal log-probs from the rollout engine (split placement, eta > 0, the hf backend)
    (ASYNC + ["async_rl.proximal_log_probs=engines"], 2, "async_rl.proximal_log_probs"),
    (["placement.mode=split", "async_rl.proximal_log_probs=engine"], 2, "async_rl.proximal_log_probs"),  # eta 0
    (PARTIAL + ["async_rl.max_staleness=1", "async_rl.correction=tis", "rollout.reuse_rollout_log_probs=false",
                "async_rl.proximal_log_probs=engine"], 2, "async_rl.proximal_log_probs"),  # hybrid placement
])
def test_bad_placement_and_async_configs_name_the_key(overrides, world, key):
    cfg = load_config(GRPO, overrides)
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        check_run(cfg, world)


def test_split_placement_trains_on_the_ranks_left():
    assert check_run(load_config(GRPO, ["placement.mode=split"]), 2) == 1
    assert check_run(load_config(GRPO, ["placement.mode=split", "placement.rollout_ranks=2"]), 4) == 2
    cfg = load_config(GRPO, ASYNC + ["async_rl.correction=decoupled", "async_rl.is_cap=null"])
    assert check_run(cfg, 2) == 1
    assert check_run(load_config(GRPO, ASYNC + ["async_rl.proximal_log_probs=engine"]), 2) == 1
    # hybrid placement takes a staleness bound with partial rollouts (eta 0: over-sampling only)
    for extra in ([], ["async_rl.max_staleness=2", "async_rl.correction=tis", "rollout.reuse_rollout_log_probs=false"]):
        assert check_run(load_config(GRPO, PARTIAL + ["async_rl.extra_groups=16"] + extra), 2) == 2


def test_megatron_at_scale_keys_default_off_and_are_checked():
    """parallel.sequence_parallel, parallel.overlap_grad_reduce and parallel.recompute default to
    today's behaviour; a recompute setting megatron cannot take is refused naming the key."""
    cfg = load_config(GRPO, [])
    p = cfg.parallel
    assert (p.sequence_parallel, p.overlap_grad_reduce, p.recompute.granularity) == (False, False, None)
    for over in (["parallel.recompute.granularity=full"], ["parallel.recompute.granularity=selective"],
                 ["parallel.recompute.granularity=full", "parallel.recompute.method=block",
                  "parallel.recompute.num_layers=2"],
                 ["parallel.recompute.granularity=selective", "parallel.recompute.modules=[moe,layernorm]"]):
        assert check_run(load_config(GRPO, over), 1) == 1, over
    _fail(GRPO, ["parallel.recompute.granularity=some"], "parallel.recompute.granularity")
    _fail(GRPO, ["parallel.recompute.granularity=full", "parallel.recompute.method=interleaved"],
          "parallel.recompute.method")
    _fail(GRPO, ["parallel.recompute.num_layers=0"], "parallel.recompute.num_layers")
    _fail(GRPO, ["parallel.recompute.granularity=selective", "parallel.recompute.modules=[attn]"],
          "parallel.recompute.modules[0]")
    msg = _fail(GRPO, ["parallel.recompute.granularity=selective", "parallel.recompute.modules=[moe_act]"],
                "parallel.recompute.modules")
    assert "grouped-GEMM" in msg
