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

Sources: a ``.jsonl``/``.json`` or ``.parquet`` file, a directory of them, a ``datasets``
directory or a Hub dataset; :func:`iter_rows`, the one row reader the loader and the start-up
data check share, says how each is read, named and hashed (``stats["sha256"]``).

:class:`PromptSampler` draws dataset indices epoch by epoch; epoch ``e`` is the permutation
``numpy.random.default_rng([seed, e]).permutation(n)``, so the order depends only on
``(seed, epoch, cursor)``, which is all its state: a resumed run draws the same next prompts.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterator, Mapping, Sequence
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
    "load_configured_dataset",
    "configured_sources",
    "iter_rows",
    "source_kind",
    "check_source",
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

    def task(self) -> dict:
        """The row an agent environment starts on (``Environment.reset``): the ground-truth
        fields, plus ``prompt`` (the prompt text, None for a chat prompt) and ``messages`` (the
        chat prompt's messages, None for a text prompt)."""
        return {**self.ground_truth, "prompt": self.text,
                "messages": None if self.messages is None else [dict(m) for m in self.messages]}


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

HUB_PREFIX = "hf://datasets/"
_DATASETS_HINT = 'pip install -e ".[datasets]"'


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


def _is_hub_dataset(path: str) -> bool:
    if path.startswith(HUB_PREFIX):
        return True
    from megarl.data.hub import is_hub_id

    # "data/train.jsonl" (missing) is a file that is not there, not a repo named train.jsonl
    return is_hub_id(path) and "@" not in path and not path.lower().endswith(JSONL_SUFFIXES + PARQUET_SUFFIXES)


def source_kind(path: str | os.PathLike) -> str:
    """What ``path`` is: ``"jsonl"``, ``"parquet"``, ``"files"`` (a directory of them),
    ``"datasets"`` (a save_to_disk directory) or ``"hub"`` (a Hub dataset name).  Raises
    :class:`PromptDatasetError` for a path that is none of these."""
    path = os.fspath(path)
    if os.path.isdir(path):
        if any(os.path.isfile(os.path.join(path, f)) for f in ("dataset_dict.json", "state.json")):
            return "datasets"
        if _dir_files(path):
            return "files"
        raise PromptDatasetError(
            f"prompt directory {path} holds no {', '.join(JSONL_SUFFIXES + PARQUET_SUFFIXES)} files and is not a "
            f"`datasets` save_to_disk directory (no dataset_dict.json / state.json)")
    if os.path.exists(path):
        lower = path.lower()
        if lower.endswith(JSONL_SUFFIXES):
            return "jsonl"
        if lower.endswith(PARQUET_SUFFIXES):
            return "parquet"
        raise PromptDatasetError(
            f"prompt file {path}: unknown format; expected one of {', '.join(JSONL_SUFFIXES + PARQUET_SUFFIXES)}, "
            f"a directory of them, a `datasets` directory or a Hub dataset name")
    if _is_hub_dataset(path):
        return "hub"
    raise PromptDatasetError(f"prompt file {path} does not exist")


def check_source(path: str | os.PathLike) -> str:
    """:func:`source_kind`, plus: the ``datasets`` package is there when the source needs it.
    Reads no rows (a Hub dataset is not contacted): the cheap start-up check."""
    kind = source_kind(path)
    if kind in ("datasets", "hub"):
        _import_datasets(os.fspath(path))
    return kind


def _dir_files(path: str) -> list[str]:
    return sorted(f for f in os.listdir(path) if f.lower().endswith(JSONL_SUFFIXES + PARQUET_SUFFIXES)
                  and os.path.isfile(os.path.join(path, f)))


def _import_datasets(path: str):
    try:
        import datasets
    except ImportError:
        raise PromptDatasetError(f"{path}: reading a `datasets` directory or a Hub dataset needs the datasets "
                                 f"package: {_DATASETS_HINT}") from None
    return datasets


def _json_default(value):
    if isinstance(value, (bytes, bytearray)):
        return value.hex()
    if hasattr(value, "isoformat"):  # dates and times from Arrow timestamp columns
        return value.isoformat()
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, np.ndarray):
        return value.tolist()
    raise TypeError(f"a {type(value).__name__} value")


def _dataset_rows(ds, label: str, id_prefix: str, hasher) -> Iterator[tuple[str, str, dict]]:
    for i, row in enumerate(ds):
        where = f"{label}#{i}"
        # Arrow has no "absent": a column a row does not use is null there; drop it, so the row
        # carries the fields a JSONL line would (and a null never looks like a ground truth)
        row = {k: v for k, v in row.items() if v is not None}
        try:
            hasher.update(json.dumps(row, sort_keys=True, ensure_ascii=False, default=_json_default).encode() + b"\n")
        except TypeError as e:
            raise PromptDatasetError(f"{where}: a field holds {e}, which a prompt row cannot carry") from None
        yield where, f"{id_prefix}:{i}", row


