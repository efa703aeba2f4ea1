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
import math
import os
import time
from dataclasses import dataclass, field
from typing import Any, List, Optional

from megarl.errors import MegarlError
from megarl.hashing import json_sha256

ALGORITHMS = ("grpo", "ppo")
ROUTING_REPLAY = ("none", "measure", "rollout")
TINY_FAMILIES = ("llama", "qwen3_moe")  # what megarl.tinymodel builds (its FAMILIES)
TINY_VALIDATIONS = ("heldout", "train-mix")  # where its early stop is measured (its VALIDATIONS)


class ConfigError(MegarlError, ValueError):
    """A config key with a value that cannot run; the message names the key."""


# ---- the schema ----------------------------------------------------------------------------


@dataclass
class TinyModelConfig:
    """How to build the built-in tiny model when ``model.path`` does not exist yet."""

    hidden_size: int = 128  # the built-in tiny Llama's width
    num_layers: int = 4  # its transformer layers
    num_heads: int = 4  # its attention heads
    num_kv_heads: int = 2  # its KV heads (GQA)
    intermediate_size: int = 256  # its SwiGLU width
    #: the most supervised warm-start steps on the arithmetic task (exactly this many when
    #: warmstart_target_accuracy is null)
    warmstart_steps: int = 2000
    warmstart_lr: float = 2.0e-3  # the warm start's learning rate
    warmstart_batch: int = 64  # the warm start's batch size
    #: Adam's second-moment decay in the warm start (0.98 with batches of 128 brought the
    #: onset earlier on an AVX-512 Xeon; no recipe sets it yet: megarl/tinymodel.py says why)
    warmstart_adam_beta2: float = 0.999
    #: where the arithmetic build's early stop is measured: heldout (held-out problems outside
    #: the evaluation set, mostly two-by-two-digit sums) | train-mix (train problems in the
    #: evaluation set's mix, never drawn by the warm start); megarl/tinymodel.py compares them
    warmstart_validation: str = "heldout"
    #: early-stop the warm start at the first check (every 4 steps) where its teacher-forced
    #: accuracy on 256 held-out problems outside the evaluation set reaches this; null: run
    #: warmstart_steps steps (megarl/tinymodel.py says why a step count is a knife's edge)
    warmstart_target_accuracy: Optional[float] = 0.3
    seed: int = 0  # of its initialisation and warm-start data
    #: llama (the dense default) | qwen3_moe (a Qwen3-MoE: every layer routes each token to
    #: top_k of num_experts experts; intermediate_size unused)
    family: str = "llama"
    num_experts: int = 8  # qwen3_moe: routed experts per layer
    top_k: int = 2  # qwen3_moe: experts per token (<= num_experts)
    moe_intermediate_size: int = 128  # qwen3_moe: each expert's SwiGLU width
    #: share of calculator tool-use demonstrations among the warm-start sequences after
    #: tool_only_steps (0: the arithmetic build; > 0: the calculator recipe's build, every
    #: sequence a calculator conversation on tool_min_digits..tool_max_digits operands, the
    #: rest answered at once, with loss on their first token: the decision not to call)
    tool_demos: float = 0.0
    tool_only_steps: int = 0  # the first warm-start steps that are demonstrations only (they teach copying)
    #: with warmstart_target_accuracy: tool_only_steps is the most of an onset phase at the full
    #: rate that stops at the target (tool-use validation); a tail of warmstart_steps -
    #: tool_only_steps steps at a decaying rate follows, its last tool_mixture_steps the mixture
    tool_mixture_steps: int = 100
    tool_min_digits: int = 4  # fewest digits per operand of the calculator build's sequences
    tool_max_digits: int = 6  # most digits per operand of the calculator build's sequences
    #: the role of the demonstrations' tool messages (the tiny vocabulary has no <|tool|>; the
    #: recipe passes the same rollout.agent.env_args.tool_role)
    tool_role: str = "user"
    #: share of warm-start sequences that are two_turn demonstrations (guess, feedback, answer;
    #: 0: none): the two-turn recipe's build (not with tool_demos)
    two_turn_demos: float = 0.0


@dataclass
class ModelConfig:
    """The policy model: where it is, its tokenizer and chat template."""

    path: str = "???"  # an HF checkpoint dir, a megarl megatron checkpoint dir, or a Hub id (megarl/hub.py)
    tokenizer: Optional[str] = None  # default: model.path (a directory or a Hub id)
    #: the Hub revision (branch, tag or commit) of model.path / model.tokenizer when they are Hub ids
    revision: Optional[str] = None
    chat_template: Optional[str] = None  # a file with a Jinja template; default: the tokenizer's
    build_tiny: bool = False  # build the built-in tiny model at model.path if it is missing
    tiny: TinyModelConfig = field(default_factory=TinyModelConfig)
    vocab_multiple: int = 128  # pad the vocabulary to a multiple of this (divisible by parallel.tp)


@dataclass
class ParallelConfig:
    """Megatron model parallelism of the trained and frozen roles (dp = world / (tp x pp))."""

    tp: int = 1  # tensor-parallel size of the actor, reference, critic and reward model
    pp: int = 1  # pipeline-parallel size; tp x pp x dp = the number of processes
    #: expert-parallel size of a mixture-of-experts model: each layer's experts are spread over ep
    #: ranks taken from the data-parallel ones (ep divides the number of experts and world / (etp x pp))
    ep: int = 1
    etp: Optional[int] = None  # expert tensor-parallel size (null: parallel.tp)


