"""The reward's own start-up checks: the isolation of the reward workers and the fields a reward
declares it reads.

Run by the command that assembles the run (:mod:`megarl.commands.run_checks`), after the
config's own checks; each failure a :class:`~megarl.errors.ConfigError` naming the key.
"""

from __future__ import annotations

import os

from megarl.errors import ConfigError, require, require_choice
from megarl.rewards.base import RewardConfigError
from megarl.rewards.declarations import normalise_requirements
from megarl.rewards.isolation import ISOLATION_MODES, resolve_isolation

__all__ = ["check_judges", "check_reward_isolation", "check_required_fields", "check_sandbox_hides_data"]


def check_judges(cfg) -> None:
    """Each generative judge's prompt reads the response, and its verdict rule can be parsed;
    each reference-guided reward model's prompt is a user turn's template."""
    from megarl.rewards.verdicts import VERDICTS, VerdictRule, check_context_template, check_template

    for key, m in cfg.reward.neural_models():
        if m.prompt is not None:
            try:
                check_context_template(m.prompt, f"{key}.prompt")
            except ValueError as e:
                raise ConfigError(str(e)) from None

    for i, j in enumerate(cfg.reward.judges):
        key = f"reward.judges[{i}]"
        require_choice(j.verdict, f"{key}.verdict", VERDICTS)
        try:
            check_template(j.prompt, f"{key}.prompt")
            VerdictRule(j.verdict, j.yes, j.no, j.pattern)
        except ValueError as e:
            msg = str(e)
            raise ConfigError(msg if msg.startswith(key) else f"{key}: {msg}") from None


def check_reward_isolation(cfg) -> None:
    """``reward.isolation`` and its worker limits: limits apply to worker processes only, and the
    timeout fault is injected in the trainer (so not through a process boundary)."""
    rw = cfg.reward
    require_choice(rw.isolation, "reward.isolation", ISOLATION_MODES)
    require(rw.workers >= 1, "reward.workers", f"must be >= 1, got {rw.workers}")
    require(rw.kill_grace_s > 0, "reward.kill_grace_s", f"must be > 0 seconds, got {rw.kill_grace_s}")
    require(rw.max_memory_mb is None or rw.max_memory_mb >= 64, "reward.max_memory_mb",
            f"must be >= 64 (the worker's whole address space) or null, got {rw.max_memory_mb}")
    require(rw.cpu_time_s is None or rw.cpu_time_s > 0, "reward.cpu_time_s", f"must be > 0 or null, got {rw.cpu_time_s}")
    if rw.fn is not None and resolve_isolation(rw.isolation, rw.fn, list(rw.components or [])) == "thread":
        for key in ("max_memory_mb", "cpu_time_s"):
            require(getattr(rw, key) is None, f"reward.{key}",
                    f"limits worker processes, but reward.fn {rw.fn!r} runs on threads (reward.isolation="
                    f"{rw.isolation}); set reward.isolation=process or drop the limit")
    require(not (cfg.faults.reward_timeout_rate and rw.isolation == "process"), "reward.isolation",
            "'process' cannot carry faults.reward_timeout_rate (the fault wrapper lives in the trainer); use thread or auto")


def check_required_fields(cfg) -> None:
    """``reward.required_fields``, when given, is a list of field names or alternatives."""
    if cfg.reward.required_fields is None:
        return
    try:
        normalise_requirements(list(cfg.reward.required_fields), "reward.required_fields")
    except RewardConfigError as err:
        raise ConfigError(str(err)) from None


def check_sandbox_hides_data(cfg, reward) -> None:
    """A reward that runs the candidate's program in a sandbox (``visible_paths()``: the host
    paths the program can read) must not show it the task: the data sources and the run
    directory lie outside every visible path, or the start-up is refused naming the key."""
    for _, _, part in getattr(reward, "parts", ()):  # a composite's parts
        check_sandbox_hides_data(cfg, part)
    show = getattr(reward, "visible_paths", None)
    roots = show() if callable(show) else None
    if not roots:
        return
    d = cfg.data
    keys = [("data.train_path", d.train_path), ("data.heldout_path", d.get("heldout_path")),
            ("trainer.run_dir", cfg.trainer.get("run_dir"))]
    for key, path in keys:
        if not path or not isinstance(path, str):
            continue
        real = os.path.realpath(path)
        for r in roots:
            rr = os.path.realpath(r)
            if real == rr or real.startswith(rr.rstrip("/") + "/"):
                raise ConfigError(f"{key}: {path} is inside {r}, which is visible to the sandboxed program "
                                  "(its interpreter's files): move it elsewhere, or point reward.kwargs.python at "
                                  "an interpreter installed outside it")
