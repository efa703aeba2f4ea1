"""The training config's schema: one dataclass per section, with every key's type, default and
comment (``python -m megarl.train --help`` lists them from here: :mod:`megarl.config.help`).

The schema imports no feature of megarl: what a key may name (an algorithm, a reward, a tracker)
is checked by :mod:`megarl.config.validation`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional

ALGORITHMS = ("grpo", "ppo")
ROUTING_REPLAY = ("none", "measure", "rollout")
TINY_FAMILIES = ("llama", "qwen3_moe")  # what megarl.tinymodel builds (its FAMILIES)
TINY_VALIDATIONS = ("heldout", "train-mix")  # where its early stop is measured (its VALIDATIONS)
TINY_TASKS = ("arithmetic", "running_sum")  # the built-in tasks a tiny model is warm-started on


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
    #: the built-in task the model is warm-started on: arithmetic (megarl.tinymodel: every
    #: setting above) | running_sum (the long-tail reasoning task, megarl.builtin.warmstart_running_sum:
    #: a dense llama, warmstart_validation / tool_* / two_turn_* unused, its early stop checked
    #: every 20 steps on 256 held-out problems outside the evaluation set; the task's data.running_sum_*)
    task: str = "arithmetic"


@dataclass
class ModelConfig:
    """The policy model: where it is, its tokenizer and chat template."""

    path: str = "???"  # an HF checkpoint dir, a megarl megatron checkpoint dir, or a Hub id (megarl/data/hub.py)
    tokenizer: Optional[str] = None  # default: model.path (a directory or a Hub id)
    #: the Hub revision (branch, tag or commit) of model.path / model.tokenizer when they are Hub ids
    revision: Optional[str] = None
    chat_template: Optional[str] = None  # a file with a Jinja template; default: the tokenizer's
    build_tiny: bool = False  # build the built-in tiny model at model.path if it is missing
    tiny: TinyModelConfig = field(default_factory=TinyModelConfig)
    vocab_multiple: int = 128  # pad the vocabulary to a multiple of this (divisible by parallel.tp)


#: what megatron-core 0.16 recomputes selectively (TransformerConfig.recompute_modules)
RECOMPUTE_MODULES = ("core_attn", "moe_act", "layernorm", "mla_up_proj", "mlp", "moe", "shared_experts")


@dataclass
class RecomputeSettings:
    """Activation recomputation of the trained models (actor, critic), megatron's own: the
    activations of recomputed parts are not kept for the backward but computed again in it."""

    granularity: Optional[str] = None  # null: keep every activation; full: whole layers; selective: named modules
    method: str = "uniform"  # full: uniform (every layer, in chunks of num_layers) or block (num_layers per stage)
    num_layers: int = 1  # full: the layers of one recomputed chunk (uniform), or recomputed per stage (block)
    #: selective: the parts recomputed (core_attn, moe_act, layernorm, mla_up_proj, mlp, moe, shared_experts)
    modules: List[str] = field(default_factory=lambda: ["core_attn"])


@dataclass
class ParallelConfig:
    """Megatron model parallelism of the trained and frozen roles (dp = world / (tp x pp x cp))."""

    tp: int = 1  # tensor-parallel size of the actor, reference, critic and reward model
    pp: int = 1  # pipeline-parallel size; tp x pp x cp x dp = the number of processes
    #: virtual pipeline stages per PP rank (interleaved 1F1B): each rank holds vpp chunks of
    #: num_layers / (pp x vpp) layers, which shrinks the pipeline bubble by vpp; needs pp > 1.
    #: Micro-batch counts are filled to a multiple of pp (the filler carries no loss).  Not yet
    #: with MoE routing replay
    vpp: int = 1
    #: context-parallel size: each sequence split over cp ranks along its length (zig-zag, 2 x cp
    #: chunks; sequences padded to a multiple of 2 x cp, times tp with sequence parallelism);
    #: attention and activation memory per rank / cp; packed sequences split one by one.  Not yet
    #: with MoE routing replay or the router's losses
    cp: int = 1
    #: expert-parallel size of a mixture-of-experts model: each layer's experts are spread over ep
    #: ranks taken from the data-parallel ones (ep divides the number of experts and world / (etp x pp))
    ep: int = 1
    etp: Optional[int] = None  # expert tensor-parallel size (null: parallel.tp)
    #: megatron's sequence parallelism at tp > 1: norms and the residual stream hold 1/tp of the
    #: sequence on each TP rank (activation memory / tp there); needed to train an MoE model at
    #: tp > 1.  Sequences are padded to a multiple of tp.  No effect at tp = 1.
    sequence_parallel: bool = False
    #: start each gradient bucket's data-parallel all-reduce (reduce-scatter with the distributed
    #: optimizer) during the last micro-batch's backward, overlapping it (megatron DDP); the
    #: gradients are the same sums either way
    overlap_grad_reduce: bool = False
    #: megatron's distributed optimizer (ZeRO-1): each DP rank holds 1/dp of the optimizer state
    #: (and of the fp32 main weights of a 16-bit model); null: on CUDA yes, on CPU no
    distributed_optimizer: Optional[bool] = None
    #: seconds a rank's heartbeat (in the job's store) may stand still before the others declare it
    #: lost, say which rank on which host, and exit (status 75) for the job to restart from its last
    #: checkpoint, rather than wait out the process group's 30 minutes (megarl/runtime/liveness.py);
    #: null: no watch.  Hybrid placement; split placement has placement.timeout_s
    peer_timeout_s: Optional[float] = 300.0
    recompute: RecomputeSettings = field(default_factory=RecomputeSettings)


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
    #: build the built-in running-sum task files (the long-tail reasoning task,
    #: megarl/data/tasks/running_sum.py) at these paths if they are missing
    build_running_sum: bool = False
    running_sum_train_n: int = 20000  # problems in its train split
    running_sum_heldout_n: int = 200  # distinct problems in its held-out split (the evaluation set)
    running_sum_min_terms: int = 2  # fewest terms of a problem (one worked step each)
    running_sum_max_terms: int = 26  # most terms (26 tags: a-z)
    running_sum_alpha: float = 1.8  # P(k terms) ~ k^-alpha: the tail of chain lengths
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
    #: hf backend: a finished response leaves the decode batch and its KV cache at once, so a
    #: batch costs what its live rows cost, not its longest response times its size (the same
    #: candidates; megarl/rollout/hf_retiring.py).  SGLang batches continuously by itself.  Not with
    #: MoE routing capture (algo.routing_replay)
    retire_finished: bool = False
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
    #: a token budget per micro-batch, per DP rank (0: off).  The update (actor and critic) and the
    #: forward-only passes then pack rows first-fit into micro-batches of at most this many real
    #: tokens (a longer row gets one of its own) instead of cutting micro_batch_size /
    #: forward_micro_batch_size rows; every DP rank runs as many micro-batches
    micro_batch_tokens: int = 0
    #: log-probs and entropy from the logits a chunk of this many positions at a time, with no fp32
    #: copy of the whole logits (megarl/models/chunked_logits.py); 0: the whole micro-batch at once
    log_prob_chunk: int = 0
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
    #: seconds the forward over one batch may take (the slowest rank's); past it every sample of
    #: the batch is status timeout, its late scores discarded (null: no limit)
    timeout_s: Optional[float] = None


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
    #: not listed) | tensorboard | wandb | mlflow (see megarl/observability/trackers.py)
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
    #: one device's peak FLOP/s in the training dtype (e.g. 989e12: an H100's dense bf16): the
    #: update's model FLOPs over this times its seconds and devices is update/mfu (null: not reported)
    peak_flops: Optional[float] = None
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
    reward_model_error_at: List[int] = field(default_factory=list)  # iterations whose RM forward raises
    #: iterations whose RM forward is held past reward.model.timeout_s (which must be set)
    reward_model_timeout_at: List[int] = field(default_factory=list)
    fail_optimizer_step_at: List[int] = field(default_factory=list)  # iterations whose update fails once
    fail_optimizer_step_rank: int = -1  # the rank that fails (-1: the last)
    fail_optimizer_step_kind: str = "exception"  # exception | nan (a non-finite loss on that rank)
    seed: int = 0  # of the fault draws (see megarl/runtime/faults.py)
    #: split placement drill: the rollout rank kills itself (SIGKILL) while it receives the
    #: weights of this optimizer step (the trainer must name it lost within placement.timeout_s)
    kill_rollout_at_load: Optional[int] = None
    #: split placement drill: a straggling rollout rank, sleeping this long after every
    #: generation segment (async_rl.segment_tokens), so versions change mid-response
    rollout_segment_delay_s: float = 0.0
    #: split placement drill: at the first segment boundary of each generation job the rollout
    #: rank waits, at most this long, for the trainer's next command, so a version the trainer
    #: publishes meanwhile is taken mid-response for certain, however fast the machine (0: off)
    rollout_segment_await_s: float = 0.0
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
    #: partial rollouts (hybrid placement, megarl/control/production_partial.py): an iteration
    #: trains on B groups that completed, generating segment_tokens tokens at a time until they
    #: have; unfinished ones carry over (eta >= 1: their tokens too, each keeping its version,
    #: a group trained within eta steps of its admission; eta 0: they start again, due next)
    partial_rollouts: bool = False
    #: over-sampling with partial_rollouts: groups kept open beyond the B an iteration trains
    #: (at most B)
    extra_groups: int = 0
    #: in-flight weight updates: the rollout ranks generate this many new tokens at a time and,
    #: between segments, activate a version published meanwhile; the rest of a response is then
    #: generated by the newer weights after re-prefilling its tokens so far (KV recomputed), each
    #: token keeping the version that sampled it.  Agent sessions (rollout.agent.env) take a version
    #: between turns instead (any value > 0).  With partial_rollouts (hybrid placement): the tokens
    #: generated between two checks of whether the iteration has its B complete groups.
    #: 0: whole responses, one version each
    segment_tokens: int = 0
    #: who computes the proximal (old) log-probs of an asynchronous batch on v, the version
    #: trained from:  actor (a forward of the megatron actor, the default) | engine (split
    #: placement: the rollout engine teacher-forces the batch on v while the trainer computes the
    #: reference and critic forwards; parity-checked against the actor's on the first iteration
    #: and every rollout.log_prob_parity_every, within rollout.log_prob_parity_tol)
    proximal_log_probs: str = "actor"


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
