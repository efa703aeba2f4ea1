"""The command line of megarl.train: --help from the schema, --print-config, --dry-run on every
recipe at its intended world size, range checks on every numeric key, one-line start-up errors,
and the resume story (the printed command, finished runs, interrupted runs)."""

import copy
import json
import os
import subprocess
import sys
import typing

import pytest

from megarl.commands.run_checks import check_run
from megarl.config import ConfigError, load_config

from tests._dist import ROOT
CONFIGS = os.path.join(ROOT, "configs")
GRPO = os.path.join(CONFIGS, "grpo_arith_tiny.yaml")
PPO = os.path.join(CONFIGS, "ppo_arith_tiny.yaml")

QWEN2_7B = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "vocab_size": 152064, "hidden_size": 3584,
            "intermediate_size": 18944, "num_hidden_layers": 28, "num_attention_heads": 28, "num_key_value_heads": 4,
            "max_position_embeddings": 32768, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
            "tie_word_embeddings": False, "torch_dtype": "bfloat16"}
LLAMA3_8B = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 128256, "hidden_size": 4096,
             "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
             "max_position_embeddings": 8192, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
             "tie_word_embeddings": False, "torch_dtype": "bfloat16"}


def _cli(args, cwd, env=None, timeout=300):
    e = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1", **(env or {}))
    return subprocess.run([sys.executable, "-m", "megarl.train", *args], capture_output=True, text=True, cwd=str(cwd),
                          timeout=timeout, env=e)


def _one_error(proc, key):
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-3000:]
    errs = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errs) == 1 and key in errs[0], proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    return errs[0]


# ---- --help: the schema's own words ------------------------------------------------------------


def test_help_lists_every_key_from_the_schema_without_torch(tmp_path):
    """--help names the module (not train.py), lists every section and key of the schema with
    the comment written next to the field, and imports neither torch nor omegaconf."""
    from megarl.config.help import iter_keys

    code = ("import sys, runpy; sys.argv = ['x', '--help']\n"
            "try:\n    runpy.run_module('megarl.train', run_name='__main__')\n"
            "except SystemExit as e:\n    assert e.code == 0\n"
            "print('IMPORTED', 'torch' in sys.modules, 'omegaconf' in sys.modules)\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=str(tmp_path),
                          env=dict(os.environ, PYTHONPATH=ROOT), timeout=60)
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "usage: python -m megarl.train" in out and "train.py" not in out.split("\n\n")[0]
    assert "IMPORTED False False" in out
    for line in ("rollout:", "trainer:", "algo:"):
        assert "\n" + line in out
    keys = list(iter_keys())
    assert len(keys) > 150
    for k in keys:
        assert f"  {k.key} " in out, k.key
    # descriptions come from the comments in megarl/config/schema.py: a trailing one and a `#:` block
    row = next(line for line in out.splitlines() if line.strip().startswith("rollout.n "))
    assert "samples per prompt; the group size G for group estimators" in row and "[>= 1]" in row
    row = next(line for line in out.splitlines() if line.strip().startswith("rollout.max_retries "))
    assert "regenerations of a lost or aborted candidate" in row
    row = next(line for line in out.splitlines() if line.strip().startswith("rollout.top_p "))
    assert "[in (0, 1]]" in row


# ---- range rules: every numeric key, enumerated from the schema -------------------------------


def _numeric_keys():
    from megarl.config.help import iter_keys

    out = []
    for k in iter_keys():
        tp = k.type
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        base = args[0] if typing.get_origin(tp) is typing.Union and len(args) == 1 else tp
        if typing.get_origin(base) in (list, typing.List):
            base = typing.get_args(base)[0] if typing.get_args(base) else None
        if base in (int, float):
            out.append(k.key)
    return out


def test_every_numeric_key_has_a_range_rule():
    """A numeric key added to the schema without a declared range (setting(..., range=...)) fails here."""
    from megarl.config.ranges import RANGES

    keys = _numeric_keys()
    assert "rollout.top_p" in keys and "trainer.profile_iterations" in keys and "critic.optim.lr" in keys
    missing = [k for k in keys if k not in RANGES]
    assert not missing, f"numeric keys declaring no range in megarl/config/schema.py: {missing}"
    stale = [k for k in RANGES if k not in keys]
    assert not stale, f"rules for keys that are not in the schema: {stale}"


