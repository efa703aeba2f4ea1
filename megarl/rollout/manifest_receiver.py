"""The receiving side of the weight-load protocol, shared by every rollout backend.

A backend's ``load_weights(version, buckets, expected_manifest)`` takes a stream of named
tensors and must prove it holds exactly ``expected_manifest`` before ``version`` may be activated.
:class:`ManifestReceiver` holds the steps every backend takes alike: the expected manifest must
be ``version``'s, no tensor may arrive twice, each tensor that landed (or was checked before
landing) is recorded, and the complete stream is compared with the expectation.  Where a tensor
lands (the hf backend's standby copy, SGLang's in-place loader) stays the backend's business.
"""

from __future__ import annotations

import time

import torch

from megarl.observability.profiling import span
from megarl.rollout.protocol import LoadReport
from megarl.rollout.weight_stream import ManifestDiff, ManifestMismatchError, TensorManifest
from megarl.versions import PolicyVersion

__all__ = ["ManifestReceiver"]


class ManifestReceiver:
    """One load of ``version``: what was received, counted and checked against ``expected``.

    Constructing it refuses an ``expected`` manifest that is not ``version``'s (before anything
    else is touched); :meth:`start` starts the load's clock.
    """

    def __init__(self, version: PolicyVersion, expected: TensorManifest):
        if expected.global_hash != version.weight_manifest_hash:
            raise ManifestMismatchError(
                f"expected manifest hash {expected.global_hash} is not the manifest of "
                f"{version.short_id} ({version.weight_manifest_hash})"
            )
        self.version, self.expected = version, expected
        self.received = TensorManifest()
        self.n_bytes = self.n_buckets = 0
        self._t0: float | None = None

    def start(self) -> None:
        self._t0 = time.perf_counter()

    def buckets(self, named_tensor_buckets):
        """The stream's buckets, counted (:attr:`n_buckets` is the current one's number)."""
        for bucket in named_tensor_buckets:
            self.n_buckets += 1
            yield bucket

    def refuse_repeat(self, name: str) -> None:
        if name in self.received.entries:
            raise ManifestMismatchError(f"{self.version.short_id}: tensor {name!r} received twice")

    def landed(self, name: str, landed: torch.Tensor, sent: torch.Tensor) -> None:
        """Record ``landed`` (the engine's tensor that now holds ``sent``): what is checksummed
        is what will be served."""
        self.received.add(name, landed)
        self.n_bytes += sent.numel() * sent.element_size()

    def kept(self, name: str, tensor: torch.Tensor) -> None:
        """Record ``tensor``, the engine's own (not sent: ``keep_unsent``), as it will be served;
        :meth:`compare` then checks it like a received one."""
        self.refuse_repeat(name)
        self.received.add(name, tensor)

    def checked(self, name: str, tensor: torch.Tensor) -> None:
        """Check ``tensor`` against the expected manifest at once, before it is handed to an
        engine that loads in place (a bad tensor is never loaded), and record it."""
        self.refuse_repeat(name)
        self.received.entries[name] = self.expected.check_entry(name, tensor)
        self.n_bytes += tensor.numel() * tensor.element_size()

    def compare(self) -> ManifestDiff:
        """The whole stream against the expected manifest (missing, unexpected, different)."""
        with span("weight_sync.verify"):
            return self.expected.compare(self.received)

    def report(self) -> LoadReport:
        return LoadReport(
            version_id=self.version.short_id,
            manifest_hash=self.received.global_hash,
            num_tensors=len(self.received),
            num_bytes=self.n_bytes,
            num_buckets=self.n_buckets,
            seconds=time.perf_counter() - self._t0,
        )
