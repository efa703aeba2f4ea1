"""The training config's schema: one dataclass per section, with every key's type, default and
comment (``python -m megarl.train --help`` lists them from here: :mod:`megarl.config.help`).

One place defines a key: its type and default here, and with them (:func:`setting`) its allowed
range (a :class:`Range`, for every int / float key) or its fixed set of choices.
:mod:`megarl.config.ranges` checks every range; :mod:`megarl.config.validation` checks the
choices, next to the checks that combine keys.

The schema imports no feature of megarl: what a key may name (an algorithm, a reward, a tracker)
is checked by :mod:`megarl.config.validation`.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, List, Optional, Tuple

ALGORITHMS = ("grpo", "ppo")
ROUTING_REPLAY = ("none", "measure", "rollout")
TINY_FAMILIES = ("llama", "qwen3_moe")  # what megarl.tinymodel builds (its FAMILIES)
PLACEMENTS = ("hybrid", "split")
ASYNC_CORRECTIONS = ("decoupled", "tis", "mask")


# ---- what a key accepts ---------------------------------------------------------------------


@dataclass(frozen=True)
class Range:
    """``lo`` / ``hi`` bounds (``None``: unbounded), open or closed; ``null``: ``None`` is
    allowed; ``also``: single values allowed outside the bounds (``rollout.top_k=-1``: off);
    ``each``: the key is a list and every item must be in range.

    Every value must also be finite (``nan`` / ``inf`` are refused everywhere; ``null`` is the
    way to say "no limit" where a key allows it)."""

    lo: Optional[float] = None
    hi: Optional[float] = None
    lo_open: bool = False
    hi_open: bool = False
    null: bool = False
    also: Tuple[float, ...] = ()
    each: bool = False

    def ok(self, v) -> bool:
        if v is None:
            return self.null
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            return False
        if v in self.also:
            return True
        if self.lo is not None and (v <= self.lo if self.lo_open else v < self.lo):
            return False
        if self.hi is not None and (v >= self.hi if self.hi_open else v > self.hi):
            return False
        return True

    def describe(self) -> str:
        """``in (0, 1]``, ``>= 0``, ``-1 or >= 1``, ``... or null``."""
        lo, hi = self.lo, self.hi
        if lo is not None and hi is not None:
            text = f"in {'(' if self.lo_open else '['}{lo:g}, {hi:g}{')' if self.hi_open else ']'}"
        elif lo is not None:
            text = f"{'>' if self.lo_open else '>='} {lo:g}"
        elif hi is not None:
            text = f"{'<' if self.hi_open else '<='} {hi:g}"
        else:
            text = "a finite number"
        text = " or ".join([f"{a:g}" for a in self.also] + [text])
        return text + (" or null" if self.null else "")


#: a count of things (>= 1), a count that may be zero (>= 0), a positive real, a seed, a rate
COUNT, COUNT0, POS, SEED = Range(lo=1), Range(lo=0), Range(lo=0, lo_open=True), Range(lo=0)
RATE = Range(lo=0, hi=1, hi_open=True)
ITERATIONS = Range(lo=0, each=True)  # lists of iteration indices


def setting(default: Any = dataclasses.MISSING, *, default_factory: Any = dataclasses.MISSING,
            range: Optional[Range] = None, choices: Optional[tuple] = None) -> Any:
    """A schema field with what it accepts: ``range`` (a numeric key) or ``choices`` (a key that
    is one of a fixed set; on a list key, each item), kept in the field's metadata."""
    metadata = {}
    if range is not None:
        metadata["range"] = range
    if choices is not None:
        metadata["choices"] = tuple(choices)
    return field(default=default, default_factory=default_factory, metadata=metadata)


def choices_of(section: type, name: str) -> tuple:
    """The choices the field ``name`` of the section dataclass ``section`` declares."""
    return next(f for f in dataclasses.fields(section) if f.name == name).metadata["choices"]


# ---- the schema ----------------------------------------------------------------------------


@dataclass
class TinyModelConfig:
    """How to build the built-in tiny model when ``model.path`` does not exist yet."""

    hidden_size: int = setting(128, range=COUNT)  # the built-in tiny Llama's width
    num_layers: int = setting(4, range=COUNT)  # its transformer layers
    num_heads: int = setting(4, range=COUNT)  # its attention heads
    num_kv_heads: int = setting(2, range=COUNT)  # its KV heads (GQA)
    intermediate_size: int = setting(256, range=COUNT)  # its SwiGLU width
    #: the most supervised warm-start steps on data.task (exactly this many when
    #: warmstart_target_accuracy is null)
    warmstart_steps: int = setting(2000, range=COUNT0)
    warmstart_lr: float = setting(2.0e-3, range=POS)  # the warm start's learning rate
    warmstart_batch: int = setting(64, range=COUNT)  # the warm start's batch size
    #: Adam's second-moment decay in the warm start (0.98 with batches of 128 brought the
    #: onset earlier on an AVX-512 Xeon; no recipe sets it yet: docs/tiny-model.md says why)
    warmstart_adam_beta2: float = setting(0.999, range=Range(lo=0, hi=1, hi_open=True))
    #: early-stop the warm start at the first check (every 4 steps; running_sum: 20) where its
    #: teacher-forced accuracy on 256 held-out problems outside the evaluation set reaches this;
    #: null: run warmstart_steps steps (docs/tiny-model.md says why a step count is a knife's edge)
    warmstart_target_accuracy: Optional[float] = setting(0.3, range=Range(lo=0, hi=1, lo_open=True, null=True))
    seed: int = setting(0, range=SEED)  # of its initialisation and warm-start data
    #: llama (the dense default) | qwen3_moe (a Qwen3-MoE: every layer routes each token to
    #: top_k of num_experts experts; intermediate_size unused)
    family: str = setting("llama", choices=TINY_FAMILIES)
    num_experts: int = setting(8, range=COUNT)  # qwen3_moe: routed experts per layer
    top_k: int = setting(2, range=COUNT)  # qwen3_moe: experts per token (<= num_experts)
    moe_intermediate_size: int = setting(128, range=COUNT)  # qwen3_moe: each expert's SwiGLU width


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
    #: pad the vocabulary to a multiple of this (divisible by parallel.tp)
    vocab_multiple: int = setting(128, range=COUNT)


