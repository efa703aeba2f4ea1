import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)
os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.fixture(scope="session")
def megatron_world():
    """A world-size-1 megatron parallel state (TP=PP=DP=1) shared by in-process tests."""
    from megarl.runtime import distributed as rt

    rt.initialize(tp=1, pp=1)
    yield
