"""Prompt datasets (JSONL / Parquet), encoded once through the tokenizer contract, and a
resumable prompt sampler.

A row carries either a plain-text prompt (``prompt_field``, default ``"prompt"``) or a chat
(``messages_field``, default ``"messages"``: a list of ``{"role", "content"}``), an optional id
(``id_field``), and any other fields, which travel unchanged to the reward as
``PromptRecord.ground_truth`` (e.g. ``{"answer": "357"}``).

* A text prompt is wrapped as one user message (after ``system_prompt`` as a system message,
  if given) and rendered with the contract's chat template; with ``apply_chat_template=False``
  it is encoded as-is (:meth:`TokenizerContract.encode_prompt` on the string).
* A chat is rendered with the chat template; ``system_prompt`` is put in front unless the chat
  already starts with a system message.
* Prompts longer than ``max_prompt_tokens`` are dropped (never cut) and counted in
  ``stats["dropped_overlong"]``.

:class:`PromptSampler` draws dataset indices epoch by epoch; epoch ``e`` is the permutation
``numpy.random.default_rng([seed, e]).permutation(n)``, so the order depends only on
``(seed, epoch, cursor)``, which is all its state: a resumed run draws the same next prompts.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from megarl.errors import MegarlError

__all__ = [
    "PromptRecord",
    "PromptDataset",
    "PromptDatasetError",
    "PromptSampler",
    "load_prompt_dataset",
]

JSONL_SUFFIXES = (".jsonl", ".json")
PARQUET_SUFFIXES = (".parquet",)


class PromptDatasetError(MegarlError, ValueError):
    """A prompt file (or a sampler state) that cannot be used; the message names file, line and field."""


@dataclass(frozen=True)
class PromptRecord:
    """One prompt, tokenized once.  ``prompt_ids`` is what the model is fed."""

    prompt_id: str
    prompt_ids: tuple[int, ...]
    text: str | None
    messages: tuple[Mapping[str, str], ...] | None
    ground_truth: Mapping[str, Any]


@dataclass
class PromptDataset:
    """The kept records, in file order, and ``stats``: ``rows``, ``kept``, ``dropped_overlong``,
    ``max_prompt_tokens_seen`` (over all rows, dropped ones included), ``path``, ``sha256``
    (of the file bytes)."""

    records: tuple[PromptRecord, ...]
    stats: dict = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.records)

    def __getitem__(self, i: int) -> PromptRecord:
        return self.records[i]

    def __iter__(self) -> Iterator[PromptRecord]:
        return iter(self.records)


# ---- reading rows ----------------------------------------------------------------------------


def _jsonl_rows(path: str, hasher) -> Iterator[tuple[int, dict]]:
    with open(path, "rb") as f:
        for line_no, raw in enumerate(f, start=1):
            hasher.update(raw)
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise PromptDatasetError(f"{path}:{line_no}: not UTF-8 text ({e})") from None
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                hint = ""
                if line_no == 1 and line.lstrip().startswith("["):
                    hint = "; expected JSON lines (one object per line), not a JSON array"
                raise PromptDatasetError(f"{path}:{line_no}: not valid JSON ({e.msg}){hint}") from None
            if not isinstance(row, dict):
                raise PromptDatasetError(
                    f"{path}:{line_no}: expected a JSON object, got {type(row).__name__}")
            yield line_no, row


def _parquet_rows(path: str, hasher) -> Iterator[tuple[int, dict]]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise PromptDatasetError(
            f"{path}: reading Parquet prompt files needs pyarrow; `pip install pyarrow` "
            f"(or convert the file to JSONL)") from None
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            hasher.update(chunk)
    try:
        pf = pq.ParquetFile(path)
    except Exception as e:  # pyarrow raises ArrowInvalid / OSError for a bad file
        raise PromptDatasetError(f"{path}: not a readable Parquet file ({e})") from None
    row_no = 0
    for batch in pf.iter_batches(batch_size=4096):
        for row in batch.to_pylist():
            row_no += 1
            yield row_no, row


# ---- validating and encoding -----------------------------------------------------------------


def _messages(value, where: str, field_name: str) -> list[dict]:
    if not isinstance(value, (list, tuple)) or not value:
        raise PromptDatasetError(
            f"{where}: field {field_name!r} must be a non-empty list of {{role, content}} messages, "
            f"got {type(value).__name__}")
    out = []
    for i, m in enumerate(value):
        if not isinstance(m, Mapping):
            raise PromptDatasetError(
                f"{where}: field {field_name!r} message {i} must be an object with 'role' and 'content', "
                f"got {type(m).__name__}")
        for key in ("role", "content"):
            if not isinstance(m.get(key), str):
                raise PromptDatasetError(
                    f"{where}: field {field_name!r} message {i} needs a string {key!r}, got {m.get(key)!r}")
        out.append({k: v for k, v in m.items() if v is not None})  # Parquet fills absent struct keys with None
    return out


def _row_id(row: dict, id_field: str, where: str, default: str) -> str:
    value = row.get(id_field)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (str, int)):
        raise PromptDatasetError(
            f"{where}: field {id_field!r} must be a string or an integer, got {type(value).__name__}")
    value = str(value)
    if not value:
        raise PromptDatasetError(f"{where}: field {id_field!r} is empty")
    return value


def load_prompt_dataset(
    path: str | os.PathLike,
    contract,
    *,
    prompt_field: str = "prompt",
    messages_field: str = "messages",
    id_field: str = "id",
    apply_chat_template: bool = True,
    system_prompt: str | None = None,
    max_prompt_tokens: int,
) -> PromptDataset:
    """Read, validate and encode a prompt file (``.jsonl``/``.json`` JSON lines, or ``.parquet``).

    ``contract`` is the run's :class:`~megarl.data.tokenizer.TokenizerContract`.  Raises
    :class:`PromptDatasetError` naming ``path:line`` and the field for a bad row, naming both
    lines for a duplicate id, and for a missing, empty or all-overlong file.
    """
    path = os.fspath(path)
    if isinstance(max_prompt_tokens, bool) or not isinstance(max_prompt_tokens, int) or max_prompt_tokens < 1:
        raise PromptDatasetError(f"max_prompt_tokens must be a positive int, got {max_prompt_tokens!r}")
    if not apply_chat_template and system_prompt is not None:
        raise PromptDatasetError("system_prompt needs apply_chat_template=True (a raw prompt has no system turn)")
    if apply_chat_template and getattr(contract, "chat_template", None) is None:
        raise PromptDatasetError(
            f"{path}: apply_chat_template is set but the tokenizer ({getattr(contract, 'source', None)}) "
            f"has no chat template; give it one or set apply_chat_template=False")
    if not os.path.exists(path):
        raise PromptDatasetError(f"prompt file {path} does not exist")
    if os.path.isdir(path):
        raise PromptDatasetError(f"prompt file {path} is a directory; give a .jsonl or .parquet file")
    lower = path.lower()
    if lower.endswith(JSONL_SUFFIXES):
        reader = _jsonl_rows
    elif lower.endswith(PARQUET_SUFFIXES):
        reader = _parquet_rows
    else:
        raise PromptDatasetError(
            f"prompt file {path}: unknown format; expected one of "
            f"{', '.join(JSONL_SUFFIXES + PARQUET_SUFFIXES)}")

    basename = os.path.basename(path)
    hasher = hashlib.sha256()
    records: list[PromptRecord] = []
    seen_ids: dict[str, str] = {}
    rows = dropped = longest = 0
    reserved = {prompt_field, messages_field, id_field}
    try:
        row_iter = reader(path, hasher)
        for line_no, row in row_iter:
            rows += 1
            where = f"{path}:{line_no}"
            prompt_id = _row_id(row, id_field, where, f"{basename}:{line_no}")
            if prompt_id in seen_ids:
                raise PromptDatasetError(
                    f"{where}: duplicate {id_field!r} {prompt_id!r} (first at {seen_ids[prompt_id]})")
            seen_ids[prompt_id] = where

            text, chat = row.get(prompt_field), row.get(messages_field)
            if text is not None and chat is not None:
                raise PromptDatasetError(
                    f"{where}: has both {prompt_field!r} and {messages_field!r}; give exactly one")
            if text is None and chat is None:
                raise PromptDatasetError(
                    f"{where}: needs a {prompt_field!r} (text) or {messages_field!r} (chat) field; "
                    f"found {sorted(row)}")
            if text is not None:
                if not isinstance(text, str) or not text:
                    raise PromptDatasetError(
                        f"{where}: field {prompt_field!r} must be a non-empty string, got {text!r:.80}")
                messages = None
                if apply_chat_template:
                    messages = [{"role": "user", "content": text}]
            else:
                messages = _messages(chat, where, messages_field)
                if not apply_chat_template:
                    raise PromptDatasetError(
                        f"{where}: field {messages_field!r} is a chat, which needs apply_chat_template=True")
            if messages is not None and system_prompt is not None and messages[0]["role"] != "system":
                messages = [{"role": "system", "content": system_prompt}] + messages
            try:
                ids = contract.encode_prompt(messages if messages is not None else text)
            except Exception as e:  # template errors (jinja raise_exception), tokenizer errors
                fld = messages_field if chat is not None else prompt_field
                raise PromptDatasetError(f"{where}: field {fld!r} cannot be encoded: {e}") from e

            longest = max(longest, len(ids))
            if len(ids) > max_prompt_tokens:
                dropped += 1
                continue
            records.append(PromptRecord(
                prompt_id=prompt_id,
                prompt_ids=tuple(int(i) for i in ids),
                text=text,
                messages=None if messages is None else tuple(messages),
                ground_truth={k: v for k, v in row.items() if k not in reserved},
            ))
    except OSError as e:
        raise PromptDatasetError(f"prompt file {path} cannot be read: {e}") from e

    if rows == 0:
        raise PromptDatasetError(f"prompt file {path} has no rows")
    if not records:
        raise PromptDatasetError(
            f"prompt file {path}: all {rows} prompts are longer than max_prompt_tokens={max_prompt_tokens} "
            f"(longest {longest} tokens)")
    stats = {
        "rows": rows,
        "kept": len(records),
        "dropped_overlong": dropped,
        "max_prompt_tokens_seen": longest,
        "path": path,
        "sha256": hasher.hexdigest(),
    }
    return PromptDataset(tuple(records), stats)


# ---- sampling --------------------------------------------------------------------------------


class PromptSampler:
    """Dataset indices, epoch after epoch, each epoch a permutation (every index exactly once).

    Epoch ``e``'s order is ``numpy.random.default_rng([seed, e]).permutation(dataset_len)`` (or
    ``range(dataset_len)`` without ``shuffle``): a function of ``(seed, e)`` alone, so however the
    sampler was advanced (one big call or many small ones, before or after a resume), the
    stream of indices is the same.
    """

    def __init__(self, dataset_len: int, seed: int, shuffle: bool = True):
        if isinstance(dataset_len, bool) or not isinstance(dataset_len, int) or dataset_len < 1:
            raise ValueError(f"PromptSampler: dataset_len must be a positive int, got {dataset_len!r}")
        if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
            raise ValueError(f"PromptSampler: seed must be a non-negative int, got {seed!r}")
        self.dataset_len = int(dataset_len)
        self.seed = int(seed)
        self.shuffle = bool(shuffle)
        self.epoch = 0
        self.cursor = 0  # position within the current epoch; always < dataset_len
        self._order: np.ndarray | None = None
        self._order_epoch = -1

    def epoch_order(self, epoch: int) -> list[int]:
        """The full index order of ``epoch``."""
        return self._epoch_array(epoch).tolist()

    def _epoch_array(self, epoch: int) -> np.ndarray:
        if self._order_epoch != epoch:
            if self.shuffle:
                self._order = np.random.default_rng([self.seed, int(epoch)]).permutation(self.dataset_len)
            else:
                self._order = np.arange(self.dataset_len)
            self._order_epoch = epoch
        return self._order

    def next_indices(self, n: int) -> list[int]:
        """The next ``n`` indices, continuing into the next epoch when this one runs out."""
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ValueError(f"PromptSampler.next_indices: n must be a non-negative int, got {n!r}")
        out: list[int] = []
        while len(out) < n:
            order = self._epoch_array(self.epoch)
            take = min(n - len(out), self.dataset_len - self.cursor)
            out.extend(order[self.cursor:self.cursor + take].tolist())
            self.cursor += take
            if self.cursor == self.dataset_len:
                self.epoch, self.cursor = self.epoch + 1, 0
        return out

    def __iter__(self) -> Iterator[int]:
        """Endless indices; advances this sampler like ``next_indices(1)``."""
        while True:
            yield self.next_indices(1)[0]

    def state_dict(self) -> dict:
        return {"seed": self.seed, "epoch": self.epoch, "cursor": self.cursor,
                "shuffle": self.shuffle, "dataset_len": self.dataset_len}

    def load_state_dict(self, state: Mapping) -> None:
        """Continue from ``state``; refuses a state saved for another dataset length, seed or shuffle."""
        missing = [k for k in ("seed", "epoch", "cursor", "shuffle", "dataset_len") if k not in state]
        if missing:
            raise PromptDatasetError(f"prompt sampler state is missing {missing}; got keys {sorted(state)}")
        if int(state["dataset_len"]) != self.dataset_len:
            raise PromptDatasetError(
                f"prompt sampler state was saved for a dataset of {state['dataset_len']} prompts, this one has "
                f"{self.dataset_len} (did the prompt file, its filtering or max_prompt_tokens change?)")
        if int(state["seed"]) != self.seed:
            raise PromptDatasetError(
                f"prompt sampler state was saved with seed {state['seed']}, this run uses seed {self.seed}")
        if bool(state["shuffle"]) != self.shuffle:
            raise PromptDatasetError(
                f"prompt sampler state was saved with shuffle={bool(state['shuffle'])}, this run has "
                f"shuffle={self.shuffle}")
        epoch, cursor = int(state["epoch"]), int(state["cursor"])
        if epoch < 0 or not 0 <= cursor <= self.dataset_len:
            raise PromptDatasetError(
                f"prompt sampler state has epoch={epoch} cursor={cursor}, outside 0..{self.dataset_len}")
        if cursor == self.dataset_len:  # tolerate a state saved at an epoch's very end
            epoch, cursor = epoch + 1, 0
        self.epoch, self.cursor = epoch, cursor