#: what megatron-core 0.16 recomputes selectively (TransformerConfig.recompute_modules)
RECOMPUTE_MODULES = ("core_attn", "moe_act", "layernorm", "mla_up_proj", "mlp", "moe", "shared_experts")


@dataclass
class RecomputeSettings:
    """Activation recomputation of the trained models (actor, critic), megatron's own: the
    activations of recomputed parts are not kept for the backward but computed again in it."""

    #: null: keep every activation; full: whole layers; selective: named modules
    granularity: Optional[str] = setting(None, choices=(None, "full", "selective"))
    #: full: uniform (every layer, in chunks of num_layers) or block (num_layers per stage)
    method: str = setting("uniform", choices=("uniform", "block"))
    #: full: the layers of one recomputed chunk (uniform), or recomputed per stage (block)
    num_layers: int = setting(1, range=COUNT)
    #: selective: the parts recomputed (core_attn, moe_act, layernorm, mla_up_proj, mlp, moe, shared_experts)
    modules: List[str] = setting(default_factory=lambda: ["core_attn"], choices=RECOMPUTE_MODULES)


@dataclass
class ParallelConfig:
    """Megatron model parallelism of the trained and frozen roles (dp = world / (tp x pp x cp))."""

    tp: int = setting(1, range=COUNT)  # tensor-parallel size of the actor, reference, critic and reward model
    pp: int = setting(1, range=COUNT)  # pipeline-parallel size; tp x pp x cp x dp = the number of processes
    #: virtual pipeline stages per PP rank (interleaved 1F1B): each rank holds vpp chunks of
    #: num_layers / (pp x vpp) layers, which shrinks the pipeline bubble by vpp; needs pp > 1.
    #: Micro-batch counts are filled to a multiple of pp (the filler carries no loss).  Not yet
    #: with MoE routing replay
    vpp: int = setting(1, range=COUNT)
    #: an uneven pipeline split: the decoder layers of the first / last stage (null: an even share),
    #: the layers left split evenly over the other stages (megatron-core's
    #: num_layers_in_first/last_pipeline_stage; megarl/models/stages.py).  For a layer count no pp
    #: divides (DeepSeek-V3's 61 at pp 8: 7, 6 x 8, 6), or to lighten the stages that also hold the
    #: embedding and the output layer.  Needs pp > 1 and vpp = 1
    first_stage_layers: Optional[int] = setting(None, range=Range(lo=1, null=True))
    last_stage_layers: Optional[int] = setting(None, range=Range(lo=1, null=True))
    #: context-parallel size: each sequence split over cp ranks along its length (zig-zag, 2 x cp
    #: chunks; sequences padded to a multiple of 2 x cp, times tp with sequence parallelism);
    #: attention and activation memory per rank / cp; packed sequences split one by one.  Not yet
    #: with MoE routing replay or the router's losses
    cp: int = setting(1, range=COUNT)
    #: expert-parallel size of a mixture-of-experts model: each layer's experts are spread over ep
    #: ranks taken from the data-parallel ones (ep divides the number of experts and world / (etp x pp))
    ep: int = setting(1, range=COUNT)
    etp: Optional[int] = setting(None, range=Range(lo=1, null=True))  # expert tensor-parallel size (null: parallel.tp)
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
    peer_timeout_s: Optional[float] = setting(300.0, range=Range(lo=1, null=True))
    recompute: RecomputeSettings = field(default_factory=RecomputeSettings)


@dataclass
class TaskConfig:
    """The built-in task a recipe trains on: its files and its tiny model's warm start
    (megarl/builtin/tasks: one module per task, its own keys in ``args``)."""

    #: null (none) | arithmetic | calculator | two_turn | running_sum (megarl/builtin/tasks)
    name: Optional[str] = None
    #: write the task's files at data.train_path / data.heldout_path if they are missing (false:
    #: use those files as they are; the tiny model is still warm-started on this task)
    build: bool = True
    train_n: int = setting(20000, range=COUNT)  # problems in the train file
    heldout_n: int = setting(200, range=COUNT)  # distinct problems in the held-out file (the evaluation set)
    #: the task's own settings, by name (listed below, by task); keys not given take its defaults
    args: dict = field(default_factory=dict)


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
    max_prompt_tokens: int = setting(256, range=COUNT)  # longer prompts are dropped and counted, never cut
    shuffle: bool = True  # shuffle the prompt order (seeded by trainer.seed)
    task: TaskConfig = field(default_factory=lambda: TaskConfig())  # the built-in task (megarl/builtin/tasks)
    #: a train / held-out row without a ground-truth field the reward reads: error (refuse the
    #: file at start-up, naming file, line and field) | skip (drop such rows, counted)
    on_missing_fields: str = setting("error", choices=("error", "skip"))


@dataclass
class AgentConfig:
    """Multi-turn agent rollouts: the environment a trajectory talks to, and its limits."""

    #: the environment: "" (no agent: single-turn rollouts) | calculator | two_turn | "pkg.mod:Class"
    #: (a user environment, see megarl/envs/protocol.py)
    env: str = ""
    env_args: dict = field(default_factory=dict)  # keyword arguments of the environment's constructor
    #: policy turns per trajectory; reaching it ends it (finish reason max_turns)
    max_turns: int = setting(4, range=COUNT)
    #: tokens per trajectory after the prompt, policy and environment tokens together (finish reason length)
    max_total_tokens: int = setting(1024, range=COUNT)
    #: the limit of one environment call (reset or step), in seconds; an overrun is status timeout
    step_timeout_s: float = setting(10.0, range=POS)
    max_workers: int = setting(8, range=COUNT)  # environment calls run concurrently on this many threads