def bad_values(rule) -> list:
    """Values a range rule refuses: just outside each bound, and nan."""
    out = [float("nan")]
    if rule.lo is not None:
        out.append(rule.lo if rule.lo_open else rule.lo - 1)
    if rule.hi is not None:
        out.append(rule.hi if rule.hi_open else rule.hi + 1)
    return [v for v in out if v not in rule.also]


def test_every_range_rule_refuses_its_bad_values_naming_the_key():
    """For every numeric key, each value just outside its range (and nan) is refused by
    check_run() naming that key; the recipes' own values pass."""
    from megarl.config.ranges import RANGES

    base = {GRPO: load_config(GRPO, []), PPO: load_config(PPO, [])}
    for cfg in base.values():
        assert check_run(copy.deepcopy(cfg), 1) == 1
    checked = 0
    for key, rule in RANGES.items():
        path = PPO if key.startswith("critic.") else GRPO
        for bad in bad_values(rule):
            cfg = copy.deepcopy(base[path])
            node = cfg
            *parents, leaf = key.split(".")
            for part in parents:
                node = getattr(node, part)
            setattr(node, leaf, [bad] if rule.each else bad)
            with pytest.raises(ConfigError) as e:
                check_run(cfg, 1)
            assert key in str(e.value), (key, bad, str(e.value))
            checked += 1
    assert checked > 200


@pytest.mark.parametrize("overrides,key", [
    # the issue's cases ...
    (["eval.every=-1"], "eval.every"),
    (["trainer.export_every=-3"], "trainer.export_every"),
    (["rollout.top_p=1.5"], "rollout.top_p"),
    (["reward.timeout_s=-1"], "reward.timeout_s"),
    (["reward.max_retries=-1"], "reward.max_retries"),
    (["trainer.max_wall_minutes=-5"], "trainer.max_wall_minutes"),
    (["actor.optim.min_lr=1e-3"], "actor.optim.min_lr"),          # above lr=5e-5
    # ... and a sibling of each
    (["trainer.checkpoint_every=-1"], "trainer.checkpoint_every"),
    (["rollout.top_p=0"], "rollout.top_p"),
    (["rollout.top_k=0"], "rollout.top_k"),
    (["reward.timeout_s=0"], "reward.timeout_s"),
    (["reward.retry_backoff_s=-0.1"], "reward.retry_backoff_s"),
    (["trainer.max_wall_minutes=0"], "trainer.max_wall_minutes"),
    (["actor.optim.lr_warmup_steps=-1"], "actor.optim.lr_warmup_steps"),
    (["actor.optim.weight_decay=-0.01"], "actor.optim.weight_decay"),
    (["actor.optim.adam_beta1=1.0"], "actor.optim.adam_beta1"),
    (["actor.optim.adam_beta2=-0.5"], "actor.optim.adam_beta2"),
    (["actor.optim.adam_eps=0"], "actor.optim.adam_eps"),
    (["actor.optim.clip_grad=0"], "actor.optim.clip_grad"),
    (["algo.gamma=1.5"], "algo.gamma"),
    (["algo.lam=-0.1"], "algo.lam"),
    (["algo.clip_low=-0.2"], "algo.clip_low"),
    (["algo.clip_high=-0.2"], "algo.clip_high"),
    (["algo.dual_clip=1.0"], "algo.dual_clip"),
    (["algo.entropy_coef=-0.01"], "algo.entropy_coef"),
    (["rollout.mem_fraction_static=1.0"], "rollout.mem_fraction_static"),
    (["eval.n=0"], "eval.n"),
    (["rollout.temperature=nan"], "rollout.temperature"),
    (["trainer.profile_iterations=[-1]"], "trainer.profile_iterations"),
])
def test_issue_ranges_exit_2_naming_the_key(overrides, key):
    with pytest.raises(ConfigError) as e:
        check_run(load_config(GRPO, overrides), 1)
    assert str(e.value).startswith(key), str(e.value)


def test_critic_min_lr_above_lr_refused():
    with pytest.raises(ConfigError, match=r"^critic\.optim\.min_lr: 0\.1 is above critic\.optim\.lr"):
        check_run(load_config(PPO, ["critic.optim.min_lr=0.1"]), 1)


