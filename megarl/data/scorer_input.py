"""What a scorer reads: the semantic sample rendered through the scorer's own tokenizer and chat
template (a reward model, a judge, a model trained on preference pairs), never the actor's ids."""

from __future__ import annotations

from typing import Mapping, Optional, Sequence


def scorer_chat(messages: Optional[Sequence[dict]], prompt_text: str, context: Optional[str] = None,
                ground_truth: Optional[Mapping] = None, key: str = "reward.models[i].prompt") -> list:
    """The chat a scorer reads before the response: the prompt's messages, or its text as one
    user turn.  With ``context`` (a reference-guided scorer's template: ``"{prompt} answer :
    {answer}"``) the last user turn is that template filled with the turn's text (``{prompt}``)
    and the row's ground-truth fields it names; a field the row lacks raises KeyError naming
    ``key`` (the start-up data check refuses such rows first)."""
    chat = list(messages) if messages else [{"role": "user", "content": prompt_text}]
    if context is None:
        return chat
    from megarl.rewards.verdicts import template_ground_truth_fields

    truth = ground_truth or {}
    reads = template_ground_truth_fields(context, own=("prompt",))
    missing = sorted(f for f in reads if truth.get(f) is None)
    if missing:
        raise KeyError(f"{key} reads the row's {missing}; this sample's ground truth has {sorted(truth)}")
    users = [i for i, m in enumerate(chat) if m["role"] == "user"]
    if not users:
        raise KeyError(f"{key}: the prompt has no user turn to fill")
    last = users[-1]
    filled = context.format(prompt=chat[last]["content"], **{f: str(truth[f]).strip() for f in reads})
    return chat[:last] + [dict(chat[last], content=filled)] + chat[last + 1:]


def render_for_scorer(contract, messages: Optional[Sequence[dict]], prompt_text: str, response_text: str,
                      context: Optional[str] = None, ground_truth: Optional[Mapping] = None,
                      key: str = "reward.models[i].prompt") -> list:
    """A scorer's own rendering of (prompt, response) with its tokenizer ``contract``: the chat
    (:func:`scorer_chat`) and the response as the assistant's turn through its chat template;
    without a template, the user turn's text and the response joined."""
    chat = scorer_chat(messages, prompt_text, context, ground_truth, key)
    if contract.chat_template is not None:
        return contract.encode_prompt(chat + [{"role": "assistant", "content": response_text}],
                                      add_generation_prompt=False)
    return contract.tokenizer.encode(_user_text(chat, messages, prompt_text, context) + response_text,
                                     add_special_tokens=True)


def _user_text(chat, messages, prompt_text: str, context: Optional[str]) -> str:
    """Without a chat template: the prompt text as it is (the filled context when one is given)."""
    if context is None:
        return prompt_text
    return [m for m in chat if m["role"] == "user"][-1]["content"]


def render_with_offsets(contract, messages: Optional[Sequence[dict]], prompt_text: str,
                        response_text: str, context: Optional[str] = None,
                        ground_truth: Optional[Mapping] = None, key: str = "reward.models[i].prompt") -> tuple:
    """:func:`render_for_scorer`'s ids with the rendered text and each token's character span in
    it (``(ids, text, offsets)``): what maps a process reward model's steps through characters."""
    tok = contract.tokenizer
    chat = scorer_chat(messages, prompt_text, context, ground_truth, key)
    if contract.chat_template is not None:
        text = tok.apply_chat_template(chat + [{"role": "assistant", "content": response_text}],
                                       chat_template=contract.chat_template, tokenize=False,
                                       add_generation_prompt=False)
        enc = tok(text, add_special_tokens=False, return_offsets_mapping=True)
    else:
        text = _user_text(chat, messages, prompt_text, context) + response_text
        enc = tok(text, add_special_tokens=True, return_offsets_mapping=True)
    return list(enc["input_ids"]), text, [tuple(o) for o in enc["offset_mapping"]]
