"""Tokenizer contract: deterministic hash, sensitivity to what decides ids, encode once."""

import pytest

from megarl.builtin.tiny_tokenizer import TINY_CHAT_TEMPLATE, build_tiny_tokenizer
from megarl.data.tokenizer import TokenizerContract, TokenizerMismatchError


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("tok")
    build_tiny_tokenizer(d)
    return d


def test_hash_is_reproducible_across_builds_and_loads(tok_dir, tmp_path):
    a = TokenizerContract.from_pretrained(tok_dir)
    build_tiny_tokenizer(tmp_path)
    b = TokenizerContract.from_pretrained(tmp_path)
    assert a.hash == b.hash and a.hash.startswith("sha256:")
    a.require_same(b.hash, "rollout")


def test_hash_changes_with_template_vocab_and_special_tokens(tok_dir):
    base = TokenizerContract.from_pretrained(tok_dir)
    other_template = TokenizerContract.from_tokenizer(base.tokenizer, TINY_CHAT_TEMPLATE.replace("<|end|>", ""))
    assert other_template.hash != base.hash
    tok = TokenizerContract.from_pretrained(tok_dir).tokenizer
    tok.add_tokens(["newword"])
    assert TokenizerContract.from_tokenizer(tok).hash != base.hash
    tok2 = TokenizerContract.from_pretrained(tok_dir).tokenizer
    tok2.eos_token = "<|end|>"  # same vocab, different eos id
    assert TokenizerContract.from_tokenizer(tok2).hash != base.hash
    with pytest.raises(TokenizerMismatchError, match="actor has"):
        base.require_same(other_template.hash, "actor")


def test_encode_prompt_templates_messages_once(tok_dir):
    c = TokenizerContract.from_pretrained(tok_dir)
    ids = c.encode_prompt([{"role": "user", "content": "What is 12 + 7 ?"}])
    toks = c.tokenizer.convert_ids_to_tokens(ids)
    assert toks == ["<bos>", "<|user|>", "what", "is", "1", "2", "+", "7", "?", "<|end|>", "<|assistant|>"]
    assert toks.count("<bos>") == 1  # the template's BOS is not doubled by add_special_tokens
    no_gen = c.encode_prompt([{"role": "user", "content": "hello"}], add_generation_prompt=False)
    assert c.tokenizer.convert_ids_to_tokens(no_gen)[-1] == "<|end|>"
    assert c.encode_prompt("what is 3 ?") == c.tokenizer.encode("what is 3 ?")
    with pytest.raises(ValueError, match="message 0"):
        c.encode_prompt([{"content": "x"}])
    assert c.eos_token_id == c.tokenizer.convert_tokens_to_ids("<eos>")
    assert c.vocab_size == len(c.tokenizer) < 320  # fits the tiny test model's vocab


def test_contract_without_template_refuses_messages(tok_dir):
    c = TokenizerContract.from_pretrained(tok_dir)
    bare = TokenizerContract(c.tokenizer, None, "sha256:" + "0" * 64)
    with pytest.raises(TokenizerMismatchError, match="no chat template"):
        bare.encode_prompt([{"role": "user", "content": "x"}])
