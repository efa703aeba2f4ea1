"""``python -m megarl.plan``: every shipped recipe, and the models the anchors train at scale, built
at full size on the meta device at a published or documented layout, every rank brought up on a
fake process group (megarl/commands/full_size.py).  Each proof: the HF tensors of the real
``config.json`` (tests/data/hf_configs) covered exactly once by the shards megarl's own mapping
reads, and by the shards SGLang's ranks keep of the streamed tensors at ``rollout.tp``; the
parameters over the positions equal to the published count; memory per rank per phase against the
device.  Planted faults -- a TP that does not divide the attention heads, a layer count
PP does not divide, an architecture the mapping does not cover, a mapping that leaves a slice of a
tensor out -- are each one ``error:`` line naming what a launch would hit."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests._dist import ROOT, subprocess_env

CONFIGS = os.path.join(ROOT, "tests", "data", "hf_configs")
DATA = ["data.train_path=/nonexistent/train.jsonl"]  # never read: the plan loads no data

#: (id, recipe, world, device GiB, overrides, published parameters in billions, where the layout is from)
PLANS = [
    ("qwen2_7b", "grpo_qwen2_7b.yaml", 8, 80, [], 7.62, "the recipe"),
    ("llama3_8b_ppo", "ppo_llama3_8b.yaml", 8, 80, [f"model.path={CONFIGS}/llama3_8b", "reward.fn=arithmetic"], 8.03,
     "the recipe"),
    ("qwen3_30b_a3b", "grpo_qwen3_30b_a3b.yaml", 8, 141, [], 30.53, "the recipe (slime's layout)"),
    # NeMo-RL's grpo-qwen3-235b-16n8g: TP 2 + SP, CP 2, EP 16, PP 8 with uneven stages (11 layers on
    # the first and the last, 12 on the six others), engine TP 16 on 128 H100s
    ("qwen3_235b_a22b", "grpo_qwen3_30b_a3b.yaml", 128, 80,
     [f"model.path={CONFIGS}/qwen3_235b_a22b", "parallel.tp=2", "parallel.pp=8", "parallel.first_stage_layers=11",
      "parallel.last_stage_layers=11", "parallel.cp=2", "parallel.ep=16", "rollout.tp=16",
      "algo.routing_replay=none"], 235.09, "NeMo-RL's"),
    # DeepSeek-V3's architecture on one node (multi-latent attention without a q latent)
    ("moonlight_16b_a3b", "grpo_moonlight_16b_a3b.yaml", 8, 80, [], 15.96, "the recipe"),
    ("glm4_5_air", "grpo_glm4_5_air.yaml", 64, 80, [], 106.85, "the recipe"),
    # GLM-4.5 (355B-A32B) on 16 nodes: 23 layers a stage, each expert's width over expert TP 2
    ("glm4_5", "grpo_glm4_5_air.yaml", 128, 80,
     [f"model.path={CONFIGS}/glm4_5", "parallel.tp=4", "parallel.pp=4", "parallel.ep=16", "parallel.etp=2",
      "rollout.tp=16", "rollout.ep=16"], 352.80, "documented here: TP 4 x PP 4 x EP 16 x expert TP 2"),
    # DeepSeek-V3 (671B) on 32 nodes at NeMo-RL's layout (the bf16 checkpoint's config: see below)
    ("deepseek_v3", "grpo_deepseek_v3.yaml", 256, 80, [], 671.03, "the recipe (NeMo-RL's)"),
    # tied embeddings across pipeline stages: the last stage holds its own copy of the embedding
    ("qwen2_5_1_5b_tied_pp2", "grpo_qwen2_7b.yaml", 8, 80,
     [f"model.path={CONFIGS}/qwen2_5_1_5b", "parallel.tp=2", "parallel.pp=2"], 1.54, "TP 2 x PP 2"),
    ("llama3_70b", "grpo_qwen2_7b.yaml", 32, 80,
     [f"model.path={CONFIGS}/llama3_70b", "parallel.tp=8", "parallel.pp=4", "rollout.tp=8"], 70.55,
     "documented here: TP 8 x PP 4, 32 GPUs"),
]
DEFAULT_MODEL = {"grpo_qwen2_7b.yaml": "qwen2_7b", "grpo_qwen3_30b_a3b.yaml": "qwen3_30b_a3b",
                 "grpo_moonlight_16b_a3b.yaml": "moonlight_16b_a3b", "grpo_glm4_5_air.yaml": "glm4_5_air"}


def bf16_deepseek_v3(root):
    """DeepSeek-V3's published config.json without its ``quantization_config``: the config of the
    bf16 checkpoint DeepSeek's ``fp8_cast_bf16.py`` writes (megarl maps bf16 tensors, not fp8 with
    their scales)."""
    import json

    with open(os.path.join(CONFIGS, "deepseek_v3", "config.json")) as f:
        cfg = json.load(f)
    cfg.pop("quantization_config")
    os.makedirs(root, exist_ok=True)
    with open(os.path.join(root, "config.json"), "w") as f:
        json.dump(cfg, f)
    return root


def _plan(recipe, world, device_gib, overrides, expect=0):
    if recipe == "grpo_deepseek_v3.yaml" and not any(o.startswith("model.path=") for o in overrides):
        import tempfile

        overrides = [f"model.path={bf16_deepseek_v3(os.path.join(tempfile.mkdtemp(), 'dsv3_bf16'))}", *overrides]
    model = [] if any(o.startswith("model.path=") for o in overrides) else [
        f"model.path={CONFIGS}/{DEFAULT_MODEL[recipe]}"]
    cmd = [sys.executable, "-m", "megarl.plan", "--config", os.path.join(ROOT, "configs", recipe),
           "--world-size", str(world), "--device-gib", str(device_gib), *DATA, *model, *overrides]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=subprocess_env(), timeout=600)
    assert proc.returncode == expect, f"{' '.join(cmd)}\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    return proc


@pytest.mark.parametrize("name,recipe,world,gib,overrides,billions,layout", PLANS, ids=[p[0] for p in PLANS])
def test_the_recipe_builds_at_full_size_on_every_rank(name, recipe, world, gib, overrides, billions, layout):
    out = _plan(recipe, world, gib, overrides).stdout
    lines = out.splitlines()
    head = next(x for x in lines if x.startswith("full-size plan of"))
    assert f"{billions:.2f} B parameters" in head, head
    assert any(f"{world} ranks brought up" in x for x in lines), out
    shards = next(x for x in lines if x.lstrip().startswith("shards"))
    assert "covered exactly once" in shards, shards
    if "tied" in name:  # the last stage's copy of the tied embedding: 151936 x 1536 more
        assert "+ 233,373,696 (vocabulary padding, tied copies)" in shards, shards
    assert any(x.lstrip().startswith("engine") and "tile each of them once" in x for x in lines), out
    for phase in ("update", "generate"):
        row = next(x for x in lines if x.lstrip().startswith(phase))
        assert "DOES NOT FIT" not in row, row  # each recipe's memory per rank fits its device


def test_what_a_launch_would_hit_is_refused_by_name():
    """A TP that does not divide the attention heads; NeMo-RL's PP 8 for Qwen3-235B (94 layers):
    one error line each, naming the key and number."""
    bad = _plan("grpo_qwen2_7b.yaml", 8, 80, ["parallel.tp=8"], expect=2)
    assert "num_attention_heads=28 is not divisible by" in bad.stderr and "tp=8" in bad.stderr, bad.stderr[-2000:]
    bad = _plan("grpo_qwen3_30b_a3b.yaml", 128, 80, [f"model.path={CONFIGS}/qwen3_235b_a22b", "parallel.tp=2",
                                                     "parallel.pp=8", "parallel.cp=2", "parallel.ep=16",
                                                     "algo.routing_replay=none"], expect=2)
    assert "num_hidden_layers=94 is not divisible by" in bad.stderr and "pp=8" in bad.stderr, bad.stderr[-2000:]


def test_deepseek_v3_as_published_is_refused_naming_its_fp8_quantization():
    bad = _plan("grpo_deepseek_v3.yaml", 256, 80, [f"model.path={CONFIGS}/deepseek_v3"], expect=2)
    line = [x for x in bad.stderr.splitlines() if x.startswith("error:")]
    assert len(line) == 1 and "['quantization_config'] are not understood" in line[0], bad.stderr[-2000:]


def test_an_architecture_the_mapping_does_not_cover_is_named(tmp_path):
    import json

    (tmp_path / "config.json").write_text(json.dumps({
        "architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss", "hidden_size": 2880,
        "num_hidden_layers": 36, "num_attention_heads": 64, "num_key_value_heads": 8, "head_dim": 64,
        "vocab_size": 201088, "intermediate_size": 2880, "num_local_experts": 128, "num_experts_per_tok": 4,
        "torch_dtype": "bfloat16"}))
    bad = _plan("grpo_qwen3_30b_a3b.yaml", 8, 141, [f"model.path={tmp_path}"], expect=2)
    line = [x for x in bad.stderr.splitlines() if x.startswith("error:")]
    assert len(line) == 1 and "'GptOssForCausalLM' is not supported" in line[0], bad.stderr[-2000:]


PLANTED = r"""
import sys
from megarl.models import mapping
original = mapping.shard_from_hf
def leaky(rule, read, spec, tp_rank, tp, padded):
    # the output projection's last TP rank reads one column short: a slice no shard covers
    if rule.kind == mapping.ROW and tp_rank == tp - 1 and rule.megatron_name.endswith("layers.5.self_attention.linear_proj.weight"):
        def short(name, dim, start, stop):
            return read(name, dim, start, stop - 1)
        import torch
        part = original(rule, short, spec, tp_rank, tp, padded)
        return torch.cat([part, part[:, :1]], 1)  # the shape still fits: only the coverage check can tell
    return original(rule, read, spec, tp_rank, tp, padded)
