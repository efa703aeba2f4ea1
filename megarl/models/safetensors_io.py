"""HF safetensors checkpoints on disk: a slice-reading reader and a sharded writer.

The reader opens ``model.safetensors`` or the shards listed in
``model.safetensors.index.json`` lazily and reads *slices* (``get_slice``), so a TP rank
never materialises rows or columns it does not own.  Every failure names the file and key.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from typing import Dict, Iterable, Iterator, Optional, Tuple

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from megarl.errors import MegarlError

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
    "vocab.json", "merges.txt", "added_tokens.json", "chat_template.jinja",
    "generation_config.json",
)


class CheckpointError(MegarlError, ValueError):
    """A checkpoint file that is missing, truncated or inconsistent; names the file/key."""


def read_format_json(path: str, expected_format: str, what: str) -> dict:
    """A JSON file whose ``format`` field must be ``expected_format``; a missing, unreadable or
    foreign one is a :class:`CheckpointError` naming the file and ``what`` it should have been."""
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path}: cannot read {what} ({e})") from None
    if not isinstance(data, dict) or data.get("format") != expected_format:
        got = data.get("format") if isinstance(data, dict) else type(data).__name__
        raise CheckpointError(f"{path}: format {got!r}, expected {expected_format!r}")
    return data


class HFCheckpointReader:
    """Read (slices of) tensors from an HF safetensors checkpoint directory."""

    def __init__(self, model_dir: str):
        self.model_dir = model_dir
        index = os.path.join(model_dir, INDEX_NAME)
        single = os.path.join(model_dir, SINGLE_NAME)
        if os.path.isfile(index):
            try:
                with open(index) as f:
                    weight_map = json.load(f)["weight_map"]
            except (json.JSONDecodeError, KeyError) as e:
                raise CheckpointError(f"{index}: not a valid safetensors index ({e})") from None
            self._where = {k: os.path.join(model_dir, v) for k, v in weight_map.items()}
            for name, path in sorted(self._where.items(), key=lambda kv: kv[1]):
                if not os.path.isfile(path):
                    raise CheckpointError(
                        f"{index} maps '{name}' to '{os.path.basename(path)}', which does not "
                        f"exist in {model_dir}"
                    )
        elif os.path.isfile(single):
            self._where = None
            self._single = single
        else:
            raise CheckpointError(
                f"{model_dir}: no {SINGLE_NAME} and no {INDEX_NAME} (expected HF safetensors weights)"
            )
        self._handles: Dict[str, object] = {}
        if self._where is None:
            self._where = {k: single for k in self._open(single).keys()}

    def _open(self, path: str):
        h = self._handles.get(path)
        if h is None:
            try:
                h = safe_open(path, framework="pt", device="cpu")
            except (SafetensorError, OSError, Exception) as e:  # safetensors raises its own types
                raise CheckpointError(
                    f"{path}: cannot read safetensors file (truncated or corrupt?): {e}"
                ) from None
            self._handles[path] = h
        return h

    def keys(self) -> Iterable[str]:
        return self._where.keys()

    def __contains__(self, name: str) -> bool:
        return name in self._where

    def names(self) -> list:
        """Every tensor name the checkpoint holds."""
        return list(self._where)

    def path_of(self, name: str) -> str:
        if name not in self._where:
            raise CheckpointError(f"{self.model_dir}: tensor '{name}' is missing from the checkpoint")
        return self._where[name]

    def shape(self, name: str) -> Tuple[int, ...]:
        path = self.path_of(name)
        try:
            return tuple(self._open(path).get_slice(name).get_shape())
        except SafetensorError as e:
            raise CheckpointError(f"{path}: cannot read '{name}': {e}") from None

    def read(self, name: str, dim: Optional[int] = None, start: int = 0, stop: int = 0) -> torch.Tensor:
        """The whole tensor (``dim=None``) or ``[start:stop]`` along ``dim`` (0 or 1)."""
        path = self.path_of(name)
        try:
            sl = self._open(path).get_slice(name)
            if dim is None:
                t = sl[:]
            elif dim == 0:
                t = sl[start:stop]
            elif dim == 1:
                t = sl[:, start:stop]
            else:
                raise CheckpointError(f"slicing along dim {dim} is not supported")
        except SafetensorError as e:
            raise CheckpointError(f"{path}: cannot read '{name}' (truncated file?): {e}") from None
        return t.contiguous()


def write_hf_checkpoint(
    out_dir: str,
    tensors: Iterator[Tuple[str, torch.Tensor]],
    config: dict,
    max_shard_bytes: int = 2 * 1024**3,
    tokenizer_dir: Optional[str] = None,
) -> None:
    """Write tensors as HF safetensors (sharded with an index when over ``max_shard_bytes``),
    plus ``config.json`` and the tokenizer files found in ``tokenizer_dir``."""
    os.makedirs(out_dir, exist_ok=True)
    shards, current, size = [], {}, 0
    for name, t in tensors:
        nbytes = t.numel() * t.element_size()
        if current and size + nbytes > max_shard_bytes:
            shards.append(current)
            current, size = {}, 0
        current[name] = t.detach().cpu().contiguous()
        size += nbytes
    if current or not shards:
        shards.append(current)
    # replacing an earlier export: drop its weight files so no stale shard outlives the index
    for fname in os.listdir(out_dir):
        if fname in (INDEX_NAME, SINGLE_NAME) or re.fullmatch(r"model-\d+-of-\d+\.safetensors", fname):
            os.remove(os.path.join(out_dir, fname))
    if len(shards) == 1:
        save_file(shards[0], os.path.join(out_dir, SINGLE_NAME), metadata={"format": "pt"})
    else:
        weight_map, total = {}, 0
        for i, shard in enumerate(shards):
            fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
            save_file(shard, os.path.join(out_dir, fname), metadata={"format": "pt"})
            for k, t in shard.items():
                weight_map[k] = fname
                total += t.numel() * t.element_size()
        with open(os.path.join(out_dir, INDEX_NAME), "w") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(config, f, indent=2, sort_keys=True)
    if tokenizer_dir:
        copy_tokenizer_files(tokenizer_dir, out_dir)


def copy_tokenizer_files(src: str, dst: str) -> list:
    copied = []
    if os.path.abspath(src) == os.path.abspath(dst):
        return copied
    for fname in TOKENIZER_FILES:
        p = os.path.join(src, fname)
        if os.path.isfile(p):
            shutil.copyfile(p, os.path.join(dst, fname))
            copied.append(fname)
    return copied


def _ids(value) -> list[int]:
    if value is None:
        return []
    return [int(value)] if isinstance(value, int) else [int(v) for v in value]


def model_dir_eos_token_ids(model_path: str | os.PathLike) -> tuple[int, ...]:
    """The eos ids an HF model dir declares: ``config.json`` ``eos_token_id`` plus
    ``generation_config.json`` ``eos_token_id``, in that order -- what SGLang itself stops on
    (its ``configs/model_config.py`` ``_get_hf_eos_token_id``, 0.5.3 and 0.5.23 alike)."""
    ids: list[int] = []
    for name in ("config.json", "generation_config.json"):
        path = os.path.join(os.fspath(model_path), name)
        if os.path.isfile(path):
            with open(path, encoding="utf-8") as f:
                ids += _ids(json.load(f).get("eos_token_id"))
    return tuple(dict.fromkeys(ids))
