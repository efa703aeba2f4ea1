"""The start-up check of ``data.task``: a registered name, its ``args`` as the task's typed
settings, and those settings against the tiny model's warm start (``model.tiny.*``)."""

from __future__ import annotations

from megarl.builtin.tasks import JUDGE_TASKS, POLICY_TASKS, get_task, task_settings, warmstart_run
from megarl.errors import ConfigError


def check_builtin_task(cfg) -> None:
    task = cfg.data.task
    if task.name is None:
        return
    if task.name in JUDGE_TASKS:
        raise ConfigError(f"data.task.name: {task.name} is a generative judge's warm start (python -m megarl.tinymodel "
                          f"--task {task.name}; the judge goes in reward.judges), not a policy's task; choose from "
                          f"{', '.join(POLICY_TASKS)}")
    settings = task_settings(task.name, task.args)
    check_run = getattr(settings, "check_run", None)
    if cfg.model.build_tiny and check_run is not None:
        problem = check_run(warmstart_run(cfg))
        if problem:
            raise ConfigError(f"data.task.args.{problem[0]}: {problem[1]} (model.tiny.warmstart_steps, "
                              "model.tiny.warmstart_target_accuracy)")
