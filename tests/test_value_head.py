"""The scalar value-head variant (critic / neural reward model) matches transformers'
``*ForTokenClassification`` (num_labels=1) and round-trips through the mapping."""

import torch

from megarl.models import mapping
from megarl.models.forward import scalar_values
from megarl.models.hf_config import load_spec
from megarl.models.megatron_ckpt import load_model
from megarl.models.tiny import make_tiny_hf_checkpoint
from megarl.models.weights import iter_hf_tensors


def test_value_head_parity_and_export(tmp_path, megatron_world):
    import transformers
    from safetensors.torch import load_file

    hf = make_tiny_hf_checkpoint(str(tmp_path / "critic"), "qwen2", seed=5, value_head=True)
    spec = load_spec(hf)
    assert spec.value_head and spec.architecture == "Qwen2ForTokenClassification"
    assert [r.hf_names for r in mapping.rules(spec)[-2:]] == [("score.weight",), ("score.bias",)]
    model = load_model(hf)
    tokens = torch.randint(0, 300, (3, 11))
    ref = transformers.AutoModelForTokenClassification.from_pretrained(hf).eval()
    with torch.no_grad():
        want = ref(tokens).logits[..., 0]
    got = scalar_values(model, tokens)
    assert (got - want).abs().max().item() < 1e-4
    src = load_file(f"{hf}/model.safetensors")
    out = dict(iter_hf_tensors(model))
    assert set(out) == set(src)
    for k in src:
        assert torch.equal(out[k], src[k]), k