@dataclass
class DataConfig:
    """Prompt datasets: files, fields, chat formatting, length limit."""

    #: a .jsonl / .parquet file, a directory of them, a `datasets` save_to_disk directory, or a
    #: Hub dataset (org/name or hf://datasets/name; needs the `datasets` extra)
    train_path: str = "???"
    heldout_path: Optional[str] = None  # held-out prompts for eval.* (null: no held-out evaluation)
    train_split: str = "train"  # the split of a DatasetDict directory or Hub dataset (files have none)
    train_subset: Optional[str] = None  # the subset (config name) of a Hub dataset (openai/gsm8k: main)
    heldout_split: str = "test"  # the held-out split of a DatasetDict directory or Hub dataset
    heldout_subset: Optional[str] = None  # the held-out subset (config name) of a Hub dataset
    prompt_field: str = "prompt"  # the row field with the prompt text
    messages_field: str = "messages"  # the row field with chat messages (instead of a prompt)
    id_field: str = "id"  # the row field with a stable sample id (default: the row number)
    apply_chat_template: bool = True  # render prompts with the tokenizer's chat template
    system_prompt: Optional[str] = None  # a system message put before every prompt (null: none)
    max_prompt_tokens: int = 256  # longer prompts are dropped and counted, never cut
    shuffle: bool = True  # shuffle the prompt order (seeded by trainer.seed)
    #: build the built-in arithmetic task files at these paths if they are missing
    build_arithmetic: bool = False
    arithmetic_train_n: int = 20000  # problems in the built-in train split
    arithmetic_heldout_n: int = 200  # problems in the built-in held-out split
    arithmetic_min_digits: int = 1  # fewest digits per operand of the built-in task
    arithmetic_max_digits: int = 3  # most digits per operand of the built-in task
    #: a train / held-out row without a ground-truth field the reward reads: error (refuse the
    #: file at start-up, naming file, line and field) | skip (drop such rows, counted)
    on_missing_fields: str = "error"


@dataclass
class AgentConfig:
    """Multi-turn agent rollouts: the environment a trajectory talks to, and its limits."""

    #: the environment: "" (no agent: single-turn rollouts) | calculator | two_turn | "pkg.mod:Class"
    #: (a user environment, see megarl/envs/protocol.py)
    env: str = ""
    env_args: dict = field(default_factory=dict)  # keyword arguments of the environment's constructor
    max_turns: int = 4  # policy turns per trajectory; reaching it ends it (finish reason max_turns)
    #: tokens per trajectory after the prompt, policy and environment tokens together (finish reason length)
    max_total_tokens: int = 1024
    #: the limit of one environment call (reset or step), in seconds; an overrun is status timeout
    step_timeout_s: float = 10.0
    max_workers: int = 8  # environment calls run concurrently on this many threads


@dataclass
class RolloutConfig:
    """Generation: the engine, sampling parameters, samples per prompt, weight sync."""

    backend: str = "hf"  # hf (transformers; CPU default) | sglang (GPU; on CPU: megarl/rollout/sglang_cpu)
    temperature: float = 1.0  # sampling temperature of training rollouts
    top_p: float = 1.0  # nucleus sampling (1: off)
    top_k: int = -1  # top-k sampling (-1: off)
    max_new_tokens: int = 256  # response length limit (tokens)
    n: int = 1  # samples per prompt; the group size G for group estimators
    #: old log-probs from the rollout engine instead of an actor forward, accepted only after a
    #: measured token-by-token parity check against the actor on the first iteration (and again
    #: every ``log_prob_parity_every`` iterations; 0 = the first only), within ``log_prob_parity_tol``
    reuse_rollout_log_probs: bool = False
    log_prob_parity_tol: float = 1.0e-3  # largest |rollout - actor| log-prob accepted by the parity check
    log_prob_parity_every: int = 0  # iterations between parity checks (0: the first iteration only)
    bucket_mb: int = 512  # weight-sync bucket size (MiB)
    #: regenerations of a lost or aborted candidate (same sample id, seed and policy version)
    #: before its group is handled as incomplete (algo.partial_groups)
    max_retries: int = 2
    # sglang (GPU) settings
    tp: int = 1  # inference TP size
    #: inference expert-parallel size of a mixture-of-experts model (SGLang's ep_size): each
    #: inference group's rollout.tp GPUs hold 1/ep of every layer's experts; divides rollout.tp
    ep: int = 1
    mem_fraction_static: float = 0.6  # SGLang's share of GPU memory (weights + KV cache)
    enable_memory_saver: bool = True  # SGLang releases its KV cache and weights while the actor trains
    #: SGLang's enable_deterministic_inference: per-candidate seeds are honoured (and recorded in
    #: the experience) only with it; batch-invariant kernels make decoding slower
    deterministic_inference: bool = False
    #: prove that a weight update wrote every engine parameter (SGLang's weight checker: the
    #: parameters are reset to random values before the update and checksummed before and after;
    #: an unwritten one fails the load, naming it): first (the engine's first load) | every | never
    verify_engine_weights: str = "first"
    #: multi-turn agent rollouts (rollout.agent.env: "" = none)
    agent: AgentConfig = field(default_factory=AgentConfig)


@dataclass
class KLSettings:
    """The KL to the reference model: where it enters, its estimator and coefficient."""

    placement: str = "none"  # none | loss (GRPO, DeepSeekMath) | reward (PPO shaped reward)
    estimator: str = "k3"  # k1 | k2 | k3 (Schulman's estimators of KL(actor || reference))
    beta: float = 0.0  # KL coefficient (initial one when adaptive)
    adaptive: bool = False  # PPO: Ziegler et al. adaptive controller
    target: float = 6.0  # adaptive controller: target KL per sequence
    horizon: int = 10000  # adaptive controller: horizon (samples)


@dataclass
class DynamicSampling:
    """DAPO dynamic sampling (Yu et al. 2025): drop groups whose rewards all agree and sample
    more prompts on the same version until the batch is full, at most ``max_rounds`` rounds."""

    enabled: bool = False  # drop groups whose rewards all agree and sample more prompts
    max_rounds: int = 4  # most sampling rounds per iteration


