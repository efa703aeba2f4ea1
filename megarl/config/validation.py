"""Validation: what a type cannot express -- sizes that must divide, settings the chosen algorithm
would ignore, a KL with no reference -- checked before any model is built, each failure a
:class:`~megarl.errors.ConfigError` naming the key."""

from __future__ import annotations

import math
import os
from typing import Callable, Mapping, Optional, Sequence

from megarl.config.ranges import lookup, range_errors
from megarl.config.schema import ASYNC_CORRECTIONS, TrainConfig, choices_of
from megarl.errors import ConfigError, require as _need, require_choice as _choice


def _one_of(cfg, dotted: str, key: Optional[str] = None) -> None:
    """The value at ``dotted`` (under ``cfg``, a config or one of its sections) is one of the
    choices its schema field declares; the error names ``key`` (default: ``dotted``)."""
    parent, _, leaf = dotted.rpartition(".")
    section = lookup(cfg, parent)[1] if parent else cfg
    _choice(getattr(section, leaf), key or dotted, choices_of(type(section), leaf))


def _validate_trackers(cfg: TrainConfig) -> None:
    """The sample-table keys and the wandb mode (the tracker names are the trackers' own check,
    :func:`megarl.observability.trackers.check_loggers`)."""
    t = cfg.trainer
    dup = sorted({n for n in t.loggers if list(t.loggers).count(n) > 1})
    _need(not dup, "trainer.loggers", f"lists {dup[0] if dup else ''!r} more than once")
    _need(t.wandb.mode in (None, "online", "offline"), "trainer.wandb.mode",
          f"{t.wandb.mode!r} is not one of ['online', 'offline', null]")
    _need(t.log_samples_every >= 0, "trainer.log_samples_every", f"must be >= 0 (0 = off), got {t.log_samples_every}")
    _need(t.log_samples_n >= 1, "trainer.log_samples_n", f"must be >= 1, got {t.log_samples_n}")
    _need(0 <= t.log_samples_console <= t.log_samples_n, "trainer.log_samples_console",
          f"must be in [0, trainer.log_samples_n={t.log_samples_n}], got {t.log_samples_console}")


def validate_eval_settings(cfg: TrainConfig) -> None:
    """The ``eval`` section and the data-vs-reward keys (also all that ``python -m megarl.eval``
    validates: it trains nothing)."""
    e = cfg.eval
    _one_of(cfg, "data.on_missing_fields")
    _need(e.samples_per_prompt >= 1, "eval.samples_per_prompt", f"must be >= 1, got {e.samples_per_prompt}")
    _need(e.max_new_tokens is None or e.max_new_tokens >= 1, "eval.max_new_tokens",
          f"must be >= 1 or null (rollout.max_new_tokens), got {e.max_new_tokens}")
    _need(e.temperature > 0, "eval.temperature",
          f"must be > 0 (the greedy accuracy is always decoded at 0), got {e.temperature}")
    _need(0 < e.top_p <= 1, "eval.top_p", f"must be in (0, 1], got {e.top_p}")
    for i, k in enumerate(e.k):
        _need(1 <= k <= e.samples_per_prompt, f"eval.k[{i}]",
              f"must be in [1, eval.samples_per_prompt={e.samples_per_prompt}], got {k}")
    _need(bool(e.source_field), "eval.source_field", "must be a non-empty field name")


def _validate_ranges(cfg: TrainConfig) -> None:
    """Every numeric key within its range (declared beside its type in :mod:`megarl.config.schema`),
    and the bounds that pair two keys."""
    for key, msg in range_errors(cfg):
        raise ConfigError(f"{key}: {msg}")
    for key, o in (("actor.optim", cfg.actor.optim),) + ((("critic.optim", cfg.critic.optim),) if cfg.critic else ()):
        _need(o.min_lr <= o.lr, f"{key}.min_lr",
              f"{o.min_lr} is above {key}.lr={o.lr} (the schedule decays lr to min_lr)")
    for k, v in cfg.reward.penalty.items():
        _need(not isinstance(v, float) or math.isfinite(v), f"reward.penalty.{k}", f"must be finite or null, got {v}")
    d, tiny = cfg.data, cfg.model.tiny
    _one_of(cfg, "model.tiny.family")
    _need(tiny.family == "llama" or tiny.top_k <= tiny.num_experts, "model.tiny.top_k",
          f"{tiny.top_k} is above model.tiny.num_experts={tiny.num_experts}")
    # the task's name and its args are its own check (megarl/builtin/tasks/config_checks.py)
    _need(isinstance(d.task.args, dict) and all(isinstance(k, str) for k in d.task.args), "data.task.args",
          f"must be a mapping of the task's setting names to values, got {d.task.args!r}")
    _need(d.task.name is not None or not d.task.args, "data.task.args",
          f"is set ({sorted(d.task.args)}) but data.task.name is null (no built-in task)")
    _need(d.task.name is not None or not cfg.model.build_tiny, "model.build_tiny",
          "is true but data.task.name is null: the tiny model is warm-started on a built-in task; name one "
          "(data.task.name=arithmetic) or set model.build_tiny=false")


