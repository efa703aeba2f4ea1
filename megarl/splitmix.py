"""splitmix64's output function over int64 tensors, for megarl's counter-based draws.

Steele, Lea & Flood, "Fast splittable pseudorandom number generators" (OOPSLA 2014): output k
of a generator seeded with ``s`` is ``mix64(s + k * GOLDEN)`` modulo 2**64.  Being a pure
function of (seed, k), it gives numbers that depend on nothing else: the hf engine's per-candidate
sampling uniforms and the fixed weights of the weight-stream checksum both use it.  torch's
int64 arithmetic wraps modulo 2**64, which is what the mixer needs; ``>>`` is arithmetic on
signed words, so the logical shift is masked.  A leaf module: it imports nothing from megarl.
"""

from __future__ import annotations

import torch

GOLDEN = 0x9E3779B97F4A7C15


def as_int64(x: int) -> int:
    """The int64 with the same low 64 bits as ``x``."""
    x %= 1 << 64
    return x - (1 << 64) if x >= 1 << 63 else x


_MIX1, _MIX2 = as_int64(0xBF58476D1CE4E5B9), as_int64(0x94D049BB133111EB)


def shr(z: torch.Tensor, bits: int) -> torch.Tensor:
    """Logical right shift of int64 words."""
    return (z >> bits) & ((1 << (64 - bits)) - 1)


def mix64(z: torch.Tensor) -> torch.Tensor:
    """splitmix64's finaliser of int64 words (modulo 2**64)."""
    z = (z ^ shr(z, 30)) * _MIX1
    z = (z ^ shr(z, 27)) * _MIX2
    return z ^ shr(z, 31)


def splitmix64(seeds: torch.Tensor, k: int) -> torch.Tensor:
    """Output ``k`` (1, 2, ...) of splitmix64 seeded with each of ``seeds`` (int64 words)."""
    return mix64(seeds + as_int64(k * GOLDEN))
