"""Sampled KL estimators, their placement, and the adaptive KL coefficient.

For a response token a_t sampled from the behaviour policy, with log-probs ``log_p`` under the
policy being regularised and ``log_ref`` under the reference, let the signed log-ratio be

    l_t = log pi(a_t) - log pi_ref(a_t).

Estimators of KL(pi || pi_ref) from one sample (Schulman 2020, "Approximating KL divergence"):

- k1 = l_t                              unbiased, high variance, can be negative (it is *not*
                                        a KL value per token, only its sampled log-ratio)
- k2 = 0.5 * l_t ** 2                   biased, low variance, >= 0
- k3 = exp(-l_t) - 1 + l_t              unbiased, low variance, >= 0; with r = pi_ref / pi this
     = r - log r - 1                    is the estimator of DeepSeekMath GRPO (Shao et al. 2024, eq. 4)

Placement (a config, never implicit):
- ``reward``: a per-token shaped reward ``-beta * k1`` with pi = the old (behaviour) policy,
  computed once from sealed facts, PPO / InstructGPT style (Ouyang et al. 2022);
- ``loss``: ``beta * k`` added to the token loss with pi = the current policy and a chosen
  estimator ``k`` (GRPO, Shao et al. 2024);
- ``none``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Literal, get_args

import torch

KLEstimator = Literal["k1", "k2", "k3"]
KL_ESTIMATORS: tuple[str, ...] = get_args(KLEstimator)
KLPlacement = Literal["reward", "loss", "none"]
KL_PLACEMENTS: tuple[str, ...] = get_args(KLPlacement)


def _check(log_p: torch.Tensor, log_ref: torch.Tensor) -> None:
    if log_p.shape != log_ref.shape:
        raise ValueError(f"KL: log_p {tuple(log_p.shape)} and log_ref {tuple(log_ref.shape)} must have the same shape")


def kl_k1(log_p: torch.Tensor, log_ref: torch.Tensor) -> torch.Tensor:
    """k1_t = log pi(a_t) - log pi_ref(a_t) (signed log-ratio; Schulman 2020).

    Args:
        log_p: ``(bs, response_len)`` log-probs of the sampled tokens under pi.
        log_ref: ``(bs, response_len)`` log-probs of the same tokens under pi_ref.
    Returns:
        ``(bs, response_len)``; padding positions carry whatever the inputs carry (mask later).
    """
    _check(log_p, log_ref)
    return log_p - log_ref


def kl_k2(log_p: torch.Tensor, log_ref: torch.Tensor) -> torch.Tensor:
    """k2_t = 0.5 * (log pi(a_t) - log pi_ref(a_t))^2 (Schulman 2020).  Shapes as :func:`kl_k1`."""
    _check(log_p, log_ref)
    d = log_p - log_ref
    return 0.5 * d * d


def kl_k3(log_p: torch.Tensor, log_ref: torch.Tensor) -> torch.Tensor:
    """k3_t = pi_ref/pi - log(pi_ref/pi) - 1 = exp(log_ref - log_p) - (log_ref - log_p) - 1.

    The low-variance unbiased estimator (Schulman 2020) used by DeepSeekMath GRPO (Shao et al.
    2024, eq. 4).  Shapes as :func:`kl_k1`.
    """
    _check(log_p, log_ref)
    d = log_ref - log_p
    return torch.expm1(d) - d


_ESTIMATORS: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "k1": kl_k1,
    "k2": kl_k2,
    "k3": kl_k3,
}


def kl_estimate(log_p: torch.Tensor, log_ref: torch.Tensor, estimator: str) -> torch.Tensor:
    """Dispatch to k1 / k2 / k3 by name; shapes ``(bs, response_len)`` in and out."""
    try:
        fn = _ESTIMATORS[estimator]
    except KeyError:
        raise ValueError(f"KL estimator {estimator!r} is not one of {KL_ESTIMATORS}") from None
    return fn(log_p, log_ref)


@dataclass(frozen=True)
class KLConfig:
    """Where the reference KL enters, with which estimator and coefficient.

    placement: ``reward`` (per-token shaped reward -beta*k1 from old log-probs; estimator must
    be k1, the signed log-ratio), ``loss`` (beta * estimator on current log-probs), ``none``.
    """

    placement: str = "none"
    estimator: str = "k3"
    beta: float = 0.0

    def __post_init__(self) -> None:
        if self.placement not in KL_PLACEMENTS:
            raise ValueError(f"KLConfig.placement {self.placement!r} is not one of {KL_PLACEMENTS}")
        if self.estimator not in KL_ESTIMATORS:
            raise ValueError(f"KLConfig.estimator {self.estimator!r} is not one of {KL_ESTIMATORS}")
        if self.placement == "reward" and self.estimator != "k1":
            raise ValueError("KLConfig.estimator must be 'k1' when placement is 'reward' (shaped reward -beta * k1)")
        if not (self.beta >= 0 and math.isfinite(self.beta)):
            raise ValueError(f"KLConfig.beta must be finite and >= 0, got {self.beta}")


class FixedKLController:
    """A constant KL coefficient (beta never changes)."""

    def __init__(self, beta: float):
        self.value = float(beta)

    def update(self, current_kl: float, n_steps: int) -> float:
        return self.value

    def state_dict(self) -> dict:
        return {"value": self.value}

    def load_state_dict(self, state: dict) -> None:
        self.value = float(state["value"])


class AdaptiveKLController:
    """Adaptive KL coefficient (Ziegler et al. 2019, "Fine-Tuning LMs from Human Preferences").

        e     = clip(KL_current / KL_target - 1, -0.2, 0.2)
        beta <- beta * (1 + e * n_steps / horizon)

    ``current_kl`` is the measured mean per-token KL to the reference over the global batch
    (reduce it over DP before calling); ``n_steps`` the number of samples (or steps) it covers.
    """

    def __init__(self, init_beta: float, target_kl: float, horizon: float):
        if not init_beta > 0:
            raise ValueError(f"AdaptiveKLController.init_beta must be > 0, got {init_beta}")
        if not target_kl > 0:
            raise ValueError(f"AdaptiveKLController.target_kl must be > 0, got {target_kl}")
        if not horizon > 0:
            raise ValueError(f"AdaptiveKLController.horizon must be > 0, got {horizon}")
        self.value = float(init_beta)
        self.target = float(target_kl)
        self.horizon = float(horizon)

    def update(self, current_kl: float, n_steps: int) -> float:
        if not math.isfinite(current_kl):
            raise ValueError(f"AdaptiveKLController.update: current_kl must be finite, got {current_kl}")
        error = min(max(current_kl / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + error * n_steps / self.horizon
        return self.value

    def state_dict(self) -> dict:
        return {"value": self.value, "target": self.target, "horizon": self.horizon}

    def load_state_dict(self, state: dict) -> None:
        self.value, self.target, self.horizon = float(state["value"]), float(state["target"]), float(state["horizon"])