mapping.shard_from_hf = leaky
from megarl.plan import main
main(sys.argv[1:])
"""


def test_a_shard_plan_that_leaves_a_slice_out_is_caught():
    cmd = [sys.executable, "-c", PLANTED, "--config", os.path.join(ROOT, "configs", "grpo_qwen2_7b.yaml"),
           "--world-size", "8", *DATA, f"model.path={CONFIGS}/qwen2_7b"]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=subprocess_env(), timeout=600)
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-3000:]
    line = [x for x in proc.stderr.splitlines() if x.startswith("error:")]
    assert len(line) == 1 and "'model.layers.5.self_attn.o_proj.weight' [3583:3584] along dim 1 is read by no rank" \
        in line[0], line


ENGINE_LEAK = r"""
import sys
from megarl.commands import engine_plan
original = engine_plan._slice
def leaky(spec, name, leaf, kind, shape, r, tp, *rest):
    # SGLang's last TP rank keeps nothing of one layer's down projection: a tensor the plan leaves out
    if name == "model.layers.3.mlp.down_proj.weight" and r == tp - 1:
        return ("not held",)
    return original(spec, name, leaf, kind, shape, r, tp, *rest)
engine_plan._slice = leaky
from megarl.plan import main
main(sys.argv[1:])
"""


def test_the_engine_shard_plan_is_checked_too():
    """SGLang's own sharding of the streamed tensors (megarl/commands/engine_plan.py): an engine
    TP that does not divide the attention heads is refused naming rollout.tp; a plan whose last
    engine rank keeps no part of one tensor is caught naming it."""
    bad = _plan("grpo_qwen2_7b.yaml", 8, 80, ["rollout.tp=8"], expect=2)
    assert "error: rollout.tp: SGLang splits num_attention_heads=28 over 8 ranks" in bad.stderr, bad.stderr[-2000:]
    cmd = [sys.executable, "-c", ENGINE_LEAK, "--config", os.path.join(ROOT, "configs", "grpo_qwen2_7b.yaml"),
           "--world-size", "8", *DATA, f"model.path={CONFIGS}/qwen2_7b"]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=subprocess_env(), timeout=600)
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-3000:]
    line = [x for x in proc.stderr.splitlines() if x.startswith("error:")]
    assert len(line) == 1 and "SGLang at rollout.tp=2" in line[0] and \
        "'model.layers.3.mlp.down_proj.weight' [9472:18944] along dim 1 is read by no rank" in line[0], line