# ---- one-line start-up errors through the real entry point ------------------------------------


def test_startup_errors_are_one_line_naming_the_key(tmp_path):
    """Override typos are blamed on the override with the closest key; a list key given a
    scalar says so; a YAML typo is blamed on the file; an unwritable run dir is named before any
    model loads; a missing sglang names the install command; the issue's bad values exit 2."""
    tiny = [f"model.path={tmp_path / 'never_built'}", f"data.train_path={tmp_path / 't.jsonl'}",
            f"data.heldout_path={tmp_path / 'h.jsonl'}"]
    line = _one_error(_cli(["--config", GRPO, "trainer.iteratons=3"], tmp_path), "trainer.iteratons")
    assert line == ("error: override 'trainer.iteratons=3': unknown key trainer.iteratons "
                    "(did you mean trainer.iterations?)")
    line = _one_error(_cli(["--config", GRPO, "trainer.profile_iterations=3"], tmp_path), "trainer.profile_iterations")
    assert "expects a list, e.g. trainer.profile_iterations=[3]" in line and "AnyNode" not in line
    bad_yaml = tmp_path / "typo.yaml"
    base = os.path.join(CONFIGS, "base", "tiny.yaml")  # the tiny recipes' shared keys
    bad_yaml.write_text(open(base).read().replace("prompts_per_iteration: 16", "prompts_per_iteraton: 16"))
    line = _one_error(_cli(["--config", str(bad_yaml)], tmp_path), "trainer.prompts_per_iteraton")
    assert line.startswith(f"error: {bad_yaml}: unknown key") and "did you mean trainer.prompts_per_iteration" in line
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    try:
        if os.access(str(ro), os.W_OK):  # root: a mode-500 directory is writable, so it is accepted
            from megarl.checkpointing.run_dir import check_writable

            check_writable("trainer.run_dir", str(ro / "run"))
        else:
            line = _one_error(_cli(["--config", GRPO, *tiny, f"trainer.run_dir={ro / 'run'}"], tmp_path),
                              "trainer.run_dir")
            assert str(ro) in line and not (tmp_path / "never_built").exists()
    finally:
        ro.chmod(0o700)
    # a directory nobody can create in, root included (os.access would say yes to root)
    line = _one_error(_cli(["--config", GRPO, *tiny, "trainer.run_dir=/proc/megarl-run"], tmp_path), "trainer.run_dir")
    assert "/proc/megarl-run cannot be created" in line and not (tmp_path / "never_built").exists()
    (tmp_path / "file").write_text("x")
    line = _one_error(_cli(["--config", GRPO, *tiny, f"trainer.run_dir={tmp_path / 'file' / 'run'}"], tmp_path),
                      "trainer.run_dir")
    assert "is a file" in line and not (tmp_path / "never_built").exists()
    for ov, key in (("eval.every=-1", "eval.every"), ("rollout.top_p=1.5", "rollout.top_p")):
        _one_error(_cli(["--config", GRPO, *tiny, ov], tmp_path), key)
    sglang = ["rollout.backend=sglang", "rollout.reuse_rollout_log_probs=false"]
    if importlib_find("sglang") is None:
        line = _one_error(_cli(["--config", GRPO, *tiny, *sglang], tmp_path), "rollout.backend")
        assert line == ("error: rollout.backend: 'sglang' is not installed here; install the GPU extra: "
                        'pip install -e ".[gpu]" (or use the Dockerfile)')
    else:  # a GPU image with sglang: nothing is missing
        from megarl.config import load_config, missing_packages

        assert missing_packages(load_config(GRPO, [*tiny, *sglang])) == []
    # the run directory, read before anything is built: an interrupted run without a checkpoint
    # is refused naming trainer.run_dir; a finished one says so and exits 0, untouched
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text('{"iteration": 0}\n')
    line = _one_error(_cli(["--config", GRPO, *tiny, f"trainer.run_dir={run}"], tmp_path), "trainer.run_dir")
    assert "no checkpoint" in line and "trainer.resume=never" in line
    (run / "DONE").write_text(json.dumps({"iterations": 10, "heldout_accuracy": 0.25}))
    proc = _cli(["--config", GRPO, *tiny, f"trainer.run_dir={run}", "trainer.iterations=10"], tmp_path)
    assert proc.returncode == 0 and "holds a finished run (10 iterations, final held-out accuracy 0.250)" in proc.stdout
    assert sorted(os.listdir(run)) == ["DONE", "metrics.jsonl"]
    assert not (tmp_path / "never_built").exists() and not (tmp_path / "runs").exists()