@dataclass
class RolloutConfig:
    """Generation: the engine, sampling parameters, samples per prompt, weight sync."""

    #: hf (transformers; CPU default) | sglang (GPU; on CPU: megarl/rollout/sglang_cpu)
    backend: str = setting("hf", choices=("hf", "sglang"))
    temperature: float = setting(1.0, range=POS)  # sampling temperature of training rollouts
    top_p: float = setting(1.0, range=Range(lo=0, hi=1, lo_open=True))  # nucleus sampling (1: off)
    top_k: int = setting(-1, range=Range(lo=1, also=(-1,)))  # top-k sampling (-1: off)
    max_new_tokens: int = setting(256, range=COUNT)  # response length limit (tokens)
    n: int = setting(1, range=COUNT)  # samples per prompt; the group size G for group estimators
    #: old log-probs from the rollout engine instead of an actor forward, accepted only after a
    #: measured token-by-token parity check against the actor on the first iteration (and again
    #: every ``log_prob_parity_every`` iterations; 0 = the first only), within ``log_prob_parity_tol``
    reuse_rollout_log_probs: bool = False
    #: largest |rollout - actor| log-prob accepted by the parity check
    log_prob_parity_tol: float = setting(1.0e-3, range=POS)
    #: iterations between parity checks (0: the first iteration only)
    log_prob_parity_every: int = setting(0, range=COUNT0)
    bucket_mb: int = setting(512, range=COUNT)  # weight-sync bucket size (MiB)
    #: hf backend: a finished response leaves the decode batch and its KV cache at once, so a
    #: batch costs what its live rows cost, not its longest response times its size (the same
    #: candidates; megarl/rollout/hf_retiring.py).  SGLang batches continuously by itself.  Not with
    #: MoE routing capture (algo.routing_replay)
    retire_finished: bool = False
    #: regenerations of a lost or aborted candidate (same sample id, seed and policy version)
    #: before its group is handled as incomplete (algo.partial_groups)
    max_retries: int = setting(2, range=COUNT0)
    # sglang (GPU) settings
    tp: int = setting(1, range=COUNT)  # inference TP size
    #: inference expert-parallel size of a mixture-of-experts model (SGLang's ep_size): each
    #: inference group's rollout.tp GPUs hold 1/ep of every layer's experts; divides rollout.tp
    ep: int = setting(1, range=COUNT)
    #: SGLang's share of GPU memory (weights + KV cache)
    mem_fraction_static: float = setting(0.6, range=Range(lo=0, hi=1, lo_open=True, hi_open=True))
    enable_memory_saver: bool = True  # SGLang releases its KV cache and weights while the actor trains
    #: SGLang's enable_deterministic_inference: per-candidate seeds are honoured (and recorded in
    #: the experience) only with it; batch-invariant kernels make decoding slower
    deterministic_inference: bool = False
    #: prove that a weight update wrote every engine parameter (SGLang's weight checker: the
    #: parameters are reset to random values before the update and checksummed before and after;
    #: an unwritten one fails the load, naming it): first (the engine's first load) | every | never
    verify_engine_weights: str = setting("first", choices=("first", "every", "never"))
    #: multi-turn agent rollouts (rollout.agent.env: "" = none)
    agent: AgentConfig = field(default_factory=AgentConfig)


@dataclass
class KLSettings:
    """The KL to the reference model: where it enters, its estimator and coefficient."""

    #: none | loss (GRPO, DeepSeekMath) | reward (PPO shaped reward)
    placement: str = setting("none", choices=("none", "loss", "reward"))
    estimator: str = "k3"  # k1 | k2 | k3 (Schulman's estimators of KL(actor || reference))
    beta: float = setting(0.0, range=Range(lo=0))  # KL coefficient (initial one when adaptive)
    adaptive: bool = False  # PPO: Ziegler et al. adaptive controller
    target: float = setting(6.0, range=POS)  # adaptive controller: target KL per sequence
    horizon: int = setting(10000, range=COUNT)  # adaptive controller: horizon (samples)


@dataclass
class DynamicSampling:
    """DAPO dynamic sampling (Yu et al. 2025): drop groups whose rewards all agree and sample
    more prompts on the same version until the batch is full, at most ``max_rounds`` rounds."""

    enabled: bool = False  # drop groups whose rewards all agree and sample more prompts
    max_rounds: int = setting(4, range=COUNT)  # most sampling rounds per iteration


@dataclass
class RolloutCorrectionSettings:
    """Correction of the rollout-vs-trainer log-prob mismatch (Yao et al. 2025), computed from
    the sealed actor and rollout log-probs; both off (null) by default."""

    #: C of truncated importance sampling, >= 1 (null: no IS weights)
    token_is_cap: Optional[float] = setting(None, range=Range(lo=1, null=True))
    #: drop a sample from the loss above this error (null: keep all)
    seq_mask_threshold: Optional[float] = setting(None, range=Range(lo=0, lo_open=True, null=True))
    #: max_abs | mean (|mean log-ratio| over the response)
    seq_mask_stat: str = setting("max_abs", choices=("max_abs", "mean"))


@dataclass
class SFTSettings:
    """A supervised (cross-entropy) term mixed into the actor's update: the negative log-likelihood
    of demonstration responses, normalised by its own token count (megarl/algo/sft.py)."""

    #: demonstrations: a prompt file read like ``data.train_path`` (``data.prompt_field`` /
    #: ``messages_field``, the chat template, ``max_prompt_tokens``) whose rows also hold the
    #: response; null: no SFT term
    path: Optional[str] = None
    coef: float = setting(0.0, range=Range(lo=0))  # its weight beside the RL loss (> 0 with a path)
    response_field: str = "response"  # the row's demonstration response (text)
    #: demonstration rows per optimizer step, drawn epoch after epoch by a cursor the checkpoint keeps
    rows: int = setting(8, range=COUNT)