def _validate_rollout_groups(cfg: TrainConfig, world_size: int) -> None:
    """SGLang inference groups of rollout.tp consecutive ranks must tile the world; what the hf
    backend's decode that retires finished rows does not do."""
    r = cfg.rollout
    _need(r.backend != "sglang" or world_size % r.tp == 0, "rollout.tp",
          f"{r.tp} does not divide the world size {world_size} (inference groups of rollout.tp GPUs tile the world)")
    _need(not r.retire_finished or r.backend == "hf", "rollout.retire_finished",
          f"is true with rollout.backend={r.backend}: it is the hf backend's decode (SGLang batches continuously "
          "by itself); set rollout.retire_finished=false")
    _need(not r.retire_finished or cfg.algo.routing_replay == "none", "rollout.retire_finished",
          f"is true with algo.routing_replay={cfg.algo.routing_replay!r}: the decode that retires finished rows "
          "does not record the experts each token was routed to; turn one of them off")
    _need(r.ep == 1 or (r.backend == "sglang" and r.tp % r.ep == 0), "rollout.ep",
          f"{r.ep} needs rollout.backend=sglang with rollout.ep dividing rollout.tp={r.tp} (SGLang splits each "
          "inference group's TP ranks into expert-parallel ones)")


def validate_agent_args(cfg: TrainConfig) -> None:
    """``rollout.agent.env_args``: a mapping of argument names, given only with an environment."""
    ag = cfg.rollout.agent
    _need(isinstance(ag.env_args, dict) and all(isinstance(k, str) for k in ag.env_args), "rollout.agent.env_args",
          f"must be a mapping of argument names to values, got {ag.env_args!r}")
    if not ag.env:
        _need(not ag.env_args, "rollout.agent.env_args",
              f"is set ({sorted(ag.env_args)}) but rollout.agent.env is empty (no agent)")


def validate_agent_settings(cfg: TrainConfig) -> None:
    """``rollout.agent``: an agent has a chat template to render the environment's messages with,
    and its episodes are scored by the environment alone (that the environment loads with its
    arguments is the environment's own check, :func:`megarl.envs.config_checks.check_environment`)."""
    ag = cfg.rollout.agent
    validate_agent_args(cfg)
    if not ag.env:
        return
    _need(cfg.data.apply_chat_template, "data.apply_chat_template",
          f"is false, but rollout.agent.env={ag.env!r} renders the environment's messages with the chat template "
          "(the prompt must be templated by the same one)")
    # an agent's episode is scored by its environment's reward components; what would score the
    # token list as one response (a rule on the decoded text, a reward model, the overlong
    # punishment over environment tokens too) is refused rather than silently mixed in
    rw = cfg.reward
    _need(rw.fn is None, "reward.fn", f"is {rw.fn!r}, but rollout.agent.env={ag.env!r} scores each episode by the "
          "environment's reward components; set reward.fn: null")
    models = rw.neural_models()
    _need(not models, f"{models[0][0]}.path" if models else "reward.model.path",
          f"is set, but rollout.agent.env={ag.env!r} scores each episode by the environment; unset it")
    _need(not rw.judges, "reward.judges", f"is set, but rollout.agent.env={ag.env!r} scores each episode by the "
          "environment; unset it")
    _need(rw.overlong_buffer is None, "reward.overlong_buffer",
          f"is set, but rollout.agent.env={ag.env!r} budgets episodes with rollout.agent.max_total_tokens; unset it")
    _need(cfg.algo.routing_replay == "none", "algo.routing_replay",
          f"is {cfg.algo.routing_replay!r}, but routing replay of multi-turn agent trajectories is not supported "
          "(each turn's routing would have to be joined); set algo.routing_replay: none")




def trainer_world_size(cfg: TrainConfig, world_size: int) -> int:
    """The ranks that train: the whole world in hybrid placement, all but the rollout ranks in split."""
    return world_size - cfg.placement.rollout_ranks if cfg.placement.mode == "split" else world_size


