"""The one definition of the content hashes megarl writes into runs, checkpoints and versions.

Every hash megarl stores is spelled ``"sha256:<64 hex>"``.  Two kinds:

* :func:`json_sha256`: the sha256 of a value's canonical JSON (:func:`canonical_json`: keys
  sorted, no whitespace).  The resolved config (``megarl.config.config_hash``), config sections
  (``megarl.config.section_hash``), the model architecture and policy-version identities
  (``megarl.versions``) and the tokenizer contract (``megarl.data.tokenizer``) all go through it.
* :func:`file_sha256`: the sha256 of a file's bytes (checkpoint and sealed-experience manifests).

The bytes hashed are part of what is stored: changing :func:`canonical_json` (separators, key
order, escaping, the ``default`` fallback) changes every stored hash, and a resumed run refuses
a checkpoint whose hashes no longer match.  tests/unit/project/test_hashing.py pins them.

A leaf module (standard library only), so leaf modules such as ``megarl/versions.py`` may use it
(tests/unit/project/test_layering.py).
"""

from __future__ import annotations

import hashlib
import json
import os
from typing import Any, Callable, Optional

__all__ = ["canonical_json", "json_sha256", "file_sha256", "PREFIX"]

#: every stored hash starts with it
PREFIX = "sha256:"

#: the read size of :func:`file_sha256`
_CHUNK = 1 << 20


def canonical_json(obj: Any, *, ensure_ascii: bool = True,
                   default: Optional[Callable[[Any], Any]] = str) -> str:
    """``obj`` as canonical JSON: keys sorted at every level, separators ``,`` and ``:`` with no
    whitespace.

    ``ensure_ascii``: escape non-ASCII characters as ``\\uXXXX`` (JSON's default) or write them
    as they are (hashed as UTF-8).  ``default``: what a value JSON cannot encode becomes
    (``str`` by default, e.g. paths and dtypes); ``None`` raises ``TypeError`` for such a value
    instead.
    """
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=ensure_ascii, default=default)


def json_sha256(obj: Any, *, ensure_ascii: bool = True, default: Optional[Callable[[Any], Any]] = str) -> str:
    """``"sha256:<hex>"`` of :func:`canonical_json` of ``obj`` (UTF-8); the arguments are
    :func:`canonical_json`'s."""
    blob = canonical_json(obj, ensure_ascii=ensure_ascii, default=default)
    return PREFIX + hashlib.sha256(blob.encode()).hexdigest()


def file_sha256(path: str | os.PathLike) -> str:
    """``"sha256:<hex>"`` of the file's bytes, read in 1 MiB chunks."""
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(_CHUNK), b""):
            h.update(chunk)
    return PREFIX + h.hexdigest()