@dataclass
class RolloutCorrectionSettings:
    """Correction of the rollout-vs-trainer log-prob mismatch (Yao et al. 2025), computed from
    the sealed actor and rollout log-probs; both off (null) by default."""

    token_is_cap: Optional[float] = None  # C of truncated importance sampling, >= 1 (null: no IS weights)
    seq_mask_threshold: Optional[float] = None  # drop a sample from the loss above this error (null: keep all)
    seq_mask_stat: str = "max_abs"  # max_abs | mean (|mean log-ratio| over the response)


@dataclass
class AlgoConfig:
    """The algorithm: advantage estimator, policy loss, KL, epochs and batch splits."""

    name: str = "grpo"  # grpo | ppo
    advantage: str = "grpo"  # grpo | dr_grpo | rloo | gae | reinforce_plus_plus
    gamma: float = 1.0  # discount (GAE)
    lam: float = 1.0  # GAE lambda
    zero_std_rule: str = "epsilon"  # epsilon | skip
    std_eps: float = 1.0e-6  # added to the group std (zero_std_rule=epsilon)
    whiten_advantages: bool = True  # GAE advantages whitened over the batch (PPO practice)
    policy_loss: str = "vanilla"  # vanilla | gspo
    clip_low: float = 0.2  # ratio clipped below at 1 - clip_low
    clip_high: float = 0.2  # ratio clipped above at 1 + clip_high (DAPO clip-higher)
    dual_clip: Optional[float] = 3.0  # c > 1 bounds negative-advantage losses by -c * A (null: off)
    agg_mode: str = "token-mean"  # token-mean | seq-mean-token-sum | seq-mean-token-mean | seq-mean-token-sum-norm
    entropy_coef: float = 0.0  # entropy bonus coefficient
    kl: KLSettings = field(default_factory=KLSettings)
    ppo_epochs: int = 1  # passes over each sealed batch
    num_mini_batches: int = 1  # optimizer steps per epoch (each over whole groups)
    #: rows per forward/backward in the update, per DP rank; 0 = the whole mini-batch at once
    micro_batch_size: int = 8
    #: rows per forward-only pass (old/reference log-probs, critic values); 0 = all at once
    forward_micro_batch_size: int = 16
    #: forward-only passes run each micro-batch's real tokens as one packed (THD) sequence; false = padded
    pack_sequences: bool = False
    dynamic_sampling: DynamicSampling = field(default_factory=DynamicSampling)
    partial_groups: str = "drop"  # drop | allow_partial
    min_partial_size: Optional[int] = None  # allow_partial: the smallest group kept
    rollout_correction: RolloutCorrectionSettings = field(default_factory=RolloutCorrectionSettings)
    #: MoE: none | measure | rollout.  measure: the engine returns each sample's experts (sealed in
    #: the experience record) and the old-log-prob forward reports how often the trainer's own
    #: routing differs; rollout: also replays them in every policy forward (old log-probs, update)
    routing_replay: str = "none"


@dataclass
class OptimSettings:
    """An optimizer and its learning-rate schedule (megatron's)."""

    optimizer: str = "adam"  # adam (AdamW) | sgd
    lr: float = 1.0e-6  # peak learning rate
    min_lr: float = 0.0  # learning rate at the end of the decay (<= lr)
    lr_warmup_steps: int = 0  # optimizer steps (ppo_epochs x num_mini_batches per iteration)
    lr_decay_style: str = "constant"  # constant | linear | cosine
    weight_decay: float = 0.0  # decoupled weight decay
    adam_beta1: float = 0.9  # Adam beta1
    adam_beta2: float = 0.999  # Adam beta2
    adam_eps: float = 1.0e-8  # Adam epsilon
    clip_grad: float = 1.0  # global grad-norm clip


@dataclass
class ActorConfig:
    """The trained policy: its optimizer."""

    optim: OptimSettings = field(default_factory=OptimSettings)
    offload: bool = False  # params/grads/optimizer to host while the rollout engine runs (GPU)
    #: mixture-of-experts models: the router's load-balancing loss coefficient (megatron's
    #: aux_loss, Switch-Transformer style); 0 = off, the RL default (it is a pre-training regulariser)
    moe_aux_loss_coeff: float = 0.0
    moe_z_loss_coeff: Optional[float] = None  # mixture-of-experts models: the router z-loss coefficient (ST-MoE); null = off


@dataclass
class ReferenceConfig:
    """The frozen reference policy for the KL."""

    enabled: bool = True  # a frozen reference model for the KL
    path: Optional[str] = None  # default: the actor's starting checkpoint
    refresh_every: int = 0  # 0: never; K: copy the actor into the reference every K iterations
    offload: bool = False  # on the host between its forwards (GPU)


@dataclass
class CriticConfig:
    """PPO's value model (``critic: {}`` for the defaults; null for GRPO)."""

    path: Optional[str] = None  # None: initialised from the actor's weights (value head zero)
    optim: OptimSettings = field(default_factory=lambda: OptimSettings(lr=1.0e-5))
    value_clip: Optional[float] = 0.2  # PPO value clipping around the old values (null: off)
    micro_batch_size: int = 8  # rows per critic forward/backward, per DP rank (0: the whole mini-batch at once)
    warmup_iters: int = 0  # critic-only updates before the actor starts moving
    offload: bool = False  # on the host while the rollout engine runs (GPU)


@dataclass
class RewardModelConfig:
    """A neural reward model, alone or next to a rule (reward.fn)."""

    path: Optional[str] = None  # an HF *ForTokenClassification (num_labels=1) checkpoint
    tokenizer: Optional[str] = None  # default: reward_model.path
    chat_template: Optional[str] = None  # a Jinja file for the RM's prompts (default: its tokenizer's)
    weight: float = 1.0  # weight of the RM score in a composite with reward.fn
    offload: bool = False  # on the host between its forwards (GPU time-slicing)


