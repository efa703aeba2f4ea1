"""The training config: an omegaconf structured schema, CLI overrides, validation, hash.

    python -m megarl.train --config configs/grpo_arith_tiny.yaml key=value ...

The YAML recipe is merged onto the schema below (so an unknown key or a value of the wrong type
is refused by omegaconf with the key's full name), then ``key=value`` overrides are merged as an
omegaconf dotlist.  :func:`validate` then checks what a type cannot express -- sizes that must
divide, settings the chosen algorithm would ignore, a KL with no reference -- and raises
:class:`ConfigError` naming the key, before any model is built.  The resolved config and its
hash are written into the run directory.
"""

from __future__ import annotations

import dataclasses
import os
import time
from dataclasses import dataclass, field
from typing import Any, List, Optional

from megarl.errors import MegarlError
from megarl.hashing import json_sha256

ALGORITHMS = ("grpo", "ppo")


class ConfigError(MegarlError, ValueError):
    """A config key with a value that cannot run; the message names the key."""


# ---- the schema ----------------------------------------------------------------------------


@dataclass
class TinyModelConfig:
    """How to build the built-in tiny model when ``model.path`` does not exist yet."""

    hidden_size: int = 128
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int = 2
    intermediate_size: int = 256
    warmstart_steps: int = 470
    warmstart_lr: float = 2.0e-3
    warmstart_batch: int = 64
    seed: int = 0


@dataclass
class ModelConfig:
    path: str = "???"  # an HF checkpoint dir or a megarl megatron checkpoint dir
    tokenizer: Optional[str] = None  # default: model.path
    chat_template: Optional[str] = None  # a file with a Jinja template; default: the tokenizer's
    build_tiny: bool = False  # build the built-in tiny model at model.path if it is missing
    tiny: TinyModelConfig = field(default_factory=TinyModelConfig)
    vocab_multiple: int = 128


@dataclass
class ParallelConfig:
    tp: int = 1
    pp: int = 1


@dataclass
class DataConfig:
    train_path: str = "???"
    heldout_path: Optional[str] = None
    prompt_field: str = "prompt"
    messages_field: str = "messages"
    id_field: str = "id"
    apply_chat_template: bool = True
    system_prompt: Optional[str] = None
    max_prompt_tokens: int = 256
    shuffle: bool = True
    #: build the built-in arithmetic task files at these paths if they are missing
    build_arithmetic: bool = False
    arithmetic_train_n: int = 20000
    arithmetic_heldout_n: int = 200
    arithmetic_min_digits: int = 1
    arithmetic_max_digits: int = 3


@dataclass
class RolloutConfig:
    backend: str = "hf"  # hf (transformers; CPU default) | sglang (GPU)
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_new_tokens: int = 256
    n: int = 1  # samples per prompt; the group size G for group estimators
    #: old log-probs from the rollout engine instead of an actor forward, accepted only after a
    #: measured token-by-token parity check against the actor on the first iteration (and again
    #: every ``log_prob_parity_every`` iterations; 0 = the first only), within ``log_prob_parity_tol``
    reuse_rollout_log_probs: bool = False
    log_prob_parity_tol: float = 1.0e-3
    log_prob_parity_every: int = 0
    bucket_mb: int = 512
    #: regenerations of a lost or aborted candidate (same sample id, seed and policy version)
    #: before its group is handled as incomplete (algo.partial_groups)
    max_retries: int = 2
    # sglang (GPU) settings
    tp: int = 1  # inference TP size
    mem_fraction_static: float = 0.6
    enable_memory_saver: bool = True
    #: SGLang's enable_deterministic_inference: per-candidate seeds are honoured (and recorded in
    #: the experience) only with it; batch-invariant kernels make decoding slower
    deterministic_inference: bool = False


@dataclass
class KLSettings:
    placement: str = "none"  # none | loss (GRPO, DeepSeekMath) | reward (PPO shaped reward)
    estimator: str = "k3"
    beta: float = 0.0
    adaptive: bool = False  # PPO: Ziegler et al. adaptive controller
    target: float = 6.0
    horizon: int = 10000