def importlib_find(name):
    import importlib.util

    return importlib.util.find_spec(name)


# ---- --print-config and --dry-run on every recipe ---------------------------------------------


def _fake_hf(d, cfg):
    from megarl.builtin.tiny_tokenizer import build_tiny_tokenizer

    d.mkdir()
    build_tiny_tokenizer(str(d))
    (d / "config.json").write_text(json.dumps(cfg))
    return str(d)


def _recipes(tmp_path):
    """Every train recipe in configs/ with what it needs at its intended world size: the tiny
    ones as they are (MEGARL_CACHE points at an empty cache: dry-run must not build), the 8-GPU
    ones with config.json-only model directories of the real shapes and the tiny tokenizer."""
    data = tmp_path / "math.jsonl"
    data.write_text("".join(json.dumps({"id": str(i), "prompt": f"what is {i} + 1 ?", "answer": str(i + 1)}) + "\n"
                            for i in range(6)))
    qwen = _fake_hf(tmp_path / "qwen2_7b", QWEN2_7B)
    llama = _fake_hf(tmp_path / "llama3_8b", LLAMA3_8B)
    rm_config = dict(LLAMA3_8B, architectures=["LlamaForTokenClassification"], num_labels=1)
    rm = _fake_hf(tmp_path / "llama3_8b_rm", rm_config)
    from tests._moe import QWEN3_30B_A3B

    qwen3_moe = _fake_hf(tmp_path / "qwen3_30b_a3b", QWEN3_30B_A3B)
    tiny_rm = _fake_hf(tmp_path / "tiny_rm", {
        "architectures": ["LlamaForSequenceClassification"], "model_type": "llama", "num_labels": 1, "vocab_size": 112,
        "hidden_size": 128, "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
        "intermediate_size": 256, "max_position_embeddings": 512, "rms_norm_eps": 1e-6, "pad_token_id": 0})
    tiny_judge = _fake_hf(tmp_path / "tiny_judge", {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 112, "hidden_size": 128,
        "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 256,
        "max_position_embeddings": 512, "rms_norm_eps": 1e-6, "pad_token_id": 0})
    from megarl.builtin.tasks.arithmetic_judge import PROMPT

    def published(name):  # tests/data/hf_configs: the real config.json files the full-size plan runs on
        with open(os.path.join(ROOT, "tests", "data", "hf_configs", name, "config.json")) as f:
            return json.load(f)

    moonlight = _fake_hf(tmp_path / "moonlight_16b_a3b", published("moonlight_16b_a3b"))
    glm_air = _fake_hf(tmp_path / "glm4_5_air", published("glm4_5_air"))
    dsv3 = published("deepseek_v3")
    dsv3.pop("quantization_config")  # the bf16 checkpoint's config (configs/grpo_deepseek_v3.yaml)
    dsv3 = _fake_hf(tmp_path / "deepseek_v3_bf16", dsv3)
    out = {"grpo_arith_tiny.yaml": (1, []), "ppo_arith_tiny.yaml": (1, []), "grpo_moe_tiny.yaml": (1, []),
           "grpo_arith_async_tiny.yaml": (2, []),  # 1 trainer rank + 1 rollout rank
           "grpo_calc_tiny.yaml": (1, []), "grpo_two_turn_tiny.yaml": (1, []), "grpo_rsum_tiny.yaml": (1, []),
           "grpo_rsum_process_tiny.yaml": (1, []),
           # its teacher is grpo_arith_tiny.yaml's export (a dry run loads no model)
           "opd_arith_tiny.yaml": (1, []), "opd_rsum_tiny.yaml": (1, []),
           # its reward model is configs/train_rm/arith_tiny.yaml's export: a config.json-only one here
           "ppo_arith_rm_tiny.yaml": (1, [f"reward.models=[{{name: arith_rm, path: {tiny_rm}}}]"]),
           # its judge is python -m megarl.tinymodel --task arithmetic_judge's build: a config.json-only one here
           "grpo_arith_judge_tiny.yaml": (1, [f"reward.judges=[{{name: arith_judge, path: {tiny_judge}, "
                                              f"prompt: '{PROMPT}', max_new_tokens: 2}}]"]),
           "grpo_qwen2_7b.yaml": (8, [f"model.path={qwen}", f"data.train_path={data}"]),
           # the recipe names the Hub id; without network the test points it at config.json only
           "grpo_qwen3_30b_a3b.yaml": (8, [f"model.path={qwen3_moe}", f"data.train_path={data}"]),
           "ppo_llama3_8b.yaml": (8, [f"model.path={llama}", f"data.train_path={data}", f"reward.model.path={rm}"]),
           "grpo_moonlight_16b_a3b.yaml": (8, [f"model.path={moonlight}", f"data.train_path={data}"]),
           "grpo_glm4_5_air.yaml": (64, [f"model.path={glm_air}", f"data.train_path={data}"]),
           "grpo_deepseek_v3.yaml": (256, [f"model.path={dsv3}", f"data.train_path={data}"])}
    train_recipes = sorted(n for n in os.listdir(CONFIGS) if n.endswith(".yaml") and n != "quickstart_tiny.yaml")
    assert sorted(out) == train_recipes  # quickstart_tiny.yaml is megarl.quickstart's, not a training recipe
    return out


