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
    # the adapter served by the engine itself: SGLang's LoRA backends, in hybrid placement
    (["actor.lora.rank=8", "actor.lora.engine=peft"], "actor.lora.engine"),
    (["actor.lora.rank=8", "actor.lora.engine=adapter"], "actor.lora.engine"),  # rollout.backend=hf
    (["actor.lora.engine=adapter", "rollout.backend=sglang"], "actor.lora.engine"),  # rank 0
    (["actor.lora.rank=8", "actor.lora.engine=adapter", "rollout.backend=sglang", "placement.mode=split",
      "rollout.enable_memory_saver=false"],
     "actor.lora.engine"),
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


def test_an_adapter_served_engine_is_refused_for_a_mixture_of_experts_model(tmp_path):
    """``actor.lora.engine: adapter`` on an MoE model: refused naming the key before SGLang starts
    (its LoRA on routed experts is not proven here); a dense model gets SGLang's LoRA set-up with
    the HF linears each megatron target stands for."""
    import json

    from megarl.control.placement import engine_lora

    cfg = load_config(GRPO, ["actor.lora.rank=8", "actor.lora.engine=adapter", "rollout.backend=sglang",
                             "actor.lora.target_modules=[linear_qkv,linear_fc1]"])
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    assert engine_lora(cfg, str(tmp_path)) == {"rank": 8, "target_modules": ["q_proj", "k_proj", "v_proj",
                                                                             "gate_proj", "up_proj"]}
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3_moe", "num_experts": 8}))
    with pytest.raises(ConfigError, match=r"^actor\.lora\.engine: 'adapter' is not built for a mixture"):
        engine_lora(cfg, str(tmp_path))
    assert engine_lora(load_config(GRPO, ["actor.lora.rank=8"]), str(tmp_path)) is None
