"""The algorithm's own start-up checks: the names ``algo.*`` selects exist in the registries, and
the roles the chosen estimator reads are configured (its registry entry says what it needs).

Run by the command that assembles the run (:mod:`megarl.commands.run_checks`), after the
config's own checks; each failure a :class:`~megarl.errors.ConfigError` naming the key.
"""

from __future__ import annotations

import megarl.algo.advantages  # noqa: F401  (registers the estimators)
import megarl.algo.distillation  # noqa: F401  (registers on_policy_distill)
import megarl.algo.policy_loss  # noqa: F401  (registers the policy losses)
from megarl.algo.aggregation import AGG_MODES
from megarl.algo.kl import KL_ESTIMATORS
from megarl.algo.registry import advantage_names, advantage_needs, policy_loss_names
from megarl.errors import require, require_choice

__all__ = ["check_algorithm_names", "check_estimator_needs"]


def check_algorithm_names(cfg) -> None:
    """``algo.advantage``, ``algo.policy_loss``, ``algo.agg_mode`` and ``algo.kl.estimator`` name
    registered functions."""
    a = cfg.algo
    require_choice(a.advantage, "algo.advantage", advantage_names())
    require_choice(a.policy_loss, "algo.policy_loss", policy_loss_names())
    require_choice(a.agg_mode, "algo.agg_mode", AGG_MODES)
    require_choice(a.kl.estimator, "algo.kl.estimator", KL_ESTIMATORS)


def check_estimator_needs(cfg) -> None:
    """The estimator's needs (a critic, groups of G >= 2, no step rewards) are met."""
    a, r = cfg.algo, cfg.rollout
    needs = advantage_needs(a.advantage)
    critic_free = [n for n in advantage_names() if not advantage_needs(n).critic and not advantage_needs(n).step_rewards]
    if a.name == "grpo":
        require(not needs.critic, "algo.advantage",
                f"{a.advantage!r} needs a critic; algo.name=grpo has none (use one of {critic_free})")
    else:
        critic_ests = [n for n in advantage_names() if advantage_needs(n).critic]
        require(needs.critic, "algo.advantage",
                f"algo.name=ppo uses the critic: expected one of {critic_ests}, got {a.advantage!r}")
    if needs.step_rewards:  # process rewards: the reward function must place steps
        fn = None
        if cfg.reward.fn and cfg.reward.fn != "composite":
            from megarl.rewards.dataset_fields import configured_reward

            fn = configured_reward(cfg)
        process = [m for _, m in cfg.reward.neural_models() if m.kind == "process"]
        rule_steps = getattr(fn, "places_steps", False) and not cfg.reward.neural_models()
        model_steps = len(process) == 1 and not getattr(fn, "places_steps", False)
        # an environment's reward of each turn, on the turn's last policy token (its applies_to)
        env_turns = bool(cfg.rollout.agent.env) and not cfg.reward.neural_models()
        require((rule_steps or model_steps or env_turns) and not cfg.reward.judges,
                "algo.advantage",
                f"{a.advantage!r} reads per-step process rewards from one source: reward.fn placing them "
                f"(running_sum_steps, or a function with places_steps = True) without reward models, one "
                f"reward model of kind process, or an agent environment's per-turn rewards (rollout.agent.env), "
                f"and no judge; got reward.fn={cfg.reward.fn!r} "
                f"(or use one of {critic_free})")
    require(not (needs.teacher or a.distill_coef) or bool(cfg.teacher.path), "teacher.path",
            f"is null, but algo.advantage={a.advantage!r} with algo.distill_coef={a.distill_coef} distils from a "
            "teacher: set teacher.path to an HF causal LM with the actor's tokenizer")
    require(not (needs.teacher and a.distill_coef), "algo.distill_coef",
            "on_policy_distill is the teacher's advantage alone; distill_coef weighs it beside another estimator")
    require(not cfg.teacher.path or needs.teacher or a.distill_coef, "teacher.path",
            f"is set, but nothing reads the teacher: algo.advantage={a.advantage!r} and algo.distill_coef=0 "
            "(use on_policy_distill, or a distill_coef > 0)")
    sft = a.sft
    require(not sft.path or sft.coef > 0, "algo.sft.coef",
            f"is 0, but algo.sft.path={sft.path!r} is set: give the SFT term a weight > 0 (or drop the path)")
    require(bool(sft.path) or sft.coef == 0, "algo.sft.path",
            f"is null, but algo.sft.coef={sft.coef}: set it to a demonstration file (prompts with a "
            f"{sft.response_field!r} field)")
    require(not sft.path or a.routing_replay != "rollout", "algo.sft.path",
            "with algo.routing_replay=rollout: demonstration rows have no recorded routing to replay")
    require(a.reward_placement == "last_token" or needs.token_rewards, "algo.reward_placement",
            f"recorded places rewards for a token-reward estimator ({[n for n in advantage_names() if advantage_needs(n).token_rewards]}); "
            f"algo.advantage={a.advantage!r} reads "
            + ("each record's parts itself" if needs.step_rewards else "one score per sample")
            + " (grpo_process credits turns and steps)")
    if needs.groups:
        require(r.n >= 2, "rollout.n", f"the group estimator {a.advantage!r} needs G >= 2 samples per prompt, got {r.n}")
    require(not a.dynamic_sampling.enabled or needs.groups, "algo.dynamic_sampling.enabled",
            "filters zero-spread groups, which only exist with a group estimator")