@dataclass
class AlgoConfig:
    """The algorithm: advantage estimator, policy loss, KL, epochs and batch splits."""

    name: str = setting("grpo", choices=ALGORITHMS)  # grpo | ppo
    #: grpo | dr_grpo | rloo | reinforce_plus_plus_baseline | grpo_process (step rewards) | gae | reinforce_plus_plus
    advantage: str = "grpo"
    gamma: float = setting(1.0, range=Range(lo=0, hi=1))  # discount (GAE)
    lam: float = setting(1.0, range=Range(lo=0, hi=1))  # GAE lambda
    zero_std_rule: str = setting("epsilon", choices=("epsilon", "skip"))  # epsilon | skip
    std_eps: float = setting(1.0e-6, range=POS)  # added to the group std (zero_std_rule=epsilon)
    whiten_advantages: bool = True  # GAE advantages whitened over the batch (PPO practice)
    #: a token-reward estimator (gae, reinforce_plus_plus): last_token, each sample's total on its
    #: last action | recorded, the parts its reward record says it is made of on the actions they
    #: follow (an environment's reward of each turn on that turn's last policy token, process
    #: steps on their ends; what they leave of the total on the last action)
    reward_placement: str = setting("last_token", choices=("last_token", "recorded"))
    #: on-policy distillation beside the estimator: the teacher's per-token reverse KL
    #: (log pi_old - log T) subtracted from the advantage with this weight (needs teacher.path)
    distill_coef: float = setting(0.0, range=Range(lo=0))
    policy_loss: str = "vanilla"  # vanilla | gspo | cispo | gmpo | sapo (megarl/algo/policy_loss.py)
    # range: the ratio's floor 1 - clip_low stays > 0
    clip_low: float = setting(0.2, range=Range(lo=0, hi=1, hi_open=True))  # ratio clipped below at 1 - clip_low
    clip_high: float = setting(0.2, range=Range(lo=0))  # ratio clipped above at 1 + clip_high (DAPO clip-higher)
    #: c > 1 bounds negative-advantage losses by -c * A (null: off)
    dual_clip: Optional[float] = setting(3.0, range=Range(lo=1, lo_open=True, null=True))
    agg_mode: str = "token-mean"  # token-mean | seq-mean-token-sum | seq-mean-token-mean | seq-mean-token-sum-norm
    #: policy_loss sapo: the gate's temperature for tokens with a positive advantage
    sapo_tau_pos: float = setting(1.0, range=POS)
    #: policy_loss sapo: the gate's temperature for tokens with a non-positive advantage
    sapo_tau_neg: float = setting(1.05, range=POS)
    entropy_coef: float = setting(0.0, range=Range(lo=0))  # entropy bonus coefficient
    kl: KLSettings = field(default_factory=KLSettings)
    sft: SFTSettings = field(default_factory=SFTSettings)  # a cross-entropy term on demonstrations
    ppo_epochs: int = setting(1, range=COUNT)  # passes over each sealed batch
    num_mini_batches: int = setting(1, range=COUNT)  # optimizer steps per epoch (each over whole groups)
    #: rows per forward/backward in the update, per DP rank; 0 = the whole mini-batch at once
    micro_batch_size: int = setting(8, range=COUNT0)
    #: rows per forward-only pass (old/reference log-probs, critic values); 0 = all at once
    forward_micro_batch_size: int = setting(16, range=COUNT0)
    #: forward-only passes run each micro-batch's real tokens as one packed (THD) sequence; false = padded
    pack_sequences: bool = False
    #: a token budget per micro-batch, per DP rank (0: off).  The update (actor and critic) and the
    #: forward-only passes then pack rows first-fit into micro-batches of at most this many real
    #: tokens (a longer row gets one of its own) instead of cutting micro_batch_size /
    #: forward_micro_batch_size rows; every DP rank runs as many micro-batches
    micro_batch_tokens: int = setting(0, range=COUNT0)
    #: log-probs and entropy with the output layer applied to the last hidden states a chunk of
    #: this many positions at a time, so no full-vocabulary logits exist in the forward-only passes
    #: or the update (megarl/models/fused_output.py); 0: the model's logits, the whole micro-batch
    log_prob_chunk: int = setting(0, range=COUNT0)
    dynamic_sampling: DynamicSampling = field(default_factory=DynamicSampling)
    partial_groups: str = setting("drop", choices=("drop", "allow_partial"))  # drop | allow_partial
    #: allow_partial: the smallest group kept
    min_partial_size: Optional[int] = setting(None, range=Range(lo=1, null=True))
    rollout_correction: RolloutCorrectionSettings = field(default_factory=RolloutCorrectionSettings)
    #: MoE: none | measure | rollout.  measure: the engine returns each sample's experts (sealed in
    #: the experience record) and the old-log-prob forward reports how often the trainer's own
    #: routing differs; rollout: also replays them in every policy forward (old log-probs, update)
    routing_replay: str = setting("none", choices=ROUTING_REPLAY)


@dataclass
class OptimSettings:
    """An optimizer and its learning-rate schedule (megatron's)."""

    optimizer: str = setting("adam", choices=("adam", "sgd"))  # adam (AdamW) | sgd
    lr: float = setting(1.0e-6, range=POS)  # peak learning rate
    # range: also <= lr (checked with it)
    min_lr: float = setting(0.0, range=Range(lo=0))  # learning rate at the end of the decay (<= lr)
    lr_warmup_steps: int = setting(0, range=COUNT0)  # optimizer steps (ppo_epochs x num_mini_batches per iteration)
    lr_decay_style: str = setting("constant", choices=("constant", "linear", "cosine"))  # constant | linear | cosine
    weight_decay: float = setting(0.0, range=Range(lo=0))  # decoupled weight decay
    adam_beta1: float = setting(0.9, range=Range(lo=0, hi=1, hi_open=True))  # Adam beta1
    adam_beta2: float = setting(0.999, range=Range(lo=0, hi=1, hi_open=True))  # Adam beta2
    adam_eps: float = setting(1.0e-8, range=POS)  # Adam epsilon
    # range: > 0: megatron computes the grad norm only when clipping; the update rollback reads it
    clip_grad: float = setting(1.0, range=POS)  # global grad-norm clip


@dataclass
class LoraSettings:
    """Low-rank adapters on the policy's linears (megarl/models/lora.py): the base frozen, only
    ``A`` and ``B`` trained, the engine fed the merged weight."""

    rank: int = setting(0, range=COUNT0)  # r; 0: off (the whole model trains)
    alpha: float = setting(16.0, range=POS)  # the adapter's scale is alpha / rank
    dropout: float = setting(0.0, range=Range(lo=0, hi=1, hi_open=True))  # on the adapter's input
    #: megatron's linears to adapt: linear_qkv, linear_proj (attention), linear_fc1, linear_fc2 (MLP)
    target_modules: List[str] = field(default_factory=lambda: ["linear_qkv", "linear_proj", "linear_fc1",
                                                               "linear_fc2"])
    #: kaiming: A Kaiming-uniform, B = 0 (peft's default) | gaussian: A ~ N(0, 1/r), B = 0
    init: str = setting("kaiming", choices=("kaiming", "gaussian"))
    #: what the rollout engine is sent: merged (W + s B A, the adapted tensors after a first whole
    #: load) | adapter (SGLang only: the base once, then each version's adapter, applied by
    #: SGLang's LoRA backend)
    engine: str = setting("merged", choices=("merged", "adapter"))


