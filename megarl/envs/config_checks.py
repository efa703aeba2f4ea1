"""The environment's own start-up check: ``rollout.agent.env`` loads with its arguments, so a
misspelt argument or an unimportable plug-in fails before any model loads, naming the key.

Run by the command that assembles the run (:mod:`megarl.commands.run_checks`), after the
config's own checks.
"""

from __future__ import annotations

from megarl.envs.protocol import EnvConfigError, load_environment
from megarl.errors import ConfigError

__all__ = ["check_environment"]


def check_environment(cfg) -> None:
    ag = cfg.rollout.agent
    if not ag.env:
        return
    try:
        load_environment(ag.env, **ag.env_args)
    except EnvConfigError as e:
        raise ConfigError(str(e)) from None
