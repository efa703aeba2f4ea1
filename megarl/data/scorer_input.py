"""What a scorer reads: the semantic sample rendered through the scorer's own tokenizer and chat
template (a reward model, a judge, a model trained on preference pairs), never the actor's ids."""

from __future__ import annotations

from typing import Optional, Sequence


def render_for_scorer(contract, messages: Optional[Sequence[dict]], prompt_text: str, response_text: str) -> list:
    """A scorer's own rendering of (prompt, response) with its tokenizer ``contract``: the chat
    (the prompt's messages, or the prompt text as one user turn) and the response as the
    assistant's turn through its chat template; without a template, the two texts joined."""
    if contract.chat_template is not None:
        chat = list(messages) if messages else [{"role": "user", "content": prompt_text}]
        return contract.encode_prompt(chat + [{"role": "assistant", "content": response_text}],
                                      add_generation_prompt=False)
    return contract.tokenizer.encode(prompt_text + response_text, add_special_tokens=True)


def render_with_offsets(contract, messages: Optional[Sequence[dict]], prompt_text: str,
                        response_text: str) -> tuple:
    """:func:`render_for_scorer`'s ids with the rendered text and each token's character span in
    it (``(ids, text, offsets)``): what maps a process reward model's steps through characters."""
    tok = contract.tokenizer
    if contract.chat_template is not None:
        chat = list(messages) if messages else [{"role": "user", "content": prompt_text}]
        text = tok.apply_chat_template(chat + [{"role": "assistant", "content": response_text}],
                                       chat_template=contract.chat_template, tokenize=False,
                                       add_generation_prompt=False)
        enc = tok(text, add_special_tokens=False, return_offsets_mapping=True)
    else:
        text = prompt_text + response_text
        enc = tok(text, add_special_tokens=True, return_offsets_mapping=True)
    return list(enc["input_ids"]), text, [tuple(o) for o in enc["offset_mapping"]]