def _split_of(dsdict, path: str, split: str | None):
    splits = sorted(dsdict)
    if split is None and len(splits) == 1:
        split = splits[0]
    if split not in dsdict:
        raise PromptDatasetError(f"{path}: has no split {split!r}; its splits are {splits} "
                                 f"(choose one with data.train_split / data.heldout_split)")
    return dsdict[split], split


def _open_datasets_dir(path: str, split: str | None):
    datasets = _import_datasets(path)
    try:
        ds = datasets.load_from_disk(path)
    except Exception as e:  # FileNotFoundError / arrow errors from a damaged directory
        raise PromptDatasetError(f"{path}: not a readable `datasets` directory ({type(e).__name__}: {e})") from None
    if isinstance(ds, datasets.DatasetDict):
        ds, split = _split_of(ds, path, split)
        return ds, f"{path}[{split}]", f"{os.path.basename(os.path.normpath(path))}/{split}"
    return ds, path, os.path.basename(os.path.normpath(path))


def _open_hub(path: str, split: str | None, subset: str | None):
    datasets = _import_datasets(path)
    name = path[len(HUB_PREFIX):] if path.startswith(HUB_PREFIX) else path
    label = f"{HUB_PREFIX}{name}[{subset + '/' if subset else ''}{split}]"
    try:
        ds = datasets.load_dataset(name, subset, split=split)
    except Exception as e:  # offline and not cached, unknown name, missing config name, no such split
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        if "OfflineModeIsEnabled" in first:
            raise PromptDatasetError(
                f"{HUB_PREFIX}{name}: not in the local datasets cache, and HF_HUB_OFFLINE / HF_DATASETS_OFFLINE is "
                f"set; load it once online, or save it with Dataset.save_to_disk and give that directory") from None
        hint = ""
        if "config" in first.lower() and subset is None:
            hint = " (set data.train_subset / data.heldout_subset to one of its configs)"
        elif "split" in first.lower():
            hint = " (choose another data.train_split / data.heldout_split)"
        raise PromptDatasetError(f"{HUB_PREFIX}{name}: cannot load the Hub dataset: {first}{hint}") from None
    if isinstance(ds, datasets.DatasetDict):
        ds, split = _split_of(ds, path, split)
    return ds, label, f"{name}/{split}"


def _source_rows(path: str, hasher, split: str | None = None,
                 subset: str | None = None) -> Iterator[tuple[str, str, dict]]:
    """``(where, default id, row)`` for every row of the source ``path`` (see the module doc);
    feeds ``hasher`` what ``stats["sha256"]`` covers."""
    kind = source_kind(path)
    if kind in ("jsonl", "parquet"):
        basename = os.path.basename(path)
        reader = _jsonl_rows if kind == "jsonl" else _parquet_rows
        for line_no, row in reader(path, hasher):
            yield f"{path}:{line_no}", f"{basename}:{line_no}", row
    elif kind == "files":
        for name in _dir_files(path):
            file = os.path.join(path, name)
            hasher.update(name.encode() + b"\0")  # which bytes belong to which file
            reader = _jsonl_rows if name.lower().endswith(JSONL_SUFFIXES) else _parquet_rows
            for line_no, row in reader(file, hasher):
                yield f"{file}:{line_no}", f"{name}:{line_no}", row
    elif kind == "datasets":
        ds, label, prefix = _open_datasets_dir(path, split)
        yield from _dataset_rows(ds, label, prefix, hasher)
    else:
        ds, label, prefix = _open_hub(path, split, subset)
        yield from _dataset_rows(ds, label, prefix, hasher)


def iter_rows(path: str | os.PathLike, *, split: str | None = None, subset: str | None = None,
              hasher=None) -> Iterator[tuple[str, dict]]:
    """``(where, row)`` for every row of a prompt source, in order: the rows
    :func:`load_prompt_dataset` reads, with ``where`` naming the row in error messages
    (``file:line``, or ``name[split]#index`` for a ``datasets`` source).  ``split`` / ``subset``
    apply to ``datasets`` directories and Hub datasets.  Raises :class:`PromptDatasetError` for
    a missing path, an unknown format, a row that is not a JSON object, or a missing
    ``datasets`` package.

    Sources: a ``.jsonl``/``.json`` or ``.parquet`` file (``where`` = ``file:line``); a directory of such
    files, read in name order (``file:line``); a ``datasets`` directory written by
    ``Dataset.save_to_disk`` or ``DatasetDict.save_to_disk`` (``split`` picks the split;
    ``where`` = ``dir[split]#index``); a Hub dataset, ``org/name`` or ``hf://datasets/name``, read
    with ``datasets.load_dataset(name, subset, split=split)``, which honours ``HF_HUB_OFFLINE`` /
    ``HF_DATASETS_OFFLINE`` (``where`` = ``hf://datasets/name[subset/split]#index``).  The last two
    need the optional ``datasets`` package.  ``stats["sha256"]`` is the file's bytes for a file,
    every file's name and bytes for a directory of files, and the rows themselves (canonical JSON,
    in order) for a ``datasets`` source: the same rows give the same hash.
    """
    hasher = hasher if hasher is not None else hashlib.sha256()
    try:
        for where, _, row in _source_rows(os.fspath(path), hasher, split, subset):
            yield where, row
    except OSError as e:
        raise PromptDatasetError(f"prompt file {os.fspath(path)} cannot be read: {e}") from e


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


