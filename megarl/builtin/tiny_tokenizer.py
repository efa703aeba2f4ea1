"""A tiny, deterministic tokenizer with a chat template, built locally (no downloads).

For tests, the CPU embedded default and the built-in tiny model: a WordLevel vocabulary over
digits (one token per digit, so arithmetic answers tokenize position by position), arithmetic
symbols, punctuation, lowercase letters and a few words, plus chat-role special tokens.  Being
a fixed word list (not a trained BPE), the same call always produces byte-identical files and
therefore the same contract hash.
"""

from __future__ import annotations

import os
import string

__all__ = ["build_tiny_tokenizer", "TINY_CHAT_TEMPLATE", "TINY_SPECIAL_TOKENS"]

TINY_SPECIAL_TOKENS = {
    "pad_token": "<pad>",
    "unk_token": "<unk>",
    "bos_token": "<bos>",
    "eos_token": "<eos>",
}
_ROLE_TOKENS = ["<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]

TINY_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "<|{{ message['role'] }}|> {{ message['content'] }} <|end|> "
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|> {% endif %}"
)

_WORDS = (
    "what is the answer of plus minus times divided by equals compute solve a an and or not "
    "yes no true false number sum difference product question result think step so then "
    "hello world please give final"
).split()


def _vocab() -> dict[str, int]:
    tokens = list(TINY_SPECIAL_TOKENS.values()) + _ROLE_TOKENS
    tokens += list(string.digits)
    tokens += list("+-*/=()<>.,:;?!'\"#%&[]{}_|")
    tokens += list(string.ascii_lowercase)
    tokens += [w for w in _WORDS if w not in tokens]
    return {t: i for i, t in enumerate(dict.fromkeys(tokens))}


def build_tiny_tokenizer(out_dir: str | os.PathLike):
    """Write a PreTrainedTokenizerFast with TINY_CHAT_TEMPLATE to ``out_dir``; return it.

    Vocabulary size is ``len(tokenizer)`` (about 110); models may have a larger embedding.
    """
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.WordLevel(vocab=_vocab(), unk_token=TINY_SPECIAL_TOKENS["unk_token"]))
    backend.normalizer = normalizers.Lowercase()
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Whitespace(), pre_tokenizers.Digits(individual_digits=True)]
    )
    backend.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # joins tokens with spaces
    tok = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        additional_special_tokens=_ROLE_TOKENS,
        **TINY_SPECIAL_TOKENS,
    )
    tok.chat_template = TINY_CHAT_TEMPLATE
    os.makedirs(out_dir, exist_ok=True)
    tok.save_pretrained(os.fspath(out_dir))
    return tok
