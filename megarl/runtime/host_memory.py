"""Host memory of a tensor read in place: its bytes as a read-only view, for hashing and
checksums of live parameters and optimizer state (the weight stream, checkpoints)."""

from __future__ import annotations

import torch

__all__ = ["host_bytes", "host_span"]


def host_bytes(t: torch.Tensor) -> memoryview:
    """A read-only view of a contiguous CPU tensor's bytes, without ``Tensor.numpy()``.

    ``numpy()`` would mark the storage non-resizable for good (numpy may hold on to the buffer),
    and the offloader frees a parameter's storage by resizing it to 0: checksumming or hashing a
    live parameter or optimizer state must not take that away.  The caller keeps ``t`` alive
    while the view is used.
    """
    return host_span(t.data_ptr(), t.numel() * t.element_size())


def host_span(address: int, n: int) -> memoryview:
    import ctypes

    return memoryview((ctypes.c_char * n).from_address(address)).cast("B").toreadonly()