@dataclass
class ActorConfig:
    """The trained policy: its optimizer."""

    optim: OptimSettings = field(default_factory=OptimSettings)
    lora: LoraSettings = field(default_factory=LoraSettings)  # rank 0: full fine-tuning
    offload: bool = False  # params/grads/optimizer to host while the rollout engine runs (GPU)
    #: mixture-of-experts models: the router's load-balancing loss coefficient (megatron's
    #: aux_loss, Switch-Transformer style); 0 = off, the RL default (it is a pre-training regulariser)
    moe_aux_loss_coeff: float = setting(0.0, range=Range(lo=0))
    #: mixture-of-experts models: the router z-loss coefficient (ST-MoE); null = off
    moe_z_loss_coeff: Optional[float] = setting(None, range=Range(lo=0, null=True))


@dataclass
class ReferenceConfig:
    """The frozen reference policy for the KL."""

    enabled: bool = True  # a frozen reference model for the KL
    path: Optional[str] = None  # default: the actor's starting checkpoint
    refresh_every: int = setting(0, range=COUNT0)  # 0: never; K: copy the actor into the reference every K iterations
    offload: bool = False  # on the host between its forwards (GPU)


@dataclass
class TeacherBuild:
    """A teacher made before the run when ``teacher.path`` is missing: ``megarl.train`` on
    ``recipe`` (a path, or one under the project's ``configs/``) with ``overrides``, into
    ``run_dir``; ``teacher.path`` must then be one of that run's exports.  Rank 0 builds (a
    plain single process; a build that was stopped resumes from its checkpoints), the other
    ranks wait for it."""

    recipe: Optional[str] = None  # null: no build (teacher.path must exist)
    run_dir: Optional[str] = None
    overrides: List[str] = field(default_factory=list)


@dataclass
class TeacherConfig:
    """On-policy distillation's teacher: a frozen model teacher-forced on the student's samples
    (``algo.advantage: on_policy_distill``, or ``algo.distill_coef`` beside another estimator)."""

    #: an HF causal LM with the actor's tokenizer (token-level distillation reads one vocabulary);
    #: null: no teacher
    path: Optional[str] = None
    offload: bool = False  # on the host between its forwards (GPU)
    #: where its forward runs: ``megatron`` (a frozen model at the actor's TP/PP, like the
    #: reference), ``hf`` (the checkpoint served by an hf engine on rank 0, its prompt log-probs of
    #: the rollout's tokens broadcast to every rank) or ``sglang`` (the same with an SGLang engine)
    engine: str = setting("megatron", choices=("megatron", "hf", "sglang"))
    #: ``teacher.engine: sglang``: the share of the device its SGLang engine takes (beside the rollout's)
    mem_fraction_static: float = setting(0.2, range=Range(lo=0, hi=1, lo_open=True, hi_open=True))
    build: TeacherBuild = field(default_factory=TeacherBuild)


@dataclass
class CriticConfig:
    """PPO's value model (``critic: {}`` for the defaults; null for GRPO)."""

    path: Optional[str] = None  # None: initialised from the actor's weights (value head zero)
    optim: OptimSettings = field(default_factory=lambda: OptimSettings(lr=1.0e-5))
    #: PPO value clipping around the old values (null: off)
    value_clip: Optional[float] = setting(0.2, range=Range(lo=0, lo_open=True, null=True))
    #: rows per critic forward/backward, per DP rank (0: the whole mini-batch at once)
    micro_batch_size: int = setting(8, range=COUNT0)
    warmup_iters: int = setting(0, range=COUNT0)  # critic-only updates before the actor starts moving
    offload: bool = False  # on the host while the rollout engine runs (GPU)
    lora: LoraSettings = field(default_factory=LoraSettings)  # adapters on the trunk; the value head trains whole


@dataclass
class RewardModelConfig:
    """A neural reward model, alone or next to a rule (reward.fn)."""

    #: the reward component its score is recorded under (unique among reward.model and reward.models)
    name: str = "reward_model"
    path: Optional[str] = None  # an HF *ForSequenceClassification or *ForTokenClassification (num_labels=1)
    tokenizer: Optional[str] = None  # default: reward_model.path
    chat_template: Optional[str] = None  # a Jinja file for the RM's prompts (default: its tokenizer's)
    #: a reference-guided model's user turn: a format string with {prompt} (the turn's text) and the
    #: row's ground-truth fields (e.g. "{prompt} answer : {answer}"), as it was trained
    #: (megarl.train_rm's data.prompt, recorded in its export); null: the prompt as it is
    prompt: Optional[str] = None
    weight: float = setting(1.0, range=Range())  # weight of the RM score in a composite with reward.fn
    offload: bool = False  # on the host between its forwards (GPU time-slicing)
    #: seconds the forward over one batch may take (the slowest rank's); past it every sample of
    #: the batch is status timeout, its late scores discarded (null: no limit)
    timeout_s: Optional[float] = setting(None, range=Range(lo=0, lo_open=True, null=True))
    #: outcome: one score per response | process: a score per step, read at each step separator of
    #: its own rendering and placed on the actor token that ends the step (grpo_process reads them)
    kind: str = setting("outcome", choices=("outcome", "process"))
    step_separator: Optional[str] = None  # kind process: the text that ends a step (the response's end ends the last)
    step_aggregate: str = setting("min", choices=("min", "mean", "last"))  # kind process: the steps' scores -> its total


