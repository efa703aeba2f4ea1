"""The versions of one rollout engine, and the refusals that keep them apart.

Every backend holds its versions in a :class:`VersionLifecycle`: at most one version *loading*
(weights arriving), at most one *staged* (loaded and verified, not yet served) and one *active*
(what ``generate`` serves).  The contract of :class:`~megarl.rollout.protocol.RolloutEngine` is
enforced here once, with the same messages for every backend:

* a second ``load_weights`` while one runs is refused (:class:`RolloutBusyError`);
* ``generate`` during a load is refused: a half-loaded model is never served;
* ``activate(v)`` needs ``v`` staged (:class:`VersionNotStagedError`): nothing unverified serves;
* ``generate`` with no active version is refused (:class:`NoActiveVersionError`): an engine that
  loads in place (SGLang) has none from the start of a load until the activation.

The lifecycle is not locked: a backend that serves several threads holds its own lock around it.
"""

from __future__ import annotations

from typing import Optional

from megarl.rollout.protocol import NoActiveVersionError, RolloutBusyError, VersionNotStagedError
from megarl.versions import PolicyVersion

__all__ = ["VersionLifecycle"]


def _short(version: Optional[PolicyVersion]) -> Optional[str]:
    return None if version is None else version.short_id


class VersionLifecycle:
    def __init__(self) -> None:
        self.loading: Optional[PolicyVersion] = None
        self.staged: Optional[PolicyVersion] = None
        self.active: Optional[PolicyVersion] = None

    def refuse_second_load(self, version: PolicyVersion) -> None:
        if self.loading is not None:
            raise RolloutBusyError(f"load_weights({version.short_id}): already loading {self.loading.short_id}")

    def begin_load(self, version: PolicyVersion) -> None:
        """``version`` starts loading; whatever was staged is no longer (its buffer is rewritten)."""
        self.refuse_second_load(version)
        self.loading, self.staged = version, None

    def loaded_in_place(self) -> None:
        """The load now writes the served weights: the active version is gone until an activation."""
        self.active = None

    def stage(self, version: PolicyVersion) -> None:
        """``version`` arrived whole and verified."""
        self.staged = version

    def end_load(self) -> None:
        """The load is over, staged or failed (call it in ``finally``)."""
        self.loading = None

    def refuse_while_loading(self, what: str) -> None:
        if self.loading is not None:
            raise RolloutBusyError(f"{what} refused: loading {self.loading.short_id}; a half-loaded model is never served")

    def require_active(self, what: str, why: str = "") -> PolicyVersion:
        """The active version, or :class:`NoActiveVersionError` (``why``: the backend's account of it)."""
        if self.active is None:
            raise NoActiveVersionError(f"{what} refused: no version is active{why}")
        return self.active

    def require_staged(self, version: PolicyVersion, ready: bool = True) -> None:
        """``version`` is staged (and ``ready`` by the backend's own account), or
        :class:`VersionNotStagedError`."""
        if self.staged != version or not ready:
            raise VersionNotStagedError(
                f"activate({version.short_id}): staged version is {_short(self.staged)}; load_weights it first")

    def activate(self, version: PolicyVersion, ready: bool = True) -> None:
        """The staged ``version`` becomes the active one."""
        self.require_staged(version, ready)
        self.active, self.staged = version, None

    def release(self) -> None:
        """The weights are gone (released memory): nothing is active or staged."""
        self.active, self.staged = None, None