@dataclass
class DynamicSampling:
    """DAPO dynamic sampling (Yu et al. 2025): drop groups whose rewards all agree and sample
    more prompts on the same version until the batch is full, at most ``max_rounds`` rounds."""

    enabled: bool = False
    max_rounds: int = 4


@dataclass
class RolloutCorrectionSettings:
    """Correction of the rollout-vs-trainer log-prob mismatch (Yao et al. 2025), computed from
    the sealed actor and rollout log-probs; both off (null) by default."""

    token_is_cap: Optional[float] = None  # C of truncated importance sampling, >= 1 (null: no IS weights)
    seq_mask_threshold: Optional[float] = None  # drop a sample from the loss above this error (null: keep all)
    seq_mask_stat: str = "max_abs"  # max_abs | mean (|mean log-ratio| over the response)


@dataclass
class AlgoConfig:
    name: str = "grpo"  # grpo | ppo
    advantage: str = "grpo"  # grpo | dr_grpo | rloo | gae | reinforce_plus_plus
    gamma: float = 1.0
    lam: float = 1.0
    zero_std_rule: str = "epsilon"  # epsilon | skip
    std_eps: float = 1.0e-6
    whiten_advantages: bool = True  # GAE advantages whitened over the batch (PPO practice)
    policy_loss: str = "vanilla"  # vanilla | gspo
    clip_low: float = 0.2
    clip_high: float = 0.2
    dual_clip: Optional[float] = 3.0
    agg_mode: str = "token-mean"
    entropy_coef: float = 0.0
    kl: KLSettings = field(default_factory=KLSettings)
    ppo_epochs: int = 1
    num_mini_batches: int = 1
    #: rows per forward/backward in the update, per DP rank; 0 = the whole mini-batch at once
    micro_batch_size: int = 8
    #: rows per forward-only pass (old/reference log-probs, critic values); 0 = all at once
    forward_micro_batch_size: int = 16
    #: forward-only passes run each micro-batch's real tokens as one packed (THD) sequence; false = padded
    pack_sequences: bool = False
    dynamic_sampling: DynamicSampling = field(default_factory=DynamicSampling)
    partial_groups: str = "drop"  # drop | allow_partial
    min_partial_size: Optional[int] = None
    rollout_correction: RolloutCorrectionSettings = field(default_factory=RolloutCorrectionSettings)


@dataclass
class OptimSettings:
    optimizer: str = "adam"
    lr: float = 1.0e-6
    min_lr: float = 0.0
    lr_warmup_steps: int = 0  # optimizer steps (ppo_epochs x num_mini_batches per iteration)
    lr_decay_style: str = "constant"  # constant | linear | cosine
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1.0e-8
    clip_grad: float = 1.0


@dataclass
class ActorConfig:
    optim: OptimSettings = field(default_factory=OptimSettings)
    offload: bool = False  # params/grads/optimizer to host while the rollout engine runs (GPU)


@dataclass
class ReferenceConfig:
    enabled: bool = True
    path: Optional[str] = None  # default: the actor's starting checkpoint
    refresh_every: int = 0  # 0: never; K: copy the actor into the reference every K iterations
    offload: bool = False


@dataclass
class CriticConfig:
    path: Optional[str] = None  # None: initialised from the actor's weights (value head zero)
    optim: OptimSettings = field(default_factory=lambda: OptimSettings(lr=1.0e-5))
    value_clip: Optional[float] = 0.2
    micro_batch_size: int = 8
    warmup_iters: int = 0  # critic-only updates before the actor starts moving
    offload: bool = False


@dataclass
class RewardModelConfig:
    path: Optional[str] = None  # an HF *ForTokenClassification (num_labels=1) checkpoint
    tokenizer: Optional[str] = None  # default: reward_model.path
    chat_template: Optional[str] = None
    weight: float = 1.0  # weight of the RM score in a composite with reward.fn
    offload: bool = False  # on the host between its forwards (GPU time-slicing)