def test_print_config_and_dry_run_on_every_recipe(tmp_path):
    recipes = _recipes(tmp_path)
    cache = tmp_path / "empty_cache"
    dry_outs = {}
    for name, (world, overrides) in recipes.items():
        path = os.path.join(CONFIGS, name)
        proc = _cli(["--config", path, "--print-config", *overrides, "trainer.iterations=7"], tmp_path,
                    env={"MEGARL_CACHE": str(cache)})
        assert proc.returncode == 0, proc.stderr
        import yaml

        printed = yaml.safe_load(proc.stdout)
        assert printed["trainer"]["iterations"] == 7 and printed["recipe"] == name[:-5]
        if name.endswith("_tiny.yaml"):
            family = "qwen3_moe" if name == "grpo_moe_tiny.yaml" else "llama"
            built = {"grpo_calc_tiny.yaml": "calc", "grpo_two_turn_tiny.yaml": "two_turn",
                     "grpo_rsum_tiny.yaml": "rsum", "grpo_rsum_process_tiny.yaml": "rsum",
                     "opd_rsum_tiny.yaml": "rsum"}.get(name, "arith")
            assert printed["model"]["path"] == f"{cache}/tiny_{built}_{family}"  # resolved
            assert printed["model"]["tiny"]["family"] == family
        args = ["--config", path, "--dry-run", *overrides] + (["--world-size", str(world)] if world > 1 else [])
        proc = _cli(args, tmp_path, env={"MEGARL_CACHE": str(cache)})
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        out = dry_outs[name] = proc.stdout
        assert "dry run: nothing was trained or written" in out
        cfg = load_config(path, overrides)
        tp, pp = cfg.parallel.tp, cfg.parallel.pp
        if cfg.placement.mode == "split":
            trainers = world - cfg.placement.rollout_ranks
            assert f"plan: trainer ranks {trainers} = tp {tp} x pp {pp} x dp {trainers // (tp * pp)}" in out
            assert f"placement split: the last {cfg.placement.rollout_ranks} rank(s) of {world} only generate" in out
        else:
            cp = cfg.parallel.cp
            assert f"plan: world {world} = tp {tp} x pp {pp}{f' x cp {cp}' if cp > 1 else ''} x dp " \
                   f"{world // (tp * pp * cp)}" in out
        if name.endswith("_tiny.yaml"):
            assert "would build the built-in tiny model" in out and not cache.exists()
        else:
            assert "memory per GPU" in out and "ok   tokenizer" in out and "6 of 6 rows kept" in out
            if importlib_find("sglang") is None:
                assert "not checked here: rollout.backend: 'sglang' is not installed here" in out
    assert not (tmp_path / "runs").exists()
    # the plan's numbers for the Qwen2-7B recipe at 8 GPUs (tp 2 x dp 4)
    out = dry_outs["grpo_qwen2_7b.yaml"]
    assert "B=128 prompts x G=8 samples = 1024 samples per iteration" in out
    assert "4 mini-batch(es) of 256 samples (32 prompts) -> 64 per DP rank -> 32 micro-batch(es) of 2" in out
    assert "= 4 per iteration, 2000 in total (500 iterations)" in out
    assert "sglang, 4 inference group(s) of rollout.tp=2 GPUs" in out
    assert "7.62 B parameters, 3.81 B on the heaviest tp x pp shard" in out
    # 3.81e9 params: bf16 weights 7.1 GiB, fp32 grads 14.2 GiB, fp32 main + Adam m, v over dp 4: 10.6 GiB
    assert "actor        weights 7.1 GiB + grads 14.2 GiB + optimizer 10.6 GiB = 31.9 GiB" in out
    # Qwen3-30B-A3B at ep 8 on 8 GPUs: 16 experts of each layer per GPU, replicated attention
    out = dry_outs["grpo_qwen3_30b_a3b.yaml"]
    assert "128 experts (top-8) over ep 8 x etp 1" in out and "sglang, 2 inference group(s) of rollout.tp=4" in out
    assert "30.53 B parameters, 4.01 B on the heaviest tp x pp shard" in out
    # TP 4 + SP, EP 8, etp 1: 4.01e9 params of which 3.62e9 experts: the dense 0.39e9's fp32 main + Adam over
    # dp 2 (2.2 GiB), the experts' over the expert data-parallel group of 8 / (ep 8 x etp 1) = 1 (40.5 GiB)
    assert "actor        weights 7.5 GiB + grads 14.9 GiB + optimizer 42.7 GiB = 65.1 GiB" in out
    assert ("a micro-batch of 16384 tokens (algo.micro_batch_tokens=16384); sequence parallelism on; recompute full "
            "(uniform, 1 layer(s) a chunk)") in out
    # the output layer 1024 positions at a time over V/tp = 37,984 rows: three fp32 chunks (0.43 GiB) and the
    # output weight's fp32 gradient sum (4 x 37,984 x 2048: 0.29 GiB)
    assert ("logits  0.7 GiB on the last stage (the output layer 1024 positions at a time: no full logits; "
            "incl. its fp32 weight-gradient sum 0.3 GiB)") in out
    assert "left out:" in out and "the K/V chunks context parallelism exchanges" in out