@dataclass
class JudgeConfig:
    """A generative judge: a causal LM that reads (prompt, response) through its own prompt and
    template, writes a verdict, and has it parsed by a declared rule (megarl/rewards/verdicts.py)."""

    name: str = "judge"  # the reward component its verdict is recorded under
    path: Optional[str] = None  # an HF causal LM (*ForCausalLM)
    tokenizer: Optional[str] = None  # default: the judge's path
    chat_template: Optional[str] = None  # a Jinja file (default: its tokenizer's; none: the prompt text as it is)
    #: what the judge is asked: a format string with {response} (required) and {prompt}
    prompt: str = "question : {prompt} answer : {response} . is the answer right ?"
    verdict: str = setting("yes_no", choices=("yes_no", "score"))  # yes_no: the first yes / no word | score: pattern
    yes: str = "yes"  # verdict yes_no: the word that scores 1
    no: str = "no"  # verdict yes_no: the word that scores 0
    probability: bool = False  # verdict yes_no: score P(yes) / (P(yes) + P(no)) at the verdict instead of 1 / 0
    pattern: Optional[str] = None  # verdict score: a regular expression with one group, read as a float
    max_new_tokens: int = setting(8, range=COUNT)  # the verdict's budget; past it without a verdict: invalid
    temperature: float = setting(0.0, range=Range(lo=0))  # 0: greedy
    weight: float = setting(1.0, range=Range())  # weight of the verdict in the total
    batch_size: int = setting(64, range=COUNT)  # judge prompts per generate call
    #: where it generates: hf (transformers in-process) | sglang (an SGLang engine of its own on
    #: rank 0, beside the rollout's, taking mem_fraction_static of the device)
    engine: str = setting("hf", choices=("hf", "sglang"))
    mem_fraction_static: float = setting(0.1, range=Range(lo=0, hi=1, lo_open=True, hi_open=True))
    offload: bool = False  # engine hf: its weights on the host except while it judges (GPU)


@dataclass
class RewardConfig:
    """How samples are scored: the function, its isolation, timeouts and failure policy."""

    def neural_models(self) -> list:
        """``[(key, RewardModelConfig)]`` of every neural reward model, in scoring order:
        ``reward.model`` (when its path is set), then each of ``reward.models``."""
        out = [("reward.model", self.model)] if self.model.path else []
        return out + [(f"reward.models[{i}]", m) for i, m in enumerate(self.models)]

    fn: Optional[str] = "exact_numeric"  # builtin name or "pkg.mod:callable"; None = RM only
    kwargs: dict = field(default_factory=dict)  # keyword arguments of reward.fn
    components: list = field(default_factory=list)  # for fn=composite
    model: RewardModelConfig = field(default_factory=RewardModelConfig)
    #: more neural reward models, each its own frozen role with its own tokenizer and template,
    #: scored on its own rendering and recorded as the component of its name: a list of
    #: {name, path, tokenizer, chat_template, weight, offload, timeout_s}
    models: List[RewardModelConfig] = field(default_factory=list)
    #: generative judges (rank 0, through an inference engine of their own: hf or SGLang), each its
    #: own component: a list of {name, path, tokenizer, chat_template, prompt, verdict, yes, no,
    #: probability, pattern, max_new_tokens, temperature, weight, batch_size, engine,
    #: mem_fraction_static, offload}; an unparseable or truncated verdict is status invalid, never a score
    judges: List[JudgeConfig] = field(default_factory=list)
    #: per-call timeout in seconds (null: none)
    timeout_s: Optional[float] = setting(30.0, range=Range(lo=0, lo_open=True, null=True))
    max_retries: int = setting(2, range=COUNT0)  # retries of a failed or timed-out call
    retry_backoff_s: float = setting(0.05, range=Range(lo=0))  # sleep before a retry
    #: where scorers run: process (killable worker processes) | thread | auto (threads for the
    #: cheap rule builtins exact_numeric / regex / arithmetic and composites of them, processes
    #: for math_verify and plug-ins); see megarl/rewards/isolation.py
    isolation: str = "auto"
    workers: int = setting(4, range=COUNT)  # concurrent reward calls: worker threads or processes
    kill_grace_s: float = setting(0.5, range=POS)  # process: SIGTERM -> SIGKILL delay for an overdue worker
    #: process: RLIMIT_AS per worker (whole address space); null = none
    max_memory_mb: Optional[int] = setting(None, range=Range(lo=64, null=True))
    #: process: RLIMIT_CPU per call (SIGXCPU -> error); null = none
    cpu_time_s: Optional[float] = setting(None, range=Range(lo=0, lo_open=True, null=True))
    #: drop | quarantine (kept in <run_dir>/quarantine.jsonl)
    on_failure: str = setting("drop", choices=("drop", "quarantine"))
    #: the only way a failure becomes a number: a penalty per status (null = none)
    penalty: dict = field(default_factory=lambda: {"error": None, "timeout": None, "invalid": None})
    # range: also <= rollout.max_new_tokens (checked with it)
    #: DAPO soft overlong punishment: L_cache, the last tokens before rollout.max_new_tokens over
    #: which an ok score is lowered linearly to -1 (component "overlong"); null = off
    overlong_buffer: Optional[int] = setting(None, range=Range(lo=1, null=True))
    #: the ground-truth fields the reward reads (checked in every train / held-out row at
    #: start-up); null: what the reward function declares (megarl/rewards/declarations.py)
    required_fields: Optional[List[str]] = None


@dataclass
class EvalConfig:
    """Held-out evaluation during training (data.heldout_path) and python -m megarl.eval."""

    every: int = setting(5, range=COUNT0)  # iterations between held-out evaluations (0: start and end only)
    n: int = setting(200, range=COUNT)  # held-out prompts per evaluation
    max_new_tokens: Optional[int] = setting(None, range=Range(lo=1, null=True))  # default: rollout.max_new_tokens
    #: accuracy = share of the *scored* held-out samples with reward >= this (a sample whose
    #: generation or scorer failed is counted in eval/scorer_failures, never as wrong)
    success_threshold: float = setting(1.0, range=Range())
    before_train: bool = True  # evaluate before the first update (with every=0: start and end only)
    save_results: bool = False  # per-row results of each evaluation to <run_dir>/eval/iter_<k>.jsonl
    #: python -m megarl.eval: samples per prompt for pass@k / maj@k (at ``temperature``; 1 = greedy only)
    samples_per_prompt: int = setting(1, range=COUNT)
    temperature: float = setting(1.0, range=POS)  # of the pass@k / maj@k samples (the greedy accuracy is always at 0)
    top_p: float = setting(1.0, range=Range(lo=0, hi=1, lo_open=True))
    #: the k of pass@k / maj@k (default: 1 and samples_per_prompt)
    k: List[int] = setting(default_factory=list, range=Range(lo=1, each=True))
    source_field: str = "source"  # per-source metrics when the rows carry this field
    seed: int = setting(0, range=SEED)  # of the pass@k / maj@k samples (per-candidate seeds, as in training)
    #: the reward function the held-out evaluation grades with instead of the training reward (a
    #: reward.fn name, e.g. arithmetic, for a run trained on a reward model or a judge: the accuracy
    #: is then the rule's, not the model's); null: the training reward
    grader: Optional[str] = None
    grader_kwargs: dict = field(default_factory=dict)  # keyword arguments of eval.grader


