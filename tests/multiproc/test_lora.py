"""LoRA adapters on megatron's parallel linears (megarl/models/lora.py): one optimizer step of the
adapters at TP=2, PP=2, DP=2 and TP=2 with sequence parallelism equals TP=1's on the same global batch -- the merged weights the
weight stream reads and the adapters themselves -- with SGD (the gradient) and AdamW with
clipping (the optimizer path); the base weights never move and only the adapters train (their
count is r x (in + out) per adapted linear); fresh adapters leave the model bitwise as it was,
and with the adapters off it is the base model bitwise, equal to a frozen copy loaded apart --
the LoRA actor's reference (asserted in the worker).  Negative
control: without the row-parallel adapter's reduction, TP=2 lands far from TP=1."""

import json

import pytest
import torch
from safetensors.torch import load_file

from megarl.builtin.tiny_checkpoint import make_tiny_hf_checkpoint
from tests._dist import torchrun
from tests._tolerance import adam_weights_tol, within

LAYOUTS = [(2, 1, 1, False), (1, 2, 1, False), (1, 1, 2, False), (2, 1, 1, True)]  # the last: sequence parallel


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora")
    hf = make_tiny_hf_checkpoint(str(root / "llama"), "llama", seed=3, vocab_size=300)
    torchrun("lora_step_worker.py", 1, "--hf", hf, "--out", str(root))
    for tp, pp, dp, sp in LAYOUTS:
        torchrun("lora_step_worker.py", tp * pp * dp, "--tp", str(tp), "--pp", str(pp), *(["--sp"] if sp else []),
                 "--hf", hf, "--out", str(root))
    torchrun("lora_step_worker.py", 2, "--tp", "2", "--no-reduce", "--hf", hf, "--out", str(root))
    return root, hf, load_file(f"{hf}/model.safetensors")


def _tol(optimizer):
    # the step at another layout sums the gradients in another order (fp32): SGD (lr 0.5) moves a
    # weight by lr x its gradient (~1e-6 relative rounding); Adam by tests/_tolerance.py's bound
    return 1e-5 if optimizer == "sgd" else adam_weights_tol(1e-3, 1, 1e-3)


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
@pytest.mark.parametrize("tp,pp,dp,sp", LAYOUTS, ids=["tp2", "pp2", "dp2", "tp2sp"])
def test_one_adapter_step_matches_single_rank(runs, optimizer, tp, pp, dp, sp):
    root, hf, initial = runs
    ref = torch.load(root / f"lora_{optimizer}_tp1_pp1_dp1.pt")
    got = torch.load(root / f"lora_{optimizer}_tp{tp}_pp{pp}_dp{dp}{'_sp' if sp else ''}.pt")
    moved = max((ref["merged"][k] - initial[k]).abs().max().item() for k in initial)
    assert moved > 1e-3, "the step did not change the merged weights; the comparison would be vacuous"
    for run in (ref, got):  # the base is frozen: read with the adapters off, it is the checkpoint's
        assert all(torch.equal(run["base"][k], initial[k]) for k in initial)
    c = json.load(open(f"{hf}/config.json"))
    h, d, inter = c["hidden_size"], c["head_dim"], c["intermediate_size"]
    qkv = (c["num_attention_heads"] + 2 * c["num_key_value_heads"]) * d
    per_layer = sum(4 * (i + o) for i, o in ((h, qkv), (c["num_attention_heads"] * d, h), (h, 2 * inter), (inter, h)))
    assert ref["trainable"] == got["trainable"] == per_layer * c["num_hidden_layers"]
    tol = _tol(optimizer)
    err = max((got["merged"][k] - ref["merged"][k]).abs().max().item() for k in initial)
    assert within(err, tol, f"lora/{optimizer}/merged"), err
    assert set(got["adapters"]) == set(ref["adapters"]) and len(ref["adapters"]) == 4 * c["num_hidden_layers"]
    err = max((got["adapters"][k][i] - ref["adapters"][k][i]).abs().max().item() for k in ref["adapters"] for i in (0, 1))
    assert within(err, tol, f"lora/{optimizer}/adapters"), err
    assert abs(got["grad_norm"] - ref["grad_norm"]) <= 1e-5 * max(1.0, ref["grad_norm"])


def test_a_missing_reduction_is_caught(runs):
    root, _, initial = runs
    ref = torch.load(root / "lora_sgd_tp1_pp1_dp1.pt")
    bad = torch.load(root / "lora_sgd_tp2_pp1_dp1_noreduce.pt")
    err = max((bad["merged"][k] - ref["merged"][k]).abs().max().item() for k in initial)
    assert err > 100 * _tol("sgd"), err
