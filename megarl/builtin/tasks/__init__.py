"""The built-in tasks, one module each, registered by name (``data.task.name``).

A task module is the whole of a task: the problem files a recipe trains and evaluates on, the
sequences the tiny model is warm-started on, and the settings both read.  It exports

* ``Settings`` -- a frozen dataclass of the task's own keys (``data.task.args``), each declaring
  its range or choices (:func:`megarl.config.schema.setting`), with a ``check()`` for the keys
  that constrain each other;
* ``REWARD`` -- the ``reward.fn`` that scores it, or None where its environment does;
* ``splits(settings, train_n, heldout_n)`` -- ``{"train": make_rows, "heldout": make_rows}``;
* ``WarmStart`` -- its warm-start sequence source (:class:`megarl.builtin.warmstart.SequenceSource`);
* ``recorded(settings)`` -- what ``tiny_model.json`` records of these settings (dotted key ->
  value) and ``CONFIG_KEYS``, the config key behind each entry;
* ``DEFAULTS`` -- its build's defaults (``steps``, ``target_accuracy``, ``check_every``; ``lr`` where it is not
  the tiny model's 2e-3).

A new task is a new module here and one line in :data:`REGISTRY`.
"""

from __future__ import annotations

import dataclasses
import importlib
import typing

from megarl.errors import ConfigError

#: task name -> its module
REGISTRY = {
    "arithmetic": "megarl.builtin.tasks.arithmetic",
    "calculator": "megarl.builtin.tasks.calculator",
    "two_turn": "megarl.builtin.tasks.two_turn",
    "running_sum": "megarl.builtin.tasks.running_sum",
    "arithmetic_judge": "megarl.builtin.tasks.arithmetic_judge",  # a judge's warm start, not a policy's task
}
TASKS = tuple(REGISTRY)
#: the tasks that warm-start a generative judge (``reward.judges``), never a policy's ``data.task.name``
JUDGE_TASKS = ("arithmetic_judge",)
POLICY_TASKS = tuple(n for n in TASKS if n not in JUDGE_TASKS)


def get_task(name: str, key: str = "data.task.name"):
    """The task module registered as ``name``; an unknown name is refused naming ``key``."""
    if name not in REGISTRY:
        raise ConfigError(f"{key}: unknown built-in task {name!r}; choose from {', '.join(TASKS)}")
    return importlib.import_module(REGISTRY[name])


def task_settings(name: str, args, key: str = "data.task.args"):
    """``args`` (a mapping) as the task's typed ``Settings``: an unknown key, a value of the wrong
    type or out of its range is refused naming ``key.<name>``; keys not given take their defaults."""
    task = get_task(name)
    fields = {f.name: f for f in dataclasses.fields(task.Settings)}
    hints = typing.get_type_hints(task.Settings)
    args = dict(args or {})
    unknown = sorted(set(args) - set(fields))
    if unknown:
        raise ConfigError(f"{key}: task {name} takes no {', '.join(unknown)} (its keys: {', '.join(fields)})")
    where = (lambda k: f"{key} {k}") if key.startswith("--") else (lambda k: f"{key}.{k}")  # a CLI flag or a key
    values = {}
    for k, v in args.items():
        values[k] = _typed(where(k), v, hints[k])
        rule, choices = fields[k].metadata.get("range"), fields[k].metadata.get("choices")
        if rule is not None and not rule.ok(values[k]):
            raise ConfigError(f"{where(k)}: must be {rule.describe()}, got {v!r}")
        if choices is not None and values[k] not in choices:
            raise ConfigError(f"{where(k)}: must be one of {', '.join(map(str, choices))}, got {v!r}")
    settings = task.Settings(**values)
    problem = settings.check()
    if problem:
        raise ConfigError(f"{where(problem[0])}: {problem[1]}")
    return settings


def _typed(key: str, v, tp):
    if tp is float and isinstance(v, int) and not isinstance(v, bool):
        return float(v)
    if tp in (int, float, str, bool) and (type(v) is not tp):
        raise ConfigError(f"{key}: expects {tp.__name__}, got {v!r}")
    return v


def settings_dict(settings) -> dict:
    """The settings as a plain mapping (``--task-arg`` / ``data.task.args`` spelling)."""
    return dataclasses.asdict(settings)


def warmstart_run(cfg):
    """The warm start a config asks for (``model.tiny.warmstart_*``, ``data.task``)."""
    from megarl.builtin.warmstart import WarmStartRun

    t, task = cfg.model.tiny, cfg.data.task
    return WarmStartRun(steps=t.warmstart_steps, batch=t.warmstart_batch, seed=t.seed, lr=t.warmstart_lr,
                        adam_beta2=t.warmstart_adam_beta2, target_accuracy=t.warmstart_target_accuracy or 0.0,
                        check_every=get_task(task.name).DEFAULTS["check_every"], heldout_n=task.heldout_n)