def _validate_placement(cfg: TrainConfig, world_size: int) -> None:
    """``placement`` and ``async_rl``: the split of the world, and the staleness bound's required
    off-policy correction."""
    pl, an, r = cfg.placement, cfg.async_rl, cfg.rollout
    _one_of(cfg, "placement.mode")
    if pl.mode == "split":
        _need(world_size > pl.rollout_ranks, "placement.rollout_ranks",
              f"{pl.rollout_ranks} leaves no trainer rank in a world of {world_size} (torchrun --nproc-per-node "
              f"must be at least {pl.rollout_ranks + 1})")
        _need(r.backend == "hf" or r.tp == 1, "rollout.tp",
              f"is {r.tp}: in split placement every rollout rank runs its own engine (rollout.tp=1)")
        _need(not r.enable_memory_saver or r.backend == "hf", "rollout.enable_memory_saver",
              "time-slices one GPU pool; split placement gives the engines their own devices (set it to false)")
    if an.partial_rollouts:
        _need(pl.mode == "hybrid", "async_rl.partial_rollouts",
              "is true with placement.mode=split, where generation already runs ahead on the rollout ranks; "
              "partial rollouts are hybrid placement's (set one of them)")
        _need(an.segment_tokens > 0, "async_rl.segment_tokens",
              "must be > 0 with async_rl.partial_rollouts: unfinished candidates are generated this many tokens at "
              "a time, and the iteration stops between two segments")
        B = cfg.trainer.prompts_per_iteration
        _need(an.extra_groups <= B, "async_rl.extra_groups",
              f"is {an.extra_groups}, above trainer.prompts_per_iteration={B}: the groups due at a step (which must "
              "complete and be trained then) would outnumber the batch")
        _need(not cfg.algo.dynamic_sampling.enabled, "algo.dynamic_sampling.enabled",
              "is true with async_rl.partial_rollouts: its further rounds are the synchronous producer's")
        _need(cfg.trainer.resume_experience == "rerun", "trainer.resume_experience",
              "'reuse' replays a sealed batch without producing it; with async_rl.partial_rollouts the open groups "
              "are the checkpoint's to record (use 'rerun')")
    else:
        _need(an.extra_groups == 0, "async_rl.extra_groups",
              f"is {an.extra_groups}: over-sampling is async_rl.partial_rollouts' (set it to true, or this to 0)")
    if an.max_staleness > 0:
        _need(pl.mode == "split" or an.partial_rollouts, "async_rl.max_staleness",
              f"is {an.max_staleness} in hybrid placement, which needs async_rl.partial_rollouts=true (unfinished "
              "candidates carry over, each token keeping its version), or placement.mode=split")
        _need(an.correction is not None, "async_rl.correction",
              f"must be chosen when async_rl.max_staleness={an.max_staleness} > 0: one of {list(ASYNC_CORRECTIONS)} "
              "(the rollout's log-probs are the behaviour policy, the recomputed old ones the proximal)")
        _need(not r.reuse_rollout_log_probs, "rollout.reuse_rollout_log_probs",
              f"must be false with async_rl.max_staleness={an.max_staleness}: stale rollout log-probs are the "
              "behaviour policy, never the proximal one PPO clips against")
        a_rc = cfg.algo.rollout_correction
        _need(a_rc.token_is_cap is None and a_rc.seq_mask_threshold is None, "algo.rollout_correction",
              "is set together with async_rl.correction, which already corrects the same log-prob gap (use one)")
        _need(cfg.trainer.resume_experience == "rerun", "trainer.resume_experience",
              f"'reuse' replays one synchronous sealed batch; with async_rl.max_staleness={an.max_staleness} "
              "a checkpoint gives the in-flight prompts back instead (use 'rerun')")
    if an.segment_tokens:
        _need(pl.mode == "split" or an.partial_rollouts, "async_rl.segment_tokens",
              "applies versions published while the rollout ranks generate, which needs placement.mode=split; "
              "or splits generation for async_rl.partial_rollouts")
        _need(cfg.algo.routing_replay == "none", "algo.routing_replay",
              "records routing per response; responses generated in segments (async_rl.segment_tokens) have none")
        _need(not r.agent.env or not an.partial_rollouts, "rollout.agent.env",
              "agent sessions are not carried over by async_rl.partial_rollouts (in split placement, "
              "async_rl.segment_tokens > 0 applies versions published mid-session between turns)")
    _need(not cfg.faults.rollout_segment_delay_s or an.segment_tokens, "faults.rollout_segment_delay_s",
          "delays generation segments, which needs async_rl.segment_tokens > 0")
    _need(not cfg.faults.rollout_segment_await_s or (an.segment_tokens and pl.mode == "split"),
          "faults.rollout_segment_await_s", "holds a rollout rank between generation segments, which needs "
          "placement.mode=split and async_rl.segment_tokens > 0")
    _one_of(cfg, "async_rl.proximal_log_probs")
    if an.proximal_log_probs == "engine":
        _need(pl.mode == "split" and an.max_staleness > 0, "async_rl.proximal_log_probs",
              "is 'engine', which needs placement.mode=split and async_rl.max_staleness > 0 (synchronously the "
              "rollout's own log-probs are the proximal ones: rollout.reuse_rollout_log_probs=true)")
        _need(r.backend == "hf", "async_rl.proximal_log_probs",
              f"is 'engine', which is built for rollout.backend=hf only (the split placement's {r.backend} rollout "
              "ranks do not offer teacher forcing yet)")
        _need(cfg.algo.routing_replay == "none", "async_rl.proximal_log_probs",
              "is 'engine', but algo.routing_replay needs the actor's forward with the recorded routing")
    if an.correction is not None:
        _one_of(cfg, "async_rl.correction")
        if an.correction == "tis":
            _need(an.is_cap is not None, "async_rl.is_cap", "must be set (>= 1) with async_rl.correction=tis")


#: the sections :func:`validate` checks, in order; a feature's check of the keys it owns runs
#: right before the section it names (the first failing key is the one named)
SECTIONS = ("ranges", "placement", "rollout_groups", "agent_args", "agent", "choices", "eval", "trackers",
            "trainer", "faults", "reward_penalty", "algorithm", "sizes", "layout", "batches")


