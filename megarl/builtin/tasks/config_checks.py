"""The start-up check of ``data.task``: a registered name, its ``args`` as the task's typed
settings, and those settings against the tiny model's warm start (``model.tiny.*``)."""

from __future__ import annotations

from megarl.builtin.tasks import get_task, task_settings, warmstart_run
from megarl.errors import ConfigError


def check_builtin_task(cfg) -> None:
    task = cfg.data.task
    if task.name is None:
        return
    get_task(task.name)
    settings = task_settings(task.name, task.args)
    check_run = getattr(settings, "check_run", None)
    if cfg.model.build_tiny and check_run is not None:
        problem = check_run(warmstart_run(cfg))
        if problem:
            raise ConfigError(f"data.task.args.{problem[0]}: {problem[1]} (model.tiny.warmstart_steps, "
                              "model.tiny.warmstart_target_accuracy)")
