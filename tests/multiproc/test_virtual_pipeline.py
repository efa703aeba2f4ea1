"""Virtual pipeline stages (interleaved 1F1B), the model layer: at PP=2 x VPP=2 every rank holds
two model chunks of interleaved layers, HF weights load into them and stream back out bitwise,
forward-only passes through megatron's interleaved schedule (any micro-batch count, ragged and
packed rows) equal PP=2 without virtual stages bitwise (the same per-layer arithmetic), and so
does one Adam step through the interleaved 1F1B schedule (a micro-batch count that is not a
multiple of pp is filled with zero-weight micro-batches); a checkpoint saved without virtual
stages loads into the chunks bitwise.

The config key (``parallel.vpp``) and what it refuses are here; the roles, checkpoints and
weight sync under virtual stages run end to end in
tests/e2e/test_train_e2e.py::test_ppo_torchrun_virtual_pipeline_then_resumed_without."""

import pytest
import torch
from safetensors.torch import load_file

from megarl.builtin.tiny_checkpoint import make_tiny_hf_checkpoint
from tests._dist import torchrun
from tests._tolerance import adam_weights_tol, formula_tol, within

#: llama untied; qwen2 ties the embedding to the output layer (held by the first and the last chunk);
#: qwen3_moe: megatron's MoE block spec per chunk, the router's aux and z losses on
FAMS = ("llama", "qwen2", "qwen3_moe")
MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)


def test_config_key_and_what_it_refuses(four_layer_dirs):
    from megarl.config import load_config
    from megarl.config.validation import validate
    from megarl.errors import ConfigError
    from megarl.models.fit import validate_model_fit
    from megarl.models.hf_config import load_spec
    from tests._dist import ROOT

    recipe = f"{ROOT}/configs/grpo_arith_tiny.yaml"
    assert load_config(recipe, []).parallel.vpp == 1
    assert validate(load_config(recipe, ["parallel.pp=2", "parallel.vpp=2"]), 4) == 2
    for overrides, key in ((["parallel.vpp=2"], "parallel.vpp"),  # pp = 1: nothing to interleave
                           (["parallel.pp=2", "parallel.vpp=0"], "parallel.vpp"),
                           (["parallel.pp=2", "parallel.vpp=2", "algo.routing_replay=rollout"], "algo.routing_replay"),
                           # a filler micro-batch's recompute would add its router losses
                           (["parallel.pp=2", "parallel.vpp=2", "parallel.recompute.granularity=full",
                             "actor.moe_aux_loss_coeff=0.01"], "actor.moe_aux_loss_coeff")):
        with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
            validate(load_config(recipe, overrides), 4)
    spec = load_spec(str(four_layer_dirs / "llama"))
    validate_model_fit(load_config(recipe, ["parallel.pp=2", "parallel.vpp=2"]), spec, where="llama")
    with pytest.raises(ConfigError, match=r"parallel\.vpp.*num_hidden_layers=4, not divisible by pp x vpp = 2 x 4"):
        validate_model_fit(load_config(recipe, ["parallel.pp=2", "parallel.vpp=4"]), spec, where="llama")


@pytest.fixture(scope="module")
def four_layer_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("vpp_families")
    for i, fam in enumerate(FAMS):
        make_tiny_hf_checkpoint(str(root / fam), fam, seed=11 + i, num_layers=4, vocab_size=300,
                                **(MOE if fam == "qwen3_moe" else {}))
    g = torch.Generator().manual_seed(0)
    torch.save(torch.randint(0, 256, (5, 19), generator=g), root / "tokens.pt")
    return root


