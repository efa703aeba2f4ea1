"""Preference files (megarl/data/preference.py) and the built-in arithmetic pairs
(megarl/builtin/preference_pairs.py)."""

import json
from collections import Counter

import pytest

from megarl.builtin.preference_pairs import MISSES, TRAIN_MIX, arithmetic_pairs
from megarl.data.preference import PreferenceDataError, parse_pair, read_pairs, render_pairs
from megarl.data.tasks.arithmetic import problem_key, score


def _write(tmp_path, rows, name="pairs.jsonl"):
    p = tmp_path / name
    p.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return str(p)


def test_both_layouts_parse_to_the_same_pair():
    text = parse_pair({"prompt": [{"role": "user", "content": "q"}], "chosen": "a", "rejected": "b"}, "f:1")
    chat = parse_pair({"chosen": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}],
                       "rejected": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "b"}]}, "f:2")
    assert (text.messages, text.chosen, text.rejected) == (chat.messages, chat.chosen, chat.rejected)
    plain = parse_pair({"prompt": "q", "chosen": "a", "rejected": "b"}, "f:3")
    assert plain.messages is None and plain.prompt_text == "q"


@pytest.mark.parametrize("row, words", [
    ({"prompt": "q", "chosen": "a"}, ["f.jsonl:2", "no rejected key"]),
    ({"prompt": "q", "good": "a", "bad": "b"}, ["f.jsonl:2", "chosen / rejected"]),
    ({"chosen": "a", "rejected": "b"}, ["f.jsonl:2", "prompt"]),
    ({"prompt": "q", "chosen": 3, "rejected": "b"}, ["f.jsonl:2", "chosen"]),
    ({"prompt": "q", "chosen": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}],
      "rejected": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "b"}]}, ["prompt key is not allowed"]),
    ({"chosen": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}],
      "rejected": [{"role": "user", "content": "other"}, {"role": "assistant", "content": "b"}]}, ["share the conversation"]),
    ({"chosen": [{"role": "user", "content": "q"}], "rejected": [{"role": "user", "content": "r"}]},
     ["last message must be the assistant"]),
    ("{not json", ["f.jsonl:2", "not JSON"]),
])
def test_a_bad_row_is_refused_naming_its_line_and_key(tmp_path, row, words):
    path = _write(tmp_path, [{"prompt": "q", "chosen": "a", "rejected": "b"}, row], "f.jsonl")
    with pytest.raises(PreferenceDataError) as e:
        read_pairs(path, "data.train_path")
    for w in words:
        assert w in str(e.value), str(e.value)


def test_missing_and_empty_files_name_the_key(tmp_path):
    with pytest.raises(PreferenceDataError, match="data.heldout_path: .*no such file"):
        read_pairs(str(tmp_path / "nope.jsonl"), "data.heldout_path")
    with pytest.raises(PreferenceDataError, match="holds no pairs"):
        read_pairs(_write(tmp_path, []), "data.train_path")


def test_rendering_refuses_long_rows_and_pairs_without_a_preference(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from megarl.data.tokenizer import TokenizerContract

    vocab = {w: i for i, w in enumerate(["<pad>", "<unk>", "q", "a", "b", "c"])}
    t = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    t.pre_tokenizer = pre_tokenizers.Whitespace()
    contract = TokenizerContract.from_tokenizer(PreTrainedTokenizerFast(tokenizer_object=t, pad_token="<pad>"))
    # no chat template: the prompt and the response texts joined, as the scorer renders them
    ok = parse_pair({"prompt": "q ", "chosen": "a", "rejected": "b"}, "f:1")
    assert render_pairs(contract, [ok], 8, "data.max_tokens") == [([2, 3], [2, 4])]
    long = parse_pair({"prompt": "q q q q ", "chosen": "a a a a a", "rejected": "b"}, "f:7")
    with pytest.raises(PreferenceDataError, match="f:7: renders to 9 tokens, over data.max_tokens=8"):
        render_pairs(contract, [long], 8, "data.max_tokens")
    same = parse_pair({"prompt": "q ", "chosen": "a", "rejected": "a "}, "f:9")
    with pytest.raises(PreferenceDataError, match="f:9: .*same tokens"):
        render_pairs(contract, [same], 8, "data.max_tokens")


def test_a_reference_guided_rendering_fills_the_user_turn_with_the_rows_fields(tmp_path):
    """``data.prompt`` / ``reward.models[i].prompt``: the last user turn is the template filled with
    the turn's text and the row's fields (the other turns kept); a row without a field is refused
    naming its line and the key."""
    from megarl.builtin.tiny_tokenizer import build_tiny_tokenizer
    from megarl.data.scorer_input import render_for_scorer, scorer_chat
    from megarl.data.tokenizer import TokenizerContract

    ctx = "{prompt} answer : {answer}"
    chat = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "what is 1 plus 2 ?"}]
    assert scorer_chat(chat, "ignored", ctx, {"answer": " 3 "}) == [
        {"role": "system", "content": "be brief"}, {"role": "user", "content": "what is 1 plus 2 ? answer : 3"}]
    assert scorer_chat(None, "q", None, {"answer": 3}) == [{"role": "user", "content": "q"}]
    with pytest.raises(KeyError, match=r"reward.models\[0\].prompt reads the row's \['answer'\]"):
        scorer_chat(None, "q", ctx, {"target": 3}, key="reward.models[0].prompt")
    build_tiny_tokenizer(tmp_path / "tok")
    contract = TokenizerContract.load(str(tmp_path / "tok"))
    pair = parse_pair({"id": "p1", "prompt": "what is 1 plus 2 ?", "chosen": "3", "rejected": "4", "answer": "3"},
                      "f:1")
    assert pair.ground_truth == {"id": "p1", "answer": "3"}
    (good, bad), = render_pairs(contract, [pair], 64, "data.max_tokens", ctx)
    assert good == render_for_scorer(contract, None, "what is 1 plus 2 ?", "3", ctx, {"answer": "3"})
    assert contract.decode(good) == ("<bos> <|user|> what is 1 plus 2 ? answer : 3 <|end|> <|assistant|> 3 <|end|>")
    assert render_pairs(contract, [pair], 64, "data.max_tokens") != [(good, bad)]  # without it: another input
    lacking = parse_pair({"prompt": "what is 1 plus 2 ?", "chosen": "3", "rejected": "4"}, "f:4")
    with pytest.raises(PreferenceDataError, match=r"f:4: data.prompt reads the row's \['answer'\]"):
        render_pairs(contract, [lacking], 64, "data.max_tokens", ctx)


def test_builtin_pairs_are_ranked_by_the_rule_and_splits_never_share_a_problem():
    train, heldout = arithmetic_pairs("train", 300), arithmetic_pairs("heldout", 120)
    assert arithmetic_pairs("train", 300) == train  # a function of (split, n)
    for p in train + heldout:
        assert score(p["chosen"], p["chosen"]) == 1.0 and score(p["rejected"], p["chosen"]) == 0.0, p
        assert p["answer"] == p["chosen"]  # the reference a reference-guided model reads
    # train: half off by 1-3 (the policy's most frequent miss), every kind present; held-out: even
    assert Counter(p["miss"] for p in train) == {k: 300 // len(TRAIN_MIX) * TRAIN_MIX.count(k) for k in MISSES}
    assert Counter(p["miss"] for p in train)["off_by_small"] == 150
    assert Counter(p["miss"] for p in heldout) == {k: 120 // len(MISSES) for k in MISSES}
    assert not {problem_key(p) for p in train} & {problem_key(p) for p in heldout}