def validate(cfg: TrainConfig, world_size: int, feature_checks: Optional[Mapping[str, Sequence[Callable]]] = None) -> int:
    """Check everything a type cannot; return the data-parallel size.  Reads no model weights.

    ``feature_checks`` maps a name of :data:`SECTIONS` to the checks the features contribute
    there (the config imports no feature: the command that assembles the run passes them, see
    :mod:`megarl.commands.run_checks`)."""
    hooks = dict(feature_checks or {})
    unknown = sorted(set(hooks) - set(SECTIONS))
    if unknown:
        raise ValueError(f"feature checks for unknown sections {unknown}; the sections are {list(SECTIONS)}")

    def section(name: str, check: Callable, *args):
        for feature_check in hooks.get(name, ()):
            feature_check(cfg)
        return check(cfg, *args)

    section("ranges", _validate_ranges)
    section("placement", _validate_placement, world_size)
    world_size = trainer_world_size(cfg, world_size)
    section("rollout_groups", _validate_rollout_groups, world_size)
    section("agent_args", validate_agent_args)
    section("agent", validate_agent_settings)
    section("choices", _validate_choices)
    section("eval", validate_eval_settings)
    section("trackers", _validate_trackers)
    section("trainer", _validate_trainer)
    section("faults", _validate_faults, world_size)
    section("reward_penalty", _validate_reward_penalty)
    section("algorithm", _validate_algorithm)
    section("sizes", _validate_sizes)
    dp = section("layout", _validate_layout, world_size)
    section("batches", _validate_batches, dp)
    return dp


def _validate_choices(cfg: TrainConfig) -> None:
    """Every key whose value is one of a fixed set: the rollout backend, failure handling (the
    algorithm's registered names are its own check, :mod:`megarl.algo.config_checks`)."""
    _one_of(cfg, "algo.name")
    _one_of(cfg, "algo.zero_std_rule")
    _one_of(cfg, "algo.reward_placement")
    _one_of(cfg, "algo.kl.placement")
    _one_of(cfg, "algo.partial_groups")
    _one_of(cfg, "algo.routing_replay")
    _one_of(cfg, "rollout.backend")
    _one_of(cfg, "rollout.verify_engine_weights")
    _one_of(cfg, "reward.on_failure")
    _one_of(cfg, "reward.model.kind")
    _one_of(cfg, "reward.model.step_aggregate")
    _one_of(cfg, "teacher.engine")
    _need(not (cfg.teacher.engine == "sglang" and cfg.teacher.offload), "teacher.offload",
          "with teacher.engine=sglang: SGLang's engine gives its weights up when it sleeps (the teacher would be "
          "gone); its share of the device is teacher.mem_fraction_static")
    b = cfg.teacher.build
    if b.recipe is not None:
        _need(bool(cfg.teacher.path), "teacher.build.recipe", "builds the teacher at teacher.path: set teacher.path "
              "to the export of the build's run that is the teacher (e.g. <run_dir>/export/iter_N)")
        _need(bool(b.run_dir), "teacher.build.run_dir", "the run directory the teacher is trained in (its exports "
              "hold teacher.path)")
        _need(not b.run_dir or not cfg.trainer.run_dir or os.path.abspath(b.run_dir) != os.path.abspath(cfg.trainer.run_dir),
              "teacher.build.run_dir", "must not be this run's trainer.run_dir")
    else:
        _need(not b.run_dir and not b.overrides, "teacher.build.recipe", "teacher.build.run_dir / overrides are set "
              "but no recipe to build the teacher with")
    _one_of(cfg, "actor.lora.init")
    _validate_lora(cfg.actor.lora, "actor.lora")
    if cfg.critic is not None:
        _one_of(cfg, "critic.lora.init")
        _validate_lora(cfg.critic.lora, "critic.lora")
    _need(not cfg.actor.lora.rank or cfg.reference.refresh_every == 0, "reference.refresh_every",
          "with actor.lora: a refresh would copy the base weights, not the adapted ones")
    _one_of(cfg, "actor.lora.engine")
    if cfg.actor.lora.engine == "adapter":
        _need(cfg.actor.lora.rank > 0, "actor.lora.engine", "'adapter' needs actor.lora.rank > 0")
        _need(cfg.rollout.backend == "sglang", "actor.lora.engine",
              f"'adapter' is served by SGLang's LoRA backends; rollout.backend={cfg.rollout.backend!r} "
              "takes the merged weights (actor.lora.engine=merged)")
        _need(cfg.placement.mode == "hybrid", "actor.lora.engine",
              f"'adapter' is built for hybrid placement; placement.mode={cfg.placement.mode!r} takes the merged "
              "weights (actor.lora.engine=merged)")
    if cfg.critic is not None:
        _one_of(cfg, "critic.lora.engine")
        _need(cfg.critic.lora.engine == "merged", "critic.lora.engine",
              "the critic feeds no rollout engine; leave it 'merged'")


