"""HF -> megatron (TP=2 x PP=2 dist checkpoint) -> HF is bitwise equal tensor by tensor, for
tied and untied embeddings and a vocabulary that needs padding; the megatron checkpoint
reloads at another layout (TP=1, PP=1) with the same result."""

import json
import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from megarl.builtin.tiny_checkpoint import make_tiny_hf_checkpoint
from tests._dist import ROOT, torchrun
from tests._hf_tensors import assert_bitwise, load_all

TOOL = os.path.join(ROOT, "tools", "convert_checkpoint.py")

CASES = {
    "untied_llama_v300": dict(family="llama", vocab_size=300, tie_word_embeddings=False),
    "tied_qwen2_v257": dict(family="qwen2", vocab_size=257, tie_word_embeddings=True),
}


@pytest.mark.parametrize("case", list(CASES))
def test_roundtrip_bitwise(tmp_path, case):
    kw = dict(CASES[case])
    fam = kw.pop("family")
    hf = make_tiny_hf_checkpoint(str(tmp_path / "hf"), fam, seed=11, **kw)
    src = load_file(os.path.join(hf, "model.safetensors"))
    assert ("lm_head.weight" in src) == (not kw["tie_word_embeddings"])
    meg = str(tmp_path / "meg")
    torchrun(TOOL, 4, "hf-to-megatron", "--hf", hf, "--out", meg, "--tp", "2", "--pp", "2")
    assert os.path.isfile(os.path.join(meg, "megarl_model.json"))

    back22 = str(tmp_path / "back22")
    torchrun(TOOL, 4, "megatron-to-hf", "--megatron", meg, "--out", back22, "--tp", "2", "--pp", "2")
    assert_bitwise(src, load_all(back22), "tp2pp2 -> tp2pp2")

    # reshard on load: the same dist checkpoint at TP=1/PP=1, as a plain process, sharded output
    back11 = str(tmp_path / "back11")
    proc = subprocess.run([sys.executable, TOOL, "megatron-to-hf", "--megatron", meg, "--out", back11,
                           "--max-shard-gb", str(20e3 / 1024**3)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert os.path.isfile(os.path.join(back11, "model.safetensors.index.json"))
    assert_bitwise(src, load_all(back11), "tp2pp2 -> tp1pp1")
    with open(os.path.join(hf, "config.json")) as f:
        c0 = json.load(f)
    with open(os.path.join(back11, "config.json")) as f:
        c1 = json.load(f)
    for key in ("vocab_size", "hidden_size", "num_hidden_layers", "tie_word_embeddings", "architectures"):
        assert c0[key] == c1[key], key


def test_bf16_checkpoint_roundtrip_on_cpu(tmp_path, megatron_world):
    """On CPU the actor computes in fp32, but a bf16 HF checkpoint comes back as bf16, bitwise
    (bf16 -> fp32 is exact), through a megatron dist checkpoint in between."""
    from megarl.models.megatron_ckpt import load_model, save_megatron_checkpoint
    from megarl.models.weights import export_hf

    hf = make_tiny_hf_checkpoint(str(tmp_path / "hf"), "qwen3", seed=4, dtype=torch.bfloat16)
    src = load_file(os.path.join(hf, "model.safetensors"))
    assert all(t.dtype == torch.bfloat16 for t in src.values())
    model = load_model(hf)
    assert next(model.parameters()).dtype == torch.float32
    save_megatron_checkpoint(model, str(tmp_path / "meg"), tokenizer_dir=hf)
    again = load_model(str(tmp_path / "meg"))
    export_hf(again, str(tmp_path / "back"), tokenizer_dir=str(tmp_path / "meg"))
    assert_bitwise(src, load_all(str(tmp_path / "back")), "bf16 round trip")
