"""The reward-model head most checkpoints are published with, ``*ForSequenceClassification``
(num_labels=1): megarl's reward model scores as transformers does -- the head at the last
token that is not the config's pad id -- for every dense family, and exports it unchanged."""

import pytest
import torch

from megarl.builtin.tiny_checkpoint import make_tiny_hf_checkpoint
from megarl.builtin.tiny_tokenizer import build_tiny_tokenizer
from megarl.models import mapping
from megarl.models.hf_config import ModelConfigError, load_spec, sequence_score_positions
from megarl.models.weights import iter_hf_tensors
from megarl.roles.reward_model import RewardModel
from tests._tolerance import NET_FP32_LOGPROB, within

PAD = 3  # the tiny tokenizer's EOS, used as the pad id: a real EOS at a row's end is skipped
ROWS = [[5, 9, 40, 41, 7], [5, 9, 40, 41, 7, PAD], [5, 9, 40, 41, 7, PAD, PAD], [8], [5, 11, 12, 13, 14, 15, 16, 17]]


def test_positions_are_transformers_last_non_pad_token():
    tokens = torch.tensor([[1, 2, 3, 0], [1, 3, 3, 0], [3, 3, 0, 0], [4, 0, 0, 0]])
    lengths = torch.tensor([3, 3, 2, 1])
    assert sequence_score_positions(tokens, lengths, 3).tolist() == [1, 0, 0, 0]
    assert sequence_score_positions(tokens, lengths, None).tolist() == [2, 2, 1, 0]  # no pad id: the last token


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "mistral"])
def test_sequence_head_scores_as_transformers_and_exports_unchanged(tmp_path, megatron_world, family):
    import transformers
    from safetensors.torch import load_file

    tok = tmp_path / "tok"
    build_tiny_tokenizer(str(tok))
    hf = make_tiny_hf_checkpoint(str(tmp_path / "rm"), family, seed=7, sequence_head=True, pad_token_id=PAD,
                                 tokenizer_dir=str(tok))
    spec = load_spec(hf)
    assert spec.sequence_score and spec.value_head and not spec.value_head_bias
    assert spec.architecture.endswith("ForSequenceClassification")
    assert mapping.rules(spec)[-1].hf_names == ("score.weight",)
    rm = RewardModel(hf, tp=1, pp=1, micro_batch_size=2)
    got = rm.score(ROWS)

    ref = transformers.AutoModelForSequenceClassification.from_pretrained(hf).eval()
    L = max(map(len, ROWS))
    ids = torch.full((len(ROWS), L), PAD)
    att = torch.zeros_like(ids)
    for i, r in enumerate(ROWS):
        ids[i, :len(r)], att[i, :len(r)] = torch.tensor(r), 1
    with torch.no_grad():
        want = ref(input_ids=ids, attention_mask=att).logits[:, 0]
    err = float((got - want).abs().max())
    # fp32, transformers vs megatron: two implementations of the same 2-layer network
    assert within(err, NET_FP32_LOGPROB, "sequence_head/vs_transformers"), (err, got, want)
    # negative control: the last token (the token-classification reading) is another score where a
    # row ends in pad ids, and the trailing pads are what transformers skips
    with torch.no_grad():
        per_token = ref.model(input_ids=ids, attention_mask=att).last_hidden_state @ ref.score.weight[0]
    last = per_token[torch.arange(len(ROWS)), torch.tensor([len(r) - 1 for r in ROWS])]
    gap = float((last[1:3] - want[1:3]).abs().min())
    assert gap > 10 * NET_FP32_LOGPROB, gap
    assert torch.allclose(got[0], got[1]) and torch.allclose(got[1], got[2])  # the same last real token

    src = load_file(f"{hf}/model.safetensors")
    out = dict(iter_hf_tensors(rm.model))
    assert set(out) == set(src) and all(torch.equal(out[k], src[k]) for k in src)


def test_a_head_with_several_labels_is_refused_naming_the_file(tmp_path):
    import json

    hf = make_tiny_hf_checkpoint(str(tmp_path / "rm"), "llama", seed=1, sequence_head=True, pad_token_id=PAD)
    cfg = json.loads((tmp_path / "rm" / "config.json").read_text())
    cfg["id2label"] = {"0": "bad", "1": "good"}
    (tmp_path / "rm" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelConfigError, match=r"config\.json: LlamaForSequenceClassification with 2 labels"):
        load_spec(hf)