def _validate_trainer(cfg: TrainConfig) -> None:
    """``trainer``: resume, checkpoints, update failures and rollback, phase deadlines; the
    rollout's retries."""
    t, r = cfg.trainer, cfg.rollout
    _one_of(cfg, "trainer.resume")
    _need(cfg.trainer.checkpoint_every >= 0, "trainer.checkpoint_every", "must be >= 0")
    _need(cfg.trainer.checkpoint_keep >= 1, "trainer.checkpoint_keep", "must be >= 1")
    _one_of(cfg, "trainer.resume_experience")
    _one_of(cfg, "trainer.on_update_failure")
    _one_of(cfg, "trainer.update_rollback")
    _need(t.max_update_retries >= 0, "trainer.max_update_retries", "must be >= 0")
    for phase, limit in vars(t.phase_timeout_s).items():
        _need(limit is None or limit > 0, f"trainer.phase_timeout_s.{phase}", f"must be > 0 seconds or null, got {limit}")
    _need(t.update_rollback == "memory" or t.on_update_failure == "stop", "trainer.on_update_failure",
          f"{t.on_update_failure!r} needs trainer.update_rollback=memory (without a copy of version v "
          "the only recovery is a restart from the last checkpoint: use 'stop')")
    _need(r.max_retries >= 0, "rollout.max_retries", "must be >= 0")


def _validate_faults(cfg: TrainConfig, world_size: int) -> None:
    """``faults``: rates in [0, 1), the failing rank in the world."""
    f = cfg.faults
    for key in ("rollout_error_rate", "duplicate_result_rate", "reward_timeout_rate"):
        _need(0.0 <= getattr(f, key) < 1.0, f"faults.{key}", f"must be in [0, 1), got {getattr(f, key)}")
    _one_of(cfg, "faults.fail_optimizer_step_kind")
    _need(-1 <= f.fail_optimizer_step_rank < world_size, "faults.fail_optimizer_step_rank",
          f"must be -1 (the last rank) or a rank in [0, {world_size}), got {f.fail_optimizer_step_rank}")
    _need(not f.reward_timeout_rate or cfg.reward.timeout_s is not None, "faults.reward_timeout_rate",
          "injects calls that hang past reward.timeout_s, which is null (no timeout)")
    models = cfg.reward.neural_models()
    for key in ("reward_model_error_at", "reward_model_timeout_at"):
        _need(not getattr(f, key) or bool(models), f"faults.{key}",
              "injects into the reward model's forward, and reward.model.path is not set")
    for key, m in models:
        _need(not f.reward_model_timeout_at or m.timeout_s is not None, "faults.reward_model_timeout_at",
              f"holds the reward model's forward past {key}.timeout_s, which is null (no timeout)")


def _validate_reward_penalty(cfg: TrainConfig) -> None:
    """``reward.penalty``: a number or null for each failure status, and no other key."""
    for k in ("error", "timeout", "invalid"):
        _need(k in cfg.reward.penalty, f"reward.penalty.{k}", "must be given (null for no penalty)")
    extra = sorted(set(cfg.reward.penalty) - {"error", "timeout", "invalid"})
    _need(not extra, f"reward.penalty.{extra[0] if extra else ''}", "unknown status; expected error, timeout, invalid")
    for k, v in cfg.reward.penalty.items():
        _need(v is None or isinstance(v, (int, float)), f"reward.penalty.{k}", f"must be a number or null, got {v!r}")


def _validate_algorithm(cfg: TrainConfig) -> None:
    """``algo`` and the roles it reads: the critic section, the KL and its reference, partial
    groups, the reward's source (what the chosen estimator needs is the algorithm's own check,
    :mod:`megarl.algo.config_checks`)."""
    a, r = cfg.algo, cfg.rollout
    if a.name == "grpo":
        _need(cfg.critic is None, "critic",
              "is set but algo.name=grpo trains no critic; remove the critic section or use algo.name=ppo")
    else:
        _need(cfg.critic is not None, "critic", "algo.name=ppo needs a critic section (critic: {} for the defaults)")
    _need(a.dynamic_sampling.max_rounds >= 1, "algo.dynamic_sampling.max_rounds", "must be >= 1")
    if a.kl.placement == "none":
        _need(a.kl.beta == 0, "algo.kl.beta", f"is {a.kl.beta} but algo.kl.placement is 'none' (the KL would be ignored)")
    else:
        _need(a.kl.beta > 0 or a.kl.adaptive, "algo.kl.beta", f"must be > 0 with algo.kl.placement={a.kl.placement!r}")
        _need(cfg.reference.enabled, "reference.enabled",
              f"is false but algo.kl.beta={a.kl.beta} > 0 with placement {a.kl.placement!r} needs a reference model")
    if a.kl.placement == "reward":
        _need(a.kl.estimator == "k1", "algo.kl.estimator", "must be 'k1' (the signed log-ratio) with placement 'reward'")
        _need(a.name == "ppo", "algo.kl.placement", "'reward' shapes per-token rewards for GAE (algo.name=ppo); GRPO puts the KL in the loss")
    _need(not a.kl.adaptive or a.kl.placement != "none", "algo.kl.adaptive", "needs a KL placement")
    if a.partial_groups == "allow_partial":
        _need(a.min_partial_size is not None and 1 <= a.min_partial_size <= r.n, "algo.min_partial_size",
              f"must be in [1, rollout.n={r.n}] with algo.partial_groups=allow_partial")
    if cfg.reward.model.path is None:
        for key in ("tokenizer", "chat_template"):
            _need(getattr(cfg.reward.model, key) is None, f"reward.model.{key}",
                  "is set but reward.model.path is not: there is no reward model to use it")
    _need(cfg.reward.fn is not None or bool(r.agent.env) or bool(cfg.reward.neural_models()) or bool(cfg.reward.judges),
          "reward.fn", "is null and no reward model or judge is given (reward.model.path, reward.models, "
          "reward.judges): nothing scores the samples")
    _validate_reward_models(cfg)
    _validate_judges(cfg)
    _validate_log_prob_sources(cfg)


