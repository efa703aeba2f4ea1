"""A key's type, range and choices are declared in one place, its schema field: every declared
choice is enforced naming the key, and the range table is the schema's own."""

import copy
import os

import pytest

from megarl.commands.run_checks import check_run
from megarl.config import ConfigError, load_config, schema
from megarl.config.ranges import RANGES, _declared

from tests._dist import ROOT
GRPO = os.path.join(ROOT, "configs", "grpo_arith_tiny.yaml")
PPO = os.path.join(ROOT, "configs", "ppo_arith_tiny.yaml")

CHOICES = {key: f.metadata["choices"] for key, f in _declared(schema.TrainConfig) if "choices" in f.metadata}
#: what a key's choice is checked under (it is read only then)
NEEDS = {"parallel.recompute.modules": ["parallel.recompute.granularity=selective"]}


def test_a_field_declares_a_range_or_choices_never_both():
    both = [key for key, f in _declared(schema.TrainConfig) if {"range", "choices"} <= set(f.metadata)]
    assert not both
    assert len(CHOICES) >= 25 and len(RANGES) >= 140
    assert CHOICES["placement.mode"] == schema.PLACEMENTS and CHOICES["algo.name"] == schema.ALGORITHMS


@pytest.mark.parametrize("task", ["arithmetic", "calculator", "two_turn", "running_sum", "arithmetic_judge"])
def test_every_task_setting_declares_what_it_accepts_and_is_enforced(task):
    """A built-in task's own keys (data.task.args) follow the schema's rule: every int / float
    declares its range; a value out of it, or not of a declared choice, is refused naming the key."""
    import dataclasses
    import typing

    from megarl.builtin.tasks import TASKS, get_task, task_settings

    assert set(TASKS) == {"arithmetic", "calculator", "two_turn", "running_sum", "arithmetic_judge"}
    settings = get_task(task).Settings
    hints = typing.get_type_hints(settings)
    for f in dataclasses.fields(settings):
        if hints[f.name] in (int, float):
            rule = f.metadata["range"]  # KeyError: a numeric key without a declared range
            bad = next(v for v in (-1, 10 ** 9, 0, 1.5) if not rule.ok(v) and (hints[f.name] is float or v != 1.5))
            with pytest.raises(ConfigError, match=rf"^data\.task\.args\.{f.name}: must be"):
                task_settings(task, {f.name: bad})
        elif "choices" in f.metadata:
            with pytest.raises(ConfigError, match=rf"^data\.task\.args\.{f.name}: must be one of"):
                task_settings(task, {f.name: "bogus"})


@pytest.mark.parametrize("key", sorted(CHOICES))
def test_every_declared_choice_is_enforced_naming_the_key(key):
    path = PPO if key.startswith("critic.") else GRPO
    cfg = load_config(path, NEEDS.get(key, []))
    node = cfg
    *parents, leaf = key.split(".")
    for part in parents:
        node = getattr(node, part)
    each = isinstance(getattr(node, leaf), list)
    setattr(node, leaf, ["bogus"] if each else "bogus")
    with pytest.raises(ConfigError) as e:
        check_run(copy.deepcopy(cfg), 1)
    name = f"{key}[0]" if each else key
    assert str(e.value) == f"{name}: 'bogus' is not one of {list(CHOICES[key])}"


def test_the_optimizer_choices_hold_for_the_critic_too():
    cfg = load_config(PPO, [])
    cfg.critic.optim.lr_decay_style = "bogus"
    with pytest.raises(ConfigError, match=r"^critic\.optim\.lr_decay_style: 'bogus' is not one of"):
        check_run(cfg, 1)  # one declaration (OptimSettings) serves actor.optim and critic.optim