@dataclass
class RewardConfig:
    """How samples are scored: the function, its isolation, timeouts and failure policy."""

    fn: Optional[str] = "exact_numeric"  # builtin name or "pkg.mod:callable"; None = RM only
    kwargs: dict = field(default_factory=dict)  # keyword arguments of reward.fn
    components: list = field(default_factory=list)  # for fn=composite
    model: RewardModelConfig = field(default_factory=RewardModelConfig)
    timeout_s: Optional[float] = 30.0  # per-call timeout in seconds (null: none)
    max_retries: int = 2  # retries of a failed or timed-out call
    retry_backoff_s: float = 0.05  # sleep before a retry
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
    #: the ground-truth fields the reward reads (checked in every train / held-out row at
    #: start-up); null: what the reward function declares (megarl/rewards/declarations.py)
    required_fields: Optional[List[str]] = None


@dataclass
class EvalConfig:
    """Held-out evaluation during training (data.heldout_path) and python -m megarl.eval."""

    every: int = 5  # iterations between held-out evaluations (0: start and end only)
    n: int = 200  # held-out prompts per evaluation
    max_new_tokens: Optional[int] = None  # default: rollout.max_new_tokens
    #: accuracy = share of the *scored* held-out samples with reward >= this (a sample whose
    #: generation or scorer failed is counted in eval/scorer_failures, never as wrong)
    success_threshold: float = 1.0
    before_train: bool = True  # evaluate before the first update (with every=0: start and end only)
    save_results: bool = False  # per-row results of each evaluation to <run_dir>/eval/iter_<k>.jsonl
    #: python -m megarl.eval: samples per prompt for pass@k / maj@k (at ``temperature``; 1 = greedy only)
    samples_per_prompt: int = 1
    temperature: float = 1.0  # of the pass@k / maj@k samples (the greedy accuracy is always at 0)
    top_p: float = 1.0
    k: List[int] = field(default_factory=list)  # the k of pass@k / maj@k (default: 1 and samples_per_prompt)
    source_field: str = "source"  # per-source metrics when the rows carry this field
    seed: int = 0  # of the pass@k / maj@k samples (per-candidate seeds, as in training)


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
class WandbSettings:
    """Weights & Biases (``trainer.loggers`` names ``wandb``; ``pip install -e ".[wandb]"``)."""

    project: str = "megarl"  # the wandb project
    entity: Optional[str] = None  # the wandb team or user (null: your default entity)
    mode: Optional[str] = None  # online | offline; null: wandb's own default (WANDB_MODE, else online)
    tags: List[str] = field(default_factory=list)  # tags of the wandb run
    group: Optional[str] = None  # the wandb run group (null: none)


@dataclass
class MlflowSettings:
    """MLflow (``trainer.loggers`` names ``mlflow``; ``pip install -e ".[mlflow]"``)."""

    tracking_uri: Optional[str] = None  # the mlflow store or server (null: a file store in <run_dir>/mlruns)
    experiment: Optional[str] = None  # the mlflow experiment (null: the recipe's name)


@dataclass
class TrainerConfig:
    """The run: iterations, batch size, run directory, logging, checkpoints, resume, recovery."""

    iterations: int = 10  # training iterations (rollout + update each)
    prompts_per_iteration: int = 8  # B
    seed: int = 1234  # of the prompt order, sampling and init
    run_dir: Optional[str] = None  # default runs/<recipe>-<timestamp>
    run_id: Optional[str] = None  # default: the run_dir's name
    export_every: int = 0  # 0: only iter_0 and the end
    save_experience: bool = False  # audit trail: every sealed batch with its manifest
    #: where metrics go: jsonl (<run_dir>/metrics.jsonl, the source of truth, always on even if
    #: not listed) | tensorboard | wandb | mlflow (see megarl/trackers.py)
    loggers: List[str] = field(default_factory=lambda: ["jsonl", "tensorboard"])
    wandb: WandbSettings = field(default_factory=WandbSettings)
    mlflow: MlflowSettings = field(default_factory=MlflowSettings)
    #: a table of trainer.log_samples_n samples of the sealed batch every this many iterations
    #: (iterations 0, K, 2K, ...) to <run_dir>/samples.jsonl and every tracker with tables; 0 = off
    log_samples_every: int = 10
    log_samples_n: int = 4  # rows per sample table
    log_samples_console: int = 2  # of those rows, how many are printed (one short line each)
    deterministic: bool = True  # torch deterministic algorithms
    max_wall_minutes: Optional[float] = None  # stop (with an export) after this much wall time
    checkpoint_every: int = 0  # iterations between training-position checkpoints (0: only on SIGTERM/SIGUSR1)
    checkpoint_keep: int = 3  # how many published checkpoints to keep
    #: auto: continue from <run_dir>/checkpoints/latest if there is one (a finished run: nothing to do;
    #: metrics but no checkpoint: refused) | never: start at iteration 0 (an interrupted attempt without
    #: checkpoints is moved to <run_dir>/attempt-<time>/; a finished or checkpointed run dir is refused)
    resume: str = "auto"
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
    max_update_retries: int = 2  # on_update_failure=retry: attempts per batch
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
    #: split placement drill: the rollout rank kills itself (SIGKILL) while it receives the
    #: weights of this optimizer step (the trainer must name it lost within placement.timeout_s)
    kill_rollout_at_load: Optional[int] = None
    #: split placement drill: a straggling rollout rank, sleeping this long after every
    #: generation segment (async_rl.segment_tokens), so versions change mid-response
    rollout_segment_delay_s: float = 0.0
    #: stop drill: after iteration k's metrics row is written (before its stop check and its
    #: checkpoint) the run holds -- rank 0 prints "faults: holding after iteration k" -- until a
    #: stop is asked for (SIGTERM, SIGUSR1, <run_dir>/STOP) or it is killed, so a test's stop or
    #: kill lands at a known point however fast or busy the machine is
    hold_after_iteration: List[int] = field(default_factory=list)