def _validate_reward_models(cfg: TrainConfig) -> None:
    """Every neural reward model (``reward.model``, ``reward.models``): a path, a name of its
    own (the component its score is recorded under, not a rule's), its ranges."""
    import dataclasses

    from megarl.config.schema import RewardModelConfig

    seen = {}
    for key, m in cfg.reward.neural_models():
        _need(isinstance(m.path, str) and bool(m.path), f"{key}.path", "is required: the reward model's checkpoint")
        _need(bool(m.name) and "/" not in m.name, f"{key}.name", f"must be a component name without '/', got {m.name!r}")
        _need(m.name not in seen, f"{key}.name", f"{m.name!r} is also {seen.get(m.name)}'s: each score is its own component")
        seen[m.name] = key
        if key != "reward.model":  # (reward.model's ranges are the schema table's)
            for f in dataclasses.fields(RewardModelConfig):
                rule, choices, v = f.metadata.get("range"), f.metadata.get("choices"), getattr(m, f.name)
                _need(rule is None or rule.ok(v), f"{key}.{f.name}", f"must be {rule.describe() if rule else ''}, got {v}")
                _need(choices is None or v in choices, f"{key}.{f.name}", f"{v!r} is not one of {list(choices or ())}")
        _need(m.kind != "process" or bool(m.step_separator), f"{key}.step_separator",
              "is required with kind process: the text that ends a step, where the model's head is read")


def _validate_judges(cfg: TrainConfig) -> None:
    """Every generative judge (``reward.judges``): a path, a component name of its own, a prompt
    that reads the response, a verdict rule that can be parsed, its ranges and choices."""
    import dataclasses

    from megarl.config.schema import JudgeConfig

    seen = {m.name: key for key, m in cfg.reward.neural_models()}
    for i, j in enumerate(cfg.reward.judges):
        key = f"reward.judges[{i}]"
        _need(isinstance(j.path, str) and bool(j.path), f"{key}.path", "is required: the judge's checkpoint (a causal LM)")
        _need(bool(j.name) and "/" not in j.name, f"{key}.name", f"must be a component name without '/', got {j.name!r}")
        _need(j.name not in seen, f"{key}.name", f"{j.name!r} is also {seen.get(j.name)}'s: each score is its own component")
        seen[j.name] = key
        for f in dataclasses.fields(JudgeConfig):
            rule, choices, v = f.metadata.get("range"), f.metadata.get("choices"), getattr(j, f.name)
            _need(rule is None or rule.ok(v), f"{key}.{f.name}", f"must be {rule.describe() if rule else ''}, got {v}")
            _need(choices is None or v in choices, f"{key}.{f.name}", f"{v!r} is not one of {list(choices or ())}")
        _need(not j.probability or j.verdict == "yes_no", f"{key}.probability", "reads P(yes) / (P(yes) + P(no)): "
              "it needs verdict yes_no")
        _need(not (j.engine == "sglang" and j.offload), f"{key}.offload",
              f"with {key}.engine=sglang: SGLang's engine gives its weights up when it sleeps (the judge would be "
              f"gone); its share of the device is {key}.mem_fraction_static")
    # (the prompt template and the verdict rule: megarl/rewards/config_checks.py check_judges)


def _validate_log_prob_sources(cfg: TrainConfig) -> None:
    """``rollout.reuse_rollout_log_probs``, ``algo.rollout_correction``, the overlong buffer and
    the log-prob parity check: what the rollout's log-probs may stand for."""
    a, r = cfg.algo, cfg.rollout
    if r.reuse_rollout_log_probs:
        _need(r.backend == "hf" or r.temperature == 1.0, "rollout.reuse_rollout_log_probs",
              "raw-space rollout log-probs are needed")
    rc = a.rollout_correction
    _need(rc.token_is_cap is None or rc.token_is_cap >= 1, "algo.rollout_correction.token_is_cap",
          f"must be >= 1 or null, got {rc.token_is_cap}")
    _need(rc.seq_mask_threshold is None or rc.seq_mask_threshold > 0, "algo.rollout_correction.seq_mask_threshold",
          f"must be > 0 or null, got {rc.seq_mask_threshold}")
    _one_of(cfg, "algo.rollout_correction.seq_mask_stat")
    if rc.token_is_cap is not None or rc.seq_mask_threshold is not None:
        _need(not r.reuse_rollout_log_probs, "algo.rollout_correction",
              "compares the actor's old log-probs with the rollout's; rollout.reuse_rollout_log_probs=true "
              "makes them the same tensor (set it to false)")
    ob = cfg.reward.overlong_buffer
    _need(ob is None or 0 < ob <= r.max_new_tokens, "reward.overlong_buffer",
          f"must be in (0, rollout.max_new_tokens={r.max_new_tokens}] or null, got {ob}")
    _need(r.log_prob_parity_every >= 0, "rollout.log_prob_parity_every",
          f"must be >= 0 (0 = check parity on the first iteration only), got {r.log_prob_parity_every}")
    _need(r.log_prob_parity_tol > 0, "rollout.log_prob_parity_tol", f"must be > 0, got {r.log_prob_parity_tol}")


