"""Environment output to tokens, once, by the chat template; and checks of the template itself.

A multi-turn trajectory is a token list that only grows: the prompt's ids, then each policy
turn's sampled ids exactly as generated, then the environment's messages rendered to ids by
:class:`EnvTurnRenderer` -- never by decoding the trajectory, re-templating the conversation and
re-encoding it (the re-tokenization bug, TRL #5224).

How a render is made: :class:`EnvTurnRenderer`; the checks of the template itself:
:func:`check_template`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence, Union

from megarl.data.tokenizer import TokenizerMismatchError
from megarl.envs.protocol import Message, check_messages

__all__ = ["EnvTurnRenderer", "EnvRenderError", "TemplateReport", "RenderedConversation", "check_template",
           "session_matches_template", "render_conversation", "PROBE_Q", "PROBE_A"]

PROBE_Q = "megarl probe question"
PROBE_A = "megarl probe answer"

#: a policy turn in :func:`session_matches_template`: the assistant message (or its text), or
#: the ids the engine generated (decoded only to build the template's side of the comparison)
PolicyTurn = Union[Message, str, Sequence[int]]


class EnvRenderError(ValueError):
    """Environment messages that cannot be rendered safely (a special token in their text)."""


class EnvTurnRenderer:
    """Renders environment messages to the ids appended after a finished policy turn.

    ``assistant_end_ids``: the ids that end a policy turn (generation stop tokens): the
    template's end-of-turn token, then EOS when it is another token.  ``end_of_turn_id`` is the
    first of them, the one the template itself writes.

    **How a render is made.**  The template is asked once per environment step for a fixed probe
    conversation ``[user: PROBE_Q, assistant: PROBE_A]`` followed by the new messages, all of them in
    *one* call (parallel tool messages are templated together, slime #2263), with the generation
    prompt of the next assistant turn.  The ids to append are the encoding of that text after the
    probe assistant's end-of-turn token (the first special token the template writes after an
    assistant message's content: ``<|end|>`` for the tiny template, ``<|im_end|>`` for Qwen's).
    What the template writes after that token (Qwen's ``\\n``) belongs to the environment's render,
    since the policy stops at the end-of-turn token.  The render does not depend on the real
    conversation, so earlier turns are never re-rendered.
    """

    def __init__(self, contract):
        if contract.chat_template is None:
            raise TokenizerMismatchError(
                f"an agent needs a chat template to render environment messages; the tokenizer contract "
                f"({contract.source}) has none")
        self.contract, self.tokenizer = contract, contract.tokenizer
        turn = self.text([Message("user", PROBE_Q), Message("assistant", PROBE_A)], False)
        gen = self.text([Message("user", PROBE_Q)], True)
        at = turn.rfind(PROBE_A)
        if at < 0 or not turn.startswith(gen):
            raise TokenizerMismatchError(
                "chat template: an assistant message is not rendered as the generation prompt followed by its "
                f"content (prompt {gen[-40:]!r}, turn {turn[-80:]!r}); megarl cannot tell what the policy generates")
        rest = turn[at + len(PROBE_A):]
        specials = sorted({str(t) for t in self.tokenizer.all_special_tokens}, key=len, reverse=True)
        # every token matched before pre-tokenization (special or merely added, like Qwen's <tool_call>)
        added = {str(getattr(t, "content", t)) for t in getattr(self.tokenizer, "added_tokens_decoder", {}).values()}
        self._specials = tuple(sorted({t for t in specials if t} | {t for t in added if t}, key=len, reverse=True))
        hits = [(rest.find(t), t) for t in specials if t and rest.find(t) >= 0]
        if not hits:
            raise TokenizerMismatchError(
                f"chat template writes no special token after an assistant message ({rest!r}); a policy turn "
                "has no end-of-turn token to stop at")
        pos, self.end_text = min(hits, key=lambda h: (h[0], -len(h[1])))
        self.lead_text = turn[len(gen):at]  # what the template writes before the content (Qwen3: an empty think block)
        self.between_text = rest[:pos]  # ... and between the content and the end-of-turn token
        self.end_of_turn_id = int(self.tokenizer.convert_tokens_to_ids(self.end_text))
        eos = self.tokenizer.eos_token_id
        self.assistant_end_ids = tuple(dict.fromkeys(
            [self.end_of_turn_id] + ([int(eos)] if eos is not None else [])))

    # ---- text and ids -----------------------------------------------------------------------

    def text(self, messages: Sequence[Message], add_generation_prompt: bool) -> str:
        """The template's text for ``messages`` (one call)."""
        return self.tokenizer.apply_chat_template(
            [m.as_dict() for m in messages], chat_template=self.contract.chat_template, tokenize=False,
            add_generation_prompt=add_generation_prompt)

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def _after_probe(self, messages: Sequence[Message], add_generation_prompt: bool) -> str:
        """The text the template writes after the probe assistant's end-of-turn token."""
        full = self.text([Message("user", PROBE_Q), Message("assistant", PROBE_A), *messages], add_generation_prompt)
        at = full.find(PROBE_A)
        end = full.find(self.end_text, at + len(PROBE_A)) if at >= 0 else -1
        if end < 0:
            raise TokenizerMismatchError("chat template: the probe assistant turn is not rendered before the "
                                         "environment messages; cannot tell where they begin")
        return full[end + len(self.end_text):]

    def render_text(self, messages: Sequence[Message], add_generation_prompt: bool = True) -> str:
        return self._after_probe(check_messages(messages, "environment messages"), add_generation_prompt)

    def render(self, messages: Sequence[Message]) -> list[int]:
        """The ids to append after a finished policy turn: ``messages`` (all in one template
        call) and the generation prompt of the next assistant turn.

        A message whose content holds a special token's text (``<|im_end|>``, ``<|end|>``, ...)
        raises :class:`EnvRenderError`: encoded, it would become that control token and could end
        or forge a turn (an environment echoing policy text, a hostile tool); the session treats
        it as an ``invalid`` environment step.
        """
        msgs = check_messages(messages, "environment messages")
        for k, m in enumerate(msgs):
            found = [(m.content.find(t), t) for t in self._specials if t in m.content]
            if found:
                hit = min(found)[1]  # the first in the text
                raise EnvRenderError(f"environment message {k} ({m.role}) contains the special token {hit!r}; "
                                     "it would be encoded as that control token")
        return self.encode(self._after_probe(msgs, True))

    def assistant_turn_ids(self, history: Sequence[Message], message: Message | str) -> list[int]:
        """The ids a policy that speaks the template generates for ``message`` after ``history``
        (which the session has rendered up to the generation prompt): the template's rendering of
        it as the newest message, through the end-of-turn token.  For demonstrations and checks;
        a real session keeps the engine's ids."""
        msg = message if isinstance(message, Message) else Message("assistant", message)
        if msg.role != "assistant":
            raise ValueError(f"assistant_turn_ids: expected an assistant message, got role {msg.role!r}")
        before = self.text(history, True)
        turn = self.text([*history, msg], False)
        end = turn.rfind(self.end_text)
        if turn.startswith(before) and end >= len(before):
            return self.encode(turn[len(before):end + len(self.end_text)])
        # the template renders the history differently when an assistant turn follows: the
        # generic shape of a turn instead
        return self.encode(self.lead_text + msg.content + self.between_text + self.end_text)


@dataclass(frozen=True)
class RenderedConversation:
    """A conversation as a session builds it: ``prompt_ids``, then ``response_ids`` with per-token
    ``sources`` (1 policy, 2 environment) and ``turns`` (0-based; a policy turn and the
    environment output after it share the index) -- the layout
    ``megarl.control.batch.collate_trajectories`` takes."""

    prompt_ids: list[int]
    response_ids: list[int]
    sources: list[int]
    turns: list[int]
    spans: list[tuple[str, int, int, int]] = field(default_factory=list)  # (kind, turn, start, end) in ids
    messages: tuple[Message, ...] = ()  # the conversation, assistant turns included

    @property
    def ids(self) -> list[int]:
        return self.prompt_ids + self.response_ids


def _split_turns(messages: Sequence[Message]):
    """``(prompt messages, [(assistant message, [env messages...]), ...])``."""
    msgs = list(messages)
    first = next((i for i, m in enumerate(msgs) if m.role == "assistant"), len(msgs))
    prompt, turns = msgs[:first], []
    for m in msgs[first:]:
        if m.role == "assistant":
            if turns and not turns[-1][1]:
                raise ValueError("render_conversation: two assistant messages in a row (a turn needs the "
                                 "environment's messages between)")
            turns.append((m, []))
        else:
            turns[-1][1].append(m)
    if not prompt:
        raise ValueError("render_conversation: the conversation needs a prompt before the first assistant message")
    return prompt, turns


def _build(renderer: EnvTurnRenderer, prompt: Sequence[Message], turns) -> RenderedConversation:
    """The session's ids for ``prompt`` and ``turns`` ((policy turn, env messages) pairs)."""
    prompt = check_messages(list(prompt), "prompt messages")
    prompt_ids = renderer.contract.encode_prompt([m.as_dict() for m in prompt], add_generation_prompt=True)
    history: list[Message] = list(prompt)
    response, sources, turn_idx, spans = [], [], [], []
    for k, (policy, env_msgs) in enumerate(turns):
        env_msgs = check_messages(list(env_msgs), f"turn {k}'s environment messages")
        if isinstance(policy, (Message, str)):
            msg = policy if isinstance(policy, Message) else Message("assistant", policy)
            pol_ids = renderer.assistant_turn_ids(history, msg)
        else:
            pol_ids = [int(i) for i in policy]
            body = pol_ids[:-1] if pol_ids and pol_ids[-1] in renderer.assistant_end_ids else pol_ids
            msg = Message("assistant", renderer.contract.decode(body))  # the template's side only
        start = len(prompt_ids) + len(response)
        response += pol_ids
        sources += [1] * len(pol_ids)
        turn_idx += [k] * len(pol_ids)
        spans.append(("policy", k, start, start + len(pol_ids)))
        history.append(msg)
        if env_msgs:
            env_ids = renderer.render(env_msgs)
            start = len(prompt_ids) + len(response)
            response += env_ids
            sources += [2] * len(env_ids)
            turn_idx += [k] * len(env_ids)
            spans.append(("environment", k, start, start + len(env_ids)))
            history += env_msgs
    return RenderedConversation(list(prompt_ids), response, sources, turn_idx, spans, tuple(history))


def render_conversation(renderer: EnvTurnRenderer, messages: Sequence[Message]) -> RenderedConversation:
    """A whole conversation (prompt messages, then assistant turns each followed by environment
    messages) as the token list a session builds for it, assistant turns as a template-speaking
    policy generates them (:meth:`EnvTurnRenderer.assistant_turn_ids`).  For warm-start
    demonstrations: train on ``response_ids`` with loss where ``sources == 1``."""
    prompt, turns = _split_turns(check_messages(list(messages), "messages"))
    return _build(renderer, prompt, turns)


def _difference(renderer: EnvTurnRenderer, session: RenderedConversation, ref: list[int]) -> str:
    ids = session.ids
    i = next((k for k, (a, b) in enumerate(zip(ids, ref, strict=False)) if a != b), min(len(ids), len(ref)))
    where = "the prompt" if i < len(session.prompt_ids) else "the template's tokens after the session's last"
    for kind, turn, start, end in session.spans:
        if start <= i < end:
            where = f"turn {turn} ({kind} tokens)"
    tok = renderer.tokenizer.convert_ids_to_tokens
    lo = max(0, i - 3)
    return (f"first difference at token {i} of {len(ids)} (session) / {len(ref)} (template), in {where}: "
            f"session {tok(ids[lo:i + 6])} vs template {tok(ref[lo:i + 6])}")


def session_matches_template(contract, prompt_messages: Sequence[Message],
                             turns: Sequence[tuple[PolicyTurn, Sequence[Message]]],
                             renderer: EnvTurnRenderer | None = None) -> tuple[bool, str]:
    """``(equal, detail)``: do the ids a session builds for this conversation (prompt ids, each
    policy turn's ids, each render) equal the template's encoding of the same conversation?

    ``turns``: ``(policy turn, environment messages after it)`` pairs; a policy turn is an
    assistant :class:`Message` / text (its ids: :meth:`EnvTurnRenderer.assistant_turn_ids`) or
    the engine's ids.  The template side ends with the generation prompt when the last turn has
    environment messages; otherwise with the last assistant turn, whose trailer after the
    end-of-turn token (Qwen's ``\\n``, never generated) may follow the session's ids.
    """
    r = renderer or EnvTurnRenderer(contract)
    session = _build(r, prompt_messages, turns)
    msgs = session.messages
    open_turn = bool(turns) and bool(list(turns[-1][1]))
    ref = r.encode(r.text(msgs, open_turn))
    ids = session.ids
    if not open_turn and turns and len(ref) >= len(ids):
        trailer = r.encode(r._after_probe((), False))  # what follows an assistant's end-of-turn token
        if ref[:len(ids)] == ids and ref[len(ids):] == trailer:
            return True, f"the session's {len(ids)} ids equal the template's rendering"
    elif ref == ids:
        return True, f"the session's {len(ids)} ids equal the template's rendering"
    return False, _difference(r, session, ref)


@dataclass(frozen=True)
class TemplateReport:
    """What :func:`check_template` found (below); ``details`` says it in words.

    **Checks.**  :func:`check_template` runs a synthetic agent conversation (tool calls, parallel
    tool results, a user feedback message, ``<think>`` blocks) and reports:

    - ``prefix_stable``: the session's ids (prompt ids + policy ids + renders) equal the template's
      encoding of the whole conversation (:func:`session_matches_template`);
    - ``rewrites_earlier_turns``: the template renders an earlier assistant turn differently once
      more messages follow (Qwen3 drops ``<think>`` blocks of turns before the last user message,
      NeMo-RL #2821).  The session's rule is then: keep the generated tokens, never re-render past
      turns; the difference from the template's rendering is reported, not "fixed";
    - ``parallel_tool_messages``: several tool messages rendered in one call equal the template's
      rendering of them in the conversation; ``one_at_a_time_differs`` says whether templating them
      one by one would have been wrong for this template;
    - ``unknown_token_roles``: environment roles whose rendering contains the unknown token (the
      tiny vocabulary has no ``<|tool|>``).
    """

    prefix_stable: bool
    rewrites_earlier_turns: bool
    parallel_tool_messages: bool
    one_at_a_time_differs: bool
    unknown_token_roles: tuple[str, ...]
    details: str

    @property
    def rule(self) -> str:
        if self.prefix_stable:
            return "prefix-stable: a session's ids equal the template's rendering of its conversation"
        return ("not prefix-stable: the session keeps the generated tokens and never re-renders past turns; "
                "its ids differ from the template's rendering of the same conversation")


def _synthetic():
    """The conversation the checks run: tool calls with think blocks, two parallel tool results,
    a user feedback message, a final answer."""
    prompt = [Message("user", "what is 12 plus 34 ?")]
    turns = [
        (Message("assistant", "<think> add </think> [ 12 + 34 ]"), [Message("tool", "46")]),
        (Message("assistant", "<think> check </think> [ 46 - 34 ] [ 46 - 12 ]"),
         [Message("tool", "12"), Message("tool", "34")]),
        (Message("assistant", "<think> so </think> 46"), [Message("user", "4 6")]),
        (Message("assistant", "<think> done </think> 46"), []),
    ]
    return prompt, turns


def check_template(contract) -> TemplateReport:
    """Check the contract's chat template for agent use (:class:`TemplateReport`); run at start-up by
    any agent rollout.  Raises :class:`TokenizerMismatchError` when the template cannot be used
    at all (no template, no end-of-turn token)."""
    r = EnvTurnRenderer(contract)
    try:
        return _check(contract, r)
    except TokenizerMismatchError:
        raise
    except Exception as e:  # the template itself raised (a role it does not support, ...)
        raise TokenizerMismatchError(
            f"chat template fails on an agent conversation (user, assistant, tool messages): "
            f"{type(e).__name__}: {e}") from None


def _check(contract, r: EnvTurnRenderer) -> TemplateReport:
    prompt, turns = _synthetic()
    stable, diff = session_matches_template(contract, prompt, turns, renderer=r)

    # rewrites: an assistant turn's text when it was the newest message vs in the full conversation
    full: list[Message] = list(prompt) + [m for a, env in turns for m in (a, *env)]
    full_text = r.text(full, False)
    rewritten, history = [], list(prompt)
    for k, (a, env) in enumerate(turns[:-1]):
        history.append(a)
        then = r.text(history, False)
        then = then[:then.rfind(r.end_text) + len(r.end_text)]
        if not full_text.startswith(then):
            rewritten.append(k)
        history += env

    # parallel tool messages: together in one render vs the template vs one at a time
    a0 = Message("assistant", "[ 46 - 34 ] [ 46 - 12 ]")
    tools = [Message("tool", "12"), Message("tool", "34")]
    base = contract.encode_prompt([m.as_dict() for m in prompt]) + r.assistant_turn_ids(prompt, a0)
    ref = r.encode(r.text([*prompt, a0, *tools], True))
    together = base + r.render(tools) == ref
    gen_prompt = r._after_probe((), True)[len(r._after_probe((), False)):]
    one_by_one = base + r.encode("".join(r._after_probe((t,), False) for t in tools) + gen_prompt)
    one_differs = one_by_one != ref

    unk = r.tokenizer.unk_token_id
    unknown = tuple(role for role in ("tool", "user")
                    if unk is not None and unk in r.render([Message(role, "1")]))
    lines = [("prefix-stable: " if stable else "NOT prefix-stable: ") + diff,
             (f"rewrites earlier assistant turns {rewritten} once later messages follow; the session keeps the "
              "generated tokens and never re-renders them" if rewritten else
              "earlier assistant turns are rendered as generated"),
             ("parallel tool messages rendered in one call equal the template's rendering" if together else
              "parallel tool messages rendered in one call DIFFER from the template's rendering in the conversation"),
             ("templating tool messages one at a time would differ (megarl renders them together)" if one_differs
              else "templating tool messages one at a time would give the same ids")]
    if unknown:
        lines.append(f"roles {list(unknown)} render with the unknown token {r.tokenizer.unk_token!r}")
    return TemplateReport(stable, bool(rewritten), together, one_differs, unknown, "\n".join(lines))