def _row_prompt(row: dict, where: str, prompt_field: str, messages_field: str, apply_chat_template: bool,
                system_prompt: str | None):
    """``(text, chat, messages)`` of one row: exactly one of a text prompt and a chat; the
    messages to encode (None for a raw text prompt), the system prompt first where one is set."""
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
    return text, chat, messages


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
    split: str | None = None,
    subset: str | None = None,
) -> PromptDataset:
    """Read, validate and encode a prompt source (a ``.jsonl``/``.json`` JSON-lines or
    ``.parquet`` file, a directory of them, a ``datasets`` directory or a Hub dataset; ``split``
    and ``subset`` apply to the last two, see :func:`iter_rows`).

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
    kind = source_kind(path)
    hasher = hashlib.sha256()
    records: list[PromptRecord] = []
    seen_ids: dict[str, str] = {}
    rows = dropped = longest = 0
    reserved = {prompt_field, messages_field, id_field}
    try:
        for where, default_id, row in _source_rows(path, hasher, split, subset):
            rows += 1
            prompt_id = _row_id(row, id_field, where, default_id)
            if prompt_id in seen_ids:
                raise PromptDatasetError(
                    f"{where}: duplicate {id_field!r} {prompt_id!r} (first at {seen_ids[prompt_id]})")
            seen_ids[prompt_id] = where

            text, chat, messages = _row_prompt(row, where, prompt_field, messages_field, apply_chat_template,
                                               system_prompt)
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
    if kind not in ("jsonl", "parquet"):  # files keep the stats they always had
        stats["source"] = kind
        if kind in ("datasets", "hub"):
            stats.update(split=split, subset=subset)
    return PromptDataset(tuple(records), stats)


# ---- sampling --------------------------------------------------------------------------------



def configured_sources(data_cfg) -> list[tuple[str, str, str | None, str | None]]:
    """``(key, path, split, subset)`` of the train and held-out sources the ``data`` section names
    (the held-out one only when set)."""
    d = data_cfg
    out = [("data.train_path", d.train_path, d.train_split, d.train_subset)]
    if d.heldout_path:
        out.append(("data.heldout_path", d.heldout_path, d.heldout_split, d.heldout_subset))
    return out


def load_configured_dataset(data_cfg, contract, path: str, *, split: str | None = None,
                            subset: str | None = None) -> PromptDataset:
    """:func:`load_prompt_dataset` with the ``data`` section's fields, chat-template and length
    settings: how training, ``--dry-run`` and ``python -m megarl.eval`` all read prompts."""
    d = data_cfg
    return load_prompt_dataset(path, contract, prompt_field=d.prompt_field, messages_field=d.messages_field,
                               id_field=d.id_field, apply_chat_template=d.apply_chat_template,
                               system_prompt=d.system_prompt, max_prompt_tokens=d.max_prompt_tokens,
                               split=split, subset=subset)

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
        #: indices given back (prompts drawn for generation that was dropped, e.g. in flight at
        #: an asynchronous run's checkpoint): served first, in this order
        self.returned: list[int] = []

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
        out: list[int] = self.returned[:n]
        self.returned = self.returned[n:]
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

    def state_dict(self, returned: Sequence[int] = ()) -> dict:
        """The cursor; ``returned``: indices to give back, served first after a load (ahead of
        any already given back)."""
        state = {"seed": self.seed, "epoch": self.epoch, "cursor": self.cursor,
                 "shuffle": self.shuffle, "dataset_len": self.dataset_len}
        back = [int(i) for i in returned] + list(self.returned)
        if back:  # only then: a synchronous run's state is what it always was
            state["returned"] = back
        return state

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
        back = [int(i) for i in state.get("returned", ())]
        bad = [i for i in back if not 0 <= i < self.dataset_len]
        if bad:
            raise PromptDatasetError(f"prompt sampler state returns index {bad[0]}, outside 0..{self.dataset_len - 1}")
        self.epoch, self.cursor, self.returned = epoch, cursor, back
