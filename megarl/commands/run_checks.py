"""Start-up checks of a run, assembled: the config's own (:mod:`megarl.config.validation`:
types, ranges, sizes that must divide, settings that contradict each other), then each feature's
check of the keys it owns -- the names it registers, the packages it needs, what it can load.

The config package never imports a feature; a feature checks its own section here, at the place
that assembles the run, so a new estimator, environment or tracker brings its own check.  Every
failure is a :class:`~megarl.errors.ConfigError` naming the key, before any model loads (the
model's fit to the layout, which needs its ``config.json``, is :func:`megarl.models.fit.validate_model_fit`).
"""

from __future__ import annotations

from megarl.algo.config_checks import check_algorithm_names, check_estimator_needs
from megarl.builtin.tasks.config_checks import check_builtin_task
from megarl.config.validation import validate, validate_agent_args, validate_agent_settings, validate_eval_settings
from megarl.envs.config_checks import check_environment
from megarl.models.fit import check_packing
from megarl.observability.trackers import check_loggers
from megarl.rewards.config_checks import check_judges, check_required_fields, check_reward_isolation

__all__ = ["check_run", "check_evaluation", "FEATURE_CHECKS"]

#: each feature's check of the keys it owns, by the config section it runs before
#: (:data:`megarl.config.validation.SECTIONS`)
FEATURE_CHECKS = {
    "agent": (check_environment,),
    "choices": (check_algorithm_names, check_builtin_task),
    "eval": (check_required_fields,),
    "trackers": (check_reward_isolation, check_judges, check_loggers),
    "algorithm": (check_estimator_needs,),
    "batches": (check_packing,),
}


def check_run(cfg, world_size: int) -> int:
    """Everything a training run can check before it loads a model; returns the data-parallel size."""
    return validate(cfg, world_size, FEATURE_CHECKS)


def check_evaluation(cfg) -> None:
    """What ``python -m megarl.eval`` checks: it trains nothing, so the ``eval`` section, the
    data-vs-reward keys and the environment."""
    check_required_fields(cfg)
    validate_eval_settings(cfg)
    check_builtin_task(cfg)
    validate_agent_args(cfg)
    check_environment(cfg)
    validate_agent_settings(cfg)
