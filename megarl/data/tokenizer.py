"""The tokenizer + chat-template contract shared by the actor and the rollout.

Strings that look the same do not necessarily give the same action positions, so exactly one
tokenizer and one chat template are used, their hash goes into every PolicyVersion
(``tokenizer_hash``), and prompts are templated and tokenized once by
:meth:`TokenizerContract.encode_prompt`; from then on only ids travel.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from megarl.hashing import json_sha256

__all__ = ["TokenizerContract", "TokenizerMismatchError", "tokenizer_contract_hash"]


class TokenizerMismatchError(ValueError):
    """Two parties (actor, rollout, a resumed run) do not share the same tokenizer contract."""


def tokenizer_contract_hash(tokenizer, chat_template: str | None) -> str:
    """sha256 over what decides the ids: the backend tokenizer's full JSON (model, vocab, merges,
    normalizer, pre-tokenizer, post-processor, added tokens), the vocabulary, the special tokens
    with their ids, and the chat template.

    File bytes are not hashed directly: tokenizer_config.json carries fields (library version,
    cosmetic flags) that change without changing a single id.
    """
    backend = getattr(tokenizer, "backend_tokenizer", None)
    backend_json = backend.to_str() if backend is not None else None
    special = {}
    for attr in ("bos_token", "eos_token", "unk_token", "pad_token"):
        tok = getattr(tokenizer, attr, None)
        special[attr] = None if tok is None else [str(tok), tokenizer.convert_tokens_to_ids(str(tok))]
    added = sorted((int(i), str(t)) for i, t in tokenizer.added_tokens_decoder.items())
    payload = {
        "backend": backend_json,
        "vocab": sorted(tokenizer.get_vocab().items()),
        "special": special,
        "added": added,
        "chat_template": chat_template,
    }
    # non-ASCII (vocabulary, template) hashed as UTF-8; a value JSON cannot encode is an error
    return json_sha256(payload, ensure_ascii=False, default=None)


@dataclass
class TokenizerContract:
    """One tokenizer and chat template, with their hash.

    Build with :meth:`from_pretrained` on a local directory (the run's tokenizer export), or
    :meth:`from_tokenizer`.
    """

    tokenizer: object
    chat_template: str | None
    hash: str
    source: str | None = None

    @classmethod
    def from_tokenizer(cls, tokenizer, chat_template: str | None = None, source: str | None = None):
        template = chat_template if chat_template is not None else getattr(tokenizer, "chat_template", None)
        if isinstance(template, Mapping):  # named templates: hash them all, use "default"
            template = json.dumps(dict(template), sort_keys=True)
        return cls(tokenizer, template, tokenizer_contract_hash(tokenizer, template), source)

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike, chat_template: str | None = None):
        from transformers import AutoTokenizer

        path = os.fspath(path)
        if not os.path.isdir(path):
            raise FileNotFoundError(f"tokenizer directory {path} does not exist")
        return cls.from_tokenizer(AutoTokenizer.from_pretrained(path), chat_template, source=path)

    @classmethod
    def load(cls, tokenizer_dir: str | os.PathLike, chat_template_file: str | None = None):
        """The contract of the tokenizer in ``tokenizer_dir`` with the Jinja chat template read from
        ``chat_template_file`` (``model.chat_template``; None: the tokenizer's own) -- how every
        role, command and check of a run loads it."""
        template = None
        if chat_template_file:
            with open(chat_template_file, encoding="utf-8") as f:
                template = f.read()
        return cls.from_pretrained(tokenizer_dir, chat_template=template)

    # ---- ids ---------------------------------------------------------------------------------

    @property
    def eos_token_id(self) -> int | None:
        return self.tokenizer.eos_token_id

    @property
    def pad_token_id(self) -> int | None:
        return self.tokenizer.pad_token_id

    @property
    def vocab_size(self) -> int:
        return len(self.tokenizer)

    def encode_prompt(
        self, prompt: str | Sequence[Mapping[str, str]], *, add_generation_prompt: bool = True
    ) -> list[int]:
        """Template (for a message list) and tokenize a prompt, once.

        A message list ``[{"role": ..., "content": ...}, ...]`` is rendered with the contract's
        chat template (which places BOS and role markers itself) and encoded without adding
        special tokens a second time.  A plain string is encoded as-is, with the tokenizer's
        own special-token rule, for tasks that are not chats.
        """
        if isinstance(prompt, str):
            return list(self.tokenizer.encode(prompt, add_special_tokens=True))
        if self.chat_template is None:
            raise TokenizerMismatchError(
                f"encode_prompt got messages but the tokenizer contract ({self.source}) has no chat template"
            )
        for i, m in enumerate(prompt):
            if not isinstance(m, Mapping) or "role" not in m or "content" not in m:
                raise ValueError(f"encode_prompt: message {i} must have 'role' and 'content', got {m!r}")
        text = self.tokenizer.apply_chat_template(
            [dict(m) for m in prompt],
            chat_template=self.chat_template,
            tokenize=False,
            add_generation_prompt=add_generation_prompt,
        )
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        """For logs and rule-based rewards only; never re-encode the result for training."""
        return self.tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def require_same(self, other_hash: str, who: str = "peer") -> None:
        """Raise unless ``other_hash`` (from a PolicyVersion, an engine, a checkpoint) is ours."""
        if other_hash != self.hash:
            raise TokenizerMismatchError(
                f"tokenizer contract mismatch: {who} has {other_hash}, this process has {self.hash} "
                f"(source {self.source}); a tokenizer or template change needs a new run"
            )