@dataclass
class PhaseTimeoutsConfig:
    """Seconds each phase of the iteration may last (null: no limit).  A phase past its limit
    fails the run on every rank together (restart from the last checkpoint): loading and
    activation are checked when they end, generation after every generate call (before scoring
    and the forwards run), the sealed batch before the update, the update after every optimizer
    step."""

    exporting: Optional[float] = setting(600.0, range=Range(lo=0, lo_open=True, null=True))
    rollout_loading: Optional[float] = setting(600.0, range=Range(lo=0, lo_open=True, null=True))
    rollout_ready: Optional[float] = setting(600.0, range=Range(lo=0, lo_open=True, null=True))
    generating: Optional[float] = setting(3600.0, range=Range(lo=0, lo_open=True, null=True))
    experience_sealed: Optional[float] = setting(600.0, range=Range(lo=0, lo_open=True, null=True))
    updating_from: Optional[float] = setting(3600.0, range=Range(lo=0, lo_open=True, null=True))


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

    iterations: int = setting(10, range=COUNT)  # training iterations (rollout + update each)
    prompts_per_iteration: int = setting(8, range=COUNT)  # B
    seed: int = setting(1234, range=SEED)  # of the prompt order, sampling and init
    run_dir: Optional[str] = None  # default runs/<recipe>-<timestamp>
    run_id: Optional[str] = None  # default: the run_dir's name
    export_every: int = setting(0, range=COUNT0)  # 0: only iter_0 and the end
    save_experience: bool = False  # audit trail: every sealed batch with its manifest
    #: where metrics go: jsonl (<run_dir>/metrics.jsonl, the source of truth, always on even if
    #: not listed) | tensorboard | wandb | mlflow (see megarl/observability/trackers.py)
    loggers: List[str] = field(default_factory=lambda: ["jsonl", "tensorboard"])
    wandb: WandbSettings = field(default_factory=WandbSettings)
    mlflow: MlflowSettings = field(default_factory=MlflowSettings)
    #: a table of trainer.log_samples_n samples of the sealed batch every this many iterations
    #: (iterations 0, K, 2K, ...) to <run_dir>/samples.jsonl and every tracker with tables; 0 = off
    log_samples_every: int = setting(10, range=COUNT0)
    log_samples_n: int = setting(4, range=COUNT)  # rows per sample table
    log_samples_console: int = setting(2, range=COUNT0)  # of those rows, how many are printed (one short line each)
    deterministic: bool = True  # torch deterministic algorithms
    #: stop (with an export) after this much wall time
    max_wall_minutes: Optional[float] = setting(None, range=Range(lo=0, lo_open=True, null=True))
    #: one device's peak FLOP/s in the training dtype (e.g. 989e12: an H100's dense bf16): the
    #: update's model FLOPs over this times its seconds and devices is update/mfu (null: not reported)
    peak_flops: Optional[float] = setting(None, range=Range(lo=0, lo_open=True, null=True))
    #: iterations between training-position checkpoints (0: only on SIGTERM/SIGUSR1)
    checkpoint_every: int = setting(0, range=COUNT0)
    checkpoint_keep: int = setting(3, range=COUNT)  # how many published checkpoints to keep
    #: auto: continue from <run_dir>/checkpoints/latest if there is one (a finished run: nothing to do;
    #: metrics but no checkpoint: refused) | never: start at iteration 0 (an interrupted attempt without
    #: checkpoints is moved to <run_dir>/attempt-<time>/; a finished or checkpointed run dir is refused)
    resume: str = setting("auto", choices=("auto", "never"))
    resume_force: bool = False  # resume although tokenizer / template / reward / model config changed (new run id)
    #: the iteration a crash interrupted after its experience was sealed: "rerun" its rollout, or
    #: "reuse" the sealed batch (written to <run_dir>/experience/pending at every seal; reused only
    #: if its policy version, config hashes and content hash match the checkpoint's)
    resume_experience: str = setting("rerun", choices=("rerun", "reuse"))
    #: a failed actor/critic update (exception on any rank, non-finite loss or grad norm): the
    #: weights, optimizer and LR schedule return to the committed version v on every rank, then
    #: "retry" the update on the same sealed batch (at most max_update_retries times, then stop),
    #: "skip" the batch and keep v, or "stop" the run (the last checkpoint stays the restart point)
    on_update_failure: str = setting("retry", choices=("retry", "skip", "stop"))
    max_update_retries: int = setting(2, range=COUNT0)  # on_update_failure=retry: attempts per batch
    #: "memory": a host copy of actor (and critic) params and optimizer state at the start of every
    #: update, for the rollback (costs one device->host copy of that state per iteration); "none":
    #: no copy, a failed update stops the run and resume=auto restarts from the last checkpoint
    update_rollback: str = setting("memory", choices=("memory", "none"))
    #: iterations recorded as a Chrome-trace timeline per rank (<run_dir>/profile/iter_<k>.rank<r>.json)
    profile_iterations: List[int] = setting(default_factory=list, range=ITERATIONS)
    phase_timeout_s: PhaseTimeoutsConfig = field(default_factory=PhaseTimeoutsConfig)


