"""The allowed range of every numeric config key, in one table.

:func:`megarl.config.validate` checks each key here (``_validate_ranges``) before the checks
that combine keys, so a value out of range is refused naming its key instead of surfacing later
as a division by zero or a silently odd run (``eval.every=-1`` evaluating every iteration).
``tests/test_cli.py`` enumerates every int / float field of the schema and fails when one has
no entry here, so a new numeric key cannot be added without saying what it accepts.

Every value must also be finite (``nan`` / ``inf`` are refused everywhere; ``null`` is the way
to say "no limit" where a key allows it).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Tuple


@dataclass(frozen=True)
class Range:
    """``lo`` / ``hi`` bounds (``None``: unbounded), open or closed; ``null``: ``None`` is
    allowed; ``also``: single values allowed outside the bounds (``rollout.top_k=-1``: off);
    ``each``: the key is a list and every item must be in range."""

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


#: a count of things (>= 1), a count that may be zero (>= 0), a positive real, a probability
COUNT, COUNT0, POS, SEED = Range(lo=1), Range(lo=0), Range(lo=0, lo_open=True), Range(lo=0)
RATE = Range(lo=0, hi=1, hi_open=True)
ITERATIONS = Range(lo=0, each=True)  # lists of iteration indices

_OPTIM = {
    "lr": POS,
    "min_lr": Range(lo=0),  # and <= lr (checked with it)
    "lr_warmup_steps": COUNT0,
    "weight_decay": Range(lo=0),
    "adam_beta1": Range(lo=0, hi=1, hi_open=True),
    "adam_beta2": Range(lo=0, hi=1, hi_open=True),
    "adam_eps": POS,
    "clip_grad": POS,  # megatron computes the grad norm only when clipping (> 0); the rollback reads it
}

RANGES = {
    "model.tiny.hidden_size": COUNT, "model.tiny.num_layers": COUNT, "model.tiny.num_heads": COUNT,
    "model.tiny.num_kv_heads": COUNT, "model.tiny.intermediate_size": COUNT,
    "model.tiny.warmstart_steps": COUNT0, "model.tiny.warmstart_lr": POS, "model.tiny.warmstart_batch": COUNT,
    "model.tiny.warmstart_adam_beta2": Range(lo=0, hi=1, hi_open=True),
    "model.tiny.warmstart_target_accuracy": Range(lo=0, hi=1, lo_open=True, null=True),
    "model.tiny.seed": SEED,
    "model.tiny.num_experts": COUNT, "model.tiny.top_k": COUNT, "model.tiny.moe_intermediate_size": COUNT,
    "model.tiny.tool_demos": Range(lo=0, hi=1), "model.tiny.two_turn_demos": Range(lo=0, hi=1),
    "model.tiny.tool_only_steps": COUNT0, "model.tiny.tool_mixture_steps": COUNT0,
    "model.tiny.tool_min_digits": COUNT, "model.tiny.tool_max_digits": COUNT,
    "model.vocab_multiple": COUNT,
    "parallel.tp": COUNT, "parallel.pp": COUNT, "parallel.vpp": COUNT, "parallel.cp": COUNT, "parallel.ep": COUNT, "parallel.etp": Range(lo=1, null=True),
    "parallel.peer_timeout_s": Range(lo=1, null=True),
    "parallel.recompute.num_layers": COUNT,
    "data.max_prompt_tokens": COUNT, "data.arithmetic_train_n": COUNT, "data.arithmetic_heldout_n": COUNT,
    "data.arithmetic_min_digits": COUNT, "data.arithmetic_max_digits": COUNT,
    "data.running_sum_train_n": COUNT, "data.running_sum_heldout_n": COUNT,
    "data.running_sum_min_terms": Range(lo=1, hi=26), "data.running_sum_max_terms": Range(lo=1, hi=26),
    "data.running_sum_alpha": Range(lo=0),
    "faults.kill_rollout_at_load": Range(lo=0, null=True), "faults.rollout_segment_delay_s": Range(lo=0),
    "faults.rollout_segment_await_s": Range(lo=0),
    "async_rl.segment_tokens": COUNT0, "async_rl.extra_groups": COUNT0,
    "placement.rollout_ranks": COUNT, "placement.timeout_s": POS,
    "async_rl.max_staleness": COUNT0, "async_rl.is_cap": Range(lo=1, null=True), "async_rl.mask_threshold": POS,
    "rollout.temperature": POS,
    "rollout.top_p": Range(lo=0, hi=1, lo_open=True),
    "rollout.top_k": Range(lo=1, also=(-1,)),
    "rollout.max_new_tokens": COUNT, "rollout.n": COUNT,
    "rollout.log_prob_parity_tol": POS, "rollout.log_prob_parity_every": COUNT0,
    "rollout.bucket_mb": COUNT, "rollout.max_retries": COUNT0, "rollout.tp": COUNT, "rollout.ep": COUNT,
    "rollout.mem_fraction_static": Range(lo=0, hi=1, lo_open=True, hi_open=True),
    "rollout.agent.max_turns": COUNT, "rollout.agent.max_total_tokens": COUNT,
    "rollout.agent.step_timeout_s": POS, "rollout.agent.max_workers": COUNT,
    "algo.gamma": Range(lo=0, hi=1), "algo.lam": Range(lo=0, hi=1),
    "algo.std_eps": POS,
    "algo.clip_low": Range(lo=0, hi=1, hi_open=True),  # the ratio's floor 1 - clip_low stays > 0
    "algo.clip_high": Range(lo=0),
    "algo.dual_clip": Range(lo=1, lo_open=True, null=True),
    "algo.entropy_coef": Range(lo=0),
    "algo.kl.beta": Range(lo=0), "algo.kl.target": POS, "algo.kl.horizon": COUNT,
    "algo.ppo_epochs": COUNT, "algo.num_mini_batches": COUNT,
    "algo.micro_batch_size": COUNT0, "algo.forward_micro_batch_size": COUNT0,  # 0: all at once
    "algo.micro_batch_tokens": COUNT0, "algo.log_prob_chunk": COUNT0,  # 0: off
    "algo.dynamic_sampling.max_rounds": COUNT,
    "algo.min_partial_size": Range(lo=1, null=True),
    "algo.rollout_correction.token_is_cap": Range(lo=1, null=True),
    "algo.rollout_correction.seq_mask_threshold": Range(lo=0, lo_open=True, null=True),
    **{f"actor.optim.{k}": v for k, v in _OPTIM.items()},
    "actor.moe_aux_loss_coeff": Range(lo=0), "actor.moe_z_loss_coeff": Range(lo=0, null=True),
    **{f"critic.optim.{k}": v for k, v in _OPTIM.items()},
    "reference.refresh_every": COUNT0,
    "critic.value_clip": Range(lo=0, lo_open=True, null=True),
    "critic.micro_batch_size": COUNT0,  # 0: the whole mini-batch at once
    "critic.warmup_iters": COUNT0,
    "reward.model.weight": Range(),
    "reward.timeout_s": Range(lo=0, lo_open=True, null=True),
    "reward.max_retries": COUNT0,
    "reward.retry_backoff_s": Range(lo=0),
    "reward.workers": COUNT,
    "reward.kill_grace_s": POS,
    "reward.max_memory_mb": Range(lo=64, null=True),
    "reward.cpu_time_s": Range(lo=0, lo_open=True, null=True),
    "reward.overlong_buffer": Range(lo=1, null=True),  # and <= rollout.max_new_tokens (checked with it)
    "eval.every": COUNT0,
    "eval.n": COUNT,
    "eval.max_new_tokens": Range(lo=1, null=True),
    "eval.success_threshold": Range(),
    "eval.samples_per_prompt": COUNT,
    "eval.temperature": POS,
    "eval.top_p": Range(lo=0, hi=1, lo_open=True),
    "eval.k": Range(lo=1, each=True),
    "eval.seed": SEED,
    **{f"trainer.phase_timeout_s.{k}": Range(lo=0, lo_open=True, null=True)
       for k in ("exporting", "rollout_loading", "rollout_ready", "generating", "experience_sealed",
                 "updating_from")},
    "trainer.iterations": COUNT,
    "trainer.prompts_per_iteration": COUNT,
    "trainer.seed": SEED,
    "trainer.export_every": COUNT0,
    "trainer.max_wall_minutes": Range(lo=0, lo_open=True, null=True),
    "reward.model.timeout_s": Range(lo=0, lo_open=True, null=True),
    "trainer.peak_flops": Range(lo=0, lo_open=True, null=True),
    "trainer.checkpoint_every": COUNT0,
    "trainer.checkpoint_keep": COUNT,
    "trainer.max_update_retries": COUNT0,
    "trainer.profile_iterations": ITERATIONS,
    "trainer.log_samples_every": COUNT0,
    "trainer.log_samples_n": COUNT,
    "trainer.log_samples_console": COUNT0,
    "faults.crash_during_checkpoint_at": Range(lo=0, null=True),
    "faults.crash_during_update_at": Range(lo=0, null=True),
    "faults.corrupt_weight_sync_at": ITERATIONS,
    "faults.rollout_error_rate": RATE,
    "faults.duplicate_result_rate": RATE,
    "faults.reward_timeout_rate": RATE,
    "faults.fail_optimizer_step_at": ITERATIONS,
    "faults.hold_after_iteration": ITERATIONS,
    "faults.reward_model_error_at": ITERATIONS,
    "faults.reward_model_timeout_at": ITERATIONS,
    "faults.fail_optimizer_step_rank": Range(lo=-1),  # -1: the last rank; < world size (checked with it)
    "faults.seed": SEED,
}


def lookup(cfg, dotted: str):
    """The value at ``dotted`` in a :class:`~megarl.config.TrainConfig`; ``(False, None)`` when
    a section on the way is absent (``critic`` is null for GRPO) or the key is unknown."""
    node = cfg
    for part in dotted.split("."):
        if node is None or not hasattr(node, part):
            return False, None
        node = getattr(node, part)
    return True, node


def range_errors(cfg):
    """``(key, message)`` for every value out of its range, in table order."""
    for key, rule in RANGES.items():
        found, v = lookup(cfg, key)
        if not found:
            continue
        items = list(enumerate(v)) if rule.each and v is not None else [(None, v)]
        for i, item in items:
            if not rule.ok(item):
                name = key if i is None else f"{key}[{i}]"
                yield name, f"must be {rule.describe()}, got {item!r}"
