"""Bad input gives one clear error naming the file or key, exit status 2, no traceback."""

import json
import os
import subprocess
import sys

import pytest
from safetensors.torch import load_file, save_file

from megarl.builtin.tiny_checkpoint import make_tiny_hf_checkpoint
from megarl.models.hf_config import ModelConfigError, spec_from_hf_config
from tests._dist import ROOT

TOOL = os.path.join(ROOT, "tools", "convert_checkpoint.py")


def _convert(hf, out, *extra):
    proc = subprocess.run([sys.executable, TOOL, "hf-to-megatron", "--hf", hf, "--out", out, *extra],
                          capture_output=True, text=True, env=dict(os.environ, PYTHONWARNINGS="ignore"))
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    return proc.returncode, lines


def _expect_error(rc, lines, *needles):
    assert rc == 2, lines
    assert not any("Traceback" in ln for ln in lines), "\n".join(lines)
    errors = [ln for ln in lines if ln.startswith("error:")]
    assert len(errors) == 1, lines
    for n in needles:
        assert n in errors[0], (n, errors[0])
    return errors[0]


@pytest.fixture()
def hf(tmp_path):
    return make_tiny_hf_checkpoint(str(tmp_path / "hf"), "llama", seed=1)


def _shard(hf_dir):
    """Rewrite a single-file checkpoint as two shards with an index."""
    sd = load_file(os.path.join(hf_dir, "model.safetensors"))
    os.remove(os.path.join(hf_dir, "model.safetensors"))
    names = sorted(sd)
    half = len(names) // 2
    wm = {}
    for i, part in enumerate([names[:half], names[half:]]):
        fn = f"model-0000{i + 1}-of-00002.safetensors"
        save_file({k: sd[k] for k in part}, os.path.join(hf_dir, fn), metadata={"format": "pt"})
        wm.update({k: fn for k in part})
    with open(os.path.join(hf_dir, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": wm}, f)
    return wm


def test_missing_shard_file(hf, tmp_path):
    wm = _shard(hf)
    os.remove(os.path.join(hf, "model-00002-of-00002.safetensors"))
    rc, lines = _convert(hf, str(tmp_path / "out"))
    _expect_error(rc, lines, "model-00002-of-00002.safetensors", "does not exist")
    assert any(v == "model-00002-of-00002.safetensors" for v in wm.values())


def test_truncated_safetensors(hf, tmp_path):
    path = os.path.join(hf, "model.safetensors")
    size = os.path.getsize(path)
    with open(path, "r+b") as f:
        f.truncate(size // 2)
    rc, lines = _convert(hf, str(tmp_path / "out"))
    _expect_error(rc, lines, "model.safetensors")


def test_heads_not_divisible_by_tp(hf, tmp_path):
    rc, lines = _convert(hf, str(tmp_path / "out"), "--tp", "3")
    _expect_error(rc, lines, "num_attention_heads=4", "tp=3", "config.json")


def test_unknown_architecture(hf, tmp_path):
    cfg_path = os.path.join(hf, "config.json")
    with open(cfg_path) as f:
        cfg = json.load(f)
    cfg["architectures"] = ["GPTNeoXForCausalLM"]
    with open(cfg_path, "w") as f:
        json.dump(cfg, f)
    rc, lines = _convert(hf, str(tmp_path / "out"))
    _expect_error(rc, lines, "GPTNeoXForCausalLM", "config.json")


def test_shapes_disagree_with_config(hf, tmp_path):
    cfg_path = os.path.join(hf, "config.json")
    with open(cfg_path) as f:
        cfg = json.load(f)
    cfg["intermediate_size"] = 96  # the weights were made with 128
    with open(cfg_path, "w") as f:
        json.dump(cfg, f)
    rc, lines = _convert(hf, str(tmp_path / "out"))
    _expect_error(rc, lines, "model.safetensors", "mlp", "[96, 64]")


def test_unknown_config_key_is_rejected_by_name():
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 10,
           "hidden_size": 8, "intermediate_size": 16, "num_hidden_layers": 1,
           "num_attention_heads": 2, "attn_logit_softcapping": 50.0}
    with pytest.raises(ModelConfigError, match="attn_logit_softcapping"):
        spec_from_hf_config(cfg)
    cfg.pop("attn_logit_softcapping")
    cfg["rope_scaling"] = {"rope_type": "yarn", "factor": 4.0}
    with pytest.raises(ModelConfigError, match="yarn"):
        spec_from_hf_config(cfg)
    cfg.pop("rope_scaling")
    cfg["hidden_act"] = "gelu"
    with pytest.raises(ModelConfigError, match="hidden_act"):
        spec_from_hf_config(cfg)


def test_existing_output_is_not_overwritten_without_flag(hf, tmp_path):
    out = tmp_path / "meg"
    out.mkdir()
    (out / "config.json").write_text("{}")
    rc, lines = _convert(hf, str(out))
    _expect_error(rc, lines, str(out), "--overwrite")
    assert (out / "config.json").read_text() == "{}"
    rc, lines = _convert(hf, hf)
    _expect_error(rc, lines, "source checkpoint")
    rc, lines = _convert(hf, str(out), "--overwrite")
    assert rc == 0, lines
    assert (out / "megarl_model.json").exists()