def test_param_count_matches_the_published_sizes():
    """Hand-checked against the published parameter counts (Qwen2-7B 7.62 B, Llama-3-8B 8.03 B)."""
    from megarl.commands.dry_run import count_params
    from megarl.models.hf_config import spec_from_hf_config

    q = count_params(spec_from_hf_config(QWEN2_7B), 128, 1, 1)
    assert q.total == 7_615_616_512 and q.dtype_bytes == 2
    assert count_params(spec_from_hf_config(LLAMA3_8B), 128, 1, 1).total == 8_030_261_248
    # tp 4: every weight matrix split four ways (the norms are replicated)
    assert abs(count_params(spec_from_hf_config(LLAMA3_8B), 128, 4, 1).per_shard * 4 - 8_030_261_248) < 4 * 300_000


def test_lora_adapter_count_by_hand():
    """actor.lora's trainable parameters in the dry run, hand-checked on Qwen2-7B at rank 16: per
    layer r x (in + out) of the fused qkv (3584 -> 3584 + 2 x 512), the output projection (3584 ->
    3584), the gated fc1 (3584 -> 2 x 18944) and fc2 (18944 -> 3584); at tp 2 the column linears'
    B and the row linears' A are halved."""
    from types import SimpleNamespace

    from megarl.commands.dry_run import lora_params
    from megarl.models.hf_config import spec_from_hf_config

    spec = spec_from_hf_config(QWEN2_7B)
    lora = SimpleNamespace(rank=16, target_modules=["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"])
    per_layer = 16 * ((3584 + 4608) + (3584 + 3584) + (3584 + 37888) + (18944 + 3584))
    assert lora_params(spec, lora, 1, 1) == (28 * per_layer, 28 * per_layer)
    half = 16 * ((3584 + 4608 // 2) + (3584 // 2 + 3584) + (3584 + 37888 // 2) + (18944 // 2 + 3584))
    assert lora_params(spec, lora, 2, 2) == (28 * per_layer, 14 * half)
    attn_only = SimpleNamespace(rank=16, target_modules=["linear_qkv", "linear_proj"])
    assert lora_params(spec, attn_only, 1, 1)[0] == 28 * 16 * ((3584 + 4608) + (3584 + 3584))
    # what the weight sync sends after the first load: the adapted linears' merged weights, i.e. the
    # whole model but its embeddings (2 x 152064 x 3584, untied) and norms
    from megarl.commands.dry_run import count_params, lora_adapted_weights

    adapted = lora_adapted_weights(spec, lora)
    assert adapted == 28 * (3584 * 4608 + 3584 * 3584 + 3 * 3584 * 18944)
    assert count_params(spec, 128, 1, 1).total - adapted == 2 * 152064 * 3584 + 3584 * (2 * 28 + 1) + 28 * 4608


def test_lora_adapter_count_of_a_mixture_of_experts_by_hand():
    """With the routed experts adapted: Qwen3-30B-A3B at rank 16, per layer the attention's two
    adapters and each of the 128 experts' fc1 (2048 -> 2 x 768) and fc2 (768 -> 2048); at tp 4 x
    ep 8 x etp 1 (the recipe's layout) a rank holds 16 experts' adapters whole and the attention's
    split four ways; the weight sync sends every adapted linear, the experts' included."""
    from types import SimpleNamespace

    from megarl.commands.dry_run import lora_adapted_weights, lora_params
    from megarl.models.hf_config import spec_from_hf_config
    from tests._moe import QWEN3_30B_A3B

    spec = spec_from_hf_config(QWEN3_30B_A3B)
    lora = SimpleNamespace(rank=16, target_modules=["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"])
    attn = 16 * ((2048 + 5120) + (4096 + 2048))
    expert = 16 * ((2048 + 1536) + (768 + 2048))
    assert lora_params(spec, lora, 1, 1) == (48 * (attn + 128 * expert),) * 2
    shard = 16 * ((2048 + 5120 // 4) + (4096 // 4 + 2048)) + 16 * expert
    assert lora_params(spec, lora, 4, 1, ep=8, etp=1) == (48 * (attn + 128 * expert), 48 * shard)
    assert lora_adapted_weights(spec, lora) == 48 * (2048 * 5120 + 4096 * 2048 + 128 * 3 * 2048 * 768)


def test_activation_estimate_by_recompute_sequence_parallelism_and_chunking():
    """The dry run's activation estimate (megarl/commands/activation_memory.py) for Qwen2-7B's
    layers, hand-checked: a 8192-token micro-batch at tp 2 keeps 2 bytes x 8192 x (4h/2 + (2q + 2kv)/2
    + 3f/2) = 650 MB a layer with sequence parallelism (the h terms split too), 2 x 8192 x 4h more
    without; full recompute keeps each layer's input (2 x 8192 x h / 2) and one layer's activations;
    the fp32 softmax (4 x 8192 x V/2) goes with algo.log_prob_chunk."""
    from megarl.commands.activation_memory import activation_lines
    from megarl.models.hf_config import spec_from_hf_config

    spec = spec_from_hf_config(QWEN2_7B)
    h, q, kv, f = 3584, 3584, 512, 18944
    path = os.path.join(CONFIGS, "grpo_qwen2_7b.yaml")

    def estimate(*overrides):
        lines = activation_lines(load_config(path, ["data.train_path=x", "model.path=x", *overrides]), spec, 4)
        layers = float(lines[1].split(": ")[1].split(" GiB")[0])
        return layers, lines

    sp, lines = estimate()
    assert f"({round(2 * 8192 * (4 * h / 2 + (2 * q + 2 * kv) / 2 + 3 * f / 2) / 2 ** 20)} MiB a layer" in lines[1]
    assert abs(sp - 28 * 2 * 8192 * (4 * h / 2 + (2 * q + 2 * kv) / 2 + 3 * f / 2) / 2 ** 30) < 0.05
    no_sp, _ = estimate("parallel.sequence_parallel=false")
    assert abs(no_sp - sp - 28 * 2 * 8192 * 2 * h / 2 ** 30) < 0.1  # printed to 0.1 GiB
    full, lines = estimate("parallel.recompute.granularity=full")
    assert abs(full - (28 * 2 * 8192 * h / 2 + 2 * 8192 * (2 * h + q + kv + 1.5 * f)) / 2 ** 30) < 0.05
    assert sp / full > 10
    _, lines = estimate("algo.log_prob_chunk=0")
    assert "incl. the fp32 softmax 2.3 GiB" in lines[2]
    # without a token budget: 2 rows of 1024 + 2048 tokens, padded to the longest
    _, lines = estimate("algo.micro_batch_tokens=0")
    assert "a micro-batch of 6144 tokens (2 row(s) x (1024 prompt + 2048 response tokens)" in lines[0]
    # context parallelism: each of the cp ranks keeps its half of every token's activations and logits
    cp, lines = estimate("algo.micro_batch_tokens=0", "parallel.cp=2")
    assert "a micro-batch of 6144 tokens" in lines[0] and "3072 on each of cp 2 ranks" in lines[0]
    padded, _ = estimate("algo.micro_batch_tokens=0")
    assert abs(cp - padded / 2) < 0.1


# ---- the resume story -------------------------------------------------------------------------


def test_resume_command_names_the_run_dir():
    from megarl.checkpointing.run_dir import resume_command

    argv = ["/x/megarl/train.py", "--config", "configs/grpo_arith_tiny.yaml", "trainer.iterations=5",
            "trainer.run_dir=/old"]
    assert resume_command("runs/a b", argv, env={}) == (
        "python -m megarl.train --config configs/grpo_arith_tiny.yaml trainer.iterations=5 'trainer.run_dir=runs/a b'")
    cmd = resume_command("runs/r", argv[:3], env={"TORCHELASTIC_RUN_ID": "x", "LOCAL_WORLD_SIZE": "8"})
    assert cmd == ("torchrun --nproc-per-node 8 -m megarl.train --config configs/grpo_arith_tiny.yaml "
                   "trainer.run_dir=runs/r")


def test_run_dir_decisions(tmp_path):
    """The table in megarl/checkpointing/run_dir.py, on directories laid out as runs leave them."""
    from megarl.checkpointing.run_dir import inspect_run_dir, start_decision

    def cfg(*ov):
        return load_config(GRPO, ["trainer.iterations=3", *ov])

    fresh = tmp_path / "fresh"
    assert start_decision(cfg(), inspect_run_dir(str(fresh))) is None
    done = tmp_path / "done"
    done.mkdir()
    (done / "metrics.jsonl").write_text('{"iteration": 0}\n{"iteration": 1}\n{"iteration": 2}\n')
    (done / "DONE").write_text(json.dumps({"iterations": 3, "heldout_accuracy": 0.5}))
    msg = start_decision(cfg(), inspect_run_dir(str(done)))
    assert msg.startswith(f"{done} holds a finished run (3 iterations, final held-out accuracy 0.500); nothing to do")
    with pytest.raises(ConfigError, match=r"^trainer\.iterations: raised to 5.*trainer\.checkpoint_every=0"):
        start_decision(cfg("trainer.iterations=5"), inspect_run_dir(str(done)))
    with pytest.raises(ConfigError, match=r"^trainer\.run_dir: .* holds a finished run"):
        start_decision(cfg("trainer.resume=never"), inspect_run_dir(str(done)))
    (done / "checkpoints" / "iter_000002").mkdir(parents=True)
    (done / "checkpoints" / "latest").write_text("iter_000002")
    assert start_decision(cfg("trainer.iterations=5"), inspect_run_dir(str(done))) is None  # continues
    broken = tmp_path / "interrupted"
    broken.mkdir()
    (broken / "metrics.jsonl").write_text('{"iteration": 0}\n')
    (broken / "config.yaml").write_text("x: 1\n")
    with pytest.raises(ConfigError, match=r"^trainer\.run_dir: .* interrupted run with 1 metric rows and no check"):
        start_decision(cfg(), inspect_run_dir(str(broken)))
    assert start_decision(cfg("trainer.resume=never"), inspect_run_dir(str(broken))) is None
    moved = [p for p in os.listdir(broken)]
    assert len(moved) == 1 and moved[0].startswith("attempt-")
    assert sorted(os.listdir(broken / moved[0])) == ["config.yaml", "metrics.jsonl"]
    assert not inspect_run_dir(str(broken)).used