@dataclass
class RewardConfig:
    fn: Optional[str] = "exact_numeric"  # builtin name or "pkg.mod:callable"; None = RM only
    kwargs: dict = field(default_factory=dict)
    components: list = field(default_factory=list)  # for fn=composite
    model: RewardModelConfig = field(default_factory=RewardModelConfig)
    timeout_s: Optional[float] = 30.0
    max_retries: int = 2
    retry_backoff_s: float = 0.05
    #: where scorers run: process (killable worker processes) | thread | auto (threads for the
    #: cheap rule builtins exact_numeric / regex / arithmetic and composites of them, processes
    #: for math_verify and plug-ins); see megarl/rewards/isolation.py
    isolation: str = "auto"
    workers: int = 4  # concurrent reward calls: worker threads or processes
    kill_grace_s: float = 0.5  # process: SIGTERM -> SIGKILL delay for an overdue worker
    max_memory_mb: Optional[int] = None  # process: RLIMIT_AS per worker (whole address space); null = none
    cpu_time_s: Optional[float] = None  # process: RLIMIT_CPU per call (SIGXCPU -> error); null = none
    on_failure: str = "drop"  # drop | quarantine (kept in <run_dir>/quarantine.jsonl)
    #: the only way a failure becomes a number: a penalty per status (null = none)
    penalty: dict = field(default_factory=lambda: {"error": None, "timeout": None, "invalid": None})
    #: DAPO soft overlong punishment: L_cache, the last tokens before rollout.max_new_tokens over
    #: which an ok score is lowered linearly to -1 (component "overlong"); null = off
    overlong_buffer: Optional[int] = None


@dataclass
class EvalConfig:
    every: int = 5  # iterations between held-out evaluations (0: start and end only)
    n: int = 200  # held-out prompts per evaluation
    max_new_tokens: Optional[int] = None  # default: rollout.max_new_tokens
    success_threshold: float = 1.0  # accuracy = share of held-out samples with reward >= this


@dataclass
class PhaseTimeoutsConfig:
    """Seconds each phase of the iteration may last (null: no limit).  A phase past its limit
    fails the run on every rank together (restart from the last checkpoint): loading and
    activation are checked when they end, generation after every generate call (before scoring
    and the forwards run), the sealed batch before the update, the update after every optimizer
    step."""

    exporting: Optional[float] = 600.0
    rollout_loading: Optional[float] = 600.0
    rollout_ready: Optional[float] = 600.0
    generating: Optional[float] = 3600.0
    experience_sealed: Optional[float] = 600.0
    updating_from: Optional[float] = 3600.0


@dataclass
class TrainerConfig:
    iterations: int = 10
    prompts_per_iteration: int = 8  # B
    seed: int = 1234
    run_dir: Optional[str] = None  # default runs/<recipe>-<timestamp>
    run_id: Optional[str] = None  # default: the run_dir's name
    export_every: int = 0  # 0: only iter_0 and the end
    save_experience: bool = False  # audit trail: every sealed batch with its manifest
    tensorboard: bool = True
    deterministic: bool = True
    max_wall_minutes: Optional[float] = None  # stop (with an export) after this much wall time
    checkpoint_every: int = 0  # iterations between training-position checkpoints (0: only on SIGTERM/SIGUSR1)
    checkpoint_keep: int = 3  # how many published checkpoints to keep
    resume: str = "auto"  # auto: continue from <run_dir>/checkpoints/latest if there is one | never
    resume_force: bool = False  # resume although tokenizer / template / reward / model config changed (new run id)
    #: the iteration a crash interrupted after its experience was sealed: "rerun" its rollout, or
    #: "reuse" the sealed batch (written to <run_dir>/experience/pending at every seal; reused only
    #: if its policy version, config hashes and content hash match the checkpoint's)
    resume_experience: str = "rerun"
    #: a failed actor/critic update (exception on any rank, non-finite loss or grad norm): the
    #: weights, optimizer and LR schedule return to the committed version v on every rank, then
    #: "retry" the update on the same sealed batch (at most max_update_retries times, then stop),
    #: "skip" the batch and keep v, or "stop" the run (the last checkpoint stays the restart point)
    on_update_failure: str = "retry"
    max_update_retries: int = 2
    #: "memory": a host copy of actor (and critic) params and optimizer state at the start of every
    #: update, for the rollback (costs one device->host copy of that state per iteration); "none":
    #: no copy, a failed update stops the run and resume=auto restarts from the last checkpoint
    update_rollback: str = "memory"
    #: iterations recorded as a Chrome-trace timeline per rank (<run_dir>/profile/iter_<k>.rank<r>.json)
    profile_iterations: List[int] = field(default_factory=list)
    phase_timeout_s: PhaseTimeoutsConfig = field(default_factory=PhaseTimeoutsConfig)


