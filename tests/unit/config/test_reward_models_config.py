"""``reward.models``: several neural reward models next to ``reward.model``, each entry checked by
its own key before any model loads."""

import os

import pytest

from megarl.commands.run_checks import check_run
from megarl.config import ConfigError, load_config

from tests._dist import ROOT
GRPO = os.path.join(ROOT, "configs", "grpo_arith_tiny.yaml")


def test_entries_in_scoring_order_with_their_keys():
    cfg = load_config(GRPO, ["reward.model.path=/a", "reward.models=[{name: style, path: /b, weight: 0.5}]"])
    assert [(k, m.name, m.path, m.weight) for k, m in cfg.reward.neural_models()] == [
        ("reward.model", "reward_model", "/a", 1.0), ("reward.models[0]", "style", "/b", 0.5)]
    assert load_config(GRPO, []).reward.neural_models() == []
    # reward models alone score the samples: no rule needed; so do judges
    assert check_run(load_config(GRPO, ["reward.fn=null", "reward.models=[{name: style, path: /b}]"]), 1) == 1
    assert check_run(load_config(GRPO, ["reward.fn=null", "reward.judges=[{name: j, path: /j}]"]), 1) == 1
    # one process reward model is grpo_process's step source
    assert check_run(load_config(GRPO, ["reward.models=[{name: p, path: /p, kind: process, step_separator: ','}]",
                                        "algo.advantage=grpo_process"]), 1) == 1


@pytest.mark.parametrize("overrides,key", [
    (["reward.models=[{name: style}]"], "reward.models[0].path: is required"),
    (["reward.model.path=/a", "reward.models=[{path: /b}]"], "reward.models[0].name: 'reward_model' is also reward.model's"),
    (["reward.models=[{name: a/b, path: /b}]"], "reward.models[0].name: must be a component name"),
    (["reward.models=[{name: s, path: /b, timeout_s: -1}]"], "reward.models[0].timeout_s: must be > 0 or null"),
    (["reward.models=[{name: s, path: /b, wieght: 1}]"], "override 'reward.models=[{name: s, path: /b, wieght: 1}]'"),
    (["reward.fn=null"], "reward.fn: is null and no reward model or judge is given"),
    (["reward.models=[{name: s, path: /b}]", "faults.reward_model_timeout_at=[1]"],
     "faults.reward_model_timeout_at: holds the reward model's forward past reward.models[0].timeout_s"),
    # a reference-guided reward model's user turn: never the response
    (["reward.models=[{name: s, path: /b, prompt: '{prompt} {response}'}]"],
     "reward.models[0].prompt: {response} is not the user turn's"),
    (["reward.model.path=/a", "reward.model.prompt='{0}'"], "reward.model.prompt: field(s) ['0'] are not names"),
    # generative judges (reward.judges): the prompt must read the response, the rule must parse
    (["reward.judges=[{name: j}]"], "reward.judges[0].path: is required"),
    (["reward.judges=[{name: j, path: /j, prompt: 'is {prompt} hard ?'}]"],
     "reward.judges[0].prompt: the judge's prompt has no {response}"),
    (["reward.judges=[{name: j, path: /j, verdict: score}]"], "reward.judges[0]: verdict score needs a pattern"),
    (["reward.judges=[{name: j, path: /j, verdict: maybe}]"], "reward.judges[0].verdict: 'maybe' is not one of"),
    (["reward.judges=[{name: j, path: /j, verdict: score, pattern: '(x)', probability: true}]"],
     "reward.judges[0].probability: reads P(yes)"),
    (["reward.models=[{name: j, path: /b}]", "reward.judges=[{name: j, path: /j}]"],
     "reward.judges[0].name: 'j' is also reward.models[0]'s"),
    (["reward.judges=[{name: j, path: /j, max_new_tokens: 0}]"], "reward.judges[0].max_new_tokens: must be >= 1"),
    (["reward.judges=[{name: j, path: /j, engine: vllm}]"], "reward.judges[0].engine: 'vllm' is not one of"),
    (["reward.judges=[{name: j, path: /j, engine: sglang, offload: true}]"],
     "reward.judges[0].offload: with reward.judges[0].engine=sglang"),
    (["reward.judges=[{name: j, path: /j, engine: sglang, mem_fraction_static: 1.5}]"],
     "reward.judges[0].mem_fraction_static: must be"),
    # process reward models: a separator, one step source for grpo_process
    (["reward.models=[{name: p, path: /p, kind: process}]"], "reward.models[0].step_separator: is required"),
    (["reward.models=[{name: p, path: /p, kind: steps, step_separator: ','}]"], "reward.models[0].kind: 'steps'"),
    (["reward.models=[{name: p, path: /p}]", "algo.advantage=grpo_process"], "algo.advantage: 'grpo_process' reads"),
    (["reward.models=[{name: p, path: /p, kind: process, step_separator: ','}, {name: q, path: /q, kind: process, "
      "step_separator: ','}]", "algo.advantage=grpo_process"], "algo.advantage: 'grpo_process' reads"),
])
def test_a_bad_entry_is_refused_naming_its_key(overrides, key):
    with pytest.raises(ConfigError) as e:
        check_run(load_config(GRPO, overrides), 1)
    assert str(e.value).startswith(key), str(e.value)


def test_a_judge_on_sglang_needs_sglang_installed():
    """``reward.judges[i].engine: sglang`` where SGLang is not installed: named by key (a real start
    raises it; a dry run reports it as not checked here)."""
    import importlib.util

    from megarl.config.validation import missing_packages

    cfg = load_config(GRPO, ["reward.judges=[{name: a, path: /a}, {name: b, path: /b, engine: sglang}]"])
    missing = dict(missing_packages(cfg))
    if importlib.util.find_spec("sglang") is None:
        assert "'sglang' is not installed here" in missing["reward.judges[1].engine"]
    assert "reward.judges[0].engine" not in missing  # the hf engine needs nothing more
