"""Algorithm core: advantages, KL, policy / value losses, loss aggregation (pure torch, rank-agnostic).

Importing the package registers every advantage estimator and policy loss.
"""

from megarl.algo import advantages as _advantages  # noqa: F401  (registers estimators)
from megarl.algo import distillation as _distillation  # noqa: F401  (registers on_policy_distill)
from megarl.algo import policy_loss as _policy_loss  # noqa: F401  (registers policy losses)
from megarl.algo.registry import get_advantage, get_policy_loss, register_advantage, register_policy_loss

__all__ = ["get_advantage", "get_policy_loss", "register_advantage", "register_policy_loss"]