@dataclass
class FaultsConfig:
    """Fault injection for tests and drills; every key is inert unless set."""

    #: die after writing checkpoint k, before publishing it
    crash_during_checkpoint_at: Optional[int] = setting(None, range=Range(lo=0, null=True))
    #: die (os._exit) in iteration k's update, after its seal
    crash_during_update_at: Optional[int] = setting(None, range=Range(lo=0, null=True))
    #: iterations whose first weight load is corrupted
    corrupt_weight_sync_at: List[int] = setting(default_factory=list, range=ITERATIONS)
    #: a candidate's result is lost (and delivered late, in the next call)
    rollout_error_rate: float = setting(0.0, range=RATE)
    duplicate_result_rate: float = setting(0.0, range=RATE)  # a candidate's result is delivered twice
    reward_timeout_rate: float = setting(0.0, range=RATE)  # a reward call hangs past reward.timeout_s
    #: iterations whose RM forward raises
    reward_model_error_at: List[int] = setting(default_factory=list, range=ITERATIONS)
    #: iterations whose RM forward is held past reward.model.timeout_s (which must be set)
    reward_model_timeout_at: List[int] = setting(default_factory=list, range=ITERATIONS)
    #: iterations whose update fails once
    fail_optimizer_step_at: List[int] = setting(default_factory=list, range=ITERATIONS)
    # range: -1 is the last rank; also < the world size (checked with it)
    fail_optimizer_step_rank: int = setting(-1, range=Range(lo=-1))  # the rank that fails (-1: the last)
    #: exception | nan (a non-finite loss on that rank)
    fail_optimizer_step_kind: str = setting("exception", choices=("exception", "nan"))
    seed: int = setting(0, range=SEED)  # of the fault draws (see megarl/runtime/faults.py)
    #: split placement drill: the rollout rank kills itself (SIGKILL) while it receives the
    #: weights of this optimizer step (the trainer must name it lost within placement.timeout_s)
    kill_rollout_at_load: Optional[int] = setting(None, range=Range(lo=0, null=True))
    #: split placement drill: a straggling rollout rank, sleeping this long after every
    #: generation segment (async_rl.segment_tokens), so versions change mid-response
    rollout_segment_delay_s: float = setting(0.0, range=Range(lo=0))
    #: split placement drill: at the first segment boundary of each generation job the rollout
    #: rank waits, at most this long, for the trainer's next command, so a version the trainer
    #: publishes meanwhile is taken mid-response for certain, however fast the machine (0: off)
    rollout_segment_await_s: float = setting(0.0, range=Range(lo=0))
    #: stop drill: after iteration k's metrics row is written (before its stop check and its
    #: checkpoint) the run holds -- rank 0 prints "faults: holding after iteration k" -- until a
    #: stop is asked for (SIGTERM, SIGUSR1, <run_dir>/STOP) or it is killed, so a test's stop or
    #: kill lands at a known point however fast or busy the machine is
    hold_after_iteration: List[int] = setting(default_factory=list, range=ITERATIONS)


@dataclass
class PlacementConfig:
    """Where generation runs.  ``hybrid``: every rank trains and generates, time-sliced (one GPU
    pool).  ``split``: the last ``rollout_ranks`` ranks of the torchrun world only generate (each
    an engine of its own), the others only train; weights go to the rollout side over a dedicated
    process group, requests and results over a control channel, every wait bounded by
    ``timeout_s``."""

    mode: str = setting("hybrid", choices=PLACEMENTS)  # hybrid | split
    rollout_ranks: int = setting(1, range=COUNT)  # split: ranks of the world that run rollout engines (the last ones)
    #: split: seconds a side waits for the other (a reply, a weight transfer, a heartbeat) before
    #: it names the other side lost and stops; a killed process is detected within this bound
    timeout_s: float = setting(120.0, range=POS)


@dataclass
class AsyncConfig:
    """Asynchronous RL with a hard staleness bound (``placement.mode=split``).  Generation runs
    ahead of training by up to ``max_staleness`` optimizer steps: every policy token trained at
    step s was generated by a version of step >= s - max_staleness (checked per token before
    sealing).  0 is the synchronous loop."""

    max_staleness: int = setting(0, range=COUNT0)  # eta, in optimizer steps (0: synchronous)
    #: off-policy correction, required when max_staleness > 0 (the old log-probs are the
    #: proximal policy, recomputed by the actor before the update; the rollout's are the
    #: behaviour policy):  decoupled (AReaL's decoupled PPO: behaviour weight exp(old - rollout),
    #: capped at is_cap when set) | tis (the same weight, truncated at is_cap) | mask (drop a
    #: sample whose mean |old - rollout| exceeds mask_threshold)
    correction: Optional[str] = setting(None, choices=ASYNC_CORRECTIONS)
    #: cap of the behaviour weight (tis: required; decoupled: null = uncapped)
    is_cap: Optional[float] = setting(2.0, range=Range(lo=1, null=True))
    mask_threshold: float = setting(0.5, range=POS)  # correction=mask: the largest mean |log-ratio| of a trained sample
    #: partial rollouts (hybrid placement, megarl/control/production_partial.py): an iteration
    #: trains on B groups that completed, generating segment_tokens tokens at a time until they
    #: have; unfinished ones carry over (eta >= 1: their tokens too, each keeping its version,
    #: a group trained within eta steps of its admission; eta 0: they start again, due next)
    partial_rollouts: bool = False
    #: over-sampling with partial_rollouts: groups kept open beyond the B an iteration trains
    #: (at most B)
    extra_groups: int = setting(0, range=COUNT0)
    #: in-flight weight updates: the rollout ranks generate this many new tokens at a time and,
    #: between segments, activate a version published meanwhile; the rest of a response is then
    #: generated by the newer weights after re-prefilling its tokens so far (KV recomputed), each
    #: token keeping the version that sampled it.  Agent sessions (rollout.agent.env) take a version
    #: between turns instead (any value > 0).  With partial_rollouts (hybrid placement): the tokens
    #: generated between two checks of whether the iteration has its B complete groups.
    #: 0: whole responses, one version each
    segment_tokens: int = setting(0, range=COUNT0)
    #: who computes the proximal (old) log-probs of an asynchronous batch on v, the version
    #: trained from:  actor (a forward of the megatron actor, the default) | engine (split
    #: placement: the rollout engine teacher-forces the batch on v while the trainer computes the
    #: reference and critic forwards; parity-checked against the actor's on the first iteration
    #: and every rollout.log_prob_parity_every, within rollout.log_prob_parity_tol)
    proximal_log_probs: str = setting("actor", choices=("actor", "engine"))


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
    teacher: TeacherConfig = field(default_factory=TeacherConfig)
    critic: Optional[CriticConfig] = None
    reward: RewardConfig = field(default_factory=RewardConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    faults: FaultsConfig = field(default_factory=FaultsConfig)
    placement: PlacementConfig = field(default_factory=PlacementConfig)
    #: ``async`` is a Python keyword, so the section is ``async_rl``
    async_rl: AsyncConfig = field(default_factory=AsyncConfig)
