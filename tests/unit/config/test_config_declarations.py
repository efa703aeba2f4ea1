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
    assert len(CHOICES) >= 25 and len(RANGES) >= 150
    assert CHOICES["placement.mode"] == schema.PLACEMENTS and CHOICES["algo.name"] == schema.ALGORITHMS


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
