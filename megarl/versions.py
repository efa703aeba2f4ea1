"""Policy versions: the identity every sample records.

``global_step=42`` alone is ambiguous (a retry after a failure, a different branch config, a
second publish all reuse it), so a version is a tuple: run id, optimizer
step, update attempt and the hashes of the weights, the tokenizer contract and the model config.
Samples carry only the short id (``v42.1-1a2b3c4d``); the full record lives in the manifest.

A leaf module (it imports nothing from megarl but the leaf ``megarl.hashing``): rollout backends,
experience records and the control loop all share these types without depending on one another
(tests/test_layering.py enforces it).  A version's identity hash is
:func:`megarl.hashing.json_sha256` of its fields.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import asdict, dataclass, replace
from functools import cached_property

from megarl.hashing import json_sha256

__all__ = ["PolicyVersion", "VersionError", "step_of_short_id"]

_HASH_RE = re.compile(r"^sha256:[0-9a-f]{64}$")
_SHORT_RE = re.compile(r"^v(\d+)\.(\d+)-[0-9a-f]{8}$")


def step_of_short_id(short_id: str) -> int:
    """The optimizer step a :attr:`PolicyVersion.short_id` names (``v42.1-1a2b3c4d`` -> 42)."""
    m = _SHORT_RE.match(short_id) if isinstance(short_id, str) else None
    if m is None:
        raise VersionError(f"{short_id!r} is not a policy version short id (v<step>.<attempt>-<8 hex>)")
    return int(m.group(1))


class VersionError(ValueError):
    """A PolicyVersion field is malformed or two versions are not in the expected relation."""


@dataclass(frozen=True)
class PolicyVersion:
    """One committed actor version.  Immutable; equality is equality of every field."""

    run_id: str
    optimizer_step: int
    update_attempt: int
    weight_manifest_hash: str
    tokenizer_hash: str
    model_config_hash: str

    def __post_init__(self):
        if not self.run_id or "/" in self.run_id:
            raise VersionError(f"run_id must be a non-empty string without '/', got {self.run_id!r}")
        if not isinstance(self.optimizer_step, int) or self.optimizer_step < 0:
            raise VersionError(f"optimizer_step must be an int >= 0, got {self.optimizer_step!r}")
        if not isinstance(self.update_attempt, int) or self.update_attempt < 0:
            raise VersionError(f"update_attempt must be an int >= 0, got {self.update_attempt!r}")
        for fld in ("weight_manifest_hash", "tokenizer_hash", "model_config_hash"):
            value = getattr(self, fld)
            if not isinstance(value, str) or not _HASH_RE.match(value):
                raise VersionError(f"{fld} must look like 'sha256:<64 hex>', got {value!r}")

    @cached_property  # immutable fields: computed once (it is read for every sample)
    def identity_hash(self) -> str:
        """sha256 over every field; the short id shows its first 8 hex digits."""
        return json_sha256(self.to_dict())

    @cached_property
    def short_id(self) -> str:
        """Stable short id recorded on every sample, e.g. ``v42.1-1a2b3c4d``."""
        return f"v{self.optimizer_step}.{self.update_attempt}-{self.identity_hash[7:15]}"

    def __str__(self) -> str:
        return self.short_id

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping) -> "PolicyVersion":
        expected = {f for f in cls.__dataclass_fields__}
        missing = expected - set(data)
        extra = set(data) - expected
        if missing or extra:
            raise VersionError(
                f"PolicyVersion dict: missing keys {sorted(missing)}, unexpected keys {sorted(extra)}"
            )
        return cls(**{k: data[k] for k in expected})

    def successor(self, weight_manifest_hash: str) -> "PolicyVersion":
        """The version after one successful optimizer step (attempt counter restarts at 0)."""
        return replace(
            self,
            optimizer_step=self.optimizer_step + 1,
            update_attempt=0,
            weight_manifest_hash=weight_manifest_hash,
        )

    def retried(self, weight_manifest_hash: str) -> "PolicyVersion":
        """Same optimizer step, next attempt: a re-run of a failed update from the same base."""
        return replace(
            self, update_attempt=self.update_attempt + 1, weight_manifest_hash=weight_manifest_hash
        )

    def is_successor_of(self, other: "PolicyVersion") -> bool:
        """True when self can follow ``other`` in ACTOR_COMMITTED(v) -> ACTOR_COMMITTED(v+1):
        same run and contracts, one optimizer step later (any attempt)."""
        return (
            self.run_id == other.run_id
            and self.tokenizer_hash == other.tokenizer_hash
            and self.model_config_hash == other.model_config_hash
            and self.optimizer_step == other.optimizer_step + 1
        )
