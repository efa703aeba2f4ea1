"""Environments of multi-turn (agent) rollouts: the protocol, the concurrent runner with
timeouts and error statuses, the built-in ``calculator`` and ``two_turn`` environments, and the
rendering of environment output to tokens by the chat template (with the template's checks).

Modules import lazily: ``from megarl.envs.protocol import Message`` does not load the renderer.
"""

from megarl.envs.protocol import (ENVIRONMENTS, EnvConfigError, Environment, EnvStatus, EnvStepResult, Message,
                                  StepOutcome, load_environment)

__all__ = ["ENVIRONMENTS", "EnvConfigError", "Environment", "EnvStatus", "EnvStepResult", "Message", "StepOutcome",
           "load_environment"]