@dataclass
class PlacementConfig:
    """Where generation runs.  ``hybrid``: every rank trains and generates, time-sliced (one GPU
    pool).  ``split``: the last ``rollout_ranks`` ranks of the torchrun world only generate (each
    an engine of its own), the others only train; weights go to the rollout side over a dedicated
    process group, requests and results over a control channel, every wait bounded by
    ``timeout_s``."""

    mode: str = "hybrid"  # hybrid | split
    rollout_ranks: int = 1  # split: ranks of the world that run rollout engines (the last ones)
    #: split: seconds a side waits for the other (a reply, a weight transfer, a heartbeat) before
    #: it names the other side lost and stops; a killed process is detected within this bound
    timeout_s: float = 120.0


@dataclass
class AsyncConfig:
    """Asynchronous RL with a hard staleness bound (``placement.mode=split``).  Generation runs
    ahead of training by up to ``max_staleness`` optimizer steps: every policy token trained at
    step s was generated by a version of step >= s - max_staleness (checked per token before
    sealing).  0 is the synchronous loop."""

    max_staleness: int = 0  # eta, in optimizer steps (0: synchronous)
    #: off-policy correction, required when max_staleness > 0 (the old log-probs are the
    #: proximal policy, recomputed by the actor before the update; the rollout's are the
    #: behaviour policy):  decoupled (AReaL's decoupled PPO: behaviour weight exp(old - rollout),
    #: capped at is_cap when set) | tis (the same weight, truncated at is_cap) | mask (drop a
    #: sample whose mean |old - rollout| exceeds mask_threshold)
    correction: Optional[str] = None
    is_cap: Optional[float] = 2.0  # cap of the behaviour weight (tis: required; decoupled: null = uncapped)
    mask_threshold: float = 0.5  # correction=mask: the largest mean |log-ratio| of a trained sample
    #: in-flight weight updates: the rollout ranks generate this many new tokens at a time and,
    #: between segments, activate a version published meanwhile; the rest of a response is then
    #: generated by the newer weights after re-prefilling its tokens so far (KV recomputed), each
    #: token keeping the version that sampled it.  0: whole responses, one version each
    segment_tokens: int = 0


@dataclass
class TrainConfig:
    recipe: str = "custom"  # the recipe's name (default: the YAML file's); names the default run dir
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
    placement: PlacementConfig = field(default_factory=PlacementConfig)
    #: ``async`` is a Python keyword, so the section is ``async_rl``
    async_rl: AsyncConfig = field(default_factory=AsyncConfig)


# ---- loading ---------------------------------------------------------------------------------


def _closest_key(key: str) -> str:
    """`` (did you mean X?)`` for the schema key nearest to a mistyped one, or ``""``."""
    import difflib

    from megarl.config_help import schema_keys

    close = difflib.get_close_matches(key, schema_keys(), n=1, cutoff=0.6)
    if close:
        return f" (did you mean {close[0]}?)"
    if "." not in key:  # a top-level key: name the sections (python -m megarl.train --help lists their keys)
        return f" (the top level holds: {', '.join(f.name for f in dataclasses.fields(TrainConfig))})"
    return ""


def _omegaconf_error(e: Exception, where: str, key: Optional[str] = None) -> ConfigError:
    """omegaconf's exception as one line that blames ``where`` (the recipe file, or the one
    override that caused it) and names the key in the schema's words."""
    from omegaconf.errors import ConfigKeyError

    key = getattr(e, "full_key", None) or getattr(e, "key", None) or key
    msg = (getattr(e, "msg", None) or str(e)).strip().splitlines()[0]
    if isinstance(e, ConfigKeyError) and key:
        return ConfigError(f"{where}: unknown key {key}{_closest_key(str(key))}")
    if "is not a ListConfig" in msg and key:
        value = getattr(e, "value", None)
        example = value if isinstance(value, (int, float, str)) and not isinstance(value, bool) else 3
        return ConfigError(f"{where}: {key} expects a list, e.g. {key}=[{example}]")
    if "is not a subclass of" in msg and key:  # a scalar given for a whole section
        return ConfigError(f"{where}: {key} is a section; set its keys ({key}.<key>=...), not a value")
    return ConfigError(f"{where}: {key}: {msg}" if key else f"{where}: {msg}")


def merge_config(path: Optional[str], overrides: list[str] = ()):
    """The recipe and the overrides merged onto the schema: an omegaconf ``DictConfig``, not yet
    resolved (``--print-config`` shows it; :func:`load_config` turns it into a
    :class:`TrainConfig`).  A bad recipe is blamed on its file, a bad override on the override."""
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    schema = OmegaConf.structured(TrainConfig)
    merged = schema
    if path is not None:
        if not os.path.isfile(path):
            raise ConfigError(f"--config {path}: file not found")
        try:
            recipe = OmegaConf.load(path)
        except Exception as e:  # yaml syntax
            raise ConfigError(f"{path}: not a valid YAML recipe ({str(e).splitlines()[0]})") from None
        try:
            if recipe.get("critic") is not None:
                # an Optional[dataclass] node merges only onto a structured default
                schema.critic = OmegaConf.structured(CriticConfig)
            merged = OmegaConf.merge(schema, recipe)
        except OmegaConfBaseException as e:
            raise _omegaconf_error(e, path) from None
    for ov in overrides:
        if "=" not in ov:
            raise ConfigError(f"override {ov!r}: expected key=value")
        key = ov.split("=", 1)[0]
        try:
            if ov.startswith("critic.") and merged.critic is None:
                merged.critic = OmegaConf.structured(CriticConfig)
            merged = OmegaConf.merge(merged, OmegaConf.from_dotlist([ov]))
        except OmegaConfBaseException as e:
            raise _omegaconf_error(e, f"override {ov!r}", key=key) from None
    return merged