def _validate_sizes(cfg: TrainConfig) -> None:
    """Sizes that must be positive; the training temperature; the optimizers."""
    a, r, t, p = cfg.algo, cfg.rollout, cfg.trainer, cfg.parallel
    # positive sizes
    for key, v in (("trainer.iterations", t.iterations), ("trainer.prompts_per_iteration", t.prompts_per_iteration),
                   ("rollout.n", r.n), ("rollout.max_new_tokens", r.max_new_tokens),
                   ("algo.ppo_epochs", a.ppo_epochs), ("algo.num_mini_batches", a.num_mini_batches),
                   ("data.max_prompt_tokens", cfg.data.max_prompt_tokens), ("parallel.tp", p.tp),
                   ("parallel.pp", p.pp), ("rollout.bucket_mb", r.bucket_mb), ("rollout.tp", r.tp),
                   ("eval.n", cfg.eval.n)):
        _need(v >= 1, key, f"must be >= 1, got {v}")
    _need(r.temperature > 0, "rollout.temperature", f"must be > 0 for training rollouts, got {r.temperature}")
    for key, o in (("actor.optim", cfg.actor.optim),) + ((("critic.optim", cfg.critic.optim),) if cfg.critic else ()):
        _one_of(cfg, f"{key}.optimizer")
        _one_of(cfg, f"{key}.lr_decay_style")
        _need(o.lr > 0, f"{key}.lr", f"must be > 0, got {o.lr}")


def _validate_lora(lo, key: str) -> None:
    """``actor.lora`` / ``critic.lora``: known, non-empty targets."""
    if not lo.rank:
        return
    targets = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")  # megarl/models/lora.py TARGETS
    unknown = sorted(set(lo.target_modules) - set(targets))
    _need(not unknown and bool(lo.target_modules), f"{key}.target_modules",
          f"{unknown or 'an empty list'}: choose from {list(targets)} (megatron's names of the attention and MLP linears)")


def _validate_layout(cfg: TrainConfig, world_size: int) -> int:
    """``parallel``: tp x pp x cp and etp x ep x pp divide the world; returns the data-parallel size."""
    p = cfg.parallel
    # layout
    _need(p.cp >= 1, "parallel.cp", f"must be >= 1, got {p.cp}")
    mp = p.tp * p.pp * p.cp
    _need(world_size % mp == 0, "parallel.tp" if world_size % (p.tp * p.pp) else "parallel.cp",
          f"tp x pp x cp = {p.tp} x {p.pp} x {p.cp} = {mp} does not divide the world size {world_size} "
          f"(tp x pp x cp x dp must equal the number of processes)")
    dp = world_size // mp
    if p.cp > 1:  # what does not run split over context-parallel ranks yet
        a = cfg.algo
        _need(a.routing_replay == "none", "algo.routing_replay",
              f"is {a.routing_replay!r} with parallel.cp={p.cp}: routing replay is not run with context parallelism "
              "yet; set algo.routing_replay=none (or parallel.cp=1)")
        for key in ("moe_aux_loss_coeff", "moe_z_loss_coeff"):
            _need(getattr(cfg.actor, key) in (None, 0.0), f"actor.{key}",
                  f"is {getattr(cfg.actor, key)} with parallel.cp={p.cp}: the router's losses are not scaled for "
                  "context-parallel ranks yet; leave them off (or parallel.cp=1)")
    _need(p.vpp >= 1, "parallel.vpp", f"must be >= 1, got {p.vpp}")
    for key in ("first_stage_layers", "last_stage_layers"):
        n = getattr(p, key)
        if n is not None:
            _need(p.pp > 1 and p.vpp == 1, f"parallel.{key}",
                  f"is {n} with parallel.pp={p.pp} and parallel.vpp={p.vpp}: an uneven pipeline split needs pp > 1 "
                  "and no virtual stages")
    if p.vpp > 1:
        _need(p.pp > 1, "parallel.vpp", f"is {p.vpp} with parallel.pp={p.pp}: virtual pipeline stages interleave "
              "the chunks of several pipeline ranks; set parallel.pp > 1 (or parallel.vpp=1)")
        _need(cfg.algo.routing_replay == "none", "algo.routing_replay",
              f"is {cfg.algo.routing_replay!r} with parallel.vpp={p.vpp}: routing replay is not run over virtual "
              "pipeline stages yet; set algo.routing_replay=none (or parallel.vpp=1)")
        if p.recompute.granularity is not None:  # moe_losses.suspended: a filler's recompute would add its losses
            for key in ("moe_aux_loss_coeff", "moe_z_loss_coeff"):
                _need(getattr(cfg.actor, key) in (None, 0.0), f"actor.{key}",
                      f"is {getattr(cfg.actor, key)} with parallel.vpp={p.vpp} and parallel.recompute.granularity="
                      f"{p.recompute.granularity}: the recompute of a filler micro-batch would add its router losses; "
                      "leave them off, or turn off recompute or virtual stages")
    _need(p.ep >= 1, "parallel.ep", f"must be >= 1, got {p.ep}")
    _need(p.etp is None or p.etp >= 1, "parallel.etp", f"must be >= 1 or null, got {p.etp}")
    etp = p.tp if p.etp is None else p.etp
    _need(world_size % (etp * p.ep * p.pp) == 0, "parallel.ep",
          f"etp x ep x pp = {etp} x {p.ep} x {p.pp} does not divide the world size {world_size} "
          "(megatron takes the expert-parallel ranks from the data-parallel ones)")
    _validate_recompute(p.recompute)
    return dp