def test_virtual_stages_load_stream_and_forward_like_plain_pipeline_stages(four_layer_dirs, tmp_path):
    for vpp, load in ((1, ()), (2, ("--load", "1"))):
        torchrun("vpp_worker.py", 2, "--vpp", str(vpp), "--data", str(four_layer_dirs), "--out", str(tmp_path),
                 "--families", *FAMS, *load)
    for fam in FAMS:
        v2, v1 = torch.load(tmp_path / f"{fam}_vpp2.pt"), torch.load(tmp_path / f"{fam}_vpp1.pt")
        # megatron's interleaving: rank r's chunk v holds global chunk v * pp + r (1-based layer numbers)
        assert v2["chunks"] == 2 and v2["layers"] == [[[1], [3]], [[2], [4]]], v2["layers"]
        assert v1["chunks"] == 1 and v1["layers"] == [[[1, 2]], [[3, 4]]], v1["layers"]
        # every HF tensor streams back out of the interleaved shards exactly as it was loaded
        src = {}
        for f in sorted((four_layer_dirs / fam).glob("*.safetensors")):
            src.update(load_file(str(f)))
        assert v2["hf"].keys() == src.keys()
        assert all(torch.equal(v2["hf"][k], src[k]) for k in src), [k for k in src if not torch.equal(v2["hf"][k], src[k])]
        for key in ("log_probs", "log_probs_mb1", "padded_log_probs", "packed_log_probs"):
            assert v2[key].shape == v1[key].shape and v2[key].ne(0).any(), key
            assert torch.equal(v2[key], v1[key]), (fam, key, (v2[key] - v1[key]).abs().max().item())
        # one update: the same loss terms (the filler micro-batch adds nothing), gradient and weights
        assert v2["step_ok"] and v1["step_ok"]
        # the router's losses: means over the 5 real micro-batches (the filler adds none), 4 layers
        assert v2["moe_losses"].keys() == ({"moe_aux_loss", "moe_z_loss"} if fam == "qwen3_moe" else set())
        for k, v in v1["moe_losses"].items():  # a sum over 20 (micro-batch, layer) terms in another order
            assert within(abs(v2["moe_losses"][k] - v), formula_tol(torch.float32, 20, v), f"vpp/{fam}/{k}"), \
                (k, v2["moe_losses"][k], v)
        assert v2["step_metrics"] == v1["step_metrics"] and len(v2["step_metrics"]) == 5, v2["step_metrics"]
        # the gradients are the same sums; the norm adds the tensors' squares in another order (the
        # chunks list them otherwise): one fp32 sum of as many terms, rounded twice
        gn_err = abs(v2["grad_norm"] - v1["grad_norm"])
        assert within(gn_err, formula_tol(torch.float32, 2 * len(src), v1["grad_norm"]), f"vpp/{fam}/grad_norm"), \
            (v2["grad_norm"], v1["grad_norm"])
        moved = [k for k in src if not torch.equal(v1["after"][k], src[k])]
        assert len(moved) == len(src), "every tensor moves in an Adam step"
        # clipping scales every gradient by the norm, so its last bit reaches the weights through Adam
        diff = max((v2["after"][k] - v1["after"][k]).abs().max().item() for k in src)
        assert within(diff, adam_weights_tol(1e-3, 1, v1["grad_norm"]), f"vpp/{fam}/weights"), diff
        # a checkpoint saved without virtual stages loads into two chunks per rank bitwise (the other
        # way round: the end-to-end resume in tests/e2e/test_train_e2e.py)
        assert v2["loaded_chunks"] == 2 and v2["loaded"].keys() == src.keys()
        assert all(torch.equal(v2["loaded"][k], v1["after"][k]) for k in src)
    # negative control: a filler micro-batch whose router losses count (moe_losses.suspended off)
    # moves them away from the plain pipeline's by far more than the tolerance above
    torchrun("vpp_worker.py", 2, "--vpp", "2", "--data", str(four_layer_dirs), "--out", str(tmp_path),
             "--families", "qwen3_moe", "--filler-adds-router-losses")
    bad, v1 = torch.load(tmp_path / "qwen3_moe_vpp2_unsuspended.pt"), torch.load(tmp_path / "qwen3_moe_vpp1.pt")
    off = max(abs(bad["moe_losses"][k] - v) / v for k, v in v1["moe_losses"].items())
    assert off > 1e-3, (bad["moe_losses"], v1["moe_losses"])
