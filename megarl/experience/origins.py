"""Where each response token of a multi-turn (agent) trajectory came from.

An agent trajectory is one token list after the prompt that only grows: the policy's sampled
tokens of turn 0, the environment's rendered output (tool results, feedback, the next turn's
generation prompt), the policy's tokens of turn 1, and so on.  :class:`TokenOrigins` records, on
the experience grid ``(bs, response_len)`` aligned with ``response_ids``:

- ``source`` int8: :class:`TokenSource` -- 0 padding, 1 policy (a sampled token), 2 environment;
- ``turn`` int16: the 0-based turn of each token; a policy turn and the environment output that
  follows it share the index, so the index rises by exactly one where a policy token follows an
  environment token and nowhere else; -1 on padding;
- ``version_index`` int16: index into ``versions`` of the policy version that sampled the token,
  -1 on environment tokens and padding (a trajectory may span weight updates: each token keeps
  the version that generated it);
- ``versions``: the distinct ``PolicyVersion.short_id`` s the indices point at.

The construction checks every rule that needs no other field (errors name the row and the
response position); :class:`~megarl.experience.schema.ExperienceFacts` checks the rules that
tie the origins to the rest of the record (response mask, padding, per-sample policy version,
rollout log-probs).  Single-turn records carry no origins (``None``): their content hash is the
one they always had.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from enum import IntEnum
from typing import Sequence

import torch


class TokenSource(IntEnum):
    """The producer of one response token (the values of ``TokenOrigins.source``)."""

    PAD = 0
    POLICY = 1  # sampled by the policy: an action, in the loss
    ENVIRONMENT = 2  # rendered environment output: context for later turns, never an action


def first_bad(bad: torch.Tensor) -> tuple[int, int] | None:
    """The first ``(row, position)`` where the ``(bs, R)`` bool ``bad`` is True, in row-major
    order; None when there is none."""
    if not bool(bad.any()):
        return None
    b, t = bad.nonzero()[0].tolist()
    return int(b), int(t)


@dataclass(frozen=True)
class TokenOrigins:
    """Per-token source, turn and policy version of a batch of trajectories (module docstring).

    Rules checked here (a failure names the row and the response position):
    - ``source`` in {0, 1, 2}, padding (0) only at the end of a row;
    - ``turn`` is -1 exactly on padding; a non-empty row starts with a policy token of turn 0;
      between consecutive tokens the turn rises by exactly 1 where an environment token is
      followed by a policy token, and stays equal everywhere else (so it never decreases);
    - ``version_index`` is in ``[0, len(versions))`` exactly where ``source`` is policy, -1
      elsewhere; ``versions`` are distinct, non-empty strings.
    """

    source: torch.Tensor
    turn: torch.Tensor
    version_index: torch.Tensor
    versions: tuple[str, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "versions", tuple(self.versions))
        for name, dtype in (("source", torch.int8), ("turn", torch.int16), ("version_index", torch.int16)):
            t = getattr(self, name)
            if not isinstance(t, torch.Tensor) or t.dim() != 2:
                raise ValueError(f"TokenOrigins.{name} must be a (bs, response_len) tensor")
            # fixed dtypes: the bytes (and so the content hash) of a record do not depend on how it was built
            if t.dtype != dtype:
                raise ValueError(f"TokenOrigins.{name} must be {dtype}, got {t.dtype}")
            if t.shape != self.source.shape:
                raise ValueError(f"TokenOrigins.{name} has shape {tuple(t.shape)}, source {tuple(self.source.shape)}")
        if any(not isinstance(v, str) or not v for v in self.versions) or len(set(self.versions)) != len(self.versions):
            raise ValueError(f"TokenOrigins.versions must be distinct non-empty version ids, got {self.versions}")
        self._check()

    def _check(self) -> None:
        src, turn, vi = self.source.long(), self.turn.long(), self.version_index.long()

        def fail(rule: str, bad: torch.Tensor) -> None:
            at = first_bad(bad)
            if at is not None:
                raise ValueError(f"TokenOrigins: row {at[0]}, response position {at[1]}: {rule}")

        fail("source must be 0 (pad), 1 (policy) or 2 (environment)", (src < 0) | (src > 2))
        real = src != 0
        fail("padding (source 0) before a real token: padding only at the row's end", ~real[:, :-1] & real[:, 1:])
        policy, env = src == TokenSource.POLICY, src == TokenSource.ENVIRONMENT
        fail("turn must be -1 on padding", ~real & (turn != -1))
        fail("turn must be >= 0 on a real token", real & (turn < 0))
        if src.shape[1]:
            fail("a trajectory starts with a policy token of turn 0",
                 (real[:, :1] & (~policy[:, :1] | (turn[:, :1] != 0))))
            # column t compares token t with token t - 1 (column 0: no predecessor), so an error
            # names the token whose turn is wrong
            no = torch.zeros_like(real[:, :1])
            step = torch.cat([torch.zeros_like(turn[:, :1]), turn[:, 1:] - turn[:, :-1]], dim=1)
            new_turn = torch.cat([no, env[:, :-1] & policy[:, 1:]], dim=1)
            # padding is a suffix: a real token's predecessor is real
            fail("turn must rise by exactly 1 where a policy token follows an environment token",
                 real & new_turn & (step != 1))
            fail("turn may change only where a policy token follows an environment token",
                 real & ~new_turn & (step != 0))
        fail("version_index must be -1 on environment tokens and padding", ~policy & (vi != -1))
        fail(f"version_index must index versions (0..{len(self.versions) - 1}) on a policy token",
             policy & ((vi < 0) | (vi >= len(self.versions))))

    @property
    def batch_size(self) -> int:
        return int(self.source.shape[0])

    def policy_mask(self) -> torch.Tensor:
        """``(bs, R)`` bool: the sampled (policy) tokens, i.e. what ``response_mask`` must be."""
        return self.source == TokenSource.POLICY

    def environment_mask(self) -> torch.Tensor:
        """``(bs, R)`` bool: the environment tokens."""
        return self.source == TokenSource.ENVIRONMENT

    def num_turns(self) -> torch.Tensor:
        """``(bs,)`` int64: policy turns per trajectory (0 for an empty row)."""
        if not self.turn.shape[1]:
            return torch.zeros(self.batch_size, dtype=torch.long)
        return self.turn.long().max(dim=1).values + 1  # an empty row is all -1: 0 turns

    def last_policy_versions(self) -> tuple[str | None, ...]:
        """The version of each row's last policy token (the sample's ``policy_version``), None
        for a row without one."""
        pos = torch.arange(self.source.shape[1]).expand_as(self.source)
        last = torch.where(self.policy_mask(), pos, -1).max(dim=1).values if self.source.shape[1] else \
            torch.full((self.batch_size,), -1)
        out = []
        for b, t in enumerate(last.tolist()):
            out.append(None if t < 0 else self.versions[int(self.version_index[b, t])])
        return tuple(out)

    def token_versions(self, row: int) -> list[str | None]:
        """Row ``row`` 's version per response position (None off the policy tokens)."""
        return [None if i < 0 else self.versions[i] for i in self.version_index[row].tolist()]

    def metadata(self) -> dict:
        """The non-tensor part (what the manifest and the content hash record)."""
        return {"versions": list(self.versions)}

    def select(self, rows: torch.Tensor) -> "TokenOrigins":
        """The rows ``rows`` (a mini-batch); ``versions`` is kept whole, so indices stay valid."""
        return dataclasses.replace(self, source=self.source[rows], turn=self.turn[rows],
                                   version_index=self.version_index[rows])