def load_config(path: Optional[str], overrides: list[str] = ()) -> TrainConfig:
    """YAML recipe + dotlist overrides merged onto the schema; a typed :class:`TrainConfig`.

    Unknown keys, wrong types and missing required keys raise :class:`ConfigError` naming the
    key (and, for a typo, the closest key).  Relative paths in the recipe stay relative to the
    working directory (like every CLI).
    """
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    merged = merge_config(path, overrides)
    missing = sorted(OmegaConf.missing_keys(merged))
    if missing:
        raise ConfigError(f"{path or 'config'}: required key(s) not set: {', '.join(missing)} "
                          f"(set {'them' if len(missing) > 1 else 'it'} in the recipe or as key=value)")
    try:
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


def _validate_trackers(cfg: TrainConfig) -> None:
    """trainer.loggers names known trackers whose packages are installed (found, not imported:
    wandb and mlflow are imported only by a run that logs to them), and the sample-table keys."""
    import importlib.util

    from megarl.trackers import TRACKER_PACKAGES

    t = cfg.trainer
    for name in t.loggers:
        _choice(name, "trainer.loggers", tuple(TRACKER_PACKAGES))
    dup = sorted({n for n in t.loggers if list(t.loggers).count(n) > 1})
    _need(not dup, "trainer.loggers", f"lists {dup[0] if dup else ''!r} more than once")
    for name in t.loggers:
        module, install = TRACKER_PACKAGES[name]
        _need(module is None or importlib.util.find_spec(module) is not None, "trainer.loggers",
              f"names {name!r}, but the {module} package is not installed: {install}")
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
    _choice(cfg.data.on_missing_fields, "data.on_missing_fields", ("error", "skip"))
    if cfg.reward.required_fields is not None:
        from megarl.rewards.declarations import normalise_requirements
        from megarl.rewards.base import RewardConfigError

        try:
            normalise_requirements(list(cfg.reward.required_fields), "reward.required_fields")
        except RewardConfigError as err:
            raise ConfigError(str(err)) from None
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
    """Every numeric key within its range (the table in :mod:`megarl.config_ranges`), and the
    bounds that pair two keys."""
    from megarl.config_ranges import range_errors

    for key, msg in range_errors(cfg):
        raise ConfigError(f"{key}: {msg}")
    for key, o in (("actor.optim", cfg.actor.optim),) + ((("critic.optim", cfg.critic.optim),) if cfg.critic else ()):
        _need(o.min_lr <= o.lr, f"{key}.min_lr",
              f"{o.min_lr} is above {key}.lr={o.lr} (the schedule decays lr to min_lr)")
    for k, v in cfg.reward.penalty.items():
        _need(not isinstance(v, float) or math.isfinite(v), f"reward.penalty.{k}", f"must be finite or null, got {v}")
    d = cfg.data
    _need(d.arithmetic_min_digits <= d.arithmetic_max_digits, "data.arithmetic_min_digits",
          f"{d.arithmetic_min_digits} is above data.arithmetic_max_digits={d.arithmetic_max_digits}")
    tiny = cfg.model.tiny
    _choice(tiny.family, "model.tiny.family", TINY_FAMILIES)
    _choice(tiny.warmstart_validation, "model.tiny.warmstart_validation", TINY_VALIDATIONS)
    _need(tiny.family == "llama" or tiny.top_k <= tiny.num_experts, "model.tiny.top_k",
          f"{tiny.top_k} is above model.tiny.num_experts={tiny.num_experts}")
    _need(tiny.tool_min_digits <= tiny.tool_max_digits, "model.tiny.tool_min_digits",
          f"{tiny.tool_min_digits} is above model.tiny.tool_max_digits={tiny.tool_max_digits}")
    _need(not (tiny.two_turn_demos and tiny.tool_demos), "model.tiny.two_turn_demos",
          f"is {tiny.two_turn_demos}, but model.tiny.tool_demos={tiny.tool_demos} builds the calculator's model")
    tool_target = tiny.tool_demos > 0 and bool(tiny.warmstart_target_accuracy)
    _need(not tool_target or 4 <= tiny.tool_only_steps <= tiny.warmstart_steps, "model.tiny.tool_only_steps",
          f"is {tiny.tool_only_steps}: with model.tiny.warmstart_target_accuracy the calculator build's onset phase "
          f"stops on it, so it must be between 4 (one validation check) and model.tiny.warmstart_steps="
          f"{tiny.warmstart_steps} (the tail takes the difference)")
    _need(not tool_target or tiny.tool_mixture_steps <= tiny.warmstart_steps - tiny.tool_only_steps,
          "model.tiny.tool_mixture_steps",
          f"is {tiny.tool_mixture_steps}, above the tail of model.tiny.warmstart_steps - model.tiny.tool_only_steps = "
          f"{tiny.warmstart_steps - tiny.tool_only_steps} steps it ends")
    _need(bool(tiny.tool_role) and tiny.tool_role != "assistant", "model.tiny.tool_role",
          f"must be a role name other than 'assistant', got {tiny.tool_role!r}")


def _validate_rollout_groups(cfg: TrainConfig, world_size: int) -> None:
    """SGLang inference groups of rollout.tp consecutive ranks must tile the world."""
    r = cfg.rollout
    _need(r.backend != "sglang" or world_size % r.tp == 0, "rollout.tp",
          f"{r.tp} does not divide the world size {world_size} (inference groups of rollout.tp GPUs tile the world)")
    _need(r.ep == 1 or (r.backend == "sglang" and r.tp % r.ep == 0), "rollout.ep",
          f"{r.ep} needs rollout.backend=sglang with rollout.ep dividing rollout.tp={r.tp} (SGLang splits each "
          "inference group's TP ranks into expert-parallel ones)")


