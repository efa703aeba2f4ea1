"""``actor.lora``'s refusals before any model loads, each naming its key; rank 0 is full
fine-tuning and refuses nothing."""

import os

import pytest

from megarl.commands.run_checks import check_run
from megarl.config import ConfigError, load_config
from tests._dist import ROOT

GRPO = os.path.join(ROOT, "configs", "grpo_arith_tiny.yaml")
PPO = os.path.join(ROOT, "configs", "ppo_arith_tiny.yaml")


@pytest.mark.parametrize("overrides,key", [
    (["actor.lora.rank=8", "actor.lora.target_modules=[q_proj]"], "actor.lora.target_modules"),
    (["actor.lora.rank=8", "actor.lora.target_modules=[]"], "actor.lora.target_modules"),
    (["actor.lora.rank=8", "actor.lora.init=pissa"], "actor.lora.init"),
    (["actor.lora.rank=-1"], "actor.lora.rank"),
    (["actor.lora.rank=8", "actor.lora.alpha=0"], "actor.lora.alpha"),
    (["actor.lora.rank=8", "actor.lora.dropout=1.0"], "actor.lora.dropout"),
    (["actor.lora.rank=8", "reference.refresh_every=5"], "reference.refresh_every"),
])
def test_refusals_name_the_key(overrides, key):
    with pytest.raises(ConfigError) as e:
        check_run(load_config(GRPO, overrides), 2)
    assert str(e.value).startswith(key + ":"), str(e.value)


def test_rank_zero_is_full_fine_tuning():
    assert check_run(load_config(GRPO, ["actor.lora.target_modules=[q_proj]", "reference.refresh_every=5"]), 1) == 1
    assert check_run(load_config(GRPO, ["actor.lora.rank=16", "actor.lora.target_modules=[linear_qkv]"]), 1) == 1


def test_critic_lora_refusals_name_the_critic_key():
    with pytest.raises(ConfigError, match=r"^critic\.lora\.target_modules:"):
        check_run(load_config(PPO, ["critic.lora.rank=4", "critic.lora.target_modules=[lm_head]"]), 1)
    with pytest.raises(ConfigError, match=r"^critic\.lora\.init:"):
        check_run(load_config(PPO, ["critic.lora.rank=4", "critic.lora.init=zeros"]), 1)
    assert check_run(load_config(PPO, ["critic.lora.rank=4", "actor.lora.rank=4"]), 1) == 1