@dataclass
class FaultsConfig:
    """Fault injection for tests and drills; every key is inert unless set."""

    crash_during_checkpoint_at: Optional[int] = None  # die after writing checkpoint k, before publishing it
    crash_during_update_at: Optional[int] = None  # die (os._exit) in iteration k's update, after its seal
    corrupt_weight_sync_at: List[int] = field(default_factory=list)  # iterations whose first weight load is corrupted
    rollout_error_rate: float = 0.0  # a candidate's result is lost (and delivered late, in the next call)
    duplicate_result_rate: float = 0.0  # a candidate's result is delivered twice
    reward_timeout_rate: float = 0.0  # a reward call hangs past reward.timeout_s
    fail_optimizer_step_at: List[int] = field(default_factory=list)  # iterations whose update fails once
    fail_optimizer_step_rank: int = -1  # the rank that fails (-1: the last)
    fail_optimizer_step_kind: str = "exception"  # exception | nan (a non-finite loss on that rank)
    seed: int = 0  # of the fault draws (see megarl/faults.py)


@dataclass
class TrainConfig:
    recipe: str = "custom"
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    algo: AlgoConfig = field(default_factory=AlgoConfig)
    actor: ActorConfig = field(default_factory=ActorConfig)
    reference: ReferenceConfig = field(default_factory=ReferenceConfig)
    critic: Optional[CriticConfig] = None
    reward: RewardConfig = field(default_factory=RewardConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    faults: FaultsConfig = field(default_factory=FaultsConfig)


# ---- loading ---------------------------------------------------------------------------------


def _omegaconf_error(e: Exception, where: str) -> ConfigError:
    key = getattr(e, "full_key", None) or getattr(e, "key", None)
    msg = (getattr(e, "msg", None) or str(e)).strip().splitlines()[0]
    return ConfigError(f"{where}: {key}: {msg}" if key else f"{where}: {msg}")


def load_config(path: Optional[str], overrides: list[str] = ()) -> TrainConfig:
    """YAML recipe + dotlist overrides merged onto the schema; a typed :class:`TrainConfig`.

    Unknown keys, wrong types and missing required keys raise :class:`ConfigError` naming the
    key.  Relative paths in the recipe stay relative to the working directory (like every CLI).
    """
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    schema = OmegaConf.structured(TrainConfig)
    try:
        merged = schema
        if path is not None:
            if not os.path.isfile(path):
                raise ConfigError(f"--config {path}: file not found")
            try:
                recipe = OmegaConf.load(path)
            except Exception as e:  # yaml syntax
                raise ConfigError(f"{path}: not a valid YAML recipe ({str(e).splitlines()[0]})") from None
            if recipe.get("critic") is not None:
                # an Optional[dataclass] node merges only onto a structured default
                schema.critic = OmegaConf.structured(CriticConfig)
            merged = OmegaConf.merge(schema, recipe)
        for ov in overrides:
            if "=" not in ov:
                raise ConfigError(f"override {ov!r}: expected key=value")
            if ov.startswith("critic.") and merged.critic is None:
                merged.critic = OmegaConf.structured(CriticConfig)
        merged = OmegaConf.merge(merged, OmegaConf.from_dotlist(list(overrides)))
        missing = sorted(OmegaConf.missing_keys(merged))
        if missing:
            raise ConfigError(f"{path or 'config'}: required key(s) not set: {', '.join(missing)}")
        cfg = OmegaConf.to_object(merged)
    except OmegaConfBaseException as e:
        raise _omegaconf_error(e, path or "config") from None
    if path is not None and cfg.recipe == "custom":
        cfg.recipe = os.path.splitext(os.path.basename(path))[0]
    return cfg


def to_dict(cfg: TrainConfig) -> dict:
    return dataclasses.asdict(cfg)


def config_hash(cfg: TrainConfig, *, exclude: tuple[str, ...] = ("trainer.run_dir", "trainer.run_id")) -> str:
    """:func:`megarl.hashing.json_sha256` of the resolved config (where the run writes is not part
    of it); written to run.json."""
    d = to_dict(cfg)
    for dotted in exclude:
        node = d
        *parents, leaf = dotted.split(".")
        for p in parents:
            node = node.get(p) or {}
        node.pop(leaf, None)
    return json_sha256(d)


def section_hash(section: Any) -> str:
    """:func:`megarl.hashing.json_sha256` of a config section (a dataclass, as a dict) or of any
    JSON-able value: what a resumed run must share with its checkpoint."""
    return json_sha256(dataclasses.asdict(section) if dataclasses.is_dataclass(section) else section)


def default_run_dir(cfg: TrainConfig) -> str:
    return os.path.join("runs", f"{cfg.recipe}-{time.strftime('%Y%m%d-%H%M%S')}")


# ---- validation ------------------------------------------------------------------------------


def _need(ok: bool, key: str, msg: str) -> None:
    if not ok:
        raise ConfigError(f"{key}: {msg}")


def _choice(value: str, key: str, choices) -> None:
    _need(value in choices, key, f"{value!r} is not one of {list(choices)}")


def _validate_reward_isolation(cfg: TrainConfig) -> None:
    from megarl.rewards.isolation import ISOLATION_MODES, resolve_isolation

    rw = cfg.reward
    _choice(rw.isolation, "reward.isolation", ISOLATION_MODES)
    _need(rw.workers >= 1, "reward.workers", f"must be >= 1, got {rw.workers}")
    _need(rw.kill_grace_s > 0, "reward.kill_grace_s", f"must be > 0 seconds, got {rw.kill_grace_s}")
    _need(rw.max_memory_mb is None or rw.max_memory_mb >= 64, "reward.max_memory_mb",
          f"must be >= 64 (the worker's whole address space) or null, got {rw.max_memory_mb}")
    _need(rw.cpu_time_s is None or rw.cpu_time_s > 0, "reward.cpu_time_s", f"must be > 0 or null, got {rw.cpu_time_s}")
    if rw.fn is not None and resolve_isolation(rw.isolation, rw.fn, list(rw.components or [])) == "thread":
        for key in ("max_memory_mb", "cpu_time_s"):
            _need(getattr(rw, key) is None, f"reward.{key}",
                  f"limits worker processes, but reward.fn {rw.fn!r} runs on threads (reward.isolation="
                  f"{rw.isolation}); set reward.isolation=process or drop the limit")
    _need(not (cfg.faults.reward_timeout_rate and rw.isolation == "process"), "reward.isolation",
          "'process' cannot carry faults.reward_timeout_rate (the fault wrapper lives in the trainer); use thread or auto")


def validate(cfg: TrainConfig, world_size: int) -> int:
    """Check everything a type cannot; return the data-parallel size.  Reads no model weights."""
    from megarl.algo.aggregation import AGG_MODES
    from megarl.algo.kl import KL_ESTIMATORS
    from megarl.algo.registry import advantage_names, advantage_needs, policy_loss_names

    import megarl.algo.advantages  # noqa: F401  (registers the estimators)
    import megarl.algo.policy_loss  # noqa: F401

    a, r, t, p = cfg.algo, cfg.rollout, cfg.trainer, cfg.parallel
    _choice(a.name, "algo.name", ALGORITHMS)
    _choice(a.advantage, "algo.advantage", advantage_names())
    _choice(a.policy_loss, "algo.policy_loss", policy_loss_names())
    _choice(a.agg_mode, "algo.agg_mode", AGG_MODES)
    _choice(a.zero_std_rule, "algo.zero_std_rule", ("epsilon", "skip"))
    _choice(a.kl.placement, "algo.kl.placement", ("none", "loss", "reward"))
    _choice(a.kl.estimator, "algo.kl.estimator", KL_ESTIMATORS)
    _choice(a.partial_groups, "algo.partial_groups", ("drop", "allow_partial"))
    _choice(r.backend, "rollout.backend", ("hf", "sglang"))
    _choice(cfg.reward.on_failure, "reward.on_failure", ("drop", "quarantine"))
    _validate_reward_isolation(cfg)
    _choice(cfg.trainer.resume, "trainer.resume", ("auto", "never"))
    _need(cfg.trainer.checkpoint_every >= 0, "trainer.checkpoint_every", "must be >= 0")
    _need(cfg.trainer.checkpoint_keep >= 1, "trainer.checkpoint_keep", "must be >= 1")
    _choice(t.resume_experience, "trainer.resume_experience", ("rerun", "reuse"))
    _choice(t.on_update_failure, "trainer.on_update_failure", ("retry", "skip", "stop"))
    _choice(t.update_rollback, "trainer.update_rollback", ("memory", "none"))
    _need(t.max_update_retries >= 0, "trainer.max_update_retries", "must be >= 0")
    for phase, limit in vars(t.phase_timeout_s).items():
        _need(limit is None or limit > 0, f"trainer.phase_timeout_s.{phase}", f"must be > 0 seconds or null, got {limit}")
    _need(t.update_rollback == "memory" or t.on_update_failure == "stop", "trainer.on_update_failure",
          f"{t.on_update_failure!r} needs trainer.update_rollback=memory (without a copy of version v "
          "the only recovery is a restart from the last checkpoint: use 'stop')")
    _need(r.max_retries >= 0, "rollout.max_retries", "must be >= 0")
    f = cfg.faults
    for key in ("rollout_error_rate", "duplicate_result_rate", "reward_timeout_rate"):
        _need(0.0 <= getattr(f, key) < 1.0, f"faults.{key}", f"must be in [0, 1), got {getattr(f, key)}")
    _choice(f.fail_optimizer_step_kind, "faults.fail_optimizer_step_kind", ("exception", "nan"))
    _need(-1 <= f.fail_optimizer_step_rank < world_size, "faults.fail_optimizer_step_rank",
          f"must be -1 (the last rank) or a rank in [0, {world_size}), got {f.fail_optimizer_step_rank}")
    _need(not f.reward_timeout_rate or cfg.reward.timeout_s is not None, "faults.reward_timeout_rate",
          "injects calls that hang past reward.timeout_s, which is null (no timeout)")
    for k in ("error", "timeout", "invalid"):
        _need(k in cfg.reward.penalty, f"reward.penalty.{k}", "must be given (null for no penalty)")
    extra = sorted(set(cfg.reward.penalty) - {"error", "timeout", "invalid"})
    _need(not extra, f"reward.penalty.{extra[0] if extra else ''}", "unknown status; expected error, timeout, invalid")
    for k, v in cfg.reward.penalty.items():
        _need(v is None or isinstance(v, (int, float)), f"reward.penalty.{k}", f"must be a number or null, got {v!r}")

    # the algorithm and the roles it reads: the estimator's registry entry says what it needs
    needs = advantage_needs(a.advantage)
    critic_free = [n for n in advantage_names() if not advantage_needs(n).critic and not advantage_needs(n).step_rewards]
    if a.name == "grpo":
        _need(not needs.critic, "algo.advantage",
              f"{a.advantage!r} needs a critic; algo.name=grpo has none (use one of {critic_free})")
        _need(cfg.critic is None, "critic",
              "is set but algo.name=grpo trains no critic; remove the critic section or use algo.name=ppo")
    else:
        _need(cfg.critic is not None, "critic", "algo.name=ppo needs a critic section (critic: {} for the defaults)")
        critic_ests = [n for n in advantage_names() if advantage_needs(n).critic]
        _need(needs.critic, "algo.advantage",
              f"algo.name=ppo uses the critic: expected one of {critic_ests}, got {a.advantage!r}")
    _need(not needs.step_rewards, "algo.advantage",
          f"{a.advantage!r} reads per-step process rewards, which no reward function in megarl produces "
          f"(use one of {critic_free})")
    if needs.groups:
        _need(r.n >= 2, "rollout.n", f"the group estimator {a.advantage!r} needs G >= 2 samples per prompt, got {r.n}")
    _need(not a.dynamic_sampling.enabled or needs.groups, "algo.dynamic_sampling.enabled",
          "filters zero-spread groups, which only exist with a group estimator")
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
        _need(cfg.reward.fn is not None, "reward.fn", "is null and no reward_model.path is given: nothing scores the samples")
    if r.reuse_rollout_log_probs:
        _need(r.backend == "hf" or r.temperature == 1.0, "rollout.reuse_rollout_log_probs",
              "raw-space rollout log-probs are needed")
    rc = a.rollout_correction
    _need(rc.token_is_cap is None or rc.token_is_cap >= 1, "algo.rollout_correction.token_is_cap",
          f"must be >= 1 or null, got {rc.token_is_cap}")
    _need(rc.seq_mask_threshold is None or rc.seq_mask_threshold > 0, "algo.rollout_correction.seq_mask_threshold",
          f"must be > 0 or null, got {rc.seq_mask_threshold}")
    _choice(rc.seq_mask_stat, "algo.rollout_correction.seq_mask_stat", ("max_abs", "mean"))
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
        _choice(o.optimizer, f"{key}.optimizer", ("adam", "sgd"))
        _choice(o.lr_decay_style, f"{key}.lr_decay_style", ("constant", "linear", "cosine"))
        _need(o.lr > 0, f"{key}.lr", f"must be > 0, got {o.lr}")

    # layout
    mp = p.tp * p.pp
    _need(world_size % mp == 0, "parallel.tp",
          f"tp x pp = {p.tp} x {p.pp} = {mp} does not divide the world size {world_size} "
          f"(tp x pp x dp must equal the number of processes)")
    dp = world_size // mp
    # batch arithmetic: whole groups per mini-batch, equal micro-batches on every DP rank
    _need(t.prompts_per_iteration % a.num_mini_batches == 0, "algo.num_mini_batches",
          f"{a.num_mini_batches} does not divide trainer.prompts_per_iteration={t.prompts_per_iteration} "
          "(a mini-batch holds whole groups)")
    for key, v in (("algo.micro_batch_size", a.micro_batch_size),
                   ("algo.forward_micro_batch_size", a.forward_micro_batch_size)):
        _need(v >= 0, key, f"must be >= 1, or 0 for the whole batch in one pass, got {v}")
    if a.pack_sequences:
        from megarl.models.forward import packing_unsupported_reason

        why = packing_unsupported_reason()
        _need(why is None, "algo.pack_sequences", f"is true, but {why}")
    mini = t.prompts_per_iteration * r.n // a.num_mini_batches
    _need(a.micro_batch_size == 0 or mini % (dp * a.micro_batch_size) == 0, "algo.micro_batch_size",
          f"a mini-batch of {t.prompts_per_iteration} prompts x {r.n} samples / {a.num_mini_batches} = {mini} "
          f"is not divisible by dp x micro_batch_size = {dp} x {a.micro_batch_size}")
    if cfg.critic is not None:
        _need(mini % (dp * cfg.critic.micro_batch_size) == 0, "critic.micro_batch_size",
              f"a mini-batch of {mini} samples is not divisible by dp x critic.micro_batch_size = "
              f"{dp} x {cfg.critic.micro_batch_size}")
    return dp


def validate_model_fit(cfg: TrainConfig, spec, where: str) -> None:
    """Heads / KV heads / FFN / layers / vocab padding against TP and PP (config.json only)."""
    from megarl.models.hf_config import ModelConfigError, check_parallel_fit

    p = cfg.parallel
    try:
        check_parallel_fit(spec, p.tp, p.pp, where=where)
    except ModelConfigError as e:
        raise ConfigError(f"parallel.tp/parallel.pp: {e}") from None
    _need(cfg.model.vocab_multiple % p.tp == 0, "model.vocab_multiple",
          f"{cfg.model.vocab_multiple} is not divisible by parallel.tp={p.tp} (the padded vocabulary is split over TP)")