def collate_origins(sources: Sequence[Sequence[int]], turns: Sequence[Sequence[int]],
                    token_versions: Sequence[Sequence[str | None]], response_len: int) -> TokenOrigins:
    """Per-sample per-token lists -> the padded grid ``(bs, response_len)``.

    Args:
        sources: per sample, one :class:`TokenSource` value (1 policy / 2 environment) per
            response token.
        turns: per sample, the 0-based turn of each token.
        token_versions: per sample, the policy version (``short_id``) of each policy token and
            None on each environment token.
        response_len: the padded width ``R`` (at least every sample's length).
    Returns:
        the origins; ``versions`` in order of first appearance (row-major), so equal inputs give
        equal bytes.
    """
    B = len(sources)
    for b in range(B):
        n = len(sources[b])
        if len(turns[b]) != n or len(token_versions[b]) != n:
            raise ValueError(f"collate_origins: row {b} has {n} sources, {len(turns[b])} turns and "
                             f"{len(token_versions[b])} token versions (one of each per response token)")
        for t, (s, v) in enumerate(zip(sources[b], token_versions[b], strict=True)):
            if s not in (TokenSource.POLICY, TokenSource.ENVIRONMENT):
                raise ValueError(f"collate_origins: row {b}, response position {t}: source {s!r} is not "
                                 f"1 (policy) or 2 (environment)")
            if (v is None) != (s == TokenSource.ENVIRONMENT):
                what = "an environment token has" if v is not None else "a policy token needs"
                raise ValueError(f"collate_origins: row {b}, response position {t}: {what} a policy version "
                                 f"(got {v!r})")
    versions: dict[str, int] = {}
    for row in token_versions:
        for v in row:
            if v is not None:
                versions.setdefault(v, len(versions))
    pad = lambda xs, fill: list(xs) + [fill] * (response_len - len(xs))  # noqa: E731
    source = torch.tensor([pad(s, 0) for s in sources], dtype=torch.int8).reshape(B, response_len)
    turn = torch.tensor([pad(t, -1) for t in turns], dtype=torch.int16).reshape(B, response_len)
    vidx = torch.tensor([pad([-1 if v is None else versions[v] for v in row], -1) for row in token_versions],
                        dtype=torch.int16).reshape(B, response_len)
    return TokenOrigins(source=source, turn=turn, version_index=vidx, versions=tuple(versions))
