"""Reward plug-ins that misbehave the ways real verifiers do, for process isolation tests.

Which sample misbehaves is read from its ids, so a test knows exactly what must happen:
``gil_hog`` spends minutes in one GIL-holding bigint call for the group ``.../p001``;
``crash`` dies in the worker (``os._exit`` for response "exit", a segfault for "segv");
``unpicklable`` returns a record whose component value cannot be pickled; ``raise_or_hog``
raises for ``.../p000`` and hogs the GIL for ``.../p001``.
"""

import ctypes
import os

from megarl.data.tasks.arithmetic import score
from megarl.experience.schema import RewardRecord


def gil_hog(sample):
    if sample.group_id.endswith("/p001"):
        base, exp = 9, 9 ** 9
        return float(pow(base, exp) % 2)  # ~1.2e9-bit power: minutes inside one C call, GIL held
    return score(sample.response_text, sample.ground_truth["answer"])


def crash(sample):
    if sample.response_text == "exit":
        os._exit(3)
    if sample.response_text == "segv":
        ctypes.string_at(0)
    return 1.0


def unpicklable(sample):
    class Local(float):  # a local class: pickle cannot name it
        pass

    return RewardRecord(total=1.0, components={"x": Local(1.0)}, scorer_version="unpicklable/1")


def memory_hog(sample):
    if sample.response_text == "big":
        return float(len(bytearray(8 << 30)))  # 8 GiB
    return 1.0


def cpu_spin(sample):
    if sample.response_text == "spin":
        while True:
            pass
    return 1.0


def raise_or_hog(sample):
    """Two of the ways a verifier fails at once: ``.../p000``'s raises, ``.../p001``'s holds the GIL
    for minutes (:func:`gil_hog`); the other groups are scored by the arithmetic rule."""
    if sample.group_id.endswith("/p000"):
        raise RuntimeError("verifier crashed (injected by the test)")
    return gil_hog(sample)