def validate_agent_settings(cfg: TrainConfig) -> None:
    """``rollout.agent``: the environment loads with its arguments (a misspelt argument or an
    unimportable plug-in fails here, naming the key), and an agent has a chat template to render
    the environment's messages with."""
    ag = cfg.rollout.agent
    _need(isinstance(ag.env_args, dict) and all(isinstance(k, str) for k in ag.env_args), "rollout.agent.env_args",
          f"must be a mapping of argument names to values, got {ag.env_args!r}")
    if not ag.env:
        _need(not ag.env_args, "rollout.agent.env_args",
              f"is set ({sorted(ag.env_args)}) but rollout.agent.env is empty (no agent)")
        return
    from megarl.envs.protocol import EnvConfigError, load_environment

    try:
        load_environment(ag.env, **ag.env_args)
    except EnvConfigError as e:
        raise ConfigError(str(e)) from None
    _need(cfg.data.apply_chat_template, "data.apply_chat_template",
          f"is false, but rollout.agent.env={ag.env!r} renders the environment's messages with the chat template "
          "(the prompt must be templated by the same one)")
    # an agent's episode is scored by its environment's reward components; what would score the
    # token list as one response (a rule on the decoded text, a reward model, the overlong
    # punishment over environment tokens too) is refused rather than silently mixed in
    rw = cfg.reward
    _need(rw.fn is None, "reward.fn", f"is {rw.fn!r}, but rollout.agent.env={ag.env!r} scores each episode by the "
          "environment's reward components; set reward.fn: null")
    _need(rw.model.path is None, "reward.model.path",
          f"is set, but rollout.agent.env={ag.env!r} scores each episode by the environment; unset it")
    _need(rw.overlong_buffer is None, "reward.overlong_buffer",
          f"is set, but rollout.agent.env={ag.env!r} budgets episodes with rollout.agent.max_total_tokens; unset it")
    _need(cfg.algo.routing_replay == "none", "algo.routing_replay",
          f"is {cfg.algo.routing_replay!r}, but routing replay of multi-turn agent trajectories is not supported "
          "(each turn's routing would have to be joined); set algo.routing_replay: none")


PLACEMENTS = ("hybrid", "split")
ASYNC_CORRECTIONS = ("decoupled", "tis", "mask")


def trainer_world_size(cfg: TrainConfig, world_size: int) -> int:
    """The ranks that train: the whole world in hybrid placement, all but the rollout ranks in split."""
    return world_size - cfg.placement.rollout_ranks if cfg.placement.mode == "split" else world_size


def _validate_placement(cfg: TrainConfig, world_size: int) -> None:
    """``placement`` and ``async_rl``: the split of the world, and the staleness bound's required
    off-policy correction."""
    pl, an, r = cfg.placement, cfg.async_rl, cfg.rollout
    _choice(pl.mode, "placement.mode", PLACEMENTS)
    if pl.mode == "split":
        _need(world_size > pl.rollout_ranks, "placement.rollout_ranks",
              f"{pl.rollout_ranks} leaves no trainer rank in a world of {world_size} (torchrun --nproc-per-node "
              f"must be at least {pl.rollout_ranks + 1})")
        _need(r.backend == "hf" or r.tp == 1, "rollout.tp",
              f"is {r.tp}: in split placement every rollout rank runs its own engine (rollout.tp=1)")
        _need(not r.enable_memory_saver or r.backend == "hf", "rollout.enable_memory_saver",
              "time-slices one GPU pool; split placement gives the engines their own devices (set it to false)")
    if an.max_staleness > 0:
        _need(pl.mode == "split", "async_rl.max_staleness",
              f"is {an.max_staleness}, which needs placement.mode=split (generation runs ahead on the rollout "
              "ranks; partial rollouts in hybrid placement are not built)")
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
        _need(pl.mode == "split", "async_rl.segment_tokens",
              "applies versions published while the rollout ranks generate, which needs placement.mode=split")
        _need(cfg.algo.routing_replay == "none", "algo.routing_replay",
              "records routing per response; responses generated in segments (async_rl.segment_tokens) have none")
        _need(not r.agent.env, "rollout.agent.env", "agent turns are not generated in segments (async_rl.segment_tokens)")
    _need(not cfg.faults.rollout_segment_delay_s or an.segment_tokens, "faults.rollout_segment_delay_s",
          "delays generation segments, which needs async_rl.segment_tokens > 0")
    if an.correction is not None:
        _choice(an.correction, "async_rl.correction", ASYNC_CORRECTIONS)
        if an.correction == "tis":
            _need(an.is_cap is not None, "async_rl.is_cap", "must be set (>= 1) with async_rl.correction=tis")