def _validate_recompute(rc) -> None:
    """``parallel.recompute``: what megatron recomputes (how it fits a model's layers is checked
    on its config.json, :func:`megarl.models.fit.validate_model_fit`)."""
    _one_of(rc, "granularity", "parallel.recompute.granularity")
    _one_of(rc, "method", "parallel.recompute.method")
    if rc.granularity == "selective":
        _need(len(rc.modules) > 0, "parallel.recompute.modules", "must name at least one module with granularity selective")
        for i, m in enumerate(rc.modules):
            _choice(m, f"parallel.recompute.modules[{i}]", choices_of(type(rc), "modules"))
        # megarl builds its experts as SequentialMLP (no grouped GEMM) and no model with MLA
        for m, why in (("moe_act", "needs megatron's grouped-GEMM experts, which megarl does not build"),
                       ("mla_up_proj", "is for multi-latent attention, which no megarl model has")):
            _need(m not in rc.modules, "parallel.recompute.modules", f"{m!r} {why}")


def _validate_batches(cfg: TrainConfig, dp: int) -> None:
    """Batch arithmetic: whole groups per mini-batch, equal micro-batches on every DP rank; packing."""
    a, r, t = cfg.algo, cfg.rollout, cfg.trainer
    # batch arithmetic: whole groups per mini-batch, equal micro-batches on every DP rank
    _need(t.prompts_per_iteration % a.num_mini_batches == 0, "algo.num_mini_batches",
          f"{a.num_mini_batches} does not divide trainer.prompts_per_iteration={t.prompts_per_iteration} "
          "(a mini-batch holds whole groups)")
    for key, v in (("algo.micro_batch_size", a.micro_batch_size),
                   ("algo.forward_micro_batch_size", a.forward_micro_batch_size)):
        _need(v >= 0, key, f"must be >= 1, or 0 for the whole batch in one pass, got {v}")
    mini = t.prompts_per_iteration * r.n // a.num_mini_batches
    # a token budget cuts the update's micro-batches itself (the row counts are unused there)
    _need(a.micro_batch_tokens or a.micro_batch_size == 0 or mini % (dp * a.micro_batch_size) == 0,
          "algo.micro_batch_size",
          f"a mini-batch of {t.prompts_per_iteration} prompts x {r.n} samples / {a.num_mini_batches} = {mini} "
          f"is not divisible by dp x micro_batch_size = {dp} x {a.micro_batch_size}")
    if cfg.critic is not None:
        cm = cfg.critic.micro_batch_size
        _need(a.micro_batch_tokens or cm == 0 or mini % (dp * cm) == 0, "critic.micro_batch_size",
              f"a mini-batch of {mini} samples is not divisible by dp x critic.micro_batch_size = "
              f"{dp} x {cfg.critic.micro_batch_size}")


def missing_packages(cfg: TrainConfig) -> list:
    """``(key, message)`` for each optional package the config needs that is not installed here
    (found, not imported).  A real start raises the first (:func:`require_installed`); a dry run
    simulating another machine reports them as not checked here."""
    import importlib.util

    out = []
    if cfg.rollout.backend == "sglang" and importlib.util.find_spec("sglang") is None:
        out.append(("rollout.backend", "'sglang' is not installed here; install the GPU extra: "
                                       'pip install -e ".[gpu]" (or use the Dockerfile)'))
    if cfg.teacher.path and cfg.teacher.engine == "sglang" and importlib.util.find_spec("sglang") is None:
        out.append(("teacher.engine", "'sglang' is not installed here; install the GPU extra: "
                                      'pip install -e ".[gpu]" (or use the Dockerfile), or use teacher.engine=hf'))
    for i, j in enumerate(cfg.reward.judges):
        if j.engine == "sglang" and importlib.util.find_spec("sglang") is None:
            out.append((f"reward.judges[{i}].engine", "'sglang' is not installed here; install the GPU extra: "
                                                      'pip install -e ".[gpu]" (or use the Dockerfile), or use engine hf'))
    return out


def require_installed(cfg: TrainConfig) -> None:
    for key, msg in missing_packages(cfg):
        raise ConfigError(f"{key}: {msg}")