def validate(cfg: TrainConfig, world_size: int) -> int:
    """Check everything a type cannot; return the data-parallel size.  Reads no model weights."""
    from megarl.algo.aggregation import AGG_MODES
    from megarl.algo.kl import KL_ESTIMATORS
    from megarl.algo.registry import advantage_names, advantage_needs, policy_loss_names

    import megarl.algo.advantages  # noqa: F401  (registers the estimators)
    import megarl.algo.policy_loss  # noqa: F401

    _validate_ranges(cfg)
    _validate_placement(cfg, world_size)
    world_size = trainer_world_size(cfg, world_size)
    _validate_rollout_groups(cfg, world_size)
    validate_agent_settings(cfg)
    a, r, t, p = cfg.algo, cfg.rollout, cfg.trainer, cfg.parallel
    _choice(a.name, "algo.name", ALGORITHMS)
    _choice(a.advantage, "algo.advantage", advantage_names())
    _choice(a.policy_loss, "algo.policy_loss", policy_loss_names())
    _choice(a.agg_mode, "algo.agg_mode", AGG_MODES)
    _choice(a.zero_std_rule, "algo.zero_std_rule", ("epsilon", "skip"))
    _choice(a.kl.placement, "algo.kl.placement", ("none", "loss", "reward"))
    _choice(a.kl.estimator, "algo.kl.estimator", KL_ESTIMATORS)
    _choice(a.partial_groups, "algo.partial_groups", ("drop", "allow_partial"))
    _choice(a.routing_replay, "algo.routing_replay", ROUTING_REPLAY)
    _choice(r.backend, "rollout.backend", ("hf", "sglang"))
    _choice(r.verify_engine_weights, "rollout.verify_engine_weights", ("first", "every", "never"))
    _choice(cfg.reward.on_failure, "reward.on_failure", ("drop", "quarantine"))
    validate_eval_settings(cfg)
    _validate_reward_isolation(cfg)
    _validate_trackers(cfg)
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
        _need(cfg.reward.fn is not None or bool(r.agent.env), "reward.fn",
              "is null and no reward_model.path is given: nothing scores the samples")
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
    _need(p.ep >= 1, "parallel.ep", f"must be >= 1, got {p.ep}")
    _need(p.etp is None or p.etp >= 1, "parallel.etp", f"must be >= 1 or null, got {p.etp}")
    etp = p.tp if p.etp is None else p.etp
    _need(world_size % (etp * p.ep * p.pp) == 0, "parallel.ep",
          f"etp x ep x pp = {etp} x {p.ep} x {p.pp} does not divide the world size {world_size} "
          "(megatron takes the expert-parallel ranks from the data-parallel ones)")
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
        # megatron's allgather token dispatcher all-gathers equal token counts over the EP group;
        # each rank's packed sequence has its own
        _need(p.ep == 1, "algo.pack_sequences",
              f"is true with parallel.ep={p.ep}: packed sequences have a different token count on each "
              "expert-parallel rank, which the MoE token dispatcher cannot gather; set algo.pack_sequences=false")
    mini = t.prompts_per_iteration * r.n // a.num_mini_batches
    _need(a.micro_batch_size == 0 or mini % (dp * a.micro_batch_size) == 0, "algo.micro_batch_size",
          f"a mini-batch of {t.prompts_per_iteration} prompts x {r.n} samples / {a.num_mini_batches} = {mini} "
          f"is not divisible by dp x micro_batch_size = {dp} x {a.micro_batch_size}")
    if cfg.critic is not None:
        cm = cfg.critic.micro_batch_size
        _need(cm == 0 or mini % (dp * cm) == 0, "critic.micro_batch_size",
              f"a mini-batch of {mini} samples is not divisible by dp x critic.micro_batch_size = "
              f"{dp} x {cfg.critic.micro_batch_size}")
    return dp


def missing_packages(cfg: TrainConfig) -> list:
    """``(key, message)`` for each optional package the config needs that is not installed here
    (found, not imported).  A real start raises the first (:func:`require_installed`); a dry run
    simulating another machine reports them as not checked here."""
    import importlib.util

    out = []
    if cfg.rollout.backend == "sglang" and importlib.util.find_spec("sglang") is None:
        out.append(("rollout.backend", "'sglang' is not installed here; install the GPU extra: "
                                       'pip install -e ".[gpu]" (or use the Dockerfile)'))
    return out


def require_installed(cfg: TrainConfig) -> None:
    for key, msg in missing_packages(cfg):
        raise ConfigError(f"{key}: {msg}")


def validate_model_fit(cfg: TrainConfig, spec, where: str) -> None:
    """Heads / KV heads / FFN / layers / vocab padding against TP and PP, experts against EP and
    expert TP (config.json only)."""
    from megarl.models.hf_config import ExpertFitError, ModelConfigError, check_expert_fit, check_parallel_fit

    p = cfg.parallel
    try:
        check_parallel_fit(spec, p.tp, p.pp, where=where, experts=False)
    except ModelConfigError as e:
        raise ConfigError(f"parallel.tp/parallel.pp: {e}") from None
    try:
        check_expert_fit(spec, p.tp, p.ep, p.etp, where=where)
    except ExpertFitError as e:
        raise ConfigError(f"parallel.{e.size}: {e}") from None
    # megatron-core's MoELayer refuses to train at TP > 1 without sequence parallelism, which
    # megarl does not enable: refused here instead of in the first update
    _need(getattr(spec, "moe", None) is None or p.tp == 1, "parallel.tp",
          f"={p.tp} with the mixture-of-experts model {where}: megatron-core trains MoE layers at tp > 1 only "
          "with sequence parallelism, which megarl does not enable yet; use parallel.tp=1 with parallel.ep")
    _need(cfg.model.vocab_multiple % p.tp == 0, "model.vocab_multiple",
          f"{cfg.model.vocab_multiple} is not divisible by parallel.tp={p.tp} (the padded vocabulary is split over TP)")
    experts = moe_num_experts(spec)
    _need(cfg.rollout.ep == 1 or (experts is not None and experts % cfg.rollout.ep == 0), "rollout.ep",
          f"{cfg.rollout.ep} must divide the number of routed experts of {where} "
          f"({experts if experts is not None else f'none: {spec.architecture} is dense'})")
    for key in ("moe_aux_loss_coeff", "moe_z_loss_coeff"):
        _need(getattr(cfg.actor, key) in (None, 0.0) or moe_num_experts(spec) is not None, f"actor.{key}",
              f"is {getattr(cfg.actor, key)}, but {where} describes a dense model ({spec.architecture}: no router "
              f"to regularise); use actor.{key}={'null' if key == 'moe_z_loss_coeff' else '0'}")
    if cfg.algo.routing_replay != "none":
        _need(moe_num_experts(spec) is not None, "algo.routing_replay",
              f"is {cfg.algo.routing_replay!r}, but {where} describes a dense model "
              f"({spec.architecture}: no routed experts); use algo.routing_replay=none")


def moe_num_experts(spec) -> Optional[int]:
    """The number of routed experts of an MoE model spec, None for a dense one (the spec's
    ``moe.num_experts`` when it has one, else config.json's ``num_experts`` / ``num_local_experts``
    / ``n_routed_experts``)."""
    moe = getattr(spec, "moe", None)
    n = getattr(moe, "num_experts", None)
    if n is None:
        raw = getattr(spec, "raw_config", None) or {}
        for key in ("num_experts", "num_local_experts", "n_routed_experts"):
            if raw.get(key):
                n = raw[key]
                break
    return int(n) if n else None
